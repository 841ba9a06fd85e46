"""Verification: measure the best candidates and every preset on the live job, and
emit what measured fastest.

The cost model prunes the search space to a few candidates; a measurement decides.
The tuned policy and up to ``k - 1`` more candidates spread over the predicted
error/time Pareto front run in one job, interleaved (A B C A B C ...), beside every
preset a user could have picked (:mod:`autotune.presets`: plain DDP and PyTorch's own
hooks, and our policy for the same method), in rounds, until a bootstrap interval
separates the fastest from the runner-up or the time budget ends
(:func:`autotune.trials.decide`; a set-up shown slower than the fastest is dropped on
the way, and only those still measured at the end decide, so that one dropped after a
few noisy steps cannot tie its way back in). Only set-ups within the error budget may win; a tie
goes to the simpler (plain DDP first, then the presets, then the candidates), and, if
asked (``exact_margin``, default 0), an exact set-up (error 0) measured within that
fraction of a faster lossy winner wins instead. When a preset wins, the emitted policy is our equivalent of it,
and its meta says so.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Sequence

from autotune.launch import Placement, launch
from autotune.policies import Policy
from autotune.presets import PRESETS
from autotune.probes.profile import Calibration, CalibrationRun
from autotune.search.defaults import (DEFAULT_BUDGET_S, DEFAULT_CANDIDATES, DEFAULT_EXACT_MARGIN,
                                      PRUNE_PREDICTED)
from autotune.search.tuner import Candidate, TuneResult
from autotune.trials import decide, method_key, ratio_interval, separated_tau, simplicity_ranks

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_CANDIDATES", "PRUNE_PREDICTED", "candidates", "learned",
           "model_accuracy", "verify_result"]

# our plain DDP policy: the reference of the model's ratios, never judged on one step
REFERENCE = "ddp"
# why a bucket-size variant of a preset was not measured (``pruned`` in its report row)
PRUNED_SLOW = "predicted slow"
PRUNED_OVER_BUDGET = "over the error budget"


def candidates(result: TuneResult, k: int) -> list[Candidate]:
    """The tuned policy and up to ``k - 1`` more distinct trials, spread over the
    Pareto front of (predicted step time, error): fast-and-lossy to slow-and-exact, so
    that a misprediction in one corner does not hide the other; the tuner's best
    exact trial (error 0, compressing something: e.g. rowsparse on the embeddings), if
    none of those is it; and before each hierarchical one, the same policy flat
    (``<name>-flat``), since whether the intra-host stages pay is for a measurement to
    say."""
    tuned = Candidate("tuned", result.tuned.policy, result.tuned.predicted_s, result.tuned.error, True)
    pool = [c for c in result.top if c.policy.id != tuned.policy.id]
    front = [c for c in pool if not any(
        (o.predicted_s <= c.predicted_s and o.error <= c.error) and
        (o.predicted_s < c.predicted_s or o.error < c.error) for o in pool)]
    front.sort(key=lambda c: c.error)
    want = max(0, k - 1)
    if len(front) > want:
        picks = [front[round(i * (len(front) - 1) / max(want - 1, 1))] for i in range(want)] if want else []
        front = list(dict.fromkeys(picks))
    rest = [c for c in sorted(pool, key=lambda c: c.predicted_s) if c not in front]
    chosen = (front + rest)[:want]
    out = [tuned] + [Candidate(f"candidate{i + 2}", c.policy, c.predicted_s, c.error, True)
                     for i, c in enumerate(chosen)]
    exact = result.exact
    if exact is not None and k > 0 and all(c.policy.id != exact.policy.id for c in out):
        out.append(exact)  # the best exact option is always measured (see exact_margin)
    # a hierarchical one is measured beside the same policy flat, listed first (simpler)
    with_twins: list[Candidate] = []
    for c in out:
        twin = result.flat.get(c.policy.id)
        if twin is not None and all(o.policy.id != twin.policy.id for o in out):
            with_twins.append(replace(twin, name=f"{c.name}-flat"))
        with_twins.append(c)
    # one set-up more at most, the last candidates making room: every set-up holds a copy
    # of the model on every rank while measuring (dlrm on 2 x 2 ranks filled this 24 GiB
    # machine with 15 set-ups, and a rank was killed with 17)
    keep = ("tuned", "exact", "tuned-flat", "exact-flat")
    while len(with_twins) > len(out) + 1:
        drop = next((c for c in reversed(with_twins) if c.name not in keep), None)
        if drop is None:
            break
        with_twins.remove(drop)
    return with_twins


def _plain(policy: Policy) -> dict[str, Any]:
    """Policy JSON without meta (what calibration stores)."""
    return {k: v for k, v in policy.to_dict().items() if k != "meta"}


def _setups(result: TuneResult, k: int, backend: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """What to measure, simplest first, and what is known of each; a bucket-size
    variant of a preset (e.g. ``ddp1mb``) is left out (in ``info`` with ``pruned``, the
    reason: no measurement) when it is over the error budget (it cannot win, and no
    preset is it: at 100 Mbit PowerSGD at 100 MB buckets cost two set-ups' warm-up and
    memory for nothing) or the model predicts it :data:`PRUNE_PREDICTED` times the
    fastest prediction; the presets themselves never."""
    ours = {b.name: b for b in result.baselines}
    picked = candidates(result, k)
    fastest = min([c.predicted_s for c in picked] + [b.predicted_s for b in result.baselines if b.feasible])
    setups: list[dict[str, Any]] = []
    info: dict[str, dict[str, Any]] = {}
    for p in PRESETS:
        equivalent = ours.get(p.name)
        stock = p.stock_setup(backend)
        error = equivalent.error if equivalent is not None else (0.0 if p.plain else None)
        feasible = equivalent.feasible if equivalent is not None else p.plain
        if stock is not None:
            setups.append(stock)
            info[stock["name"]] = {"kind": "stock", "label": p.label, "error": error,
                                   "feasible": feasible, "equivalent": p.name}
    presets = {p.name for p in PRESETS}
    for b in result.baselines:  # our policies for the presets, and DDP's bucket sizes
        info[b.name] = {"kind": "baseline", "error": b.error, "feasible": b.feasible,
                        "predicted_step_s": b.predicted_s, "policy_id": b.policy.id,
                        "policy": _plain(b.policy)}
        if b.name not in presets and not b.feasible:
            info[b.name]["pruned"] = PRUNED_OVER_BUDGET
            continue
        if b.name not in presets and b.predicted_s > PRUNE_PREDICTED * fastest:
            info[b.name]["pruned"] = PRUNED_SLOW
            continue
        setups.append({"name": b.name, "kind": "policy", "policy": b.policy.to_dict()})
    for c in picked:
        setups.append({"name": c.name, "kind": "policy", "policy": c.policy.to_dict()})
        info[c.name] = {"kind": "candidate", "error": c.error, "feasible": True,
                        "predicted_step_s": c.predicted_s, "policy_id": c.policy.id,
                        "policy": _plain(c.policy)}
    return setups, info


def verify_result(
    result: TuneResult, k: int, workload: str, placement: Placement, *,
    budget_s: float = DEFAULT_BUDGET_S, backend: str = "gloo", block: int = 2,
    min_rounds: int = 3, max_rounds: int = 40, timeout: float = 3600.0,
    exact_margin: float = DEFAULT_EXACT_MARGIN,
) -> tuple[Policy, dict[str, Any]]:
    """Measure the candidates of ``result`` and the presets; return the policy to emit
    (with the tuner's meta and what was measured) and the report.

    Args:
        result: what :func:`~autotune.search.tuner.tune` found.
        k: tuned candidates to measure (the tuned policy included).
        workload: the workload spec the ranks train.
        placement: where the ranks run (local ranks, an emulated cluster, or the
            torchrun job itself through :func:`autotune.launch.launch`'s placement).
        budget_s: measurement time after which the lowest median wins, separated or not.
        backend: the job's backend (PyTorch's bf16 hook runs only on NCCL).
        block: consecutive steps per set-up in a round.
        min_rounds / max_rounds: rounds before the first separation test / at most.
        exact_margin: an exact set-up (error 0) whose median is within this fraction
            of a lossy winner's is emitted instead (0: the fastest always wins).
    """
    setups, info = _setups(result, k, backend)
    eligible = [s["name"] for s in setups if info[s["name"]]["feasible"]]
    # a stock set-up is predicted as our equivalent of it; our plain DDP is left out, so
    # that it is never judged on its first step alone: its steady time is the reference
    # of every ratio to DDP (a first step carried up to 70% of one-time costs)
    predicted: dict[str, float] = {}
    for name in (s["name"] for s in setups if s["name"] != REFERENCE):
        source = info.get(info[name].get("equivalent", name), {})
        if source.get("predicted_step_s"):
            predicted[name] = source["predicted_step_s"]
    measured = launch("autotune.measure:rank_measure", placement=placement, timeout=timeout,
                      kwargs={"workload": workload, "setups": setups, "rounds": max_rounds,
                              "block": block, "min_rounds": min_rounds, "budget_s": budget_s,
                              "separate": eligible, "predicted": predicted})[0]
    times = {r["name"]: r["step_s"] for r in measured["results"]}
    # how a set-up dropped in warm-up was timed: in its warm-up steps, or its first alone
    flags = {r["name"]: {f: True for f in ("warmup_only", "first_step_only") if r.get(f)}
             for r in measured["results"]}
    # Measurement drops a set-up once it is shown slower than the fastest (successive
    # elimination): one dropped early has few steps, hence a wide interval, and must not
    # tie its way back in; the survivors (the most steps) decide.
    most = max(len(times[n]) for n in eligible)
    survivors = [n for n in eligible if len(times[n]) == most]
    # our policies that differ only in bucket size are equally simple: the median
    # decides between them (a stock hook is its own rank, as plain DDP is)
    ranks = simplicity_ranks([s["name"] for s in setups], {
        s["name"]: method_key(s["policy"]) if s["kind"] == "policy" else None for s in setups})
    decision = decide({n: times[n] for n in survivors}, survivors, simplicity=ranks)
    overall = decide(times, [s["name"] for s in setups], simplicity=ranks)
    winner, why = decision.winner, decision.reason
    medians = {n: statistics.median(times[n]) for n in eligible}
    exact = _exact_within(medians, info, winner, exact_margin)
    if exact is not None:
        why = (f"{exact} (exact) measured within {exact_margin:.0%} of the lossy {winner} "
               f"({medians[exact] / medians[winner]:.3f}x): the exact one wins; "
               + why)
        winner = exact
    report: dict[str, Any] = {}
    for s in setups:
        name = s["name"]
        entry = {**info[name], "measured_step_s": overall.medians[name], "steps": len(times[name])}
        if name in decision.intervals:
            entry["interval_vs_fastest"] = list(decision.intervals[name])
        elif name in eligible and name not in survivors:  # dropped as slower on the way
            entry["interval_vs_fastest"] = list(ratio_interval(times[name], times[decision.fastest]))
            entry["dropped"] = True
        entry.update(flags[name])
        report[name] = entry
    emitted_name = info[winner].get("equivalent", winner)
    ours = {b.name: b for b in result.baselines}
    cands = {c.name: c for c in candidates(result, k)}
    source = cands.get(emitted_name) or ours[emitted_name]
    if info[winner]["kind"] == "stock" and source.policy.is_plain:
        why += (f"; emitted: our {emitted_name} policy, plain averaging, which wrap() runs as "
                f"DDP's own allreduce (no hook): {info[winner]['label']} itself")
    elif info[winner]["kind"] == "stock":
        why += (f"; emitted: our {emitted_name} policy, the same method as "
                f"{info[winner]['label']} through autotune's hook")
        ratio = report[emitted_name]["measured_step_s"] / report[winner]["measured_step_s"]
        if ratio > 1.0:
            why += f" (measured {ratio:.2f}x the stock set-up in this run)"
    summary = {
        "winner": winner, "emitted": emitted_name, "why": why,
        "model_accuracy": model_accuracy(report, times),
        "separated": decision.separated, "rounds": measured.get("rounds"),
        "measure_s": measured.get("measure_s"), "budget_s": budget_s,
        "fastest_within_budget": decision.fastest,
        "fastest_overall": overall.fastest,
        "fastest_overall_error": info[overall.fastest]["error"],
        # predicted too slow to measure: name -> predicted seconds
        "pruned": {n: r["predicted_step_s"] for n, r in info.items() if r.get("pruned") == PRUNED_SLOW},
        # bucket-size variants over the error budget, not measured: they cannot win
        "pruned_over_budget": [n for n, r in info.items() if r.get("pruned") == PRUNED_OVER_BUDGET],
        "stopped": measured.get("stopped"),
    }
    meta = dict(result.policy.meta)
    light = {n: {k: v for k, v in r.items() if k != "policy"} for n, r in report.items()}
    meta.update(chosen=emitted_name, verified=light, verification=summary,
                measured_step_s=report[emitted_name]["measured_step_s"],
                predicted_step_s=source.predicted_s, error=source.error)
    return Policy.from_dict({**source.policy.to_dict(), "meta": meta}), report | {"_summary": summary}


def _exact_within(medians: dict[str, float], info: dict[str, dict[str, Any]], winner: str,
                  margin: float) -> str | None:
    """The fastest exact (error 0) set-up measured within ``margin`` of a lossy
    ``winner``, if any."""
    if not info[winner].get("error"):
        return None
    exact = [n for n in medians if info[n].get("error") == 0.0]
    if not exact:
        return None
    best = min(exact, key=lambda n: medians[n])
    return best if medians[best] <= medians[winner] * (1 + margin) else None


def model_accuracy(report: dict[str, Any], times: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """How well the cost model ranked what verification measured: the error of each
    predicted ratio to plain DDP (our ``ddp`` policy) against the measured one, and
    Kendall's tau between predicted and measured times, among our preset policies and
    among everything predicted; with the measured ``times``, also over the pairs of
    preset policies the measurement tells apart (:func:`autotune.trials.separated_tau`)."""
    from scipy.stats import kendalltau

    # a set-up timed on its first step alone is left out: one-time costs are in its time
    rows = {n: r for n, r in report.items() if not n.startswith("_") and r.get("predicted_step_s")
            and not r.get("first_step_only")}
    if REFERENCE not in rows or len(rows) < 3:
        return {}
    ref_pred, ref_meas = rows[REFERENCE]["predicted_step_s"], rows[REFERENCE]["measured_step_s"]
    errors = sorted(abs((r["predicted_step_s"] / ref_pred) / (r["measured_step_s"] / ref_meas) - 1)
                    for n, r in rows.items() if n != REFERENCE)
    presets = [r for r in rows.values() if r["kind"] == "baseline"]

    def tau(items: list[dict[str, Any]]) -> float | None:
        if len(items) < 3:
            return None
        value = kendalltau([r["predicted_step_s"] for r in items], [r["measured_step_s"] for r in items])[0]
        return None if value != value else float(value)  # NaN when all predictions tie

    out = {"median_ratio_error": errors[len(errors) // 2], "max_ratio_error": errors[-1],
           "kendall_tau_baselines": tau(presets), "kendall_tau_all": tau(list(rows.values())),
           "set_ups": len(rows)}
    if times is not None:
        out["kendall_tau_baselines_separated"], out["separated_pairs"] = separated_tau(
            {n: r["predicted_step_s"] for n, r in rows.items() if r["kind"] == "baseline"}, times)
    return out


STOCK_MIN_STEPS = 6  # timed steps of a stock set-up before its ratio to ours is learned


def learned(calibration: Calibration, report: dict[str, Any]) -> Calibration:
    """The profile's calibration section with verification's measurements added
    (``source: "verify"``): of our own policies, which the next fit of the cost model's
    residual learns from, and of the presets' stock set-ups timed :data:`STOCK_MIN_STEPS`
    steps or more (``stock``: the preset's name), whose ratio to our equivalent measured
    beside them scales the model's predictions of those; an older measurement of the
    same policy or stock set-up is replaced."""
    # a set-up timed in its warm-up steps only (clearly slower) is left out: those steps
    # may still carry one-time costs
    rows = [r for r in report.values() if isinstance(r, dict) and not r.get("warmup_only")
            and r.get("measured_step_s") is not None]
    measured = {r["policy_id"]: r for r in rows if r.get("policy_id") and r.get("policy") is not None}
    # a stock set-up from enough steps only: PyTorch's PowerSGD hook's first compressed
    # steps cost up to 2.6x its later ones (cnn at 1 Gbit: 469 ms in two, 265 in 60 s)
    stock = {r["equivalent"]: r for r in rows if r.get("kind") == "stock" and r.get("equivalent")
             and r.get("steps", 0) >= STOCK_MIN_STEPS}
    keep = [r for r in calibration.results if r.source != "verify" or (
        r.policy_id not in measured if r.stock is None else r.stock not in stock)]
    keep += [CalibrationRun(policy=r["policy"], step_s=r["measured_step_s"], source="verify",
                            policy_id=policy_id) for policy_id, r in measured.items()]
    keep += [CalibrationRun(policy=None, step_s=r["measured_step_s"], source="verify", stock=name)
             for name, r in stock.items()]
    return replace(calibration, results=tuple(keep))


def fastest_presets(report: dict[str, Any], max_error: float | None = None) -> Sequence[tuple[str, float]]:
    """(name, measured seconds) of the stock presets, fastest first; within
    ``max_error`` only, if given."""
    rows = [(n, r["measured_step_s"]) for n, r in report.items()
            if not n.startswith("_") and r.get("kind") == "stock"
            and (max_error is None or (r.get("error") is not None and r["error"] <= max_error))]
    return sorted(rows, key=lambda x: x[1])
