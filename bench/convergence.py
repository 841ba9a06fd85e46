"""Benchmark: does a tuned policy still converge? And which error budget is safe?

digits classification (scikit-learn's bundled set) on 2 emulated hosts joined by a
100 Mbit link, one rank each. Profile, then tune under several compression-error
budgets (the default among them); train plain DDP and each tuned policy from the same
initial weights for the same number of epochs, evaluating held-out accuracy after every
epoch. Reports final accuracy (target: the default budget's policy within 1 point of
plain DDP), and wall time to reach a target accuracy (ratio to plain DDP).
Needs root. Writes JSON and prints a table.

    python bench/convergence.py [--epochs 12] [--budgets 0.3,0.6,0.85,0.95,1.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from autotune.emulate import EmulatedCluster, parse_link
from autotune.launch import launch
from autotune.probes.profile import Profile
from autotune.search.tuner import DEFAULT_MAX_ERROR, tune


def rank_train(policy: dict[str, Any] | None, epochs: int, lr: float = 0.1) -> dict[str, Any]:
    """Train digits under ``policy`` (None: plain DDP); accuracy and time per epoch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import autotune
    from autotune.launch import set_rank_threads
    from autotune.policies import Policy
    from autotune.workloads import digits

    set_rank_threads()
    work = digits()
    model = (DistributedDataParallel(work.model) if policy is None
             else autotune.wrap(work.model, Policy.from_dict(policy)))
    opt = torch.optim.SGD(work.model.parameters(), lr=lr, momentum=0.9)
    steps_per_epoch = 1437 // (32 * dist.get_world_size())  # training split / global batch
    accuracy, seconds = [], []
    elapsed = 0.0
    step = 0
    for _ in range(epochs):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps_per_epoch):
            x, y = work.make_batch(step)
            opt.zero_grad()
            work.loss_fn(model(x), y).backward()
            opt.step()
            step += 1
        elapsed += time.perf_counter() - start
        seconds.append(elapsed)
        accuracy.append(work.evaluate(work.model))
    return {"accuracy": accuracy, "train_s": seconds, "steps": step}


def _time_to(target: float, run: dict[str, Any]) -> float | None:
    for acc, t in zip(run["accuracy"], run["train_s"]):
        if acc >= target:
            return t
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--budgets", default=f"0.3,0.6,{DEFAULT_MAX_ERROR},0.95,1.5")
    parser.add_argument("--target", type=float, default=0.93, help="accuracy to time")
    parser.add_argument("--out", type=Path, default=Path("bench/results/convergence.json"))
    args = parser.parse_args(argv)
    console = Console(width=200)
    budgets = [float(b) for b in args.budgets.split(",")]
    runs: dict[str, dict[str, Any]] = {}
    policies: dict[str, Any] = {}
    with EmulatedCluster(2, parse_link(args.rate)) as cluster:
        profile = Profile.from_dict(launch(
            "autotune.probes.run:rank_profile", placement=cluster, timeout=1800,
            kwargs={"workload": "digits", "budget_s": 30.0, "link": args.rate},
        )[0])
        runs["ddp"] = launch("convergence:rank_train", placement=cluster, timeout=1800,
                             kwargs={"policy": None, "epochs": args.epochs})[0]
        for budget in budgets:
            result = tune(profile, max_error=budget, trials=150, seed=0)
            name = f"tuned@{budget:g}" + (" (default)" if budget == DEFAULT_MAX_ERROR else "")
            policies[name] = {"policy": result.policy.to_dict(), "chosen": result.chosen,
                              "error": result.policy.meta["error"],
                              "predicted_s": result.policy.meta["predicted_step_s"]}
            runs[name] = launch("convergence:rank_train", placement=cluster, timeout=1800,
                                kwargs={"policy": result.policy.to_dict(), "epochs": args.epochs})[0]
            console.print(f"{name}: final accuracy {runs[name]['accuracy'][-1]:.3f}")
    base = runs["ddp"]
    rows = []
    for name, run in runs.items():
        t_target = _time_to(args.target, run)
        t_base = _time_to(args.target, base)
        rows.append({
            "name": name, "final_accuracy": run["accuracy"][-1],
            "vs_ddp_points": 100 * (run["accuracy"][-1] - base["accuracy"][-1]),
            "train_s": run["train_s"][-1], "time_to_target_s": t_target,
            "time_to_target_ratio": (t_target / t_base) if t_target and t_base else None,
            **policies.get(name, {}), "curve": run["accuracy"],
        })
    out = {"benchmark": "convergence", "workload": "digits", "rate": args.rate, "epochs": args.epochs,
           "target_accuracy": args.target, "default_max_error": DEFAULT_MAX_ERROR, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    table = Table(title=f"digits, 2 hosts at {args.rate}, {args.epochs} epochs, same initial weights")
    for col in ("run", "policy error", "chosen", "final accuracy", "vs DDP (points)", "train s",
                f"s to {args.target:.0%}", "ratio to DDP"):
        table.add_column(col, justify="left" if col in ("run", "chosen") else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['error']:.3f}" if "error" in r else "0", r.get("chosen", ""),
                      f"{r['final_accuracy']:.3f}", f"{r['vs_ddp_points']:+.1f}", f"{r['train_s']:.1f}",
                      f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] else "not reached",
                      f"{r['time_to_target_ratio']:.2f}" if r["time_to_target_ratio"] else "")
    console.print(table)
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
