"""Benchmark: what the runtime's guard costs (the per-bucket agreement on non-finite
gradients and joined ranks, runtime/hook.py).

2 local ranks (gloo, one thread each). For each case, two copies of the model train
under the same mixed compressing policy, one with ``guard=True`` and one with
``guard=False``, in interleaved blocks (A B B A ...); a step's time is the slowest
rank's. Reports median step times, their ratio, and per compressed bucket the median
time of the guard's work in the hook (finiteness check, issuing the allreduce) and of
the communication thread's wait for its result (from the hook's records).

Writes JSON (default bench/results/guard_overhead.json) and prints a table.

    python bench/guard_overhead.py [--blocks 8] [--block 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from autotune.errors import AutotuneError
from autotune.jsonio import dumps, write_atomic
from autotune.launch import launch, set_rank_threads
from autotune.policies import Policy
from autotune.runtime import wrap
from autotune.workloads import resolve_workload

# (label, workload, bucket_cap_mb): DDP-sized buckets, and many small ones (worst case)
CASES = [("cnn, 25 MB buckets", "cnn", 25.0), ("mlp, 0.25 MB buckets", "mlp", 0.25)]
SPECS = [
    {"compressor": "powersgd", "rank": 4},
    {"compressor": "topk", "ratio": 0.01},
    {"compressor": "int8"},
    {"compressor": "sign"},
    {"compressor": "fp16"},
]


def _policy(model: torch.nn.Module, cap: float) -> Policy:
    names = [n for n, _ in model.named_parameters()]
    layers = {n: SPECS[i % len(SPECS)] for i, n in enumerate(names)}
    return Policy.from_dict({"version": 1, "bucket_cap_mb": cap, "layers": layers})


def rank_guard(workload: str, cap: float, blocks: int, block: int) -> dict[str, Any]:
    set_rank_threads()
    work = resolve_workload(workload)
    runs = {}
    for guard in (True, False):
        model = copy.deepcopy(work.model)
        ddp = wrap(model, _policy(model, cap), guard=guard)
        runs[guard] = (ddp, torch.optim.SGD(model.parameters(), lr=0.01))
    times: dict[bool, list[float]] = {True: [], False: []}
    guard_s: list[float] = []
    wait_s: list[float] = []
    buckets = 0
    step = 0

    def run(guard: bool, count: int, record: bool) -> None:
        nonlocal step, buckets
        ddp, opt = runs[guard]
        for _ in range(count):
            x, y = work.make_batch(step)
            step += 1
            start = time.perf_counter()
            opt.zero_grad()
            work.loss_fn(ddp(x), y).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if record:
                times[guard].append(float(elapsed))
                records = [r for r in ddp.comm_state.last_step_records() if r.compressed]
                buckets = len(records)
                if guard:
                    guard_s.extend(r.guard_s for r in records)
                    wait_s.extend(r.guard_wait_s for r in records)

    for guard in (True, False):
        run(guard, 3, record=False)  # warm-up, past the bucket rebuild
    for b in range(blocks):
        for guard in ((True, False) if b % 2 == 0 else (False, True)):
            run(guard, block, record=True)
    for ddp, _ in runs.values():
        ddp.comm_state.close()
    return {
        "guard_step_s": statistics.median(times[True]),
        "plain_step_s": statistics.median(times[False]),
        "guard_per_bucket_s": statistics.median(guard_s),
        "guard_wait_per_bucket_s": statistics.median(wait_s),
        "compressed_buckets": buckets,
        "steps": len(times[True]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8, help="interleaved blocks per set-up")
    parser.add_argument("--block", type=int, default=5, help="timed steps per block")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "guard_overhead.json")
    args = parser.parse_args(argv)
    console = Console()
    results = []
    for label, workload, cap in CASES:
        r = launch("bench.guard_overhead:rank_guard", 2,
                   {"workload": workload, "cap": cap, "blocks": args.blocks, "block": args.block},
                   timeout=1200)[0]
        results.append({"case": label, **r, "ratio": r["guard_step_s"] / r["plain_step_s"]})
    table = Table(title="guard overhead (2 ranks, gloo, medians of interleaved blocks)")
    for col in ("case", "compressed buckets/step", "step, guard off", "step, guard on", "ratio",
                "guard work/bucket", "guard wait/bucket"):
        table.add_column(col)
    for r in results:
        table.add_row(r["case"], str(r["compressed_buckets"]), f"{r['plain_step_s'] * 1e3:.1f} ms",
                      f"{r['guard_step_s'] * 1e3:.1f} ms", f"{r['ratio']:.3f}",
                      f"{r['guard_per_bucket_s'] * 1e3:.2f} ms",
                      f"{r['guard_wait_per_bucket_s'] * 1e3:.2f} ms")
    console.print(table)
    try:
        write_atomic(args.out, dumps({"blocks": args.blocks, "block": args.block, "results": results}),
                     AutotuneError, "results")
    except AutotuneError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
