"""``none``: plain averaging allreduce in the gradient's own dtype (what DDP does)."""

from __future__ import annotations

import torch

from autotune.compressors.base import (
    AllreduceCompressor,
    Collective,
    Shape,
    numel,
    register,
)
from autotune.compressors.registry import PLAIN  # re-exported: where it was defined before

__all__ = ["NoCompression", "PLAIN"]


@register
class NoCompression(AllreduceCompressor):
    """Exact: one allreduce of the group's gradients, divided by the world size."""

    name = "none"
    lossy = False

    def encode(self, flat: torch.Tensor, world_size: int) -> torch.Tensor:
        return flat.div_(world_size)

    def decode(self, summed: torch.Tensor, flat: torch.Tensor) -> None:
        if summed.data_ptr() != flat.data_ptr():
            flat.copy_(summed)

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        return {"allreduce": numel(shape) * 4}
