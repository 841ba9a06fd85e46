"""``topk``: send only the largest-magnitude ``ratio`` of each gradient (with error feedback).

Each rank picks its own coordinates, so payloads cannot be summed elementwise: values
and indices are all-gathered and every rank adds up the W sparse vectors. Values (fp32)
and indices (int32, within the tensor) travel in one int32 buffer, so a group costs a
single all_gather of ``8 k`` bytes per tensor, ``k = ceil(ratio * numel)``: exactly
``k`` entries per tensor on every rank, as an all_gather needs equal sizes.

Selection: a full ``torch.topk`` costs about 60 memcpys of the gradient on a CPU (a
sort's worth of work), so only tensors of fewer than :data:`EXACT_BELOW` elements, or
with ``k < 64``, use it. Larger ones use a sampled threshold, as Deep Gradient
Compression does; the count on the wire is still exactly ``k``, padded where fewer are
sent:

1. a fixed sample of ``s`` elements (runs of :data:`SAMPLE_RUN` consecutive elements,
   one at a random place in each stratum) gives a magnitude threshold ``thr`` from
   ``h = k s / numel``, the number of sampled elements expected at or above the true
   k-th largest. Below it by default: ``s = (numel sqrt(ratio))^(2/3)`` (at least
   :data:`MIN_SAMPLE`, at most ``numel / 8``, a size that balances the sample's cost
   against step 3's) and ``thr`` the magnitude ``h + 3 sqrt(h) + 1`` sampled elements
   reach, about 3 standard deviations below the k-th largest, so that the ``c``
   elements with ``|x| >= thr`` usually number somewhat more than ``k`` (5-50 %).
   Above it where trimming would cost more than a larger sample (``ratio * k`` at
   least :data:`PAD_WORTH`, e.g. ratio 0.1 from 1 M elements): ``s`` at least
   ``PAD_HITS / ratio`` and ``thr`` the magnitude ``h - 2.5 sqrt(h)`` reach, so that
   ``c`` is usually about 5 % under ``k`` (89-99 % of it on Gaussian and skewed
   gradients; on gradients whose rows differ greatly in scale 86-100 %, and up to one
   step in eight over ``k``, trimmed);
2. one pass over the tensor in chunks of :data:`CHUNK` elements, each of which stays in
   cache while it is worked on, adds the error feedback, finds the candidates (each
   group of elements is screened by its largest and smallest value, so that only
   groups that reach ``thr`` are looked at element by element), takes their values,
   zeroes them in the residual and zeroes the chunk of the output;
3. if ``c > k`` the ``c - k`` smallest candidates are dropped (and given back to the
   residual): the result is exactly the k largest, since all of them are candidates.
   If ``c <= k`` the ``c`` largest are sent, and the payload is padded by repeating the
   last entry (decoding adds a rank's repeated index once, so a repeat changes
   nothing): fewer than ``k`` elements count that step, and what was not sent stays
   in the error feedback. With a threshold below the k-th largest this is rare (the
   sample overestimated it: 1 step in 600 with error feedback on skewed random
   gradients, none in 450 steps of larger tensors); above it, it is the rule.

The error feedback is kept in place: the residual buffer holds the compensated
gradient, and the sent entries are zeroed in it, so no full-size temporary is made.
Indices stay in ascending order, so that decoding sweeps the output forwards.

On a CPU, step 2 is one compiled loop over the tensor that writes the candidates straight
into the payload when they are expected to fit, and step 1's sample, step 3 (a radix
selection of the k-th largest magnitude, no sort) and the decoding are compiled too
(:mod:`autotune.compressors.kernels`): the same selection, without ``nonzero``'s cost per
element. The compiled decoder writes every element of the output, so there the
selection pass leaves the output alone instead of zeroing it.
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
# Above it instead (fewer than k sent, no trimming) where trimming ~k candidates costs
# more than the larger sample: when ratio * k reaches PAD_WORTH (the two costs, measured
# on this CPU, meet near 10_000), with a sample of PAD_HITS / ratio elements (at most
# numel / 8), which puts the threshold PAD_SIGMAS * sqrt(PAD_HITS) / PAD_HITS = 5 %
# above the k-th largest in count.
PAD_WORTH = 10_000
PAD_HITS = 2_500
PAD_SIGMAS = 2.5


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
        # derived, not state: sample runs and positions per (numel, device), and scratch
        # buffers per role and device (:meth:`_buffer`); rebuilt identically after a restore
        self._samples: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
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
        # the result is written straight into fp32 contiguous tensors; the torch forms
        # zero them chunk by chunk while encoding (in cache: no later pass over them),
        # the compiled decoder writes every element anyway
        direct = [t.dtype == torch.float32 and t.is_contiguous() for t in tensors]
        for t, name, k, d in zip(tensors, names, ks, direct):
            # this tensor's k values (fp32 bits) and indices, written in place
            self._encode(t, name, zero=d and not kernels.use_for(t),
                         into=(payload[start : start + k].view(torch.float32),
                               payload[total + start : total + start + k]))
            start += k
        gathered = comm.all_gather(payload)  # (W, 2 * total)
        start = 0
        for t, k, d in zip(tensors, ks, direct):
            if kernels.use_for(t):
                out = t.view(-1) if d else torch.empty(t.numel(), dtype=torch.float32)
                kernels.get().topk_decode(kernels.array(out), kernels.array(gathered),
                                          start, total + start, k, comm.world_size)
                if not d:
                    t.copy_(out.view_as(t))
                start += k
                continue
            # the W payloads, averaged: scaled first, on W k values rather than numel
            values = gathered[:, start : start + k].view(torch.float32).div(comm.world_size)
            out = t.view(-1) if d else torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
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

    def _encode(self, t: torch.Tensor, name: str, zero: bool,
                into: tuple[torch.Tensor, torch.Tensor]) -> None:
        """This rank's k (values, ascending indices) of ``t`` into ``into`` (fp32 and
        int32, k each: its slots of the payload); updates the residual and, if
        ``zero``, leaves ``t`` zero (its gradient is consumed on the way)."""
        grad = t.detach().reshape(-1)
        n = grad.numel()
        k = into[1].numel()
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
            _put(into, [(idx, values)])
        else:
            self._threshold_select(m, add, ef, grad if zero else None, into)

    def _pads(self, n: int) -> bool:
        """Whether a tensor of ``n`` elements takes a threshold above its k-th largest
        (fewer than k sent, padded, no trimming) rather than below it (trimmed to k)."""
        ratio = self.config["ratio"]
        return ratio * self.k(n) >= PAD_WORTH and PAD_HITS / ratio <= n / 8

    def _sample(self, n: int, device: torch.device) -> torch.Tensor:
        """Fixed sample positions for tensors of ``n`` elements, on ``device``: runs of
        :data:`SAMPLE_RUN` consecutive elements (a cache line of fp32: scattered single
        elements cost a cache miss each), one run at a random place in each stratum.

        Its size balances its own cost against trimming's: a larger sample gives a
        tighter threshold, so fewer surplus candidates to drop."""
        return self._sample_runs(n, device)[1]

    def _sample_runs(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the runs' starts, on the CPU; every sampled position, on ``device``) of
        :meth:`_sample`."""
        key = (n, str(device))
        cached = self._samples.get(key)
        if cached is None:
            ratio = self.config["ratio"]
            s = min(n // 8, max(MIN_SAMPLE, int((n * math.sqrt(ratio)) ** (2 / 3))))
            if self._pads(n):
                s = max(s, math.ceil(PAD_HITS / ratio))
            runs = max(1, s // SAMPLE_RUN)
            stride = n // runs
            gen = torch.Generator().manual_seed(n)
            starts = torch.arange(runs) * stride + torch.randint(stride - SAMPLE_RUN + 1, (runs,), generator=gen)
            cached = (starts, (starts.unsqueeze(1) + torch.arange(SAMPLE_RUN)).view(-1).to(device))
            self._samples[key] = cached
        return cached

    def _threshold_select(
        self, m: torch.Tensor, add: torch.Tensor | None, ef: bool,
        zero: torch.Tensor | None, into: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """The k largest ``|m + add|`` (fewer, padded, if the sampled threshold was too
        high) into ``into`` (values, ascending indices). Adds ``add`` into ``m``, with
        error feedback zeroes the entries sent in ``m``, and zeroes ``zero`` (if given)
        once each chunk of it is consumed."""
        n = m.numel()
        k = into[1].numel()
        starts, pos = self._sample_runs(n, m.device)
        s = pos.numel()
        hits = k * s / n
        pads = self._pads(n)
        if pads:
            j = max(1, math.floor(hits - PAD_SIGMAS * math.sqrt(hits)))
        else:
            j = min(s, math.ceil(hits + MARGIN_SIGMAS * math.sqrt(hits)) + 1)
        fused = kernels.use_for(m)
        if fused:  # the same magnitudes and j-th largest, without index_select
            m_np = kernels.array(m)
            thr = float(kernels.get().topk_sample_threshold(
                m_np, kernels.addend(add, m_np), add is not None, kernels.array(starts),
                SAMPLE_RUN, j, kernels.array(self._buffer("sample", s))))
        else:
            sample = m.index_select(0, pos)
            if add is not None:
                sample.add_(add.index_select(0, pos))
            thr = float(sample.abs_().topk(j, sorted=False).values.min())
        strict = thr == 0.0  # never pick zeros: a mostly-zero gradient sends its non-zeros
        if fused:
            # padding: the candidates go straight into the payload; else room for twice
            # those the sample expects (j of its s elements)
            self._select_fused(m, add, ef, thr, strict, pads, 2 * math.ceil(j * n / s), into)
            return
        # screen the elements in groups, by their maximum: groups of about 1/8 of the
        # inverse candidate density, so that about one group in ten holds a candidate
        group = 1
        while group < MAX_GROUP and 2 * group * j <= s / 8:
            group *= 2
        scratch = self._buffer("chunk", CHUNK, m.device)
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
            _put(into, [(cand, values)])
            return
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
        _put(into, [(cand.index_select(0, kept), values.index_select(0, kept))])

    def _select_fused(
        self, m: torch.Tensor, add: torch.Tensor | None, ef: bool, thr: float, strict: bool,
        pads: bool, room: int, into: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """:meth:`_threshold_select`'s pass and trimming as compiled loops (a CPU tensor).
        The candidates are found into the payload's slots when ``pads`` (they are
        expected to fit), else into a scratch buffer of ``room``; the kernel stops
        before a chunk that might not fit, and goes on into (another) scratch buffer."""
        kern = kernels.get()
        m_np = kernels.array(m)
        add_np = kernels.addend(add, m_np)
        k, n = into[1].numel(), m.numel()
        room = max(room, 2 * kernels.CHUNK)
        buf = (into[1], into[0]) if pads else self._candidates(room)
        found: list[tuple[torch.Tensor, torch.Tensor]] = []  # (indices, values) in order
        pos = 0
        while pos < n:
            c, pos = kern.topk_select(m_np, add_np, add is not None, ef, np.float32(thr), strict,
                                      pos, kernels.array(buf[0]), kernels.array(buf[1]))
            part = (buf[0][:c], buf[1][:c])
            if pos < n:  # the scratch buffer takes the rest: what it holds is kept apart
                if buf[0] is not into[1]:
                    part = (part[0].clone(), part[1].clone())
                buf = self._candidates(room)
            found.append(part)
        if sum(part[0].numel() for part in found) <= k:
            _put(into, found)
            return
        idx, val = found[0] if len(found) == 1 else (torch.cat([p[0] for p in found]),
                                                     torch.cat([p[1] for p in found]))
        if idx.data_ptr() == into[1].data_ptr():  # trimming writes where it reads
            idx, val = idx.clone(), val.clone()
        kern.topk_trim(m_np, ef, kernels.array(idx), kernels.array(val),
                       kernels.array(into[1]), kernels.array(into[0]))

    def _candidates(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index (int32, as the payload's) and value (fp32) buffers of ``size`` for the
        selection's candidates; what is found in them is taken before the next tensor."""
        have = self._buffer("candidates", 2 * size)
        return have[:size].view(torch.int32), have[size:]

    def _buffer(self, role: str, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``size`` fp32 elements on ``device`` for ``role``, kept between reductions (a
        fresh buffer of MBs page-faults again every step)."""
        key = f"{role}@{device}"
        have = self._scratch.get(key)
        if have is None or have.numel() < size:
            have = self._scratch[key] = torch.empty(size, dtype=torch.float32, device=device)
        return have[:size]


def _put(into: tuple[torch.Tensor, torch.Tensor],
         found: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write a selection of at most k entries, given in parts ((indices, values) each,
    in order), into ``into`` (k values, k indices) one after another (a part found in
    place is left there); fewer than k are padded by repeating the last entry (or 0 at
    index 0 if there is none): decoding adds a rank's repeated index once, so padding
    changes nothing."""
    values, indices = into
    c = 0
    for idx, vals in found:
        size = idx.numel()
        if size and idx.data_ptr() != indices[c:].data_ptr():
            indices[c : c + size] = idx
            values[c : c + size] = vals
        c += size
    if c < indices.numel():
        values[c:] = values[c - 1] if c else 0.0
        indices[c:] = indices[c - 1] if c else 0


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
