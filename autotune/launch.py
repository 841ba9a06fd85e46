"""Local launcher: run one function (or any command) on N ranks, as torchrun would.

Each rank is a fresh ``python -m autotune.launch`` process that gets torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``...),
initialises the default process group from it, calls the target function and writes its
JSON-serialisable return value to a file. So the code a rank runs is exactly the code it
would run under ``torchrun``, and a rank can be placed in another network namespace by
prefixing its command (see :mod:`autotune.emulate`). :func:`launch_command` runs any
command (a user's torchrun-style script) on the ranks in the same way, and is what
:func:`launch` is built on.

A rank that fails ends the job: the others are given a short grace period (their next
collective fails within milliseconds when a peer's connection resets) and then killed,
and :class:`~autotune.errors.RankFailure` names the rank and the last line it printed.
A rank that stalls (alive but silent) is noticed when its peers' collectives time out
(``pg_timeout``, or ``AUTOTUNE_PG_TIMEOUT`` in the environment): the ranks still running
when the others gave up waiting are named as the stalled ones, and killed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from autotune.errors import AutotuneError, RankFailure, WorkloadError

__all__ = [
    "RankSpec",
    "Placement",
    "launch",
    "launch_command",
    "local_placement",
    "resolve_target",
    "init_from_env",
    "pg_timeout_s",
    "set_rank_threads",
    "under_torchrun",
]

# Seconds a collective may block before gloo gives up; a hung peer is noticed then.
# AUTOTUNE_PG_TIMEOUT in the environment overrides it, for launched ranks and torchrun's.
DEFAULT_PG_TIMEOUT_S = 120.0
PG_TIMEOUT_ENV = "AUTOTUNE_PG_TIMEOUT"
# Seconds the surviving ranks get to notice a failed peer before they are killed.
FAILURE_GRACE_S = 5.0
# How the backends word a collective (or store wait) that gave up on a silent peer:
# gloo "Timed out waiting 5000ms for recv operation", the store "Wait timeout".
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)
# torch's warning and info log lines ("W1202 16:46:03.18 ...", "[W1202 16:46:03.18
# socket.cpp:207] ..."): never the reason a rank failed.
_LOG_NOISE_RE = re.compile(r"\[?[WI]\d{4} \d")
# Prefix torch's excepthook puts on every traceback line of a rank ("[rank0]: ...").
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]:\s*")
# What torch prepends to an error raised in a future's callback.
_CALLBACK_WRAPPER = "Got the following error when running the callback: "


def pg_timeout_s() -> float:
    """Seconds a collective may wait for a peer: ``AUTOTUNE_PG_TIMEOUT`` if set, else
    :data:`DEFAULT_PG_TIMEOUT_S`.

    Raises:
        AutotuneError: the variable is not a positive number of seconds.
    """
    text = os.environ.get(PG_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_PG_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise AutotuneError(
            f"{PG_TIMEOUT_ENV} must be a positive number of seconds, got {text!r}"
        )
    return value


@dataclass(frozen=True)
class RankSpec:
    """Where and how one rank runs."""

    host: int  # index of the (emulated) host the rank runs on
    local_rank: int  # index among the ranks of that host
    prefix: tuple[str, ...] = ()  # command prefix, e.g. ("ip", "netns", "exec", "h0")
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment


class Placement(Protocol):
    """Something that places ranks: :func:`local_placement` or an emulated cluster."""

    master_addr: str

    def ranks(self) -> Sequence[RankSpec]: ...


@dataclass(frozen=True)
class _LocalPlacement:
    nprocs: int
    nproc_per_node: int
    master_addr: str = "127.0.0.1"

    def ranks(self) -> Sequence[RankSpec]:
        n = self.nproc_per_node
        return [RankSpec(host=r // n, local_rank=r % n) for r in range(self.nprocs)]


def local_placement(nprocs: int, nproc_per_node: int | None = None) -> Placement:
    """All ranks on this machine, talking over loopback.

    Args:
        nprocs: number of ranks.
        nproc_per_node: ranks per (pretended) host: rank ``r`` gets ``LOCAL_RANK`` =
            ``r % nproc_per_node`` and ``GROUP_RANK`` = ``r // nproc_per_node``, as on
            that many machines (but every link is loopback); default: one host.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    per_node = nprocs if nproc_per_node is None else nproc_per_node
    if per_node < 1 or nprocs % per_node:
        raise ValueError(f"nproc_per_node must divide nprocs ({nprocs}), got {nproc_per_node}")
    return _LocalPlacement(nprocs, per_node)


def resolve_target(target: str) -> Callable[..., Any]:
    """Import ``package.module:function``."""
    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        raise WorkloadError(f"expected 'module:function', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkloadError(f"cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in func_name.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(f"module {module_name!r} has no attribute {func_name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise WorkloadError(f"{target!r} is not callable")
    return obj


def _target_name(target: str | Callable[..., Any]) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    if module in (None, "__main__"):
        raise ValueError(
            "launch needs a function importable by name (module:function); "
            f"{target!r} lives in __main__"
        )
    return f"{module}:{target.__qualname__}"


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr if addr != "127.0.0.1" else "", 0))
        return int(sock.getsockname()[1])


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits (Linux 5.3+)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class _Rank:
    """One child process and the thread that copies its output to a log; with no log,
    the process writes straight to this process's stdout and stderr."""

    def __init__(
        self, rank: int, cmd: list[str], env: dict[str, str], log: Path | None, echo: bool,
        on_line: Callable[[int, str], bool] | None,
    ):
        self.rank = rank
        self._on_line = on_line
        self.log = log
        piped = log is not None
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.STDOUT if piped else None,
            start_new_session=True,  # so that killing it takes its children too
        )
        self.pidfd = _pidfd(self.proc.pid)
        self._thread: threading.Thread | None = None
        if piped:
            self._thread = threading.Thread(target=self._pump, args=(echo,), daemon=True)
            self._thread.start()

    def _pump(self, echo: bool) -> None:
        assert self.proc.stdout is not None and self.log is not None
        with open(self.log, "wb") as out:
            for line in iter(self.proc.stdout.readline, b""):
                if self._on_line is not None and self._on_line(
                    self.rank, line.decode(errors="replace").rstrip("\n")
                ):
                    continue  # consumed (e.g. a progress report), not logged
                out.write(line)
                out.flush()
                if echo:
                    sys.stderr.write(f"[rank {self.rank}] {line.decode(errors='replace')}")
                    sys.stderr.flush()

    def kill(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def last_line(self) -> str:
        if self._thread is None or self.log is None:
            return ""  # its output went to the terminal, where the reader sees it
        self._thread.join(timeout=2.0)
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        lines = [_RANK_PREFIX_RE.sub("", ln).strip() for ln in text.splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("warnings.warn")
                 and not _LOG_NOISE_RE.match(ln)]
        for ln in reversed(lines):  # prefer the exception line of a traceback
            if ln.split(":", 1)[0].endswith(("Error", "Exception", "Failure", "Interrupt")):
                return ln.replace(_CALLBACK_WRAPPER, "")
        return lines[-1] if lines else ""

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, a debugger), where /proc tells."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[:1] == ["T"]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def launch(
    target: str | Callable[..., Any],
    nprocs: int | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    placement: Placement | None = None,
    timeout: float = 600.0,
    backend: str = "gloo",
    pg_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    echo: bool = False,
    on_line: Callable[[int, str], bool] | None = None,
) -> list[Any]:
    """Run ``target(**kwargs)`` on every rank of a fresh process group.

    Args:
        target: ``"package.module:function"`` or a module-level function.
        nprocs: number of local ranks (ignored when ``placement`` is given).
        kwargs: JSON-serialisable keyword arguments for the target.
        placement: where ranks run; default: ``nprocs`` ranks on this machine.
        timeout: seconds the whole job may take before every rank is killed.
        backend: ``"gloo"`` or ``"nccl"``.
        pg_timeout: seconds a collective may wait for a peer before it fails; a stalled
            rank is noticed (and named) then. Default: :func:`pg_timeout_s`.
        env: extra environment for every rank.
        echo: copy every rank's output to stderr, prefixed with its rank.
        on_line: called with (rank, line) for each line a rank prints; returning True
            consumes the line (it is neither logged nor echoed).

    Returns:
        The target's return value on each rank, in rank order.

    Raises:
        RankFailure: a rank failed, was killed, stalled, or the job ran past ``timeout``.
        AutotuneError: ``AUTOTUNE_PG_TIMEOUT`` is set to something other than seconds.
    """
    if pg_timeout is None:
        pg_timeout = pg_timeout_s()
    if placement is None:
        if nprocs is None:
            raise ValueError("launch needs nprocs or placement")
        placement = local_placement(nprocs)
    name = _target_name(target)

    with tempfile.TemporaryDirectory(prefix="autotune-launch-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / "kwargs.json").write_text(json.dumps(dict(kwargs or {})))
        rank_env = dict(env or {})
        # Ranks must import the same code as this process, wherever it was imported from.
        paths = [p for p in sys.path if p]
        if "" in sys.path or not sys.path:
            paths.insert(0, os.getcwd())
        rank_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        rank_env.update(AUTOTUNE_BACKEND=backend, **{PG_TIMEOUT_ENV: str(pg_timeout)})
        launch_command(
            [sys.executable, "-m", "autotune.launch", "--target", name,
             "--workdir", str(tmpdir)],
            placement, log_dir=tmpdir, timeout=timeout, env=rank_env, echo=echo,
            on_line=on_line,
        )
        world = len(placement.ranks())
        results = []
        for rank in range(world):
            path = tmpdir / f"result{rank}.json"
            if not path.exists():
                raise RankFailure(f"rank {rank} finished without writing a result")
            results.append(json.loads(path.read_text())["value"])
        return results


def launch_command(
    command: Sequence[str],
    placement: Placement,
    *,
    log_dir: Path,
    timeout: float = math.inf,
    env: Mapping[str, str] | None = None,
    stream_rank0: bool = False,
    echo: bool = False,
    on_line: Callable[[int, str], bool] | None = None,
    stop_grace_s: float = 0.0,
) -> None:
    """Run ``command`` once per rank of ``placement``, each with torchrun's environment.

    Every rank's process gets this process's environment, then ``env``, then
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (a port free on the master's host),
    ``PYTHONUNBUFFERED=1`` and ``AUTOTUNE_MACHINE_RANKS`` (the ranks sharing this
    machine: all of them), then the placement's own variables; the command runs behind
    the placement's prefix (e.g. in an emulated host's network namespace). The command
    itself initialises its process group, as under torchrun.

    The job ends when every rank has exited; when one fails, the others get
    :data:`FAILURE_GRACE_S` seconds to notice and exit, then are ended. On any way out
    (success, failure, timeout, an exception such as ``KeyboardInterrupt`` in this
    process) no rank is left running.

    Args:
        command: the argument vector every rank runs, e.g. ``[sys.executable, "train.py"]``.
        placement: where ranks run (:func:`local_placement` or an emulated cluster).
        log_dir: an existing directory; rank ``r``'s output (stdout and stderr) goes to
            ``log_dir/rank<r>.log``.
        timeout: seconds the whole job may take.
        env: extra environment for every rank.
        stream_rank0: rank 0 writes straight to this process's stdout and stderr (live,
            through the same terminal) instead of to its log file.
        echo: copy every logged rank's output to stderr, prefixed with its rank.
        on_line: called with (rank, line) for each line a logged rank prints; returning
            True consumes the line (it is neither logged nor echoed).
        stop_grace_s: ranks being ended get SIGTERM, then SIGKILL once this many
            seconds have passed; 0 sends SIGKILL at once.

    Raises:
        RankFailure: a rank failed (its ``rank`` and ``returncode`` are set), stalled,
            or the job ran past ``timeout``.
    """
    specs = list(placement.ranks())
    world = len(specs)
    per_host: dict[int, int] = {}
    for spec in specs:
        per_host[spec.host] = per_host.get(spec.host, 0) + 1
    # A placement whose master lives in another network namespace picks the port there.
    free_port = getattr(placement, "free_port", None)
    port = free_port() if callable(free_port) else _free_port(placement.master_addr)
    base_env = dict(os.environ)
    base_env.update(env or {})
    ranks: list[_Rank] = []
    try:
        for rank, spec in enumerate(specs):
            rank_env = dict(base_env)
            rank_env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(spec.local_rank),
                LOCAL_WORLD_SIZE=str(per_host[spec.host]),
                GROUP_RANK=str(spec.host),
                MASTER_ADDR=placement.master_addr,
                MASTER_PORT=str(port),
                AUTOTUNE_MACHINE_RANKS=str(world),  # every rank of a launch is here
                PYTHONUNBUFFERED="1",
            )
            rank_env.update(spec.env)
            log = None if stream_rank0 and rank == 0 else log_dir / f"rank{rank}.log"
            ranks.append(_Rank(rank, [*spec.prefix, *command], rank_env, log, echo, on_line))
        _supervise(ranks, timeout)
    finally:
        _end(ranks, stop_grace_s)


def _wait_for_exit(ranks: list[_Rank], seconds: float) -> None:
    """Sleep until a running rank exits or ``seconds`` pass.

    With pidfds the wake-up comes within microseconds of an exit, so the ranks one sweep
    finds exited did exit together, and the first failure seen is the first that
    happened (the failing rank, not the peer whose collective then broke). Without
    them, a short sleep keeps that order likely.
    """
    running = [r for r in ranks if r.proc.returncode is None]
    fds = [r.pidfd for r in running if r.pidfd is not None]
    if running and len(fds) == len(running):
        select.select(fds, [], [], min(max(seconds, 0.0), 1.0))
    else:
        time.sleep(min(max(seconds, 0.0), 0.02))


def _end(ranks: list[_Rank], grace_s: float) -> None:
    """End every rank still running (SIGTERM first when ``grace_s`` > 0), and reap it."""
    try:
        if grace_s > 0 and any(r.proc.poll() is None for r in ranks):
            for r in ranks:
                r.kill(signal.SIGTERM)
            until = time.monotonic() + grace_s
            while any(r.proc.poll() is None for r in ranks) and time.monotonic() < until:
                _wait_for_exit(ranks, until - time.monotonic())
    finally:  # a second Ctrl-C during the grace period still kills every rank
        for r in ranks:
            r.kill(signal.SIGKILL)
        for r in ranks:
            with contextlib.suppress(Exception):
                r.proc.wait(timeout=5)
            r.close()


def _supervise(ranks: list[_Rank], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    failed: list[_Rank] = []  # ranks that exited non-zero, in the order seen
    grace_end = math.inf
    while True:
        codes = [r.proc.poll() for r in ranks]
        failed += [r for r, c in zip(ranks, codes) if c not in (None, 0) and r not in failed]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if failed and grace_end == math.inf:
            grace_end = now + FAILURE_GRACE_S
        if now > grace_end:
            break
        if now > deadline:
            running = [r.rank for r, c in zip(ranks, codes) if c is None]
            raise RankFailure(
                f"job ran past its {timeout:.0f} s timeout; ranks {running} were still "
                "running and have been killed"
            )
        _wait_for_exit(ranks, min(grace_end, deadline) - now + 0.001)
    if failed:
        raise _blame(failed, [r for r in ranks if r.proc.poll() is None])


def _blame(failed: list[_Rank], running: list[_Rank]) -> RankFailure:
    """Which rank ended the job, and why, in one line.

    A rank that stalls makes its peers' collectives time out: they exit first, so the
    first exit is a victim. Ranks still running when a peer gave up waiting on them are
    the stalled ones. Otherwise a rank killed by a signal (not by us: we have not killed
    anyone yet) is the cause; else the first rank seen failing.
    """
    lines = {r.rank: r.last_line() for r in failed}
    waited = [r for r in failed if _TIMEOUT_RE.search(lines[r.rank])]
    if running and waited:
        names = ", ".join(str(r.rank) for r in running)
        how = " (stopped by a signal)" if all(r.stopped() for r in running) else ""
        victim = waited[0]
        return RankFailure(
            f"rank{'s' if len(running) > 1 else ''} {names} stalled{how}: still running but "
            f"silent when rank {victim.rank} gave up waiting for {'them' if len(running) > 1 else 'it'}; "
            f"killed. rank {victim.rank}: {lines[victim.rank]}",
            rank=victim.rank, returncode=victim.proc.returncode,
        )
    cause = next((r for r in failed if (r.proc.returncode or 0) < 0), failed[0])
    detail = lines[cause.rank]
    return RankFailure(
        f"rank {cause.rank} {_describe_exit(cause.proc.returncode or 0)}"
        + (f": {detail}" if detail else ""),
        rank=cause.rank, returncode=cause.proc.returncode,
    )


def set_rank_threads(threads: int | None = None) -> int:
    """Give this rank its share of the machine's cores (cores / local ranks), as the
    training job would run; returns the number of intra-op threads set."""
    import torch

    # Ranks sharing this machine: all of a local launch (emulated hosts included), or
    # torchrun's ranks on this node.
    local = int(os.environ.get("AUTOTUNE_MACHINE_RANKS", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    n = threads or max(1, (os.cpu_count() or 1) // max(local, 1))
    torch.set_num_threads(n)
    return n


def under_torchrun() -> bool:
    """True in a process started by torchrun (or anything setting its environment)
    rather than by this module's launcher."""
    return "AUTOTUNE_BACKEND" not in os.environ and all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    )


def init_from_env() -> None:
    """Initialise the default process group from torchrun's environment, if not yet,
    with a finite timeout (:func:`pg_timeout_s`) so that a stalled peer is noticed."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = os.environ.get("AUTOTUNE_BACKEND", "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=pg_timeout_s()))


def _worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.launch")
    parser.add_argument("--target", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    fn = resolve_target(args.target)
    kwargs = json.loads((args.workdir / "kwargs.json").read_text())
    init_from_env()
    value = fn(**kwargs)
    rank = dist.get_rank()
    path = args.workdir / f"result{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"value": value}))
    tmp.replace(path)
    dist.destroy_process_group()
    return 0


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown, once output is flushed.

    The rank's work is done and its result written by now. Tearing torch down after a
    gloo job still aborts now and then ("terminate called without an active exception":
    a C++ thread torch owns is destroyed unjoined during finalisation; about 1 run in 40
    of a 2-rank probe here), which turned finished jobs into failed ones. Skipping the
    teardown is what a process killed right after its last write would do anyway.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_main() -> int:
    """Run the rank; a failure prints its traceback here and exits 1 without teardown,
    which could hang or abort on a process group whose peer is gone."""
    try:
        return _worker_main()
    except SystemExit as exc:  # argparse
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, and the rank exits non-zero
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    _exit_now(_rank_main())
