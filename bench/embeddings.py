"""Benchmark: embedding-heavy models, where the gradient's row structure pays.

For each link and workload: profile (the codec probe measures each parameter's row
density), tune (with ``--verify``-style measurement of the top candidates), then
measure in one job, interleaved: plain DDP, PyTorch's fp16 and PowerSGD rank 1 hooks,
our uniform ``rowsparse`` (every parameter; dense ones go dense by themselves), the
tuned policy, and the compute-only floor. Reports medians, ratios, and the compression
error the tuned policy puts on the embedding tables (the codec probe's measured error
of the compressor it chose for them).

Workloads: ``dlrm`` (six EmbeddingBag tables, 55.7 MB) and a transformer with a 32768-token
vocabulary (bench/workloads/large_vocab.py: a 16 MB row-sparse token embedding, a dense
16 MB head). Links: rates (2 emulated hosts, needs root) and ``unshaped`` (2 local ranks).
Writes JSON (default bench/results/embeddings.json) and prints a table.

    python bench/embeddings.py [--links 300mbit,1gbit,unshaped] [--workloads dlrm,large_vocab]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _links import save_cells, two_ranks  # bench/ is on sys.path when a script runs
from rich.console import Console
from rich.table import Table

from autotune.launch import launch
from autotune.probes.run import profile_job
from autotune.search.defaults import candidate_pool
from autotune.search.tuner import DEFAULT_MAX_ERROR, tune
from autotune.search.verify import DEFAULT_CANDIDATES, verify_result

HERE = Path(__file__).resolve().parent
WORKLOADS = {"dlrm": "dlrm", "large_vocab": str(HERE / "workloads" / "large_vocab.py") + ":make"}
BASELINES: list[dict[str, Any]] = [
    {"name": "ddp", "kind": "ddp"},
    {"name": "fp16", "kind": "hook", "hook": "fp16"},
    {"name": "powersgd1", "kind": "hook", "hook": "powersgd", "rank": 1},
    {"name": "rowsparse", "kind": "policy",
     "policy": {"version": 1, "bucket_cap_mb": 25.0, "default": {"compressor": "rowsparse"}}},
]


def _embedding_errors(profile: Any, policy: Any) -> dict[str, dict[str, Any]]:
    """For each embedding table (a parameter whose rows a step mostly leaves zero), the
    compressor the policy gives it and the probe's measured error of that compressor."""
    from autotune.search.space import ErrorModel, label_of

    errors = ErrorModel(profile)
    out = {}
    for name, s in profile.codecs.structure.items():
        if s.row_density_max > 0.5:
            continue
        label = label_of(policy.spec_for(name).to_dict())
        out[name] = {"compressor": label, "row_density": s.row_density_max,
                     "cum_error": errors.layer_error(label, name)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", default="300mbit,1gbit,unshaped")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--budget-s", type=float, default=40.0, help="profile budget per cell")
    parser.add_argument("--trials", type=int, default=150)
    parser.add_argument("--verify", type=int, default=DEFAULT_CANDIDATES, metavar="K")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/embeddings.json"))
    args = parser.parse_args(argv)
    console = Console(width=200)
    started = time.time()
    cells: list[dict[str, Any]] = []

    def save() -> None:
        save_cells("embeddings", args, cells, started)

    for link in args.links.split(","):
        with two_ranks(link) as where:
            for name in args.workloads.split(","):
                workload = WORKLOADS.get(name, name)
                t0 = time.perf_counter()
                profile = profile_job(where, workload=workload, budget_s=args.budget_s,
                                      link=None if link == "unshaped" else link)
                result = tune(profile, trials=args.trials, seed=0, top_k=candidate_pool(args.verify))
                policy, verified = result.policy, None
                if args.verify:
                    policy, verified = verify_result(result, args.verify, workload, where)
                t1 = time.perf_counter()
                setups = BASELINES + [{"name": "tuned", "kind": "policy", "policy": policy.to_dict()},
                                      {"name": "floor", "kind": "floor"}]
                measured = launch("autotune.measure:rank_measure", placement=where, timeout=7200,
                                  kwargs={"workload": workload, "setups": setups,
                                          "rounds": args.rounds, "block": args.block})[0]
                med = {r["name"]: statistics.median(r["step_s"]) for r in measured["results"]}
                cells.append({
                    "link": link, "workload": name, "medians_s": med,
                    "speedup_vs_ddp": med["ddp"] / med["tuned"],
                    "tuned_vs_powersgd1": med["tuned"] / med["powersgd1"],
                    "tuned_vs_ddp": med["tuned"] / med["ddp"],
                    "chosen": policy.meta.get("chosen"), "policy": policy.to_dict(),
                    "error": policy.meta.get("error"), "max_error": DEFAULT_MAX_ERROR,
                    "embedding_tables": _embedding_errors(profile, policy),
                    "verified": verified, "profile_tune_s": t1 - t0,
                    "results": measured["results"],
                })
                console.print(f"{link} {name}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()))
                save()
    save()

    table = Table(title="embedding-heavy models: median step ms, 2 ranks, interleaved")
    cols = ["link", "workload", "ddp", "fp16", "psgd1", "rowsparse", "tuned", "floor",
            "ddp/tuned", "tuned/psgd1", "tuned/ddp", "tables: compressor (error)", "error", "profile+tune s"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("link", "workload") or col.startswith("tables") else "right")
    for c in cells:
        m = c["medians_s"]
        tables = ", ".join(sorted({f"{t['compressor']} ({t['cum_error'] if t['cum_error'] is None else round(t['cum_error'], 3)})"
                                   for t in c["embedding_tables"].values()}))
        table.add_row(c["link"], c["workload"], *(f"{m[k] * 1e3:.0f}" for k in
                                                  ("ddp", "fp16", "powersgd1", "rowsparse", "tuned", "floor")),
                      f"{c['speedup_vs_ddp']:.2f}x", f"{c['tuned_vs_powersgd1']:.2f}", f"{c['tuned_vs_ddp']:.2f}",
                      tables, f"{c['error']:.3f}" if c["error"] is not None else "", f"{c['profile_tune_s']:.0f}")
    console.print(table)
    console.print("targets: dlrm at 300mbit: ddp/tuned >= 6 and tuned/psgd1 <= 0.7 with error 0 on the "
                  "tables; tuned/ddp <= 1 unshaped")
    console.print(f"wrote {args.out} ({(time.time() - started) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
