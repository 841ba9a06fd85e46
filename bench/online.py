"""Benchmark: online revision when the link changes under a running job.

2 emulated hosts (one rank each), workload cnn. Offline first: a profile and a tuned
policy at 5 Gbit (A) and at 100 Mbit (B). Then one training run starts on policy A with
``online=True``; the link drops from 5 Gbit to 100 Mbit at step 40 and returns at step
120, changed live through the emulated cluster (rank 0 reports its step; the parent
changes the tc rate). Reports, per change: steps to detection and to the switch, and the
median step time over the 20 steps after the switch next to the offline-tuned policy's
for that link (measured on the same link; target >= 0.9 of its throughput within 30 steps
of the change). Then the monitoring overhead with no change: online=True vs
online=False on policy A at 5 Gbit, interleaved (target <= 1 %).

Needs root. Writes JSON and prints tables.

    python bench/online.py [--workload cnn] [--steps 160]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autotune.emulate import EmulatedCluster
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.launch import launch
from autotune.probes.run import profile_job
from autotune.search.tuner import tune

STEP_PREFIX = "@@step "


def rank_online(workload: str, policy: dict[str, Any], profile: str, steps: int,
                log: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """Train under ``policy`` with online revision; rank 0 prints its step for the parent."""
    import torch
    import torch.distributed as dist

    import autotune
    from autotune.launch import set_rank_threads
    from autotune.policies import Policy
    from autotune.workloads import resolve_workload

    set_rank_threads()
    work = resolve_workload(workload)
    ddp = autotune.wrap(work.model, Policy.from_dict(policy), online=True, profile=profile,
                        log=log if dist.get_rank() == 0 else None, **knobs)
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01, momentum=0.9)
    times, policies = [], []
    for step in range(steps):
        if dist.get_rank() == 0:
            print(f"{STEP_PREFIX}{step}", flush=True)
        dist.barrier()  # the link change lands between steps on every rank
        x, y = work.make_batch(step)
        start = time.perf_counter()
        opt.zero_grad()
        work.loss_fn(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
        policies.append(ddp.policy.id)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"step_s": t.tolist(), "policy": policies, "events": ddp.controller.events}


def _measure(cluster: EmulatedCluster, workload: str, setups: list[dict[str, Any]],
             rounds: int, block: int) -> dict[str, list[float]]:
    result = launch("autotune.online:rank_measure", placement=cluster, timeout=3600,
                    kwargs={"workload": workload, "setups": setups, "rounds": rounds, "block": block})[0]
    return {r["name"]: r["step_s"] for r in result["results"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="cnn")
    parser.add_argument("--fast", default="5gbit")
    parser.add_argument("--slow", default="100mbit")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--drop-at", type=int, default=40)
    parser.add_argument("--restore-at", type=int, default=120)
    parser.add_argument("--out", type=Path, default=Path("bench/results/online.json"))
    args = parser.parse_args(argv)
    console = Console(width=200)
    started = time.time()
    knobs = {"check_every": 5, "patience": 2, "threshold": 0.5, "budget_s": 10.0, "trials": 60}
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(2, args.fast) as cluster:
        console.print(f"offline: profile and tune at {args.fast} and at {args.slow}")
        fast_profile = profile_job(cluster, workload=args.workload, budget_s=40.0, link=args.fast)
        fast_policy = tune(fast_profile, seed=0).policy
        cluster.set_link(args.slow)
        slow_profile = profile_job(cluster, workload=args.workload, budget_s=40.0, link=args.slow)
        slow_policy = tune(slow_profile, seed=0).policy
        cluster.set_link(args.fast)
        profile_path = str(Path(tmp) / "profile.json")
        fast_profile.save(profile_path)
        log = str(Path(tmp) / "revisions.jsonl")

        console.print(f"online run: {args.steps} steps, link {args.fast} -> {args.slow} at step "
                      f"{args.drop_at}, back at {args.restore_at}")
        changes = {args.drop_at: args.slow, args.restore_at: args.fast}
        changed_at: dict[int, float] = {}

        def on_line(rank: int, line: str) -> bool:
            if not line.startswith(STEP_PREFIX):
                return False
            step = int(line[len(STEP_PREFIX):])
            if step in changes and step not in changed_at:
                cluster.set_link(changes[step])
                changed_at[step] = time.time()
            return True

        run = launch("online:rank_online", placement=cluster, timeout=3600, on_line=on_line,
                     kwargs={"workload": args.workload, "policy": fast_policy.to_dict(),
                             "profile": profile_path, "steps": args.steps, "log": log,
                             "knobs": knobs})[0]
        revisions = [json.loads(line) for line in Path(log).read_text().splitlines()]

        console.print("offline references and monitoring overhead")
        cluster.set_link(args.slow)
        slow_ref = _measure(cluster, args.workload, [
            {"name": "offline", "kind": "policy", "policy": slow_policy.to_dict()}], 2, 5)["offline"]
        cluster.set_link(args.fast)
        fast = _measure(cluster, args.workload, [
            {"name": "offline", "kind": "policy", "policy": fast_policy.to_dict()},
            {"name": "monitored", "kind": "policy", "policy": fast_policy.to_dict(),
             "online": {"profile": profile_path, **knobs}},
        ], 10, 5)

    events = run["events"]
    steps = run["step_s"]
    rows = []
    for change, link, ref in ((args.drop_at, args.slow, slow_ref), (args.restore_at, args.fast, fast["offline"])):
        after = [e for e in events if e.get("step", -1) >= change]
        drift = next((e["step"] for e in after if e["event"] == "drift"), None)
        switch = next((e["step"] for e in after if e["event"] == "switch"), None)
        window = steps[switch:switch + 20] if switch is not None else []
        within = steps[change + 10:change + 30]
        online_s = statistics.median(window) if window else float("nan")
        ref_s = statistics.median(ref)
        rows.append({
            "change_step": change, "link": link,
            "detect_steps": None if drift is None else drift - change,
            "switch_steps": None if switch is None else switch - change,
            "online_step_s_20_after_switch": online_s, "offline_step_s": ref_s,
            "throughput_vs_offline": ref_s / online_s if window else 0.0,
            "throughput_vs_offline_steps_10_30": ref_s / statistics.median(within) if within else 0.0,
        })
    overhead = statistics.median(fast["monitored"]) / statistics.median(fast["offline"]) - 1
    out = {"benchmark": "online", "workload": args.workload, "knobs": knobs, "rows": rows,
           "monitoring_overhead": overhead, "offline_policies": {
               args.fast: fast_policy.to_dict(), args.slow: slow_policy.to_dict()},
           "run": run, "revisions": revisions, "overhead_runs": fast, "wall_s": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(out, indent=1), AutotuneError, "benchmark results")

    table = Table(title=f"online revision, {args.workload} on 2 emulated hosts (check every "
                        f"{knobs['check_every']} steps, patience {knobs['patience']})")
    for col in ("change at step", "to link", "detected after", "switched after",
                "online ms (20 steps after switch)", "offline-tuned ms", "throughput vs offline",
                "same, steps 10-30 after change"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["change_step"]), r["link"], f"{r['detect_steps']} steps",
                      f"{r['switch_steps']} steps", f"{r['online_step_s_20_after_switch'] * 1e3:.0f}",
                      f"{r['offline_step_s'] * 1e3:.0f}", f"{r['throughput_vs_offline']:.2f}",
                      f"{r['throughput_vs_offline_steps_10_30']:.2f}")
    console.print(table)
    console.print(f"monitoring overhead with no change (online vs offline, {args.fast}, interleaved): "
                  f"{overhead * 100:+.2f} % (target <= 1 %)")
    for e in revisions:
        console.print(f"  step {e.get('step')}: {e['event']} " + ", ".join(
            f"{k}={v}" for k, v in e.items() if k in ("reason", "new_policy", "old_policy", "switch_step",
                                                     "measured_step_s", "predicted_step_s",
                                                     "link_bps_estimate")))
    console.print(f"wrote {args.out} ({out['wall_s'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
