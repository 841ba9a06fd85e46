"""``int8``: QSGD-style stochastic quantisation to 8 bits with a scale per block.

Each block of ``block`` elements is scaled by its largest magnitude and every element
is rounded to one of 127 levels per sign at random, up or down with the probabilities
that make the result unbiased (Alistarh et al. 2017). Unbiased, so no error feedback.

Collective: **all_gather**, not allreduce. Ranks quantise with their own scales, and a
sum of int8 codes from W ranks would overflow 8 bits; summing in a wider type would send
as many bytes as fp16 or fp32. So each rank sends ``numel`` int8 codes plus a 4-byte
scale per block, and every rank dequantises and averages the W payloads.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Mapping, Sequence

import torch

from autotune.compressors.base import Collective, Compressor, Param, Shape, numel, register
from autotune.compressors.comm import Comm
from autotune.errors import CompressorError

__all__ = ["Int8"]

LEVELS = 127  # magnitude levels per sign that fit in int8


@register
class Int8(Compressor):
    """Stochastic 8-bit quantisation. Tuning: smaller ``block`` lowers the error (an
    outlier only inflates its own block's scale) at 4 bytes per block."""

    name = "int8"
    collectives: tuple[Collective, ...] = ("allgather",)
    params = {
        "block": Param(int, 1024, low=8, high=2**24, doc="elements sharing one scale"),
        "seed": Param(int, 0, low=0, high=2**31 - 1, doc="seed of the rounding noise (offset by rank)"),
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # reductions done per parameter name: with the seed and rank it fixes the
        # rounding noise, so a resumed or regrouped run draws exactly the same noise
        self.steps: dict[str, int] = {}

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

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        block = self.config["block"]
        codes, scales, layout = [], [], []
        for t, name in zip(tensors, names):
            x = t.detach().reshape(-1).float()
            n = x.numel()
            nb = self._blocks(n)
            padded = torch.nn.functional.pad(x, (0, nb * block - n)).view(nb, block)
            scale = padded.abs().amax(dim=1, keepdim=True)
            level = padded.abs() / scale.clamp_min(torch.finfo(torch.float32).tiny) * LEVELS
            gen = self._generator(name, comm.rank, level.device)
            noise = torch.rand(level.shape, generator=gen, device=level.device)
            q = torch.floor(level + noise).clamp_(max=LEVELS) * torch.sign(padded)
            codes.append(q.view(-1)[:n].to(torch.int8))
            scales.append(scale.view(-1))
            layout.append((n, nb))
        n_codes = sum(c.numel() for c in codes)
        payload = torch.cat([torch.cat(codes), torch.cat(scales).view(torch.int8)])
        gathered = comm.all_gather(payload)  # (W, n_codes + 4 * blocks)
        all_codes = gathered[:, :n_codes].float()
        all_scales = gathered[:, n_codes:].clone(memory_format=torch.contiguous_format).view(torch.float32)
        c_off = s_off = 0
        for t, (n, nb) in zip(tensors, layout):
            c = torch.nn.functional.pad(all_codes[:, c_off : c_off + n], (0, nb * block - n))
            s = all_scales[:, s_off : s_off + nb]
            avg = (c.view(-1, nb, block) * s.unsqueeze(-1)).sum(0).view(-1)[:n]
            t.copy_((avg / (LEVELS * comm.world_size)).view_as(t))
            c_off += n
            s_off += nb

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
