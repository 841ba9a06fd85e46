"""``topk``: send only the largest-magnitude ``ratio`` of each gradient (with error feedback).

Each rank picks its own coordinates, so payloads cannot be summed elementwise: values
and indices are all-gathered and every rank adds up the W sparse vectors. Values (fp32)
and indices (int32, offsets within the group) travel in one int32 buffer, so a group
costs a single all_gather of ``8 k`` bytes per tensor, ``k = ceil(ratio * numel)``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from autotune.compressors.base import Collective, Compressor, Param, Shape, numel, register
from autotune.compressors.comm import Comm
from autotune.compressors.memory import ErrorFeedback
from autotune.errors import CompressorError

__all__ = ["TopK"]


@register
class TopK(Compressor):
    """Top-k sparsification. Tuning: ratios of 0.01-0.1 keep accuracy with error
    feedback; below 0.001 convergence usually slows."""

    name = "topk"
    collectives: tuple[Collective, ...] = ("allgather",)
    params = {
        "ratio": Param(float, 0.01, low=0.0, high=1.0, low_open=True, doc="fraction of elements sent"),
        "error_feedback": Param(bool, True, doc="add back what the last step dropped"),
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory = ErrorFeedback(self.config["error_feedback"])

    def k(self, n: int) -> int:
        """Elements kept of a tensor with ``n`` elements."""
        # the small epsilon keeps e.g. 0.1 * 30 from rounding up to 4
        return max(1, min(n, math.ceil(self.config["ratio"] * n - 1e-9)))

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        return {"allgather": 8 * self.k(numel(shape))}

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        values, indices, offset = [], [], 0
        for t, name in zip(tensors, names):
            m = self.memory.compensate(name, t).view(-1)
            idx = m.abs().topk(self.k(m.numel()), sorted=False).indices
            val = m[idx]
            decoded = torch.zeros_like(m)
            decoded[idx] = val
            self.memory.update(name, m, decoded)
            values.append(val)
            indices.append(idx.to(torch.int32) + offset)
            offset += m.numel()
        kept = sum(v.numel() for v in values)
        payload = torch.cat([torch.cat(values).view(torch.int32), torch.cat(indices)])
        gathered = comm.all_gather(payload)  # (W, 2 * kept)
        vals = gathered[:, :kept].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(-1)
        idxs = gathered[:, kept:].reshape(-1).long()
        total = torch.zeros(offset, dtype=torch.float32, device=payload.device)
        total.index_add_(0, idxs, vals)
        total.div_(comm.world_size)
        start = 0
        for t in tensors:
            n = t.numel()
            t.copy_(total[start : start + n].view_as(t))
            start += n

    def release(self, name: str) -> torch.Tensor | None:
        return self.memory.pop(name)

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"memory"}
        if unknown:
            raise CompressorError(f"unexpected keys in topk state: {sorted(unknown)}")
        self.memory.load_state_dict(state.get("memory", {}))
