"""Communicators: the collectives a compressor may use, and a count of what they carried.

GRACE's split: compressors decide *what* travels, a communicator moves it. The runtime
uses :class:`GroupComm` on a real process group; probes and unit tests use
:class:`LocalComm`, W simulated ranks that all hold the same tensors, to time
encode+decode and to measure compression error without any network.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

__all__ = ["Comm", "Gate", "GroupComm", "GuardFallback", "LocalComm", "all_gather_flat"]

# Equal-size all-gather into one flat tensor: recent torch names it all_gather_single and
# warns on every call of all_gather_into_tensor, the only name older releases have.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GuardFallback(Exception):
    """Raised by :meth:`Comm.admit` where the ranks agreed not to compress a bucket."""


class Gate(Protocol):
    """The runtime's guard on one bucket, left to its compressor (:meth:`Comm.admit`)."""

    # True: no agreement was issued; the compressor appends flags(bad) to its first
    # allreduce and hands admit() the two summed values (one collective fewer, and no
    # pass over the bucket in the backward pass). False: admit() waits for the agreement.
    rides: bool

    def flags(self, bad: torch.Tensor) -> torch.Tensor:
        """This rank's two fp32 flags (``bad``: a non-finite value in what the compressor
        sends, which holds one wherever its input does; joined), on ``bad``'s device."""

    def decide(self, summed: torch.Tensor | None) -> bool:
        """True where every rank must average the bucket exactly instead."""


class Comm(ABC):
    """Blocking collectives over one group, counting the bytes handed to each kind."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        # bytes this rank handed to each collective kind since creation
        self.sent: Counter[str] = Counter()
        # number of collectives issued, by kind
        self.calls: Counter[str] = Counter()
        # wall seconds spent in collectives, by kind (host time: exact for blocking
        # backends such as gloo; NCCL returns before the GPU finishes)
        self.seconds: Counter[str] = Counter()
        # When a list, every collective and every :meth:`phase` appends
        # ``(name, start, end, nbytes)`` (perf_counter seconds) to it: the runtime sets
        # one per bucket to break the bucket's time down; None (the default) logs nothing.
        self.log: list[tuple[str, float, float, int]] | None = None
        # The runtime's guard for the bucket being reduced, when it is left to the
        # compressor (see :meth:`admit` and :class:`Gate`); None: no guard pending.
        self.gate: Gate | None = None

    def _count(self, kind: str, tensor: torch.Tensor, start: float) -> None:
        end = time.perf_counter()
        nbytes = tensor.numel() * tensor.element_size()
        self.sent[kind] += nbytes
        self.calls[kind] += 1
        self.seconds[kind] += end - start
        if self.log is not None:
            self.log.append((kind, start, end, nbytes))

    def admit(self, summed: torch.Tensor | None = None) -> None:
        """Settle the guard on this bucket, if one is pending (once; later calls return
        at once): wait for the ranks' agreement, or, where the gate rides on the
        compressor's first allreduce (:attr:`Gate.rides`), read it from ``summed``, the
        ranks' :meth:`Gate.flags` summed by that allreduce. A compressor whose
        ``encodes_before_guard`` is set calls this before it changes any state, so that
        its encoding overlaps the agreement (and the ranks' skew it waits out); the
        runtime calls it before any other compressor's reduce.

        Raises:
            GuardFallback: the ranks agreed to average this bucket by plain allreduce
                (a non-finite value or a joined rank); the compressor's state is as it
                was before the call to ``reduce``.
        """
        gate, self.gate = self.gate, None
        if gate is not None and gate.decide(summed):
            raise GuardFallback

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Log the enclosed work as ``name`` (e.g. ``"flatten"``, ``"copy_back"``) when
        :attr:`log` is set; compressors mark their copies in and out with it, so that
        the runtime's breakdown tells copies from encoding."""
        if self.log is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.log.append((name, start, time.perf_counter(), 0))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""
        start = time.perf_counter()
        out = self._all_reduce(tensor)
        self._count("allreduce", tensor, start)
        return out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked: shape ``(world_size, *tensor.shape)``."""
        start = time.perf_counter()
        out = self._all_gather(tensor.contiguous())
        self._count("allgather", tensor, start)
        return out

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
        all_gather_flat(out, tensor.reshape(-1), group=self.group)
        return out.view(self.world_size, *tensor.shape)


class LocalComm(Comm):
    """``world_size`` ranks that all hold the same tensors, simulated in one process.

    ``all_reduce`` multiplies by ``world_size`` in place (the sum of W equal copies) and
    ``all_gather`` returns W copies, so a compressor decodes W payloads, as it would on
    W real ranks, and, its inputs being identical, averages to the single-rank result.
    That makes it the codec probe's stand-in for a cluster: decode time scales with W
    as it really does, and nothing touches a network. Bytes are counted per call as
    :class:`Comm` counts them (what this rank hands in, not what it receives).

    Args:
        world_size: ranks to simulate; 1 (the default) makes collectives identities.

    Raises:
        ValueError: ``world_size`` is not an int >= 1.
    """

    def __init__(self, world_size: int = 1) -> None:
        super().__init__()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalComm's world_size must be an int >= 1, got {world_size!r}")
        self.rank = 0
        self.world_size = world_size

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor.mul_(self.world_size)
        return tensor

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        # A copy, not an expanded view: a real all_gather writes W separate payloads, and
        # a decoder may write into what it received.
        return tensor.unsqueeze(0).repeat(self.world_size, *([1] * tensor.dim()))
