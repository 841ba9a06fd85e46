"""Benchmark: does a tuned policy still converge? And which error budget is safe?

digits classification (scikit-learn's bundled set) on 2 emulated hosts joined by a
100 Mbit link, one rank each. Profile, then tune under several compression-error
budgets (the default among them); train plain DDP and each tuned policy from the same
initial weights for the same number of epochs, evaluating held-out accuracy after every
epoch. Reports final accuracy (target: the default budget's policy within 1 point of
plain DDP), and wall time to reach a target accuracy (ratio to plain DDP).

digits' 26 K parameters make compression pointless on the live link, so the tuner
rightly picks near-lossless fp16 under every budget. To test the budgets themselves,
"stress" rows tune for a what-if link slow enough (``--stress-link``, 1 Mbit) that the
search takes all the compression each budget allows, and train those policies on the
same live link. "stock powersgd" rows train with PyTorch's own ``powerSGD_hook`` (rank 1
and 4, error feedback and warm start, as users run it), at the error the codec probe
measured for the same method: what a budget must admit to allow what users already run.
Needs root. Writes JSON and prints a table.

``--workload transformer`` asks the same of the GPT-style transformer, whose PowerSGD
errors are higher than digits' (rank 4: ~0.74): an "epoch" is then ``--steps-per-epoch``
steps of generated sequences, accuracy is next-token accuracy on held-out ones. Run as
the 100 Mbit cell of bench/tuned_vs_baselines.py sees it, on a faster live link for
time: ``--workload transformer --rate 1gbit --stress-link 100mbit --budgets 0.6,0.8``.
``--workload cnn`` likewise (held-out accuracy on its synthetic images, lr 0.02).

    python bench/convergence.py [--workload digits|transformer|cnn] [--epochs 12]
                                [--budgets 0.2,0.4,0.6,0.8,1.0] [--stress-link 1mbit]
                                [--seeds 0,1,2] [--steps-per-epoch 25]
                                [--policy NAME=policy.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from autotune.emulate import EmulatedCluster
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.launch import launch
from autotune.links import parse_link
from autotune.models.simulator import WhatIf
from autotune.policies import load_policy
from autotune.probes.run import profile_job
from autotune.search.space import ErrorModel
from autotune.search.tuner import DEFAULT_MAX_ERROR, tune


# SGD's learning rate (momentum 0.9) per workload, as each workload's docstring trains it
LR = {"digits": 0.1, "transformer": 0.1, "cnn": 0.02}


def rank_train(policy: dict[str, Any] | None, epochs: int, seed: int = 0,
               lr: float = 0.1, stock_powersgd_rank: int | None = None,
               workload: str = "digits", steps_per_epoch: int | None = None) -> dict[str, Any]:
    """Train ``workload`` (digits, transformer or cnn) under ``policy`` (None: plain DDP, or
    PyTorch's own PowerSGD hook at ``stock_powersgd_rank``, registered as its docs show,
    with error feedback and warm start); held-out accuracy and time per epoch (for
    transformer and cnn, whose data is generated, an "epoch" is ``steps_per_epoch`` steps)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import autotune
    from autotune.launch import set_rank_threads
    from autotune.policies import Policy
    from autotune.measure import one_bucket_cap_mb
    from autotune.workloads import BUILTINS

    set_rank_threads()
    work = BUILTINS[workload](seed=seed)  # type: ignore[call-arg]  # the built-ins take seed
    if policy is not None:
        model = autotune.wrap(work.model, Policy.from_dict(policy))
    else:
        if stock_powersgd_rank is None:
            model = DistributedDataParallel(work.model)
        else:
            model = DistributedDataParallel(work.model, bucket_cap_mb=one_bucket_cap_mb(work.model))
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=stock_powersgd_rank,
                start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True,
                warm_start=True)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(work.model.parameters(), lr=lr, momentum=0.9)
    if steps_per_epoch is None:
        # digits' training split (1797 images, a quarter held out) over the global batch.
        steps_per_epoch = (1797 - math.ceil(0.25 * 1797)) // (32 * dist.get_world_size())
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
    parser.add_argument("--workload", choices=tuple(LR), default="digits")
    parser.add_argument("--steps-per-epoch", type=int, default=25,
                        help="steps between evaluations (digits: its training split)")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in sorted({0.2, 0.4, DEFAULT_MAX_ERROR, 0.8, 1.0})))
    parser.add_argument("--stress-link", default="1mbit",
                        help="what-if link the stress rows are tuned for ('' for none)")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, paired across runs")
    parser.add_argument("--policy", action="append", default=[], metavar="NAME=FILE",
                        help="also train this policy file (e.g. one a tuned_vs_baselines cell "
                             "emitted), its error scored on this run's profile; repeatable")
    parser.add_argument("--target", type=float, default=0.93, help="accuracy to time")
    parser.add_argument("--out", type=Path,
                        help="default: bench/results/convergence.json (digits), "
                             "convergence_<workload>.json (the others)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path("bench/results/" + ("convergence.json" if args.workload == "digits"
                                            else f"convergence_{args.workload}.json"))
    steps_per_epoch = None if args.workload == "digits" else args.steps_per_epoch
    console = Console(width=200)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    seeds = [int(s) for s in args.seeds.split(",")]
    policies: dict[str, Any] = {"ddp": {"policy": None}}
    with EmulatedCluster(2, parse_link(args.rate)) as cluster:
        profile = profile_job(cluster, workload=args.workload, budget_s=30.0, link=args.rate)
        stress = (WhatIf(bandwidth_bps=parse_link(args.stress_link).rate_bps)
                  if args.stress_link else None)
        configs = [(f"tuned@{b:g}", b, None) for b in budgets]
        if stress is not None:
            configs += [(f"stress@{b:g}", b, stress) for b in budgets]
        errors = ErrorModel(profile)
        for name, path in (item.split("=", 1) for item in args.policy):
            policy = load_policy(path)
            used = sorted({spec.label() for spec in (policy.default, *policy.layers.values())})
            # scored as the tuner scores it now, on this profile (its meta: when it was tuned)
            policies[name] = {"policy": policy.to_dict(), "chosen": f"file {path}",
                              "compressors": "+".join(used), "error": errors.of(policy),
                              "error_in_meta": policy.meta.get("error")}
        # the baselines' errors come from a tuning result (a short one if none is asked for)
        result = tune(profile, max_error=DEFAULT_MAX_ERROR, trials=20, seed=0) if not configs else None
        for name, budget, what_if in configs:
            result = tune(profile, max_error=budget, trials=150, seed=0, what_if=what_if)
            name += " (default)" if budget == DEFAULT_MAX_ERROR else ""
            used = sorted({spec.label() for spec in
                           (result.policy.default, *result.policy.layers.values())})
            policies[name] = {"policy": result.policy.to_dict(), "chosen": result.chosen,
                              "compressors": "+".join(used),
                              "error": result.policy.meta["error"],
                              "predicted_s": result.policy.meta["predicted_step_s"]}
        # PyTorch's PowerSGD hook as users run it (error feedback, warm start), at the
        # error the codec probe measured for our equivalent (the same method)
        for rank in (1, 4):
            policies[f"stock powersgd{rank}"] = {
                "policy": None, "stock_powersgd_rank": rank, "chosen": "stock hook",
                "compressors": f"powerSGD_hook(rank={rank})",
                "error": result.policy.meta["baselines"][f"powersgd{rank}"]["error"]}
        # Seed by seed, every configuration in turn (A B C A B C): the seed changes the
        # data split, the initial weights and the shuffling; runs of one seed are paired.
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
        for seed in seeds:
            for name, entry in policies.items():
                run = launch("convergence:rank_train", placement=cluster, timeout=1800,
                             kwargs={"policy": entry["policy"], "epochs": args.epochs,
                                     "seed": seed, "workload": args.workload,
                                     "lr": LR[args.workload],
                                     "steps_per_epoch": steps_per_epoch,
                                     "stock_powersgd_rank": entry.get("stock_powersgd_rank")})[0]
                runs[name].append(run)
                console.print(f"seed {seed} {name}: final accuracy {run['accuracy'][-1]:.3f}")
    rows = []
    for name, seeded in runs.items():
        finals = [run["accuracy"][-1] for run in seeded]
        deltas = [100 * (run["accuracy"][-1] - base["accuracy"][-1])
                  for run, base in zip(seeded, runs["ddp"])]
        ratios = []
        for run, base in zip(seeded, runs["ddp"]):
            t_run, t_base = _time_to(args.target, run), _time_to(args.target, base)
            ratios.append(t_run / t_base if t_run and t_base else None)
        reached = [r for r in ratios if r is not None]
        entry = {k: v for k, v in policies[name].items()
                 if v is not None or k not in ("policy", "stock_powersgd_rank")}
        rows.append({
            "name": name, "final_accuracy_mean": statistics.mean(finals),
            "vs_ddp_points_mean": statistics.mean(deltas), "vs_ddp_points_worst": min(deltas),
            "train_s_median": statistics.median(run["train_s"][-1] for run in seeded),
            "time_to_target_ratio_median": statistics.median(reached) if reached else None,
            "target_reached": f"{len(reached)}/{len(seeded)}",
            **entry, "runs": seeded,
        })
    out = {"benchmark": "convergence", "workload": args.workload, "rate": args.rate,
           "epochs": args.epochs, "steps_per_epoch": steps_per_epoch,
           "seeds": seeds, "stress_link": args.stress_link,
           "target_accuracy": args.target, "default_max_error": DEFAULT_MAX_ERROR, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(out, indent=1), AutotuneError, "benchmark results")
    table = Table(title=f"{args.workload}, 2 hosts at {args.rate}, {args.epochs} epochs"
                        + (f" of {steps_per_epoch} steps" if steps_per_epoch else "")
                        + f", seeds {args.seeds}"
                        f" (paired: same split, weights and shuffling per seed)")
    for col in ("run", "policy error", "chosen", "compressors", "final accuracy (mean)",
                "vs DDP points (mean)", "vs DDP points (worst)", "train s (median)",
                f"time to {args.target:.0%} / DDP (median)"):
        table.add_column(col, justify="left" if col in ("run", "chosen", "compressors") else "right")
    for r in rows:
        ratio = r["time_to_target_ratio_median"]
        table.add_row(r["name"], f"{r['error']:.3f}" if "error" in r else "0", r.get("chosen", ""),
                      r.get("compressors", ""), f"{r['final_accuracy_mean']:.3f}",
                      f"{r['vs_ddp_points_mean']:+.1f}", f"{r['vs_ddp_points_worst']:+.1f}",
                      f"{r['train_s_median']:.1f}",
                      (f"{ratio:.2f}" if ratio is not None else "not reached")
                      + ("" if r["target_reached"] == f"{len(seeds)}/{len(seeds)}"
                         else f" ({r['target_reached']} reached)"))
    console.print(table)
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
