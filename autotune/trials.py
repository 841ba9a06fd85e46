"""Choosing by measurement: which of several interleaved set-ups is fastest, and is it
fastest beyond noise?

A prediction prunes; a measurement decides. Given each set-up's measured step times
(interleaved, so CPU drift hits all alike), the winner is the lowest median. A
bootstrap interval of each rival's median over the winner's tells whether the gap is
real: a rival whose interval reaches 1 is *tied* with the winner, and a tie goes to the
simpler set-up (the caller orders them, simplest first: plain DDP, then the baselines,
then tuned candidates). :func:`decide` is what ``autotune tune``'s verification uses;
:func:`separated` tells an adaptive measurement when it may stop.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["Decision", "ratio_interval", "decide", "separated", "separated_tau"]

LEVEL = 0.95  # two-sided confidence of the intervals
RESAMPLES = 2000


def ratio_interval(
    rival: Sequence[float], best: Sequence[float], level: float = LEVEL,
    resamples: int = RESAMPLES, seed: int = 0,
) -> tuple[float, float]:
    """Bootstrap interval of ``median(rival) / median(best)`` (percentile method,
    resampling each set-up's steps independently)."""
    a = np.asarray(rival, dtype=float)
    b = np.asarray(best, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("ratio_interval needs at least one time for each set-up")
    rng = np.random.default_rng(seed)
    ra = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    rb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    ratios = ra / np.maximum(rb, 1e-12)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def separated_tau(predicted: Mapping[str, float], times: Mapping[str, Sequence[float]],
                  level: float = LEVEL) -> tuple[float | None, int]:
    """Kendall's tau between ``predicted`` and measured order over the pairs of set-ups
    the measurement itself tells apart (the bootstrap interval of their ratio excludes
    1): (concordant - discordant) / such pairs, and how many there were (tau None when
    none). Set-ups measured alike (DDP at 1 and 5 MB buckets on a slow link) have no
    order to predict: counted, the noise decides a pair's sign, and four such set-ups in
    seven cap the plain tau near 0.7 for a model that ranks every real gap right."""
    names = [n for n in predicted if n in times and len(times[n])]
    agree = disagree = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            low, high = ratio_interval(times[a], times[b], level)
            if low <= 1.0 <= high or predicted[a] == predicted[b]:
                continue
            if (low > 1.0) == (predicted[a] > predicted[b]):
                agree += 1
            else:
                disagree += 1
    pairs = agree + disagree
    return ((agree - disagree) / pairs if pairs else None), pairs


@dataclass(frozen=True)
class Decision:
    """The measured winner and why."""

    winner: str
    medians: dict[str, float]
    # per rival of the fastest set-up: the interval of its median over the fastest's
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    fastest: str = ""  # lowest median (the winner unless a simpler set-up tied with it)
    separated: bool = False  # the fastest beats every other set-up beyond the interval
    reason: str = ""


def method_key(policy: Mapping[str, Any]) -> str:
    """A policy's JSON without its bucket size and meta: equal for one method's set-ups."""
    return json.dumps({k: v for k, v in policy.items() if k not in ("bucket_cap_mb", "meta")},
                      sort_keys=True)


def simplicity_ranks(order: Sequence[str], method: Mapping[str, str | None]) -> dict[str, int]:
    """Ranks for :func:`decide`: a name's rank is the position of the first name in
    ``order`` with the same ``method`` key (None: a rank of its own), so set-ups of
    one method, e.g. at two bucket sizes, are equally simple."""
    first: dict[str, int] = {}
    ranks: dict[str, int] = {}
    for i, name in enumerate(order):
        key = method.get(name)
        ranks[name] = i if key is None else first.setdefault(key, i)
    return ranks


def decide(times: Mapping[str, Sequence[float]], order: Sequence[str], level: float = LEVEL,
           simplicity: Mapping[str, int] | None = None) -> Decision:
    """The fastest set-up by median; a simpler one whose interval over it reaches 1 ties
    and wins instead.

    Args:
        times: measured step times per set-up name.
        order: every name of ``times``, simplest first.
        level: confidence of the intervals.
        simplicity: name -> rank, lower simpler (default: the position in ``order``);
            set-ups of one rank are equally simple, and between them the median decides
            (e.g. one method at two bucket sizes).
    """
    missing = set(times) - set(order)
    if missing or not times:
        raise ValueError(f"order must name every set-up; missing {sorted(missing)}")
    rank = dict(simplicity) if simplicity is not None else {n: i for i, n in enumerate(order)}
    medians = {n: statistics.median(t) for n, t in times.items()}
    fastest = min(times, key=lambda n: (medians[n], order.index(n)))
    intervals = {n: ratio_interval(times[n], times[fastest], level)
                 for n in times if n != fastest}
    ties = [n for n in order if n in intervals and intervals[n][0] <= 1.0]
    simpler_ties = [n for n in ties if rank[n] < rank[fastest]]
    is_separated = not ties
    if simpler_ties:  # the simplest; of equally simple ones (bucket sizes), the faster
        winner = min(simpler_ties, key=lambda n: (rank[n], medians[n]))
        low, high = intervals[winner]
        reason = (f"{winner} ties with the fastest, {fastest} ({winner}/{fastest} "
                  f"{medians[winner] / medians[fastest]:.3f}, {level:.0%} interval "
                  f"{low:.3f}-{high:.3f} reaches 1): the simpler wins")
    else:
        winner = fastest
        if is_separated:
            runner = min(intervals, key=lambda n: medians[n]) if intervals else None
            reason = (f"{winner} is fastest beyond noise" + (
                f": the runner-up {runner} is {medians[runner] / medians[winner]:.3f}x "
                f"(interval {intervals[runner][0]:.3f}-{intervals[runner][1]:.3f})" if runner else ""))
        else:
            reason = (f"{winner} has the lowest median; " + ", ".join(
                f"{n} within noise ({intervals[n][0]:.3f}-{intervals[n][1]:.3f})" for n in ties)
                + " but not simpler")
    return Decision(winner=winner, medians=medians, intervals=intervals, fastest=fastest,
                    separated=is_separated, reason=reason)


def separated(times: Mapping[str, Sequence[float]], level: float = LEVEL) -> bool:
    """Whether the lowest-median set-up beats the runner-up beyond the interval."""
    if len(times) < 2 or any(len(t) < 2 for t in times.values()):
        return False
    medians = {n: statistics.median(t) for n, t in times.items()}
    best, runner = sorted(medians, key=lambda n: medians[n])[:2]
    return ratio_interval(times[runner], times[best], level)[0] > 1.0
