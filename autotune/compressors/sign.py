"""``sign``: one bit per element and one scale per tensor, with error feedback
(EF-SignSGD, Karimireddy et al. 2019).

Each rank sends ``sign(M)`` packed 8 to a byte and ``mean(|M|)`` as the scale, where
``M`` is the gradient plus last step's residual; the decoded average is the mean of the
W ranks' ``scale * sign``. Like top-k, every rank has its own scale, so the payload is
all-gathered: ``ceil(numel / 8) + 4`` bytes per tensor.

The bit sent is M's IEEE sign bit (1 for negative, so -0.0 counts as negative), first
element in the highest bit. Encoding is two passes in chunks that stay in cache: the
first adds the gradient into the residual in place, sums ``|M|`` and packs the sign
bits with integer operations (8 sign bits gathered into a byte by one 64-bit multiply);
the second, once the scale is known, leaves the residual ``M - scale * sign(M)`` in
place. Decoding looks each byte up in a 256 x 8 table of ``+-scale / W`` per rank.
On a CPU the first pass and the decoding each run as one compiled loop
(:mod:`autotune.compressors.kernels`), and the second is deferred
(:meth:`~autotune.compressors.memory.ErrorFeedback.defer`): the next step's first loop
settles each element of the residual just before it adds the gradient in, one sweep of
the memory where two were (anything else that reads the residual settles it first).
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from autotune.compressors import kernels
from autotune.compressors.base import (
    REGISTRY,
    Collective,
    ErrorFeedbackCompressor,
    Shape,
    numel,
    register,
)
from autotune.compressors.comm import Comm

__all__ = ["Sign"]

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
CHUNK = 1 << 18  # elements per step of a pass (1 MB of fp32: stays in cache); a multiple of 8
_SIGN_BIT = -(2**31)  # 0x80000000 as an int32
_ONES = 0x0101010101010101  # the low bit of each of 8 bytes
# times 8 bytes of 0/1 (element i in byte i), it moves element i's bit to bit 63 - i: the
# top byte is then the 8 bits, first element highest (0x8040201008040201 as an int64)
_GATHER_BITS = 0x8040201008040201 - 2**64
_SIGNS: dict[str, torch.Tensor] = {}


def _signs(device: torch.device) -> torch.Tensor:
    """(256, 8): byte -> its 8 signs as +-1.0, highest bit first, bit 1 meaning -1."""
    table = _SIGNS.get(str(device))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(7, -1, -1)) & 1
        table = _SIGNS[str(device)] = (1.0 - 2.0 * bits.float()).to(device)
    return table


def _pack_signs(x: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """``out`` (uint8, ceil(len / 8)) = x's sign bits, 8 to a byte, first element in
    the highest bit; ``scratch``: int32 and uint8 buffers of at least x's length."""
    n = x.numel()
    whole = (n // 8) * 8
    if whole:
        # -1 or 0 per element, as bytes 0xFF / 0x00, then 8 bytes -> 1 byte
        spread = torch.bitwise_right_shift(x[:whole].view(torch.int32), 31, out=scratch[0][:whole])
        as_bytes = scratch[1][:whole].copy_(spread)
        words = as_bytes.view(torch.int64).bitwise_and(_ONES).mul_(_GATHER_BITS)
        out[: whole // 8] = words.bitwise_right_shift_(56)
    if whole < n:
        out[whole // 8] = pack_bits(torch.signbit(x[whole:]))[0]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, first element in the highest bit."""
    n = bits.numel()
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, (-n) % 8))
    return (padded.view(-1, 8) * _WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


@register
class Sign(ErrorFeedbackCompressor):
    """Scaled sign compression; 32x fewer bytes than fp32. Keep error feedback on:
    without it sign compression is biased and may not converge."""

    name = "sign"
    collectives: ClassVar[tuple[Collective, ...]] = ("allgather",)
    params = REGISTRY.params(name)  # error_feedback

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # int32 and uint8 buffers of CHUNK elements per device (not state)
        self._scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        return {"allgather": (numel(shape) + 7) // 8 + 4}

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        device = tensors[0].device
        sizes = [t.numel() for t in tensors]
        nbytes = [(n + 7) // 8 for n in sizes]
        n_packed = sum(nbytes)
        payload = torch.empty(n_packed + 4 * len(tensors), dtype=torch.uint8, device=device)
        scales = torch.empty(len(tensors), dtype=torch.float32, device=device)
        offset = 0
        for i, (t, name, nb) in enumerate(zip(tensors, names, nbytes)):
            scales[i] = self._encode(t, name, payload[offset : offset + nb])
            offset += nb
        payload[n_packed:] = scales.view(torch.uint8)
        gathered = comm.all_gather(payload).contiguous()  # (W, n_packed + 4 * len(tensors))
        world = comm.world_size
        all_scales = gathered[:, n_packed:].clone(memory_format=torch.contiguous_format).view(torch.float32)
        signs = _signs(device)
        offset = 0
        for i, (t, n, nb) in enumerate(zip(tensors, sizes, nbytes)):
            # per rank, byte -> its 8 decoded values, +-scale / W
            tables = signs.unsqueeze(0) * (all_scales[:, i] / world).view(world, 1, 1)
            direct = t.dtype == torch.float32 and t.is_contiguous()
            out = t.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=device)
            if kernels.use_for(out):
                kernels.get().sign_decode(kernels.array(gathered), offset, kernels.array(tables),
                                          kernels.array(out))
                if not direct:
                    t.copy_(out.view_as(t))
                offset += nb
                continue
            whole = (n // 8) * 8
            for start in range(0, whole, CHUNK):
                size = min(CHUNK, whole - start)
                rows = out[start : start + size].view(-1, 8)
                for w in range(world):
                    codes = gathered[w, offset + start // 8 : offset + (start + size) // 8].long()
                    if w == 0:
                        torch.index_select(tables[0], 0, codes, out=rows)
                    else:
                        rows.add_(tables[w].index_select(0, codes))
            if whole < n:  # the last byte, partly filled
                codes = gathered[:, offset + nb - 1].long()
                last = tables[torch.arange(world, device=device), codes]  # (W, 8)
                out[whole:] = last[:, : n - whole].sum(0)
            if not direct:
                t.copy_(out.view_as(t))
            offset += nb

    def _encode(self, t: torch.Tensor, name: str, packed: torch.Tensor) -> torch.Tensor:
        """Pack ``t``'s (plus residual's) sign bits into ``packed``; return the scale
        (0-dim) and leave the new residual in the error feedback."""
        grad = t.detach().reshape(-1)
        n = grad.numel()
        ef = self.memory.enabled
        # last step's residual pass, if deferred: ours to fuse into this step's first
        owed = self.memory.take_deferred(name)
        m, add = self._compensated_flat(name, grad)
        if add is None:  # no residual of this size (a first step): nothing is owed on it
            owed = None
        if kernels.use_for(m) and (owed is None or isinstance(owed, _Settle)):
            return self._encode_fused(name, m, add, owed, packed)
        if owed is not None:
            owed(m)
        scratch = self._scratch.get(str(m.device))
        if scratch is None:
            scratch = (torch.empty(CHUNK, dtype=torch.int32, device=m.device),
                       torch.empty(CHUNK, dtype=torch.uint8, device=m.device))
            self._scratch[str(m.device)] = scratch
        total = torch.zeros((), dtype=torch.float64, device=m.device)
        for start in range(0, n, CHUNK):
            chunk = m[start : start + CHUNK]
            if add is not None:
                chunk.add_(add[start : start + CHUNK])
            bits = scratch[0][: chunk.numel()]
            # |M| summed through the integer view (clearing the sign bit)
            total += torch.bitwise_and(chunk.view(torch.int32), 0x7FFFFFFF, out=bits).view(torch.float32).sum()
            _pack_signs(chunk, scratch, packed[start // 8 : (start + chunk.numel() + 7) // 8])
        scale = (total / max(n, 1)).to(torch.float32)
        if ef:  # the residual: M - scale * sign(M), in place
            scale_bits = int(scale.view(torch.int32))
            for start in range(0, n, CHUNK):
                chunk = m[start : start + CHUNK]
                bits = scratch[0][: chunk.numel()]
                torch.bitwise_and(chunk.view(torch.int32), _SIGN_BIT, out=bits).bitwise_or_(scale_bits)
                chunk.sub_(bits.view(torch.float32))
        return scale

    def _encode_fused(self, name: str, m: torch.Tensor, add: torch.Tensor | None,
                      owed: _Settle | None, packed: torch.Tensor) -> torch.Tensor:
        """:meth:`_encode`'s first pass as a compiled loop (a CPU tensor), settling the
        residual ``owed`` from last step on the way; its second, the residual, deferred
        to the next step's."""
        m_np = kernels.array(m)
        settle = owed.scale if owed is not None else np.float32(0.0)
        total = kernels.get().sign_encode(m_np, kernels.addend(add, m_np), add is not None,
                                          settle, owed is not None, kernels.array(packed))
        scale = torch.tensor(total / max(m.numel(), 1), dtype=torch.float32)
        if self.memory.enabled:
            self.memory.defer(name, _Settle(scale.numpy()[()]))
        return scale


class _Settle:
    """A sign residual's deferred pass: ``M - scale * sign(M)`` in place, M's sign bit
    taken as its sign (the step :meth:`Sign._encode` makes right away off the CPU)."""

    __slots__ = ("scale",)

    def __init__(self, scale: np.float32) -> None:
        self.scale = scale

    def __call__(self, m: torch.Tensor) -> None:
        if kernels.use_for(m) and m.is_contiguous():
            kernels.get().sign_residual(kernels.array(m.view(-1)), self.scale)
        else:
            m.sub_(torch.copysign(torch.tensor(float(self.scale), device=m.device), m))
