"""One ordered communication thread per rank.

Compressors such as PowerSGD issue several collectives per bucket, each depending on the
last. PyTorch's stock hook chains them through future callbacks, which gloo's worker
threads then run in a different order on each rank: with two or more buckets it
deadlocks or aborts ("Received data size doesn't match expected size"). Here every
bucket's whole reduction runs, in bucket order, on one Python thread per rank, on a
process group of its own; the hook returns a :class:`torch.futures.Future` that this
thread completes. Since DDP hands buckets to the hook in index order on every rank, the
collectives are issued in the same order everywhere.

A job that fails (a peer rank was killed, or stalled past the process group's timeout)
fails its bucket's future with :class:`~autotune.errors.RankFailure`, which DDP raises
from ``backward()`` on this rank, naming the rank and quoting the backend's reason (gloo
names the peer's address). The failure is sticky: the group is unusable after it, so every
later job fails at once with the same error instead of waiting out another timeout.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from typing import Callable

import torch
import torch.distributed as dist

from autotune.errors import RankFailure

__all__ = ["Channel"]

logger = logging.getLogger(__name__)

Job = Callable[[], torch.Tensor]

# How gloo words a peer that died ("Connection closed by peer", "Connection reset by
# peer") or went silent ("Timed out waiting 5000ms for recv operation").
_PEER_LOST = re.compile(r"peer|timed out|timeout", re.IGNORECASE)


class Channel:
    """A FIFO of reduction jobs run by one daemon thread; each job completes a future."""

    def __init__(self, name: str = "autotune-comm") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Job, torch.futures.Future, object] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stream: object = None  # CUDA stream of the thread, created on first CUDA job
        self._failure: RankFailure | None = None  # the first failed job's error, if any

    def submit(self, job: Job, device: torch.device) -> torch.futures.Future:
        """Queue ``job``; the returned future holds its result or, when it failed, an
        error that DDP re-raises (a :class:`RankFailure` naming this rank)."""
        self._ensure_started()
        if device.type == "cuda":
            # The job must see the gradients the backward pass is still writing on the
            # current stream: record where that stream is, the thread waits for it.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            fut: torch.futures.Future = torch.futures.Future(devices=[device])
            self._jobs.put((job, fut, event))
        else:
            fut = torch.futures.Future()
            self._jobs.put((job, fut, None))
        # A Python future's set_exception only stores the exception as its value: DDP's
        # C++ side would then fail with "Unable to cast <exception> to Tensor". A callback
        # that raises marks the chained future failed in C++, with the message intact.
        return fut.then(_value)

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, event = item
            if self._failure is not None:
                fut.set_exception(self._failure)
                continue
            try:
                if event is None:
                    result = job()
                else:
                    self._run_cuda(job, fut, event)
                    continue
            except BaseException as exc:  # noqa: BLE001 - handed to DDP, which re-raises it
                self._failure = self._as_failure(exc)
                logger.debug("%s", self._failure)
                fut.set_exception(self._failure)
                continue
            fut.set_result(result)

    @property
    def failure(self) -> RankFailure | None:
        """The error of the first job that failed (every later job fails with it)."""
        return self._failure

    def _as_failure(self, exc: BaseException) -> RankFailure:
        if isinstance(exc, RankFailure):  # already names the rank and the reason
            return exc
        reason = " ".join(str(exc).split()) or type(exc).__name__
        who = f"rank {dist.get_rank()}" if dist.is_initialized() else self._name
        hint = " (a peer rank was lost or stopped responding)" if _PEER_LOST.search(reason) else ""
        failure = RankFailure(
            f"{who}: the reduction of a gradient bucket failed{hint}, so training cannot "
            f"continue: {reason}"
        )
        failure.__cause__ = exc
        return failure

    def _run_cuda(self, job: Job, fut: torch.futures.Future, event: object) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            stream.wait_event(event)  # type: ignore[attr-defined]
            result = job()
            # A CUDA future records the current stream here; DDP's wait syncs on it.
            fut.set_result(result)

    def close(self) -> None:
        """Stop the thread after the jobs already queued."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10)
            self._thread = None


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()  # re-raises the job's error inside the callback
