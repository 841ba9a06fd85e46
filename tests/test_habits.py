"""Training habits on real 2-rank gloo groups, each with a policy that compresses every
matrix: gradient accumulation with ``no_sync()``, ``find_unused_parameters=True``,
``static_graph=True``, bf16 autocast, and uneven inputs under ``join()``.

Every step, plain DDP (same habit, same parameters, same batches) gives the reference
gradient. Layers whose compressor is exact (``topk`` at ratio 1) must match it bitwise;
layers whose error is bounded must stay within the bound: ``fp16`` within 2**-10 and
``int8`` within 1/127 of the largest local gradient of the layer on any rank (two
roundings of 2**-11; one quantisation level per rank). Lossy layers (PowerSGD, sign)
must be finite and identical on both ranks.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import autotune
from autotune import Policy
from autotune.errors import AutotuneError
from autotune.launch import launch

pytestmark = pytest.mark.multirank  # every test here starts ranks


class WarningCapture(logging.Handler):
    """Collects the messages of warnings logged on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class SmallNet(nn.Module):
    """Four 64-wide matrices (16 KB each: about one per bucket at 0.02 MB), an optional
    branch ``aux`` and, with ``unused=True``, a layer ``dead`` that is never used."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 64)
        self.aux = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)
        self.dead = nn.Linear(64, 64) if unused else None

    def forward(self, x: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        h = F.relu(self.fc3(h))
        if use_aux:
            h = h + F.relu(self.aux(h))
        return self.head(h)


LAYERS = {
    "fc1.weight": {"compressor": "int8", "block": 64},
    "fc2.weight": {"compressor": "powersgd", "rank": 1},
    "fc3.weight": {"compressor": "topk", "ratio": 1.0},
    "aux.weight": {"compressor": "powersgd", "rank": 1},
    "head.weight": {"compressor": "sign"},
    "dead.weight": {"compressor": "topk", "ratio": 0.1},
}
CAP_MB = 0.02


def mixed_policy(model: nn.Module) -> Policy:
    """int8, PowerSGD, exact top-k and sign on the matrices, fp16 on the rest."""
    names = {n for n, _ in model.named_parameters()}
    return Policy.from_dict({
        "version": 1, "bucket_cap_mb": CAP_MB, "default": {"compressor": "fp16"},
        "layers": {n: s for n, s in LAYERS.items() if n in names},
    })


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def digest(tensors: Iterator[torch.Tensor | None]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"none" if t is None else t.detach().float().numpy().tobytes())
    return h.hexdigest()


def state_digest(state: dict[str, Any]) -> str:
    """Digest of a comm state's compressor state and carry (not its step counter)."""
    h = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value):
                walk(f"{prefix}/{k}", value[k])
        elif isinstance(value, torch.Tensor):
            h.update(prefix.encode() + value.detach().float().numpy().tobytes())
        else:
            h.update(f"{prefix}={value}".encode())

    walk("", {"compressors": state["compressors"], "carry": state["carry"]})
    return h.hexdigest()


def state_finite(state: dict[str, Any]) -> bool:
    def walk(value: Any) -> bool:
        if isinstance(value, dict):
            return all(walk(v) for v in value.values())
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return bool(torch.isfinite(value).all())
        return True

    return walk(state["compressors"]) and walk(state["carry"])


def _bound(spec: dict[str, Any], gmax: float) -> float | None:
    """Largest allowed |ours - DDP| of a layer; None for lossy compressors."""
    name = spec["compressor"]
    if name == "none" or (name == "topk" and spec.get("ratio") == 1.0):
        return 0.0
    if name == "fp16":
        return 2**-10 * gmax + 1e-7  # + fp16's subnormal spacing
    if name == "int8":
        return gmax / 127 * (1 + 1e-5) + 1e-8
    return None


# --------------------------------------------------------------------------- ranks
def _run_habit(habit: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps under ``habit`` and compare each step's gradients with DDP's."""
    torch.manual_seed(0)
    base = SmallNet(unused=habit == "unused")
    ddp_kwargs: dict[str, Any] = {
        "unused": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True},
    }.get(habit, {})
    model, ref_model, local = (copy.deepcopy(base) for _ in range(3))
    policy = mixed_policy(model)
    ours = autotune.wrap(model, policy, **ddp_kwargs)
    ref = DDP(ref_model, bucket_cap_mb=CAP_MB, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro_batches = 3 if habit == "no_sync" else 1
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if habit == "autocast" \
        else contextlib.nullcontext
    out: dict[str, Any] = {"violations": [], "lossy_finite": True, "grad_digests": [],
                           "fallbacks": [], "none_grads": {}, "aux_norm": []}
    for step in range(steps):
        for m in (ref_model, local):
            m.load_state_dict(model.state_dict())
        for m in (model, ref_model, local):
            m.zero_grad(set_to_none=True)
        # find_unused_parameters: aux is unused on every rank in the first compressed step
        use_aux = not (habit == "unused" and step == 2)
        for module in (ours, ref, local):
            for i in range(micro_batches):
                x, y = batch(step, i)
                sync = i == micro_batches - 1
                quiet = module.no_sync() if isinstance(module, DDP) and not sync \
                    else contextlib.nullcontext()
                with quiet:
                    with autocast():
                        loss = F.cross_entropy(module(x, use_aux=use_aux), y)
                    loss.backward()
        # the largest local gradient of each layer on any rank, for the error bounds
        names = [n for n, _ in model.named_parameters()]
        local_grads = dict(local.named_parameters())
        gmax = torch.tensor([float(local_grads[n].grad.abs().max()) if local_grads[n].grad is not None
                             else 0.0 for n in names])
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        refs = dict(ref_model.named_parameters())
        for (name, p), g in zip(model.named_parameters(), gmax.tolist()):
            r = refs[name]
            if (p.grad is None) != (r.grad is None):
                out["violations"].append(f"step {step} {name}: grad None in one of ours/DDP")
                continue
            if p.grad is None:
                out["none_grads"].setdefault(name, []).append(step)
                continue
            spec = policy.spec_for(name).to_dict() if step >= 2 else {"compressor": "none"}
            bound = _bound(spec, g)
            if bound is None:
                out["lossy_finite"] &= bool(torch.isfinite(p.grad).all())
                continue
            err = float((p.grad - r.grad).abs().max())
            if err > bound:
                out["violations"].append(f"step {step} {name} ({spec['compressor']}): "
                                         f"|ours - DDP| = {err:.3g} > {bound:.3g}")
        aux = dict(model.named_parameters())["aux.weight"].grad
        out["aux_norm"].append(None if aux is None else float(aux.norm()))
        out["grad_digests"].append(digest(p.grad for p in model.parameters()))
        out["fallbacks"].append([r.fallback for r in ours.comm_state.last_step_records()])
        opt.step()
    state = ours.comm_state.state_dict()
    out.update(step=ours.comm_state.step, param_digest=digest(model.parameters()),
               state_finite=state_finite(state),
               compressed=sum(r.compressed for r in ours.comm_state.last_step_records()))
    ours.comm_state.close()
    return out


def rank_habits(habits: list[str], steps: int = 5) -> dict[str, Any]:
    return {habit: _run_habit(habit, steps) for habit in habits}


def rank_join(batches: tuple[int, int] = (4, 7)) -> dict[str, Any]:
    """Rank 0 has 4 batches, rank 1 has 7. DDP's semantics for rank 1's extra steps:
    the joined rank adds zero, so the gradient is rank 1's own divided by 2 (the
    initial world size). The hook must give exactly that, and move no compressor state
    while a rank is joined."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SmallNet()
    local = copy.deepcopy(model)
    ours = autotune.wrap(model, mixed_policy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common = min(batches)
    out: dict[str, Any] = {"tail_exact": [], "fallbacks": []}
    with ours.join():
        for step in range(batches[rank]):
            local.load_state_dict(model.state_dict())
            local.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            x, y = batch(step)
            F.cross_entropy(local(x), y).backward()
            F.cross_entropy(ours(x), y).backward()
            out["fallbacks"].append(sorted({r.fallback for r in ours.comm_state.last_step_records()}))
            if step >= common:  # the other rank has joined
                out["tail_exact"].append(all(
                    torch.equal(p.grad, q.grad / 2) for p, q in zip(model.parameters(), local.parameters())
                ))
            opt.step()
            if step == common - 1:
                out["state_before_tail"] = state_digest(ours.comm_state.state_dict())
    out["state_after"] = state_digest(ours.comm_state.state_dict())
    out["param_digest"] = digest(model.parameters())
    out["step"] = ours.comm_state.step
    ours.comm_state.close()
    return out


def rank_join_divide_by_active() -> str:
    ours = autotune.wrap(SmallNet(), Policy())
    try:
        with ours.join(divide_by_initial_world_size=False):
            pass
    except AutotuneError as exc:
        return str(exc)
    return "no error"


# --------------------------------------------------------------------------- tests
HABITS = ["no_sync", "unused", "static_graph", "autocast"]


@pytest.fixture(scope="module")
def habits() -> list[dict[str, Any]]:
    """All four habits in one 2-rank job (each builds its own models)."""
    return launch("test_habits:rank_habits", 2, {"habits": HABITS}, timeout=300, pg_timeout=60)


def _check_common(results: list[dict[str, Any]], habit: str, steps: int = 5) -> None:
    a, b = (r[habit] for r in results)
    for r in (a, b):
        assert not r["violations"], r["violations"]
        assert r["lossy_finite"] and r["state_finite"]
        assert r["step"] == steps, "one comm step per synchronised backward"
        assert r["compressed"] > 0 and all(f == "" for s in r["fallbacks"] for f in s)
    assert a["grad_digests"] == b["grad_digests"], "gradients differ between ranks"
    assert a["param_digest"] == b["param_digest"], "parameters differ between ranks"


@pytest.mark.parametrize("habit", ["no_sync", "static_graph", "autocast"])
def test_habit_gives_ddp_gradients_within_each_compressors_bound(habits, habit: str) -> None:
    _check_common(habits, habit)


def test_find_unused_parameters_leaves_unused_grads_alone_and_powersgd_recovers(habits) -> None:
    _check_common(habits, "unused")
    for r in (h["unused"] for h in habits):
        # never used: no gradient, as under DDP; aux unused (on every rank) at step 2 only
        assert r["none_grads"] == {"dead.weight": [0, 1, 2, 3, 4], "dead.bias": [0, 1, 2, 3, 4],
                                   "aux.weight": [2], "aux.bias": [2]}
        # a zero M at the first compressed step must not leave PowerSGD (rank 1) a zero Q
        assert all(n > 0 for n in r["aux_norm"][3:]), r["aux_norm"]


def test_join_falls_back_to_allreduce_while_a_rank_has_joined(run_ranks) -> None:
    r0, r1 = run_ranks("test_habits:rank_join", timeout=120)
    # rank 1's three extra steps: exactly its own gradient / 2, as DDP's join gives
    assert r1["tail_exact"] == [True, True, True]
    assert r1["fallbacks"][:2] == [[""], [""]]
    assert r1["fallbacks"][2:4] == [[""], [""]], "steps 2-3 (both ranks active) compress"
    assert r1["fallbacks"][4:] == [["joined"]] * 3
    for r in (r0, r1):  # no compressor state moved while a rank was joined
        assert r["state_after"] == r["state_before_tail"]
        assert r["step"] == 7
    assert r0["param_digest"] == r1["param_digest"]


def test_join_rejects_dividing_by_the_active_ranks(run_ranks) -> None:
    message = run_ranks("test_habits:rank_join_divide_by_active")[0]
    assert "divide_by_initial_world_size=False" in message
