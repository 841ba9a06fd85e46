"""``autotune profile``: probe the network, compute and codecs of a job; write profile.json."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from autotune.cli._base import (
    EXIT_OK,
    Subparsers,
    add_command,
    console,
    positive_float,
    positive_int,
)
from autotune.cli.tables import print_profile
from autotune.emulate import EmulatedCluster
from autotune.errors import AutotuneError, ClusterError
from autotune.jsonio import check_writable
from autotune.launch import local_placement, under_torchrun
from autotune.links import parse_link
from autotune.probes.run import PHASES, take_profile
from autotune.progress import Bars
from autotune.workloads import resolve_workload


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nproc-per-node``, ``--hosts`` and ``--link``, shared by commands that launch."""
    parser.add_argument("--nproc-per-node", type=positive_int, default=2,
                        help="ranks per host (as torchrun's flag)")
    parser.add_argument("--hosts", type=positive_int, default=1,
                        help="emulated hosts (network namespaces, needs root); ranks = "
                             "hosts x nproc-per-node")
    parser.add_argument("--link", default=None, metavar="RATE[:DELAY]",
                        help="shape each emulated host's NIC, e.g. 1gbit or 100mbit "
                             "(needs --hosts >= 2)")


def add_profile_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "profile",
        "Launch local ranks (or run under torchrun when its environment is set), probe\n"
        "collectives and point-to-point links by message size, per-layer compute and\n"
        "gradient-ready times, and every compressor's cost and error on real gradients;\n"
        "write the profile as JSON and print a summary.\n\n"
        "examples:\n  autotune profile --workload cnn --out profile.json\n"
        "  autotune profile --workload cnn --hosts 2 --nproc-per-node 1 --link 1gbit\n"
        "  torchrun --nproc-per-node 8 -m autotune profile --workload mymod:make --out p.json",
    )
    parser.add_argument("--workload", default="cnn",
                        help="built-in name, path/to/file.py:function or package.module:function "
                             "(a file or module is imported: this runs that file's code, as "
                             "`python file.py` would)")
    add_cluster_arguments(parser)
    parser.add_argument("--budget-s", type=positive_float, default=50.0,
                        help="seconds of probing (network 45%%, compute 30%%, codecs 25%%); "
                             "calibration then measures 8 policies for a few steps each")
    parser.add_argument("--steps", type=positive_int, default=10, help="measured compute steps")
    parser.add_argument("--out", type=Path, default=Path("profile.json"), help="profile file to write")
    parser.set_defaults(func=cmd_profile)
    return parser


@contextlib.contextmanager
def placement(args: argparse.Namespace) -> Iterator[Any]:
    """The ranks' placement ``--hosts``, ``--nproc-per-node`` and ``--link`` describe."""
    with cluster(args.hosts, args.nproc_per_node, args.link) as where:
        yield where


@contextlib.contextmanager
def cluster(hosts: int, nproc_per_node: int, link: str | None) -> Iterator[Any]:
    """Local ranks (``hosts`` 1), or an emulated cluster that is removed afterwards."""
    if hosts == 1:
        if link is not None:
            raise ClusterError("--link shapes the links between emulated hosts: give --hosts 2 or more")
        yield local_placement(nproc_per_node)
        return
    if link is None:
        raise ClusterError(f"--hosts {hosts} needs --link RATE (e.g. --link 1gbit)")

    with EmulatedCluster(hosts, parse_link(link), nproc_per_node=nproc_per_node) as emulated:
        yield emulated


def check_out_path(path: Path, what: str = "output") -> None:
    """Fail before any work if ``what`` cannot be written to ``path`` (missing directory,
    a file where a directory should be, a directory where the file should be, a
    read-only file system or no permission)."""
    check_writable(path, AutotuneError, what)


def probe(workload: str, where: Any, budget_s: float, steps: int, link: str | None) -> Any:
    """:func:`autotune.probes.run.take_profile` with progress bars (on rank 0 only, under
    torchrun, where ``where`` is None); a Profile, or None on the other ranks."""
    if where is None and os.environ.get("RANK", "0") != "0":
        return take_profile(workload, None, budget_s=budget_s, steps=steps, link=link)
    with Bars(console(), PHASES) as bars:
        profile = take_profile(workload, where, budget_s=budget_s, steps=steps, link=link,
                               report=bars.report)
        bars.finish()
    return profile


def cmd_profile(args: argparse.Namespace) -> int:
    check_out_path(args.out, "profile")
    resolve_workload(args.workload)  # a bad spec fails here, before any rank starts
    if under_torchrun():
        profile = probe(args.workload, None, args.budget_s, args.steps, args.link)
    else:
        with placement(args) as where:
            profile = probe(args.workload, where, args.budget_s, args.steps, args.link)
    if profile is None:  # a rank other than 0 under torchrun
        return EXIT_OK
    profile.save(args.out)
    out = console()
    print_profile(out, profile)
    out.print(f"wrote {args.out} (took {profile.env.extra['wall_s']:.0f} s of probing)")
    return EXIT_OK
