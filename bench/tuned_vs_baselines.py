"""Benchmark: is the tuned policy never slower than a hand-picked one, and much faster
where the network is the bottleneck?

On 2 emulated hosts (one rank each) at each link rate, for each workload: profile, tune
(default error budget), then measure in one job, interleaved: plain DDP (25 MB, its
default), DDP at 1, 5 and 100 MB buckets (the best bucket size alone), PyTorch's fp16 and
PowerSGD rank 1 and 4 hooks, the tuned policy, and the compute-only floor. The tuned
policy is what ``autotune tune --verify K`` writes (K=0: the prediction alone). Reports
the profile+tune(+verify) wall time too, and the best baseline within the error budget
beside the best of all (PowerSGD's error is over the default budget on cnn and
transformer). Needs root. Writes JSON and prints a table.

    python bench/tuned_vs_baselines.py [--rates 100mbit,1gbit,10gbit] [--workloads cnn,transformer]
                                       [--verify 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autotune.emulate import EmulatedCluster, parse_link
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.launch import launch
from autotune.probes.run import profile_job
from autotune.search.tuner import DEFAULT_MAX_ERROR, tune
from autotune.search.verify import verify_result

SETUPS: list[dict[str, Any]] = [
    {"name": "ddp", "kind": "ddp"},
    {"name": "ddp1mb", "kind": "ddp", "bucket_cap_mb": 1.0},
    {"name": "ddp5mb", "kind": "ddp", "bucket_cap_mb": 5.0},
    {"name": "ddp100mb", "kind": "ddp", "bucket_cap_mb": 100.0},
    {"name": "fp16", "kind": "hook", "hook": "fp16"},
    {"name": "powersgd1", "kind": "hook", "hook": "powersgd", "rank": 1},
    {"name": "powersgd4", "kind": "hook", "hook": "powersgd", "rank": 4},
]
BUCKETS = ("ddp", "ddp1mb", "ddp5mb", "ddp100mb")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit")
    parser.add_argument("--workloads", default="cnn,transformer")
    parser.add_argument("--budget-s", type=float, default=40.0)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--verify", type=int, default=2, metavar="K",
                        help="choose among the K best candidates and 2 best baselines by measurement")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tuned_vs_baselines.json"))
    args = parser.parse_args(argv)
    console = Console(width=220)
    started = time.time()
    cells = []
    for rate in args.rates.split(","):
        with EmulatedCluster(2, parse_link(rate)) as cluster:
            for workload in args.workloads.split(","):
                t0 = time.perf_counter()
                profile = profile_job(cluster, workload=workload, budget_s=args.budget_s, link=rate)
                t1 = time.perf_counter()
                result = tune(profile, trials=args.trials, seed=0, top_k=max(1, args.verify))
                policy, verified = result.policy, None
                if args.verify:
                    policy, verified = verify_result(result, args.verify, workload, cluster)
                t2 = time.perf_counter()
                setups = SETUPS + [{"name": "tuned", "kind": "policy", "policy": policy.to_dict()},
                                   {"name": "floor", "kind": "floor"}]
                measured = launch("autotune.measure:rank_measure", placement=cluster, timeout=7200,
                                  kwargs={"workload": workload, "setups": setups,
                                          "rounds": args.rounds, "block": args.block})[0]
                med = {r["name"]: statistics.median(r["step_s"]) for r in measured["results"]}
                best_bucket = min(BUCKETS, key=lambda n: med[n])
                baselines = [n for n in med if n not in ("tuned", "floor")]
                best = min(baselines, key=lambda n: med[n])
                feasible = [n for n in baselines if result.policy.meta["baselines"][n]["feasible"]]
                best_ok = min(feasible, key=lambda n: med[n])
                cell = {
                    "rate": rate, "workload": workload, "medians_s": med,
                    "best_bucket": best_bucket, "best_baseline": best,
                    "tuned_vs_best_baseline": med["tuned"] / med[best],
                    "best_within_budget": best_ok,
                    "tuned_vs_best_within_budget": med["tuned"] / med[best_ok],
                    "speedup_vs_ddp": med["ddp"] / med["tuned"],
                    "tuned_vs_ddp": med["tuned"] / med["ddp"],
                    "tuned_vs_floor": med["tuned"] / med["floor"],
                    "chosen": policy.meta["chosen"], "policy": policy.to_dict(),
                    "predicted_s": policy.meta["predicted_step_s"], "verified": verified,
                    "error": policy.meta["error"], "max_error": DEFAULT_MAX_ERROR,
                    "profile_s": t1 - t0, "tune_s": t2 - t1,
                    "results": measured["results"],
                }
                cells.append(cell)
                console.print(f"{rate} {workload}: tuned {med['tuned'] * 1e3:.0f} ms, best baseline "
                              f"{best} {med[best] * 1e3:.0f} ms, ddp {med['ddp'] * 1e3:.0f} ms, floor "
                              f"{med['floor'] * 1e3:.0f} ms")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(args.out, json.dumps({"benchmark": "tuned_vs_baselines", "cells": cells}, indent=1),
                             AutotuneError, "benchmark results")
    out = {"benchmark": "tuned_vs_baselines", "args": vars(args) | {"out": str(args.out)},
           "cells": cells, "wall_s": time.time() - started}
    write_atomic(args.out, json.dumps(out, indent=1), AutotuneError, "benchmark results")

    table = Table(title="measured median step time (ms), 2 emulated hosts, interleaved")
    cols = ["link", "workload", "ddp", "best bucket", "fp16", "psgd1", "psgd4", "tuned", "floor",
            "tuned/best", "tuned/best in budget", "ddp/tuned", "tuned/floor", "chosen", "error",
            "profile+tune s"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("link", "workload", "chosen") else "right")
    for c in cells:
        m = c["medians_s"]
        table.add_row(c["rate"], c["workload"], f"{m['ddp'] * 1e3:.0f}",
                      f"{m[c['best_bucket']] * 1e3:.0f} ({c['best_bucket']})", f"{m['fp16'] * 1e3:.0f}",
                      f"{m['powersgd1'] * 1e3:.0f}", f"{m['powersgd4'] * 1e3:.0f}",
                      f"{m['tuned'] * 1e3:.0f}", f"{m['floor'] * 1e3:.0f}",
                      f"{c['tuned_vs_best_baseline']:.3f}",
                      f"{c['tuned_vs_best_within_budget']:.3f} ({c['best_within_budget']})",
                      f"{c['speedup_vs_ddp']:.2f}x", f"{c['tuned_vs_floor']:.2f}", c["chosen"],
                      f"{c['error']:.2f}", f"{c['profile_s'] + c['tune_s']:.0f}")
    console.print(table)
    console.print(f"error budget {DEFAULT_MAX_ERROR} (the default); verify K={args.verify}")
    console.print("targets: tuned/best <= 1.03 in every cell; ddp/tuned >= 3 at 100mbit on cnn; "
                  "tuned/ddp <= 1.02 on the fastest link; tuned/floor <= 1.3 at 1gbit")
    console.print(f"wrote {args.out} ({out['wall_s'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
