"""``topk``: send only the largest-magnitude ``ratio`` of each gradient (with error feedback).

Each rank picks its own coordinates, so payloads cannot be summed elementwise: values
and indices are all-gathered and every rank adds up the W sparse vectors. Values (fp32)
and indices (int32, within the tensor) travel in one int32 buffer, so a group costs a
single all_gather of ``8 k`` bytes per tensor, ``k = ceil(ratio * numel)``: exactly
``k`` entries per tensor on every rank, as an all_gather needs equal sizes.

Selection: a full ``torch.topk`` costs about 60 memcpys of the gradient on a CPU (a
sort's worth of work), so only tensors of fewer than :data:`EXACT_BELOW` elements, or
with ``k < 64``, use it. Larger ones use a sampled threshold; the count is then still
exactly ``k`` on the wire, and which elements are sent is approximate only in a rare
case (3. below):

1. a fixed sample of ``s`` elements (runs of :data:`SAMPLE_RUN` consecutive elements,
   one at a random place in each stratum; ``s = (numel sqrt(ratio))^(2/3)``, at least
   :data:`MIN_SAMPLE` and at most ``numel / 8``, a size that balances the sample's cost
   against step 3's) gives a magnitude threshold ``thr`` that ``h + 3 sqrt(h) + 1``
   sampled elements reach, ``h = k s / numel`` the number expected at or above the true
   k-th largest: a threshold about 3 standard deviations below it, so that the ``c``
   elements with ``|x| >= thr`` usually number somewhat more than ``k`` (10-50 %);
2. one pass over the tensor in chunks of :data:`CHUNK` elements, each of which stays in
   cache while it is worked on, adds the error feedback, finds the candidates (each
   group of elements is screened by its largest and smallest value, so that only
   groups that reach ``thr`` are looked at element by element), takes their values,
   zeroes them in the residual and zeroes the chunk of the output;
3. if ``c >= k`` the ``c - k`` smallest candidates are dropped (and given back to the
   residual): the result is exactly the k largest, since all of them are candidates.
   If ``c < k`` (the sample overestimated the threshold: 1 step in 600 with error
   feedback on skewed random gradients, none in 450 steps of larger tensors) the ``c``
   largest are sent, and the payload is padded by repeating the
   last entry (decoding copies a rank's entries into place, so a repeat changes
   nothing): fewer than ``k`` elements count that step, and what was not sent stays
   in the error feedback.

The error feedback is kept in place: the residual buffer holds the compensated
gradient, and the sent entries are zeroed in it, so no full-size temporary is made.
Indices stay in ascending order, so that decoding sweeps the output forwards.

On a CPU, step 2 is one compiled loop over the tensor, and step 3 (a radix selection of
the k-th largest magnitude, no sort) and the decoding are compiled too
(:mod:`autotune.compressors.kernels`): the same selection, without ``nonzero``'s cost per
element.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from autotune.compressors import kernels
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

__all__ = ["TopK"]

EXACT_BELOW = 32_768  # tensors smaller than this use torch.topk (cheap at that size)
CHUNK = 1 << 18  # elements per step of the selection pass (1 MB of fp32)
MIN_SAMPLE = 4096  # smallest threshold sample (when the tensor has 8 times as many)
SAMPLE_RUN = 16  # the sample is taken in runs of this many consecutive elements
MAX_GROUP = 64  # largest group whose maximum screens its elements
MARGIN_SIGMAS = 3.0  # the threshold's margin below the sampled k-th largest, in sigmas


@register
class TopK(ErrorFeedbackCompressor):
    """Top-k sparsification. Tuning: ratios of 0.01-0.1 keep accuracy with error
    feedback; below 0.001 convergence usually slows."""

    name = "topk"
    collectives: ClassVar[tuple[Collective, ...]] = ("allgather",)
    params = REGISTRY.params(name)  # ratio, error_feedback
    size_param = "ratio"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # derived, not state: sample positions per (numel, device), and the selection
        # pass's scratch buffer per device; both rebuilt identically after a restore
        self._samples: dict[tuple[int, str], torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}

    def k(self, n: int) -> int:
        """Elements kept of a tensor with ``n`` elements."""
        # the small epsilon keeps e.g. 0.1 * 30 from rounding up to 4
        return max(1, min(n, math.ceil(self.config["ratio"] * n - 1e-9)))

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        return {"allgather": 8 * self.k(numel(shape))}

    @staticmethod
    def codec_features(xp: Any, numel: Any, rows: Any, cols: Any, param: Any) -> list[Any]:
        # a pass, and the selection of k = ratio * numel entries
        k = xp.maximum(xp.ceil(param * numel), 1.0)
        return [xp.ones_like(numel), numel, k * xp.log2(numel + 2)]

    def on_live_rows(self, shape: Shape, live: int, world_size: int) -> CompressorSpec | None:
        # zeros are never among the largest (or add nothing when they are): the same k
        # on the live rows sends the same entries
        k = self.k(numel(shape))
        ratio = min(1.0, k / numel((live, *shape[1:])))
        return CompressorSpec.from_dict({**self.spec.to_dict(), "ratio": ratio})

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        ks = [self.k(t.numel()) for t in tensors]
        total = sum(ks)
        payload = torch.empty(2 * total, dtype=torch.int32, device=tensors[0].device)
        start = 0
        # the result is written straight into fp32 contiguous tensors, which encode
        # zeroes chunk by chunk while the chunk is in cache (no later pass over them)
        direct = [t.dtype == torch.float32 and t.is_contiguous() for t in tensors]
        for t, name, k, d in zip(tensors, names, ks, direct):
            values, indices = self._encode(t, name, k, zero=d)
            payload[start : start + k] = values.view(torch.int32)
            payload[total + start : total + start + k] = indices
            start += k
        gathered = comm.all_gather(payload)  # (W, 2 * total)
        start = 0
        for t, k, d in zip(tensors, ks, direct):
            # the W payloads, averaged: scaled first, on W k values rather than numel
            values = gathered[:, start : start + k].view(torch.float32).div(comm.world_size)
            out = t.view(-1) if d else torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
            if kernels.use_for(out):
                kernels.get().topk_decode(kernels.array(out),
                                          kernels.array(gathered[:, total + start : total + start + k]),
                                          kernels.array(values))
                if not d:
                    t.copy_(out.view_as(t))
                start += k
                continue
            indices = gathered[:, total + start : total + start + k].long()
            # a rank's indices are distinct, so the first is copied and the others added
            # by gather-add-copy: both several times faster than index_add_ on a CPU,
            # and the same sum in the same order on every rank
            out.index_copy_(0, indices[0], values[0])
            for w in range(1, comm.world_size):
                out.index_copy_(0, indices[w], out.index_select(0, indices[w]).add_(values[w]))
            if not d:
                t.copy_(out.view_as(t))
            start += k

    def _encode(
        self, t: torch.Tensor, name: str, k: int, zero: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``k`` (values, ascending indices) of ``t``; updates the residual
        and, if ``zero``, leaves ``t`` zero (its gradient is consumed on the way)."""
        grad = t.detach().reshape(-1)
        n = grad.numel()
        ef = self.memory.enabled
        # ``add`` is added to ``m`` during the selection pass; without error feedback
        # ``m`` may be t itself, overwritten by the result only after the payload is taken
        m, add = self._compensated_flat(name, grad)

        if n < EXACT_BELOW or k < 64:
            if add is not None:
                m.add_(add)
            idx = m.abs().topk(k, sorted=False).indices.sort().values
            values = m.index_select(0, idx)
            if ef:
                m.index_fill_(0, idx, 0.0)  # the residual: compensated minus what was sent
            if zero:
                t.zero_()
        else:
            idx, values = self._threshold_select(m, add, k, ef, grad if zero else None)
        if idx.numel() < k:
            # padding repeats the last entry (or sends 0 at index 0): decoding copies a
            # rank's entries into place, so a repeated one changes nothing
            pad = k - idx.numel()
            if idx.numel():
                values = torch.cat([values, values[-1:].expand(pad)])
                idx = torch.cat([idx, idx[-1:].expand(pad)])
            else:
                values, idx = values.new_zeros(k), idx.new_zeros(k)
        return values, idx

    def _sample(self, n: int, device: torch.device) -> torch.Tensor:
        """Fixed sample positions for tensors of ``n`` elements: runs of
        :data:`SAMPLE_RUN` consecutive elements (a cache line of fp32: scattered single
        elements cost a cache miss each), one run at a random place in each stratum.

        Its size balances its own cost against trimming's: a larger sample gives a
        tighter threshold, so fewer surplus candidates to drop."""
        ratio = self.config["ratio"]
        s = min(n // 8, max(MIN_SAMPLE, int((n * math.sqrt(ratio)) ** (2 / 3))))
        key = (n, str(device))
        cached = self._samples.get(key)
        if cached is None:
            runs = max(1, s // SAMPLE_RUN)
            stride = n // runs
            gen = torch.Generator().manual_seed(n)
            starts = torch.arange(runs) * stride + torch.randint(stride - SAMPLE_RUN + 1, (runs,), generator=gen)
            cached = (starts.unsqueeze(1) + torch.arange(SAMPLE_RUN)).view(-1).to(device)
            self._samples[key] = cached
        return cached

    def _threshold_select(
        self, m: torch.Tensor, add: torch.Tensor | None, k: int, ef: bool,
        zero: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ascending indices, values) of the k largest ``|m + add|``, fewer if the
        sampled threshold was too high. Adds ``add`` into ``m``, with error feedback
        zeroes the entries returned in ``m``, and zeroes ``zero`` (if given) once each
        chunk of it is consumed."""
        n = m.numel()
        pos = self._sample(n, m.device)
        sample = m.index_select(0, pos)
        if add is not None:
            sample.add_(add.index_select(0, pos))
        sample.abs_()
        s = sample.numel()
        hits = k * s / n
        j = min(s, math.ceil(hits + MARGIN_SIGMAS * math.sqrt(hits)) + 1)
        thr = float(sample.topk(j, sorted=False).values.min())
        strict = thr == 0.0  # never pick zeros: a mostly-zero gradient sends its non-zeros
        if kernels.use_for(m):
            # room for twice the candidates the sample expects (j of its s elements)
            cap = 2 * math.ceil(j * n / s) + 2 * kernels.CHUNK
            return self._select_fused(m, add, k, ef, zero, thr, strict, cap)
        # screen the elements in groups, by their maximum: groups of about 1/8 of the
        # inverse candidate density, so that about one group in ten holds a candidate
        group = 1
        while group < MAX_GROUP and 2 * group * j <= s / 8:
            group *= 2
        scratch = self._scratch.get(str(m.device))
        if scratch is None:
            scratch = self._scratch[str(m.device)] = torch.empty(CHUNK, dtype=torch.float32, device=m.device)
        found, taken = [], []
        for start in range(0, n, CHUNK):
            chunk = m[start : start + CHUNK]
            if add is not None:
                chunk.add_(add[start : start + CHUNK])
            where = _above(chunk, scratch, thr, strict, group)
            # while the chunk is in cache: take the candidates' values, and zero them in
            # the residual (the surplus dropped below is put back)
            taken.append(chunk.index_select(0, where))
            if ef:
                chunk.index_fill_(0, where, 0.0)
            if zero is not None:
                zero[start : start + CHUNK].zero_()
            found.append(where.add_(start))
        cand, values = torch.cat(found), torch.cat(taken)
        extra = cand.numel() - k
        if extra <= 0:
            return cand, values
        # drop the surplus with a mask, which keeps the candidates in ascending order:
        # decoding then sweeps memory forwards (random order costs a cache miss each)
        mags = values.abs()
        if extra < k:  # drop the smallest: cheaper than picking the largest
            drop = mags.topk(extra, largest=False, sorted=False).indices
            keep = torch.ones(cand.numel(), dtype=torch.bool, device=m.device).index_fill_(0, drop, False)
        else:
            keep = torch.zeros(cand.numel(), dtype=torch.bool, device=m.device)
            keep.index_fill_(0, mags.topk(k, sorted=False).indices, True)
            drop = (~keep).nonzero().view(-1)
        if ef:  # the dropped candidates stay owed
            m.index_copy_(0, cand.index_select(0, drop), values.index_select(0, drop))
        kept = keep.nonzero().view(-1)
        return cand.index_select(0, kept), values.index_select(0, kept)

    def _select_fused(
        self, m: torch.Tensor, add: torch.Tensor | None, k: int, ef: bool,
        zero: torch.Tensor | None, thr: float, strict: bool, cap: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_threshold_select`'s pass and trimming as compiled loops (a CPU tensor);
        ``cap``: the candidates to make room for (more take another call of the kernel)."""
        kern = kernels.get()
        m_np = kernels.array(m)
        add_np = kernels.addend(add, m_np)
        zero_np = kernels.array(zero) if zero is not None else m_np[:0]
        # the kernel stops at a full buffer and goes on from there with the next
        idx, val = self._found("candidates", cap)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        pos, n = 0, m.numel()
        while True:
            c, pos = kern.topk_select(m_np, add_np, add is not None, ef, zero_np, zero is not None,
                                      np.float32(thr), strict, pos, kernels.array(idx),
                                      kernels.array(val))
            if pos >= n and not parts:
                cand, values = idx[:c], val[:c]
                break
            parts.append((idx[:c].clone(), val[:c].clone()))
            if pos >= n:
                cand, values = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                break
        if cand.numel() <= k:
            return cand, values
        kept_idx, kept_val = self._found("kept", k + 1)
        kern.topk_trim(m_np, ef, kernels.array(cand), kernels.array(values), k,
                       kernels.array(kept_idx), kernels.array(kept_val))
        return kept_idx[:k], kept_val[:k]

    def _found(self, role: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index (int64) and value (fp32) buffers of ``size`` on the CPU for ``role``, kept
        between reductions (a fresh one of MBs page-faults again every step); what is
        returned in them is copied into the payload before the next tensor is encoded."""
        have = self._scratch.get(role)
        if have is None or have.numel() < 3 * size:
            have = self._scratch[role] = torch.empty(3 * size, dtype=torch.float32)
        return have[: 2 * size].view(torch.int64), have[2 * size : 3 * size]


def _above(x: torch.Tensor, scratch: torch.Tensor, thr: float, strict: bool, group: int) -> torch.Tensor:
    """Positions (int64) in ``x`` with ``|x| >= thr`` (``>`` if strict). Elements are
    screened ``group`` at a time by their group's largest and smallest value (groups
    strided, so both are cheap vectorised reductions; no pass computes ``|x|``), and
    only the groups reaching ``thr`` are looked at element by element."""
    n = x.numel()
    cut = n - n % group if group > 1 else 0
    parts = []
    if cut:
        cols = cut // group
        grid = x[:cut].view(group, cols)
        reach = torch.maximum(grid.amax(0), grid.amin(0).neg_())
        hit_cols = (reach > thr if strict else reach >= thr).nonzero().view(-1)
        sub = grid.index_select(1, hit_cols).abs_()
        rc = (sub > thr if strict else sub >= thr).nonzero()
        parts.append(hit_cols.index_select(0, rc[:, 1]).add_(rc[:, 0], alpha=cols))
    if cut < n:
        rest = torch.abs(x[cut:], out=scratch[: n - cut])
        parts.append((rest > thr if strict else rest >= thr).nonzero().view(-1).add_(cut))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
