"""Specification of the policy file: what it holds, how it is validated, saved and matched."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.compressors import CompressorSpec
from autotune.errors import PolicyError
from autotune.policies import POLICY_VERSION, Policy, PolicyCheck, load_policy

GOOD: dict[str, Any] = {
    "version": 1,
    "bucket_cap_mb": 25,
    "default": {"compressor": "none"},
    "layers": {
        "fc1.weight": {"compressor": "powersgd", "rank": 4},
        "fc2.weight": {"compressor": "topk", "ratio": 0.01},
        "fc2.bias": {"compressor": "fp16"},
    },
    "meta": {"predicted_step_s": 0.25, "baselines": {"ddp": 0.5, "fp16": 0.4}},
}


def with_(**changes: Any) -> dict[str, Any]:
    """GOOD with some top-level keys replaced (a value of ... removes the key)."""
    data = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    return data


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)


# ---------------------------------------------------------------- contents and round trips


def test_from_dict_reads_every_field() -> None:
    policy = Policy.from_dict(GOOD)
    assert POLICY_VERSION == 1
    assert policy.bucket_cap_mb == 25.0
    assert policy.default == CompressorSpec("none")
    assert policy.layers["fc1.weight"] == CompressorSpec.of("powersgd", rank=4)
    assert list(policy.layers) == ["fc1.weight", "fc2.weight", "fc2.bias"]
    assert policy.meta["baselines"]["ddp"] == 0.5


def test_omitted_optional_fields_take_their_defaults() -> None:
    policy = Policy.from_dict({"version": 1})
    assert policy == Policy()
    assert policy.bucket_cap_mb == 25.0
    assert policy.default == CompressorSpec("none")
    assert dict(policy.layers) == {} and dict(policy.meta) == {}


def test_dict_round_trip() -> None:
    policy = Policy.from_dict(GOOD)
    assert Policy.from_dict(policy.to_dict()) == policy
    assert policy.to_dict()["layers"] == GOOD["layers"]
    assert policy.to_dict()["meta"] == GOOD["meta"]


def test_json_round_trip_with_stable_key_order() -> None:
    policy = Policy.from_dict(GOOD)
    text = policy.to_json()
    assert list(json.loads(text)) == ["version", "bucket_cap_mb", "default", "layers", "meta"]
    assert Policy.from_dict(json.loads(text)) == policy
    assert policy.to_json(indent=None) == Policy.from_dict(json.loads(text)).to_json(indent=None)


def test_file_round_trip(tmp_path: Path) -> None:
    policy = Policy.from_dict(GOOD)
    path = tmp_path / "policy.json"
    policy.save(path)
    assert load_policy(path) == policy
    assert load_policy(str(path)) == policy


def test_policy_is_immutable_and_owns_its_data() -> None:
    data = with_()
    policy = Policy.from_dict(data)
    with pytest.raises(TypeError):
        policy.layers["fc3.weight"] = CompressorSpec("fp16")  # type: ignore[index]
    with pytest.raises(TypeError):
        policy.meta["new"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        policy.meta["baselines"]["ddp"] = 1.0
    with pytest.raises(AttributeError):
        policy.bucket_cap_mb = 50.0  # type: ignore[misc]
    # the caller's dicts are copied, not shared
    data["meta"]["baselines"]["ddp"] = 99.0
    data["layers"]["fc1.weight"]["rank"] = 8
    assert policy.meta["baselines"]["ddp"] == 0.5
    assert policy.layers["fc1.weight"] == CompressorSpec.of("powersgd", rank=4)
    # and to_dict hands out a fresh, editable copy
    out = policy.to_dict()
    out["meta"]["baselines"]["ddp"] = 7.0
    assert policy.meta["baselines"]["ddp"] == 0.5


def test_policies_are_hashable_and_compare_by_content() -> None:
    a, b = Policy.from_dict(GOOD), Policy.from_dict(with_())
    assert a == b and hash(a) == hash(b)
    assert len({a, b, Policy()}) == 2


def test_spec_for_uses_the_layer_entry_else_the_default() -> None:
    policy = Policy.from_dict(with_(default={"compressor": "bf16"}))
    assert policy.spec_for("fc1.weight") == CompressorSpec.of("powersgd", rank=4)
    assert policy.spec_for("fc1.bias") == CompressorSpec("bf16")


def test_compressors_lists_the_canonical_specs_in_use() -> None:
    policy = Policy.from_dict(
        with_(layers={"a": {"compressor": "powersgd"}, "b": {"compressor": "powersgd", "rank": 1}})
    )
    assert policy.compressors() == {
        CompressorSpec("none").canonical(),
        CompressorSpec("powersgd").canonical(),
    }


def test_uniform_uses_one_compressor_everywhere() -> None:
    policy = Policy.uniform("powersgd", bucket_cap_mb=50, rank=2)
    assert policy.bucket_cap_mb == 50.0
    assert dict(policy.layers) == {}
    assert policy.spec_for("anything") == CompressorSpec.of("powersgd", rank=2)
    with pytest.raises(PolicyError, match=r"default: .*'rank' parameter of powersgd"):
        Policy.uniform("powersgd", rank=0)
    with pytest.raises(PolicyError, match="default: unknown compressor 'zip'"):
        Policy.uniform("zip")


def test_with_meta_returns_an_updated_copy() -> None:
    policy = Policy.from_dict(GOOD)
    updated = policy.with_meta(predicted_step_s=0.1, note="tuned")
    assert updated.meta["predicted_step_s"] == 0.1 and updated.meta["note"] == "tuned"
    assert updated.meta["baselines"]["fp16"] == 0.4
    assert policy.meta["predicted_step_s"] == 0.25
    assert updated.layers == policy.layers


def test_constructor_validates_like_from_dict() -> None:
    with pytest.raises(PolicyError, match="bucket_cap_mb"):
        Policy(bucket_cap_mb=0)
    with pytest.raises(PolicyError, match=r"layers\['x'\]: unknown compressor"):
        Policy(layers={"x": CompressorSpec("zip")})
    with pytest.raises(PolicyError, match="default: expected a CompressorSpec"):
        Policy(default={"compressor": "none"})  # type: ignore[arg-type]


# ---------------------------------------------------------------- the id


def test_id_is_12_hex_digits_and_stable() -> None:
    policy = Policy.from_dict(GOOD)
    assert len(policy.id) == 12 and int(policy.id, 16) >= 0
    assert policy.id == Policy.from_dict(json.loads(policy.to_json())).id


def test_id_ignores_meta() -> None:
    policy = Policy.from_dict(GOOD)
    assert policy.with_meta(predicted_step_s=9.0).id == policy.id
    assert Policy.from_dict(with_(meta=...)).id == policy.id


def test_id_ignores_spelling_and_layer_order() -> None:
    written = Policy.from_dict(with_(bucket_cap_mb=25, layers={
        "a": {"compressor": "powersgd", "rank": 1},
        "b": {"compressor": "topk"},
    }))
    spelled_differently = Policy.from_dict(with_(bucket_cap_mb=25.0, layers={
        "b": {"compressor": "topk", "ratio": 0.01, "error_feedback": True},
        "a": {"compressor": "powersgd"},
        "c": {"compressor": "none"},  # the same as the default: compresses alike
    }))
    assert written.id == spelled_differently.id
    assert Policy.uniform("powersgd").id == Policy.uniform("powersgd", rank=1).id


def test_id_changes_when_communication_changes() -> None:
    base = Policy.from_dict(GOOD)
    ids = {
        base.id,
        Policy.from_dict(with_(bucket_cap_mb=50)).id,
        Policy.from_dict(with_(default={"compressor": "fp16"})).id,
        Policy.from_dict(with_(layers={"fc1.weight": {"compressor": "powersgd", "rank": 8}})).id,
    }
    assert len(ids) == 4


def test_topology_is_hierarchical_or_flat_and_flat_keeps_its_old_id() -> None:
    flat = Policy.from_dict(GOOD)
    assert flat.topology == "flat" and "topology" not in flat.to_dict()
    assert Policy.from_dict(with_(topology="flat")).id == flat.id  # written or not, one policy
    hier = Policy.from_dict(with_(topology="hierarchical"))
    assert hier.id != flat.id and hier != flat
    assert hier.to_dict()["topology"] == "hierarchical"
    assert Policy.from_dict(json.loads(hier.to_json())) == hier
    assert list(hier.to_dict()) == ["version", "bucket_cap_mb", "topology", "default", "layers",
                                    "meta"]


# ---------------------------------------------------------------- saving


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    Policy().save(path)
    Policy.from_dict(GOOD).save(path)  # replaces the old file
    assert load_policy(path) == Policy.from_dict(GOOD)
    assert os.listdir(tmp_path) == ["policy.json"]
    assert path.read_text().endswith("}\n")


def test_meta_that_is_not_json_is_refused_before_any_file_is_touched(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    Policy().save(path)
    before = path.read_bytes()
    for bad in (object(), float("nan"), {1, 2}):
        with pytest.raises(PolicyError, match="meta: must hold only JSON values"):
            Policy.from_dict(GOOD).with_meta(bad=bad).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["policy.json"]


def test_a_failed_save_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "policy.json"
    Policy().save(path)
    before = path.read_bytes()

    def failing_replace(src: str, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(PolicyError, match=r"policy\.json: cannot write policy: No space left"):
        Policy.from_dict(GOOD).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["policy.json"]


def test_save_into_a_missing_directory_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot write policy"):
        Policy().save(tmp_path / "no" / "such" / "policy.json")


# ---------------------------------------------------------------- bad policies


BAD_POLICIES = [
    pytest.param(with_(version=2), r"version: expected 1, got 2", id="wrong-version"),
    pytest.param(with_(version="1"), r"version: expected 1, got '1'", id="version-string"),
    pytest.param(with_(version=True), r"version: expected 1, got True", id="version-bool"),
    pytest.param(with_(version=...), r"version: missing; expected 1", id="no-version"),
    pytest.param(
        with_(extra=1), r"unknown key 'extra'; the keys of a policy are", id="unknown-key"
    ),
    pytest.param(with_(bucket_cap_mb="25"), r"bucket_cap_mb: expected a number", id="cap-string"),
    pytest.param(with_(bucket_cap_mb=0), r"bucket_cap_mb: .*got 0", id="cap-zero"),
    pytest.param(with_(bucket_cap_mb=2048), r"bucket_cap_mb: .*\(0, 1024\]", id="cap-huge"),
    pytest.param(with_(bucket_cap_mb=True), r"bucket_cap_mb: ", id="cap-bool"),
    pytest.param(
        with_(default="none"), r"default: a compressor spec must be an object", id="default-str"
    ),
    pytest.param(
        with_(default={"rank": 4}), r"default: .*needs a 'compressor' key", id="default-no-name"
    ),
    pytest.param(
        with_(default={"compressor": "gzip"}),
        r"default: unknown compressor 'gzip'; registered: none, .*powersgd",
        id="unknown-compressor",
    ),
    pytest.param(with_(layers=[]), r"layers: expected an object, got an array", id="layers-array"),
    pytest.param(
        with_(layers={"": {"compressor": "none"}}),
        r"layers: parameter names must be non-empty strings, got ''",
        id="empty-name",
    ),
    pytest.param(
        with_(layers={3: {"compressor": "none"}}),
        r"layers: parameter names must be non-empty strings, got 3",
        id="int-name",
    ),
    pytest.param(
        with_(layers={"fc1.weight": {"compressor": "powersgd", "rank": 0}}),
        r"layers\['fc1.weight'\]: The 'rank' parameter of powersgd must be an int in the range "
        r"\[1, 1024\]\. Got 0 instead\.",
        id="powersgd-rank-0",
    ),
    pytest.param(
        with_(layers={"fc2.weight": {"compressor": "topk", "ratio": 1.5}}),
        r"layers\['fc2.weight'\]: The 'ratio' parameter of topk must be a float in the range "
        r"\(0, 1\]\. Got 1.5 instead\.",
        id="topk-ratio-1.5",
    ),
    pytest.param(
        with_(layers={"fc2.weight": {"compressor": "topk", "ratio": 0}}),
        r"layers\['fc2.weight'\]: The 'ratio' parameter of topk",
        id="topk-ratio-0",
    ),
    pytest.param(
        with_(layers={"fc2.weight": {"compressor": "topk", "k": 3}}),
        r"layers\['fc2.weight'\]: compressor 'topk' has no parameter 'k'; "
        r"its parameters are: ratio",
        id="unknown-param",
    ),
    pytest.param(with_(meta=[1]), r"meta: expected an object, got an array", id="meta-array"),
    pytest.param(with_(topology="ring"),
                 r"topology: expected one of 'flat', 'hierarchical', got 'ring'", id="topology"),
]


@pytest.mark.parametrize("data, message", BAD_POLICIES)
def test_bad_policy_is_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=r"^policy\.json: " + message):
        Policy.from_dict(data, source="policy.json")


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(PolicyError, match=r"^policy\.json: expected a JSON object .*got an array"):
        Policy.from_dict([GOOD], source="policy.json")


# ---------------------------------------------------------------- bad files


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "policy.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_malformed_json_gives_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{"version": 1,\n  "layers": {,}}')
    with pytest.raises(PolicyError, match=rf"^{path}: malformed JSON at line 2, column 14: "):
        load_policy(path)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(PolicyError, match=rf"^{path}: cannot read policy: No such file"):
        load_policy(path)


def test_a_directory_is_not_a_policy(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=rf"^{tmp_path}: cannot read policy"):
        load_policy(tmp_path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", r"expected a JSON object at the top level, got an array"),
        ('{"version": 1, "bucket_cap_mb": NaN}', r"NaN is not valid JSON"),
        ('{"version": 1, "layers": {"a": {"compressor": "none"}, "a": {"compressor": "fp16"}}}',
         r"duplicate key 'a'"),
        (b"\x80\x81 not text", r"not UTF-8 text"),
        ('{"version": 2}', r"version: expected 1, got 2"),
    ],
)
def test_bad_file_contents_are_refused(tmp_path: Path, text: str | bytes, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=rf"^{path}: {message}"):
        load_policy(path)


# ---------------------------------------------------------------- matching a model


def test_check_reports_unknown_and_uncovered_parameters() -> None:
    model = Net()
    model.fc2.bias.requires_grad_(False)  # frozen: the policy cannot address it
    policy = Policy.from_dict(
        with_(layers={
            "fc1.weight": {"compressor": "powersgd"},
            "fc3.weight": {"compressor": "fp16"},
            "fc2.bias": {"compressor": "fp16"},
        })
    )
    check = policy.check(model)
    assert check == PolicyCheck(
        unknown=("fc3.weight", "fc2.bias"), uncovered=("fc1.bias", "fc2.weight")
    )
    assert not check.ok
    message = r"2 name\(s\) match no trainable parameter.*'fc3.weight', 'fc2.bias'$"
    with pytest.raises(PolicyError, match=message):
        check.raise_if_unknown()


def test_check_passes_for_a_policy_of_the_model() -> None:
    model = Net()
    check = Policy.from_dict(with_(layers={"fc1.weight": {"compressor": "fp16"}})).check(model)
    assert check.ok
    assert check.uncovered == ("fc1.bias", "fc2.weight", "fc2.bias")
    check.raise_if_unknown()  # does not raise
    every_name = tuple(name for name, _ in model.named_parameters())
    assert Policy.uniform("fp16").check(model).uncovered == every_name


def test_check_lists_at_most_five_unknown_names_and_counts_them() -> None:
    layers = {f"ghost{i}.weight": {"compressor": "fp16"} for i in range(8)}
    check = Policy.from_dict(with_(layers=layers)).check(Net())
    with pytest.raises(PolicyError) as info:
        check.raise_if_unknown()
    message = str(info.value)
    assert message.startswith("policy: layers: 8 name(s)")
    assert "'ghost4.weight' and 3 more" in message and "ghost5" not in message


def test_is_plain_means_every_parameter_summed_exactly_and_flat() -> None:
    """A plain policy needs no hook (wrap runs it as DDP's own allreduce)."""
    assert Policy().is_plain
    assert Policy.from_dict({"version": 1, "bucket_cap_mb": 5, "layers": {"a": {"compressor": "none"}}}).is_plain
    assert not Policy.uniform("fp16").is_plain
    assert not Policy.from_dict({"version": 1, "layers": {"a": {"compressor": "powersgd", "rank": 1}}}).is_plain
    assert not Policy.from_dict({"version": 1, "topology": "hierarchical"}).is_plain
