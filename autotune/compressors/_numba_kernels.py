"""The numba kernels of :mod:`autotune.compressors.kernels`, one module-level function
each, compiled on first call and cached on disk beside this module.

Apart from ``kernels`` so that numba is imported only when a kernel is first wanted;
module-level (not closures built by a function) so that numba's cache finds them again in
the next process: a kernel calling another through a closure's cell missed the cache in
every process and compiled again (sign's encoder 1.0 s, int8's 0.3 s at a policy's first
use, a live trial's first step).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros  # LLVM's cttz

from autotune.compressors.kernels import CHUNK, GATHER_BITS

DECODE_BLOCK = 1 << 14  # elements of top-k's output summed at a time (64 KB: in L2)
# 8 bytes of 0/1 -> their bits in the top byte, byte j on bit 56 + j (the reverse of
# GATHER_BITS' order; distinct products, so no carries)
LOW_FIRST_BITS = np.uint64(0x0102040810204080)


def _compiler(**options: Any) -> Any:
    """numba's ``njit`` releasing the GIL, caching its machine code on disk where numba
    finds a writable place (else each process compiles again)."""

    def compile_(func: Any) -> Any:
        try:
            return njit(nogil=True, cache=True, **options)(func)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(nogil=True, **options)(func)

    return compile_


jit = _compiler()
# a sum's terms may be added in any order (lanes of a vector): sign's scale only
jit_sum = _compiler(fastmath={"reassoc"})


@jit  # no fastmath: (m - s) + a in this order, the settled residual plus the gradient
def settled_plus(m: Any, scale: Any, a: Any) -> Any:
    """Sign's residual ``m - scale * sign(m)`` (rounded to fp32, as stored) plus ``a``."""
    return np.float32(m - math.copysign(scale, m)) + a


@jit_sum
def add_abs_sum(m: Any, add: Any, has_add: bool, settle: Any, has_settle: bool) -> float:
    """m += add (if has_add), m first settled into sign's residual ``m - settle *
    sign(m)`` if has_settle (which needs has_add); returns sum |m| in float64."""
    total = 0.0
    if has_settle:
        for i in range(m.size):
            v = settled_plus(m[i], settle, add[i])
            m[i] = v
            total += abs(v)
    elif has_add:
        for i in range(m.size):
            v = m[i] + add[i]
            m[i] = v
            total += abs(v)
    else:
        for i in range(m.size):
            total += abs(m[i])
    return total


@jit
def pack_sign_bits(bits: Any, packed: Any, spread: Any) -> None:
    """packed = the sign bits of ``bits`` (int32 view of fp32; at most CHUNK), 8 to a
    byte, first element highest; a last, partial byte padded with zero bits.
    ``spread``: CHUNK bytes of scratch, one bit per byte (a vectorised loop), whose
    8-byte words one multiplication each gathers into a byte: byte j's bit lands on
    bit 63 - j of the product, with no carries (as :mod:`autotune.compressors.sign`)."""
    for i in range(bits.size):
        spread[i] = (bits[i] >> 31) & 1
    words = spread.view(np.uint64)
    whole = bits.size // 8
    for b in range(whole):
        packed[b] = (words[b] * GATHER_BITS) >> np.uint64(56)
    if whole < packed.size:
        byte = 0
        for j in range(bits.size - 8 * whole):
            byte |= spread[8 * whole + j] << (7 - j)
        packed[whole] = byte


@jit
def sign_encode(m: Any, add: Any, has_add: bool, settle: Any, has_settle: bool, packed: Any) -> float:
    """m += add (if has_add), m first settled as last step's residual (if has_settle:
    ``m - settle * sign(m)``, the pass :func:`sign_residual` would have made); packed =
    m's sign bits; returns sum |m| (float64). Chunk by chunk, each in cache for both
    steps."""
    n = m.size
    bits = m.view(np.int32)
    spread = np.empty(CHUNK, dtype=np.uint8)
    total = 0.0
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        total += add_abs_sum(m[lo:hi], add[lo:hi] if has_add else add, has_add, settle, has_settle)
        pack_sign_bits(bits[lo:hi], packed[lo // 8 : (hi + 7) // 8], spread)
    return total


@jit
def sign_residual(m: Any, scale: Any) -> None:
    """m -= scale * sign(m), the sign being m's sign bit."""
    for i in range(m.size):
        m[i] = m[i] - math.copysign(scale, m[i])


@jit
def sign_decode(gathered: Any, offset: int, tables: Any, out: Any) -> None:
    """out = sum over ranks w of tables[w, byte] for each element's byte of rank w's
    payload (``gathered[w, offset:]``), in rank order.

    The first two ranks' sum is looked up whole: a byte's first 4 values depend on
    its high nibble only, so a table of the 16 x 16 nibble pairs' sums (4 values
    each, the same float32 additions) gives 8 elements from 2 lookups, copied as
    int64 pairs at memcpy speed; each further rank is added in order."""
    n = out.size
    nb = (n + 7) // 8
    whole = n // 8
    world = gathered.shape[0]
    ga = gathered[0, offset : offset + nb]
    gb = gathered[min(1, world - 1), offset : offset + nb]
    pair = np.empty((256, 4), dtype=np.float32)
    for x in range(16):
        for y in range(16):
            for j in range(4):
                if world > 1:
                    pair[16 * x + y, j] = tables[0, 16 * x, j] + tables[1, 16 * y, j]
                else:
                    pair[16 * x + y, j] = tables[0, 16 * x, j]
    words = out[: 8 * whole].view(np.int64)
    pw = pair.view(np.int64)  # (256, 2)
    for b in range(whole):
        a = ga[b]
        c = gb[b] if world > 1 else a
        hi = ((a >> 4) << 4) | (c >> 4)
        lo = ((a & 15) << 4) | (c & 15)
        words[4 * b] = pw[hi, 0]
        words[4 * b + 1] = pw[hi, 1]
        words[4 * b + 2] = pw[lo, 0]
        words[4 * b + 3] = pw[lo, 1]
    if whole < nb:  # the last byte, partly filled
        tail = out[8 * whole :]
        ra = tables[0, ga[whole]]
        rb = tables[min(1, world - 1), gb[whole]]
        for j in range(tail.size):
            tail[j] = ra[j] + rb[j] if world > 1 else ra[j]
    for w in range(2, world):
        gw = gathered[w, offset : offset + nb]
        tw = tables[w]
        for b in range(nb):
            r = tw[gw[b]]
            ob = out[8 * b : min(n, 8 * b + 8)]
            for j in range(ob.size):
                ob[j] = ob[j] + r[j]


@jit
def abs_max_bits(bits: Any) -> Any:
    """max |x| over an int32 view of fp32 ``x``, as bits: with the sign bit cleared,
    fp32 bit patterns order as their values (NaN above inf), and integer maxima
    vectorise where float ones do not."""
    top = np.int32(0)
    for i in range(bits.size):
        a = bits[i] & 0x7FFFFFFF
        top = a if a > top else top
    return top


@jit
def int8_encode(x: Any, block: int, table: Any, starts: Any, counts: Any,
                widths: Any, offsets: Any, levels: Any, tiny: Any,
                codes: Any, scales: Any) -> None:
    """Per block of ``x``: scale = max |x|, and each element's code the low byte of
    trunc(noise + x * levels / scale) (noise + 128 from ``table`` at the piece's
    offset), top bit flipped: the signed level, as int8 bits."""
    bits = x.view(np.int32)
    scale_bits = scales.view(np.int32)
    for p in range(starts.size):
        s0 = starts[p]
        width = widths[p]
        noise = table[offsets[p] :]
        first = s0 // block
        for b in range(counts[p]):
            lo = s0 + b * width
            scale_bits[first + b] = abs_max_bits(bits[lo : lo + width])
            mx = scales[first + b]
            inv = levels / (mx if mx > tiny else tiny)
            xb = x[lo : lo + width]
            cb = codes[lo : lo + width]
            nb = noise[b * width : b * width + width]
            for i in range(width):
                level = nb[i] + xb[i] * inv
                cb[i] = np.uint8((np.int32(level) & 0xFF) ^ 0x80)


@jit
def int8_decode(gathered: Any, c_off: int, scales: Any, s_off: int, block: int,
                out: Any) -> None:
    """out = sum over ranks of code * scale (per block), in rank order. Block by block,
    every rank's codes added while the block of out is in cache: out is swept once,
    not once per rank."""
    n = out.size
    for b in range((n + block - 1) // block):
        lo = b * block
        hi = min(n, lo + block)
        ob = out[lo:hi]
        for w in range(gathered.shape[0]):
            s = scales[w, s_off + b]
            cb = gathered[w, c_off + lo : c_off + hi]
            if w == 0:
                for i in range(cb.size):
                    ob[i] = np.float32(cb[i]) * s
            else:
                for i in range(cb.size):
                    ob[i] = ob[i] + np.float32(cb[i]) * s


@jit
def topk_select(m: Any, add: Any, has_add: bool, ef: bool, thr: Any, strict: bool,
                start: int, idx: Any, val: Any) -> tuple[int, int]:
    """From ``start``: m += add; the elements with |m| >= thr (> if strict) go to
    (idx, val), in ascending order, and with error feedback are zeroed in m. Stops
    before a chunk whose candidates could overflow idx: returns (candidates found,
    where it stopped).

    Per chunk (in cache): a vectorised loop adds and marks the candidates in a byte
    mask; each 64 bytes of it are gathered into a word of bits (8 multiplications),
    and only its set bits are visited, lowest first (a branch per element would
    mispredict at every candidate, and writing every element unkept would cost a
    store per element)."""
    n = m.size
    cap = idx.size
    mask = np.zeros(CHUNK, dtype=np.uint8)
    words = mask.view(np.uint64)
    c = 0
    for lo in range(start, n, CHUNK):
        hi = min(n, lo + CHUNK)
        if cap - c < hi - lo:
            return c, lo
        ms = m[lo:hi]
        size = ms.size
        if has_add:
            adds = add[lo:hi]
            if strict:
                for i in range(size):
                    v = ms[i] + adds[i]
                    ms[i] = v
                    mask[i] = abs(v) > thr
            else:
                for i in range(size):
                    v = ms[i] + adds[i]
                    ms[i] = v
                    mask[i] = abs(v) >= thr
        elif strict:
            for i in range(size):
                mask[i] = abs(ms[i]) > thr
        else:
            for i in range(size):
                mask[i] = abs(ms[i]) >= thr
        blocks = (size + 63) // 64
        mask[size : 64 * blocks] = 0
        for b in range(blocks):
            bits = np.uint64(0)
            for t in range(8):
                bits |= ((words[8 * b + t] * LOW_FIRST_BITS) >> np.uint64(56)) << np.uint64(8 * t)
            while bits:
                at = 64 * b + trailing_zeros(bits)  # the lowest set bit
                idx[c] = lo + at
                val[c] = ms[at]
                if ef:
                    ms[at] = 0.0
                c += 1
                bits &= bits - np.uint64(1)
    return c, n


@jit
def kth_largest_abs_bits(bits: Any, k: int) -> tuple[Any, int, int]:
    """(the k-th largest |x| of fp32 ``x``, given as its int32 view, as bits; how many
    are larger; how many are equal to it): a radix selection over the magnitudes' bit
    patterns (which order as their values), first by their top bits above the
    smallest, spread over 65536 bins (bins crowded by close values would make each
    count wait on the last), then by the remaining low bits of the few in the bin that
    holds the k-th (found by a vectorised mark, then only marked words looked at).
    No sort, no copy."""
    n = bits.size
    least = np.int32(0x7FFFFFFF)
    most = np.int32(0)
    for j in range(n):
        a = bits[j] & 0x7FFFFFFF
        least = a if a < least else least
        most = a if a > most else most
    span = most - least
    shift = 0
    while (span >> shift) >= 65536:
        shift += 1
    hist = np.zeros(65536, dtype=np.int32)
    for j in range(n):
        hist[((bits[j] & 0x7FFFFFFF) - least) >> shift] += 1
    above = 0
    top = span >> shift
    while above + hist[top] < k:
        above += hist[top]
        top -= 1
    base = least + (top << shift)
    if shift == 0:
        return np.int32(base), above, hist[top]
    width = 1 << shift
    hist[:width] = 0
    mark = np.zeros((n + 7) // 8 * 8, dtype=np.uint8)
    for j in range(n):
        mark[j] = ((bits[j] & 0x7FFFFFFF) - least) >> shift == top
    words = mark.view(np.uint64)
    for w in range(words.size):
        if words[w]:
            for j in range(8 * w, 8 * w + 8):
                if mark[j]:
                    hist[(bits[j] & 0x7FFFFFFF) - base] += 1
    low = width - 1
    while above + hist[low] < k:
        above += hist[low]
        low -= 1
    return np.int32(base + low), above, hist[low]


@jit
def topk_sample_threshold(m: Any, add: Any, has_add: bool, starts: Any, run: int, j: int,
                          sample: Any) -> Any:
    """The j-th largest |m + add| (fp32) over runs of ``run`` elements from each of
    ``starts``; ``sample`` (fp32 scratch of ``starts.size * run``) holds the
    magnitudes. Each run is one cache line read whole, where a gather per element
    costs an index each."""
    at = 0
    for r in range(starts.size):
        lo = starts[r]
        if has_add:
            for i in range(run):
                sample[at + i] = abs(m[lo + i] + add[lo + i])
        else:
            for i in range(run):
                sample[at + i] = abs(m[lo + i])
        at += run
    kth = np.empty(1, dtype=np.int32)
    kth[0] = kth_largest_abs_bits(sample.view(np.int32), j)[0]
    return kth.view(np.float32)[0]


@jit
def topk_trim(m: Any, ef: bool, idx: Any, val: Any, out_idx: Any, out_val: Any) -> None:
    """The k = out_idx.size largest |val| of the candidates (idx, val) into (out_idx,
    out_val), in their ascending order; ties at the k-th largest kept first come;
    with error feedback the dropped are put back into m. Without a branch per
    candidate (about one in ten is dropped, at no predictable place): each is written
    and kept by counting it, up to the last kept one (after which out is full)."""
    k = out_idx.size
    bits = val.view(np.int32)
    kth, above, equal = kth_largest_abs_bits(bits, k)
    ties = k - above  # of the candidates equal to the k-th largest, how many are kept
    last = bits.size - 1  # the last kept candidate
    while (bits[last] & 0x7FFFFFFF) < kth:
        last -= 1
    o = 0
    dropped = np.empty(bits.size - k + 1, dtype=np.int64)
    d = 0
    if ties == equal:  # every candidate at least the k-th largest is kept
        for j in range(last + 1):
            keep = (bits[j] & 0x7FFFFFFF) >= kth
            out_idx[o] = idx[j]
            out_val[o] = val[j]
            o += keep
            dropped[d] = j
            d += not keep
    else:
        for j in range(bits.size):
            mag = bits[j] & 0x7FFFFFFF
            tie = (mag == kth) & (ties > 0)
            keep = (mag > kth) | tie
            ties -= tie
            if keep:
                out_idx[o] = idx[j]
                out_val[o] = val[j]
                o += 1
            else:
                dropped[d] = j
                d += 1
        last = bits.size - 1
    if ef:
        for j in dropped[:d]:
            m[idx[j]] = val[j]
        for j in range(last + 1, bits.size):
            m[idx[j]] = val[j]


@jit
def topk_decode(out: Any, gathered: Any, values_at: int, indices_at: int, k: int,
                world: int) -> None:
    """out = the sum over ranks w, in rank order, of their k values / world at their k
    indices, zero elsewhere: every element of out is written. Rank w's values (fp32
    bits) are ``gathered[w, values_at:][:k]``, its indices ``gathered[w, indices_at:][:k]``,
    ascending but for padding, which repeats the last one (added once). Block by block
    of out, each in cache while every rank adds into it, so that out is swept once
    (not once per rank)."""
    ranks = gathered.shape[0]
    idx = gathered[:, indices_at : indices_at + k]
    val = gathered.view(np.float32)[:, values_at : values_at + k]
    # dividing by a power of two is multiplying by its exact inverse: the same bits, at
    # a fraction of a division's cost
    power_of_two = world & (world - 1) == 0
    scale = np.float32(1.0 / world) if power_of_two else np.float32(world)
    ends = np.empty(ranks, dtype=np.int64)  # where each rank's padding starts
    for w in range(ranks):
        e = k
        while e > 1 and idx[w, e - 1] == idx[w, e - 2]:
            e -= 1
        ends[w] = e
    at = np.zeros(ranks, dtype=np.int64)  # each rank's next entry
    n = out.size
    for lo in range(0, n, DECODE_BLOCK):
        hi = min(n, lo + DECODE_BLOCK)
        block = out[lo:hi]
        for i in range(block.size):
            block[i] = 0.0
        for w in range(ranks):
            iw = idx[w]
            vw = val[w]
            first = at[w]
            stop = first + np.searchsorted(iw[first : ends[w]], hi)
            if power_of_two:
                for j in range(first, stop):
                    out[iw[j]] += vw[j] * scale
            else:
                for j in range(first, stop):
                    out[iw[j]] += vw[j] / scale
            at[w] = stop
