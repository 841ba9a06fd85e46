"""``topology: "hierarchical"`` on real gloo groups of 2 pretended hosts x 2 ranks (the
launcher's local placement sets GROUP_RANK as torchrun does): exact for ``none``, every
compressor (row-sparse included) over many buckets without deadlock, the stages in the
breakdown, and flat where there is nothing to gain."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import autotune
from autotune import Policy
from autotune.launch import launch, local_placement
from test_runtime import ALL_SPECS, Net, _batch, _grads, _param_digest

pytestmark = pytest.mark.multirank


class EmbedNet(Net):
    """Net with an embedding table in front (row-sparse gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ids = (x[:, 0, 0, :].abs() * 50).long() % 512
        return super().forward(x) + self.emb(ids).sum(1).sum(1, keepdim=True)


def _hierarchical(model: nn.Module, cap: float, specs: list[dict]) -> Policy:
    names = [n for n, _ in model.named_parameters()]
    layers = {n: specs[i % len(specs)] for i, n in enumerate(names)}
    if "emb.weight" in layers:
        layers["emb.weight"] = {"compressor": "rowsparse"}
    return Policy.from_dict({"version": 1, "bucket_cap_mb": cap, "topology": "hierarchical",
                             "layers": layers})


# --------------------------------------------------------------------------- ranks
def rank_none_vs_ddp(steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, bucket_cap_mb=0.05)
    ours = autotune.wrap(model, _hierarchical(model, 0.05, [{"compressor": "none"}]))
    close = []
    for step in range(steps):
        x, y = _batch(step)
        F.cross_entropy(ref(x), y).backward()
        F.cross_entropy(ours(x), y).backward()
        a = torch.cat([g.reshape(-1) for g in _grads(ref_model)])
        b = torch.cat([g.reshape(-1) for g in _grads(model)])
        close.append(bool(torch.allclose(b, a, rtol=1e-5, atol=1e-7)))
        ref_model.zero_grad()
        model.zero_grad()
    state = ours.comm_state
    h = state.hierarchy
    phases = state.step_breakdown()
    records = state.last_step_records()
    return {
        "close": close,
        "hosts": h.hosts if h else 0,
        "local_size": h.local_size if h else 0,
        "leader": h.is_leader if h else None,
        "buckets": len(records),
        "intra_reduce": phases.get("intra_reduce", 0.0),
        "intra_share": phases.get("intra_share", 0.0),
        "sent": sum(sum(r.bytes_by_collective.values()) for r in records),
    }


def rank_every_compressor(steps: int = 30, embed: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    model = EmbedNet() if embed else Net()
    ddp = autotune.wrap(model, _hierarchical(model, 0.05, ALL_SPECS))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    records = ddp.comm_state.last_step_records()
    labels = sorted({k for r in records for k in r.bytes_by_compressor})
    return {"digest": _param_digest(model), "buckets": len(records), "labels": labels,
            "finite": all(map(lambda v: v == v, losses)), "rank": dist.get_rank()}


def rank_flat_when_one_host() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    ddp = autotune.wrap(model, _hierarchical(model, 0.05, [{"compressor": "fp16"}]))
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(ddp(x), y).backward()
    return {"hierarchy": ddp.comm_state.hierarchy is not None,
            "phases": sorted(ddp.comm_state.step_breakdown())}


def _two_hosts(target: str, **kwargs: Any) -> list[Any]:
    return launch(f"test_hierarchical:{target}", kwargs=kwargs,
                  placement=local_placement(4, 2), timeout=300, pg_timeout=60.0)


# --------------------------------------------------------------------------- tests
def test_hierarchical_none_equals_a_flat_allreduce_and_logs_its_stages() -> None:
    results = _two_hosts("rank_none_vs_ddp")
    for rank, r in enumerate(results):
        assert all(r["close"]), (rank, r["close"])
        assert (r["hosts"], r["local_size"]) == (2, 2)
        assert r["leader"] is (rank % 2 == 0)
        assert r["buckets"] > 3  # many buckets, each through the three stages
        assert r["intra_reduce"] > 0 and r["intra_share"] > 0
    # only the leaders send across hosts
    assert results[0]["sent"] > 0 and results[2]["sent"] > 0
    assert results[1]["sent"] == 0 and results[3]["sent"] == 0


def test_every_compressor_trains_hierarchically_over_many_buckets_in_lockstep() -> None:
    results = _two_hosts("rank_every_compressor")
    assert len({r["digest"] for r in results}) == 1  # every rank holds the same model
    assert all(r["finite"] for r in results)
    assert results[0]["buckets"] > 3
    leaders = results[0]["labels"]
    for spec in ("fp16", "bf16", "int8", "sign", "rowsparse"):
        assert any(label.startswith(spec) for label in leaders), (spec, leaders)


def test_hierarchical_runs_flat_on_one_host(run_ranks) -> None:
    for r in run_ranks("test_hierarchical:rank_flat_when_one_host"):
        assert r["hierarchy"] is False
        assert "intra_reduce" not in r["phases"]


def rank_nonfinite_then_lost(bad_step: int = 3, lost_step: int = 6) -> dict[str, Any]:
    """Hierarchical PowerSGD and fp16 on 2 x 2 ranks: at ``bad_step`` rank 3's loss is
    NaN (every bucket must then go by plain allreduce on every rank, and the next step
    compress again); at ``lost_step`` rank 3 leaves, and the others' next backward must
    fail with a message, not wait."""
    torch.manual_seed(0)
    model = Net()
    ddp = autotune.wrap(model, _hierarchical(model, 0.05, [{"compressor": "powersgd", "rank": 1},
                                                           {"compressor": "fp16"}]))
    rank = dist.get_rank()
    out: dict[str, Any] = {"fallbacks": []}
    for step in range(lost_step + 2):
        if step == lost_step and rank == 3:
            return out | {"left": True}
        x, y = _batch(step)
        try:
            loss = F.cross_entropy(ddp(x), y)
            if step == bad_step and rank == 3:
                loss = loss * float("nan")
            loss.backward()
        except RuntimeError as exc:  # from backward, or from DDP's buffer broadcast in forward
            return out | {"error": str(exc).splitlines()[0]}
        if step == bad_step:
            out["nans"] = sum(int(p.grad.isnan().sum()) for p in model.parameters())
        elif step > bad_step:
            out["finite"] = all(bool(p.grad.isfinite().all()) for p in model.parameters())
        out["fallbacks"].append(sorted({r.fallback for r in ddp.comm_state.last_step_records()}))
        model.zero_grad()
    return out


def test_hierarchical_nonfinite_falls_back_and_a_lost_rank_ends_the_others() -> None:
    results = _two_hosts("rank_nonfinite_then_lost")
    assert results[3]["left"]
    for rank, r in enumerate(results):
        # the NaN reached every rank, as under DDP (ReLU's backward zeroes some of it)
        assert r["nans"] > 0 and r["nans"] == results[0]["nans"], rank
        assert r["fallbacks"][3] == ["nonfinite"] and r["fallbacks"][4] == [""], (rank, r["fallbacks"])
        assert r["finite"], rank
    for r in results[:3]:  # DDP's forward, or our hook, names what was lost
        assert "by peer" in r["error"] or "a peer rank was lost" in r["error"], r
