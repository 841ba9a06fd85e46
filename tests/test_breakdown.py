"""The fast path and its breakdown, on real 2-process gloo groups: fp16/bf16 go the way
PyTorch's own hooks go and give their results bit for bit; every bucket's time is
broken down by phase; `autotune bench --breakdown` shows it per configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_runtime import Net, _batch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import autotune
from autotune import Policy
from autotune.runtime.hook import PHASES

pytestmark = pytest.mark.multirank  # every test here starts ranks

STOCK = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def rank_half_vs_stock(compressor: str, steps: int = 5) -> list[bool]:
    """Per step: are our gradients bitwise the stock hook's, on the same buckets?"""
    torch.manual_seed(0)
    ours_model = Net()
    stock_model = Net()
    stock_model.load_state_dict(ours_model.state_dict())
    ours = autotune.wrap(ours_model, Policy.from_dict(
        {"version": 1, "bucket_cap_mb": 0.05, "default": {"compressor": compressor}}))
    stock = DDP(stock_model, bucket_cap_mb=0.05)
    stock.register_comm_hook(None, STOCK[compressor])
    equal = []
    for step in range(steps):
        x, y = _batch(step)
        for model in (ours, stock):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
        equal.append(all(torch.equal(a.grad, b.grad)
                         for a, b in zip(ours_model.parameters(), stock_model.parameters())))
    paths = {r.compressed for r in ours.comm_state.last_step_records()}
    return equal + [paths == {False}]


@pytest.mark.parametrize("compressor", [
    "fp16",
    pytest.param("bf16", marks=pytest.mark.skip(
        reason="PyTorch's bf16_compress_hook needs CUDA 11+ and NCCL 2.10+; this suite runs on gloo")),
])
def test_half_precision_is_bitwise_the_stock_hook_and_takes_the_direct_path(run_ranks, compressor: str) -> None:
    for result in run_ranks("test_breakdown:rank_half_vs_stock", compressor=compressor):
        *steps, direct = result
        # autotune compresses from step 2 on (after DDP's bucket rebuild); the stock hook
        # from step 0, so the first two steps differ by design
        assert all(steps[2:]), f"gradients differ from {compressor}_compress_hook: {steps}"
        assert not any(steps[:2])
        assert direct, "every fp16/bf16 bucket should take the direct path (no channel)"


def rank_breakdown(steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    # fp16 buckets take the direct path; those holding a PowerSGD or top-k layer the channel
    ddp = autotune.wrap(model, Policy.from_dict({
        "version": 1, "bucket_cap_mb": 0.05, "default": {"compressor": "fp16"},
        "layers": {"mid.0.weight": {"compressor": "powersgd", "rank": 2},
                   "fc1.weight": {"compressor": "topk", "ratio": 0.1}}}))
    seen: list[Any] = []
    ddp.comm_state.listeners.append(seen.append)
    for step in range(steps):
        x, y = _batch(step)
        ddp.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
    state = ddp.comm_state
    records = state.last_step_records()
    summed: dict[str, float] = {}
    for r in seen:
        for k, v in r.breakdown.items():
            summed[k] = summed.get(k, 0.0) + v
    return {
        "records": [{"compressed": r.compressed, "seconds": r.seconds, "breakdown": r.breakdown,
                     "collectives": r.collectives, "bytes_by_collective": r.bytes_by_collective}
                    for r in records],
        "step_breakdown": state.step_breakdown(),
        "totals": dict(state.breakdown_totals), "buckets": state.breakdown_buckets,
        "summed": summed, "seen": len(seen),
    }


def test_every_bucket_is_broken_down_by_phase(run_ranks) -> None:
    for result in run_ranks("test_breakdown:rank_breakdown"):
        records = result["records"]
        assert any(r["compressed"] for r in records) and not all(r["compressed"] for r in records)
        for r in records:
            bd = r["breakdown"]
            assert set(bd) <= set(PHASES), bd
            assert all(v >= 0 for v in bd.values()), bd
            # what happened after hand-over fits in the bucket's own time
            assert sum(v for k, v in bd.items() if k != "wait") <= r["seconds"] + 1e-3, r
            if r["compressed"]:
                assert {"guard", "queue", "guard_wait", "encode"} <= set(bd), bd
            else:
                assert {"encode", "allreduce", "decode"} <= set(bd), bd
            # each collective is listed with its bytes, and they add up per kind
            per_kind: dict[str, int] = {}
            for kind, nbytes, seconds in r["collectives"]:
                per_kind[kind] = per_kind.get(kind, 0) + nbytes
                assert seconds >= 0
            assert per_kind == r["bytes_by_collective"]
            assert sum(s for k, _, s in r["collectives"] if k == "allgather") == pytest.approx(
                bd.get("allgather", 0.0))
        step = result["step_breakdown"]
        for phase in step:
            assert step[phase] == pytest.approx(sum(r["breakdown"].get(phase, 0.0) for r in records))
        assert result["buckets"] == result["seen"]
        for phase, total in result["totals"].items():
            assert total == pytest.approx(result["summed"][phase])


def test_bench_breakdown_prints_a_table_per_configuration_and_writes_it(tmp_path: Path) -> None:
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"version": 1, "bucket_cap_mb": 1,
                                  "default": {"compressor": "powersgd", "rank": 1}}))
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "bench", "--workload", "mlp", "--policy", str(policy),
         "--baselines", "ddp,fp16", "--steps", "2", "--block", "1", "--warmup", "3",
         "--breakdown", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "policy: where the communication time goes" in text
    assert "fp16: where the communication time goes" in text
    assert "ddp: where" not in text  # plain DDP has no hook to time
    result = json.loads(out.read_text())
    by_name = {r["name"]: r for r in result["results"]}
    ours = by_name["policy"]["breakdown"]
    assert {"encode", "allreduce"} <= set(ours["per_step_s"])
    assert ours["last_step_buckets"] and all("breakdown" in b for b in ours["last_step_buckets"])
    assert set(by_name["fp16"]["breakdown"]["per_step_s"]) == {"in_hook", "after_hook"}
    assert "breakdown" not in by_name["ddp"]
