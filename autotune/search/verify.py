"""``--verify``: measure the best candidates on the live job and choose by measurement.

A prediction can be wrong; a few interleaved steps of each candidate on the real job
cannot be (within noise). The top K tuned candidates and the best baselines run in one
job, interleaved (A B C A B C ...), and the fastest median wins.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from autotune.launch import Placement, launch
from autotune.policies import Policy
from autotune.search.tuner import Candidate, TuneResult

__all__ = ["candidates", "verify", "verify_result", "with_verification"]


def candidates(result: TuneResult, k: int) -> list[Candidate]:
    """The tuned policy, the next ``k - 1`` best distinct trials, and the two baselines
    predicted fastest within the error budget."""
    feasible = sorted((b for b in result.baselines if b.feasible), key=lambda b: b.predicted_s)
    tuned = [Candidate("tuned", result.tuned.policy, result.tuned.predicted_s, result.tuned.error, True)]
    tuned += [c for c in result.top if c.policy.id != result.tuned.policy.id][: max(0, k - 1)]
    return tuned + feasible[:2]


def verify_result(
    result: TuneResult, k: int, workload: str, placement: Placement,
) -> tuple[Policy, dict[str, Any]]:
    """Measure :func:`candidates` of ``result`` and return the winner's policy (with the
    tuner's meta and the measurements) and the report."""
    winner, report = verify(candidates(result, k), workload, placement)
    return with_verification(result.policy, winner, report), report


def verify(
    candidates: Sequence[Candidate], workload: str, placement: Placement,
    rounds: int = 3, block: int = 3, timeout: float = 3600.0,
) -> tuple[Candidate, dict[str, Any]]:
    """Measure ``candidates`` and return the fastest, with every measurement."""
    setups = [{"name": c.name, "kind": "policy", "policy": c.policy.to_dict()} for c in candidates]
    result = launch("autotune.measure:rank_measure", placement=placement, timeout=timeout,
                    kwargs={"workload": workload, "setups": setups, "rounds": rounds,
                            "block": block})[0]
    medians = {r["name"]: statistics.median(r["step_s"]) for r in result["results"]}
    best = min(candidates, key=lambda c: medians[c.name])
    report = {c.name: {"measured_step_s": medians[c.name], "predicted_step_s": c.predicted_s,
                       "policy_id": c.policy.id} for c in candidates}
    return best, report


def with_verification(policy: Policy, winner: Candidate, report: dict[str, Any]) -> Policy:
    """The winner's policy, with the tuner's meta and the measurements."""
    meta = dict(policy.meta)
    meta.update(chosen=winner.name, verified=report,
                measured_step_s=report[winner.name]["measured_step_s"],
                predicted_step_s=winner.predicted_s, error=winner.error)
    return Policy.from_dict({**winner.policy.to_dict(), "meta": meta})
