"""Specification of autotune.workloads: the built-ins, their data, and workload specs."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

from autotune.errors import WorkloadError
from autotune.workloads import (
    BUILTINS,
    Workload,
    cnn,
    describe,
    digits,
    dlrm,
    mlp,
    resolve_workload,
    transformer,
)

# Built-ins with small batches: the contract does not depend on batch size, test time does.
SMALL: dict[str, Callable[[], Workload]] = {
    "mlp": lambda: mlp(batch_size=8),
    "cnn": lambda: cnn(batch_size=2),
    "transformer": lambda: transformer(batch_size=2),
    "dlrm": lambda: dlrm(batch_size=8),
    "digits": lambda: digits(batch_size=8),
}


@pytest.fixture(scope="module", params=sorted(SMALL))
def workload(request: pytest.FixtureRequest) -> Workload:
    return SMALL[request.param]()


def _params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _same(a: Any, b: Any) -> bool:
    """Tensors, or tuples of tensors (dlrm's (dense, sparse) inputs), equal throughout."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


# --- every built-in -------------------------------------------------------------------


def test_registry_names_every_builtin() -> None:
    assert BUILTINS == {"mlp": mlp, "cnn": cnn, "transformer": transformer, "dlrm": dlrm,
                        "digits": digits}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_is_callable_without_arguments(name: str) -> None:
    assert isinstance(BUILTINS[name](), Workload)


def test_one_training_step_has_finite_loss_and_gradients(workload: Workload) -> None:
    model = workload.model
    inputs, targets = workload.make_batch(0)
    loss = workload.loss_fn(model(inputs), targets)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    model.zero_grad()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
    model.zero_grad(set_to_none=True)


def test_make_batch_is_deterministic_per_step_and_rank(workload: Workload) -> None:
    x0, y0 = workload.make_batch(0)
    x0_again, y0_again = workload.make_batch(0)
    assert _same(x0, x0_again) and torch.equal(y0, y0_again)
    x1, _ = workload.make_batch(1)
    assert not _same(x0, x1)


def test_make_batch_differs_between_ranks(workload: Workload) -> None:
    make: Any = workload.make_batch  # built-ins accept explicit rank/world_size
    a, _ = make(3, rank=0, world_size=2)
    b, _ = make(3, rank=1, world_size=2)
    assert not _same(a, b)
    assert _same(a, make(3, rank=0, world_size=2)[0])


@pytest.mark.parametrize("name", sorted(SMALL))
def test_model_init_is_seeded_and_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = SMALL[name]().model
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(456)  # a different global state must not change the model
    assert _params_equal(first, SMALL[name]().model)


def test_evaluate_returns_an_accuracy_and_keeps_training_mode(workload: Workload) -> None:
    assert workload.evaluate is not None
    workload.model.train()
    acc = workload.evaluate(workload.model)
    assert 0.0 <= acc <= 1.0
    assert workload.model.training


def test_describe_counts_parameters_and_tensors() -> None:
    wl = mlp()
    info = describe(wl)
    assert info["name"] == "mlp"
    assert info["num_parameters"] == sum(p.numel() for p in wl.model.parameters())
    assert info["num_tensors"] == len(list(wl.model.parameters()))


# --- sizes that make each built-in the case it stands for -----------------------------


def test_mlp_is_small_with_several_linear_layers() -> None:
    info = describe(mlp())
    assert 100_000 <= info["num_parameters"] <= 1_000_000
    assert sum(isinstance(m, nn.Linear) for m in mlp().model.modules()) >= 4


def test_cnn_is_a_resnet_with_5_to_25_million_parameters() -> None:
    wl = cnn(batch_size=2)
    assert 5_000_000 <= describe(wl)["num_parameters"] <= 25_000_000
    assert any(isinstance(m, nn.BatchNorm2d) for m in wl.model.modules())
    x, y = wl.make_batch(0)
    assert x.shape == (2, 3, 32, 32) and int(y.max()) < 10


def test_transformer_has_many_small_tensors() -> None:
    assert describe(transformer())["num_tensors"] >= 40


def test_transformer_with_tied_weights_shares_one_tensor() -> None:
    untied, tied = transformer(), transformer(tie_weights=True)
    assert tied.model.head.weight is tied.model.tok.weight
    assert describe(tied)["num_tensors"] == describe(untied)["num_tensors"] - 1
    names = [n for n, _ in tied.model.named_parameters()]
    assert "tok.weight" in names and "head.weight" not in names


def test_transformer_sequences_are_learnable_next_tokens() -> None:
    x, y = transformer(batch_size=4, period=8).make_batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.equal(y[:, 7:], x[:, :-7])  # and, after one motif, repeat it


def test_invalid_builtin_arguments_raise_workload_error() -> None:
    with pytest.raises(WorkloadError, match="one block count"):
        cnn(widths=(32, 64), blocks=(1,))
    with pytest.raises(WorkloadError, match="divisible by heads"):
        transformer(dim=130, heads=4)
    with pytest.raises(WorkloadError, match="period"):
        transformer(seq_len=16, period=32)
    with pytest.raises(WorkloadError, match="test_fraction"):
        digits(test_fraction=1.5)
    with pytest.raises(WorkloadError, match="one pooling factor"):
        dlrm(tables=((100, 16), (100, 16)), pooling=(1,))
    with pytest.raises(WorkloadError, match="rows >= 1"):
        dlrm(tables=((0, 16),), pooling=(1,))
    with pytest.raises(WorkloadError, match="zipf"):
        dlrm(zipf=-1.0)


def test_workload_checks_its_fields() -> None:
    loss: Any = lambda a, b: a  # noqa: E731
    bad: Any = "not a model"
    with pytest.raises(WorkloadError, match="torch.nn.Module"):
        Workload(model=bad, make_batch=lambda s: s, loss_fn=loss)
    with pytest.raises(WorkloadError, match="make_batch must be callable"):
        Workload(model=nn.Linear(1, 1), make_batch=bad, loss_fn=loss)
    with pytest.raises(WorkloadError, match="evaluate must be callable"):
        Workload(model=nn.Linear(1, 1), make_batch=lambda s: s, loss_fn=loss, evaluate=bad)


# --- dlrm: embedding tables, skewed sparse lookups ------------------------------------


@pytest.fixture(scope="module")
def big_dlrm() -> Workload:
    return dlrm(batch_size=256)


def _tables(wl: Workload) -> list[nn.EmbeddingBag]:
    return [m for m in wl.model.modules() if isinstance(m, nn.EmbeddingBag)]


def test_dlrm_is_embedding_heavy_with_dense_table_gradients(big_dlrm: Workload) -> None:
    tables = _tables(big_dlrm)
    assert len(tables) >= 4
    rows = [t.num_embeddings for t in tables]
    dims = [t.embedding_dim for t in tables]
    assert 10**4 <= min(rows) and max(rows) <= 10**6 and max(rows) >= 10 * min(rows)
    assert 16 <= min(dims) and max(dims) <= 128 and len(set(dims)) >= 3
    # dense gradients: what DDP with a communication hook needs (and users write)
    assert not any(t.sparse for t in tables) and all(t.mode == "sum" for t in tables)
    table_bytes = 4 * sum(t.weight.numel() for t in tables)
    assert 30e6 <= table_bytes <= 60e6  # ~1.5 s per allreduce on a 300 Mbit/s link
    assert table_bytes >= 0.99 * 4 * describe(big_dlrm)["num_parameters"]


def test_dlrm_batches_are_dense_features_and_bags_of_valid_ids(big_dlrm: Workload) -> None:
    (dense, sparse), y = big_dlrm.make_batch(0)
    tables = _tables(big_dlrm)
    assert dense.shape == (256, 13) and dense.dtype == torch.float32
    assert sparse.dtype == torch.long and sparse.shape == (256, 4 + 2 + 2 + 1 + 1 + 1)
    assert set(y.unique().tolist()) == {0.0, 1.0} and y.dtype == torch.float32
    bounds = [0, 4, 6, 8, 9, 10, 11]
    for t, table in enumerate(tables):
        ids = sparse[:, bounds[t] : bounds[t + 1]]
        assert int(ids.min()) >= 0 and int(ids.max()) < table.num_embeddings


def test_dlrm_steps_touch_a_small_skewed_subset_of_rows(big_dlrm: Workload) -> None:
    make: Any = big_dlrm.make_batch
    tables = _tables(big_dlrm)
    bounds = [0, 4, 6, 8, 9, 10, 11]
    seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for rank in (0, 1):
        for step in (0, 1):
            (_, sparse), _ = make(step, rank=rank, world_size=2)
            rows: set[tuple[int, int]] = set()
            for t, table in enumerate(tables):
                ids = sparse[:, bounds[t] : bounds[t + 1]].flatten()
                touched = ids.unique()
                # a step touches under 1% of each large table, a few percent of the small
                assert len(touched) / table.num_embeddings < (0.01 if t < 3 else 0.05)
                # skewed: ids repeat far more than uniform draws would
                assert len(touched) < 0.8 * len(ids)
                rows |= {(t, int(i)) for i in touched}
            seen[rank, step] = rows
    # ranks and steps draw different rows, and share the popular ones
    assert seen[0, 0] != seen[1, 0] and seen[0, 0] != seen[0, 1]
    assert len(seen[0, 0] & seen[1, 0]) > 0.1 * len(seen[0, 0])


def test_dlrm_table_gradients_are_mostly_zero_rows(big_dlrm: Workload) -> None:
    model = big_dlrm.model
    x, y = big_dlrm.make_batch(0)
    model.zero_grad()
    big_dlrm.loss_fn(model(x), y).backward()
    for table in _tables(big_dlrm):
        assert table.weight.grad is not None and table.weight.grad.layout == torch.strided
        nonzero_rows = (table.weight.grad != 0).any(dim=1).float().mean()
        assert 0 < nonzero_rows < 0.05
    model.zero_grad(set_to_none=True)


def test_dlrm_labels_are_learnable(one_thread: None) -> None:
    # small tables, so that the test is quick; the defaults learn the same way
    wl = dlrm(tables=((5_000, 16), (2_000, 32), (1_000, 64)), pooling=(2, 1, 1),
              batch_size=128, seed=1)
    assert wl.evaluate is not None
    before = wl.evaluate(wl.model)
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1, momentum=0.9)
    for step in range(150):
        x, y = wl.make_batch(step)
        opt.zero_grad()
        wl.loss_fn(wl.model(x), y).backward()
        opt.step()
    after = wl.evaluate(wl.model)
    assert 0.35 < before < 0.65
    assert after > before + 0.05


# --- digits: the convergence workload -------------------------------------------------


def test_digits_shards_the_training_set_between_ranks() -> None:
    make: Any = digits(batch_size=32).make_batch
    seen = [set(), set()]
    for rank in (0, 1):
        for step in range(10):  # less than one epoch of a ~674-sample shard
            x, _ = make(step, rank=rank, world_size=2)
            seen[rank].update(tuple(row.tolist()) for row in x)
    assert len(seen[0]) == len(seen[1]) == 320  # no repeats within an epoch
    assert not seen[0] & seen[1]


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Two intra-op threads on a shared 2-core machine run this tiny model 3x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_digits_sgd_reaches_high_test_accuracy(one_thread: None) -> None:
    wl = digits(seed=0)
    assert wl.evaluate is not None
    before = wl.evaluate(wl.model)
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1, momentum=0.9)
    for step in range(300):
        x, y = wl.make_batch(step)
        opt.zero_grad()
        wl.loss_fn(wl.model(x), y).backward()
        opt.step()
    after = wl.evaluate(wl.model)
    assert before < 0.5
    assert after > 0.85


# --- resolve_workload -----------------------------------------------------------------


def test_resolve_builtin_name() -> None:
    assert resolve_workload("mlp").name == "mlp"


def test_resolve_module_form() -> None:
    assert resolve_workload("autotune.workloads:mlp").name == "mlp"


USER_FILE = """
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from autotune.workloads import Workload

@dataclass
class Config:  # dataclasses need their module in sys.modules
    width: int = 4

def make(width: int = Config().width) -> Workload:
    return Workload(
        model=nn.Linear(width, 2),
        make_batch=lambda step: (torch.ones(1, width), torch.zeros(1, dtype=torch.long)),
        loss_fn=torch.nn.functional.cross_entropy,
        name="user",
    )

def needs_args(width):
    return make(width)

def not_a_workload():
    return {"model": None}

def broken():
    raise RuntimeError("boom")

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "my_workload.py"
    path.write_text(textwrap.dedent(USER_FILE))
    monkeypatch.chdir(tmp_path)
    return path


def test_resolve_file_form_absolute_and_relative(user_file: Path) -> None:
    assert resolve_workload(f"{user_file}:make").name == "user"
    assert resolve_workload("my_workload.py:make").name == "user"
    assert resolve_workload("./my_workload.py:make").name == "user"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("resnet50", r"unknown workload 'resnet50'.*Built-ins: mlp, cnn, transformer, dlrm, digits"),
        ("", "unknown workload"),
        ("missing.py:make", "workload file not found: .*missing.py"),
        ("sub/dir/missing.py:make", "workload file not found"),
        ("no_such_package_xyz.mod:make", "cannot import workload module 'no_such_package_xyz.mod'"),
        ("autotune.workloads:nope", r"has no function 'nope'.*mlp"),
        ("my_workload.py:nope", r"has no function 'nope'; it defines: .*make"),
        ("my_workload:make", r"No module named 'my_workload' \(to load the file, write"),
        ("my_workload.py:NOT_CALLABLE", "is a int, not a function"),
        ("my_workload.py:needs_args", r"requires arguments \(width\)"),
        ("my_workload.py:not_a_workload", "returned dict; expected an autotune.workloads.Workload"),
        ("my_workload.py:broken", "raised RuntimeError: boom"),
        ("my_workload.py:", "incomplete"),
        (":make", "incomplete"),
    ],
)
def test_resolve_errors_say_what_went_wrong(user_file: Path, spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        resolve_workload(spec)


def test_resolve_reports_import_errors_in_a_file(tmp_path: Path) -> None:
    bad_import = tmp_path / "bad_import.py"
    bad_import.write_text("import no_such_dependency_xyz\n")
    message = r"bad_import.py failed: ModuleNotFoundError.*no_such_dependency_xyz"
    with pytest.raises(WorkloadError, match=message):
        resolve_workload(f"{bad_import}:make")
    bad_syntax = tmp_path / "bad_syntax.py"
    bad_syntax.write_text("def make(:\n")
    with pytest.raises(WorkloadError, match="bad_syntax.py failed: SyntaxError"):
        resolve_workload(f"{bad_syntax}:make")


def test_resolve_reports_import_errors_in_a_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "wl_pkg_broken_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError, match="no_such_dependency_xyz"):
        resolve_workload("wl_pkg_broken_xyz:make")


# --- on real ranks --------------------------------------------------------------------


def rank_view(name: str) -> dict[str, Any]:
    """Run on each rank by the launcher: a fingerprint of the model and of batch 0."""
    wl = SMALL[name]()
    x, _ = wl.make_batch(0)
    return {
        "params": float(sum(p.double().sum() for p in wl.model.parameters())),
        "batch": float(x.double().sum()),
    }


@pytest.mark.multirank
def test_ranks_build_the_same_model_and_draw_different_batches(
    run_ranks: Callable[..., list[Any]],
) -> None:
    r0, r1 = run_ranks("test_workloads:rank_view", name="mlp", timeout=120)
    assert r0["params"] == r1["params"]
    assert r0["batch"] != r1["batch"]
