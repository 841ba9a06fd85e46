"""Gradient compressors: one module per method, one registry, one contract.

>>> from autotune import compressors
>>> c = compressors.create("powersgd", rank=4)
>>> c.wire_bytes((512, 512), world_size=8)
16384
"""

from __future__ import annotations

# Importing a method's module registers it; the order here is the order users see.
from autotune.compressors import none  # noqa: F401  isort: skip
from autotune.compressors import cast  # noqa: F401  isort: skip
from autotune.compressors import powersgd  # noqa: F401  isort: skip
from autotune.compressors import topk  # noqa: F401  isort: skip
from autotune.compressors import int8  # noqa: F401  isort: skip
from autotune.compressors import sign  # noqa: F401  isort: skip
from autotune.compressors import rowsparse  # noqa: F401  isort: skip
from autotune.compressors.base import (
    REGISTRY,
    Compressor,
    CompressorSpec,
    Param,
    create,
    names,
    register,
)
from autotune.compressors.comm import Comm, GroupComm, LocalComm
from autotune.compressors.none import PLAIN

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
