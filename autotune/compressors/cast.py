"""``fp16`` and ``bf16``: allreduce in half precision, as PyTorch's
``fp16_compress_hook`` / ``bf16_compress_hook`` do.

As in PyTorch's hooks, the gradient is cast first and divided by the world size in
half precision, so the sum of W shares stays in fp16's range; an element beyond that
range (65504) becomes inf, exactly as under ``fp16_compress_hook``. Casting first is
half the memory traffic of dividing in fp32 first (one read of the fp32 gradient
instead of two passes). One class, two registered names: they differ only in the dtype.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from autotune.compressors.base import AllreduceCompressor, Collective, Shape, numel, register

__all__ = ["HalfPrecision", "FP16", "BF16"]


class HalfPrecision(AllreduceCompressor):
    """Cast to a 2-byte float, allreduce, cast back. Not error-compensated."""

    dtype: ClassVar[torch.dtype]
    half_precision = True

    def encode(self, flat: torch.Tensor, world_size: int) -> torch.Tensor:
        return flat.to(self.dtype).div_(world_size)

    def decode(self, summed: torch.Tensor, flat: torch.Tensor) -> None:
        flat.copy_(summed)

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        return {"allreduce": numel(shape) * 2}


@register
class FP16(HalfPrecision):
    name = "fp16"
    dtype = torch.float16


@register
class BF16(HalfPrecision):
    name = "bf16"
    dtype = torch.bfloat16
