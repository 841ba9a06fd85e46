"""The auto mode's search worker processes (online/worker.py), fresh and forked: a
failure is an answer, never a hang, its files go when it ends, and a forked one keeps
nothing of its parent open."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import torch

from autotune.online import worker as worker_module
from autotune.online.worker import ForkedSearch, SearchWorker


def _wait(worker: Any, most_s: float = 120.0) -> dict:
    end = time.monotonic() + most_s
    while time.monotonic() < end:
        reply = worker.poll()
        if reply is not None:
            return reply
        time.sleep(0.05)
    raise AssertionError("the worker neither answered nor failed")


def test_a_bad_request_comes_back_as_one_error_line() -> None:
    worker = SearchWorker()
    directory = worker._dir
    worker.submit({"compute": {}, "network": {}, "current": {"bucket_cap_mb": 25}},
                  {"w": [torch.zeros(3)]}, timeout_s=120)
    reply = _wait(worker)
    assert set(reply) == {"error", "timeline"} and "PolicyError" in reply["error"]
    assert reply["timeline"]["imported"][0] <= reply["timeline"]["replied"][0]
    worker.close()
    assert not directory.exists()


def test_a_worker_that_dies_is_reported_with_its_status() -> None:
    worker = SearchWorker()
    worker._proc.kill()
    reply = _wait(worker)
    assert "exited with status" in reply["error"]
    worker.close()


def test_no_answer_in_time_is_an_error_and_ends_the_worker() -> None:
    worker = SearchWorker()
    worker.submit({"compute": {}, "network": {}, "current": {}}, {}, timeout_s=0.0)
    time.sleep(0.01)
    reply = worker.poll()
    assert reply == {"error": "the search worker did not answer in time"}
    assert worker._proc.poll() is not None


def test_closing_without_waiting_kills_it_at_once_and_reaps_it_on_a_thread() -> None:
    worker = SearchWorker()
    directory, proc = worker._dir, worker._proc
    worker.close(wait=False)
    proc.wait(timeout=30)  # killed: it ends without the request it was waiting for
    assert proc.returncode is not None and proc.returncode < 0
    end = time.monotonic() + 30
    while directory.exists() and time.monotonic() < end:
        time.sleep(0.02)
    assert not directory.exists()


# ------------------------------------------------------------------ forked search
# The child is a fork of this process: a function patched here is what it runs.

def test_a_forked_search_answers_from_its_parents_memory(monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "_answer", lambda request, grads, started: {
        "v": request["v"], "sum": float(grads["w"][0].sum()), "pid": os.getpid()})
    search = ForkedSearch()
    search.submit({"v": 7}, {"w": [torch.arange(4.0)]}, timeout_s=60)
    reply = _wait(search)
    assert reply["v"] == 7 and reply["sum"] == 6.0 and reply["pid"] == search.pid != os.getpid()
    search.close()
    assert search._exit == 0


def test_a_bad_request_to_a_forked_search_comes_back_as_an_error() -> None:
    search = ForkedSearch()
    search.submit({"compute": {}, "network": {}, "current": {"bucket_cap_mb": 25}},
                  {"w": [torch.zeros(3)]}, timeout_s=120)
    reply = _wait(search)
    assert "PolicyError" in reply["error"] and "replied" in reply["timeline"]
    search.close()


def test_a_forked_child_closes_what_it_inherited(monkeypatch) -> None:
    mine, peer = socket.socketpair()
    monkeypatch.setattr(worker_module, "_answer",
                        lambda request, grads, started: time.sleep(30) or {})
    search = ForkedSearch()
    search.submit({}, {}, timeout_s=60)
    try:
        time.sleep(0.5)  # the child is running (asleep) with its copies closed
        mine.close()
        peer.settimeout(10)
        assert peer.recv(1) == b""  # end of stream: no copy of `mine` is open anywhere
    finally:
        search.close()
        peer.close()
    assert search._exit == -9  # killed


@pytest.mark.parametrize("kind", ["dies", "late"])
def test_a_forked_search_that_dies_or_is_late_is_an_error_and_is_reaped(
        monkeypatch, kind: str) -> None:
    def answer(request: dict, grads: dict, started: float) -> dict:
        if kind == "dies":
            os._exit(3)
        time.sleep(30)
        return {}

    monkeypatch.setattr(worker_module, "_answer", answer)
    search = ForkedSearch()
    search.submit({}, {}, timeout_s=120 if kind == "dies" else 0.0)
    time.sleep(0.01)
    reply = _wait(search)
    expected = ("the search worker exited with status 3" if kind == "dies"
                else "the search worker did not answer in time")
    assert reply == {"error": expected}
    search.close()
    assert search._exit == (3 if kind == "dies" else -9)


def test_closing_a_forked_search_without_waiting_kills_it(monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "_answer",
                        lambda request, grads, started: time.sleep(30) or {})
    search = ForkedSearch()
    search.submit({}, {}, timeout_s=60)
    started = time.monotonic()
    search.close(wait=False)
    assert search._reader is not None
    search._reader.join(timeout=30)
    assert search._exit == -9 and time.monotonic() - started < 10
