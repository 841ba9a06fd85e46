"""Communicators: the collectives a compressor may use, and a count of what they carried.

GRACE's split: compressors decide *what* travels, a communicator moves it. The runtime
uses :class:`GroupComm` on a real process group; probes and unit tests use
:class:`LocalComm`, a world of one, to time encode+decode and to measure compression error
without any network.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter

import torch
import torch.distributed as dist

__all__ = ["Comm", "GroupComm", "LocalComm"]


class Comm(ABC):
    """Blocking collectives over one group, counting the bytes handed to each kind."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        # bytes this rank handed to each collective kind since creation
        self.sent: Counter[str] = Counter()
        # number of collectives issued, by kind
        self.calls: Counter[str] = Counter()

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        self.sent[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""
        self._count("allreduce", tensor)
        return self._all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked: shape ``(world_size, *tensor.shape)``."""
        self._count("allgather", tensor)
        return self._all_gather(tensor.contiguous())

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


class GroupComm(Comm):
    """Collectives on a ``torch.distributed`` process group (default: the world)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            (self.world_size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device
        )
        dist.all_gather_into_tensor(out, tensor.reshape(-1), group=self.group)
        return out.view(self.world_size, *tensor.shape)


class LocalComm(Comm):
    """A world of one rank: collectives are identities, bytes are still counted."""

    def __init__(self) -> None:
        super().__init__()
        self.rank = 0
        self.world_size = 1

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)
