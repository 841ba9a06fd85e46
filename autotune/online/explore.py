"""Trials on the live job: a few steps of each contender, interleaved with the fastest
measured so far (A B A C ...; B becomes A once it measures faster), until the
measurement decides.

Rank 0's bookkeeping only; the controller announces every switch to all ranks (so they
all run the same policy at the same step) and hands each finished step's time back.
A block is one settling step (not timed: after a switch PowerSGD builds its state, and
after a bucket change DDP's first iteration runs in one bucket while it learns the
gradient order; two at a contender's first block, whose first steps also load what it
first uses, such as compiled codec kernels) and ``trial_steps`` timed steps. Contenders
are visited in the order of their predicted step time, so the fast ones come first and
the steps between trials run the best policy found so far, not the slow start: that is
what keeps degraded steps few.

Three rules drop a contender, each costing its user fewer slow steps than measuring it
fully: a timed step beyond ``abort_above`` times the incumbent's median ends its block at
once; after the first round a median beyond ``reject_above`` times the incumbent's, and all
but the ``keep_after_first`` fastest (the later rounds separate the close ones); after
``min_rounds`` a bootstrap interval behind the fastest
(:func:`autotune.trials.ratio_interval`). The trials end with one contender left, after
``max_rounds`` or when the step budget is spent; :func:`autotune.trials.decide` then picks
the fastest, a tie going to the simpler (plain DDP first), and never one measured slower
than plain DDP.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, Sequence

from autotune import trials
from autotune.policies import Policy

__all__ = ["Contender", "Exploration"]


@dataclass(frozen=True)
class Contender:
    """A policy tried on the live job."""

    name: str  # "ddp", "current", a preset's equivalent ("fp16", "ddp5mb"), "tuned", ...
    policy: Policy
    kind: str  # "ddp" (plain DDP), "current", "baseline" (a preset's equivalent), "candidate"
    error: float = 0.0
    predicted_s: float | None = None


class Exploration:
    """The schedule and measurements of one exploration.

    Args:
        contenders: simplest first (the order ties are broken in); the first is plain
            DDP, one of them is ``current`` (the policy in force when the trials start,
            the first incumbent).
        current: the name of the policy in force.
        trial_steps: timed steps per block (each block adds a settling step).
        budget_steps: steps the trials may take in all.
        min_rounds: rounds before the bootstrap test may drop a contender.
        max_rounds: rounds at most.
        reject_above: after the first round, drop a contender whose median exceeds the
            incumbent's by this factor.
        keep_after_first: after the first round, keep only this many contenders besides
            the incumbent (the fastest medians), so the budget's later rounds go to
            separating the close ones.
        abort_above: end a contender's block at once, and drop it, when one of its timed
            steps exceeds the incumbent's median by this factor (CPU speed drifts by up
            to 1.5x for seconds here, so this is set above that).
    """

    def __init__(self, contenders: Sequence[Contender], current: str, *, trial_steps: int,
                 budget_steps: int, min_rounds: int = 2, max_rounds: int = 4,
                 reject_above: float = 1.2, abort_above: float = 1.6,
                 keep_after_first: int = 3) -> None:
        self.contenders = {c.name: c for c in contenders}
        self.order = [c.name for c in contenders]
        if current not in self.contenders:
            raise ValueError(f"current {current!r} is not a contender")
        self.current = current
        self.incumbent = current  # the fastest measured so far: A in A B A C
        self.trial_steps = trial_steps
        self.budget_steps = budget_steps
        self.min_rounds = min_rounds
        self.max_rounds = max_rounds
        self.reject_above = reject_above
        self.abort_above = abort_above
        self.keep_after_first = keep_after_first
        self.times: dict[str, list[float]] = {n: [] for n in self.order}
        # predicted fastest first; unpredicted ones after, simplest first
        rank = {n: i for i, n in enumerate(self.order)}
        self._visit = sorted(self.order, key=lambda n: (
            self.contenders[n].predicted_s is None, self.contenders[n].predicted_s or 0.0, rank[n]))
        self.alive = [n for n in self._visit if n != current]  # not yet dropped, not A
        self.dropped: dict[str, str] = {}  # name -> why
        self.rounds = 0
        self.steps = 0  # steps run under the trials so far
        self._plan: dict[int, tuple[str, bool]] = {}  # step -> (contender, timed)
        self._queue: list[str] = []  # this round's contenders still to visit
        self._last: str | None = None  # the contender of the block planned last
        self._visited = {current}  # contenders switched to at least once (and the first)
        self.done = not self.alive

    # ------------------------------------------------------------------ steps
    def tick(self, step: int, last_s: float | None) -> Contender | None:
        """At the boundary of ``step`` (``last_s``: the time of ``step - 1``): record it,
        and return the contender to announce for ``step + 1`` when it differs from the
        one running at ``step`` (None: no switch)."""
        ran = self._plan.pop(step - 1, None)
        if ran is not None and last_s is not None:
            self.steps += 1
            if ran[1]:
                self.times[ran[0]].append(last_s)
                self._maybe_abort(ran[0], last_s, step)
        if self.done:
            return None
        if step not in self._plan:  # the trials start here: `step` runs the current policy
            self._plan[step] = (self.incumbent, True)
            self._last = self.incumbent
        if step + 1 in self._plan:
            return None
        name = self._next_block()
        if name is None:
            self.done = True
            return None
        running = self._plan[step][0]
        # untimed steps after a switch: two at a contender's first visit, whose first
        # steps load what it first uses (compiled codec kernels: a 0.66 s and a 0.33 s
        # step seen on a 300 Mbit link, beside 40 ms ones)
        settle = 0 if name == running else 1 + int(name not in self._visited)
        self._visited.add(name)
        for i in range(self.trial_steps + settle):
            self._plan[step + 1 + i] = (name, i >= settle)
        self._last = name
        return self.contenders[name] if settle else None

    def running(self, step: int) -> str | None:
        """The contender planned for ``step`` (None: not a trial step, or recorded)."""
        planned = self._plan.get(step)
        return planned[0] if planned is not None else None

    def _maybe_abort(self, name: str, seconds: float, step: int) -> None:
        """One timed step of a contender far beyond the incumbent: stop measuring it."""
        base = self.times[self.incumbent]
        if name == self.incumbent or name not in self.alive or not base:
            return
        ratio = seconds / statistics.median(base)
        if ratio > self.abort_above:
            self._drop(name, f"a step {ratio:.2f}x the fastest so far ({self.incumbent}): "
                             f"its block was cut short")
            for later in [k for k, (n, _) in self._plan.items() if k > step and n == name]:
                del self._plan[later]

    def _promote(self) -> None:
        """Make the last measured contender the incumbent when it is faster."""
        last = self._last
        if last is None or last == self.incumbent or last not in self.alive:
            return
        mine, base = self.times[last], self.times[self.incumbent]
        if mine and base and statistics.median(mine) < statistics.median(base):
            self.alive.remove(last)
            self.alive.insert(0, self.incumbent)
            self.incumbent = last

    def _next_block(self) -> str | None:
        if self._last is not None and self._last != self.incumbent:
            self._promote()
            name = self.incumbent  # back to A after each contender's block
        else:
            self._queue = [n for n in self._queue if n in self.alive]
            if not self._queue:
                self._end_round()
                if self.done or not self.alive:
                    return None
                self.rounds += 1
                self._queue = [n for n in self._visit if n in self.alive]
            name = self._queue.pop(0)
        if self.steps + len(self._plan) + self.trial_steps + 1 > self.budget_steps:
            return None
        return name

    def _end_round(self) -> None:
        if self.rounds == 0:
            return
        base = self.times[self.incumbent]
        if self.rounds == 1 and base:
            ref = statistics.median(base)
            for name in list(self.alive):
                t = self.times[name]
                if t and statistics.median(t) > self.reject_above * ref:
                    self._drop(name, f"{statistics.median(t) / ref:.2f}x the fastest so far "
                                     f"({self.incumbent}) after one block")
            # the later rounds go to the closest: each has the budget's steps to
            # separate, where a block of every contender a round would leave each two
            ranked = sorted((n for n in self.alive if self.times[n]),
                            key=lambda n: statistics.median(self.times[n]))
            for name in ranked[self.keep_after_first:]:
                self._drop(name, f"{statistics.median(self.times[name]) / ref:.2f}x the fastest "
                                 f"so far ({self.incumbent}) after one block, behind "
                                 f"{self.keep_after_first} faster")
        if self.rounds >= self.min_rounds:
            measured = {n: t for n, t in self.times.items()
                        if (n in self.alive or n == self.incumbent) and len(t) >= 2}
            if len(measured) >= 2:
                fastest = min(measured, key=lambda n: statistics.median(measured[n]))
                for name in list(self.alive):
                    if name != fastest and name in measured:
                        low, _ = trials.ratio_interval(measured[name], measured[fastest])
                        if low > 1.0:
                            self._drop(name, f"slower than {fastest} beyond the interval")
        if self.rounds >= self.max_rounds or not self.alive:
            self.done = True

    def _drop(self, name: str, why: str) -> None:
        self.alive.remove(name)
        self.dropped[name] = why

    # --------------------------------------------------------------- decision
    def decide(self) -> tuple[Contender, trials.Decision]:
        """The winner among the contenders the trials kept (at least two timed steps
        each): the fastest median, ties to the simpler, never slower than plain DDP.

        A dropped contender stays out: a rule dropped it for measuring slower, and with
        the two or three steps it was given, its interval would reach 1 and hand a tie to
        a simpler contender already measured 1.2x slower (a live 100 Mbit run settled on
        PowerSGD at 36.5 ms beside a candidate at 29.8)."""
        kept = [n for n in self.order if n not in self.dropped]
        times = {n: self.times[n] for n in kept if len(self.times[n]) >= 2}
        if not times:
            times = {self.incumbent: self.times[self.incumbent] or [1.0]}
        order = [n for n in self.order if n in times]
        decision = trials.decide(times, order, simplicity=self._simplicity(order))
        winner = decision.winner
        ddp = next((n for n in self.order if self.contenders[n].kind == "ddp"), None)
        if ddp is not None and self.times[ddp] and ddp not in times:
            # plain DDP was dropped, but its steps still bound the winner
            decision = replace(decision, medians={
                **decision.medians, ddp: statistics.median(self.times[ddp])})
        if ddp in decision.medians and decision.medians[winner] > decision.medians[ddp]:
            winner = ddp  # a simpler tie measured slower than plain DDP: DDP instead
        return self.contenders[winner], decision

    def _simplicity(self, order: Sequence[str]) -> dict[str, int]:
        """Plain DDP simplest; contenders that differ only in bucket size are equally
        simple (the median decides between them)."""
        return trials.simplicity_ranks(order, {
            n: None if self.contenders[n].kind == "ddp" else trials.method_key(self.contenders[n].policy.to_dict())
            for n in order})

    def report(self, decision: trials.Decision) -> dict[str, dict[str, Any]]:
        """Per measured contender: what ``autotune show`` prints (policy meta ``verified``)."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.order:
            t = self.times[name]
            if not t:
                continue
            c = self.contenders[name]
            row: dict[str, Any] = {"kind": c.kind, "measured_step_s": statistics.median(t),
                                   "steps": len(t), "error": c.error, "feasible": True,
                                   "policy_id": c.policy.id}
            if c.predicted_s is not None:
                row["predicted_step_s"] = c.predicted_s
            if name in decision.intervals:
                row["interval_vs_fastest"] = list(decision.intervals[name])
            if name in self.dropped:
                row["dropped"] = self.dropped[name]
            out[name] = row
        return out
