"""The runtime on real 2-process gloo groups: wrap() against plain DDP, every compressor
through the hook, many small buckets, checkpoints, join() and no_sync()."""

from __future__ import annotations

import copy
import hashlib
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import autotune
from autotune import Policy
from autotune.errors import AutotuneError, PolicyError

pytestmark = pytest.mark.multirank  # every test here starts ranks

ALL_SPECS = [
    {"compressor": "none"},
    {"compressor": "fp16"},
    {"compressor": "bf16"},
    {"compressor": "powersgd", "rank": 2},
    {"compressor": "topk", "ratio": 0.1},
    {"compressor": "int8"},
    {"compressor": "sign"},
]


class Net(nn.Module):
    """Conv, BatchNorm (buffers DDP broadcasts), LayerNorm and linear layers of 64 KB
    each: many buckets at bucket_cap_mb=0.05."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.mid = nn.Sequential(
            *[m for _ in range(6) for m in (nn.Linear(128, 128), nn.LayerNorm(128), nn.ReLU())]
        )
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc2(self.mid(F.relu(self.fc1(x.flatten(1)))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _mixed_policy(model: nn.Module, bucket_cap_mb: float) -> Policy:
    names = [n for n, _ in model.named_parameters()]
    layers = {n: ALL_SPECS[i % len(ALL_SPECS)] for i, n in enumerate(names)}
    return Policy.from_dict({"version": 1, "bucket_cap_mb": bucket_cap_mb, "layers": layers})


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _param_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- ranks
def rank_grads_vs_ddp(compressor: str, steps: int = 4, accumulate: bool = False,
                      native: bool | None = None, views: bool | None = None) -> list[dict]:
    """Per step: do the gradients match plain DDP's within rtol 1e-5, the largest
    absolute difference, the relative error over the whole model, and how many distinct
    storages our gradients live in (views into the buckets: one per bucket)."""
    torch.manual_seed(0)
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, bucket_cap_mb=0.05)
    options = {} if native is None else {"native": native}
    if views is not None:
        options["gradient_as_bucket_view"] = views
    ours = autotune.wrap(model, Policy.uniform(compressor, bucket_cap_mb=0.05), **options)
    errors = []
    for step in range(steps):
        x, y = _batch(step)
        if accumulate:  # one local micro-batch without sync, then a synced one
            with ref.no_sync():
                F.cross_entropy(ref(x), y).backward()
            with ours.no_sync():
                F.cross_entropy(ours(x), y).backward()
            x, y = _batch(step + 100)
        F.cross_entropy(ref(x), y).backward()
        F.cross_entropy(ours(x), y).backward()
        a = torch.cat([g.reshape(-1) for g in _grads(ref_model)])
        b = torch.cat([g.reshape(-1) for g in _grads(model)])
        errors.append({
            "close": bool(torch.allclose(b, a, rtol=1e-5, atol=1e-8)),
            "max_abs": float((a - b).abs().max()),
            "max_ref": float(a.abs().max()),
            "rel": float((a - b).norm() / a.norm()),
            "storages": len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}),
            "params": len(list(model.parameters())),
        })
        ref_model.zero_grad()
        model.zero_grad()
    return errors


def rank_mixed_many_buckets(steps: int = 50) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    ddp = autotune.wrap(model, _mixed_policy(model, 0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    records = ddp.comm_state.last_step_records()
    return {"digest": _param_digest(model), "buckets": len(records), "step": ddp.comm_state.step}


def rank_wire_bytes() -> dict[str, Any]:
    """Bytes the hook recorded in one step vs. each compressor's wire_bytes()."""
    torch.manual_seed(0)
    model = Net()
    ddp = autotune.wrap(model, _mixed_policy(model, 0.05))
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(ddp(x), y).backward()
    world = dist.get_world_size()
    expected: dict[str, int] = {}
    for name, p in model.named_parameters():
        spec = ddp.policy.spec_for(name)
        comp = ddp.comm_state.compressor(spec)
        label = spec.canonical().label()
        expected[label] = expected.get(label, 0) + comp.wire_bytes(tuple(p.shape), world)
    sent: dict[str, int] = {}
    for rec in ddp.comm_state.last_step_records():
        for label, nbytes in rec.bytes_by_compressor.items():
            sent[label] = sent.get(label, 0) + nbytes
    return {"expected": expected, "sent": sent}


def _train_steps(ddp: nn.Module, opt: torch.optim.Optimizer, start: int, count: int) -> list[torch.Tensor]:
    model = ddp.module
    grads = []
    for step in range(start, start + count):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([g.reshape(-1) for g in _grads(model)]))
        opt.step()
    return grads


def rank_checkpoint(n: int = 6) -> dict[str, Any]:
    """Train n+5 steps straight; and n steps, checkpoint, rebuild, load, 5 more."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Net()
        ddp = autotune.wrap(model, _mixed_policy(model, 0.05))
        return ddp, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ddp, opt = build()
    straight = _train_steps(ddp, opt, 0, n + 5)[n:]

    ddp, opt = build()
    _train_steps(ddp, opt, 0, n)
    buf = io.BytesIO()
    torch.save(
        {"model": ddp.state_dict(), "opt": opt.state_dict(), "comm": ddp.comm_state.state_dict()},
        buf,
    )
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # no pickled objects in a checkpoint
    ddp, opt = build()
    ddp.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    ddp.comm_state.load_state_dict(ckpt["comm"])
    resumed = _train_steps(ddp, opt, n, 5)
    return {
        "equal": [bool(torch.equal(a, b)) for a, b in zip(straight, resumed)],
        "max_diff": [float((a - b).abs().max()) for a, b in zip(straight, resumed)],
        "keys_like_ddp": sorted(ckpt["model"]) == sorted(DDP(Net()).state_dict()),
    }


def rank_join_uneven() -> int:
    """Rank 1 has two more batches than rank 0; join() must shadow them, not hang."""
    torch.manual_seed(0)
    model = Net()
    ddp = autotune.wrap(model, Policy.uniform("powersgd", bucket_cap_mb=0.05, rank=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = 6 + 2 * dist.get_rank()
    with ddp.join():
        for step in range(batches):
            x, y = _batch(step)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    return batches


def rank_digits(specs: list[dict], steps: int) -> dict[str, float]:
    from autotune.workloads import digits

    accuracy = {}
    for spec in specs:
        work = digits()
        ddp = autotune.wrap(work.model, Policy.from_dict({"version": 1, "default": spec}))
        opt = torch.optim.SGD(work.model.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            x, y = work.make_batch(step)
            opt.zero_grad()
            work.loss_fn(ddp(x), y).backward()
            opt.step()
        accuracy[spec["compressor"]] = work.evaluate(work.model)
    return accuracy


def rank_unknown_parameter() -> str:
    model = Net()
    policy = Policy.from_dict({"version": 1, "layers": {"fc9.weight": {"compressor": "fp16"}}})
    try:
        autotune.wrap(model, policy)
    except PolicyError as exc:
        return str(exc)
    return "no error"


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize(("native", "views"), [(None, None), (False, None), (False, False)])
def test_policy_none_gives_plain_ddp_gradients(run_ranks, native: bool | None,
                                               views: bool | None) -> None:
    """By default (native) and through the hook's direct path; with the gradients as
    views into DDP's buckets (wrap's default: fewer storages than parameters) or, when
    asked, each in its own storage as under DDP's default."""
    for steps in run_ranks("test_runtime:rank_grads_vs_ddp", compressor="none", native=native,
                           views=views):
        assert all(s["close"] for s in steps), steps
        shared = [s["storages"] < s["params"] for s in steps]
        assert shared == [views is None] * len(steps), steps


def rank_native_plain_policy() -> dict[str, Any]:
    """wrap() of a plain policy registers no hook unless asked; what it refuses."""
    torch.manual_seed(0)
    plain = autotune.wrap(Net(), None)
    hooked = autotune.wrap(Net(), Policy.uniform("none"), native=False)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
    refused = []
    try:
        plain.comm_state.set_policy(Policy.uniform("fp16"))
    except AutotuneError as exc:
        refused.append(str(exc))
    for kwargs in ({"native": True}, {"native": True, "online": True}):
        try:
            autotune.wrap(Net(), Policy.uniform("fp16"), **kwargs)
        except PolicyError as exc:
            refused.append(str(exc))
    return {"plain_hooks": len(plain._comm_hooks), "hooked_hooks": len(hooked._comm_hooks),
            "records": len(plain.comm_state.last_step_records()), "step": plain.comm_state.step,
            "native": plain.comm_state.native, "refused": refused}


def test_a_plain_policy_runs_as_ddp_without_a_hook(run_ranks) -> None:
    """Plain averaging needs no hook: DDP's own C++ allreduce is the fastest way to run
    it, so wrap() registers none (the step still counts); it then refuses to switch to a
    compressing policy, and native=True refuses a compressing policy or online revision."""
    for r in run_ranks("test_runtime:rank_native_plain_policy"):
        assert (r["plain_hooks"], r["hooked_hooks"], r["records"], r["step"], r["native"]) == (0, 1, 0, 3, True)
        assert len(r["refused"]) == 3, r["refused"]
        assert "native=False" in r["refused"][0]
        assert "compresses" in r["refused"][1] and "needs it" in r["refused"][2]


def rank_bucket_sizes() -> dict[str, Any]:
    """The bucket sizes (MiB) DDP hands over in a steady step, for DDP built as users
    build it and for wrap() at the same caps, natively and rebucketed."""
    from autotune.workloads import transformer  # 3.1 MiB of gradients: one bucket at 25

    def sizes(model: DDP, work: Any) -> list[float]:
        # the hook (registered once, and again by a rebucket) appends to the model's list
        seen: list[float] = model.__dict__.setdefault("_seen_buckets", [])

        def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            seen.append(round(bucket.buffer().numel() * 4 / 2**20, 2))
            fut = torch.futures.Future()  # type: ignore[var-annotated]
            fut.set_result(bucket.buffer())  # one rank: the sum is the gradient
            return fut

        if not model._comm_hooks:
            model.register_comm_hook(None, counting)
        for step in range(3):  # the third is past DDP's bucket rebuild
            seen.clear()
            x, y = work.make_batch(step)
            work.loss_fn(model(x), y).backward()
        return seen

    out = {}
    for name, build in (("ddp", lambda m: DDP(m)), ("ddp25", lambda m: DDP(m, bucket_cap_mb=25)),
                        ("ddp2", lambda m: DDP(m, bucket_cap_mb=2)),
                        ("wrap", lambda m: autotune.wrap(m)),
                        ("wrap2", lambda m: autotune.wrap(m, Policy(bucket_cap_mb=2.0)))):
        work = transformer()
        out[name] = sizes(build(work.model), work)
    work = transformer()
    model = autotune.wrap(work.model, Policy(bucket_cap_mb=2.0))
    sizes(model, work)
    model.set_bucket_cap(25.0)
    out["rebucketed"] = sizes(model, work)
    try:  # the counting hook is DDP's one: autotune's cannot be added beside it
        model.set_native(False)
        out["refused"] = ""
    except AutotuneError as exc:
        out["refused"] = str(exc)
    return out


def test_a_policy_at_ddps_default_cap_gets_ddps_default_buckets(run_ranks) -> None:
    """DDP(model) caps its first bucket (the last layers) at 1 MiB so that communication
    starts early; DDP(model, bucket_cap_mb=25) does not. A policy's 25 means the former,
    so that wrap(model) is DDP(model), bucket for bucket; other caps are DDP's own."""
    (r,) = run_ranks("test_runtime:rank_bucket_sizes", nprocs=1, timeout=120)
    assert len(r["ddp"]) == 2 and r["ddp"][0] < 1.1 and len(r["ddp25"]) == 1, r
    assert r["wrap"] == r["ddp"] == r["rebucketed"]
    assert r["wrap2"] == r["ddp2"] and len(r["ddp2"]) >= 2
    assert "another communication hook" in r["refused"]


def rank_compress_from(first: int) -> dict[str, Any]:
    """Which steps' buckets went compressed, and the ranks' parameters after them."""
    torch.manual_seed(0)
    model = Net()
    ddp = autotune.wrap(model, Policy.uniform("powersgd", rank=1, bucket_cap_mb=0.05),
                        compress_from_step=first)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compressed = []
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        compressed.append(all(r.compressed for r in ddp.comm_state.last_step_records()))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    return {"compressed": compressed, "digest": digest.hexdigest()}


@pytest.mark.multirank
def test_compress_from_step_zero_compresses_before_ddps_rebuild(run_ranks) -> None:
    """State is keyed by parameter name, so the steps before DDP's bucket rebuild may
    compress too (measurement's warm-up does); by default they are DDP's own."""
    a, b = run_ranks("test_runtime:rank_compress_from", first=0)
    assert a["compressed"] == [True] * 4 and a["digest"] == b["digest"]
    a, _ = run_ranks("test_runtime:rank_compress_from", first=2)
    assert a["compressed"] == [False, False, True, True]


def test_a_bad_compress_from_step_is_refused() -> None:
    from autotune.runtime.hook import AutotuneState

    for bad in (-1, 1.5, True):
        with pytest.raises(AutotuneError, match="compress_from_step must be an int >= 0"):
            AutotuneState(Policy.uniform("none"), Net(), compress_from_step=bad)  # type: ignore[arg-type]


# Two roundings (before and after the sum) of a format with a 2**-11 (fp16) or 2**-8
# (bf16) unit roundoff: elementwise within 2**-10 / 2**-7 of the largest gradient.
@pytest.mark.parametrize("compressor,eps,rel", [("fp16", 2**-10, 1e-3), ("bf16", 2**-7, 1e-2)])
def test_half_precision_matches_ddp_within_its_precision(
    run_ranks, compressor: str, eps: float, rel: float
) -> None:
    for steps in run_ranks("test_runtime:rank_grads_vs_ddp", compressor=compressor):
        assert steps[0]["close"] and steps[1]["close"]  # nothing compressed before the rebuild
        for s in steps[2:]:
            assert not s["close"], "half precision should not be bit-exact"
            assert s["max_abs"] <= eps * s["max_ref"] and s["rel"] <= rel, s


def test_no_sync_accumulates_like_ddp(run_ranks) -> None:
    for steps in run_ranks("test_runtime:rank_grads_vs_ddp", compressor="none", accumulate=True):
        assert all(s["close"] for s in steps), steps


def test_hook_sends_exactly_the_wire_bytes_each_compressor_declares(run_ranks) -> None:
    for result in run_ranks("test_runtime:rank_wire_bytes"):
        assert result["sent"] == result["expected"]
        assert len(result["sent"]) == len(ALL_SPECS)


def test_mixed_policy_over_many_small_buckets_runs_50_steps_in_lockstep(run_ranks) -> None:
    a, b = run_ranks("test_runtime:rank_mixed_many_buckets", timeout=240)
    assert a["buckets"] >= 8, "the model should span many buckets at 0.05 MB"
    assert a["step"] == b["step"] == 50
    assert a["digest"] == b["digest"], "parameters differ between ranks"


def test_checkpoint_resume_reproduces_the_next_five_steps(run_ranks) -> None:
    for result in run_ranks("test_runtime:rank_checkpoint"):
        assert result["keys_like_ddp"]
        assert all(result["equal"]), f"max differences: {result['max_diff']}"


def test_join_handles_uneven_inputs_with_compression(run_ranks) -> None:
    assert run_ranks("test_runtime:rank_join_uneven", timeout=120) == [6, 8]


def test_each_lossy_compressor_trains_digits_within_two_points(run_ranks) -> None:
    specs = [{"compressor": "none"}] + [s for s in ALL_SPECS if s["compressor"] != "none"]
    acc = run_ranks("test_runtime:rank_digits", specs=specs, steps=300, timeout=400)[0]
    for name, value in acc.items():
        assert value >= acc["none"] - 0.02, f"{name}: {value:.3f} vs none {acc['none']:.3f}"
    assert acc["none"] > 0.9


def test_wrap_rejects_a_policy_naming_unknown_parameters(run_ranks) -> None:
    message = run_ranks("test_runtime:rank_unknown_parameter")[0]
    assert "fc9.weight" in message
