"""``fp16`` and ``bf16``: allreduce in half precision, as PyTorch's
``fp16_compress_hook`` / ``bf16_compress_hook`` do.

As in PyTorch's hooks, the gradient is cast first and divided by the world size in
half precision, so the sum of W shares stays in fp16's range; an element beyond that
range (65504) becomes inf, exactly as under ``fp16_compress_hook``. Casting first is
half the memory traffic of dividing in fp32 first (one read of the fp32 gradient
instead of two passes). One class, two registered names: they differ only in the dtype.

On a CPU the half-precision payload is cast into a buffer kept from an earlier step
(one per payload in flight): a fresh one is a fresh allocation from the C library,
which for a few MB or more maps new pages, and faulting them in costs several times
the cast itself (8 MB: 2.6 ms of faults against a 0.7 ms cast here). CUDA's caching
allocator already reuses its blocks, so on a GPU each payload is allocated as usual.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from autotune.compressors.base import AllreduceCompressor, Collective, Shape, numel, register

__all__ = ["HalfPrecision", "FP16", "BF16"]

MAX_POOLED = 16  # payload sizes whose free buffers are kept (DDP buckets: a handful)


class HalfPrecision(AllreduceCompressor):
    """Cast to a 2-byte float, allreduce, cast back. Not error-compensated."""

    dtype: ClassVar[torch.dtype]
    half_precision = True

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        # CPU payload buffers that no reduction holds, by element count (not state);
        # at most MAX_POOLED sizes are kept, the least recently used dropped first
        self._free: dict[int, list[torch.Tensor]] = {}

    def encode(self, flat: torch.Tensor, world_size: int) -> torch.Tensor:
        if flat.device.type != "cpu":
            return flat.to(self.dtype).div_(world_size)
        free = self._free.get(flat.numel())  # decode() keeps the sizes in recent order
        payload = free.pop() if free else torch.empty(flat.numel(), dtype=self.dtype)
        payload.copy_(flat.view(-1))
        if world_size & (world_size - 1) == 0:  # a power of two: the same, exactly, and faster
            return payload.mul_(1.0 / world_size)
        return payload.div_(world_size)

    def decode(self, summed: torch.Tensor, flat: torch.Tensor) -> None:
        flat.copy_(summed.view_as(flat))
        if summed.device.type == "cpu" and summed.is_contiguous() and summed.dim() == 1:
            # the reduction is over: the payload may carry the next one of its size
            free = self._free.pop(summed.numel(), [])
            free.append(summed)
            self._free[summed.numel()] = free
            while len(self._free) > MAX_POOLED:
                del self._free[next(iter(self._free))]

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
