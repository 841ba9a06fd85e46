"""Network probe: time collectives and point-to-point transfers inside the live group.

Runs on every rank of an initialised process group (gloo or NCCL; the same code path
under torchrun or autotune's launcher). For each collective and message size: warm up,
then repeat, every repetition starting after a barrier and timed as the slowest rank.
Fits per collective ``t(bytes) = latency + bytes / bandwidth`` robustly: the bandwidth
from large messages only (a shaped link lets the start of a message through at full
speed, and small messages are latency-bound), the latency from a low percentile of
small messages (the latency term is noisy and bimodal). Rank pairs are grouped into link
classes: ``intra`` (same host) and ``inter`` (across hosts).

All decisions (how many repetitions, when to stop growing the size) are made from
values every rank shares after an allreduce, so ranks never diverge.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from autotune.compressors.comm import all_gather_flat
from autotune.runtime.topology import host_ids

__all__ = ["DEFAULT_SIZES", "COLLECTIVES", "probe_network", "fit_line", "bus_factor"]

logger = logging.getLogger(__name__)

KIB = 1024
DEFAULT_SIZES = tuple(4 * KIB * 4**i for i in range(8))  # 4 KiB .. 64 MiB
COLLECTIVES = ("allreduce", "allgather", "broadcast", "p2p")
# Messages shorter than this are latency-bound; their times give the latency.
SMALL_BYTES = 64 * KIB
# A message must take this long to count for the bandwidth fit: shorter ones are
# dominated by latency noise and by tbf's unshaped burst (see DESIGN.md's findings).
MIN_FIT_SECONDS = 0.02

Progress = Callable[[float], None]


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor.

    algbw is the collective's *size* over its time; for all_gather, nccl-tests' size is
    the whole gathered buffer (world_size x the per-rank payload).
    """
    n = world_size
    if collective == "allreduce":
        return 2 * (n - 1) / n if n > 1 else 1.0
    if collective == "allgather":
        return (n - 1) / n if n > 1 else 1.0
    return 1.0


def _alg_size(collective: str, nbytes: int, world_size: int) -> int:
    return nbytes * world_size if collective == "allgather" else nbytes


def fit_line(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Theil-Sen fit of ``t = a + b * size``: median of pairwise slopes, robust to
    outliers. Returns (intercept a, slope b); with one point, a line through the origin."""
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(times, dtype=float)
    if len(x) == 1:
        return 0.0, float(y[0] / x[0])
    slopes = [
        (y[j] - y[i]) / (x[j] - x[i])
        for i, j in itertools.combinations(range(len(x)), 2)
        if x[j] != x[i]
    ]
    slope = float(np.median(slopes))
    intercept = float(np.median(y - slope * x))
    return intercept, slope


def _fit(samples: list[dict[str, Any]], collective: str, world_size: int) -> dict[str, Any]:
    """Latency and bandwidth of one collective (or one link class of p2p)."""
    sizes = [s["bytes"] for s in samples]
    medians = [s["median_s"] for s in samples]
    large = [(b, t) for b, t in zip(sizes, medians) if t >= MIN_FIT_SECONDS]
    if len(large) < 2:  # a fast link: use the largest sizes measured
        order = sorted(range(len(sizes)), key=lambda i: sizes[i])[-3:]
        large = [(sizes[i], medians[i]) for i in order]
    intercept, slope = fit_line([b for b, _ in large], [t for _, t in large])
    if slope <= 0:  # noise on a link too fast to resolve: fall back to the largest message
        b, t = max(large)
        slope, intercept = t / b, 0.0
    bandwidth = 1.0 / slope
    # Latency from the smallest messages only: on a shaped link, messages up to tbf's
    # burst go faster than the line rate, so larger "small" ones would read negative.
    smallest = min((s["bytes"] for s in samples), default=0)
    residuals = [
        t - s["bytes"] / bandwidth
        for s in samples if s["bytes"] == smallest and smallest <= SMALL_BYTES
        for t in s["times_s"]
    ]
    latency = max(0.0, float(np.percentile(residuals, 10))) if residuals else max(0.0, intercept)
    alg_bw = bandwidth * _alg_size(collective, 1, world_size)
    return {
        "latency_s": latency,
        "bandwidth_Bps": bandwidth,  # per-rank payload bytes per second
        "algbw_Bps": alg_bw,
        "busbw_Bps": alg_bw * bus_factor(collective, world_size),
        "large_intercept_s": intercept,
        "fit_bytes": sorted(b for b, _ in large),
        "sizes": len(samples),
    }


def _host_ids(device: torch.device) -> list[int]:
    """Host index of every rank: GROUP_RANK (torchrun's node rank) or the hostname."""
    return host_ids(None, device)


class _Clock:
    """Seconds of work as every rank agrees on them (sum of slowest-rank times)."""

    def __init__(self, budget_s: float, progress: Progress | None) -> None:
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.progress = progress

    def add(self, seconds: float) -> None:
        self.spent_s += seconds
        if self.progress is not None:
            self.progress(min(1.0, self.spent_s / self.budget_s))


def _timed_reps(op: Callable[[], None], reps: int, warmup: int, device: torch.device) -> list[float]:
    """Run ``op`` ``warmup`` + ``reps`` times, each after a barrier; return the slowest
    rank's time of each timed repetition (identical on every rank)."""
    for _ in range(warmup):
        dist.barrier()
        op()
    times = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[i] = time.perf_counter() - start
    shared = times.to(device)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    return shared.cpu().tolist()


def _collective_op(name: str, nbytes: int, device: torch.device) -> Callable[[], None]:
    world = dist.get_world_size()
    numel = max(1, nbytes // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    if name == "allreduce":
        return lambda: dist.all_reduce(buf)
    if name == "allgather":
        out = torch.empty(numel * world, dtype=torch.float32, device=device)
        return lambda: all_gather_flat(out, buf)
    if name == "broadcast":
        return lambda: dist.broadcast(buf, src=0)
    raise ValueError(f"unknown collective {name!r}")


def _pingpong_op(a: int, b: int, nbytes: int, device: torch.device) -> Callable[[], None]:
    """``a`` sends to ``b`` and ``b`` sends the same size back; other ranks idle."""
    rank = dist.get_rank()
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)

    def op() -> None:
        if rank == a:
            dist.send(buf, dst=b)
            dist.recv(buf, src=b)
        elif rank == b:
            dist.recv(buf, src=a)
            dist.send(buf, dst=a)

    return op


def _sweep(
    make_op: Callable[[int], Callable[[], None]],
    sizes: Sequence[int],
    share_s: float,
    clock: _Clock,
    device: torch.device,
    reps: int,
    min_reps: int,
    warmup: int,
    scale: float = 1.0,
) -> tuple[list[dict[str, Any]], int | None]:
    """Measure one operation over growing sizes within ``share_s`` seconds.

    Returns the samples and the first size skipped for lack of budget (or None).
    ``scale`` divides each measured time (a ping-pong is two transfers).
    """
    samples: list[dict[str, Any]] = []
    spent = 0.0
    per_byte = 0.0
    for size in sizes:
        # Predict this size from the last: every rank holds the same numbers.
        est = samples[-1]["median_s"] * scale if samples else 0.0
        if samples:
            est = max(est, per_byte * size * scale)
        left = share_s - spent
        n = reps
        if est > 0:
            n = int(min(reps, max(min_reps, (left / est) - warmup)))
            if (n + warmup) * est > left and samples:
                return samples, size
        op = make_op(size)
        times = [t / scale for t in _timed_reps(op, n, warmup, device)]
        used = sum(times) * scale * (1 + warmup / max(n, 1))
        spent += used
        clock.add(used)
        median = float(np.median(times))
        per_byte = median / size
        samples.append({
            "bytes": size,
            "times_s": times,
            "median_s": median,
            "p10_s": float(np.percentile(times, 10)),
        })
    return samples, None


def probe_network(
    sizes: Sequence[int] = DEFAULT_SIZES,
    budget_s: float = 30.0,
    reps: int = 10,
    min_reps: int = 3,
    warmup: int = 1,
    max_pairs: int = 16,
    progress: Progress | None = None,
    collectives: Sequence[str] = COLLECTIVES,
) -> dict[str, Any]:
    """Probe collectives and point-to-point links of the default process group.

    Args:
        sizes: message sizes in bytes (per-rank payload), ascending.
        budget_s: seconds of measured work for the whole probe; sizes that would not
            fit are skipped (recorded in ``truncated``), never the smallest ones.
        reps: timed repetitions per size when the budget allows.
        min_reps: fewest timed repetitions of a size worth measuring.
        warmup: untimed repetitions before each size.
        max_pairs: most rank pairs to probe point-to-point (covering both link classes).
        progress: called with the fraction of the budget spent.
        collectives: which of :data:`COLLECTIVES` to probe (``wrap(model, "auto")``
            probes only what its hook issues, allreduce and allgather, to stall training
            less).

    Returns:
        JSON-friendly samples and fits (identical on every rank).
    """
    world = dist.get_world_size()
    backend = dist.get_backend()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl" else torch.device("cpu")
    )
    unknown = set(collectives) - set(COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; expected some of {COLLECTIVES}")
    hosts = _host_ids(device)
    pairs = _choose_pairs(hosts, max_pairs) if "p2p" in collectives else []
    ops = [c for c in COLLECTIVES if c != "p2p" and c in collectives] if world > 1 else []
    shares = len(ops) + (1 if pairs else 0)
    clock = _Clock(budget_s, progress)
    samples: list[dict[str, Any]] = []
    fits: dict[str, Any] = {}
    truncated: dict[str, int | None] = {}
    for name in ops:
        got, cut = _sweep(
            lambda s, name=name: _collective_op(name, s, device),
            sizes, budget_s / shares, clock, device, reps, min_reps, warmup,
        )
        for s in got:
            s.update(collective=name)
            s["algbw_Bps"] = _alg_size(name, s["bytes"], world) / s["median_s"]
            s["busbw_Bps"] = s["algbw_Bps"] * bus_factor(name, world)
        samples += got
        truncated[name] = cut
        fits[name] = _fit(got, name, world)
    if pairs:
        by_class: dict[str, list[list[dict[str, Any]]]] = {}
        for a, b in pairs:
            cls = "intra" if hosts[a] == hosts[b] else "inter"
            got, cut = _sweep(
                lambda s, a=a, b=b: _pingpong_op(a, b, s, device),
                sizes, budget_s / shares / len(pairs), clock, device, reps, min_reps,
                warmup, scale=2.0,
            )
            for s in got:
                s.update(collective="p2p", pair=[a, b], link_class=cls)
                s["algbw_Bps"] = s["busbw_Bps"] = s["bytes"] / s["median_s"]
            samples += got
            truncated[f"p2p:{a}-{b}"] = cut
            by_class.setdefault(cls, []).append(got)
        fits["p2p"] = {cls: _fit(_pool(runs), "p2p", world) for cls, runs in by_class.items()}
    return {
        "backend": backend,
        "world_size": world,
        "hosts": hosts,
        "sizes": list(sizes),
        "pairs": [list(p) for p in pairs],
        "samples": samples,
        "fits": fits,
        "truncated": truncated,
        "budget_s": budget_s,
        "spent_s": clock.spent_s,
    }


def _pool(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Samples of several pairs of one link class, merged per size (median of medians)."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        for s in run:
            by_size.setdefault(s["bytes"], []).append(s)
    pooled = []
    for size in sorted(by_size):
        group = by_size[size]
        times = [t for s in group for t in s["times_s"]]
        pooled.append({
            "bytes": size,
            "times_s": times,
            "median_s": float(np.median([s["median_s"] for s in group])),
        })
    return pooled


def _choose_pairs(hosts: list[int], max_pairs: int) -> list[tuple[int, int]]:
    """Rank pairs to probe: all of them when few, else pairs spread over both classes."""
    pairs = list(itertools.combinations(range(len(hosts)), 2))
    if len(pairs) <= max_pairs:
        return pairs
    intra = [p for p in pairs if hosts[p[0]] == hosts[p[1]]]
    inter = [p for p in pairs if hosts[p[0]] != hosts[p[1]]]
    half = max_pairs // 2 if intra and inter else max_pairs
    chosen = inter[:: max(1, len(inter) // half)][:half] + intra[:: max(1, len(intra) // half)][
        : max_pairs - min(half, len(inter))
    ]
    return chosen
