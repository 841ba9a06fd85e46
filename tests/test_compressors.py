"""Every compressor goes through the same contract: adding one to COMPRESSORS is enough."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from autotune import compressors
from autotune.compressors import CompressorSpec, LocalComm
from autotune.compressors.base import AllreduceCompressor, ErrorFeedbackCompressor
from autotune.errors import CompressorError

# (name, params, relative error allowed on one round trip of a random gradient, in a
# world of one rank, without error feedback having caught up yet)
COMPRESSORS = [
    ("none", {}, 0.0),
    ("fp16", {}, 1e-3),
    ("bf16", {}, 1e-2),
    ("powersgd", {"rank": 4}, 1.0),
    ("topk", {"ratio": 0.1}, 1.0),
    ("int8", {}, 0.05),
    ("sign", {}, 1.0),
    ("rowsparse", {}, 0.0),  # dense random gradients: it allreduces them, exactly
]
IDS = [c[0] for c in COMPRESSORS]
SHAPES = [(64, 32, 3, 3), (64,), (10, 300), (1000,), (3, 3), (257, 129)]


def _grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _round_trip(comp: compressors.Compressor, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], LocalComm]:
    out = [g.clone() for g in grads]
    comm = LocalComm()
    comp.reduce(out, [f"p{i}" for i in range(len(out))], comm)
    return out, comm


def _rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = torch.cat([(x - y).reshape(-1) for x, y in zip(a, b)]).norm()
    return float(num / torch.cat([y.reshape(-1) for y in b]).norm())


def test_registry_lists_every_method() -> None:
    assert set(IDS) <= set(compressors.names())


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_round_trip_keeps_shape_dtype_and_bounds_error(name: str, params: dict, tol: float) -> None:
    comp = compressors.create(name, **params)
    grads = _grads()
    out, _ = _round_trip(comp, grads)
    for o, g in zip(out, grads):
        assert o.shape == g.shape and o.dtype == g.dtype
        assert torch.isfinite(o).all()
    err = _rel_err(out, grads)
    assert err <= tol + 1e-12, f"{name}: relative error {err:.4f} > {tol}"
    if not comp.lossy:
        assert err == 0.0


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_wire_bytes_match_what_reduce_hands_to_collectives(name: str, params: dict, tol: float) -> None:
    comp = compressors.create(name, **params)
    _, comm = _round_trip(comp, _grads())
    expected = sum(comp.wire_bytes(s, world_size=1) for s in SHAPES)
    assert sum(comm.sent.values()) == expected
    kinds = set(comp.collectives)
    assert set(comm.sent) <= kinds
    for shape in SHAPES:
        assert set(comp.wire_messages(shape, 8)) <= kinds


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_group_messages_are_what_reduce_hands_to_each_collective(name: str, params: dict, tol: float) -> None:
    """The messages the cost model times: per collective kind, what one reduction of the
    group sends, in the order of the declared stages."""
    comp = compressors.create(name, **params)
    _, comm = _round_trip(comp, _grads())
    messages = comp.group_messages(SHAPES, 1)
    totals: dict[str, int] = {}
    for kind, nbytes in messages:
        totals[kind] = totals.get(kind, 0) + nbytes
    assert totals == {k: v for k, v in comm.sent.items() if v}
    order = list(dict.fromkeys(comp.collectives))
    kinds = list(dict.fromkeys(kind for kind, _ in messages))
    assert kinds == [k for k in order if k in kinds]
    assert sum(b for _, b in comp.group_messages(SHAPES, 8)) == sum(comp.wire_bytes(s, 8) for s in SHAPES)


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_codec_features_are_work_columns_of_the_size_knob(name: str, params: dict, tol: float) -> None:
    cls = compressors.REGISTRY.get(name)
    comp = cls(**params)
    assert cls.size_param is None or cls.size_param in cls.params
    if cls.size_param is not None and not cls.density_dependent:
        assert cls.codec_param(comp.config) == float(comp.config[cls.size_param])
    if cls.density_dependent:
        assert cls.codec_param(comp.config, 0.25) == 0.25 and cls.codec_param(comp.config) == 1.0
    numel = np.array([10.0, 1e4, 1e6])
    rows, cols = np.array([10.0, 100.0, 1000.0]), np.array([1.0, 100.0, 1000.0])
    param = np.full(3, cls.codec_param(comp.config, 0.5))
    columns = cls.codec_features(np, numel, rows, cols, param)
    assert all(np.shape(c) == (3,) and np.all(np.isfinite(c)) and np.all(c >= 0) for c in columns)
    assert np.array_equal(columns[0], np.ones(3))  # a fixed cost per tensor


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_traits_say_what_the_method_does(name: str, params: dict, tol: float) -> None:
    cls = compressors.REGISTRY.get(name)
    comp = cls(**params)
    if cls.needs_matrix:  # tensors that are not matrices travel whole
        assert comp.wire_bytes((1000,), 4) == 4000
    if cls.half_precision:  # two bytes an element, summed by allreduce
        assert comp.wire_messages((1000,), 4) == {"allreduce": 2000}
    if cls.elementwise:
        assert isinstance(comp, AllreduceCompressor)
        assert comp.on_live_rows((64, 8), 4, 2) == comp.spec
    assert isinstance(comp, ErrorFeedbackCompressor) == ("error_feedback" in cls.params)


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_on_live_rows_does_there_what_the_whole_tensor_gets(name: str, params: dict, tol: float) -> None:
    """Where a compressor names a configuration for a tensor's live rows, running it on
    those rows alone gives them what they get inside the whole tensor (whose other rows
    are zero), step after step (error feedback and warm starts included), up to
    rounding."""
    comp = compressors.create(name, **params)
    live = torch.tensor([0, 3, 9, 17, 18, 33, 40, 41, 63, 64, 90, 100, 101, 110, 126, 127])
    spec = comp.on_live_rows((128, 48), len(live), 2)
    if spec is None:
        pytest.skip(f"{name} has no live-rows equivalent")
    alone = compressors.create(spec.name, **spec.kwargs)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        rows = torch.randn(len(live), 48, generator=gen)
        whole = torch.zeros(128, 48)
        whole[live] = rows
        comp.reduce([whole], ["p"], LocalComm(2))
        part = rows.clone()
        alone.reduce([part], ["p"], LocalComm(2))
        assert torch.allclose(whole[live], part, rtol=1e-4, atol=1e-5)  # up to rounding
        dead = whole[torch.ones(128, dtype=torch.bool).index_fill_(0, live, False)]
        assert dead.abs().max() <= 1e-5  # PowerSGD's QR leaves rounding noise there


@pytest.mark.parametrize("name", [n for n in compressors.names()
                                  if issubclass(compressors.REGISTRY.get(n), ErrorFeedbackCompressor)])
def test_error_feedback_methods_owe_release_and_reset_their_residuals(name: str) -> None:
    comp = compressors.create(name)
    _round_trip(comp, _grads())
    assert "memory" in comp.state_dict() and set(comp.state_dict()) == set(comp.state_keys)
    owed = comp.release("p0")
    assert owed is not None and owed.numel() == _grads()[0].numel()
    held = len(comp.memory.residuals)
    assert held >= 1 and comp.reset_error_feedback() == held and comp.memory.residuals == {}
    with pytest.raises(CompressorError, match=f"unexpected keys in {name} state"):
        comp.load_state_dict({"memory": {}, "other": {}})
    off = compressors.create(name, error_feedback=False)
    _round_trip(off, _grads())
    assert off.memory.residuals == {} and off.reset_error_feedback() == 0


@pytest.mark.parametrize("name,params,tol", COMPRESSORS, ids=IDS)
def test_state_save_and_load_continues_identically(name: str, params: dict, tol: float) -> None:
    comp = compressors.create(name, **params)
    for step in range(3):
        _round_trip(comp, _grads(step))
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    restored = compressors.create(name, **params)
    restored.load_state_dict(torch.load(buf, weights_only=True))  # no pickle of objects
    for step in range(3, 6):
        a, _ = _round_trip(comp, _grads(step))
        b, _ = _round_trip(restored, _grads(step))
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{name}: step {step} differs after restore"


def _average_sent_error(comp: compressors.Compressor, steps: int) -> float:
    grads = _grads(7)
    sent = [torch.zeros_like(g) for g in grads]
    for _ in range(steps):
        out, _ = _round_trip(comp, grads)
        for s, o in zip(sent, out):
            s += o
    return _rel_err([s / steps for s in sent], grads)


@pytest.mark.slow
@pytest.mark.parametrize("name,params", [("powersgd", {"rank": 4}), ("topk", {"ratio": 0.1}), ("sign", {})])
def test_error_feedback_recovers_the_signal_over_steps(name: str, params: dict) -> None:
    """With error feedback, what is sent over many steps adds up to the gradients sent
    in: only the residual still in memory is missing. Without it, the bias stays."""
    with_ef = _average_sent_error(compressors.create(name, **params), 100)
    without = _average_sent_error(compressors.create(name, error_feedback=False, **params), 100)
    assert with_ef < 0.2, f"{name}: error-compensated average off by {with_ef:.3f}"
    assert without > 2 * with_ef


def test_int8_is_unbiased() -> None:
    comp = compressors.create("int8", block=64)
    g = [torch.randn(4096, generator=torch.Generator().manual_seed(3))]
    mean = torch.zeros(4096)
    n = 200
    for _ in range(n):
        out, _ = _round_trip(comp, g)
        mean += out[0] / n
    assert _rel_err([mean], g) < 0.02


def test_powersgd_falls_back_to_allreduce_for_vectors_and_small_matrices() -> None:
    comp = compressors.create("powersgd", rank=4)
    assert comp.wire_messages((1000,), 2) == {"allreduce": 4000}
    assert comp.wire_messages((3, 3), 2) == {"allreduce": 36}  # too small to gain
    assert comp.wire_messages((512, 512), 2) == {"allreduce": (512 + 512) * 4 * 4}
    assert comp.wire_messages((64, 32, 3, 3), 2) == {"allreduce": (64 + 288) * 4 * 4}


def test_topk_and_sign_wire_sizes() -> None:
    assert compressors.create("topk", ratio=0.01).wire_bytes((100, 100), 4) == 8 * 100
    assert compressors.create("topk", ratio=0.1).wire_bytes((30,), 4) == 8 * 3
    assert compressors.create("sign").wire_bytes((1000,), 4) == 125 + 4
    assert compressors.create("int8", block=100).wire_bytes((1000,), 4) == 1000 + 40


@pytest.mark.parametrize(
    "name,params,needle",
    [
        ("nope", {}, "unknown compressor 'nope'; registered: none, fp16"),
        ("topk", {"ratio": 1.5}, "The 'ratio' parameter of topk must be a float in the range (0, 1]. Got 1.5"),
        ("topk", {"ratio": 0.0}, "Got 0.0 instead"),
        ("powersgd", {"rank": 0}, "The 'rank' parameter of powersgd must be an int"),
        ("powersgd", {"rank": 2.5}, "Got 2.5 instead"),
        ("powersgd", {"rank": True}, "Got True instead"),
        ("topk", {"k": 3}, "compressor 'topk' has no parameter 'k'; its parameters are: ratio"),
        ("none", {"rank": 1}, "its parameters are: none"),
        ("int8", {"block": math.nan}, "Got nan instead"),
    ],
)
def test_bad_names_and_parameters_are_named(name: str, params: dict, needle: str) -> None:
    with pytest.raises(CompressorError) as info:
        compressors.create(name, **params)
    assert needle in str(info.value)


def test_spec_canonical_fills_defaults_and_round_trips() -> None:
    spec = CompressorSpec.from_dict({"compressor": "powersgd", "rank": 4})
    assert spec.to_dict() == {"compressor": "powersgd", "rank": 4}
    assert spec.canonical() == CompressorSpec.from_dict(
        {"compressor": "powersgd", "rank": 4, "error_feedback": True, "warm_start": True,
         "min_compression_rate": 2.0, "seed": 0}
    ).canonical()
    assert spec.canonical() != CompressorSpec.of("powersgd").canonical()


def test_registry_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        compressors.register(type(compressors.create("none")))


def test_a_declared_name_is_taken_only_by_its_own_module() -> None:
    # the built-in names are declared before their modules load (validating a policy
    # needs no torch); a class from elsewhere cannot take one of them meanwhile
    impostor = type("Impostor", (compressors.Compressor,), {"name": "rowsparse", "__module__": "elsewhere"})
    with pytest.raises(ValueError, match="already registered"):
        compressors.register(impostor)


@pytest.mark.parametrize("name", compressors.names())
def test_a_class_uses_its_declared_parameter_table(name: str) -> None:
    assert dict(compressors.REGISTRY.get(name).params) == dict(compressors.REGISTRY.params(name))


def _psgd_state(comp: compressors.Compressor) -> dict[str, torch.Tensor]:
    state = comp.state_dict()
    return {**{f"m/{k}": v for k, v in state["memory"].items()},
            **{f"q/{k}": v for k, v in state["q"].items()}}


class _Gate:
    """A stand-in for the runtime's guard on one bucket (compressors.comm.Gate)."""

    def __init__(self, rides: bool, fallback: bool = False, joined: bool = False) -> None:
        self.rides, self.fallback, self.joined = rides, fallback, joined
        self.asked: list[torch.Tensor | None] = []

    def flags(self, bad: torch.Tensor) -> torch.Tensor:
        return torch.stack([bad.float(), torch.tensor(float(self.joined))])

    def decide(self, summed: torch.Tensor | None) -> bool:
        self.asked.append(summed)
        # fallback: another rank's flags said so (LocalComm's ranks are all alike)
        if summed is None:  # the agreement, waited for: what the ranks' flags said
            return self.fallback or self.joined
        return self.fallback or bool(summed.any())


@pytest.mark.parametrize("rides", [True, False])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_powersgd_encodes_before_the_guard_and_leaves_no_trace_where_it_falls_back(
        error_feedback: bool, rides: bool) -> None:
    """The runtime's guard settled late (Comm.admit), waited for or riding on P's
    allreduce: the same results, bit for bit, as without it, and a bucket the ranks
    agree not to compress leaves the residuals and Qs as they were (the spare is not
    state) and its gradients unwritten."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"w": (64, 48), "v": (40, 40), "b": (48,)}
    steps = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(4)]
    first = compressors.create("powersgd", rank=2, error_feedback=error_feedback)
    late = compressors.create("powersgd", rank=2, error_feedback=error_feedback)
    assert late.encodes_before_guard
    for grads in steps:
        a = [g.clone() for g in grads.values()]
        first.reduce(a, list(grads), LocalComm(2))
        comm = LocalComm(2)
        comm.gate = gate = _Gate(rides)
        b = [g.clone() for g in grads.values()]
        late.reduce(b, list(grads), comm)
        assert comm.gate is None and len(gate.asked) == 1  # settled once
        if rides:  # the flags came back summed, with nothing to report
            assert gate.asked[0] is not None and gate.asked[0].tolist() == [0.0, 0.0]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert _psgd_state(first).keys() == _psgd_state(late).keys()
        assert all(torch.equal(v, _psgd_state(late)[n]) for n, v in _psgd_state(first).items())

    before = {n: v.clone() for n, v in _psgd_state(late).items()}
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    cases = [dict(fallback=True), dict(joined=True)]
    if rides:  # a non-finite value anywhere in the bucket is found in what P carries
        for name in shapes:
            bad = {n: g.clone() for n, g in grads.items()}
            bad[name].view(-1)[5] = float("nan") if name != "v" else float("inf")
            cases.append(dict(grads=bad))
    for case in cases:
        given = case.pop("grads", grads)
        tensors = [g.clone() for g in given.values()]
        comm = LocalComm(2)
        comm.gate = _Gate(rides, **case)
        with pytest.raises(compressors.comm.GuardFallback):
            late.reduce(tensors, list(given), comm)
        assert all(torch.allclose(t, g, rtol=0, atol=0, equal_nan=True)  # unwritten
                   for t, g in zip(tensors, given.values()))
        after = _psgd_state(late)
        assert after.keys() == before.keys() and all(torch.equal(after[n], v) for n, v in before.items())
    # and the next step goes on from the state as it was
    a, b = [g.clone() for g in grads.values()], [g.clone() for g in grads.values()]
    first.reduce(a, list(grads), LocalComm(2))
    late.reduce(b, list(grads), LocalComm(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
