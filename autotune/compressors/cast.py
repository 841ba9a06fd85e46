"""``fp16`` and ``bf16``: allreduce in half precision, as PyTorch's
``fp16_compress_hook`` / ``bf16_compress_hook`` do.

Gradients are divided by the world size *before* the cast, so the sum cannot overflow
fp16's range. One class, two registered names: the methods differ only in the dtype.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from autotune.compressors.base import (
    Collective,
    Compressor,
    Shape,
    flatten,
    numel,
    register,
    unflatten_into,
)
from autotune.compressors.comm import Comm

__all__ = ["HalfPrecision", "FP16", "BF16"]


class HalfPrecision(Compressor):
    """Cast to a 2-byte float, allreduce, cast back. Not error-compensated."""

    dtype: ClassVar[torch.dtype]
    collectives: tuple[Collective, ...] = ("allreduce",)

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        half = flatten(tensors).div_(comm.world_size).to(self.dtype)
        comm.all_reduce(half)
        unflatten_into(half, tensors)

    def wire_messages(self, shape: Shape, world_size: int) -> dict[Collective, int]:
        return {"allreduce": numel(shape) * 2}


@register
class FP16(HalfPrecision):
    name = "fp16"
    dtype = torch.float16


@register
class BF16(HalfPrecision):
    name = "bf16"
    dtype = torch.bfloat16
