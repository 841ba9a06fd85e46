"""Shared fixtures: real multi-process gloo groups through autotune's own launcher."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from autotune.launch import launch


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    """``run_ranks("module:function", nprocs=2, **kwargs)`` -> each rank's JSON result.

    The target runs in fresh processes with a real gloo process group; a hang ends at
    the timeout with every rank killed, so a deadlock fails the test instead of freezing
    the suite.
    """

    def run(target: str, nprocs: int = 2, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        return launch(target, nprocs, kwargs, timeout=timeout, pg_timeout=60.0)

    return run
