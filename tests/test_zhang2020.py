"""Zhang et al. 2020's profiles and cost model (autotune.models.zhang2020).

Synthetic logs written to tmp_path test the parsers and the model everywhere; the three
shipped profiles are checked too when the project's shared data folder is present.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from autotune.errors import ProfileError
from autotune.models.zhang2020 import (
    ITERATION_S,
    Layer,
    VecAddModel,
    Zhang2020Profile,
    default_vec_add,
    paper_grid,
    paper_model,
    read_vec_add,
    read_zhang2020,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "zhang2020"
needs_data = pytest.mark.skipif(
    not (DATA / "resnet50.bk.log").is_file(),
    reason=f"the shared Zhang 2020 data is not at {DATA} (only the project's workspace has it)",
)
SHIPPED = {"resnet50": (161, 102.2e6), "resnet101": (314, 178.2e6), "vgg16": (58, 553.5e6)}
GBPS = 1e9


def write_log(path: Path, rows: list[str], count: int | None = None, batches: str = "1") -> Path:
    header = ["a comment", batches, str(len(rows) if count is None else count)]
    path.write_text("\n".join(header + rows) + "\n")
    return path


def make_profile(
    waits_s: list[float], sizes: list[int], iteration_s: float = 1.0
) -> Zhang2020Profile:
    layers = tuple(Layer(w, b) for w, b in zip(waits_s, sizes, strict=True))
    return Zhang2020Profile(name="synthetic", layers=layers, iteration_s=iteration_s)


def random_profile(seed: int) -> Zhang2020Profile:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 80))
    waits = rng.uniform(0, 3e-3, n).tolist()
    sizes = rng.integers(0, 40 * 2**20, n).tolist()
    return make_profile(waits, sizes, iteration_s=float(sum(waits)) * 1.8 + 1e-3)


# an affine reduction cost with a launch floor: time per byte never grows with size
AFFINE_VEC_ADD = VecAddModel.from_points([(1.0, 1e-5), (1e9, 1e-5 + 1e9 * 3.5e-12)])


# --------------------------------------------------------------------------- parsing
class TestReadProfile:
    def test_reads_a_synthetic_log(self, tmp_path: Path) -> None:
        path = write_log(tmp_path / "tiny.bk.log", ["1000,400", "2500.5,8", "0,0"])
        p = read_zhang2020(path, iteration_s=0.01)
        assert p.name == "tiny"
        assert [layer.grad_bytes for layer in p.layers] == [400, 8, 0]
        assert [layer.wait_s for layer in p.layers] == pytest.approx([1e-3, 2.5005e-3, 0.0])
        assert p.backward_s == pytest.approx(3.5005e-3)
        assert p.ready_s == pytest.approx((1e-3, 3.5005e-3, 3.5005e-3))
        assert p.total_bytes == 408
        assert p.iteration_s == 0.01
        assert p.source == str(path)

    def test_known_model_gets_its_published_iteration_time(self, tmp_path: Path) -> None:
        p = read_zhang2020(write_log(tmp_path / "vgg16.bk.log", ["1,4"]))
        assert p.iteration_s == ITERATION_S["vgg16"]
        assert read_zhang2020(tmp_path / "vgg16.bk.log", iteration_s=2.0).iteration_s == 2.0

    def test_unknown_model_needs_iteration_s(self, tmp_path: Path) -> None:
        path = write_log(tmp_path / "mystery.bk.log", ["1,4"])
        with pytest.raises(ProfileError, match=r"mystery\.bk\.log.*'mystery'.*iteration_s="):
            read_zhang2020(path)

    @pytest.mark.parametrize(
        ("rows", "count", "batches", "line", "words"),
        [
            (["1,4", "2,8"], 3, "1", 6, "announces 3 layers, the file holds 2"),
            (["1,4", "2,8", "3,8"], 2, "1", 6, "announces 2 layers, the file holds 3"),
            (["1,4", "x,8"], None, "1", 5, "as numbers"),
            (["1,4", "2,8.5"], None, "1", 5, "as numbers"),
            (["1,4", "2,8,9"], None, "1", 5, "expected 'wait_us,grad_bytes'"),
            (["-1,4"], None, "1", 4, "wait_us must be"),
            (["1,-4"], None, "1", 4, "grad_bytes must be"),
            (["nan,4"], None, "1", 4, "wait_us must be"),
            (["1,4"], None, "two", 2, "number of batches"),
            (["1,4"], None, "3", 2, "expected 1 batch"),
        ],
    )
    def test_malformed_log_names_file_and_line(
        self,
        tmp_path: Path,
        rows: list[str],
        count: int | None,
        batches: str,
        line: int,
        words: str,
    ) -> None:
        path = write_log(tmp_path / "bad.bk.log", rows, count=count, batches=batches)
        with pytest.raises(ProfileError, match=rf"bad\.bk\.log:{line}: .*") as info:
            read_zhang2020(path, iteration_s=1.0)
        assert words in str(info.value)

    def test_truncated_header_and_bad_count(self, tmp_path: Path) -> None:
        path = tmp_path / "short.bk.log"
        path.write_text("comment\n1\n")
        with pytest.raises(ProfileError, match=r"short\.bk\.log:3: .*ends after 2 line"):
            read_zhang2020(path, iteration_s=1.0)
        path.write_text("comment\n1\nmany\n1,4\n")
        with pytest.raises(ProfileError, match=r"short\.bk\.log:3: .*number of layers"):
            read_zhang2020(path, iteration_s=1.0)

    def test_missing_file_and_bad_iteration_time(self, tmp_path: Path) -> None:
        with pytest.raises(ProfileError, match="cannot read"):
            read_zhang2020(tmp_path / "absent.bk.log", iteration_s=1.0)
        path = write_log(tmp_path / "resnet50.bk.log", ["1,4"])
        with pytest.raises(ProfileError, match="iteration_s must be"):
            read_zhang2020(path, iteration_s=0.0)


@needs_data
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_profiles(name: str) -> None:
    p = read_zhang2020(DATA / f"{name}.bk.log")
    layers, total = SHIPPED[name]
    assert p.name == name
    assert len(p.layers) == layers
    assert p.total_bytes == pytest.approx(total, rel=0.01)
    assert p.iteration_s == ITERATION_S[name]
    # the backward pass is part of the iteration, not longer than it
    assert 0 < p.backward_s < p.iteration_s
    assert p.ready_s[-1] == pytest.approx(p.backward_s)


# --------------------------------------------------------------------------- vector add
class TestVecAdd:
    def test_interpolates_monotonically_and_extrapolates_the_last_slope(self) -> None:
        # noisy small sizes (as in the real log) are lifted to a running maximum
        va = VecAddModel.from_points([(300, 1.0), (100, 2.0), (200, 1.5), (400, 3.0)])
        assert va.nbytes == (100.0, 200.0, 300.0, 400.0)
        assert va.seconds == (2.0, 2.0, 2.0, 3.0)
        assert va.time(50) == 2.0  # floor below the smallest size
        assert va.time(350) == pytest.approx(2.5)
        assert va.time(600) == pytest.approx(5.0)  # slope of the last segment: 1/100 per byte
        grid = np.linspace(0, 1000, 101)
        assert np.all(np.diff(va.time(grid)) >= 0)

    def test_flat_tail_extrapolates_at_the_overall_rate(self) -> None:
        va = VecAddModel.from_points([(100, 1.0), (200, 1.0)])
        assert va.time(400) == pytest.approx(1.0 + 200 * (1.0 / 200))
        assert VecAddModel.from_points([(100, 1.0)]).time(300) == pytest.approx(3.0)

    def test_zero_model_costs_nothing(self) -> None:
        assert VecAddModel.zero().time(1e9) == 0.0
        assert np.all(VecAddModel.zero().time(np.array([1.0, 2.0])) == 0.0)

    def test_rejects_unsorted_direct_construction(self) -> None:
        with pytest.raises(ValueError, match="from_points"):
            VecAddModel(nbytes=(2.0, 1.0), seconds=(1.0, 1.0))

    def test_reads_a_log_and_rejects_bad_lines(self, tmp_path: Path) -> None:
        path = tmp_path / "cuda_vec_add.log"
        path.write_text("40,1e-05\n80,2e-05\n\n")
        assert read_vec_add(path).time(60) == pytest.approx(1.5e-5)
        for text, line in [("40,1e-05\n80\n", 2), ("40,x\n", 1), ("0,1e-5\n", 1), ("40,-1\n", 1)]:
            path.write_text(text)
            with pytest.raises(ProfileError, match=rf"cuda_vec_add\.log:{line}: "):
                read_vec_add(path)
        path.write_text("\n")
        with pytest.raises(ProfileError, match="no 'bytes,seconds' sample"):
            read_vec_add(path)

    def test_default_looks_next_to_the_profile(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        profile = read_zhang2020(write_log(tmp_path / "resnet50.bk.log", ["1,4"]))
        with caplog.at_level(logging.WARNING, logger="autotune.models.zhang2020"):
            assert default_vec_add(profile) == VecAddModel.zero()
        assert "reduction cost taken as zero" in caplog.text
        (tmp_path / "cuda_vec_add.log").write_text("40,1e-05\n80,2e-05\n")
        assert default_vec_add(profile).time(80) == pytest.approx(2e-5)
        assert default_vec_add(tmp_path / "resnet50.bk.log").time(80) == pytest.approx(2e-5)

    @needs_data
    def test_shipped_log(self) -> None:
        va = read_vec_add(DATA / "cuda_vec_add.log")
        assert len(va.nbytes) == 25
        assert va.time(40) == pytest.approx(1.04448e-05)
        assert va.time(671088640) == pytest.approx(0.00243368)
        assert va.time(2 * 671088640) > va.time(671088640)


# --------------------------------------------------------------------------- the model
class TestFlushGrouping:
    def test_hand_computed_timeline(self) -> None:
        # Thresholds 0.5 s / 1000 B; times are binary fractions so the ties are exact.
        # A+B reach 0.5 s: flush at 0.5 (time rule, B included since the check follows
        # the add); C alone reaches 1000 B: flush at 0.625 (bytes rule); D+E end the pass.
        p = make_profile(
            [0.25, 0.25, 0.125, 0.125, 0.25], [100, 100, 1000, 400, 0], iteration_s=2.0
        )
        va = VecAddModel.from_points([(0, 0.0), (1000, 1.0)])  # 1 ms per byte
        r = paper_model(
            p, world_size=2, bandwidth_bps=800, vec_add=va, flush_ms=500, flush_bytes=1000
        )
        got = [(f["ready_s"], f["bytes"], f["start_s"], f["end_s"]) for f in r["flushes"]]
        # 800 bit/s, N=2: each phase S*8*(1/2)/800 = S/200 s, two phases S/100 s;
        # reduce-scatter adds (N-1)*vec_add(S/2) = S/2 ms.
        expected = [
            (0.5, 200, 0.5, 0.5 + 2.0 + 0.1),
            (0.625, 1000, 2.6, 2.6 + 10.0 + 0.5),
            (1.0, 400, 13.1, 13.1 + 4.0 + 0.2),
        ]
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g == pytest.approx(e)
        assert r["backward_s"] == 1.0
        assert r["exposed_comm_s"] == pytest.approx(16.3)
        assert r["step_s"] == pytest.approx(18.3)
        assert r["scaling_factor"] == pytest.approx(2.0 / 18.3)
        assert r["flushes"][1]["network_s"] == pytest.approx(10.0)
        assert r["flushes"][1]["reduce_s"] == pytest.approx(0.5)

    def test_compression_divides_network_time_only(self) -> None:
        p = make_profile([0.25, 0.25, 0.125, 0.125, 0.25], [100, 100, 1000, 400, 0])
        va = VecAddModel.from_points([(0, 0.0), (1000, 1.0)])
        r = paper_model(p, 2, 800, compression=2.0, vec_add=va, flush_ms=500, flush_bytes=1000)
        assert [f["network_s"] for f in r["flushes"]] == pytest.approx([1.0, 5.0, 2.0])
        assert [f["reduce_s"] for f in r["flushes"]] == pytest.approx([0.1, 0.5, 0.2])

    def test_default_thresholds_5ms_and_64MiB(self) -> None:
        mib = 2**20
        p = make_profile([3e-3, 3e-3, 1e-3, 1e-3, 1e-4], [10, 10, 10, 64 * mib, 10])
        r = paper_model(p, 4, 1e12, vec_add=VecAddModel.zero())
        assert [f["bytes"] for f in r["flushes"]] == [20, 10 + 64 * mib, 10]
        assert [f["ready_s"] for f in r["flushes"]] == pytest.approx([6e-3, 8e-3, 8.1e-3])
        first, big, last = r["flushes"]
        assert (first["start_s"], big["start_s"]) == (first["ready_s"], big["ready_s"])
        # the 64 MiB flush takes 2 * (64 MiB + 10 B) * 8 * 3/4 / 1e12 s = 0.8 ms, so the
        # last one, ready 0.1 ms later, waits for the channel
        assert big["end_s"] == pytest.approx(8e-3 + (64 * mib + 10) * 12 / 1e12)
        assert last["start_s"] == big["end_s"] > last["ready_s"]

    def test_empty_groups_send_nothing(self) -> None:
        p = make_profile([1.0, 1.0], [0, 0], iteration_s=3.0)
        r = paper_model(p, 8, 1e9, vec_add=AFFINE_VEC_ADD)
        assert r["flushes"] == [] and r["exposed_comm_s"] == 0.0 and r["scaling_factor"] == 1.0

    def test_one_worker_communicates_nothing(self) -> None:
        r = paper_model(random_profile(0), 1, 1e9, vec_add=AFFINE_VEC_ADD)
        assert r["scaling_factor"] == 1.0

    @pytest.mark.parametrize(
        ("kwargs", "words"),
        [
            ({"world_size": 0}, "world_size"),
            ({"world_size": 2.0}, "world_size"),
            ({"bandwidth_bps": 0.0}, "bandwidth_bps"),
            ({"compression": -1.0}, "compression"),
            ({"flush_ms": -1.0}, "flush_ms"),
            ({"flush_bytes": 1.5}, "flush_bytes"),
        ],
    )
    def test_rejects_bad_arguments(self, kwargs: dict, words: str) -> None:
        args = {"world_size": 2, "bandwidth_bps": 1e9, "vec_add": VecAddModel.zero(), **kwargs}
        with pytest.raises(ValueError, match=words):
            paper_model(random_profile(1), **args)


# --------------------------------------------------------------------------- invariants
WORLD_SIZES = [2, 4, 8, 16, 32, 64, 128]
BANDWIDTHS = [0.1 * GBPS, 1 * GBPS, 10 * GBPS, 25 * GBPS, 40 * GBPS, 100 * GBPS, 400 * GBPS]
COMPRESSIONS = [1, 2, 5, 10, 50, 100]


def check_invariants(profile: Zhang2020Profile, vec_add: VecAddModel) -> None:
    rows = paper_grid(profile, WORLD_SIZES, BANDWIDTHS, COMPRESSIONS, vec_add)
    sf = np.array([r["scaling_factor"] for r in rows]).reshape(
        len(WORLD_SIZES), len(BANDWIDTHS), len(COMPRESSIONS)
    )
    tol = 1e-12
    assert np.all((sf > 0) & (sf <= 1))
    assert np.all(np.diff(sf, axis=1) >= -tol), "more bandwidth must not lower the scaling factor"
    assert np.all(np.diff(sf, axis=2) >= -tol), "more compression must not lower it"
    assert np.all(np.diff(sf, axis=0) <= tol), "more workers (N >= 2) must not raise it"


@pytest.mark.parametrize("seed", range(8))
def test_invariants_on_synthetic_profiles(seed: int) -> None:
    check_invariants(random_profile(seed), AFFINE_VEC_ADD)
    check_invariants(random_profile(seed), VecAddModel.zero())


@needs_data
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_invariants_on_shipped_profiles(name: str) -> None:
    check_invariants(
        read_zhang2020(DATA / f"{name}.bk.log"), read_vec_add(DATA / "cuda_vec_add.log")
    )


def test_grid_rows() -> None:
    p = random_profile(3)
    rows = paper_grid(p, [2, 4], [1e9, 1e10, 1e11], [1, 2], AFFINE_VEC_ADD)
    assert len(rows) == 12
    assert set(rows[0]) == {
        "name",
        "model",
        "world_size",
        "bandwidth_bps",
        "compression",
        "step_s",
        "exposed_comm_s",
        "scaling_factor",
    }
    assert (rows[0]["name"], rows[0]["model"]) == ("paper", "synthetic")
    assert [(r["world_size"], r["bandwidth_bps"], r["compression"]) for r in rows[:3]] == [
        (2, 1e9, 1),
        (2, 1e9, 2),
        (2, 1e10, 1),
    ]
    direct = paper_model(p, 4, 1e11, 2, vec_add=AFFINE_VEC_ADD)
    assert rows[-1]["step_s"] == direct["step_s"]


@needs_data
def test_matches_the_papers_conclusions() -> None:
    """The abstract: no need for compression at 100 Gbps; 10 Gbps needs only 2-5x."""
    va = read_vec_add(DATA / "cuda_vec_add.log")
    resnet = read_zhang2020(DATA / "resnet50.bk.log")
    vgg = read_zhang2020(DATA / "vgg16.bk.log")

    def sf(p: Zhang2020Profile, gbps: float, c: float = 1.0) -> float:
        return paper_model(p, 64, gbps * GBPS, c, vec_add=va)["scaling_factor"]

    assert sf(resnet, 100) > 0.95
    assert sf(resnet, 10) < 0.9 and sf(resnet, 10, 5) > 0.95
    assert sf(vgg, 10) < sf(resnet, 10) and sf(vgg, 1) < sf(resnet, 1)
    # compression gains more where bandwidth is scarce
    assert sf(resnet, 10, 5) - sf(resnet, 10) > sf(resnet, 100, 5) - sf(resnet, 100)
