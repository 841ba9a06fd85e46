"""``autotune demo``: the README's main job on a built-in workload.

It trains the workload on local ranks under plain DDP and under a mixed policy,
interleaved, and prints what each compressor put on the wire and the step times.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from autotune.launch import launch
from autotune.policies import Policy
from autotune.workloads import resolve_workload

__all__ = ["mixed_policy", "run_demo"]


def mixed_policy(model: torch.nn.Module, bucket_cap_mb: float = 25.0) -> Policy:
    """A hand-made policy by tensor size: PowerSGD rank 4 for large matrices and
    convolutions, fp16 for mid-sized tensors, plain allreduce for the small ones."""
    layers: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() >= 2 and p.numel() >= 1_000_000:
            layers[name] = {"compressor": "powersgd", "rank": 4}
        elif p.numel() >= 65_536:
            layers[name] = {"compressor": "fp16"}
    return Policy.from_dict(
        {"version": 1, "bucket_cap_mb": bucket_cap_mb, "layers": layers,
         "meta": {"source": "autotune demo: by tensor size"}}
    )


def run_demo(
    console: Console,
    workload: str = "cnn",
    nproc_per_node: int = 2,
    rounds: int = 4,
    block: int = 5,
    out_dir: Path = Path("."),
) -> dict[str, Any]:
    """Train ``workload`` under plain DDP and a mixed policy; print and return results."""
    work = resolve_workload(workload)
    policy = mixed_policy(work.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    policy_path = out_dir / "policy.json"
    policy.save(policy_path)
    params_by_label: dict[str, int] = {}
    for name, p in work.model.named_parameters():
        label = policy.spec_for(name).canonical().label()
        params_by_label[label] = params_by_label.get(label, 0) + p.numel()
    setups = [
        {"name": "ddp", "kind": "ddp", "bucket_cap_mb": policy.bucket_cap_mb},
        {"name": "policy", "kind": "policy", "policy": policy.to_dict()},
    ]
    console.print(
        f"[bold]autotune demo[/bold]: {work.name} on {nproc_per_node} local ranks (gloo), "
        f"plain DDP vs. the policy in {policy_path} ({policy.id}), "
        f"{rounds} interleaved blocks of {block} steps each"
    )
    with console.status("training..."):
        result = launch(
            "autotune.measure:rank_measure",
            nproc_per_node,
            {"workload": workload, "setups": setups, "rounds": rounds, "block": block},
            timeout=900,
        )[0]
    ddp, tuned = result["results"]
    ddp_s = statistics.median(ddp["step_s"])
    tuned_s = statistics.median(tuned["step_s"])

    table = Table(title="bytes each compressor handed to collectives, per step and rank")
    table.add_column("compressor")
    table.add_column("parameters", justify="right")
    table.add_column("bytes/step", justify="right")
    for label, nbytes in sorted(tuned["bytes_by_compressor"].items()):
        table.add_row(label, f"{params_by_label.get(label, 0):,}", f"{nbytes:,}")
    table.add_row("[dim]plain DDP[/dim]", f"{sum(params_by_label.values()):,}",
                  f"{sum(ddp['bytes_by_compressor'].values()):,}")
    console.print(table)
    steps = Table(title="step time (median of the slowest rank)")
    steps.add_column("set-up")
    steps.add_column("median s", justify="right")
    steps.add_column("vs DDP", justify="right")
    steps.add_row("plain DDP", f"{ddp_s:.3f}", "1.00x")
    steps.add_row(f"policy {policy.id}", f"{tuned_s:.3f}", f"{tuned_s / ddp_s:.2f}x")
    console.print(steps)
    return result
