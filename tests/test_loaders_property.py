"""Property-based tests of the policy, profile and cost-model loaders (hypothesis).

Whatever a file holds (arbitrary bytes, any JSON value, a valid file with one field
dropped, retyped, made NaN, huge or negative, or cut short), loading it either succeeds
or raises the loader's documented AutotuneError subclass: nothing else escapes. What
loads is usable: a policy round-trips through its file, a profile round-trips and the
cost model fits and predicts from it.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_models import synthetic_profile

from autotune.compressors.base import REGISTRY
from autotune.errors import AutotuneError, PolicyError, ProfileError
from autotune.models.cost_model import CostModel, load_cost_model
from autotune.policies import Policy, load_policy
from autotune.probes.profile import Profile, load_profile

# Modest example counts keep the file within seconds; deadline=None because CPU speed
# here drifts 1.5x and a slow example is not a failure.
# database=None: no .hypothesis/ directory in the working tree.
FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=15, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

VALID_POLICY: dict[str, Any] = {
    "version": 1,
    "bucket_cap_mb": 25,
    "default": {"compressor": "fp16"},
    "layers": {
        "net.0.weight": {"compressor": "powersgd", "rank": 4},
        "net.0.bias": {"compressor": "none"},
        "net.2.weight": {"compressor": "topk", "ratio": 0.01},
    },
    "meta": {"predicted_step_s": 0.25, "baselines": {"ddp": 0.3}},
}

_PROFILE = synthetic_profile("mlp")
VALID_PROFILE: dict[str, Any] = _PROFILE.to_dict()
VALID_COST_MODEL: dict[str, Any] = CostModel.fit(_PROFILE).to_dict()


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    # hypothesis reruns the test body many times within one function-scoped fixture,
    # so the file every example writes lives in a directory of the module's own.
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory) / "input.json"


# ------------------------------------------------------------------ strategies

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# values that break numbers in particular
AWKWARD = st.sampled_from(
    [math.nan, math.inf, -math.inf, 10**400, -(10**400), 1e308, -1.0, 0, 0.5, -0.0, True, "", "1", [], {}, None]
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path into parsed JSON (object keys and array indices)."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield prefix + (key,)
            yield from _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield prefix + (i,)
            yield from _paths(child, prefix + (i,))


# numbers a loader may accept that still strain arithmetic downstream
EDGE_NUMBERS = st.sampled_from([0, 0.0, 5e-324, 1e-300, 1e-12, 1.0, 1e6, 2**50, 1e15, 10**30])


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any], numbers_only: bool = False) -> dict[str, Any]:
    """``valid`` with one to three fields dropped, retyped or set to an awkward value;
    with ``numbers_only``, one to three numbers set to edge values (most such files
    still load, which is what a test of the loaded data needs)."""
    data = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(data) if not numbers_only or _is_number(_get(data, p))]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _get(data, path[:-1])
        op = "edge" if numbers_only else draw(st.sampled_from(["drop", "awkward", "jsonish"]))
        if op == "drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw({"edge": EDGE_NUMBERS, "awkward": AWKWARD, "jsonish": JSONISH}[op])
    return data


def _get(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(data: Any, spell_infinity: bool = False) -> str:
    # allow_nan: a file may well hold NaN or Infinity, and the loader must refuse it;
    # 1e999 is the other spelling of infinity, one that json parses without complaint
    text = json.dumps(data, allow_nan=True)
    return text.replace("Infinity", "1e999") if spell_infinity else text


# ---------------------------------------------------------------------- policy


@FAST
@given(raw=st.binary(max_size=200))
def test_policy_from_arbitrary_bytes(scratch: Path, raw: bytes) -> None:
    scratch.write_bytes(raw)
    try:
        load_policy(scratch)
    except PolicyError as exc:
        assert "\n" not in str(exc)


@FAST
@given(data=JSONISH)
def test_policy_from_any_json_value(scratch: Path, data: Any) -> None:
    for attempt in (lambda: Policy.from_dict(data), lambda: _load_text(scratch, _text(data), load_policy)):
        try:
            _check_policy(attempt(), scratch)
        except PolicyError:
            pass


@FAST
@given(data=mutated(VALID_POLICY), spell=st.booleans())
def test_policy_mutations_load_or_raise_policy_error(scratch: Path, data: dict[str, Any], spell: bool) -> None:
    try:
        policy = _load_text(scratch, _text(data, spell), load_policy)
    except PolicyError:
        return
    _check_policy(policy, scratch)


@FAST
@given(cut=st.integers(0, len(_text(VALID_POLICY)) - 1))
def test_truncated_policy_raises_policy_error(scratch: Path, cut: int) -> None:
    text = _text(VALID_POLICY)[:cut]
    with pytest.raises(PolicyError):
        _load_text(scratch, text, load_policy)


@st.composite
def valid_policies(draw: st.DrawFn) -> dict[str, Any]:
    """Policies built from the registry's own parameter ranges."""

    def spec() -> dict[str, Any]:
        name = draw(st.sampled_from(REGISTRY.names()))
        out: dict[str, Any] = {"compressor": name}
        for key, param in REGISTRY.get(name).params.items():
            if not draw(st.booleans()):
                continue
            if param.kind is bool:
                out[key] = draw(st.booleans())
            elif param.kind is str:
                out[key] = draw(st.sampled_from(param.choices))
            elif param.kind is int:
                out[key] = draw(st.integers(int(param.low or 0) + int(param.low_open), int(param.high or 64)))
            else:
                low = param.low if param.low is not None else -1e6
                high = param.high if param.high is not None else 1e6
                out[key] = draw(st.floats(low, high, exclude_min=param.low_open))
        return out

    names = draw(st.lists(st.text(min_size=1, max_size=10), max_size=4, unique=True))
    return {
        "version": 1,
        "bucket_cap_mb": draw(st.floats(0.0, 1024.0, exclude_min=True)),
        "default": spec(),
        "layers": {name: spec() for name in names},
        "meta": draw(st.dictionaries(st.text(max_size=6), SCALARS.filter(_finite), max_size=3)),
    }


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


@FAST
@given(data=valid_policies())
def test_valid_policies_load_and_round_trip(scratch: Path, data: dict[str, Any]) -> None:
    policy = _load_text(scratch, _text(data), load_policy)
    assert policy == Policy.from_dict(data)
    _check_policy(policy, scratch)


def _check_policy(policy: Policy, scratch: Path) -> None:
    """A loaded policy is whole: it saves, loads back equal, with the same id."""
    again_path = scratch.with_name("again.json")
    policy.save(again_path)
    again = load_policy(again_path)
    assert again == policy and again.id == policy.id
    assert Policy.from_dict(json.loads(policy.to_json())) == policy


# --------------------------------------------------------------------- profile


@FAST
@given(raw=st.binary(max_size=200))
def test_profile_from_arbitrary_bytes(scratch: Path, raw: bytes) -> None:
    scratch.write_bytes(raw)
    with pytest.raises(ProfileError):  # no byte string of this size is a profile
        load_profile(scratch)


@FAST
@given(data=JSONISH)
def test_profile_from_any_json_value(scratch: Path, data: Any) -> None:
    with pytest.raises(ProfileError):
        Profile.from_dict(data)
    with pytest.raises(ProfileError):
        _load_text(scratch, _text(data), load_profile)


@FAST
@given(data=mutated(VALID_PROFILE), spell=st.booleans())
def test_profile_mutations_load_or_raise_profile_error(scratch: Path, data: dict[str, Any], spell: bool) -> None:
    try:
        profile = _load_text(scratch, _text(data, spell), load_profile)
    except ProfileError:
        return
    again_path = scratch.with_name("again.json")
    profile.save(again_path)
    assert load_profile(again_path) == profile


@FAST
@given(cut=st.integers(0, len(_text(VALID_PROFILE)) - 1))
def test_truncated_profile_raises_profile_error(scratch: Path, cut: int) -> None:
    with pytest.raises(ProfileError):
        _load_text(scratch, _text(VALID_PROFILE)[:cut], load_profile)


@SLOW
@given(data=mutated(VALID_PROFILE, numbers_only=True))
def test_a_profile_that_loads_can_be_fitted(data: dict[str, Any]) -> None:
    """The loader checks what the cost model reads: an accepted profile fits and
    predicts, or the cost model says in an AutotuneError what it lacks."""
    try:
        profile = Profile.from_dict(data)
    except ProfileError:
        return
    try:
        estimate = CostModel.fit(profile).predict(None)
    except AutotuneError:
        return
    assert math.isfinite(estimate.step_s) and estimate.step_s > 0


def test_the_valid_profile_round_trips(scratch: Path) -> None:
    profile = _load_text(scratch, _text(VALID_PROFILE), load_profile)
    assert profile == _PROFILE and profile.to_dict() == VALID_PROFILE


# ------------------------------------------------------------------ cost model


@FAST
@given(data=mutated(VALID_COST_MODEL), spell=st.booleans())
def test_cost_model_mutations_load_or_raise_profile_error(
    scratch: Path, data: dict[str, Any], spell: bool
) -> None:
    try:
        model = _load_text(scratch, _text(data, spell), load_cost_model)
    except ProfileError:
        return
    assert math.isfinite(model.predict(None).step_s)


def test_the_valid_cost_model_round_trips(scratch: Path) -> None:
    model = _load_text(scratch, _text(VALID_COST_MODEL), load_cost_model)
    assert model.to_dict() == VALID_COST_MODEL


def _load_text(path: Path, text: str, loader: Any) -> Any:
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return loader(path)
