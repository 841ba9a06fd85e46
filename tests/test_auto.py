"""``wrap(model, "auto")`` on real 2-process gloo groups: it explores from plain DDP,
switches every rank at the same step, keeps the ranks' parameters equal, saves a policy
that loads and shows, checkpoints its comm state, changes bucket sizes exactly, and
rejects bad options. Decisions that depend on timing are forced where a test needs
them; no test asserts a speed."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autotune
from autotune.errors import AutotuneError
from autotune.online import controller, explore, search
from autotune.policies import Policy, load_policy
from autotune.workloads import resolve_workload

pytestmark = pytest.mark.multirank  # every test here starts ranks

FAST = {"trial_steps": 1, "explore_steps": 40, "budget_s": 3.0, "trials": 15, "candidates": 1,
        "network_budget_s": 0.3, "profile_steps": 2}


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _settled(ddp: Any) -> bool:
    """Whether rank 0's controller has settled, agreed by every rank."""
    flag = torch.tensor([float(ddp.controller.phase == "settled")])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _train_until_settled(ddp: Any, work: Any, opt: torch.optim.Optimizer, others: list[Any] = (),
                         after: int = 6, most: int = 3000) -> int:
    """Train until rank 0 settled, then ``after`` more steps; ``others`` are (model,
    optimizer) pairs trained on the same batches. Returns the steps run."""
    rank = dist.get_rank()
    left = None
    for step in range(most):
        x, y = work.make_batch(step * 2 + rank)
        for model, o in [(ddp, opt), *others]:
            o.zero_grad()
            work.loss_fn(model(x), y).backward()
            o.step()
        if left is None and _settled(ddp):
            left = after
        if left is not None:
            left -= 1
            if left <= 0:
                return step + 1
    raise AssertionError(f"auto did not settle within {most} steps")


def _force_winner(prefer: str) -> None:
    """Make the trials' decision deterministic: the contender called ``prefer`` (else
    the last measured one) wins, whatever was measured; and explore even when plain
    DDP's step measures within the hidden-communication margin of its compute, and
    however much the search slows the steps beside it."""
    controller.HIDDEN_MARGIN = -1.0
    controller.SEARCH_COST_STEPS = 10**9
    # the contenders must not depend on this machine's load: none is pruned for its
    # prediction (a loaded loopback once measured slow enough to predict compression
    # faster and prune the DDP caps), and the search is a fork of this process, so
    # that it sees the patch (a fresh worker would not)
    controller.LINK_BOUND = -math.inf
    search.PRUNE_ABOVE = math.inf

    def decide(self: explore.Exploration) -> Any:
        from autotune.trials import Decision

        measured = [n for n in self.order if self.times[n]]
        name = prefer if prefer in measured else measured[-1]
        medians = {n: 2.0 for n in measured} | {name: 1.0}
        return self.contenders[name], Decision(winner=name, medians=medians, fastest=name,
                                               reason=f"forced: {name}")

    explore.Exploration.decide = decide  # type: ignore[method-assign]


# ------------------------------------------------------------------------ ranks
def rank_auto(save: str, log: str, prefer: str = "ddp5mb") -> dict[str, Any]:
    """Auto on the mlp with a forced winner that changes the bucket size."""
    _force_winner(prefer)
    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, "auto", save=save, log=log, **FAST)
    opt = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    steps = _train_until_settled(ddp, work, opt)
    switches = [(e["step"], e["new_policy"]) for e in ddp.controller.events if e["event"] == "switch"]
    # checkpoint round trip: tensors, numbers and strings only
    buf = io.BytesIO()
    torch.save(ddp.comm_state.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    again = autotune.wrap(copy.deepcopy(work.model), ddp.policy)
    again.comm_state.load_state_dict(state)
    return {"switches": switches, "digest": _digest(work.model), "steps": steps,
            "policy_id": ddp.policy.id, "cap": ddp.policy.bucket_cap_mb,
            "summary": ddp.controller.summary, "restored_step": again.comm_state.step,
            "saved_step": ddp.comm_state.step}


def rank_exact(save: str) -> dict[str, Any]:
    """max_error=0 leaves only exact contenders (plain averaging at several bucket
    sizes); the winner is forced to another cap. Training must equal plain DDP's."""
    _force_winner("ddp1mb")
    work = resolve_workload("cnn")
    reference = copy.deepcopy(work.model)
    ddp = autotune.wrap(work.model, "auto", save=save, max_error=0.0, **FAST)
    plain = DistributedDataParallel(reference)
    opt = torch.optim.SGD(work.model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    # settled on a plain policy: it runs natively from a check after its switch
    _train_until_settled(ddp, work, opt, others=[(plain, ref_opt)], after=12)
    caps = sorted({e["bucket_cap_mb"] for e in ddp.controller.events if e["event"] == "switch"})
    diff = max(float((a - b).abs().max()) for a, b in zip(work.model.parameters(), reference.parameters()))
    return {"diff": diff, "caps": caps, "digest": _digest(work.model),
            "compressors": sorted({s.name for s in ddp.policy.compressors()}),
            "native": ddp.comm_state.native}


def rank_hidden(save: str) -> dict[str, Any]:
    """A margin no step can miss: auto must settle on plain DDP without searching."""
    controller.HIDDEN_MARGIN = 100.0
    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, "auto", save=save, **FAST)
    opt = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    _train_until_settled(ddp, work, opt)
    return {"events": [e["event"] for e in ddp.controller.events],
            "summary": ddp.controller.summary, "policy_id": ddp.policy.id,
            "worker_gone": ddp.controller._worker is None, "native": ddp.comm_state.native}


def rank_abandon(save: str, log: str, link_bound: bool) -> dict[str, Any]:
    """A search that costs more than it could win (forced: the rule's arithmetic is
    tested alone): rank 0 kills its worker and every rank settles on plain DDP. The job
    is taken as link-bound (the network probe first) or CPU-bound (weighed first)."""
    controller.HIDDEN_MARGIN = -1.0
    controller.LINK_BOUND = -math.inf if link_bound else math.inf
    controller.SEARCH_COST_STEPS = 1
    controller.Controller._search_costs_more = (  # type: ignore[method-assign]
        lambda self: "forced: the search costs more" if self._search_steps else None)
    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, "auto", save=save, log=log, **FAST)
    opt = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    _train_until_settled(ddp, work, opt)
    return {"events": [e["event"] for e in ddp.controller.events],
            "switches": [e["new_policy"] for e in ddp.controller.events if e["event"] == "switch"],
            "summary": ddp.controller.summary, "policy_id": ddp.policy.id,
            "plain": ddp.policy.is_plain,
            "phase": ddp.controller.phase, "worker_gone": ddp.controller._worker is None,
            "profiler_gone": ddp.controller._profiler is None, "digest": _digest(work.model)}


def rank_stand_in(log: str, keep: bool) -> dict[str, Any]:
    """A job taken as link-bound runs the stand-in beside its search: kept (the trials
    start from it, and it is forced to win) or measured slower than the DDP start
    (forced), when every rank goes back to plain DDP before the trials."""
    _force_winner("fp16")
    controller.LINK_BOUND = -math.inf
    controller.STAND_IN_KEEP = math.inf if keep else 0.0
    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, "auto", log=log, **FAST)
    opt = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    _train_until_settled(ddp, work, opt)
    events = ddp.controller.events
    return {"events": [e["event"] for e in events],
            "switches": [(e["step"], e["new_policy"]) for e in events if e["event"] == "switch"],
            "searched": next((e for e in events if e["event"] == "searched"), None),
            "stand_in": next((e for e in events if e["event"] == "stand_in"), None),
            "weighed": next((e for e in events if e["event"] == "stand_in_weighed"), None),
            "compressors": sorted({s.name for s in ddp.policy.compressors()}),
            "summary": ddp.controller.summary, "digest": _digest(work.model)}


def rank_retrial(log: str) -> dict[str, Any]:
    """After auto settled, a drift's re-search (started here as a drift would start it)
    runs on a fork of rank 0 and hands its contenders to new live trials; every rank
    follows them and settles again."""
    _force_winner("ddp")
    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, "auto", log=log, **FAST)
    opt = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    _train_until_settled(ddp, work, opt)
    if dist.get_rank() == 0:
        ddp.controller._start_search(None, {"event": "drift", "forced": True})
    rank = dist.get_rank()
    for step in range(3000):
        x, y = work.make_batch(step * 2 + rank)
        opt.zero_grad()
        work.loss_fn(ddp(x), y).backward()
        opt.step()
        summary = ddp.controller.summary or {}
        done = torch.tensor([float(summary.get("total_explorations", 0) >= 2)])
        dist.broadcast(done, src=0)
        if done.item():
            break
    else:
        raise AssertionError("the re-trials did not settle within 3000 steps")
    return {"events": [e["event"] for e in ddp.controller.events],
            "forked": ddp.controller._search is None, "digest": _digest(work.model),
            "phase": ddp.controller.phase}


def rank_rebucket(steps: int = 12) -> dict[str, Any]:
    """AutotuneDDP.set_bucket_cap between steps: the same training as plain DDP."""
    work = resolve_workload("cnn")
    reference = copy.deepcopy(work.model)
    ddp = autotune.wrap(work.model, None, native=False)  # the hook's records count buckets
    plain = DistributedDataParallel(reference)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (work.model, reference)]
    buckets = []
    for step in range(steps):
        if step in (3, 6, 9):
            ddp.set_bucket_cap({3: 0.05, 6: 100.0, 9: 2.0}[step])
        x, y = work.make_batch(step * 2 + dist.get_rank())
        for model, o in zip((ddp, plain), opts):
            o.zero_grad()
            work.loss_fn(model(x), y).backward()
            o.step()
        buckets.append(len(ddp.comm_state.last_step_records()))
    diff = max(float((a - b).abs().max()) for a, b in zip(work.model.parameters(), reference.parameters()))
    return {"diff": diff, "buckets": buckets}


def rank_native(steps: int = 15) -> dict[str, Any]:
    """AutotuneDDP.set_native between steps, with a cap change while native: the same
    training as plain DDP, one step counted per step either way; a compressing policy
    cannot run natively."""
    work = resolve_workload("cnn")
    reference = copy.deepcopy(work.model)
    ddp = autotune.wrap(work.model, None, native=False)
    plain = DistributedDataParallel(reference)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (work.model, reference)]
    counted, native, records = [], [], []
    for step in range(steps):
        if step in (3, 9, 12):
            ddp.set_native(step != 9)
        if step == 6:
            ddp.set_bucket_cap(0.05)  # rebuilt natively at another cap
        x, y = work.make_batch(step * 2 + dist.get_rank())
        for model, o in zip((ddp, plain), opts):
            o.zero_grad()
            work.loss_fn(model(x), y).backward()
            o.step()
        counted.append(ddp.comm_state.step)
        native.append(ddp.comm_state.native)
        records.append(ddp.comm_state.bytes_by_compressor["none"])
    diff = max(float((a - b).abs().max()) for a, b in zip(work.model.parameters(), reference.parameters()))
    ddp.set_native(False)
    ddp.comm_state.set_policy(Policy.from_dict({"version": 1, "default": {"compressor": "fp16"}},
                                               source="test"))
    try:
        ddp.set_native(True)
        refused = ""
    except AutotuneError as exc:
        refused = str(exc)
    return {"diff": diff, "counted": counted, "native": native, "records": records,
            "refused": refused}


def rank_bad_options(tmp: str) -> dict[str, str]:
    work = resolve_workload("mlp")
    cases: dict[str, dict[str, Any]] = {
        "explore_steps": {"explore_steps": 1},
        "trial_steps": {"trial_steps": 0},
        "network_budget_s": {"network_budget_s": -1.0},
        "max_error": {"max_error": float("nan")},
        "profile": {"profile": f"{tmp}/missing.json"},
        "pinned_unknown": {"pinned": {"nope.weight": {"compressor": "fp16"}}},
        "pinned_spec": {"pinned": {"0.weight": {"compressor": "zip"}}},
        "save_dir": {"save": f"{tmp}/no/such/dir/policy.json"},
    }
    out: dict[str, str] = {}
    for name, kwargs in cases.items():
        try:
            autotune.wrap(copy.deepcopy(work.model), "auto", **kwargs)
        except AutotuneError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "accepted"
    try:
        autotune.wrap(copy.deepcopy(work.model), None, save=f"{tmp}/p.json")
    except AutotuneError as exc:
        out["save_without_auto"] = f"{type(exc).__name__}: {exc}"
    return out


# ------------------------------------------------------------------------ tests
def test_auto_explores_and_switches_every_rank_at_the_same_step(run_ranks, tmp_path: Path) -> None:
    save, log = tmp_path / "policy.json", tmp_path / "auto.jsonl"
    a, b = run_ranks("test_auto:rank_auto", save=str(save), log=str(log), timeout=400)
    assert a["switches"] and a["switches"] == b["switches"]  # same steps, same policies
    assert len(a["switches"]) >= 3  # at least one trial (there and back) and the winner
    assert a["digest"] == b["digest"]
    assert a["policy_id"] == b["policy_id"] and a["cap"] == 5.0  # the forced winner
    summary = a["summary"]
    assert summary["policy"] == "ddp5mb" and summary["explore_steps"] > 0
    assert summary["degraded_steps"] >= 0 and summary["speedup"] > 0
    assert b["summary"] is None  # rank 0 decides and reports
    assert a["restored_step"] == a["saved_step"]

    policy = load_policy(save)  # the saved policy loads and shows
    assert policy.id == a["policy_id"] and policy.bucket_cap_mb == 5.0
    assert policy.meta["auto"]["policy"] == "ddp5mb" and policy.meta["verified"]
    from autotune.cli import main

    assert main(["show", str(save)]) == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.index("network_probe") < kinds.index("searched") < kinds.index("settled")


def test_bucket_changes_under_auto_train_exactly_as_plain_ddp(run_ranks, tmp_path: Path) -> None:
    a, b = run_ranks("test_auto:rank_exact", save=str(tmp_path / "p.json"), timeout=400)
    assert a["compressors"] == ["none"]
    assert a["native"] and b["native"]  # settled on plain averaging: DDP's own allreduce
    assert 1.0 in a["caps"] and len(a["caps"]) >= 2  # buckets rebuilt at least twice
    assert a["digest"] == b["digest"]
    assert a["diff"] <= 1e-6 and b["diff"] <= 1e-6  # DDP's result up to summation order


def test_hidden_communication_settles_on_plain_ddp_without_a_search(run_ranks, tmp_path: Path) -> None:
    save = tmp_path / "p.json"
    a, _ = run_ranks("test_auto:rank_hidden", save=str(save), timeout=300)
    assert "searched" not in a["events"] and "switch" not in a["events"]
    assert "network_probe" not in a["events"]  # decided before the network is probed
    assert "communication is hidden" in a["summary"]["why"] and a["worker_gone"]
    assert a["native"] and "native" in a["events"]  # plain DDP, without the hook
    saved = load_policy(save)
    assert saved.id == a["policy_id"] and "hidden" in saved.meta["verification"]["why"]


@pytest.mark.parametrize("link_bound", [False, True])
def test_a_search_costing_more_than_it_can_win_is_abandoned_for_plain_ddp(
        run_ranks, tmp_path: Path, link_bound: bool) -> None:
    save = tmp_path / "p.json"
    a, b = run_ranks("test_auto:rank_abandon", save=str(save), log=str(tmp_path / "a.jsonl"),
                     link_bound=link_bound, timeout=300)
    assert "search_abandoned" in a["events"]
    # a CPU-bound job is weighed on the steps beside the worker's start, before the
    # network probe; a link-bound one probes first, its worker importing meanwhile
    assert ("network_probe" in a["events"]) == link_bound
    assert "searched" not in a["events"]
    # a link-bound job ran the stand-in beside the search: given up, it goes back too
    assert ("stand_in" in a["events"]) == link_bound
    assert len(a["switches"]) == (2 if link_bound else 0) and a["switches"] == b["switches"]
    assert a["plain"] and b["plain"]
    assert a["worker_gone"] and a["summary"]["why"] == "forced: the search costs more"
    assert a["profiler_gone"]  # its hooks on every parameter come off with the search
    assert a["phase"] == b["phase"] == "settled" and a["digest"] == b["digest"]
    saved = load_policy(save)
    assert saved.id == a["policy_id"] and saved.is_plain


@pytest.mark.parametrize("keep", [True, False])
def test_a_link_bound_job_runs_a_stand_in_beside_its_search(run_ranks, tmp_path: Path,
                                                             keep: bool) -> None:
    a, b = run_ranks("test_auto:rank_stand_in", log=str(tmp_path / "a.jsonl"), keep=keep,
                     timeout=400)
    assert a["switches"] == b["switches"] and a["digest"] == b["digest"]
    kinds = a["events"]
    assert kinds.index("network_probe") < kinds.index("stand_in") < kinds.index("searched")
    assert a["stand_in"]["contender"] == "fp16" and 0 < a["stand_in"]["error"] < 0.01
    assert a["weighed"]["kept"] is keep
    assert kinds.index("stand_in_weighed") < kinds.index("searched")
    stand_in_id = a["stand_in"]["policy_id"]
    assert a["switches"][0][1] == stand_in_id  # in force from the step after its announcement
    searched = a["searched"]
    assert searched["forked"]  # a link-bound job's search is a fork of rank 0
    if keep:  # the trials start from it: it is the incumbent, not plain DDP
        assert searched["current"] == "fp16" and "fp16" in searched["contenders"]
        assert a["summary"]["policy"] == "fp16" and a["compressors"] == ["fp16"]
    else:  # back to plain DDP before the reply: the trials start from plain DDP
        assert a["switches"][1][1] != stand_in_id
        assert searched["current"] == "ddp"


def test_a_drift_re_search_forks_and_runs_the_trials_again(run_ranks, tmp_path: Path) -> None:
    a, b = run_ranks("test_auto:rank_retrial", log=str(tmp_path / "a.jsonl"), timeout=400)
    assert a["forked"] and a["digest"] == b["digest"]
    kinds = a["events"]
    assert kinds.count("settled") == 2 and "retrial" in kinds
    assert kinds.index("retrial") > kinds.index("settled")
    # settled on plain DDP, it ran natively; the re-trials brought the hook back
    assert kinds.index("settled") < kinds.index("native") < kinds.index("retrial")
    assert a["phase"] == "settled"


def _search_costs(search_ms: list[float], explore_ms: Sequence[float] = (),
                  link_bound: bool = False) -> str | None:
    state = SimpleNamespace(_search_steps=[t / 1e3 for t in search_ms],
                            _ddp_steps=[0.020, 0.021, 0.019],  # DDP start: 20 ms
                            _compute={"step_s": [0.016, 0.016]},  # floor 16: 4 exposed
                            _explore_times=[t / 1e3 for t in explore_ms],
                            _link_bound=lambda: link_bound)
    return controller.Controller._search_costs_more(state)  # type: ignore[arg-type]


def test_the_search_is_abandoned_only_when_it_slows_steps_more_than_ddp_exposes() -> None:
    n = controller.SEARCH_COST_STEPS
    assert _search_costs([30.0] * (n - 1)) is None  # too few steps to judge
    assert _search_costs([23.9] * n) is None  # 3.9 ms slower < 4 ms exposed
    why = _search_costs([24.5] * n)
    assert why is not None and "4.5 ms" in why and "4.0 ms" in why and "plain DDP stays" in why


def test_a_cpu_bound_search_that_does_not_reply_is_abandoned_within_the_degraded_budget() -> None:
    # each step 23 ms: cheaper than the 4 ms exposed, but over DDP's 20 ms by more than
    # DEGRADED_MARGIN, so each is a degraded step; the search may not pass the budget
    budget, poll = controller.DEGRADED_BUDGET, controller.SEARCH_POLL_STEPS
    room = budget - poll - 1  # at a check: a network step and a poll later, at the budget
    steps = [23.0] * controller.SEARCH_COST_STEPS
    assert _search_costs(steps, [23.0] * room + [20.0] * 50) is None
    why = _search_costs(steps, [23.0] * (room + 1))
    assert why is not None and f"{room + 1} steps" in why and "has not replied" in why
    # a link-bound job's search is never given up for it: it may win half of each step
    assert _search_costs(steps, [23.0] * 100, link_bound=True) is None


def test_set_bucket_cap_rebuilds_buckets_and_keeps_training_exact(run_ranks) -> None:
    for r in run_ranks("test_auto:rank_rebucket", timeout=240):
        assert r["diff"] <= 1e-6
        assert len(set(r["buckets"])) >= 2  # the bucket count followed the caps


def test_set_native_drops_and_restores_the_hook_and_keeps_training_exact(run_ranks) -> None:
    for r in run_ranks("test_auto:rank_native", timeout=240):
        assert r["diff"] <= 1e-6
        assert r["counted"] == list(range(1, 16))  # a step counted once, hook or not
        assert r["native"] == [False] * 3 + [True] * 6 + [False] * 3 + [True] * 3
        moved = [b - a for a, b in zip(r["records"], r["records"][1:])]
        # the hook records what it reduces, natively nothing
        assert all(m > 0 for m in moved[9:11]) and all(m == 0 for m in moved[3:8] + moved[12:])
        assert "only a plain policy" in r["refused"]


def test_bad_auto_options_fail_in_wrap_with_one_clear_error(run_ranks, tmp_path: Path) -> None:
    (out,) = run_ranks("test_auto:rank_bad_options", nprocs=1, tmp=str(tmp_path), timeout=120)
    assert "accepted" not in out.values(), out
    assert "explore_steps must be an integer >=" in out["explore_steps"]
    assert "trial_steps" in out["trial_steps"]
    assert "network_budget_s" in out["network_budget_s"]
    assert "max_error" in out["max_error"]
    assert "measures its own profile" in out["profile"]
    assert "nope.weight" in out["pinned_unknown"]
    assert "zip" in out["pinned_spec"]
    assert "policy to save" in out["save_dir"]
    assert 'only with wrap(model, "auto")' in out["save_without_auto"]


def test_the_network_probe_stops_at_the_first_size_that_holds_the_gradient() -> None:
    kib = 1024
    assert controller.probe_sizes(2_600_000) == (16 * kib, 64 * kib, 256 * kib, 1024 * kib, 4096 * kib)
    assert controller.probe_sizes(100) == (16 * kib, 64 * kib, 256 * kib)  # three for the fit
    assert controller.probe_sizes(10**9)[-1] == 16 * 1024 * kib  # no more than six
