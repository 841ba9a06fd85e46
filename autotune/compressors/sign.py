"""``sign``: one bit per element and one scale per tensor, with error feedback
(EF-SignSGD, Karimireddy et al. 2019).

Each rank sends ``sign(M)`` packed 8 to a byte and ``mean(|M|)`` as the scale, where
``M`` is the gradient plus last step's residual; the decoded average is the mean of the
W ranks' ``scale * sign``. Like top-k, every rank has its own scale, so the payload is
all-gathered: ``ceil(numel / 8) + 4`` bytes per tensor.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from autotune.compressors.base import Collective, Compressor, Param, Shape, numel, register
from autotune.compressors.comm import Comm
from autotune.compressors.memory import ErrorFeedback
from autotune.errors import CompressorError

__all__ = ["Sign"]

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, first element in the highest bit."""
    n = bits.numel()
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, (-n) % 8))
    return (padded.view(-1, 8) * _WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for the first ``n`` bits (packed may be batched)."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


@register
class Sign(Compressor):
    """Scaled sign compression; 32x fewer bytes than fp32. Keep error feedback on:
    without it sign compression is biased and may not converge."""

    name = "sign"
    collectives: tuple[Collective, ...] = ("allgather",)
    params = {"error_feedback": Param(bool, True, doc="add back what the last step dropped")}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory = ErrorFeedback(self.config["error_feedback"])

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        return {"allgather": (numel(shape) + 7) // 8 + 4}

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        packed, scales, sizes = [], [], []
        for t, name in zip(tensors, names):
            m = self.memory.compensate(name, t).view(-1)
            scale = m.abs().mean()
            positive = m >= 0
            self.memory.update(name, m, torch.where(positive, scale, -scale))
            packed.append(pack_bits(positive))
            scales.append(scale.view(1))
            sizes.append(m.numel())
        n_packed = sum(p.numel() for p in packed)
        payload = torch.cat([torch.cat(packed), torch.cat(scales).view(torch.uint8)])
        gathered = comm.all_gather(payload)  # (W, n_packed + 4 * len(tensors))
        all_scales = gathered[:, n_packed:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # (W, tensors)
        offset = 0
        for i, (t, n) in enumerate(zip(tensors, sizes)):
            nbytes = (n + 7) // 8
            bits = unpack_bits(gathered[:, offset : offset + nbytes], n).float()
            signs = bits.mul_(2).sub_(1)  # (W, n) of +-1
            avg = (signs * all_scales[:, i : i + 1]).sum(0) / comm.world_size
            t.copy_(avg.view_as(t))
            offset += nbytes

    def release(self, name: str) -> torch.Tensor | None:
        return self.memory.pop(name)

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"memory"}
        if unknown:
            raise CompressorError(f"unexpected keys in sign state: {sorted(unknown)}")
        self.memory.load_state_dict(state.get("memory", {}))
