"""A NaN or Inf gradient on one rank, under a policy mixing PowerSGD, top-k, sign, int8
and fp16, on a real 2-rank gloo group.

The guard (runtime/hook.py) must make both ranks average every bucket holding it by
plain allreduce: the gradients of that step are exactly plain DDP's (the non-finite
value reaches every rank, so a GradScaler skips the step everywhere), the compressor
state of those buckets does not move (no NaN in error feedback or PowerSGD's Q), it is
counted and logged once for the step, and the next steps are finite again.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_habits import (
    CAP_MB,
    SmallNet,
    WarningCapture,
    batch,
    digest,
    mixed_policy,
    state_digest,
    state_finite,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import autotune
from autotune.launch import launch

pytestmark = pytest.mark.multirank  # every test here starts ranks

BAD_STEP = 3


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN (bit patterns of NaN may differ)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def rank_nonfinite(inject: str, steps: int = 6, guard: bool = True,
                   one_bucket: bool = False) -> dict[str, Any]:
    """Train with a GradScaler; at BAD_STEP rank 1's gradient turns non-finite:
    ``nan``: its loss is NaN (every gradient NaN); ``inf``: one element of
    ``fc2.weight``'s gradient (PowerSGD, with error feedback and a warm-start Q) is Inf.
    ``one_bucket``: PowerSGD on every parameter, in one bucket, where the guard's flags
    ride on PowerSGD's allreduce (no agreement of their own)."""
    rank = dist.get_rank()
    capture = WarningCapture()
    logging.getLogger("autotune.runtime.hook").addHandler(capture)
    torch.manual_seed(0)
    model = SmallNet()
    ref_model = copy.deepcopy(model)
    policy = mixed_policy(model) if not one_bucket else autotune.Policy.from_dict(
        {"version": 1, "bucket_cap_mb": 100.0, "default": {"compressor": "powersgd", "rank": 2}})
    ours = autotune.wrap(model, policy, guard=guard)
    ref = DDP(ref_model, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    poison = rank == 1

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if poison and inject == "inf":
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    out: dict[str, Any] = {"scales": [], "fallbacks": [], "finite_after": []}
    for step in range(steps):
        ref_model.load_state_dict(model.state_dict())
        opt.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
        bad = step == BAD_STEP
        if bad:
            before = ours.comm_state.state_dict()
            handles = [m.fc2.weight.register_hook(hook) for m in (model, ref_model)]
        x, y = batch(step)
        for module in (ours, ref):
            loss = F.cross_entropy(module(x), y)
            if bad and poison and inject == "nan":
                loss = loss * float("nan")
            (scaler.scale(loss) if module is ours else loss * scaler.get_scale()).backward()
        grads = [p.grad for p in model.parameters()]
        if bad:
            for h in handles:
                h.remove()
            after = ours.comm_state.state_dict()
            # every bucket with the NaN (all of them), or the one with the Inf, is DDP's
            pairs = zip(model.parameters(), ref_model.parameters()) if inject == "nan" \
                else [(model.fc2.weight, ref_model.fc2.weight)]
            out["as_ddp"] = all(_same(p.grad, q.grad) for p, q in pairs)
            out["nan_mask"] = digest(g.isnan() for g in grads)
            out["state_untouched"] = _fc2_state(before) == _fc2_state(after)
            out["whole_state_untouched"] = state_digest(before) == state_digest(after)
        elif step > BAD_STEP:
            out["finite_after"].append(all(bool(torch.isfinite(g).all()) for g in grads))
        out["fallbacks"].append([r.fallback for r in ours.comm_state.last_step_records()])
        scaler.step(opt)
        scaler.update()
        out["scales"].append(scaler.get_scale())
    logging.getLogger("autotune.runtime.hook").removeHandler(capture)
    state = ours.comm_state.state_dict()
    out.update(
        state_finite=state_finite(state), param_digest=digest(model.parameters()),
        nonfinite_steps=ours.comm_state.nonfinite_steps,
        nonfinite_buckets=ours.comm_state.nonfinite_buckets,
        # the guard's work in the hook: its agreement issued there (not riding)
        guard_in_hook=ours.comm_state.breakdown_totals.get("guard", 0.0) > 0,
        warnings=capture.messages,
    )
    ours.comm_state.close()
    return out


def _fc2_state(state: dict[str, Any]) -> list[bytes]:
    """PowerSGD's residual and Q of fc2.weight, as bytes."""
    (comp,) = [v for k, v in state["compressors"].items() if '"powersgd"' in k]
    return [comp[part]["fc2.weight"].numpy().tobytes() for part in ("memory", "q")]


def _check(a: dict[str, Any], b: dict[str, Any]) -> None:
    for r in (a, b):
        assert r["as_ddp"], "the non-finite step must give plain DDP's gradients"
        assert r["state_untouched"], "fc2.weight's residual and Q moved"
        assert r["state_finite"], "compressor state holds a NaN or Inf"
        assert r["finite_after"] == [True] * (len(r["scales"]) - BAD_STEP - 1)
        assert r["nonfinite_steps"] == 1
        # the scaler saw the Inf/NaN on both ranks and skipped that step on both
        assert r["scales"][BAD_STEP] == r["scales"][BAD_STEP - 1] / 2
        warned = [m for m in r["warnings"] if m.startswith(f"step {BAD_STEP}: non-finite gradient on 1 of 2")]
        assert len(warned) == 1 and len(r["warnings"]) == 1, r["warnings"]
    assert "this rank (1)" in b["warnings"][0] and "this rank" not in a["warnings"][0]
    for key in ("nan_mask", "fallbacks", "scales", "param_digest", "nonfinite_buckets"):
        assert a[key] == b[key], f"ranks differ in {key}"
    assert all(f == "" for i, s in enumerate(a["fallbacks"]) if i != BAD_STEP for f in s)


def rank_cases() -> dict[str, Any]:
    """The three cases below in one 2-rank job (each builds its own models)."""
    return {"nan": rank_nonfinite("nan"), "inf": rank_nonfinite("inf"),
            "unguarded": rank_nonfinite("nan", guard=False),
            "one_bucket": rank_nonfinite("inf", one_bucket=True)}


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return launch("test_gradients_nonfinite:rank_cases", 2, timeout=300, pg_timeout=60)


def test_nan_loss_on_one_rank_falls_back_on_every_bucket(cases) -> None:
    a, b = (c["nan"] for c in cases)
    _check(a, b)
    assert set(a["fallbacks"][BAD_STEP]) == {"nonfinite"}
    assert a["nonfinite_buckets"] == len(a["fallbacks"][BAD_STEP])
    assert a["whole_state_untouched"] and b["whole_state_untouched"]


def test_one_inf_element_falls_back_on_its_bucket_only(cases) -> None:
    a, b = (c["inf"] for c in cases)
    _check(a, b)
    assert a["fallbacks"][BAD_STEP].count("nonfinite") == 1 == a["nonfinite_buckets"]
    assert "" in a["fallbacks"][BAD_STEP], "the other buckets still compress"


def test_flags_riding_on_powersgds_allreduce_guard_a_single_bucket(cases) -> None:
    a, b = (c["one_bucket"] for c in cases)
    _check(a, b)
    assert a["fallbacks"][BAD_STEP] == ["nonfinite"] and a["nonfinite_buckets"] == 1
    assert a["whole_state_untouched"] and b["whole_state_untouched"]
    assert all(s == [""] for i, s in enumerate(a["fallbacks"]) if i != BAD_STEP)
    # no agreement of its own, where the mixed policy's buckets issue one in the hook
    assert not a["guard_in_hook"] and all(c["inf"]["guard_in_hook"] for c in cases)


def test_without_the_guard_error_feedback_is_poisoned(cases) -> None:
    """What the guard prevents (and proof that the checks above can fail)."""
    a, b = (c["unguarded"] for c in cases)
    assert not (a["state_finite"] and b["state_finite"])
    assert a["nonfinite_steps"] == 0 and not a["warnings"]
