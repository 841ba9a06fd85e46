"""``int8``: QSGD-style stochastic quantisation to 8 bits with a scale per block.

Each block of ``block`` elements is scaled by its largest magnitude and every element
is rounded to one of 127 levels per sign at random, up or down with the probabilities
that make the result unbiased (Alistarh et al. 2017). Unbiased, so no error feedback.

Rounding noise: ``floor(y + u)`` with ``u`` uniform in [0, 1) rounds ``y`` up with
probability ``frac(y)``. Drawing ``u`` per element with ``torch.rand`` costs about six
memcpys of the gradient on a CPU, so ``u`` is read instead from a fixed table of
:data:`NOISE_TABLE` values ``(b + 0.5) / 256``, every byte ``b`` equally often (a
seeded shuffle), at a random circular offset drawn per chunk of :data:`CHUNK` elements
from the (seed, rank, step, name) generator. Each element's ``u`` is then uniform over
the 256 values, so the rounding is unbiased to within 1/512 of a level, and independent
between steps and ranks (offsets differ); within a chunk, elements get distinct table
entries. Everything runs chunk by chunk in cache, with no full-size temporary; on a
CPU encoding and decoding are each one compiled loop (:mod:`autotune.compressors.kernels`)
with the same arithmetic, so the same codes and sums.

Collective: **all_gather**, not allreduce. Ranks quantise with their own scales, and a
sum of int8 codes from W ranks would overflow 8 bits; summing in a wider type would send
as many bytes as fp16 or fp32. So each rank sends ``numel`` int8 codes plus a 4-byte
scale per block, and every rank dequantises and averages the W payloads.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch

from autotune.compressors import kernels
from autotune.compressors.base import REGISTRY, Collective, Compressor, Shape, numel, register
from autotune.compressors.comm import Comm
from autotune.errors import CompressorError

__all__ = ["Int8"]

LEVELS = 127  # magnitude levels per sign that fit in int8
CHUNK = 1 << 18  # elements encoded or decoded per step (1 MB of fp32: stays in cache)
NOISE_TABLE = CHUNK  # rounding-noise values in the table (a multiple of 256)


@register
class Int8(Compressor):
    """Stochastic 8-bit quantisation. Tuning: smaller ``block`` lowers the error (an
    outlier only inflates its own block's scale) at 4 bytes per block."""

    name = "int8"
    collectives: ClassVar[tuple[Collective, ...]] = ("allgather",)
    params = REGISTRY.params(name)  # block, seed
    size_param = "block"  # one 4-byte scale per block

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # reductions done per parameter name: with the seed and rank it fixes the
        # rounding noise, so a resumed or regrouped run draws exactly the same noise
        self.steps: dict[str, int] = {}
        # derived, not state: the noise table (twice over, for windows that wrap) and
        # the encoder's scratch buffers, per device
        self._tables: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # the payload, per device

    def _payload(self, size: int, device: torch.device) -> torch.Tensor:
        """The payload buffer, kept between reductions (each ends before the next
        starts: the all_gather returns a copy), grown as needed: on a CPU a fresh one of
        a few MB maps new pages, whose faults cost more than the encoding."""
        buf = self._buffers.get(str(device))
        if buf is None or buf.numel() < size:
            buf = self._buffers[str(device)] = torch.empty(size, dtype=torch.int8, device=device)
        return buf[:size]

    def _blocks(self, n: int) -> int:
        return math.ceil(n / self.config["block"])

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        n = numel(shape)
        return {"allgather": n + 4 * self._blocks(n)}

    def _generator(self, name: str, rank: int, device: torch.device) -> torch.Generator:
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        key = f"{self.config['seed']}/{rank}/{step}/{name}".encode()
        return torch.Generator(device=device).manual_seed(zlib.crc32(key) * 65_537 + step)

    def _table(self, length: int, device: torch.device) -> torch.Tensor:
        """128 + the noise table, twice over: any window of ``length`` starting in the
        first copy is a circular window of the table."""
        size = max(NOISE_TABLE, -(-length // 256) * 256)
        table = self._tables.get(str(device))
        if table is None or table.numel() < 2 * size:
            gen = torch.Generator().manual_seed(self.config["seed"])
            byte = torch.arange(256).repeat(size // 256)[torch.randperm(size, generator=gen)]
            one = (byte.float() + 0.5) / 256 + 128  # +128: values to truncate are positive
            table = self._tables[str(device)] = torch.cat([one, one]).to(device)
        return table

    def _pieces(self, n: int) -> list[tuple[int, int, int]]:
        """(start, blocks, width): the tensor cut into chunks of whole blocks, then the
        last, partial block."""
        block = self.config["block"]
        full = n // block
        per = max(1, CHUNK // block)
        out = [(b * block, min(per, full - b), block) for b in range(0, full, per)]
        if n % block:
            out.append((full * block, 1, n % block))
        return out

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        device = tensors[0].device
        sizes = [t.numel() for t in tensors]
        n_codes = sum(sizes)
        n_blocks = sum(self._blocks(n) for n in sizes)
        payload = self._payload(n_codes + 4 * n_blocks, device)
        scales = torch.empty(n_blocks, dtype=torch.float32, device=device)
        fused = kernels.use_for(payload)
        c_off = s_off = 0
        for t, name, n in zip(tensors, names, sizes):
            nb = self._blocks(n)
            self._encode(t, name, comm.rank, payload[c_off : c_off + n], scales[s_off : s_off + nb],
                         fused)
            c_off += n
            s_off += nb
        if not fused:
            # the codes were written as the low byte of level + 128: flipping the top bit
            # makes them level, as int8 (one pass over bytes instead of one over int32s)
            payload[:n_codes].view(torch.uint8).bitwise_xor_(0x80)
        payload[n_codes:] = scales.view(torch.int8)
        gathered = comm.all_gather(payload).contiguous()  # (W, n_codes + 4 * blocks)
        # scaled once per block: the average is sum_w code_w * scale_w / (LEVELS * W)
        all_scales = gathered[:, n_codes:].clone(memory_format=torch.contiguous_format).view(torch.float32)
        all_scales.div_(LEVELS * comm.world_size)
        c_off = s_off = 0
        for t, n in zip(tensors, sizes):
            direct = t.dtype == torch.float32 and t.is_contiguous()
            out = t.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=device)
            if fused:
                kernels.get().int8_decode(kernels.array(gathered), c_off, kernels.array(all_scales),
                                          s_off, self.config["block"], kernels.array(out))
            else:
                self._decode(gathered, all_scales, c_off, s_off, out)
            if not direct:
                t.copy_(out.view_as(t))
            c_off += n
            s_off += self._blocks(n)

    def _decode(self, gathered: torch.Tensor, all_scales: torch.Tensor, c_off: int, s_off: int,
                out: torch.Tensor) -> None:
        """``out`` = the average of the W ranks' codes at ``c_off`` (scales at ``s_off``),
        chunk by chunk in cache (the torch form of the kernel's decoding)."""
        for start, blocks, width in self._pieces(out.numel()):
            b0 = s_off + start // self.config["block"]
            part = out[start : start + blocks * width].view(blocks, width)
            for w in range(gathered.shape[0]):
                codes = gathered[w, c_off + start : c_off + start + blocks * width].view(blocks, width)
                scale = all_scales[w, b0 : b0 + blocks].unsqueeze(1)
                if w == 0:  # cast, then scale in place: faster than a mixed-type mul
                    part.copy_(codes).mul_(scale)
                else:
                    part.addcmul_(codes, scale)

    def _encode(self, t: torch.Tensor, name: str, rank: int, codes: torch.Tensor,
                scales: torch.Tensor, fused: bool) -> None:
        """Quantise ``t`` into ``codes`` (int8, numel: each the low byte of its level +
        128, which :meth:`reduce` turns into the level; ``fused``: the level itself, by
        the compiled kernel) and ``scales`` (fp32, blocks)."""
        x = t.detach().reshape(-1)
        if x.dtype != torch.float32:
            x = x.float()
        n = x.numel()
        pieces = self._pieces(n)
        longest = max(blocks * width for _, blocks, width in pieces)
        table = self._table(longest, x.device)
        period = table.numel() // 2
        gen = self._generator(name, rank, x.device)
        offsets = torch.randint(period, (len(pieces),), generator=gen, device=x.device).tolist()
        tiny = torch.finfo(torch.float32).tiny
        if fused:
            # per piece: start, blocks, width, noise offset (rows, each contiguous)
            spans = np.array([(start, blocks, width, offset) for (start, blocks, width), offset
                              in zip(pieces, offsets)], dtype=np.int64).T.copy()
            kernels.get().int8_encode(
                kernels.array(x.contiguous()), self.config["block"], kernels.array(table),
                spans[0], spans[1], spans[2], spans[3], np.float32(LEVELS),
                np.float32(tiny), kernels.array(codes.view(torch.uint8)), kernels.array(scales))
            return
        scratch = self._scratch.get(str(x.device))
        if scratch is None or scratch[0].numel() < longest:
            scratch = (torch.empty(longest, dtype=torch.float32, device=x.device),
                       torch.empty(longest, dtype=torch.int32, device=x.device))
            self._scratch[str(x.device)] = scratch
        for (start, blocks, width), offset in zip(pieces, offsets):
            size = blocks * width
            xb = x[start : start + size].view(blocks, width)
            scale = torch.maximum(xb.amax(1), xb.amin(1).neg_())
            scales[start // self.config["block"] :][:blocks] = scale
            # level + 128 + noise, in (1, 256): truncation is then floor(level + u) + 128
            level = torch.addcmul(table[offset : offset + size].view(blocks, width), xb,
                                  LEVELS / scale.clamp_min(tiny).unsqueeze(1),
                                  out=scratch[0][:size].view(blocks, width))
            whole = scratch[1][:size].copy_(level.view(-1))
            codes[start : start + size] = whole  # its low byte: level + 128 (mod 256)

    def release(self, name: str) -> torch.Tensor | None:
        self.steps.pop(name, None)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"steps"}
        if unknown:
            raise CompressorError(f"unexpected keys in int8 state: {sorted(unknown)}")
        self.steps = {str(k): int(v) for k, v in state.get("steps", {}).items()}
