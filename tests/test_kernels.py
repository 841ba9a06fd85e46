"""The compiled CPU kernels of sign, int8 and topk compute what the torch forms compute.

test_compressors_large runs every property on both forms; here the two forms' outputs
and error feedback are compared step by step on the same gradients, for 1 to 3 ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from autotune import compressors
from autotune.compressors import LocalComm, kernels
from autotune.compressors import int8 as int8_module

N = 3 * 2**18 + 1_001  # several chunks of every module, a ragged tail
N_PADDED = 1_200_001  # large enough for top-k 0.1's threshold above the k-th largest


def _run(form: str, name: str, params: dict, world: int, monkeypatch: pytest.MonkeyPatch,
         steps: int = 3, n: int = N) -> tuple[list[torch.Tensor], dict]:
    """Outputs of ``steps`` reductions of skewed gradients, and the state after them."""
    monkeypatch.setenv(kernels.ENV, form)
    kernels.available.cache_clear()
    try:
        comp = compressors.create(name, **params)
        gen = torch.Generator().manual_seed(0)
        outs = []
        for _ in range(steps):
            g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3
            comp.reduce([g], ["p"], LocalComm(world))
            outs.append(g)
        return outs, comp.state_dict()
    finally:
        kernels.available.cache_clear()


@pytest.fixture
def needs_numba() -> None:
    kernels.available.cache_clear()
    if not kernels.available():
        pytest.skip("numba is not installed: the codecs' compiled kernels cannot run")


def test_numba_is_installed_so_the_kernels_run_here() -> None:
    # numba is a dependency: without it every kernel test below would skip silently
    kernels.available.cache_clear()
    assert kernels.available()
    assert kernels.use_for(torch.zeros(1))


@pytest.mark.usefixtures("needs_numba")
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("ratio", "n"), [(0.1, N), (0.01, N), (0.001, N), (0.1, N_PADDED)])
def test_topk_kernels_send_and_keep_exactly_what_torch_does(
        ratio: float, n: int, world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fused, fused_state = _run("numba", "topk", {"ratio": ratio}, world, monkeypatch, n=n)
    eager, eager_state = _run("torch", "topk", {"ratio": ratio}, world, monkeypatch, n=n)
    for a, b in zip(fused, eager):
        assert torch.equal(a, b)
    assert torch.equal(fused_state["memory"]["p"], eager_state["memory"]["p"])


def test_the_padded_size_takes_a_threshold_above_the_kth_largest() -> None:
    assert compressors.create("topk", ratio=0.1)._pads(N_PADDED)
    assert not compressors.create("topk", ratio=0.1)._pads(N)


@pytest.mark.usefixtures("needs_numba")
@pytest.mark.parametrize("world", [2, 3])
def test_topk_decoding_sums_every_ranks_entries_and_zeroes_the_rest(world: int) -> None:
    # ranks hold different indices (LocalComm's ranks would all send the same), one
    # padded by repeating its last entry; 3 ranks divide by a number not a power of two
    n, k = 100_003, 5_000
    gen = torch.Generator().manual_seed(1)
    gathered = torch.empty(world, 2 * k, dtype=torch.int32)
    want = torch.zeros(n, dtype=torch.float64)
    for w in range(world):
        sent = k - 700 if w == 1 else k
        idx = torch.randperm(n, generator=gen)[:sent].sort().values
        idx = torch.cat([idx, idx[-1:].expand(k - sent)])
        vals = torch.randn(k, generator=gen)
        gathered[w, :k] = vals.view(torch.int32)
        gathered[w, k:] = idx.to(torch.int32)
        want.index_add_(0, idx[:sent], (vals[:sent] / world).double())
    out = torch.full((n,), float("nan"))
    kernels.get().topk_decode(kernels.array(out), kernels.array(gathered), 0, k, k, world)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-7)
    assert int((out != 0).sum()) == int((want != 0).sum())


@pytest.mark.usefixtures("needs_numba")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sign_kernels_match_torch_but_for_the_scales_last_bits(
        world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the scale, a mean of magnitudes, is summed in another order: within float32 rounding
    fused, fused_state = _run("numba", "sign", {}, world, monkeypatch)
    eager, eager_state = _run("torch", "sign", {}, world, monkeypatch)
    for a, b in zip(fused, eager):
        assert torch.equal(torch.signbit(a), torch.signbit(b))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused_state["memory"]["p"], eager_state["memory"]["p"],
                               rtol=0, atol=1e-6)


@pytest.mark.usefixtures("needs_numba")
def test_sign_defers_its_residual_pass_and_anything_reading_it_sees_it_settled() -> None:
    """The kernel path leaves the residual M - scale * sign(M) to the next step's first
    loop; a twin whose residual is read after every step (which settles it) must give the
    same outputs and residual bit for bit, and release/state_dict must hand out the
    settled residual."""
    gen = torch.Generator().manual_seed(3)
    deferring, settled = compressors.create("sign"), compressors.create("sign")
    for step in range(4):
        g = torch.randn(N, generator=gen) * torch.rand(N, generator=gen) ** 3
        a, b = g.clone(), g.clone()
        deferring.reduce([a], ["p"], LocalComm(2))
        settled.reduce([b], ["p"], LocalComm(2))
        assert len(deferring.memory._deferred) == 1  # the pass is owed, not made
        truth = settled.memory.residuals["p"].clone()  # reading settles it
        assert not settled.memory._deferred
        assert torch.equal(a, b), step
    assert torch.equal(deferring.state_dict()["memory"]["p"], truth)
    assert torch.equal(deferring.release("p").view(-1), truth.view(-1))
    assert not deferring.memory._deferred and deferring.release("p") is None


@pytest.mark.usefixtures("needs_numba")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_kernels_draw_the_same_codes_as_torch(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same noise and scales: codes differ only where a level lands within a rounding
    # of a boundary (torch may fuse the multiply-add), and sums only in their last bit
    fused, _ = _run("numba", "int8", {}, world, monkeypatch)
    eager, _ = _run("torch", "int8", {}, world, monkeypatch)
    for a, b in zip(fused, eager):
        step = float(b.abs().max()) / int8_module.LEVELS
        off_by_a_level = (a - b).abs() > 1e-5 * step
        assert int(off_by_a_level.sum()) <= 5
        assert float((a - b).abs().max()) <= step * 1.001


_FIRST_CALLS = """
import torch
from autotune.compressors import LocalComm, create
for name, kw in (("sign", {}), ("int8", {}), ("topk", {"ratio": 0.01})):
    create(name, **kw).reduce([torch.randn(64, 64)], ["w"], LocalComm(2))
"""


def test_a_second_process_loads_every_kernel_from_numbas_cache() -> None:
    # a kernel that misses the cache compiles again in every process: a second at a
    # policy's first use (numba says "data saved" for each compilation it writes)
    env = {**os.environ, "NUMBA_DEBUG_CACHE": "1"}
    runs = [subprocess.run([sys.executable, "-c", _FIRST_CALLS], capture_output=True,
                           text=True, env=env, check=True, timeout=300) for _ in range(2)]
    if "no locator available" in runs[0].stderr + runs[0].stdout:
        pytest.skip("numba has no writable cache here")
    second = runs[1].stdout + runs[1].stderr
    assert "data loaded" in second
    assert "data saved" not in second, second


def test_warm_makes_every_kernel_ready_and_says_how_long_it_took() -> None:
    seconds = kernels.warm()
    assert 0 < seconds < 300
    # every kernel now has a compiled signature (or numba is absent and none is used)
    if kernels.available():
        assert all(f.signatures for f in vars(kernels.get()).values())
