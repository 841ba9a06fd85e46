"""The large-tensor paths of topk, int8 and sign (chunked passes, top-k's sampled
threshold), which the small shapes of test_compressors do not reach; each test runs on
both CPU forms of these codecs: the compiled kernels and the torch operations (the form a
GPU runs)."""

from __future__ import annotations

import pytest
import torch

from autotune import compressors
from autotune.compressors import LocalComm
from autotune.compressors import int8 as int8_module
from autotune.compressors import kernels
from autotune.compressors import sign as sign_module
from autotune.compressors import topk as topk_module

# above topk.EXACT_BELOW; several chunks of every module's CHUNK, plus ragged tails
SIZES = [40_000, 3 * topk_module.CHUNK + 1_001]


@pytest.fixture(autouse=True, params=["kernels", "torch"])
def codec_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which form the codecs take: AUTOTUNE_KERNELS=torch forces the torch operations."""
    if request.param == "torch":
        monkeypatch.setenv(kernels.ENV, "torch")
    else:
        monkeypatch.delenv(kernels.ENV, raising=False)
    kernels.available.cache_clear()
    if request.param == "kernels" and not kernels.available():
        pytest.skip("numba is not installed: the codecs' compiled kernels cannot run")
    yield request.param
    kernels.available.cache_clear()


def _grad(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _reduce(comp: compressors.Compressor, g: torch.Tensor, world: int = 1,
            name: str = "p") -> tuple[torch.Tensor, LocalComm]:
    out = g.clone()
    comm = LocalComm(world)
    comp.reduce([out], [name], comm)
    return out, comm


def test_chunks_are_large_enough_for_the_sizes_tested() -> None:
    assert SIZES[0] >= topk_module.EXACT_BELOW
    for module in (topk_module, int8_module, sign_module):
        assert SIZES[1] > 2 * module.CHUNK


# --------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.1, 0.01, 0.001])
def test_topk_threshold_selection_sends_the_k_largest(n: int, ratio: float) -> None:
    comp = compressors.create("topk", ratio=ratio, error_feedback=False)
    g = _grad(n)
    out, comm = _reduce(comp, g, world=2)
    k = comp.k(n)
    sent = out.nonzero().view(-1)
    exact = set(g.abs().topk(k).indices.tolist())
    # never more than k, only top-k elements, their exact values; on Gaussian data the
    # threshold's margin makes the count exactly k
    assert set(sent.tolist()) <= exact
    assert sent.numel() == k
    assert torch.equal(out[sent], g[sent])
    assert sum(comm.sent.values()) == comp.wire_bytes((n,), 2)


def test_topk_large_ratio_pads_a_few_percent_under_k_with_the_largest() -> None:
    # where trimming ~k candidates would cost more than a larger sample, the threshold
    # is set above the k-th largest: the c largest are sent, c about 5 % under k
    n = 1_200_001
    comp = compressors.create("topk", ratio=0.1, error_feedback=False)
    assert comp._pads(n)
    g = _grad(n)
    out, comm = _reduce(comp, g, world=2)
    k = comp.k(n)
    sent = out != 0
    assert 0.9 * k <= int(sent.sum()) < k
    assert float(g[sent].abs().min()) > float(g[~sent].abs().max())
    assert torch.equal(out[sent], g[sent])
    assert sum(comm.sent.values()) == comp.wire_bytes((n,), 2)


@pytest.mark.parametrize("ratio", [0.1, 0.01])  # a threshold above the k-th, and below
def test_topk_a_sample_that_misjudges_still_sends_exactly_the_k_largest(ratio: float) -> None:
    # the sampled elements alone are tiny: nearly every element passes the threshold,
    # more than the candidate buffers hold, and the selection is trimmed to the k largest
    n = 1_200_001
    comp = compressors.create("topk", ratio=ratio, error_feedback=False)
    g = _grad(n).abs_().add_(1.0)
    g[comp._sample(n, g.device)] = 1e-3
    out, _ = _reduce(comp, g, world=2)
    sent = out.nonzero().view(-1)
    assert set(sent.tolist()) == set(g.topk(comp.k(n)).indices.tolist())
    assert torch.equal(out[sent], g[sent])


@pytest.mark.parametrize("n", SIZES)
def test_topk_residual_is_what_was_not_sent(n: int) -> None:
    comp = compressors.create("topk", ratio=0.01)
    owed = torch.zeros(n)
    for step in range(3):
        g = _grad(n, step)
        out, _ = _reduce(comp, g)
        residual = comp.memory.residuals["p"].view(-1)
        # one rank: the update is the sent part of gradient + residual, bit for bit
        assert torch.equal(residual + out, g + owed)
        # the k largest of gradient + residual, or (rarely) fewer of them
        sent = (out != 0).nonzero().view(-1)
        assert 0.9 * comp.k(n) <= sent.numel() <= comp.k(n)
        assert set(sent.tolist()) <= set((g + owed).abs().topk(comp.k(n)).indices.tolist())
        assert bool((residual[out != 0] == 0).all())
        owed = residual.clone()


def test_topk_mostly_zero_gradient_sends_its_nonzeros_and_pads() -> None:
    n = 200_000
    g = torch.zeros(n)
    g[7:400:3] = _grad(131)
    comp = compressors.create("topk", ratio=0.01)  # k = 2000 > 131 non-zeros
    out, comm = _reduce(comp, g, world=2)
    assert torch.equal(out, g)  # the repeated padding entries change nothing
    assert sum(comm.sent.values()) == comp.wire_bytes((n,), 2)
    out, _ = _reduce(compressors.create("topk", ratio=0.01), g, world=3)
    torch.testing.assert_close(out, g)
    assert int(comp.memory.residuals["p"].count_nonzero()) == 0
    out, _ = _reduce(comp, torch.zeros(n), world=2)  # nothing at all to send
    assert int(out.count_nonzero()) == 0


def test_topk_other_dtypes_and_layouts() -> None:
    g = _grad(300 * 400).view(300, 400)
    ref, _ = _reduce(compressors.create("topk", ratio=0.01), g)
    strided = g.t()  # not contiguous: encoded from a copy, the result copied back
    out, _ = _reduce(compressors.create("topk", ratio=0.01), strided)
    assert out.shape == strided.shape and torch.count_nonzero(out) == torch.count_nonzero(ref)
    g16 = g.to(torch.bfloat16)
    half, _ = _reduce(compressors.create("topk", ratio=0.01), g16)
    assert half.dtype == torch.bfloat16
    sent = half != 0
    assert int(sent.sum()) == int((ref != 0).sum())
    assert torch.equal(half[sent], g16[sent])
    kth = g16.float().abs().flatten().topk(int(sent.sum())).values[-1]
    assert bool((g16[sent].float().abs() >= kth).all())


# --------------------------------------------------------------------------- int8
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [1024, 100, 2**19])
def test_int8_rounds_each_element_to_a_neighbouring_level(n: int, block: int) -> None:
    comp = compressors.create("int8", block=block)
    g = _grad(n)
    out, comm = _reduce(comp, g)
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(g, (0, blocks * block - n)).view(blocks, block)
    step = (padded.abs().amax(1, keepdim=True) / int8_module.LEVELS).expand(-1, block).reshape(-1)[:n]
    assert bool(((out - g).abs() <= step * (1 + 1e-5)).all())
    assert sum(comm.sent.values()) == comp.wire_bytes((n,), 1)


@pytest.mark.slow
def test_int8_large_tensor_is_unbiased_and_reproducible() -> None:
    n = SIZES[1]
    g = _grad(n) * torch.rand(n, generator=torch.Generator().manual_seed(1))
    comp = compressors.create("int8")
    mean = torch.zeros(n)
    steps = 64
    for _ in range(steps):
        out, _ = _reduce(comp, g, world=2)
        mean += out / steps
    single = float((out - g).norm() / g.norm())
    averaged = float((mean - g).norm() / g.norm())
    assert single < 0.02
    assert averaged < single / 5  # noise averages out over steps: no bias left
    again = compressors.create("int8")
    again.load_state_dict(comp.state_dict())
    a, _ = _reduce(comp, g, name="p")
    b, _ = _reduce(again, g, name="p")
    assert torch.equal(a, b)


def test_int8_zero_blocks_and_bf16() -> None:
    g = _grad(SIZES[0])
    g[:5000] = 0
    out, _ = _reduce(compressors.create("int8"), g)
    assert int(out[:5000].count_nonzero()) == 0
    half, _ = _reduce(compressors.create("int8"), g.to(torch.bfloat16).view(200, 200))
    assert half.dtype == torch.bfloat16 and half.shape == (200, 200)


# --------------------------------------------------------------------------- sign
def _sign_reference(m: torch.Tensor) -> torch.Tensor:
    """One rank's decoded update: mean |M| with M's sign (its sign bit)."""
    scale = m.abs().double().mean().float()
    return torch.where(torch.signbit(m), -scale, scale)


@pytest.mark.parametrize("n", SIZES + [13])
def test_sign_matches_its_definition(n: int) -> None:
    comp = compressors.create("sign")
    owed = torch.zeros(n)
    for step in range(3):
        g = _grad(n, step)
        m = g + owed
        out, comm = _reduce(comp, g, world=3)
        expected = _sign_reference(m)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
        residual = comp.memory.residuals["p"].view(-1)
        torch.testing.assert_close(residual, m - expected, rtol=0, atol=1e-6)
        assert sum(comm.sent.values()) == comp.wire_bytes((n,), 3)
        owed = residual.clone()


def test_sign_negative_zero_counts_as_negative() -> None:
    g = torch.tensor([1.0, -0.0, 0.0, -2.0, 3.0, 0.5, -0.5, 1.0, 2.0])
    out, _ = _reduce(compressors.create("sign", error_feedback=False), g)
    scale = float(g.abs().mean())
    assert out.tolist() == pytest.approx([scale, -scale, scale, -scale, scale, scale, -scale, scale, scale])


def test_sign_packing_is_first_element_highest_bit() -> None:
    x = torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, -1, 1, -1, 1, 1, 1, 1, 1, 1, -3])
    out = torch.empty(3, dtype=torch.uint8)
    scratch = (torch.empty(17, dtype=torch.int32), torch.empty(17, dtype=torch.uint8))
    sign_module._pack_signs(x, scratch, out)
    assert out.tolist() == [0b10000001, 0b01000000, 0b10000000]
