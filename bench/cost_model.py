"""Benchmark: how well does the cost model predict measured step times?

On 2 emulated hosts (one rank each) at each link rate, for each workload:
  1. take a profile (`rank_profile`, as `autotune profile` does);
  2. draw N random mixed policies (compressors and bucket sizes) plus the baselines
     (plain DDP, fp16, PowerSGD rank 1 and 4);
  3. measure every one on the live job, interleaved (A B C ... A B C ...), medians;
  4. predict every one from the profile taken before: the timeline with the fitted
     components alone, and the full cost model, whose residual was fitted on the
     profile's calibration measurements: 8 *other* random policies (their own seed), so
     no policy predicted here was seen by the model.
Reports MAPE, 90th-percentile absolute percentage error and Spearman rank correlation
per rate, per cell and overall. Needs root. Writes JSON and prints tables.

    python bench/cost_model.py [--rates 100mbit,1gbit,5gbit] [--workloads cnn,transformer,mlp]
                               [--policies 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from scipy.stats import spearmanr

from autotune.emulate import EmulatedCluster
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.links import parse_link
from autotune.measure import run_bench
from autotune.models.cost_model import CostModel
from autotune.policies import Policy
from autotune.probes.run import profile_job
from autotune.probes.sampling import random_policy
from autotune.workloads import resolve_workload

BASELINES: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "fp16": {"compressor": "fp16"},
    "powersgd1": {"compressor": "powersgd", "rank": 1},
    "powersgd4": {"compressor": "powersgd", "rank": 4},
}


def _setups(workload: str, n: int, seed: int) -> list[tuple[str, Policy | None]]:
    model = resolve_workload(workload).model
    params = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    rng = random.Random(seed)
    out: list[tuple[str, Policy | None]] = [
        (name, None if spec is None else Policy.from_dict({"version": 1, "default": spec}))
        for name, spec in BASELINES.items()
    ]
    out += [(f"random{i}", random_policy(params, rng)) for i in range(n)]
    return out


def _measure(cluster: EmulatedCluster, workload: str, setups: list[tuple[str, Policy | None]],
             rounds: int, block: int, chunk: int) -> dict[str, list[float]]:
    """Step times of every set-up, interleaved within chunks (bounded memory)."""
    times: dict[str, list[float]] = {}
    for start in range(0, len(setups), chunk):
        part = setups[start:start + chunk]
        specs = [{"name": name, "kind": "ddp"} if pol is None else
                 {"name": name, "kind": "policy", "policy": pol.to_dict()} for name, pol in part]
        result = run_bench(workload, cluster, specs, rounds=rounds, block=block, timeout=3600)
        for r in result["results"]:
            times[r["name"]] = r["step_s"]
    return times


def _metrics(pred: list[float], meas: list[float]) -> dict[str, float]:
    p, m = np.asarray(pred), np.asarray(meas)
    if len(p) == 0:
        return {"mape": float("nan"), "p90": float("nan"), "spearman": float("nan"), "n": 0}
    ape = np.abs(p - m) / m
    rho = float(spearmanr(p, m).statistic) if len(p) > 2 else float("nan")
    return {"mape": float(ape.mean()), "p90": float(np.percentile(ape, 90)), "spearman": rho,
            "n": int(len(p))}


def _calibration(workload: str, n: int, seed: int) -> list[dict[str, Any]]:
    """Random policies for the profile's calibration, disjoint from the test set."""
    model = resolve_workload(workload).model
    params = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    rng = random.Random(seed)
    return [random_policy(params, rng).to_dict() for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100mbit,1gbit,5gbit")
    parser.add_argument("--workloads", default="cnn,transformer,mlp")
    parser.add_argument("--policies", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cost_model.json"))
    args = parser.parse_args(argv)
    console = Console(width=200)
    started = time.time()
    cells = []
    for rate in args.rates.split(","):
        with EmulatedCluster(2, parse_link(rate)) as cluster:
            for workload in args.workloads.split(","):
                t0 = time.time()
                profile = profile_job(cluster, workload=workload, budget_s=args.budget_s, link=rate,
                                      calibrate=_calibration(workload, 8, args.seed + 4242))
                timeline = CostModel.fit(profile, residual=False)
                model = CostModel.fit(profile)
                setups = _setups(workload, args.policies, args.seed)
                measured = _measure(cluster, workload, setups, args.rounds, args.block, args.chunk)
                names = [n for n, _ in setups]
                policies = [p for _, p in setups]
                meas = [statistics.median(measured[n]) for n in names]
                pred = [timeline.predict(p).step_s for p in policies]
                ddp = timeline.predict(None)
                pred_res = [model.predict(p).step_s for p in policies]
                cell = {
                    "rate": rate, "workload": workload,
                    "network_dominated": ddp.exposed_comm_s > 0.5 * ddp.step_s,
                    "floor_s": model.compute.floor_s,
                    "timeline": _metrics(pred, meas), "calibrated": _metrics(pred_res, meas),
                    "cv_error": model.cv_error,
                    "rows": [{"name": n, "measured_s": m, "all_s": measured[n], "predicted_s": p,
                              "predicted_residual_s": q,
                              "policy": pol.to_dict() if pol is not None else None}
                             for n, m, p, q, pol in zip(names, meas, pred, pred_res, policies)],
                    "wall_s": time.time() - t0,
                }
                cells.append(cell)
                console.print(f"{rate} {workload}: MAPE {cell['calibrated']['mape']:.3f} "
                              f"(timeline alone {cell['timeline']['mape']:.3f}), Spearman "
                              f"{cell['calibrated']['spearman']:.3f} ({cell['wall_s']:.0f} s)",
                              highlight=False)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(args.out, json.dumps({"benchmark": "cost_model", "cells": cells}, indent=1),
                             AutotuneError, "benchmark results")

    def pooled(select: Any, key: str) -> dict[str, float]:
        rows = [r for c in cells if select(c) for r in c["rows"]]
        return _metrics([r[key] for r in rows], [r["measured_s"] for r in rows])

    summary: dict[str, Any] = {}
    for key, label in (("predicted_s", "timeline"), ("predicted_residual_s", "calibrated")):
        summary[label] = {
            "overall": pooled(lambda c: True, key),
            "network_dominated": pooled(lambda c: c["network_dominated"], key),
            **{rate: pooled(lambda c, r=rate: c["rate"] == r, key) for rate in args.rates.split(",")},
        }
    out = {"benchmark": "cost_model", "args": vars(args) | {"out": str(args.out)},
           "summary": summary, "cells": cells, "wall_s": time.time() - started}
    write_atomic(args.out, json.dumps(out, indent=1), AutotuneError, "benchmark results")

    table = Table(title="cost model: predicted vs measured step time (2 emulated hosts); "
                        "calibrated = the full model with its residual")
    for col in ("scope", "policies", "MAPE", "P90 APE", "Spearman", "timeline alone: MAPE",
                "P90", "Spearman"):
        table.add_column(col, justify="left" if col == "scope" else "right")
    rows = [(f"cell {c['rate']} {c['workload']}" + (" (network)" if c["network_dominated"] else ""),
             c["calibrated"], c["timeline"]) for c in cells]
    rows += [(scope, summary["calibrated"][scope], summary["timeline"][scope])
             for scope in [*args.rates.split(","), "network_dominated", "overall"]]
    for scope, a, b in rows:
        table.add_row(scope, str(a["n"]), f"{a['mape']:.3f}", f"{a['p90']:.3f}", f"{a['spearman']:.3f}",
                      f"{b['mape']:.3f}", f"{b['p90']:.3f}", f"{b['spearman']:.3f}")
    console.print(table)
    console.print(f"wrote {args.out} ({out['wall_s'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
