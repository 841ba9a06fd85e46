"""autotune.models.external: the V100 what-ifs with measured codec costs
(bench/codec_throughput.py's JSON) or, without them, the stated constants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.compressors import CompressorSpec
from autotune.errors import ProfileError
from autotune.models.external import V100, MeasuredCodecCosts, full_model
from autotune.models.zhang2020 import Layer, VecAddModel, Zhang2020Profile

MB = 2**20

# seconds = fixed + per MB + per MB and rank, per configuration (what the file encodes)
TRUTH = {
    ("none", ()): (5e-6, 10e-6, 0.0),
    ("fp16", ()): (8e-6, 20e-6, 0.0),
    ("topk", (("ratio", 0.01),)): (30e-6, 60e-6, 4e-6),
    ("topk", (("ratio", 0.001),)): (30e-6, 50e-6, 1e-6),
}


def _true(name: str, params: tuple, mb: float, world: int) -> float:
    fixed, per_mb, per_rank = TRUTH[name, params]
    return fixed + mb * (per_mb + per_rank * world)


def write_bench(path: Path, device: str = "cuda") -> Path:
    """A results file as bench/codec_throughput.py writes it (the fields read)."""
    rows = []
    for (name, params), _ in TRUTH.items():
        spec = {"compressor": name, **dict(params)}
        for world in (2, 8):
            for mb in (1, 4, 16, 64):
                rows.append({"spec": spec, "world_size": world, "numel": mb * MB // 4,
                             "codec_s": _true(name, params, mb, world)})
    path.write_text(json.dumps({"device": device, "device_name": "test GPU", "rows": rows}))
    return path


def test_fits_recover_the_measured_costs(tmp_path: Path) -> None:
    costs = MeasuredCodecCosts.from_json(write_bench(tmp_path / "c.json"))
    assert costs.device_name == "test GPU"
    for (name, params), _ in TRUTH.items():
        spec = CompressorSpec.of(name, **dict(params))
        for mb, world in [(1, 2), (64, 8), (0.25, 32), (100, 128)]:  # in and beyond the grid
            numel = int(mb * MB / 4)
            assert costs.seconds(spec, numel, world) == pytest.approx(
                _true(name, params, 4 * numel / MB, world), rel=1e-6)


def test_unmeasured_configurations_take_the_nearest_measured_one(tmp_path: Path) -> None:
    costs = MeasuredCodecCosts.from_json(write_bench(tmp_path / "c.json"))
    near = {0.05: 0.01, 0.005: 0.01, 0.002: 0.001, 0.0001: 0.001}
    for ratio, measured in near.items():
        fit = costs.fit_for(CompressorSpec.of("topk", ratio=ratio))
        assert fit.spec == CompressorSpec.of("topk", ratio=measured).canonical()
    with pytest.raises(ValueError, match="no measured codec cost for 'sign'; measured: fp16, none, topk"):
        costs.seconds(CompressorSpec.of("sign"), 1000, 2)


def test_one_world_size_gives_a_cost_independent_of_it(tmp_path: Path) -> None:
    path = write_bench(tmp_path / "c.json")
    data = json.loads(path.read_text())
    data["rows"] = [r for r in data["rows"] if r["world_size"] == 2]
    path.write_text(json.dumps(data))
    fit = MeasuredCodecCosts.from_json(path).fit_for(CompressorSpec.of("topk", ratio=0.01))
    assert fit.per_mb_rank_s == 0.0
    assert fit.seconds(MB, 2) == pytest.approx(_true("topk", (("ratio", 0.01),), 4, 2), rel=1e-6)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ({"device": "cpu", "rows": []}, "measured on 'cpu', not 'cuda'"),
        ({"device": "cuda", "rows": []}, "no codec measurements"),
        ({"device": "cuda", "rows": [{"spec": {"compressor": "fp16"}}]}, "malformed"),
        ({"device": "cuda", "rows": [{"spec": {"compressor": "nope"}, "world_size": 2,
                                      "numel": 4, "codec_s": 1.0}]}, "unknown compressor"),
        ([1, 2], "measured on None"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, content: object, words: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ProfileError, match=r"bad\.json") as info:
        MeasuredCodecCosts.from_json(path)
    assert words in str(info.value)


def test_full_model_reads_the_measured_costs(tmp_path: Path) -> None:
    # one 64 MB layer: the step's codec time is that layer's, under the ratio's compressor
    profile = Zhang2020Profile(name="one", layers=(Layer(1e-3, 64 * MB),), iteration_s=0.1)
    measured = MeasuredCodecCosts.from_json(write_bench(tmp_path / "c.json"))
    args = (profile, 8, 10e9)
    for ratio, name, params in [(2, "fp16", ()), (50, "topk", (("ratio", 0.01),))]:
        r = full_model(*args, ratio, VecAddModel.zero(), costs=measured)
        assert r["codec_s"] == pytest.approx(_true(name, params, 64, 8), rel=1e-6)
        stated = full_model(*args, ratio, VecAddModel.zero())  # the constants: V100
        spec = CompressorSpec.of(name, **dict(params))
        assert stated["codec_s"] == pytest.approx(V100.seconds(spec, 16 * MB, 8), rel=1e-9)
        assert r["codec_s"] != pytest.approx(stated["codec_s"])
