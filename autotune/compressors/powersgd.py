"""``powersgd``: rank-r low-rank approximation by one power iteration (Vogels et al. 2019).

Per matrix M (a gradient viewed as ``shape[0] x rest``, plus its error feedback):
``P = M Q``; allreduce P; orthogonalise P; ``Q = M^T P``; allreduce Q; the average is
``P Q^T / W``. Q is kept between steps (warm start), which makes one power iteration per
step enough. Tensors that are not matrices (biases, norms) or too small to gain - where
``rows * cols < min_compression_rate * (rows + cols) * rank``, PyTorch's rule - are
allreduced uncompressed, as PyTorch's ``powerSGD_hook`` does.

Collectives per group: one allreduce of the uncompressed tensors (if any), one of all
the group's Ps, one of all its Qs.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Mapping, Sequence

import torch

from autotune.compressors.base import (
    REGISTRY,
    Collective,
    CompressorSpec,
    ErrorFeedbackCompressor,
    Shape,
    numel,
    register,
)
from autotune.compressors.comm import Comm

__all__ = ["PowerSGD"]


@register
class PowerSGD(ErrorFeedbackCompressor):
    """Low-rank compression with error feedback and warm start.

    Tuning: start from ``rank=1`` and increase by factors of 2 until accuracy matches
    the uncompressed run; wire bytes grow linearly with the rank.
    """

    name = "powersgd"
    collectives: tuple[Collective, ...] = ("allreduce", "allreduce")
    params = REGISTRY.params(name)  # rank, error_feedback, warm_start, min_compression_rate, seed
    needs_matrix = True
    size_param = "rank"
    state_keys = ("memory", "q")
    # M is written beside the residual until comm.admit(): with one bucket, ready at the
    # end of backward, the guard's agreement waits out the ranks' skew, and the encoding
    # (M and P = M Q) is done meanwhile instead of after it
    encodes_before_guard = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.q: dict[str, torch.Tensor] = {}  # warm-start Q per parameter name

    def _matrix(self, shape: Shape) -> tuple[int, int, int] | None:
        """(rows, cols, rank) if a tensor of ``shape`` is compressed, else None."""
        if len(shape) < 2:
            return None
        rows = int(shape[0])
        cols = numel(shape) // max(rows, 1)
        rank = min(self.config["rank"], rows, cols)
        if rows * cols < self.config["min_compression_rate"] * (rows + cols) * rank:
            return None
        return rows, cols, rank

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        mat = self._matrix(shape)
        if mat is None:
            return {"allreduce": numel(shape) * 4}
        rows, cols, rank = mat
        return {"allreduce": (rows + cols) * rank * 4}

    def group_messages(
        self, shapes: Sequence[Shape], world_size: int,
        densities: Sequence[float | None] | None = None,
    ) -> list[tuple[Collective, int]]:
        """An allreduce of all the Ps and the tensors sent whole, then one of all the
        Qs (if any matrix is compressed)."""
        plain = p_bytes = q_bytes = 0
        for shape in shapes:
            mat = self._matrix(shape)
            if mat is None:
                plain += self.wire_bytes(shape, world_size)
            else:
                rows, cols, rank = mat
                p_bytes += rows * rank * 4
                q_bytes += cols * rank * 4
        out: list[tuple[Collective, int]] = [("allreduce", plain + p_bytes)]
        return out + [("allreduce", q_bytes)] if p_bytes else out

    @staticmethod
    def codec_features(xp: Any, numel: Any, rows: Any, cols: Any, param: Any) -> list[Any]:
        # two (rows x cols) @ (cols x r) products, QR of (rows x r), r x (rows+cols) copies
        rank = xp.maximum(param, 1.0)
        return [xp.ones_like(numel), numel, numel * rank, (rows + cols) * rank * rank]

    def on_live_rows(self, shape: Shape, live: int, world_size: int) -> CompressorSpec | None:
        # zero rows of M give zero rows of P = MQ, add nothing to Q = M^T P and keep zero
        # residuals: the live rows alone do the same if the choice (compress or not, and
        # the rank) is the same
        live_shape = (live, *shape[1:])
        cols = math.prod(shape[1:])
        rank = self.config["rank"]
        plain = [self.wire_bytes(s, world_size) == 4 * math.prod(s) for s in (shape, live_shape)]
        same_rank = min(rank, shape[0], cols) == min(rank, live, cols)
        return self.spec if plain[0] == plain[1] and same_rank else None

    def _initial_q(self, name: str, cols: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        # Seeded by the parameter's name, so every rank starts from the same Q.
        gen = torch.Generator().manual_seed(self.config["seed"] * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(cols, rank, generator=gen).to(like.device)

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        world = comm.world_size
        # With the runtime's guard pending, M is written beside the residual and adopted
        # once the ranks agree to compress (encodes_before_guard): up to then nothing
        # here is state, so a bucket they agree to average exactly leaves it untouched.
        gate = comm.gate
        aside = gate is not None
        plain: list[torch.Tensor] = []
        mats: list[tuple[torch.Tensor, str, torch.Tensor, torch.Tensor]] = []  # (grad, name, M, Q)
        for t, name in zip(tensors, names):
            mat = self._matrix(t.shape)
            if mat is None:
                plain.append(t)
                continue
            rows, cols, rank = mat
            mats.append((t, name, self._compensated(t, name, rows, cols, aside), torch.empty(0)))
        if plain:
            with comm.phase("flatten"):
                flat = torch.cat([t.reshape(-1).float() for t in plain])
            flat.div_(world)
        for i, (t, name, m, _) in enumerate(mats):
            cols, rank = m.shape[1], min(self.config["rank"], *m.shape)
            q = self.q.get(name) if self.config["warm_start"] else None
            # A step whose M was zero on every rank (a parameter DDP found unused, with
            # no residual yet) leaves Q = M^T P = 0, and from a zero Q every later P and
            # Q would be zero too: start again from the seeded Q instead.
            if q is None or q.shape != (cols, rank) or not bool(q.any()):
                q = self._initial_q(name, cols, rank, m)
            mats[i] = (t, name, m, q)

        # P = M Q and Q = M^T P, each computed as the transpose of the product the other
        # way round (Q^T M^T, P^T M): for these tall-and-thin shapes BLAS is 2-13x faster
        # in that layout (200000 x 64 at rank 4: 12 ms instead of 19, 6 instead of 83).
        ps = [(q.t() @ m.t()).t() for _, _, m, q in mats]
        # the vectors travel with the Ps, in one allreduce
        parts = [p.reshape(-1) for p in ps] + ([flat] if plain else [])
        riding = gate is not None and gate.rides
        if riding:
            # and so do the guard's flags: a non-finite value in M (or in a vector)
            # makes its rows of P non-finite whatever Q is
            bad = ~torch.isfinite(torch.stack([x.sum() for x in parts]).sum())
            parts.append(gate.flags(bad))
        else:
            comm.admit()  # waits for the ranks' agreement, if pending (as below)
        sent = comm.all_reduce(torch.cat(parts))
        if riding:
            comm.admit(sent[-2:])  # raises, state untouched, where the ranks agreed not to compress
        p_flat = sent[: sum(p.numel() for p in ps)]
        if plain:
            flat = sent[p_flat.numel() : p_flat.numel() + flat.numel()]
        if aside and self.config["error_feedback"]:
            for _, name, _, _ in mats:
                self.memory.adopt(name)
        if plain:
            with comm.phase("copy_back"):
                _scatter(flat, plain)
        if not mats:
            return
        # each P and Q its own tensor, not a view at a group-dependent offset: the same
        # arithmetic whatever else shares the bucket (see ErrorFeedback.compensate_into)
        ps = [p.clone() for p in _split(p_flat, [p.shape for p in ps])]
        for p in ps:
            _orthogonalize_(p)
        qs = [(p.t() @ m).t() for (_, _, m, _), p in zip(mats, ps)]
        if self.config["error_feedback"]:
            for (_, _, m, _), p, q in zip(mats, ps, qs):
                # M lies in the residual buffer: what this rank's projection dropped,
                # M - P Q^T, becomes the residual in place
                m.addmm_(p, q.t(), alpha=-1)
        q_flat = comm.all_reduce(torch.cat([q.reshape(-1) for q in qs])).div_(world)
        qs = [q.clone() for q in _split(q_flat, [q.shape for q in qs])]
        for (t, name, _, _), p, q in zip(mats, ps, qs):
            if t.dtype == torch.float32 and t.is_contiguous():
                torch.matmul(p, q.t(), out=t.view(p.shape[0], q.shape[0]))
            else:
                with comm.phase("copy_back"):
                    t.copy_((p @ q.t()).view_as(t))
            if self.config["warm_start"]:
                self.q[name] = q

    def _compensated(self, t: torch.Tensor, name: str, rows: int, cols: int,
                     aside: bool = False) -> torch.Tensor:
        """M = gradient + residual as a (rows, cols) fp32 matrix, in the residual's own
        buffer (no allocation after the first step; ``aside``: in its spare, adopted
        once the guard agrees); without error feedback the gradient itself when it is
        a contiguous fp32 view (the reduction overwrites it anyway), else a copy."""
        grad = t.reshape(rows, cols)
        m = (self.memory.compensate_aside if aside else self.memory.compensate_into)(name, grad)
        if m is not None:
            return m
        if t.dtype == torch.float32 and t.is_contiguous():
            return t.view(rows, cols)
        return t.to(torch.float32).reshape(rows, cols)

    def release(self, name: str) -> torch.Tensor | None:
        self.q.pop(name, None)
        return super().release(name)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "q": {k: v.detach().clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.q = {k: v.detach().clone() for k, v in state.get("q", {}).items()}


def _split(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = numel(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def _scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    for t, part in zip(tensors, _split(flat, [t.shape for t in tensors])):
        t.copy_(part)


def _orthogonalize_(p: torch.Tensor, eps: float = 1e-8) -> None:
    """Orthonormal columns spanning ``p``, in place (P is the same on every rank)."""
    if p.shape[1] == 1:
        p.div_(p.norm().clamp_min(eps))
        return
    q, _ = torch.linalg.qr(p, mode="reduced")
    p.copy_(q)
