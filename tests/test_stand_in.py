"""Auto's stand-in while its search runs (:func:`autotune.online.search.stand_in`) and
how the trials name the policy in force (:func:`trial_contenders`)."""

from __future__ import annotations

import torch
from test_models import synthetic_profile

from autotune import compressors
from autotune.compressors.base import AllreduceCompressor
from autotune.models.cost_model import CostModel
from autotune.online.search import stand_in, trial_contenders
from autotune.policies import Policy
from autotune.presets import preset
from autotune.search.tuner import tune


def _grads(scale: float = 1e-3) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return {"fc.weight": [torch.randn(512, 256, generator=gen) * scale],
            "fc.bias": [torch.randn(256, generator=gen) * scale]}


def test_the_stand_in_is_a_stateless_cast_within_the_budget_at_the_current_cap() -> None:
    found = stand_in(_grads(), Policy(bucket_cap_mb=5.0), pinned={}, max_error=0.3,
                     world_size=2)
    assert found is not None
    name, policy, error = found
    assert policy.bucket_cap_mb == 5.0 and name.endswith("5mb")
    spec = policy.spec_for("fc.weight")
    method = compressors.create(spec.name, **spec.kwargs)
    assert isinstance(method, AllreduceCompressor) and method.lossy  # no state, not exact
    assert 0 < error < 1e-2  # measured on the gradients, far inside the budget


def test_pinned_layers_keep_their_method_in_the_stand_in() -> None:
    pinned = {"fc.bias": {"compressor": "none"}}
    found = stand_in(_grads(), Policy(), pinned=pinned, max_error=0.3, world_size=2)
    assert found is not None
    assert found[1].spec_for("fc.bias").name == "none"
    assert found[1].spec_for("fc.weight").name != "none"


def test_no_stand_in_for_an_exact_budget_or_gradients_near_the_casts_range() -> None:
    assert stand_in(_grads(), Policy(), pinned={}, max_error=0.0, world_size=2) is None
    # gradients of a few thousand would leave half precision's range at 64x growth
    assert stand_in(_grads(scale=2000.0), Policy(), pinned={}, max_error=0.3,
                    world_size=2) is None


def test_the_trials_call_the_policy_in_force_by_its_stand_in_name() -> None:
    profile = synthetic_profile("cnn", link_bps=1e8)
    model = CostModel.fit(profile)
    result = tune(profile, trials=20, seed=0, model=model)
    fp16 = preset("fp16")
    current = Policy.from_dict(fp16.policy())
    contenders, name = trial_contenders(profile, model, result, current, pinned={},
                                        max_error=0.5, rebucket=True, candidates=2,
                                        current_name=fp16.name)
    names = [c.name for c in contenders]
    assert name == "fp16" and len(set(names)) == len(names)
    assert next(c for c in contenders if c.name == name).policy.id == current.id
    # at another cap the stand-in is not the baseline of that name: it keeps "current"
    other = Policy.from_dict(fp16.policy(5.0))
    contenders, name = trial_contenders(profile, model, result, other, pinned={},
                                        max_error=0.5, rebucket=True, candidates=2,
                                        current_name="fp16")
    names = [c.name for c in contenders]
    assert name == "current" and len(set(names)) == len(names)
    assert next(c for c in contenders if c.name == name).policy.id == other.id
