"""The codec probe, and LocalComm as a stand-in for W identical ranks."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from autotune import compressors
from autotune.compressors import LocalComm
from autotune.errors import CompressorError, ProfileError
from autotune.probes.codecs import (
    BASELINE_SPECS,
    DEFAULT_GRID,
    DENSER_AT,
    MIN_LIVE_ROWS,
    SAMPLE_ABOVE,
    SAMPLE_NUMEL,
    probe_codecs,
    row_plan,
)
from autotune.probes.compute import probe_compute
from autotune.probes.run import BUDGET_SHARES, CAPTURE_STEPS
from autotune.workloads import Workload, cnn, dlrm, mlp, transformer

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
        # data-dependent methods at the density of the tensor timed (these are dense)
        density = row.get("row_density")
        assert (density is not None) == comp.density_dependent
        assert row["wire_messages"] == comp.wire_messages(row["shape"], 2, density)
        assert row["wire_bytes"] == sum(row["wire_messages"].values())
        assert row["wire_bytes"] == comp.wire_bytes(row["shape"], 2, density)


def test_none_is_exact_and_lossy_methods_are_not(result: dict[str, Any]) -> None:
    wire = {(r["label"], tuple(r["shape"])): r["wire_bytes"] for r in result["shapes"]}
    for row in result["errors"]:
        shape = SHAPES[row["param"]]
        # PowerSGD sends vectors and small matrices uncompressed, in fp32; rowsparse is
        # exact (here it allreduces these dense gradients)
        exact = row["spec"]["compressor"] in ("none", "rowsparse") or (
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


@pytest.mark.multirank
def test_distributed_share_is_combined_on_every_rank(run_ranks: Any) -> None:
    a, b = run_ranks("test_probe_codecs:rank_codecs")
    assert a["grid"] == b["grid"] == [{"compressor": "none"}, {"compressor": "fp16"},
                                      {"compressor": "topk"}]
    assert a["errors"] == b["errors"] and a["shapes"] == b["shapes"]
    assert len(a["errors"]) == 3 * len(SHAPES)


# --- gradient structure: non-zero rows per step and rank -------------------------------


def test_row_structure_is_measured_per_step_and_summarised() -> None:
    table = [torch.zeros(1000, 8) for _ in range(3)]
    for step, g in enumerate(table):  # 10, 20 and 40 rows touched
        g[torch.randperm(1000, generator=torch.Generator().manual_seed(step))[:10 * 2**step]] = 1.0
    vector = torch.tensor([0.0, 1.0, 0.0, float("nan")])  # a NaN is sent, so it counts
    grads = {"emb.weight": table, "b": [vector] * 3, "w": [torch.randn(5, 3)] * 3}
    out = probe_codecs(grads, world_size=2, grid=[{"compressor": "none"}], reps=1)
    emb = out["structure"]["emb.weight"]
    assert emb["row_density_max"] == 0.04 and emb["steps"] == 3 and emb["ranks"] == 1
    assert emb["row_density_mean"] == pytest.approx(0.07 / 3)
    assert emb["row_density_std"] == pytest.approx(torch.tensor([0.01, 0.02, 0.04]).std(
        unbiased=False).item())
    assert out["structure"]["b"] == {"row_density_mean": 0.5, "row_density_max": 0.5,
                                     "row_density_std": 0.0, "steps": 3, "ranks": 1}
    assert out["structure"]["w"]["row_density_max"] == 1.0


EMBEDDING_ROWS = 2000
TOUCHED = (20, 50)  # distinct rows each rank's batch looks up, every step


def embedding_workload() -> Workload:
    """An embedding bag and a linear head; rank r's batches touch exactly TOUCHED[r]
    distinct rows of the table (different ones each step)."""
    import torch.distributed as dist
    from torch import nn

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(EMBEDDING_ROWS, 8), nn.Linear(8, 1))

    def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        ids = torch.randperm(EMBEDDING_ROWS, generator=gen)[:TOUCHED[rank]]
        return ids, torch.randn(len(ids), 1, generator=gen)

    return Workload(model, make_batch, torch.nn.functional.mse_loss, name="embedding")


def rank_structure() -> dict[str, Any]:
    torch.set_num_threads(1)
    _, grads = probe_compute(embedding_workload(), steps=3, warmup=1, capture=3)
    return probe_codecs(grads, world_size=2, grid=[{"compressor": "rowsparse"}], reps=1,
                        distribute=True)


@pytest.mark.multirank
def test_the_structure_of_real_gradients_is_combined_over_ranks(run_ranks: Any) -> None:
    a, b = run_ranks("test_probe_codecs:rank_structure")
    assert a["structure"] == b["structure"]
    table = a["structure"]["0.weight"]
    lo, hi = (t / EMBEDDING_ROWS for t in TOUCHED)
    # the busiest rank's share, the mean and spread over both ranks' three steps
    assert table["row_density_max"] == hi
    assert table["row_density_mean"] == pytest.approx((lo + hi) / 2)
    assert table["row_density_std"] == pytest.approx((hi - lo) / 2)
    assert (table["steps"], table["ranks"]) == (3, 2)
    assert {a["structure"][n]["row_density_max"] for n in ("0.weight", "1.weight", "1.bias")} == {
        hi, 1.0}
    # rowsparse was timed on the captured table, at its rows' density, and is exact
    timed = next(r for r in a["shapes"] if r["shape"] == [EMBEDDING_ROWS, 8])
    assert timed["row_density"] in (lo, hi)
    assert all(r["rel_error"] == 0.0 for r in a["errors"])


def test_rowsparse_is_timed_on_the_real_rows_and_on_a_fuller_copy(
    table_grads: dict[str, list[torch.Tensor]],
) -> None:
    out = probe_codecs(table_grads, world_size=2, grid=[{"compressor": "rowsparse"}], reps=1)
    table = next(r for r in out["shapes"] if r["shape"] == [70_000, 16])
    last = table_grads["emb.weight"][-1]
    density = int((last != 0).any(dim=1).sum()) / 70_000
    # timed on the last captured step (first on its row sample, then, with no budget
    # to keep to, in full), and a copy with a quarter of its rows filled
    assert table["measured"] == "full" and table["row_density"] == density
    assert table["denser"]["row_density"] == pytest.approx(DENSER_AT, abs=1e-3)
    comp = compressors.create("rowsparse")
    assert table["wire_bytes"] == comp.wire_bytes((70_000, 16), 2, table["row_density"])
    assert table["wire_bytes"] < 0.1 * comp.wire_bytes((70_000, 16), 2)  # dense: 4.5 MB
    dense = next(r for r in out["shapes"] if r["shape"] == [64, 32])
    assert dense["row_density"] == 1.0 and "denser" not in dense
    # exact, and on the table measured on its live rows
    errors = {r["param"]: r for r in out["errors"]}
    assert errors["emb.weight"]["measured"] == "live_rows"
    assert all(r["cum_error"] == 0.0 and r["rel_error"] == 0.0 for r in errors.values())


# --- large tensors: measured on their rows --------------------------------------------


def _sparse_table(rows: int = 70_000, dim: int = 16, candidates: int = 3000,
                  steps: int = 3, seed: int = 0) -> list[torch.Tensor]:
    """Gradients of an embedding table: ~1% of its rows live in some step, with
    Zipf-like magnitudes, the hot rows live in every step (as skewed lookups give)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(rows, generator=gen)[:candidates]
    rank = torch.arange(1, candidates + 1, dtype=torch.float32)  # hot rows first
    out = []
    for _ in range(steps):
        g = torch.zeros(rows, dim)
        keep = torch.rand(candidates, generator=gen) < 0.2 + rank.rsqrt()
        g[ids[keep]] = torch.randn(int(keep.sum()), dim, generator=gen) / rank[keep, None]
        out.append(g)
    return out


@pytest.fixture(scope="module")
def table_grads() -> dict[str, list[torch.Tensor]]:
    return {"emb.weight": _sparse_table(), "fc.weight": [torch.randn(64, 32) for _ in range(3)]}


EXACT_ON_LIVE_ROWS = [
    {"compressor": "none"}, {"compressor": "fp16"}, {"compressor": "bf16"},
    {"compressor": "powersgd", "rank": 1}, {"compressor": "powersgd", "rank": 4},
    {"compressor": "topk", "ratio": 0.01}, {"compressor": "topk", "ratio": 0.0005},
]


def test_a_sparse_table_is_planned_on_its_live_rows_and_a_proportional_sample() -> None:
    steps = _sparse_table()
    plan = row_plan("emb.weight", steps)
    assert plan is not None and plan.rows == 70_000
    live = (torch.stack(steps).abs().sum(dim=(0, 2)) > 0).nonzero().flatten()
    assert torch.equal(plan.live, live)
    assert plan.sample is not None and plan.sample.numel() >= SAMPLE_NUMEL // 16
    # live rows are sampled at the rate of the others, so the sample is as sparse
    share = plan.sampled_live / plan.sample.numel()
    assert share == pytest.approx(len(live) / plan.rows, rel=0.05)
    assert plan.sampled_live >= min(MIN_LIVE_ROWS, len(live))
    assert plan.energy_ratio is not None and plan.energy_ratio > 0
    assert torch.equal(plan.sample, plan.sample.sort().values)
    # small tensors, and dense ones too small to gain from a sample, are measured whole
    assert row_plan("b", [torch.randn(1000)]) is None
    assert row_plan("m", [torch.randn(4, 300_000)]) is None


def test_live_rows_give_the_exact_error_of_a_sparse_table(
    table_grads: dict[str, list[torch.Tensor]],
) -> None:
    on_rows = probe_codecs(table_grads, world_size=2, grid=EXACT_ON_LIVE_ROWS, reps=1)
    full = probe_codecs(table_grads, world_size=2, grid=EXACT_ON_LIVE_ROWS, reps=1,
                        sample_above=None)
    ref = {(r["label"], r["param"]): r for r in full["errors"]}
    for row in on_rows["errors"]:
        want = ref[row["label"], row["param"]]
        if row["param"] == "fc.weight":
            assert row["measured"] == "full" and "sample" not in row
            continue
        assert row["measured"] == "live_rows", row["label"]
        assert row["sample"]["of_rows"] == 70_000 and row["sample"]["rows"] < 3000
        # exact for exact methods; a top-k that selects by a sampled threshold may keep
        # a few more or fewer of the smallest entries on the tensor than on its rows
        tol = 1e-3 if row["spec"]["compressor"] == "topk" else 1e-5
        for key in ("rel_error_steps", "cum_error_steps"):
            assert row[key] == pytest.approx(want[key], abs=tol), (row["label"], key)
    # the low-ratio top-k and rank-1 PowerSGD lose a real part of this gradient
    assert max(r["cum_error"] for r in on_rows["errors"] if r["param"] == "emb.weight") > 0.1


def test_sign_and_int8_are_measured_on_a_row_sample_with_the_full_error(
    table_grads: dict[str, list[torch.Tensor]],
) -> None:
    grid = [{"compressor": "sign"}, {"compressor": "int8"}]
    on_rows = probe_codecs(table_grads, world_size=2, grid=grid, reps=1)
    full = probe_codecs(table_grads, world_size=2, grid=grid, reps=1, sample_above=None)
    ref = {(r["label"], r["param"]): r for r in full["errors"]}
    for row in on_rows["errors"]:
        if row["param"] != "emb.weight":
            continue
        assert row["measured"] == "sample"
        sample = row["sample"]
        assert sample["numel"] == 16 * sample["rows"] and sample["of_live_rows"] > 0
        assert sample["live_rows"] <= sample["of_live_rows"]
        assert row["cum_error"] == pytest.approx(ref[row["label"], row["param"]]["cum_error"],
                                                 abs=0.05)


def test_powersgd_on_too_few_rows_of_a_dense_matrix_is_measured_in_full() -> None:
    # 200 rows of 6000: a 64-row sample would make rank-4 PowerSGD's bytes per element
    # (and its error) another matrix's; elementwise methods may use the sample
    grads = {"w": [torch.randn(200, 6000) for _ in range(2)]}
    grid = [{"compressor": "powersgd", "rank": 4}, {"compressor": "int8"}]
    out = probe_codecs(grads, world_size=2, grid=grid, reps=1, budget_s=1e-9)
    modes = {r["label"]: r["measured"] for r in out["errors"]}
    assert modes == {"powersgd(rank=4)": "full", "int8": "sample"}
    times = {r["label"]: r for r in out["shapes"]}
    assert times["powersgd(rank=4)"]["measured"] == "full"


def test_times_are_scaled_from_a_sample_then_measured_in_full_as_budget_allows(
    table_grads: dict[str, list[torch.Tensor]],
) -> None:
    grid = [{"compressor": "none"}, {"compressor": "int8"}]
    # no budget left after the cells: the large shape's times stay scaled, and say so
    scaled = probe_codecs(table_grads, world_size=2, grid=grid, reps=1, budget_s=1e-9)
    for row in scaled["shapes"]:
        if row["shape"] == [70_000, 16]:
            assert row["measured"] == "sample"
            sample = row["sample"]
            assert sample["param"] == "emb.weight" and sample["numel"] == 16 * sample["rows"]
            assert row["encode_decode_s"] == pytest.approx(
                sample["encode_decode_s"] * 1_120_000 / sample["numel"])
        else:
            assert row["measured"] == "full" and "sample" not in row
    # without a budget every scaled time is measured in full afterwards
    timed = probe_codecs(table_grads, world_size=2, grid=grid, reps=1)
    assert all(r["measured"] == "full" for r in timed["shapes"])
    assert [r["reps"] for r in timed["shapes"] if r["shape"] == [70_000, 16]] == [1, 1]
    assert scaled["sampling"] == {"above": SAMPLE_ABOVE, "numel": SAMPLE_NUMEL,
                                  "min_live_rows": MIN_LIVE_ROWS, "representative": 0.1}


# what `autotune profile` gives the codec probe by default (--budget-s 50)
PROFILE_CODEC_BUDGET_S = 50.0 * BUDGET_SHARES["codecs"]
BUILT_INS = {"dlrm": dlrm, "cnn": lambda: cnn(batch_size=4), "transformer": transformer}


@pytest.fixture
def one_thread() -> Iterator[None]:
    # as `autotune profile` runs each of 2 ranks on a 2-core machine; two threads on a
    # core another process also uses wait on each other, up to 10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_every_cell_is_measured_within_the_profiles_budget(name: str, one_thread: None) -> None:
    # one process measures the whole grid here; `autotune profile` shares it among ranks
    _, grads = probe_compute(BUILT_INS[name](), steps=CAPTURE_STEPS, warmup=1,
                             capture=CAPTURE_STEPS)
    out = probe_codecs(grads, world_size=2, budget_s=PROFILE_CODEC_BUDGET_S)
    assert out["truncated"] is False and out["skipped"] == []
    labels = {compressors.CompressorSpec.from_dict(d).label() for d in DEFAULT_GRID}
    assert {(r["label"], r["param"]) for r in out["errors"]} == {
        (label, name) for label in labels for name in grads}
    assert all(r["rel_error"] is not None for r in out["errors"])
    assert out["wall_s"] < PROFILE_CODEC_BUDGET_S
    if name == "dlrm":  # its tables are measured on their rows
        modes = {r["measured"] for r in out["errors"] if r["param"].startswith("tables.")}
        assert modes >= {"live_rows", "sample"}
        # rowsparse timed on the six tables' real rows (0.15-1.5% of them), and again fuller
        tables = [r for r in out["shapes"] if r["label"] == "rowsparse" and r["shape"][0] >= 10_000]
        assert len(tables) == 6
        assert all(r["row_density"] < 0.05 and "denser" in r for r in tables)
