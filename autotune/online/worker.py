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

Two kinds, with one interface (:meth:`submit`, :meth:`poll`, :meth:`boost`,
:meth:`close`):

* :class:`SearchWorker`, a fresh interpreter (``python -m autotune.online.worker``),
  started by the controller before the network probe, so that its imports overlap the
  probe; it answers one request and exits. The exchange is JSON lines on stdin/stdout
  (the gradients travel as a tensors-only ``torch.save`` file, loaded with
  ``weights_only=True``; nothing is pickled). Its imports (torch, scikit-learn) are
  most of its work: about 3 CPU seconds of a 6-second search here.
* :class:`ForkedSearch`, a fork of rank 0 at a step boundary, which has all of that
  loaded and the request and gradients in its memory already: the search is only the
  codec probe and Optuna. Used where a fork is safe (Linux, no CUDA initialised in
  rank 0, :func:`fork_safe`): at a step boundary rank 0's other threads (the
  communication thread, gloo's) hold no lock the child needs, the child closes every
  descriptor it inherited (gloo's sockets among them), runs torch on one thread (as
  DataLoader's forked workers do), dies with its parent, and leaves by ``os._exit``
  (no atexit handler, no buffered output of the training script flushed twice). The
  reply comes back as one JSON line on a pipe.

A worker that cannot start, fails or dies is reported as an error, and the controller
keeps plain DDP or searches on a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from autotune.policies import Policy

__all__ = ["ForkedSearch", "SearchWorker", "fork_safe"]

BOOSTED_NICE = 10  # the worker's niceness once boosted (_Search.boost, both kinds)


class _Search:
    """What both kinds share: the replies read on a thread, the deadline, the boost."""

    pid: int | None = None

    def __init__(self) -> None:
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._deadline: float | None = None

    def _read_lines(self, stream: Any, wait: Callable[[], int]) -> None:
        """Reader thread: each JSON line of ``stream`` is a reply; at its end, the exit
        status (``wait()``) is one too."""
        for line in stream:  # blocking in C: the GIL is free meanwhile
            try:
                self._replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._replies.put({"exited": wait()})

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
        return ""

    def close(self, wait: bool = True) -> None:
        raise NotImplementedError

    def boost(self, nice: int = BOOSTED_NICE) -> bool:
        """Raise the worker from the idle class to the normal one at niceness ``nice``
        (False: not allowed here, or it has ended): for when the steps beside it have
        time to spare (auto's stand-in measured faster than the DDP start), so that
        the search ends sooner. Only the worker's main thread is moved: it does the
        search (one torch thread)."""
        if self.pid is None:
            return False
        try:
            os.setpriority(os.PRIO_PROCESS, self.pid, nice)
            os.sched_setscheduler(self.pid, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):
            return False
        return True


class SearchWorker(_Search):
    """Rank 0's handle on a fresh worker process: :meth:`submit` one request,
    :meth:`poll` for the reply without blocking."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = Path(tempfile.mkdtemp(prefix="autotune-search-"))
        self._stderr = open(self._dir / "stderr.log", "w+b")  # noqa: SIM115 - closed in close()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # this autotune, not another one
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.online.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, env=env, close_fds=True)
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read_lines,
                                        args=(self._proc.stdout, self._proc.wait),
                                        name="autotune-search-reader", daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(self, _end, self._proc, self._dir, self._stderr)

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


def fork_safe() -> bool:
    """Whether this process may fork a :class:`ForkedSearch`: Linux (``os.fork``, and
    the child dies with its parent), and no CUDA context (a forked child cannot use
    it, and the search must not touch the device training runs on)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_initialized()


class ForkedSearch(_Search):
    """Rank 0's handle on a forked search (see the module docstring): :meth:`submit`
    forks; call it at a step boundary, from the thread that runs training."""

    def __init__(self) -> None:
        super().__init__()
        self._exit: int | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def submit(self, request: Mapping[str, Any], grads: Mapping[str, Sequence[Any]],
               timeout_s: float) -> None:
        """Fork; the child answers ``request`` on ``grads`` (raises OSError: no fork)."""
        self.start(lambda: _answer(dict(request), grads, time.perf_counter()), timeout_s)

    def start(self, answer: Callable[[], dict[str, Any]], timeout_s: float) -> None:
        """Fork; the child's reply is what ``answer()`` returns there (JSON-able; it
        runs on this process's memory as of the fork). Raises OSError: no fork."""
        read, write = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # else the child could write them again
            if stream is not None:
                stream.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a threaded process may deadlock the child:
            # it may if the child needs a lock another thread held; at a step boundary
            # none of training's threads holds one the search takes (see the module
            # docstring), and a child that hangs anyway ends as a late reply
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never returns into training
            status = 1
            try:
                os.close(read)
                _child_setup(parent, keep=write)
                with os.fdopen(write, "wb") as out:
                    out.write((json.dumps(answer(), default=str) + "\n").encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        self.pid = pid
        self._deadline = time.monotonic() + timeout_s
        self._reader = threading.Thread(target=self._read_lines,
                                        args=(os.fdopen(read, "rb"), self._wait),
                                        name="autotune-search-reader", daemon=True)
        self._reader.start()

    def _wait(self) -> int:
        """Reader thread: wait for the child to exit, then reap it; until it is reaped
        its pid stays its own, so :meth:`close` can never signal another process."""
        assert self.pid is not None
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            with self._lock:
                _, status = os.waitpid(self.pid, 0)
                self._exit = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped elsewhere (the script ignores SIGCHLD)
            with self._lock:
                self._exit = -1
        return self._exit

    def close(self, wait: bool = True) -> None:
        """Kill the child if it still runs (the reader thread reaps it); ``wait``: until
        it is reaped."""
        with self._lock:
            if self.pid is not None and self._exit is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        if wait and self._reader is not None:
            self._reader.join()


def _child_setup(parent: int, keep: int) -> None:
    """In the forked child: die with the parent, close what it inherited (gloo's
    sockets, the script's files) but stdin/out/err and ``keep``, one torch thread, the
    lowest CPU priority."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    import torch

    torch.set_num_threads(1)
    _lowest_priority()


def _lowest_priority() -> None:
    try:  # Linux: SCHED_IDLE, below nice 19; a waking training thread preempts it at once
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass


def _answer(request: dict[str, Any], grads: Mapping[str, Sequence[Any]],
            started: float, timeline: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Run the search on ``request`` (its ``current``, ``compute`` and ``network``
    taken out, the rest passed on): the reply, with the ``timeline`` (seconds since
    ``started`` that each part ended, and the CPU seconds of this process by then)."""
    from autotune.online.search import auto_search

    timeline = {} if timeline is None else timeline
    try:
        current = Policy.from_dict(request.pop("current"), source="the policy in force")
        reply = auto_search(request.pop("compute"), grads, request.pop("network"), current,
                            **request)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which keeps DDP
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    timeline["replied"] = [round(time.perf_counter() - started, 3), round(time.process_time(), 3)]
    reply["timeline"] = timeline
    return reply


def _end(proc: subprocess.Popen[bytes], directory: Path, stderr: Any) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    stderr.close()
    for f in directory.glob("*"):
        f.unlink(missing_ok=True)
    directory.rmdir()


def _serve() -> int:
    """The worker's side: the lowest CPU priority, imports first, then one request. The
    reply's ``timeline`` says when each part ended (seconds since the worker started
    serving, and its CPU seconds): where a slow search went."""
    started = time.perf_counter()
    timeline: dict[str, list[float]] = {}

    def mark(what: str) -> None:
        timeline[what] = [round(time.perf_counter() - started, 3), round(time.process_time(), 3)]

    _lowest_priority()
    import torch

    torch.set_num_threads(1)
    import autotune.online.search  # noqa: F401 - the imports first: they are most of the work

    mark("imported")
    line = sys.stdin.readline()
    if not line:  # the parent went away before asking
        return 0
    mark("asked")
    try:
        request = json.loads(line)
        grads = torch.load(request.pop("grads"), weights_only=True)
        mark("loaded")
        reply = _answer(request, grads, started, timeline)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which keeps DDP
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
