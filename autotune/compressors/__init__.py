"""Gradient compressors: one module per method, one registry, one contract.

>>> from autotune import compressors
>>> c = compressors.create("powersgd", rank=4)
>>> c.wire_bytes((512, 512), world_size=8)
16384

Importing this package loads no torch: names and parameter tables (enough to validate a
policy) are in :mod:`~autotune.compressors.registry`; a method's module, and the
torch-side names below, load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autotune.compressors.registry import (
    PLAIN,
    REGISTRY,
    CompressorSpec,
    Param,
    create,
    names,
    register,
)

if TYPE_CHECKING:
    from autotune.compressors.base import Compressor
    from autotune.compressors.comm import Comm, GroupComm, LocalComm

__all__ = [
    "Compressor",
    "CompressorSpec",
    "Param",
    "Comm",
    "GroupComm",
    "LocalComm",
    "PLAIN",
    "REGISTRY",
    "create",
    "names",
    "register",
]

# the names that import torch, and the module each one comes from
_LAZY = {
    "Compressor": "autotune.compressors.base",
    "Comm": "autotune.compressors.comm",
    "GroupComm": "autotune.compressors.comm",
    "LocalComm": "autotune.compressors.comm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
