"""``wrap(model, "auto")`` in a plain user script against what its user could run instead.

bench/workloads/live_train.py is a tutorial-style DDP loop with Adam (not a built-in
workload), run by ``autotune launch`` on 2 ranks: unshaped (loopback) or 2 emulated
hosts whose NICs are shaped to the link. Per model (cnn, embed) and link, 200 steps of:

* ``ddp``: DistributedDataParallel as is;
* ``powersgd``: PyTorch's PowerSGD hook, rank 1 (one bucket: gloo deadlocks with more);
* ``static``: the policy an earlier ``auto`` run of the same model and link saved,
  applied with ``wrap(model, "policy.json")`` (the offline-tuned policy of this script:
  ``autotune profile``/``tune`` need a workload function, and this script is not one,
  so the tuning that saw this exact model and link is auto's own, from the previous
  run);
* ``auto``: ``wrap(model, "auto", save=...)``.

Configurations alternate (auto, ddp, powersgd, static, auto, ...) with ``--repeats``
rounds, since CPU speed drifts; the first round's ``static`` uses the ``auto`` run just
before it. Per run: the median of the last 40 steps, the whole run's wall time, degraded
steps (auto: its own count, steps of the exploration over 1.1x DDP's median; and here:
steps over 1.1x the median of the ``ddp`` run of the same round), the final loss (mean of
the last 20 steps over ranks) and whether the ranks' parameters are equal. Every run
goes under ``flock /tmp/bench.lock`` so it never overlaps another benchmark.

    python bench/live_auto.py [--links unshaped,300mbit,100mbit] [--models cnn,embed]
                              [--repeats 2] [--steps 200] [--out bench/results/live_auto.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _links import warm_kernels  # bench/ is on sys.path when a script runs

from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "workloads" / "live_train.py"
MODES = ("auto", "ddp", "powersgd", "static")
TAIL = 40  # steps of the settled median


def run(model: str, mode: str, link: str, steps: int, policy: Path, out: Path) -> dict[str, Any]:
    where = ["--hosts", "1", "--nproc-per-node", "2"] if link == "unshaped" else [
        "--hosts", "2", "--nproc-per-node", "1", "--link", link]
    script_mode = "policy" if mode == "static" else mode
    command = ["flock", "/tmp/bench.lock", sys.executable, "-m", "autotune", "launch", *where,
               "--timeout", "1200", str(SCRIPT), "--model", model, "--mode", script_mode,
               "--steps", str(steps), "--out", str(out)]
    if mode in ("auto", "static"):
        command += ["--policy", str(policy)]
    log = out.with_suffix(".jsonl")  # auto's decision log: its phases' steps
    if mode == "auto":
        command += ["--log", str(log)]
    failures = []
    # a crashed run is reported in the results and run again, up to 3 times in all: plain
    # DDP and stock PowerSGD scripts (nothing of ours) abort at interpreter exit on gloo
    # now and then (4 of 24 runs at stop 31), and twice in a row ended a whole run
    for _ in range(3):
        started = time.perf_counter()
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a crash leaves its stacks
        log.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode == 0:
            break
        failures.append({"status": proc.returncode, "stderr": proc.stderr[-6000:]})
        print(f"{model} {mode} {link} failed ({proc.returncode}):\n{proc.stderr[-3000:]}",
              file=sys.stderr, flush=True)
        if _complete(out, steps):  # it crashed in teardown, after every rank's last step
            failures[-1]["results_kept"] = "rank 0 had written every step's results"
            break
    else:
        raise SystemExit(f"{model} {mode} {link} failed 3 times")
    result = json.loads(out.read_text())
    result.update(link=link, launch_s=time.perf_counter() - started, failures=failures)
    if mode == "auto" and log.exists():  # where each phase began (first events first)
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        result["auto_phases"] = {e["event"]: e["step"] for e in reversed(events)
                                 if e["event"] not in ("announce", "switch")}
        # what a re-search after settling saw: the step and link ratios that moved
        result["auto_drifts"] = [{k: v for k, v in e.items() if k != "trigger"}
                                 for e in events if e["event"] == "drift"]
        log.unlink()
    return result


def _complete(out: Path, steps: int) -> bool:
    """Whether a run's results file holds all its steps (the script writes it after its
    last collective and a barrier, so a rank that aborts at exit cannot cut it short)."""
    try:
        return len(json.loads(out.read_text())["step_s"]) == steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def row(r: dict[str, Any], ddp_median: float | None) -> dict[str, Any]:
    steps = r["step_s"]
    out = {"model": r["model"], "link": r["link"], "mode": r["mode_name"], "round": r["round"],
           "median_last40_s": statistics.median(steps[-TAIL:]), "wall_s": r["wall_s"],
           "final_loss": r["final_loss"], "params_equal": r["params_equal"],
           "failed_runs": r.get("failures", []),
           "degraded_vs_ddp_run": (sum(t > 1.1 * ddp_median for t in steps[2:])
                                   if ddp_median else None)}
    if "auto_phases" in r:
        out["auto_phases"] = r["auto_phases"]  # e.g. searched: the step the search replied
        out["auto_drifts"] = r.get("auto_drifts", [])
    if r.get("auto"):
        a = r["auto"]
        out.update(auto_degraded=a.get("total_degraded_steps", a.get("degraded_steps")),
                   auto_explore_steps=a.get("total_explore_steps", a.get("explore_steps")),
                   auto_explorations=a.get("total_explorations", 1),
                   auto_policy=a.get("policy"), auto_speedup=a.get("speedup"),
                   auto_stall_s=a.get("stall_s"), auto_settled_step=a.get("settled_step"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="unshaped,300mbit,100mbit")
    parser.add_argument("--models", default="cnn,embed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "live_auto.json")
    args = parser.parse_args()

    warm_kernels()
    work = Path(tempfile.mkdtemp(prefix="live-auto-"))
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for link in args.links.split(","):
            policy = work / f"{model}-{link}.json"
            for rnd in range(args.repeats):
                results = {}
                for mode in MODES:
                    if mode == "static" and not policy.exists():
                        print(f"{model:5} {link:9} round {rnd} static   skipped: auto has not "
                              f"settled on a policy in any run so far", flush=True)
                        continue
                    r = run(model, mode, link, args.steps, policy, work / f"{model}-{link}-{mode}-{rnd}.out")
                    r.update(mode_name=mode, round=rnd)
                    results[mode] = r
                    print(f"{model:5} {link:9} round {rnd} {mode:8} "
                          f"median {statistics.median(r['step_s'][-TAIL:]) * 1e3:7.1f} ms  "
                          f"wall {r['wall_s']:6.1f} s  loss {r['final_loss']:.3f}", flush=True)
                ddp = statistics.median(results["ddp"]["step_s"])
                rows += [row(results[m], ddp) for m in MODES if m in results]
                if results["auto"].get("auto"):
                    Path(str(policy) + f".round{rnd}").write_text(policy.read_text())
                args.out.parent.mkdir(parents=True, exist_ok=True)  # atomically, every round
                write_atomic(args.out, json.dumps({"steps": args.steps, "rows": rows,
                                                   "cells": cells(rows)}, indent=1) + "\n",
                             AutotuneError, "benchmark results")
    print_table(rows)


def cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and link, the medians over rounds and auto's targets."""
    out = []
    keys = sorted({(r["model"], r["link"]) for r in rows})
    for model, link in keys:
        by = {m: [r for r in rows if (r["model"], r["link"], r["mode"]) == (model, link, m)]
              for m in MODES}
        med = {m: statistics.median(r["median_last40_s"] for r in rs) for m, rs in by.items() if rs}
        wall = {m: statistics.median(r["wall_s"] for r in rs) for m, rs in by.items() if rs}
        best_static = min(med[m] for m in ("ddp", "powersgd", "static") if m in med)
        auto = by["auto"]
        cell = {"model": model, "link": link, "median_last40_s": med, "wall_s": wall,
                "auto_vs_best_static": med["auto"] / best_static,
                "auto_vs_ddp": med["auto"] / med["ddp"],
                "auto_wall_below_ddp": wall["auto"] < wall["ddp"],
                "auto_degraded_max": max((r.get("auto_degraded") or 0) for r in auto),
                "params_equal": all(r["params_equal"] for m in MODES for r in by[m]),
                "final_loss": {m: statistics.median(r["final_loss"] for r in rs)
                               for m, rs in by.items() if rs},
                "auto_policies": [r.get("auto_policy") for r in auto]}
        cell["targets"] = {
            "settled <= 1.03x best static": cell["auto_vs_best_static"] <= 1.03,
            "wall < ddp": cell["auto_wall_below_ddp"],
            "<= 10 degraded": cell["auto_degraded_max"] <= 10,
            "params equal": cell["params_equal"],
            **({"unshaped <= 1.02x ddp": cell["auto_vs_ddp"] <= 1.02} if link == "unshaped" else {}),
        }
        out.append(cell)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        for r in rows:
            print(r)
        return
    table = Table(title="wrap(model, 'auto') in a plain script, 200 steps, 2 ranks (gloo)")
    for col in ("model", "link", "mode", "round", "last-40 median ms", "wall s", "degraded",
                "final loss", "params equal", "auto chose"):
        table.add_column(col)
    for r in rows:
        degraded = r.get("auto_degraded")
        table.add_row(r["model"], r["link"], r["mode"], str(r["round"]),
                      f"{r['median_last40_s'] * 1e3:.1f}", f"{r['wall_s']:.1f}",
                      f"{degraded} ({r['degraded_vs_ddp_run']})" if degraded is not None else
                      f"({r['degraded_vs_ddp_run']})",
                      f"{r['final_loss']:.3f}", "yes" if r["params_equal"] else "NO",
                      str(r.get("auto_policy") or ""))
    Console().print(table)


if __name__ == "__main__":
    main()
