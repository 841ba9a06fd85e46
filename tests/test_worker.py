"""The auto mode's search worker process (online/worker.py): a failure is an answer,
never a hang, and its files go when it ends."""

from __future__ import annotations

import time

import torch

from autotune.online.worker import SearchWorker


def _wait(worker: SearchWorker, most_s: float = 120.0) -> dict:
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
    assert set(reply) == {"error"} and "PolicyError" in reply["error"]
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
