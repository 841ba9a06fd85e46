"""Benchmark: hierarchical exchange (sum inside each host, compress only between hosts)
against the flat one, on 2 emulated hosts x 2 ranks.

For each link and workload, one job on an emulated cluster (``--hosts`` x
``--nproc-per-node`` ranks; inside a host the ranks talk over the host's loopback,
unshaped; between hosts over tc-shaped NICs; needs root) trains, in interleaved blocks
(A B A B ...): plain DDP; PyTorch's ``powerSGD_hook`` rank 1 (flat, one bucket: on gloo
the stock hook deadlocks with two or more); and ours flat vs ours hierarchical with the
same method: ``none`` and ``fp16`` (25 MB buckets), PowerSGD rank 1 (one bucket) and,
where the model has row-sparse gradients, ``rowsparse`` on its embeddings. Reports the
median step (the slowest rank's) of each, hierarchical/flat per method, and rank 0's
per-bucket breakdown (where the intra-host stages show as intra_reduce/intra_share).

With ``--tune`` (the default) each cell first does what a user would: profile the same
cluster, tune (the study searches flat and hierarchical per policy) and verify; the
written policy is then measured as ``tuned`` beside the others, and the cost model
fitted on that profile predicts every configuration: the error of its predicted ratio to
DDP against the measured one is the model's accuracy on the cell (also given for the
model refitted with verification's measurements learned, as ``autotune tune`` stores
the profile). Each cell's profile is
written beside ``--out`` (for ``autotune simulate --hosts`` what-ifs).

    python bench/hierarchical.py [--workloads cnn,dlrm] [--links 1gbit,100mbit]
                                 [--hosts 2] [--nproc-per-node 2] [--rounds 5] [--block 2]
                                 [--no-tune] [--budget-s 40] [--verify 4]
    python bench/hierarchical.py --show RESULTS.json [RESULTS.json ...]   # tables only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _links import save_cells  # bench/ is on sys.path when a script runs
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.emulate import EmulatedCluster
from autotune.launch import launch
from autotune.links import parse_link
from autotune.models.cost_model import CostModel
from autotune.policies import Policy
from autotune.probes.run import profile_job
from autotune.runtime.hook import PHASES
from autotune.search.defaults import candidate_pool
from autotune.search.space import ErrorModel
from autotune.search.tuner import DEFAULT_MAX_ERROR, tune
from autotune.search.verify import DEFAULT_BUDGET_S, DEFAULT_CANDIDATES, learned, verify_result
from autotune.trials import ratio_interval
from autotune.workloads import resolve_workload

CAP_MB = 25.0
METHODS: dict[str, dict[str, Any]] = {
    "none": {"compressor": "none"},
    "fp16": {"compressor": "fp16"},
    "powersgd1": {"compressor": "powersgd", "rank": 1},
}
ONE_BUCKET = ("powersgd1",)


def _setups(workload: str) -> tuple[list[dict[str, Any]], list[str]]:
    model = resolve_workload(workload).model
    whole_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1.0
    setups: list[dict[str, Any]] = [
        {"name": "ddp", "kind": "ddp", "bucket_cap_mb": CAP_MB},
        {"name": "stock:powersgd1", "kind": "hook", "hook": "powersgd", "rank": 1,
         "bucket_cap_mb": whole_mb},
    ]
    methods = dict(METHODS)
    embeddings = [n for n, m in model.named_modules() if type(m).__name__ in ("Embedding", "EmbeddingBag")]
    layers: dict[str, dict[str, Any]] = {}
    if embeddings:  # exact row exchange on the tables, plain allreduce elsewhere
        layers = {f"{n}.weight": {"compressor": "rowsparse"} for n in embeddings}
        methods["rowsparse"] = {"compressor": "none"}
    for method, spec in methods.items():
        cap = whole_mb if method in ONE_BUCKET else CAP_MB
        for topology in ("flat", "hierarchical"):
            policy = {"version": 1, "bucket_cap_mb": cap, "topology": topology, "default": spec,
                      "layers": layers if method == "rowsparse" else {}}
            setups.append({"name": f"{topology}:{method}", "kind": "policy", "policy": policy})
    return setups, list(methods)


def _policy_of(setup: dict[str, Any]) -> Policy:
    """Our policy for a set-up (plain DDP and the stock hook: ours for the same method
    and buckets), as the cost model is asked about it."""
    if setup["kind"] == "policy":
        return Policy.from_dict(setup["policy"])
    spec = ({"compressor": "none"} if setup["kind"] == "ddp"
            else {"compressor": "powersgd", "rank": setup["rank"]})
    return Policy.from_dict({"version": 1, "bucket_cap_mb": setup["bucket_cap_mb"], "default": spec})


def model_accuracy(model: CostModel, setups: list[dict[str, Any]], med: dict[str, float]) -> dict[str, Any]:
    """The cost model's predicted ratio to DDP of every set-up against the measured one.
    Its accuracy is over our own set-ups (plain DDP is ours with ``none``): the stock hook
    is PyTorch's implementation, which the model does not describe (it is asked about
    ours for the same method), so its error is listed apart."""
    predicted = {s["name"]: model.predict(_policy_of(s)).step_s for s in setups}
    errors = {n: (predicted[n] / predicted["ddp"]) / (med[n] / med["ddp"]) - 1
              for n in predicted if n != "ddp"}
    size = sorted(abs(e) for n, e in errors.items() if not n.startswith("stock:"))
    return {"predicted_s": predicted, "ratio_error": errors,
            "median_ratio_error": statistics.median(size), "max_ratio_error": size[-1]}


def _span(cell: dict[str, Any], rival: str) -> str:
    """The 95% bootstrap interval of the tuned policy's median over ``rival``'s, from
    the cell's measured steps."""
    steps = {r["name"]: r["step_s"] for r in cell["results"]}
    low, high = ratio_interval(steps["tuned"], steps[rival])
    return escape(f"[{low:.2f}-{high:.2f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cnn,dlrm")
    parser.add_argument("--links", default="1gbit,100mbit")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved blocks per configuration")
    parser.add_argument("--block", type=int, default=2, help="consecutive steps per block")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                        help="profile, tune and verify each cell, and measure the written policy")
    parser.add_argument("--budget-s", type=float, default=40.0, help="profile budget per cell")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--verify", type=int, default=DEFAULT_CANDIDATES, metavar="K")
    parser.add_argument("--verify-budget", type=float, default=DEFAULT_BUDGET_S)
    parser.add_argument("--out", type=Path, default=Path("bench/results/hierarchical.json"))
    parser.add_argument("--show", type=Path, nargs="+", metavar="RESULTS",
                        help="print the tables of saved results (several runs' cells together) "
                             "and measure nothing")
    args = parser.parse_args(argv)
    console = Console(width=220)
    if args.show:
        runs = [json.loads(path.read_text()) for path in args.show]
        print_tables(console, [c for run in runs for c in run["cells"]],
                     runs[0]["args"]["hosts"], runs[0]["args"]["nproc_per_node"])
        return 0
    started = time.time()
    cells: list[dict[str, Any]] = []

    for link in args.links.split(","):
        with EmulatedCluster(args.hosts, parse_link(link), nproc_per_node=args.nproc_per_node) as cluster:
            for workload in args.workloads.split(","):
                t0 = time.perf_counter()
                setups, methods = _setups(workload)
                tuned: dict[str, Any] = {}
                if args.tune:
                    profile = profile_job(cluster, workload=workload, budget_s=args.budget_s, link=link)
                    profile.save(args.out.with_name(f"{args.out.stem}_{link}_{workload}.profile.json"))
                    result = tune(profile, trials=args.trials, seed=0, top_k=candidate_pool(args.verify))
                    policy, verified = verify_result(result, args.verify, workload, cluster,
                                                     budget_s=args.verify_budget)
                    setups.append({"name": "tuned", "kind": "policy", "policy": policy.to_dict()})
                    errors = ErrorModel(profile)
                    tuned = {"policy": policy.to_dict(), "chosen": policy.meta.get("chosen"),
                             "topology": policy.topology, "verified": verified,
                             "profile_tune_verify_s": time.perf_counter() - t0,
                             "max_error": float(policy.meta.get("max_error", DEFAULT_MAX_ERROR)),
                             "errors": {s["name"]: errors.of(_policy_of(s)) for s in setups},
                             "model": CostModel.fit(profile),
                             # what `autotune tune` stores: the profile with verification's
                             # measurements learned (the next fit's residual uses them)
                             "model_learned": CostModel.fit(
                                 replace(profile, calibration=learned(profile.calibration, verified)))}
                measured = launch("autotune.measure:rank_measure", placement=cluster, timeout=7200,
                                  kwargs={"workload": workload, "setups": setups,
                                          "rounds": args.rounds, "block": args.block,
                                          "warmup": args.warmup})[0]
                by_name = {r["name"]: r for r in measured["results"]}
                med = {n: statistics.median(r["step_s"]) for n, r in by_name.items()}
                ratios = {m: med[f"hierarchical:{m}"] / med[f"flat:{m}"] for m in methods}
                cells.append({"link": link, "workload": workload, "median_s": med,
                              "hierarchical_over_flat": ratios, "methods": methods,
                              "wall_s": time.perf_counter() - t0, "results": measured["results"]})
                if tuned:
                    model, model_learned = tuned.pop("model"), tuned.pop("model_learned")
                    others = [n for n in med if n != "tuned"]
                    best = min(others, key=med.__getitem__)
                    ok = min((n for n in others if tuned["errors"][n] <= tuned["max_error"]),
                             key=med.__getitem__)
                    cells[-1]["tuned"] = tuned | {"best_other": best,
                                                  "tuned_over_best": med["tuned"] / med[best],
                                                  "best_within_budget": ok,
                                                  "tuned_over_best_within_budget": med["tuned"] / med[ok]}
                    cells[-1]["model_accuracy"] = model_accuracy(model, setups, med)
                    cells[-1]["model_accuracy_after_verify"] = model_accuracy(model_learned, setups, med)
                console.print(f"{link} {workload}: " + ", ".join(
                    f"{m} {r:.3f}" for m, r in ratios.items()) + f" ({cells[-1]['wall_s']:.0f} s)"
                    + (f"; tuned {tuned['chosen']} {cells[-1]['tuned']['tuned_over_best']:.3f}x the best "
                       f"other ({cells[-1]['tuned']['best_other']}), model ratio error median "
                       f"{cells[-1]['model_accuracy']['median_ratio_error']:.1%}" if tuned else ""))
                save_cells("hierarchical", args, cells, started)
    print_tables(console, cells, args.hosts, args.nproc_per_node)
    console.print(f"wrote {args.out} ({(time.time() - started) / 60:.1f} min)")
    return 0


def print_tables(console: Console, cells: list[dict[str, Any]], hosts: int, nproc_per_node: int) -> None:
    """The benchmark's tables for ``cells`` (of one run, or of several with --show)."""
    table = Table(title=f"{hosts} hosts x {nproc_per_node} ranks: median step ms "
                        "(slowest rank), interleaved; hier/flat = hierarchical over flat, same method")
    for col in ("link", "workload", "ddp", "stock PowerSGD r1", "method", "flat", "hierarchical", "hier/flat"):
        table.add_column(col, justify="left" if col in ("link", "workload", "method") else "right")
    for c in cells:
        med = c["median_s"]
        for i, m in enumerate(c["methods"]):
            first = i == 0
            table.add_row(c["link"] if first else "", c["workload"] if first else "",
                          f"{med['ddp'] * 1e3:.0f}" if first else "",
                          f"{med['stock:powersgd1'] * 1e3:.0f}" if first else "", m,
                          f"{med[f'flat:{m}'] * 1e3:.0f}", f"{med[f'hierarchical:{m}'] * 1e3:.0f}",
                          f"{c['hierarchical_over_flat'][m]:.3f}")
    console.print(table)
    if any("tuned" in c for c in cells):
        tt = Table(title="the policy autotune wrote for the cell (profile, tune, verify on the same cluster) "
                         "against the others measured, and the cost model's error of the predicted ratio "
                         "to DDP over our set-ups")
        for col in ("link", "workload", "tuned ms", "chosen", "topology", "tuned/best other (95% interval)",
                    "tuned/best within budget (95% interval)", "model ratio error: median", "max",
                    "after verify: median", "max",
                    "stock PowerSGD r1 (not modelled)", "profile+tune+verify s"):
            tt.add_column(col, justify="left" if col in ("link", "workload", "chosen", "topology") else "right")
        for c in cells:
            if "tuned" in c:
                t, a = c["tuned"], c["model_accuracy"]
                v = c.get("model_accuracy_after_verify", a)
                tt.add_row(c["link"], c["workload"], f"{c['median_s']['tuned'] * 1e3:.0f}", str(t["chosen"]),
                           t["topology"], f"{t['tuned_over_best']:.3f} {_span(c, t['best_other'])} "
                           f"({t['best_other']}, error {t['errors'][t['best_other']]:.2f})",
                           f"{t['tuned_over_best_within_budget']:.3f} "
                           f"{_span(c, t['best_within_budget'])} ({t['best_within_budget']})",
                           f"{a['median_ratio_error']:.1%}", f"{a['max_ratio_error']:.1%}",
                           f"{v['median_ratio_error']:.1%}", f"{v['max_ratio_error']:.1%}",
                           f"{a['ratio_error']['stock:powersgd1']:+.1%}", f"{t['profile_tune_verify_s']:.0f}")
        console.print(tt)

    phases = [p for p in PHASES if any(p in r.get("breakdown", {}).get("per_step_s", {})
                                       for c in cells for r in c["results"])]
    bd = Table(title="rank 0 (a host leader): ms per step by phase")
    for col in ("link", "workload", "configuration", "step", *phases):
        bd.add_column(col, justify="left" if col in ("link", "workload", "configuration") else "right")
    for c in cells:
        for r in c["results"]:
            per = r.get("breakdown", {}).get("per_step_s", {})
            if per:
                bd.add_row(c["link"], c["workload"], r["name"], f"{r['step_s_median'] * 1e3:.0f}",
                           *(f"{per[p] * 1e3:.1f}" if p in per else "" for p in phases))
    console.print(bd)
    console.print("targets: hierarchical <= 0.7x flat with the same method at 100 Mbit; tuned <= 1.00x "
                  "the best of the others; model ratio error <= 10%")


if __name__ == "__main__":
    sys.exit(main())
