"""Shared by the benchmarks: where 2 ranks run for a link name."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from autotune.launch import local_placement


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
