"""``autotune bench``: measured step times of a policy and the baselines, interleaved."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from autotune.cli._base import EXIT_OK, Subparsers, add_command, console, positive_int
from autotune.cli.profile import add_cluster_arguments, check_out_path, placement
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.measure import bench_setups, run_bench
from autotune.policies import load_policy
from autotune.presets import DEFAULT_PRESETS, PRESETS
from autotune.runtime.hook import PHASES
from autotune.workloads import resolve_workload

# Baselines as users run them: DDP with its defaults, and PyTorch's own hooks, by preset
# name. The stock bf16 hook needs NCCL, so it is measured only when asked for
# (--baselines ...,bf16).
BASELINES = {p.name: p for p in PRESETS}
DEFAULT_BASELINES = [p.name for p in DEFAULT_PRESETS]


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown baseline {unknown[0]!r}; choose from {', '.join(BASELINES)}")
    return names


def add_bench_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "bench",
        "Train the workload under every configuration in one job, interleaved (A B C A B C),\n"
        "and report median step times (the slowest rank's) next to the compute-only floor.\n"
        "Baselines are PyTorch's own: DDP's defaults, fp16/bf16_compress_hook and powerSGD_hook\n"
        "(on gloo, the stock PowerSGD hook runs with a single bucket, the only way it does\n"
        "not deadlock; the results say so).\n\n"
        "examples:\n  autotune bench --workload cnn --policy policy.json\n"
        "  autotune bench --workload cnn --hosts 2 --nproc-per-node 1 --link 100mbit --json out.json",
    )
    parser.add_argument("--workload", default="cnn",
                        help="built-in name, path/to/file.py:function or package.module:function "
                             "(a file or module is imported: this runs that file's code, as "
                             "`python file.py` would)")
    add_cluster_arguments(parser)
    parser.add_argument("--policy", type=Path, help="a policy to measure beside the baselines")
    parser.add_argument("--baselines", type=_names, default=DEFAULT_BASELINES,
                        help="comma-separated, from " + ",".join(BASELINES) + " (default: "
                             + ",".join(DEFAULT_BASELINES) + "; bf16 is PyTorch's "
                             "bf16_compress_hook, which needs NCCL)")
    parser.add_argument("--steps", type=positive_int, default=12,
                        help="measured steps per configuration (in blocks of --block)")
    parser.add_argument("--block", type=positive_int, default=3, help="consecutive steps per block")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed steps per configuration")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print, per configuration, where each bucket's time goes "
                             "(wait, guard, queue, flatten, encode, each collective, decode, "
                             "copy back; PyTorch's stock hooks: in the hook / after it), in ms "
                             "per step on rank 0 (default: off; the JSON always has it)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write the results as JSON to OUT")
    parser.set_defaults(func=cmd_bench)
    return parser


def measure(workload: str, where: Any, baselines: list[str], policy: Any, steps: int,
            block: int, warmup: int) -> dict[str, Any]:
    """:func:`autotune.measure.run_bench` of the baselines, ``policy`` and the floor,
    ``steps`` per configuration in blocks of ``block``, under a status line."""
    setups = bench_setups(baselines, policy)
    rounds = max(1, -(-steps // block))
    with console().status(
        f"measuring {len(setups)} configurations, {rounds} interleaved blocks of {block} steps"
    ):
        return run_bench(workload, where, setups, rounds=rounds, block=block, warmup=warmup)


def print_bench(result: dict[str, Any]) -> None:
    out = console()
    rows = result["results"]
    ddp = next((r["step_s_median"] for r in rows if r["name"] == "ddp"), None)
    floor = next((r["step_s_median"] for r in rows if r["name"] == "floor"), None)
    link = f", link {result['link']}" if result.get("link") else ""
    table = Table(title=f"measured step time: {result['workload']} on {result['world_size']} ranks{link}")
    for col in ("configuration", "median ms", "vs DDP", "vs floor", "steps", "note"):
        table.add_column(col, justify="left" if col in ("configuration", "note") else "right")
    for r in rows:
        med = r["step_s_median"]
        table.add_row(r["name"], f"{med * 1e3:.1f}", f"{med / ddp:.2f}x" if ddp else "",
                      f"{med / floor:.2f}x" if floor else "", str(len(r["step_s"])), r.get("note", ""))
    out.print(table)


def print_breakdown(result: dict[str, Any]) -> None:
    """One table per configuration: each bucket's time by phase in its last measured
    step, and the mean per step over the measured steps (rank 0's view)."""
    out = console()
    for r in result["results"]:
        bd = r.get("breakdown")
        if bd is None:
            continue
        per_step = bd["per_step_s"]
        order = [p for p in (*PHASES, "in_hook", "after_hook") if p in per_step]
        table = Table(title=f"{r['name']}: where the communication time goes (ms, rank 0; "
                            f"median step {r['step_s_median'] * 1e3:.1f} ms)")
        table.add_column("bucket", justify="left")
        table.add_column("MB", justify="right")
        table.add_column("path", justify="left")
        for phase in order:
            table.add_column(phase, justify="right")
        for b in bd["last_step_buckets"]:
            mb = f"{b['numel'] * 4 / 2**20:.1f}" if "numel" in b else ""
            table.add_row(str(b["index"]), mb, b.get("path", "stock"),
                          *(f"{b['breakdown'].get(p, 0.0) * 1e3:.1f}" for p in order))
        table.add_row("per step", "", f"{bd['buckets_per_step']:.0f} buckets",
                      *(f"{per_step[p] * 1e3:.1f}" for p in order), style="bold")
        out.print(table)


def cmd_bench(args: argparse.Namespace) -> int:
    work = resolve_workload(args.workload)
    policy = None
    if args.policy is not None:
        policy = load_policy(args.policy)
        policy.check(work.model).raise_if_unknown(f"{args.policy} on --workload {args.workload}")
    if args.json is not None:
        check_out_path(args.json, "results")
    if not args.baselines and policy is None:
        raise AutotuneError("nothing to measure: give --policy or at least one baseline")
    with placement(args) as where:
        result = measure(args.workload, where, args.baselines, policy, args.steps, args.block,
                         args.warmup)
    result.update(link=args.link, hosts=args.hosts, nproc_per_node=args.nproc_per_node)
    print_bench(result)
    if args.breakdown:
        print_breakdown(result)
    if args.json is not None:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n", AutotuneError, "results")
        console().print(f"wrote {args.json}")
    return EXIT_OK
