"""Verification: `autotune tune` measures its candidates beside plain DDP, PyTorch's own
hooks and our policies for the same methods, and writes what measured fastest within
the error budget; the adaptive measurement stops as it says."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.cli import main
from autotune.policies import load_policy
from autotune.presets import PRESETS, preset
from autotune.search.verify import STOCK_MIN_STEPS


def test_every_preset_has_a_stock_set_up_and_our_equivalent() -> None:
    assert [p.name for p in PRESETS] == ["ddp", "fp16", "bf16", "powersgd1", "powersgd4"]
    assert preset("bf16").stock_setup("gloo") is None  # PyTorch's bf16 hook needs NCCL
    assert preset("bf16").stock_setup("nccl") == {"name": "stock:bf16", "kind": "hook", "hook": "bf16", "rank": 1}
    assert preset("ddp").stock_setup() == {"name": "stock:ddp", "kind": "ddp"}
    assert preset("powersgd4").policy()["default"] == {"compressor": "powersgd", "rank": 4}
    with pytest.raises(KeyError, match="presets: ddp, fp16"):
        preset("lz4")


@pytest.mark.multirank
def test_measurement_stops_after_min_rounds_when_one_contender_is_left(run_ranks) -> None:
    setups = [{"name": "ddp", "kind": "ddp"}, {"name": "floor", "kind": "floor"}]
    result = run_ranks("autotune.measure:rank_measure", workload="mlp", setups=setups, rounds=10,
                       block=2, warmup=1, min_rounds=2, separate=["ddp"])[0]
    assert result["rounds"] == 2
    assert [len(r["step_s"]) for r in result["results"]] == [4, 4]


@pytest.mark.multirank
def test_measurement_ends_at_its_budget(run_ranks) -> None:
    setups = [{"name": "ddp", "kind": "ddp"}, {"name": "fp16", "kind": "hook", "hook": "fp16"}]
    result = run_ranks("autotune.measure:rank_measure", workload="mlp", setups=setups, rounds=50,
                       block=1, warmup=1, min_rounds=3, budget_s=1e-6, separate=["ddp", "fp16"])[0]
    assert result["rounds"] == 3  # the first look after min_rounds is already past the budget
    assert all(len(r["step_s"]) == 3 for r in result["results"])


def rank_fixed_steps(**kwargs: object) -> dict:
    """rank_measure whose every step, really run, reads as ``step_s`` seconds
    (default 0.01) plus the set-up's ``extra`` (a name -> seconds mapping)."""
    from autotune import measure

    fixed, extra = kwargs.pop("step_s", 0.01), kwargs.pop("extra", {})
    step = measure._run_step
    measure._run_step = lambda r, mb, lf: (step(r, mb, lf), fixed + extra.get(r.setup.name, 0.0))[1]
    return measure.rank_measure(**kwargs)  # type: ignore[arg-type]


@pytest.mark.multirank
def test_a_measurement_that_cannot_separate_its_contenders_ends_as_futile(run_ranks) -> None:
    from autotune.measure import FUTILE_MIN_STEPS

    setups = [{"name": "a", "kind": "ddp"}, {"name": "b", "kind": "ddp"}]
    result = run_ranks("test_verify:rank_fixed_steps", workload="mlp", setups=setups, rounds=60,
                       block=2, warmup=1, min_rounds=3, budget_s=600.0, separate=["a", "b"])[0]
    # alike to the microsecond: no number of rounds tells them apart, so the first look
    # with FUTILE_MIN_STEPS steps each ends it, neither dropped, long before the budget
    assert result["stopped"] == "futile"
    assert result["rounds"] == -(-FUTILE_MIN_STEPS // 2)
    assert [len(r["step_s"]) for r in result["results"]] == [2 * result["rounds"]] * 2


@pytest.mark.multirank
def test_a_measurement_stops_as_separated_or_at_its_budget_and_says_so(run_ranks) -> None:
    setups = [{"name": "a", "kind": "ddp"}, {"name": "b", "kind": "ddp"}]
    apart = run_ranks("test_verify:rank_fixed_steps", workload="mlp", setups=setups, rounds=60,
                      block=2, warmup=1, min_rounds=3, budget_s=600.0, separate=["a", "b"],
                      extra={"b": 0.001})[0]
    assert apart["stopped"] == "separated" and apart["rounds"] == 3
    spent = run_ranks("test_verify:rank_fixed_steps", workload="mlp", setups=setups, rounds=60,
                      block=2, warmup=1, min_rounds=3, budget_s=1e-6, separate=["a", "b"])[0]
    assert spent["stopped"] == "budget" and spent["rounds"] == 3
    plain = run_ranks("test_verify:rank_fixed_steps", workload="mlp", setups=setups, rounds=2, block=1)[0]
    assert "stopped" not in plain  # not adaptive


def test_futility_needs_steps_and_no_rival_expected_to_separate() -> None:
    import math

    from autotune.measure import FUTILE_MIN_STEPS, _futile, _rounds_left
    from autotune.trials import ratio_interval

    n = FUTILE_MIN_STEPS + 2
    base = [1 + 0.06 * math.sin(2.1 * i) for i in range(n)]  # steps 6% apart, or so
    alike = {"a": base, "b": base[::-1]}  # the same steps in another order: one median
    assert _futile(alike, 2, 25)
    # the same, before every contender has FUTILE_MIN_STEPS steps: too few to judge
    assert not _futile({k: t[: FUTILE_MIN_STEPS - 1] for k, t in alike.items()}, 2, 25)
    # 3% apart: not separated in n steps (the caller passes only rivals not yet shown
    # slower), expected to be in 100 rounds more, but not in none
    apart = {"a": base, "b": [1.03 * x for x in base[::-1]]}
    assert ratio_interval(apart["b"], apart["a"])[0] < 1.0
    assert not _futile(apart, 2, 100)
    assert _futile(apart, 2, 0)
    # rounds left: as many as the budget holds at the contenders' median steps
    times = {"a": [0.1] * 4, "b": [0.3] * 4, "slow": [5.0] * 4}
    assert _rounds_left(times, {"a", "b"}, 2, 100, 8.0) == 10
    assert _rounds_left(times, {"a", "b"}, 2, 7, 8.0) == 7
    assert _rounds_left(times, {"a", "b"}, 2, 7, None) == 7
    assert _rounds_left(times, {"a", "b"}, 2, 7, -1.0) == 0


def rank_slow_warm_up(**kwargs: object) -> dict:
    """rank_measure where the set-ups named in ``slow`` (default: the one called
    ``slow``) take 0.3 s more per step (added to their measured time, so the test costs
    nothing)."""
    from autotune import measure

    slow = kwargs.pop("slow", ["slow"])
    step = measure._run_step
    measure._run_step = lambda r, mb, lf: step(r, mb, lf) + (0.3 if r.setup.name in slow else 0.0)
    return measure.rank_measure(**kwargs)  # type: ignore[arg-type]


@pytest.mark.multirank
def test_a_set_up_clearly_slower_in_warm_up_is_never_timed_beyond_it(run_ranks) -> None:
    setups = [{"name": "slow", "kind": "ddp"},
              {"name": "fast", "kind": "policy", "policy": {"version": 1, "default": {"compressor": "fp16"}}},
              {"name": "ddp", "kind": "ddp"}]
    result = run_ranks("test_verify:rank_slow_warm_up", workload="mlp", setups=setups, rounds=3,
                       block=2, warmup=3, min_rounds=3, separate=["slow", "fast", "ddp"])[0]
    by = {r["name"]: r for r in result["results"]}
    # decided at the third warm-up step, on two steady steps (a single spike proves
    # nothing): their times kept, the slowest rank's, with the 0.3 s
    assert by["slow"]["warmup_only"] and len(by["slow"]["step_s"]) == 2
    assert "first_step_only" not in by["slow"]
    assert by["slow"]["step_s"][0] >= 0.3
    assert "warmup_only" not in by["fast"] and len(by["fast"]["step_s"]) == 6
    assert "warmup_only" not in by["ddp"] and len(by["ddp"]["step_s"]) >= 2


@pytest.mark.multirank
def test_a_set_up_the_model_predicts_clearly_slower_leaves_after_its_first_step(run_ranks) -> None:
    setups = [{"name": "slow", "kind": "ddp"},
              {"name": "fast", "kind": "policy", "policy": {"version": 1, "default": {"compressor": "fp16"}}},
              {"name": "ddp", "kind": "ddp"},
              {"name": "stock:psgd", "kind": "hook", "hook": "powersgd", "rank": 1}]
    result = run_ranks("test_verify:rank_slow_warm_up", workload="mlp", setups=setups, rounds=3,
                       block=2, warmup=3, min_rounds=3, separate=["slow", "fast", "ddp", "stock:psgd"],
                       predicted={"slow": 1.0, "fast": 0.01, "ddp": 0.01, "stock:psgd": 1.0},
                       slow=["slow", "stock:psgd"])[0]
    by = {r["name"]: r for r in result["results"]}
    # PyTorch's PowerSGD hook's first step is a plain allreduce, not its method: it is
    # judged once it compresses, on steady steps (here in the first round)
    assert "first_step_only" not in by["stock:psgd"] and len(by["stock:psgd"]["step_s"]) >= 2
    # its first step, with the 0.3 s, is its time, and says so; the others are measured as before
    assert by["slow"]["warmup_only"] and by["slow"]["first_step_only"] and len(by["slow"]["step_s"]) == 1
    assert by["slow"]["step_s"][0] >= 0.3
    assert len(by["fast"]["step_s"]) == 6 and "warmup_only" not in by["ddp"]


@pytest.mark.multirank
def test_a_set_up_of_long_steps_is_steady_sooner(run_ranks) -> None:
    setups = [{"name": "slow", "kind": "ddp"}, {"name": "ddp", "kind": "ddp"}]
    result = run_ranks("test_verify:rank_slow_warm_up", workload="mlp", setups=setups, rounds=2,
                       block=2, warmup=3, steady_s=0.3)[0]
    by = {r["name"]: r for r in result["results"]}
    # its second warm-up step showed it steady and is its first timed one, one step in
    # the first round its second; the other runs two rounds of two after three warm-up
    assert len(by["slow"]["step_s"]) == 2 and len(by["ddp"]["step_s"]) == 4
    assert min(by["slow"]["step_s"]) >= 0.3 and "warmup_only" not in by["slow"]
    assert result["rounds"] == 2


def rank_sync(differ: bool) -> list[float]:
    """_sync_parameters on a model that is the same on every rank, or not."""
    import torch
    import torch.distributed as dist

    from autotune import measure

    torch.manual_seed(dist.get_rank() if differ else 0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    sent = []
    broadcast = dist.broadcast
    dist.broadcast = lambda t, src: sent.append(t.numel()) or broadcast(t, src)
    try:
        measure._sync_parameters(model)
    finally:
        dist.broadcast = broadcast
    return [len(sent), *model[0].weight.reshape(-1)[:4].tolist()]


@pytest.mark.multirank
def test_parameters_are_sent_only_when_ranks_differ(run_ranks) -> None:
    same = run_ranks("test_verify:rank_sync", differ=False)
    assert [r[0] for r in same] == [0, 0] and same[0][1:] == same[1][1:]
    differ = run_ranks("test_verify:rank_sync", differ=True)
    assert differ[0][0] == differ[1][0] > 0 and differ[0][1:] == differ[1][1:]


def test_the_first_step_drops_a_set_up_only_when_the_model_agrees() -> None:
    from autotune.measure import _first_step_slower

    first = {"ddp": 3.5, "fp16": 1.8, "psgd": 0.4, "stock:psgd": 3.4, "tuned": 0.5}
    predicted = {"ddp": 3.2, "fp16": 1.7, "psgd": 0.2, "stock:psgd": 0.2, "tuned": 0.21}
    named = list(first)
    # stock PowerSGD's first step is a plain allreduce: slow, but predicted fast
    assert _first_step_slower(first, predicted, named) == {"ddp", "fp16"}
    # predicted slow but measured close (a first step's one-time costs cut both ways)
    assert _first_step_slower({**first, "ddp": 0.7}, predicted, named) == {"fp16"}
    assert _first_step_slower(first, {}, named) == set()  # no prediction: no early drop
    assert _first_step_slower(first, predicted, []) == set()


def test_model_accuracy_leaves_out_a_set_up_timed_on_its_first_step() -> None:
    from autotune.search.verify import model_accuracy

    def row(pred: float, meas: float, **flags: object) -> dict:
        return {"kind": "baseline", "predicted_step_s": pred, "measured_step_s": meas, **flags}

    report = {"ddp": row(1.0, 1.0), "fp16": row(0.5, 0.5), "psgd": row(0.1, 0.1)}
    assert model_accuracy(report)["median_ratio_error"] == 0.0
    # a first step 70% over the steady one would read as a 41% error
    spoiled = {**report, "ddp1mb": row(1.0, 1.7, first_step_only=True)}
    assert model_accuracy(spoiled) == model_accuracy(report)
    # with the reference itself timed so, there is no ratio to DDP to judge
    assert model_accuracy({**report, "ddp": row(1.0, 1.7, first_step_only=True)}) == {}


def test_a_bucket_variant_predicted_far_slower_is_not_measured() -> None:
    from test_models import synthetic_profile

    from autotune.search.defaults import PRUNE_PREDICTED
    from autotune.search.tuner import tune
    from autotune.search.verify import PRUNED_SLOW, _setups

    result = tune(synthetic_profile("cnn", link_bps=1e8), trials=10, seed=0, top_k=4)
    setups, info = _setups(result, 2, "gloo")
    measured = {s["name"] for s in setups}
    pruned = {n for n, r in info.items() if r.get("pruned") == PRUNED_SLOW}
    assert pruned == {"ddp1mb", "ddp5mb", "ddp100mb"}  # 100 Mbit: 10x PowerSGD's step
    assert not pruned & measured
    assert {p.name for p in PRESETS} <= measured  # our presets' policies always
    fastest = min(r["predicted_step_s"] for n, r in info.items() if n in measured and r.get("predicted_step_s"))
    assert all(info[n]["predicted_step_s"] > PRUNE_PREDICTED * fastest for n in pruned)
    # on a fast link nothing is that far off
    fast = tune(synthetic_profile("cnn", link_bps=1e11), trials=10, seed=0, top_k=4)
    assert not any(r.get("pruned") == PRUNED_SLOW for r in _setups(fast, 2, "gloo")[1].values())


def test_a_bucket_variant_over_the_error_budget_is_not_measured_but_its_preset_is() -> None:
    from test_models import synthetic_profile

    from autotune.search.tuner import tune
    from autotune.search.verify import PRUNED_OVER_BUDGET, _setups

    presets = {p.name for p in PRESETS}
    variants_over = {}
    for max_error in (0.3, 1.5):
        result = tune(synthetic_profile("cnn", link_bps=1e9), trials=10, seed=0, top_k=4,
                      max_error=max_error)
        setups, info = _setups(result, 2, "gloo")
        measured = {s["name"] for s in setups}
        over = {b.name for b in result.baselines if not b.feasible}
        assert presets <= measured  # PowerSGD r1 and r4 themselves, over budget or not
        assert {n for n, r in info.items() if r.get("pruned") == PRUNED_OVER_BUDGET} == over - presets
        assert not (over - presets) & measured
        variants_over[max_error] = over - presets
    assert variants_over[0.3]  # e.g. PowerSGD at 100 MB buckets
    assert variants_over[1.5] == set()  # every variant within budget, and measured


def rank_stock_powersgd_steps() -> list[int]:
    """Elements PyTorch's PowerSGD hook sent compressed after each of 3 steps, run as
    measuring runs it."""
    from autotune import measure
    from autotune.workloads import resolve_workload

    work = resolve_workload("mlp")
    setup = measure.Setup("stock:powersgd1", kind="hook", hook="powersgd", rank=1)
    runner = measure._build(setup, work.model, 0.01, None)
    sent = []
    for _ in range(3):
        measure._run_step(runner, work.make_batch, work.loss_fn)
        sent.append(runner.powersgd.total_numel_after_compression)
    return sent


@pytest.mark.multirank
def test_a_stock_powersgd_set_up_compresses_from_its_second_step(run_ranks) -> None:
    # its state still starts at the minimum PyTorch allows with error feedback (2), and
    # measuring moves it there after the first step, once DDP's buckets are final
    sent = run_ranks("test_verify:rank_stock_powersgd_steps")[0]
    assert sent[0] == 0 and 0 < sent[1] < sent[2]


def rank_bucket_views() -> dict[str, bool]:
    """Per set-up, whether the DDP measuring builds for it has its gradients as views
    into the buckets."""
    from autotune import measure
    from autotune.workloads import resolve_workload

    work = resolve_workload("mlp")
    policy = {"version": 1, "default": {"compressor": "fp16"}}
    out = {}
    for name, setup in {
        "ddp": {"kind": "ddp"}, "ddp+views": {"kind": "ddp", "bucket_view": True},
        "hook": {"kind": "hook", "hook": "fp16"},
        "hook+views": {"kind": "hook", "hook": "fp16", "bucket_view": True},
        "policy": {"kind": "policy", "policy": policy},
        "policy-views": {"kind": "policy", "policy": policy, "bucket_view": False},
    }.items():
        runner = measure._build(measure.Setup.from_dict({"name": name, **setup}), work.model, 0.01, None)
        measure._run_step(runner, work.make_batch, work.loss_fn)
        out[name] = bool(runner.model.gradient_as_bucket_view)
    return out


def rank_bucket_layouts() -> dict[str, list[int]]:
    """Per set-up, the sizes of the buckets (elements) of the DDP measuring builds, after
    DDP's rebuild, beside DistributedDataParallel(model)'s own."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from autotune import measure
    from autotune.workloads import resolve_workload

    work = resolve_workload("transformer")  # 3.3 MB: over DDP's first bucket of 1 MiB
    policy = {"version": 1, "bucket_cap_mb": 25.0, "default": {"compressor": "fp16"}}
    out = {}
    models = {"users": DistributedDataParallel(copy.deepcopy(work.model))}
    for name, setup in {"ddp": {"kind": "ddp", "bucket_cap_mb": 25.0},
                        "hook": {"kind": "hook", "hook": "fp16", "bucket_cap_mb": 25.0},
                        "policy": {"kind": "policy", "policy": policy, "native": False}}.items():
        models[name] = measure._build(measure.Setup.from_dict({"name": name, **setup}),
                                      work.model, 0.01, None).model
    for name, model in models.items():
        for step in range(2):  # DDP rebuilds its buckets after the first
            inputs, targets = work.make_batch(step)
            model.zero_grad(set_to_none=True)
            work.loss_fn(model(inputs), targets).backward()
        out[name] = sorted(b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets())
    return out


@pytest.mark.multirank
def test_a_set_up_builds_ddp_with_the_bucket_views_it_names(run_ranks) -> None:
    # DDP's default for plain DDP and the stock hooks, wrap's (views) for our policies
    for r in run_ranks("test_verify:rank_bucket_views"):
        assert r == {"ddp": False, "ddp+views": True, "hook": False, "hook+views": True,
                     "policy": True, "policy-views": False}


@pytest.mark.multirank
def test_set_ups_at_ddps_default_cap_have_ddps_own_buckets(run_ranks) -> None:
    # plain DDP and the stock hooks as a user builds them, DistributedDataParallel(model),
    # and ours at the same cap: a first bucket of 1 MiB, then the rest
    for r in run_ranks("test_verify:rank_bucket_layouts"):
        assert r["ddp"] == r["hook"] == r["policy"] == r["users"]
        assert len(r["users"]) == 2


def test_a_stock_powersgd_set_up_is_judged_in_warm_up_only_after_its_first_compressing_step() -> None:
    from autotune.measure import Setup, _Runner

    def runner(powersgd: object = None, **setup: object) -> _Runner:
        return _Runner(Setup.from_dict({"name": "x", **setup}), None, None, None,  # type: ignore[arg-type]
                       powersgd=powersgd)

    assert runner(object(), kind="hook", hook="powersgd", rank=1).steady_from == 2
    assert runner(kind="hook", hook="fp16").steady_from == 1
    assert runner(kind="ddp").steady_from == 1


def test_only_a_set_up_slower_in_every_step_than_twice_the_fastest_leaves_before_min_rounds() -> None:
    from autotune.measure import _clearly_slower

    times = {"ddp": [7.1, 7.3], "fp16": [0.9, 0.41], "rowsparse": [0.2, 0.3], "stock:ddp": [7.0, 0.5]}
    # 0.9 > 2 x 0.3 but fp16's fastest step is not: a drift could explain it
    assert _clearly_slower(times, ["ddp", "fp16", "rowsparse"]) == {"ddp"}
    # a set-up that may not win is measured against those that may
    assert _clearly_slower({"a": [1.0], "b": [0.1]}, ["a"]) == set()
    assert _clearly_slower(times, []) == set()
    # millisecond steps: a spike is no evidence, and keeping the set-up costs nothing
    assert _clearly_slower({"a": [0.003], "b": [0.001]}, ["a", "b"]) == set()


def test_rounds_after_the_first_run_their_set_ups_in_a_seeded_order_of_their_own() -> None:
    from autotune.measure import round_order

    names = ["ddp", "fp16", "powersgd1", "tuned", "stock:fp16"]
    assert round_order(names, 0) == names  # the first round as given
    orders = [round_order(names, k) for k in range(1, 13)]
    assert all(sorted(o) == sorted(names) for o in orders)  # every set-up, once
    assert orders == [round_order(names, k) for k in range(1, 13)]  # every rank agrees
    # no set-up always follows the same one: what a block inherits is spread over all
    before = {n: {o[o.index(n) - 1] for o in orders if o.index(n)} for n in names}
    assert all(len(prev) >= 2 for prev in before.values())
    assert names == ["ddp", "fp16", "powersgd1", "tuned", "stock:fp16"]  # not shuffled in place


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "profile.json"
    assert main(["profile", "--workload", "mlp", "--nproc-per-node", "2", "--budget-s", "8",
                 "--out", str(path)]) == 0
    return path


@pytest.mark.multirank
def test_tune_verifies_by_default_and_show_prints_what_was_measured(
    mlp_profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy.json"
    assert main(["tune", str(mlp_profile), "--out", str(out), "--trials", "20",
                 "--verify-budget", "5"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "measured on the live job" in text and "verdict:" in text
    meta = load_policy(out).meta
    report, summary = meta["verified"], meta["verification"]
    kinds = {r["kind"] for r in report.values()}
    assert kinds == {"stock", "baseline", "candidate"}
    assert {"stock:ddp", "stock:fp16", "stock:powersgd1", "stock:powersgd4"} <= set(report)
    assert "stock:bf16" not in report  # needs NCCL
    assert summary["winner"] in report and meta["chosen"] == summary["emitted"]
    winner = report[summary["winner"]]
    assert winner["feasible"]
    # nothing within the budget measured faster than the winner beyond noise: every
    # feasible rival's interval over the fastest within budget is reported (the fastest
    # is the reference; a simpler set-up that tied with it may be the winner)
    assert report[summary["fastest_within_budget"]]["feasible"]
    for name, r in report.items():
        if name != summary["fastest_within_budget"] and r["feasible"]:
            assert "interval_vs_fastest" in r
    accuracy = summary["model_accuracy"]
    assert accuracy["median_ratio_error"] >= 0 and -1 <= accuracy["kendall_tau_all"] <= 1
    # what was measured of our policies now calibrates the cost model
    from autotune.probes.profile import load_profile

    learned = [r for r in load_profile(mlp_profile).calibration.results if r.source == "verify"]
    # (all that were timed: not one pruned unmeasured, or dropped in warm-up, whose time
    # may still carry one-time costs)
    ours = [r for r in report.values() if r["kind"] in ("baseline", "candidate")
            and r.get("measured_step_s") is not None and not r.get("warmup_only")]
    assert len([r for r in learned if r.stock is None]) == len({r["policy_id"] for r in ours})
    # and the stock set-ups timed long enough, whose ratio to ours scales their predictions
    assert {r.stock for r in learned if r.stock is not None} == {
        r["equivalent"] for r in report.values() if r["kind"] == "stock"
        and r.get("steps", 0) >= STOCK_MIN_STEPS and not r.get("warmup_only")}
    assert "policy" not in winner  # the meta stays light: policies live in the profile
    assert main(["show", str(out)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "measured on the live job" in shown and summary["winner"] in shown


@pytest.mark.multirank
def test_no_verify_chooses_by_prediction(mlp_profile: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "policy.json"
    assert main(["tune", str(mlp_profile), "--out", str(out), "--trials", "10", "--no-verify"]) == 0
    assert "verified" not in load_policy(out).meta
    # the budget in force is printed, and what the default means
    text = " ".join(capsys.readouterr().out.split())
    assert "error budget 0.6 (the default" in text and "bench/convergence.py" in text
    assert main(["tune", str(mlp_profile), "--out", str(out), "--trials", "10", "--no-verify",
                 "--max-error", "0.3"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "error budget 0.3" in text and "(the default" not in text


@pytest.mark.multirank
def test_a_bad_verify_budget_is_one_line(mlp_profile: Path, tmp_path: Path, capsys) -> None:
    assert main(["tune", str(mlp_profile), "--out", str(tmp_path / "p.json"), "--verify-budget", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a number of seconds > 0" in err


def test_an_exact_set_up_within_the_margin_beats_a_faster_lossy_one() -> None:
    from autotune.search.verify import _exact_within

    info = {"ddp": {"error": 0.0}, "mix": {"error": 0.0}, "topk": {"error": 0.3},
            "fp16": {"error": 1e-4}}
    medians = {"ddp": 1.00, "mix": 0.104, "topk": 0.100, "fp16": 0.5}
    assert _exact_within(medians, info, "topk", 0.05) == "mix"  # 4% slower, exact
    assert _exact_within(medians, info, "topk", 0.03) is None  # outside the margin
    assert _exact_within(medians, info, "topk", 0.0) is None  # 0: the fastest always wins
    assert _exact_within(medians, info, "mix", 0.05) is None  # the winner is already exact
    assert _exact_within({"fp16": 0.5, "topk": 0.1}, info, "topk", 0.5) is None  # none exact


@pytest.mark.multirank  # its fixture profiles on 2 real ranks, as the other users of it do
def test_a_bad_exact_margin_is_one_line(mlp_profile: Path, tmp_path: Path, capsys) -> None:
    assert main(["tune", str(mlp_profile), "--out", str(tmp_path / "p.json"), "--exact-margin", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a number in [0, 1)" in err


def test_a_set_up_dropped_early_cannot_tie_its_way_back(monkeypatch) -> None:
    """Measurement drops a set-up once it is shown slower (few steps, a wide interval);
    the decision is among the survivors, so plain DDP dropped after 6 noisy steps does
    not win a tie against the fastest measured 20 times."""
    from test_models import synthetic_profile

    import autotune.search.verify as verify
    from autotune.search.tuner import tune

    result = tune(synthetic_profile("cnn", link_bps=1e8), trials=10, seed=0, top_k=4)
    setups, info = verify._setups(result, 2, "gloo")
    fastest = next(s["name"] for s in setups if s["name"].startswith("candidate") or s["name"] == "tuned")
    steps = {}
    for s in setups:
        name = s["name"]
        if name == fastest:
            steps[name] = [0.80 + 0.001 * (i % 5) for i in range(20)]
        elif name == "stock:ddp":
            steps[name] = [0.5, 1.6, 0.7, 1.4, 0.9, 1.2]  # dropped after 3 rounds, median 1.05
        else:
            steps[name] = [1.0 + 0.001 * (i % 5) for i in range(6)]
    monkeypatch.setattr(verify, "launch", lambda *a, **k: [
        {"results": [{"name": n, "step_s": t} for n, t in steps.items()], "rounds": 10}])
    policy, report = verify.verify_result(result, 2, "cnn", None)  # type: ignore[arg-type]
    assert report["_summary"]["winner"] == fastest
    assert report["stock:ddp"]["steps"] == 6 and report[fastest]["steps"] == 20


def test_a_hierarchical_candidate_is_measured_beside_the_same_policy_flat() -> None:
    from dataclasses import replace

    from test_models import _two_hosts_profile

    from autotune.search.tuner import tune
    from autotune.search.verify import _setups, candidates

    result = tune(_two_hosts_profile(), trials=40, seed=0, max_error=0.0)
    assert result.tuned.policy.topology == "hierarchical"
    picked = candidates(result, 4)
    names = [c.name for c in picked]
    for i, c in enumerate(picked):
        if c.policy.topology == "hierarchical":
            twin = picked[i - 1]  # just before it: simpler, so it wins a tie
            assert twin.name == f"{c.name}-flat" and twin.policy.topology == "flat"
            assert twin.policy.layers == c.policy.layers and twin.error == c.error
            assert twin.predicted_s > 0
        elif c.name.endswith("-flat") and i + 1 < len(picked):  # (the last may be alone)
            assert picked[i + 1].name == c.name[: -len("-flat")]
    assert "tuned-flat" in names
    # one set-up more at most (each holds a model copy on every rank): the last
    # candidates make room
    plain = candidates(replace(result, flat={}), 4)
    assert len(picked) == len(plain) + 1
    assert [c.name for c in picked[:2]] == ["tuned-flat", "tuned"]
    setups, info = _setups(result, 4, "gloo")
    assert [s["name"] for s in setups if s["name"].startswith("tuned")] == ["tuned-flat", "tuned"]
    assert info["tuned-flat"]["kind"] == "candidate"
