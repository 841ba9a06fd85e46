"""``autotune launch``: run a torchrun-style script on local ranks or an emulated cluster."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from autotune.cli._base import (
    EXIT_FAILURE,
    EXIT_OK,
    PROG,
    Subparsers,
    UsageError,
    add_command,
    positive_float,
    positive_int,
)
from autotune.emulate import EmulatedCluster, available
from autotune.errors import AutotuneError, ClusterError, RankFailure
from autotune.launch import launch_command, local_placement

# Seconds ranks being ended (a peer failed, Ctrl-C, SIGTERM, the timeout) get between
# SIGTERM, which lets a script's own handler save its work, and SIGKILL.
STOP_GRACE_S = 5.0


def add_launch_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "launch",
        "Run SCRIPT on hosts x nproc-per-node ranks with torchrun's environment (RANK,\n"
        "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT);\n"
        "the script initialises its own process group, as under torchrun, and needs no\n"
        "autotune import. Without --link every rank runs on this machine over loopback\n"
        "(ranks r // nproc-per-node make up host r's group); with --link each host is a\n"
        "network namespace whose NIC is shaped to RATE (needs root and iproute2).\n\n"
        "Everything after SCRIPT goes to the script unchanged, flags that look like\n"
        "autotune's included. Rank 0 writes to this terminal (its stdout to stdout, its\n"
        "stderr to stderr); every other rank's output goes to the file rank<N>.log in\n"
        "--log-dir, which is named on stderr at the start. Ranks get OMP_NUM_THREADS =\n"
        "cores / ranks unless it is set.\n\n"
        "Exit status: 0 when every rank exits 0; else the first failing rank's status\n"
        "(128 + N for a rank killed by signal N), 1 when the job ran past --timeout, 2 for\n"
        "bad input, 130 on Ctrl-C, 143 on SIGTERM. When a rank fails, the others get a few\n"
        "seconds to exit, then are ended (SIGTERM, then SIGKILL), and one line on stderr\n"
        "names the rank and its status. Ctrl-C or SIGTERM ends every rank the same way.\n\n"
        "examples:\n  autotune launch --nproc-per-node 2 train.py --epochs 3\n"
        "  autotune launch --hosts 2 --nproc-per-node 1 --link 100mbit train.py\n"
        "  torchrun --nproc-per-node 2 train.py --epochs 3   # the same script, unchanged",
    )
    # The cluster flags of `autotune profile`, with the same defaults; here --hosts
    # without --link is allowed (hosts on loopback), so the help says so.
    parser.add_argument("--hosts", type=positive_int, default=1, metavar="H",
                        help="hosts; without --link all on this machine over loopback, with "
                             "it one network namespace each")
    parser.add_argument("--nproc-per-node", type=positive_int, default=2, metavar="N",
                        help="ranks per host (as torchrun's flag); ranks = H x N")
    parser.add_argument("--link", default=None, metavar="RATE[:DELAY]",
                        help="shape each host's NIC, e.g. 1gbit, 100mbit or 500mbit:10ms "
                             "(needs --hosts >= 2, root and iproute2); None: no shaping")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                        help="where ranks 1 and up write rank<N>.log (created if missing, "
                             "kept afterwards); None: a new directory in the system's "
                             "temporary directory")
    parser.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                        help="seconds the whole job may take before every rank is ended; "
                             "None: no limit")
    # One REMAINDER positional rather than script + REMAINDER: argparse would drop a
    # "--" right after the script, and everything after it must reach the script as is.
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                        help="the Python script and its arguments")
    parser.set_defaults(func=cmd_launch)
    return parser


class _Terminated(Exception):
    """SIGTERM arrived; raised from its handler so that the job's cleanup runs."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _script_and_args(args: argparse.Namespace) -> tuple[str, list[str]]:
    command = list(args.command)
    if command[:1] == ["--"]:  # `autotune launch -- script.py`: the separator is ours
        command = command[1:]
    if not command:
        raise UsageError("missing the script to run: autotune launch [options] SCRIPT [ARGS ...]")
    script = command[0]
    if not Path(script).is_file():
        raise AutotuneError(f"script {script!r} not found (or not a file)")
    return script, command[1:]


def _placement(args: argparse.Namespace) -> Any:
    """A local placement, or an emulated cluster not yet entered; bad input fails here."""
    if args.link is None:
        return local_placement(args.hosts * args.nproc_per_node, args.nproc_per_node)
    if args.hosts == 1:
        raise ClusterError("--link shapes the links between emulated hosts: give --hosts 2 or more")

    # Building nothing yet, it parses the link (a bad one is a ClusterError).
    cluster = EmulatedCluster(args.hosts, args.link, nproc_per_node=args.nproc_per_node)
    ok, why = available()
    if not ok:
        raise ClusterError(f"--link needs an emulated cluster, which cannot be built here: {why}")
    return cluster


def _log_dir(args: argparse.Namespace) -> Path:
    if args.log_dir is None:
        return Path(tempfile.mkdtemp(prefix="autotune-launch-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args.log_dir


def _rank_env(world: int) -> dict[str, str]:
    import autotune

    env: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1; this machine's share is better
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    # A script that imports autotune finds the one running this, even from a checkout
    # that is not installed; appended, so the user's own PYTHONPATH comes first.
    root = str(Path(autotune.__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, root]))
    return env


def _exit_status(exc: RankFailure) -> int:
    code = exc.returncode
    if code is None or code == 0:
        return EXIT_FAILURE
    return 128 - code if code < 0 else code


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def cmd_launch(args: argparse.Namespace) -> int:
    script, script_args = _script_and_args(args)
    where = _placement(args)
    world = args.hosts * args.nproc_per_node
    log_dir = _log_dir(args)
    net = f"emulated, each NIC at {args.link}" if args.link else "loopback"
    others = "rank 1 logs" if world == 2 else f"ranks 1-{world - 1} log"
    logs = f"; {others} to {log_dir}/rank<N>.log" if world > 1 else ""
    _say(f"launching {script} on {world} rank{'s' if world > 1 else ''} "
         f"({args.hosts} host{'s' if args.hosts > 1 else ''} x {args.nproc_per_node}, {net}){logs}")
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        # An emulated cluster is built here and removed on every way out.
        with where if args.link else contextlib.nullcontext():
            launch_command(
                [sys.executable, "-u", script, *script_args], where, log_dir=log_dir,
                timeout=args.timeout or math.inf, env=_rank_env(world),
                stream_rank0=True, stop_grace_s=STOP_GRACE_S,
            )
    except RankFailure as exc:
        if exc.rank is None:  # the timeout: every rank is named in the message
            _say(f"error: {exc}")
        else:
            log = f" (its output: {log_dir}/rank{exc.rank}.log)" if exc.rank else ""
            _say(f"error: {exc}{log}; the other ranks were ended")
        return _exit_status(exc)
    except _Terminated:
        _say("terminated (SIGTERM); every rank was ended")
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old_term)
    return EXIT_OK
