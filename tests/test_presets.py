"""One table of presets (autotune.presets) that every comparison with "the baselines"
iterates: adding a row there is enough for the tuner, verification, calibration, the
codec probe, simulate, bench, measure and the report to know it."""

from __future__ import annotations

import pytest
from test_models import synthetic_profile

from autotune.compressors import CompressorSpec
from autotune.policies import Policy
from autotune.presets import (
    BUCKET_CAPS_MB,
    DDP_BUCKET_CAP_MB,
    DEFAULT_PRESETS,
    PRESETS,
    preset,
)

NAMES = [p.name for p in PRESETS]


def test_presets_are_plain_ddp_and_pytorchs_hooks_with_caps_from_the_grid() -> None:
    assert NAMES == ["ddp", "fp16", "bf16", "powersgd1", "powersgd4"]
    assert [p.name for p in DEFAULT_PRESETS] == ["ddp", "fp16", "powersgd1", "powersgd4"]
    assert [p.name for p in PRESETS if p.plain] == ["ddp"]
    assert DDP_BUCKET_CAP_MB in BUCKET_CAPS_MB
    for p in PRESETS:
        assert set(p.caps) <= set(BUCKET_CAPS_MB), p.name
        CompressorSpec.from_dict(p.spec)  # a valid compressor spec
        assert p.display
    assert preset("ddp").variants() == [("ddp1mb", 1.0), ("ddp5mb", 5.0), ("ddp", 25.0), ("ddp100mb", 100.0)]
    assert preset("fp16").variants() == [("fp16", 25.0)]


def test_a_presets_policy_is_our_equivalent_of_it() -> None:
    assert Policy.from_dict(preset("ddp").policy(5.0)) == Policy(bucket_cap_mb=5.0)
    assert preset("powersgd4").policy(None) == {"version": 1, "default": {"compressor": "powersgd", "rank": 4}}
    assert preset("fp16").setup("fp16") == {"name": "fp16", "kind": "hook", "hook": "fp16", "rank": 1}
    assert preset("ddp").setup() == {"name": "stock:ddp", "kind": "ddp"}


def test_sampled_caps_come_from_the_grid() -> None:
    from autotune.probes.sampling import SAMPLED_CAPS_MB
    from autotune.search.space import SearchSpace

    assert SAMPLED_CAPS_MB == (1.0, 5.0, 10.0, 25.0, 50.0)  # what calibration always drew
    assert set(SAMPLED_CAPS_MB) <= set(BUCKET_CAPS_MB)
    assert SearchSpace.from_profile(synthetic_profile()).caps == BUCKET_CAPS_MB


def test_bench_measure_and_the_probe_iterate_the_table() -> None:
    from autotune.cli.bench import BASELINES, DEFAULT_BASELINES
    from autotune.measure import HOOKS, Setup
    from autotune.probes.codecs import BASELINE_SPECS

    assert list(BASELINES) == NAMES
    assert DEFAULT_BASELINES == [p.name for p in DEFAULT_PRESETS]
    assert HOOKS == ("fp16", "bf16", "powersgd", "allreduce")
    for p in PRESETS:
        Setup.from_dict(p.setup(p.name))  # a valid measurement set-up
    assert BASELINE_SPECS == {p.name: p.spec for p in DEFAULT_PRESETS if not p.plain}


def test_calibration_simulate_and_tuner_baselines_iterate_the_table() -> None:
    from autotune.models.cost_model import CostModel
    from autotune.probes.run import calibration_policies
    from autotune.search.space import ErrorModel, SearchSpace
    from autotune.search.tuner import _baseline_params, baseline_policies, baselines
    from autotune.workloads import resolve_workload

    policies = calibration_policies(resolve_workload("cnn"))
    assert policies[: len(DEFAULT_PRESETS)] == [None if p.plain else p.policy(None) for p in DEFAULT_PRESETS]
    # on hosts of several ranks, each preset hierarchical too, for the residual to learn
    # what the intra-host stages cost
    more = calibration_policies(resolve_workload("cnn"), hierarchical=True)
    assert more[: len(policies)] == policies
    assert [Policy.from_dict(p).topology for p in more[len(policies):]] == ["hierarchical"] * len(DEFAULT_PRESETS)
    named = baseline_policies()
    assert list(named) == [p.name for p in DEFAULT_PRESETS] and named["ddp"] is None
    assert named["powersgd1"] == Policy.from_dict(preset("powersgd1").policy())

    profile = synthetic_profile()
    space = SearchSpace.from_profile(profile)
    found = baselines(space, CostModel.fit(profile), ErrorModel(profile), 1.0)
    assert [c.name for c in found] == [n for p in PRESETS for n, _ in p.variants()]
    enqueued = _baseline_params(space)
    assert [e["bucket_cap_mb"] for e in enqueued] == [1.0, 5.0, 25.0, 100.0, 25.0, 25.0, 25.0]


def test_the_reports_colours_and_names_are_the_tables() -> None:
    pytest.importorskip("matplotlib", reason="the report needs matplotlib: pip install 'ddp-autotune[report]'")
    from autotune.report.figures import COLORS, display_name

    for p in PRESETS:
        assert display_name(p.name) == p.display
        assert COLORS.get(p.name) == p.color
    assert display_name("policy") == "tuned policy"
