"""Benchmark: what autotune's hook costs, and what each compressor sends and costs.

2 local ranks (gloo, one thread each), built-in ``cnn``. Two interleaved runs:

1. plain DDP vs ``wrap`` with policy ``none`` (target: ratio <= 1.03), many rounds;
2. every compressor applied to the whole model, each with its measured wire bytes per
   step (next to what ``wire_bytes`` declares) and its median step time.

Writes JSON (default bench/results/hook_overhead.json) and prints a table.

    python bench/hook_overhead.py [--rounds 20] [--block 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autotune import compressors
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.launch import local_placement
from autotune.measure import run_bench
from autotune.policies import Policy
from autotune.workloads import resolve_workload

COMPRESSORS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("powersgd1", {"compressor": "powersgd", "rank": 1}),
    ("powersgd4", {"compressor": "powersgd", "rank": 4}),
    ("topk", {"compressor": "topk", "ratio": 0.01}),
    ("int8", {}),
    ("sign", {}),
]


def _policy(name: str, spec: dict) -> dict:
    spec = spec or {"compressor": name}
    return Policy.from_dict({"version": 1, "default": spec}).to_dict()


def _declared_bytes(workload: str, spec: dict, world: int) -> int:
    comp = compressors.create(spec["compressor"], **{k: v for k, v in spec.items() if k != "compressor"})
    model = resolve_workload(workload).model
    return sum(comp.wire_bytes(tuple(p.shape), world) for p in model.parameters() if p.requires_grad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="cnn")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved blocks, run 1")
    parser.add_argument("--rounds-all", type=int, default=5, help="interleaved blocks, run 2")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--out", type=Path, default=Path("bench/results/hook_overhead.json"))
    args = parser.parse_args(argv)
    console = Console()
    world = 2
    started = time.time()

    console.print(f"run 1: plain DDP vs wrap(policy none), {args.rounds} x {args.block} steps each")
    overhead = run_bench(args.workload, local_placement(world),
                         [{"name": "ddp", "kind": "ddp"}, {"name": "none", "policy": _policy("none", {})}],
                         rounds=args.rounds, block=args.block, timeout=1800)
    med = {r["name"]: statistics.median(r["step_s"]) for r in overhead["results"]}
    ratio = med["none"] / med["ddp"]

    console.print(f"run 2: every compressor, {args.rounds_all} x {args.block} steps each")
    setups = [{"name": "ddp", "kind": "ddp"}] + [
        {"name": name, "policy": _policy(name, spec)} for name, spec in COMPRESSORS
    ]
    each = run_bench(args.workload, local_placement(world), setups, rounds=args.rounds_all,
                     block=args.block, timeout=3600)
    ddp_median = statistics.median(each["results"][0]["step_s"])
    rows = []
    for r, (name, spec) in zip(each["results"][1:], COMPRESSORS):
        spec = spec or {"compressor": name}
        median = statistics.median(r["step_s"])
        rows.append({
            "name": name,
            "spec": spec,
            "wire_bytes_measured": sum(r["bytes_by_compressor"].values()),
            "wire_bytes_declared": _declared_bytes(args.workload, spec, world),
            "step_s_median": median,
            "vs_ddp": median / ddp_median,
            "step_s": r["step_s"],
        })

    out = {
        "benchmark": "hook_overhead",
        "workload": args.workload,
        "world_size": world,
        "overhead": {
            "ddp_step_s_median": med["ddp"],
            "none_step_s_median": med["none"],
            "ratio": ratio,
            "target": 1.03,
            "results": overhead["results"],
        },
        "compressors": {"ddp_step_s_median": ddp_median, "results": rows},
        "wall_s": time.time() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(out, indent=2), AutotuneError, "benchmark results")

    t1 = Table(title=f"hook overhead ({args.workload}, 2 ranks, {args.rounds}x{args.block} steps each, interleaved)")
    for col in ("set-up", "median step s", "ratio to DDP"):
        t1.add_column(col, justify="right" if col != "set-up" else "left")
    t1.add_row("plain DDP", f"{med['ddp']:.4f}", "1.000")
    t1.add_row("wrap, policy none", f"{med['none']:.4f}", f"{ratio:.3f} (target <= 1.03)")
    console.print(t1)
    t2 = Table(title=f"each compressor on the whole model ({args.rounds_all}x{args.block} steps each, interleaved)")
    for col in ("compressor", "wire bytes/step (measured)", "declared", "median step s", "vs DDP"):
        t2.add_column(col, justify="left" if col == "compressor" else "right")
    t2.add_row("plain DDP", "", "", f"{ddp_median:.4f}", "1.00")
    for row in rows:
        t2.add_row(row["name"], f"{row['wire_bytes_measured']:,}", f"{row['wire_bytes_declared']:,}",
                   f"{row['step_s_median']:.4f}", f"{row['vs_ddp']:.2f}")
    console.print(t2)
    console.print(f"wrote {args.out} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
