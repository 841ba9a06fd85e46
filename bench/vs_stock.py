"""Benchmark: is autotune's path for a method as fast as PyTorch's own hook for it?

Same method, same buckets, same run. For each workload and link, one job trains, in
interleaved blocks (A B A B ...): plain DDP and our policy ``none`` (25 MB buckets) through
autotune's hook (``native=False``: by default ``wrap`` runs a plain policy without the hook,
as DDP's own allreduce, which is DDP by construction; the hook's ``none`` path is what the
uncompressed buckets of a mixed policy take), and the same ``none`` beside PyTorch's
``allreduce_hook`` (``none/hook``: DDP's averaging as a stock Python hook, which pays what
any hook pays beside DDP's native path);
PyTorch's ``fp16_compress_hook`` and ``bf16_compress_hook`` and our ``fp16``/``bf16``
(25 MB buckets; on gloo, where PyTorch's bf16 hook refuses to run, our bf16 is set
beside its fp16 hook: the same bytes and steps in another dtype); PyTorch's ``powerSGD_hook`` at rank 1 and 4 and our ``powersgd`` at
the same ranks (one bucket holding the whole model: on gloo the stock hook deadlocks or
aborts with two or more). Each pair's ratio is ours/stock of the median step times (the
slowest rank's); its spread is the 10th-90th percentile of the per-block ratios (the
median of our block over the median of the stock block that ran beside it), and its
95% interval a bootstrap of the median of those paired block ratios (pairing cancels
the CPU-speed drift between rounds). A pair is ``faster`` or ``slower`` when the interval
lies on one side of 1, else ``tie``. Also
records, per configuration, where rank 0's communication time goes (autotune's
per-bucket breakdown; PyTorch's hooks: in the hook / after it).

Ours runs as ``autotune.wrap`` builds it, with each gradient a view into its bucket
(``gradient_as_bucket_view=True``); the stock side as users build it, with DDP's default
(False), which copies every gradient into its bucket and back each step. ``--views``
builds the stock side with bucket views too: the same methods on the same DDP.

Links: ``unshaped`` (2 local ranks on loopback) and rates such as ``1gbit`` (2 emulated
hosts, one rank each, tc-shaped NICs; needs root). Writes JSON (default
bench/results/vs_stock.json) and prints a table.

    python bench/vs_stock.py [--workloads cnn,transformer,dlrm] [--links unshaped,1gbit,100mbit]
                             [--rounds 8] [--block 2] [--views]
    python bench/vs_stock.py --show bench/results/vs_stock.json   # a saved run's tables
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _links import save_cells, two_ranks, warm_kernels  # bench/ is on sys.path when a script runs
from rich.console import Console
from rich.table import Table

from autotune.launch import launch
from autotune.runtime.hook import PHASES
from autotune.trials import ratio_interval
from autotune.workloads import resolve_workload

CAP_MB = 25.0  # DDP's default bucket size, and the one fp16/bf16 run with
# (ours, stock) pairs: name of the pair -> (our setup, the stock setup), minus the caps
PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "none/ddp": ({"compressor": "none"}, {"kind": "ddp"}),
    # the same method as a stock hook: PyTorch's allreduce_hook (what any Python hook
    # costs beside DDP's native path is in both; none/ddp has it on our side only)
    "none/hook": ({"compressor": "none"}, {"kind": "hook", "hook": "allreduce"}),
    "fp16": ({"compressor": "fp16"}, {"kind": "hook", "hook": "fp16"}),
    # PyTorch's bf16_compress_hook refuses anything but NCCL: on gloo our bf16 is set
    # beside the stock fp16 hook, the same bytes and the same steps in another dtype
    "bf16": ({"compressor": "bf16"}, {"kind": "hook", "hook": "fp16"}),
    "powersgd1": ({"compressor": "powersgd", "rank": 1}, {"kind": "hook", "hook": "powersgd", "rank": 1}),
    "powersgd4": ({"compressor": "powersgd", "rank": 4}, {"kind": "hook", "hook": "powersgd", "rank": 4}),
}
ONE_BUCKET = ("powersgd1", "powersgd4")


def _setups(workload: str, views: bool = False) -> list[dict[str, Any]]:
    model = resolve_workload(workload).model
    stock_views = {"bucket_view": True} if views else {}
    whole_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1.0
    setups = []
    for pair, (spec, stock) in PAIRS.items():
        cap = whole_mb if pair in ONE_BUCKET else CAP_MB
        policy = {"version": 1, "bucket_cap_mb": cap, "default": spec}
        # through our hook even for none (a plain policy otherwise runs natively, as DDP)
        setups.append({"name": f"ours:{pair}", "kind": "policy", "policy": policy, "native": False})
        setups.append({"name": f"stock:{pair}", **stock, "bucket_cap_mb": cap, **stock_views})
    return setups


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _verdict(interval: list[float]) -> str:
    return "faster" if interval[1] < 1.0 else "slower" if interval[0] > 1.0 else "tie"


def _pair_stats(ours: dict[str, Any], stock: dict[str, Any], block: int) -> dict[str, Any]:
    a, b = ours["step_s"], stock["step_s"]
    blocks = [statistics.median(a[i : i + block]) / statistics.median(b[i : i + block])
              for i in range(0, min(len(a), len(b)), block)]
    # the median of the paired ratios, bootstrapped: ratio_interval over a constant 1
    interval = list(ratio_interval(blocks, [1.0], resamples=10000))
    return {
        "interval": interval, "verdict": _verdict(interval),
        "ours_s": statistics.median(a), "stock_s": statistics.median(b),
        "ratio": statistics.median(a) / statistics.median(b),
        "block_ratios": blocks,
        "spread": [_percentile(blocks, 0.1), _percentile(blocks, 0.9)],
        "ours_iqr_s": [_percentile(a, 0.25), _percentile(a, 0.75)],
        "stock_iqr_s": [_percentile(b, 0.25), _percentile(b, 0.75)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cnn,transformer,dlrm")
    parser.add_argument("--links", default="unshaped,1gbit,100mbit")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved blocks per configuration")
    parser.add_argument("--block", type=int, default=2, help="consecutive steps per block")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--views", action="store_true",
                        help="build the stock side's DDP with gradient_as_bucket_view=True too, as "
                             "wrap builds ours by default (default: DDP's own default, False)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/vs_stock.json"))
    parser.add_argument("--show", type=Path, metavar="JSON", help="print a saved run's tables")
    args = parser.parse_args(argv)
    console = Console(width=200)
    if args.show is not None:
        saved = json.loads(args.show.read_text())
        cells, block = saved["cells"], saved["args"]["block"]
        for c in cells:  # recomputed, so that runs saved before the interval show it
            by_name = {r["name"]: r for r in c["results"]}
            c["pairs"] = {pair: _pair_stats(by_name[f"ours:{pair}"], by_name[f"stock:{pair}"], block)
                          for pair in PAIRS if f"stock:{pair}" in by_name}  # older runs lack some
        _report(console, cells)
        return 0
    warm_kernels()
    started = time.time()
    cells: list[dict[str, Any]] = []

    def save() -> None:
        save_cells("vs_stock", args, cells, started)

    for link in args.links.split(","):
        with two_ranks(link) as where:
            for workload in args.workloads.split(","):
                t0 = time.perf_counter()
                measured = launch("autotune.measure:rank_measure", placement=where, timeout=7200,
                                  kwargs={"workload": workload, "setups": _setups(workload, args.views),
                                          "rounds": args.rounds, "block": args.block,
                                          "warmup": args.warmup})[0]
                by_name = {r["name"]: r for r in measured["results"]}
                pairs = {pair: _pair_stats(by_name[f"ours:{pair}"], by_name[f"stock:{pair}"], args.block)
                         for pair in PAIRS}
                cells.append({"link": link, "workload": workload, "pairs": pairs,
                              "wall_s": time.perf_counter() - t0, "results": measured["results"]})
                console.print(f"{link} {workload}: " + ", ".join(
                    f"{p} {s['ratio']:.3f}" for p, s in pairs.items()) + f" ({cells[-1]['wall_s']:.0f} s)")
                save()
    save()
    _report(console, cells)
    console.print(f"wrote {args.out} ({(time.time() - started) / 60:.1f} min)")
    return 0


def _report(console: Console, cells: list[dict[str, Any]]) -> None:
    """Print the ratio table, the breakdown table and the targets."""
    table = Table(title="ours / stock, same method, same buckets, interleaved (median step ms; "
                        "ratio [95% interval of the paired block ratios' median])")
    table.add_column("link")
    table.add_column("workload")
    for pair in PAIRS:
        table.add_column(pair, justify="right")
    for c in cells:
        table.add_row(c["link"], c["workload"], *(
            f"{s['ours_s'] * 1e3:.0f}/{s['stock_s'] * 1e3:.0f} {s['ratio']:.3f} "
            f"[{s['interval'][0]:.2f}-{s['interval'][1]:.2f}] {s['verdict']}" if s else "–"
            for s in (c["pairs"].get(pair) for pair in PAIRS)))
    console.print(table)

    phases = [p for p in PHASES if any(p in r.get("breakdown", {}).get("per_step_s", {})
                                       for c in cells for r in c["results"])]
    bd = Table(title="where rank 0's communication time goes, ms per step (ours: autotune's "
                     "breakdown; stock: in the hook / after it)")
    for col in ("link", "workload", "configuration", "step", *phases, "in_hook", "after_hook"):
        bd.add_column(col, justify="left" if col in ("link", "workload", "configuration") else "right")
    for c in cells:
        for r in c["results"]:
            per = r.get("breakdown", {}).get("per_step_s", {})
            bd.add_row(c["link"], c["workload"], r["name"], f"{r['step_s_median'] * 1e3:.0f}",
                       *(f"{per[p] * 1e3:.1f}" if p in per else "" for p in (*phases, "in_hook", "after_hook")))
    console.print(bd)
    verdicts = [s["verdict"] for c in cells for s in c["pairs"].values()]
    console.print("targets: ours/stock <= 1.00 in every cell; none/ddp <= 1.01. Pairs: "
                  + ", ".join(f"{verdicts.count(v)} {v}" for v in ("faster", "tie", "slower")))


if __name__ == "__main__":
    sys.exit(main())
