"""``none``: plain averaging allreduce in the gradient's own dtype (what DDP does)."""

from __future__ import annotations

from typing import Sequence

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

__all__ = ["NoCompression"]


@register
class NoCompression(Compressor):
    """Exact: one allreduce of the group's gradients, divided by the world size."""

    name = "none"
    collectives: tuple[Collective, ...] = ("allreduce",)
    lossy = False

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        flat = flatten(tensors)
        flat.div_(comm.world_size)
        comm.all_reduce(flat)
        unflatten_into(flat, tensors)

    def wire_messages(self, shape: Shape, world_size: int) -> dict[Collective, int]:
        return {"allreduce": numel(shape) * 4}
