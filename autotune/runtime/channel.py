"""One ordered communication thread per rank.

Compressors such as PowerSGD issue several collectives per bucket, each depending on the
last. PyTorch's stock hook chains them through future callbacks, which gloo's worker
threads then run in a different order on each rank: with two or more buckets it
deadlocks or aborts ("Received data size doesn't match expected size"). Here every
bucket's whole reduction runs, in bucket order, on one Python thread per rank, on a
process group of its own; the hook returns a :class:`torch.futures.Future` that this
thread completes. Since DDP hands buckets to the hook in index order on every rank, the
collectives are issued in the same order everywhere.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import torch

__all__ = ["Channel"]

logger = logging.getLogger(__name__)

Job = Callable[[], torch.Tensor]


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

    def submit(self, job: Job, device: torch.device) -> torch.futures.Future:
        """Queue ``job``; the returned future holds its result (or its exception)."""
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
        return fut

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
            try:
                if event is None:
                    result = job()
                else:
                    self._run_cuda(job, fut, event)
                    continue
            except BaseException as exc:  # noqa: BLE001 - handed to DDP, which re-raises it
                logger.debug("communication job failed: %s", exc)
                fut.set_exception(exc)
                continue
            fut.set_result(result)

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
