"""The codec probe, and LocalComm as a stand-in for W identical ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotune import compressors
from autotune.compressors import LocalComm
from autotune.errors import CompressorError, ProfileError
from autotune.probes.codecs import BASELINE_SPECS, DEFAULT_GRID, probe_codecs
from autotune.probes.compute import probe_compute
from autotune.workloads import mlp

SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (64, 32), "fc.bias": (64,),
          "fc2.weight": (64, 32)}


def _grads(steps: int = 3, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {n: [torch.randn(s, generator=gen) for _ in range(steps)] for n, s in SHAPES.items()}


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return probe_codecs(_grads(), world_size=2, reps=2)


def test_every_configuration_shape_and_parameter_is_measured(result: dict[str, Any]) -> None:
    grid = [compressors.CompressorSpec.from_dict(d).to_dict() for d in DEFAULT_GRID]
    assert result["grid"] == grid and result["skipped"] == [] and result["truncated"] is False
    distinct = {s for s in SHAPES.values()}
    assert len(result["shapes"]) == len(grid) * len(distinct)
    assert len(result["errors"]) == len(grid) * len(SHAPES)
    for row in result["shapes"]:
        assert row["encode_decode_s"] > 0
    for row in result["errors"]:
        assert len(row["rel_error_steps"]) == len(row["cum_error_steps"]) == 3


def test_wire_bytes_are_the_compressors_own(result: dict[str, Any]) -> None:
    for row in result["shapes"]:
        comp = compressors.create(row["spec"]["compressor"],
                                  **{k: v for k, v in row["spec"].items() if k != "compressor"})
        assert row["wire_messages"] == comp.wire_messages(row["shape"], 2)
        assert row["wire_bytes"] == sum(row["wire_messages"].values())
        assert row["wire_bytes"] == comp.wire_bytes(row["shape"], 2)


def test_none_is_exact_and_lossy_methods_are_not(result: dict[str, Any]) -> None:
    wire = {(r["label"], tuple(r["shape"])): r["wire_bytes"] for r in result["shapes"]}
    for row in result["errors"]:
        shape = SHAPES[row["param"]]
        # PowerSGD sends vectors and small matrices uncompressed, in fp32
        exact = row["spec"]["compressor"] == "none" or (
            row["spec"]["compressor"] == "powersgd"
            and wire[row["label"], shape] == 4 * torch.Size(shape).numel()
        )
        if exact:
            assert row["rel_error"] == 0.0 and row["cum_error"] == 0.0, row["label"]
        else:
            assert row["rel_error"] > 0, (row["label"], row["param"])


def test_error_feedback_lowers_the_accumulated_error_not_the_step_error() -> None:
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    grads = {"w": [g] * 6}  # the same gradient every step
    grid = [{"compressor": "topk", "ratio": 0.1, "error_feedback": ef} for ef in (True, False)]
    with_ef, without = probe_codecs(grads, world_size=1, grid=grid, reps=1)["errors"]
    assert with_ef["cum_error"] < without["cum_error"]
    assert with_ef["cum_error_steps"] == sorted(with_ef["cum_error_steps"], reverse=True)
    # Each step's update also carries the residual, so it is *further* from g.
    assert with_ef["rel_error"] > without["rel_error"]
    assert with_ef["rel_error_steps"][0] == pytest.approx(without["rel_error_steps"][0])


@pytest.mark.parametrize("name", compressors.names())
def test_local_comm_of_identical_ranks_averages_to_one_rank(name: str) -> None:
    grads = [g[0] for g in _grads(steps=1).values()]
    names = list(SHAPES)
    outs = {}
    for world in (1, 4):
        out = [g.clone() for g in grads]
        compressors.create(name).reduce(out, names, LocalComm(world))
        outs[world] = out
    for a, b in zip(outs[1], outs[4]):
        torch.testing.assert_close(a, b)


def test_local_comm_simulates_w_ranks() -> None:
    comm = LocalComm(world_size=3)
    x = torch.ones(2, 5)
    assert torch.equal(comm.all_reduce(x), torch.full((2, 5), 3.0))
    gathered = comm.all_gather(torch.arange(4))
    assert gathered.shape == (3, 4) and torch.equal(gathered[2], torch.arange(4))
    assert comm.sent == {"allreduce": 40, "allgather": 32}  # what this rank hands in
    with pytest.raises(ValueError, match="world_size"):
        LocalComm(world_size=0)


def test_budget_skips_sizes_but_never_a_whole_method_nor_a_baseline() -> None:
    out = probe_codecs(_grads(steps=2), world_size=2, reps=1, budget_s=1e-9)
    assert out["truncated"] is True
    methods = list(dict.fromkeys(g["compressor"] for g in DEFAULT_GRID))
    firsts = [next(g for g in DEFAULT_GRID if g["compressor"] == m) for m in methods]
    kept = firsts + [g for g in BASELINE_SPECS.values() if g not in firsts]
    # the first of each method and the tuner's baselines (PowerSGD rank 1 is not a first)
    assert {"compressor": "powersgd", "rank": 1} in out["grid"]
    assert sorted(map(str, out["grid"])) == sorted(map(str, kept))
    assert len(out["skipped"]) == len(DEFAULT_GRID) - len(kept)
    assert {r["spec"]["compressor"] for r in out["errors"]} == set(methods)


def test_bad_input() -> None:
    with pytest.raises(ProfileError, match="captured"):
        probe_codecs({}, world_size=2)
    with pytest.raises(ProfileError, match="same number"):
        probe_codecs({"a": [torch.ones(3)], "b": [torch.ones(3)] * 2}, world_size=2)
    with pytest.raises(ProfileError, match="world_size"):
        probe_codecs(_grads(), world_size=0)
    with pytest.raises(CompressorError):
        probe_codecs(_grads(), world_size=2, grid=[{"compressor": "zip"}])


def test_on_gradients_the_compute_probe_captured() -> None:
    _, grads = probe_compute(mlp(hidden=32, depth=1), steps=2, warmup=0, capture=2)
    out = probe_codecs(grads, world_size=2, grid=[{"compressor": "powersgd", "rank": 2}], reps=1)
    assert {r["param"] for r in out["errors"]} == set(grads)


def rank_codecs() -> dict[str, Any]:
    torch.set_num_threads(1)
    grid = [{"compressor": "none"}, {"compressor": "fp16"}, {"compressor": "topk"}]
    return probe_codecs(_grads(steps=2), world_size=2, grid=grid, reps=1, distribute=True)


def test_distributed_share_is_combined_on_every_rank(run_ranks: Any) -> None:
    a, b = run_ranks("test_probe_codecs:rank_codecs")
    assert a["grid"] == b["grid"] == [{"compressor": "none"}, {"compressor": "fp16"},
                                      {"compressor": "topk"}]
    assert a["errors"] == b["errors"] and a["shapes"] == b["shapes"]
    assert len(a["errors"]) == 3 * len(SHAPES)
