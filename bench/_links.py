"""Shared by the benchmarks: where 2 ranks run for a link name, how results are saved,
and the numba kernels made ready before anything is measured."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any, Iterator

from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.launch import local_placement


def warm_kernels() -> None:
    """Compile the codecs' numba kernels into numba's disk cache now, or load them from
    it (:func:`autotune.compressors.kernels.warm`), and say how long that took: a fresh
    clone's cache is cold, and its compilation (about 4 s) would land in the first
    measured runs. A user pays it once per installation."""
    from autotune.compressors import kernels

    print(f"numba kernels ready in {kernels.warm():.1f} s (compiled once per installation, "
          "then loaded from numba's cache)", flush=True)


@contextlib.contextmanager
def two_ranks(link: str) -> Iterator[Any]:
    """``unshaped``: 2 local ranks on loopback; a rate such as ``1gbit``: 2 emulated
    hosts, one rank each, their NICs shaped to it (needs root)."""
    if link == "unshaped":
        yield local_placement(2)
        return
    from autotune.emulate import EmulatedCluster
    from autotune.links import parse_link

    with EmulatedCluster(2, parse_link(link)) as cluster:
        yield cluster


def save_cells(benchmark: str, args: argparse.Namespace, cells: list[dict[str, Any]], started: float) -> None:
    """Write the cells measured so far to ``args.out`` atomically (after every cell, so
    a crash keeps what was measured)."""
    out = {"benchmark": benchmark, "args": vars(args) | {"out": str(args.out)},
           "cells": cells, "wall_s": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(out, indent=1), AutotuneError, "benchmark results")
