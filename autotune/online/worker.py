"""The auto mode's search worker: a child process of rank 0 that runs
:func:`autotune.online.search.auto_search` at the lowest CPU priority.

Why a process and not a thread: the search is Python-heavy (Optuna, the cost model),
and a thread would share the GIL with training, whose steps take the GIL many times
(autograd hooks, the communication hook and thread). A niced thread is worse still: the
scheduler parks it while it holds the GIL and training waits on it. An idle-class
process is scheduled only on cores training leaves idle (while it waits on the network),
but it is not free everywhere: on this project's 2-vCPU machine one slowed plain DDP's
CPU-bound steps by 40%, so the controller measures the steps run beside the search and
gives it up when they cost more than any policy could win
(``Controller._search_costs_more``).

Started by the controller when ``wrap(model, "auto")`` is created, so its imports
overlap the first steps; it answers one request and exits. The exchange is JSON lines
on stdin/stdout (the gradients travel as a tensors-only ``torch.save`` file, loaded with
``weights_only=True``; nothing is pickled). A worker that cannot start, fails or dies
is reported as an error, and the controller keeps plain DDP or searches on a thread.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

from autotune.policies import Policy

__all__ = ["SearchWorker"]


class SearchWorker:
    """Rank 0's handle on the worker process: :meth:`submit` one request, :meth:`poll`
    for the reply without blocking."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="autotune-search-"))
        self._stderr = open(self._dir / "stderr.log", "w+b")  # noqa: SIM115 - closed in close()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # this autotune, not another one
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.online.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, env=env, close_fds=True)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="autotune-search-reader",
                                        daemon=True)
        self._reader.start()
        self._deadline: float | None = None
        self._finalizer = weakref.finalize(self, _end, self._proc, self._dir, self._stderr)

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:  # blocking in C: the GIL is free meanwhile
            try:
                self._replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._proc.wait()
        self._replies.put({"exited": self._proc.returncode})

    def submit(self, request: Mapping[str, Any], grads: Mapping[str, Sequence[Any]],
               timeout_s: float) -> None:
        """Send the request; the reply must come within ``timeout_s``."""
        import torch

        path = self._dir / "grads.pt"
        torch.save({name: list(ts) for name, ts in grads.items()}, path)
        line = json.dumps({**request, "grads": str(path)}) + "\n"
        assert self._proc.stdin is not None
        self._proc.stdin.write(line.encode())
        self._proc.stdin.flush()
        self._proc.stdin.close()
        self._deadline = time.monotonic() + timeout_s

    def poll(self) -> dict[str, Any] | None:
        """The reply (``{"error": ...}`` when the worker failed), or None: not yet."""
        try:
            reply = self._replies.get_nowait()
        except queue.Empty:
            if self._deadline is not None and time.monotonic() > self._deadline:
                self.close()
                return {"error": "the search worker did not answer in time"}
            return None
        if "exited" in reply:
            tail = self._stderr_tail()
            return {"error": f"the search worker exited with status {reply['exited']}"
                             + (f": {tail}" if tail else "")}
        return reply

    def _stderr_tail(self) -> str:
        try:
            self._stderr.flush()
            text = (self._dir / "stderr.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return text.splitlines()[-1] if text else ""

    def close(self, wait: bool = True) -> None:
        """End the worker (if it still runs) and remove its files.

        Args:
            wait: wait here for it to exit; else it is killed here and reaped, and its
                files removed, on a thread. Training passes False: an idle-class
                process on busy cores waits to be scheduled even to exit, and a
                search given up on an unshaped link stalled the step that ended it
                by 0.4 s.
        """
        if wait or self._proc.poll() is not None:
            self._finalizer()
            return
        self._proc.kill()
        if self._finalizer.detach() is not None:
            threading.Thread(target=_end, args=(self._proc, self._dir, self._stderr),
                             name="autotune-search-reaper", daemon=True).start()


def _end(proc: subprocess.Popen[bytes], directory: Path, stderr: Any) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    stderr.close()
    for f in directory.glob("*"):
        f.unlink(missing_ok=True)
    directory.rmdir()


def _serve() -> int:
    """The worker's side: the lowest CPU priority, imports first, then one request."""
    try:  # Linux: SCHED_IDLE, below nice 19; a waking training thread preempts it at once
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass
    import torch

    torch.set_num_threads(1)
    from autotune.online.search import auto_search

    line = sys.stdin.readline()
    if not line:  # the parent went away before asking
        return 0
    try:
        request = json.loads(line)
        grads = torch.load(request.pop("grads"), weights_only=True)
        current = Policy.from_dict(request.pop("current"), source="the policy in force")
        reply = auto_search(request.pop("compute"), grads, request.pop("network"), current,
                            **request)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which keeps DDP
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
