"""Fused CPU kernels for the codecs whose torch form is a chain of passes.

``sign``, ``int8`` and ``topk`` need several elementwise operations per element (add
the error feedback, take the magnitude, compare or scale, pack, write back). In eager
torch each is a pass of its own, and with the Python between them these codecs cost
4-20 memcpys of the gradient on a CPU (``bench/codec_throughput.py``). Here each step is
one loop compiled by numba, working through the tensor in chunks that stay in cache, so
that memory is swept about as often as the codec's definition needs (sign: twice, since
its residual needs the whole tensor's scale). The kernels release the GIL: a rank's
communication thread encodes while backward goes on.

They compute what the torch forms compute, from the same inputs (int8's rounding noise,
top-k's sampled threshold) and in the same float32 operations, and decoding sums the
ranks in the same order, so every rank holds the same bits. Two differences from the
torch forms, neither between ranks: ``sign``'s scale, a mean of magnitudes, is summed in
another order (its last bits may differ), and torch may fuse int8's multiply-adds, so a
level that lands within a rounding of a boundary can come out one level apart, and a sum
of three or more ranks' decoded values can differ in its last bit.

Used for CPU tensors when numba can be imported, unless ``AUTOTUNE_KERNELS=torch`` is
set (the torch forms then run; GPUs always take them). numba is imported on first use,
and each kernel compiles on its first call, about 4 s for all of them, then loads from
numba's cache on disk (beside :mod:`~autotune.compressors._numba_kernels`, or in numba's
user cache where that is read-only): 0.65 s for the first, most of it numba's import and
start, 0.02 s for each other; measurement's untimed warm-up steps, and live trials'
settling step, absorb it.

Loops index from 0 over slices: numba wraps negative indices around, and only an index
provably non-negative lets LLVM drop that check and vectorise the loop.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

__all__ = ["addend", "array", "available", "get", "use_for", "warm"]

ENV = "AUTOTUNE_KERNELS"  # "torch": never use these kernels
CHUNK = 4096  # elements per step of a two-step loop (16 KB of fp32: stays in L1)
GATHER_BITS = np.uint64(0x8040201008040201)  # 8 bytes of 0/1 -> their bits, in the top byte


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernels can run: numba imports and ``AUTOTUNE_KERNELS`` allows it."""
    if os.environ.get(ENV, "").strip().lower() == "torch":
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def use_for(t: torch.Tensor) -> bool:
    """Whether ``t``'s codec should take these kernels (a CPU tensor, numba at hand)."""
    return t.device.type == "cpu" and available()


def array(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as a numpy array (no copy); ``t`` must be on the CPU."""
    return t.detach().numpy()


def addend(add: torch.Tensor | None, like: np.ndarray) -> np.ndarray:
    """The error feedback's ``add`` (None: nothing to add) as the kernels take it: fp32,
    contiguous (copied only if it is not), or an empty array of ``like``'s type."""
    if add is None:
        return like[:0]
    return array(add.to(torch.float32, memory_format=torch.contiguous_format))


@lru_cache(maxsize=1)
def get() -> Any:
    """The kernels (a namespace of numba functions, each compiled on its first call)."""
    from autotune.compressors import _numba_kernels as k

    return SimpleNamespace(**{name: getattr(k, name) for name in (
        "sign_encode", "sign_residual", "sign_decode", "int8_encode", "int8_decode",
        "topk_sample_threshold", "topk_select", "topk_trim", "topk_decode")})


def warm() -> float:
    """Run every registered compressor once on a small CPU tensor, so that each kernel
    is compiled into numba's disk cache (about 4 s the first time after an install,
    0.65 s once cached); returns the seconds it took. A benchmark calls it first: a
    cold cache would otherwise be compiled inside its first measured runs (an auto
    search's worker compiling every kernel at the lowest CPU priority did not reply
    within a 200-step run)."""
    import time

    from autotune.compressors.comm import LocalComm
    from autotune.compressors.registry import REGISTRY

    started = time.perf_counter()
    if available():
        gen = torch.Generator().manual_seed(0)
        for name in REGISTRY.names():
            method = REGISTRY.create(name)
            for _ in range(2):  # the second step runs with error feedback's residual
                # large enough for every path: top-k's sampled threshold and its trimming
                method.reduce([torch.randn(512, 512, generator=gen)], ["w"], LocalComm(2))
    return time.perf_counter() - started
