"""``rowsparse`` is exact: on a real 2-process gloo group it gives what a plain
allreduce gives, whatever rows each rank touched; it goes dense when that is cheaper;
its wire bytes are what ``wire_messages`` says for the measured density; and through
``wrap`` an embedding model trains exactly as under DDP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import autotune
from autotune import compressors
from autotune.compressors import GroupComm, LocalComm
from autotune.compressors.rowsparse import sparse_pays
from autotune.errors import CompressorError

ROWS, COLS = 5000, 16

# rows each rank touches, by case: (rank 0's, rank 1's)
CASES: dict[str, tuple[list[int], list[int]]] = {
    "overlapping": ([0, 5, 17, 4999], [5, 17, 300]),
    "only_one_rank": ([7, 8, 9], []),
    "none": ([], []),
    "uneven": (list(range(0, 200, 2)), [1]),
    "all": (list(range(ROWS)), list(range(ROWS))),
}


def _grad(rows: list[int], rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    g = torch.zeros(ROWS, COLS)
    if rows:
        g[rows] = torch.randn(len(rows), COLS, generator=gen)
    return g


def rank_exact(values: str = "fp32") -> dict[str, Any]:
    rank = dist.get_rank()
    comp = compressors.create("rowsparse", values=values)
    comm = GroupComm()
    out: dict[str, Any] = {}
    for case, touched in CASES.items():
        mine = _grad(touched[rank], rank)
        bias = torch.randn(COLS, generator=torch.Generator().manual_seed(rank))  # a dense 1-D tensor
        ref = [mine.clone(), bias.clone()]
        for t in ref:
            dist.all_reduce(t.div_(2))
        ours = [mine.clone(), bias.clone()]
        before = dict(comm.sent)
        comp.reduce(ours, ["emb", "bias"], comm)
        sent = {k: v - before.get(k, 0) for k, v in comm.sent.items() if v - before.get(k, 0)}
        density = max(len(t) for t in touched) / ROWS
        declared: dict[str, int] = {}
        for shape, d in (((ROWS, COLS), density), ((COLS,), 1.0)):
            for kind, nbytes in comp.wire_messages(shape, 2, density=d).items():
                declared[kind] = declared.get(kind, 0) + nbytes
        out[case] = {
            "equal": [torch.equal(a, b) for a, b in zip(ours, ref)],
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(ours, ref)),
            "max_ref": float(ref[0].abs().max()),
            "sent": sent, "declared": declared,
        }
    return out


@pytest.mark.multirank
def test_rowsparse_equals_plain_allreduce_in_every_case(run_ranks) -> None:
    for result in run_ranks("test_rowsparse:rank_exact"):
        assert set(result) == set(CASES)
        for case, r in result.items():
            # two ranks: a/2 + b/2 in either order is the same float
            assert all(r["equal"]), f"{case}: max diff {r['max_diff']}"
            assert r["sent"] == r["declared"], case
        assert "allreduce" not in result["overlapping"]["sent"] or result["overlapping"]["sent"]["allreduce"] == COLS * 4
        # every row touched: the dense allreduce is cheaper, and it is what was sent
        assert result["all"]["sent"]["allreduce"] == (ROWS + 1) * COLS * 4


@pytest.mark.multirank
def test_rowsparse_bf16_rows_are_within_bf16_precision(run_ranks) -> None:
    for result in run_ranks("test_rowsparse:rank_exact", values="bf16"):
        for case, r in result.items():
            assert r["max_diff"] <= 2**-8 * max(r["max_ref"], 1e-30), case
            assert r["sent"] == r["declared"], case


def test_sparse_pays_compares_a_ring_allreduce_with_an_all_gather() -> None:
    assert sparse_pays(10, ROWS, COLS, 2)
    assert not sparse_pays(ROWS, ROWS, COLS, 2)
    assert not sparse_pays(1, ROWS, COLS, 1)  # one rank: nothing to exchange either way
    # at W ranks the all_gather carries W payloads: the break-even density falls as 2/W
    assert sparse_pays(ROWS // 3, ROWS, COLS, 8) is False
    assert sparse_pays(ROWS // 3, ROWS, COLS, 2) is True


def test_wire_messages_follow_the_density() -> None:
    comp = compressors.create("rowsparse")
    sparse = comp.wire_messages((ROWS, COLS), 2, density=0.01)
    assert sparse == {"allgather": 8 + 50 * (COLS + 1) * 4}
    assert comp.wire_messages((ROWS, COLS), 2) == {"allgather": 8, "allreduce": ROWS * COLS * 4}
    half = compressors.create("rowsparse", values="fp16").wire_messages((ROWS, COLS), 2, density=0.01)
    assert half == {"allgather": 8 + 50 * (COLS // 2 + 1) * 4}


def test_local_comm_simulates_identical_ranks() -> None:
    comp = compressors.create("rowsparse")
    g = _grad([1, 2, 3], 0)
    out = g.clone()
    comm = LocalComm(4)
    comp.reduce([out], ["emb"], comm)
    assert torch.equal(out, g)  # four identical ranks average to the same gradient
    assert comm.sent["allgather"] == comp.wire_bytes((ROWS, COLS), 4, density=3 / ROWS)


def test_a_row_is_sent_when_any_value_is_non_zero_however_small_or_not_finite() -> None:
    # more rows than one chunk of the scan, so the rows found span chunks
    rows = 200_000
    g = torch.zeros(rows, COLS)
    g[3, 5] = 2.0**-140  # a subnormal (whose half is exact)
    g[10, 0] = -0.0  # zero: not sent
    g[70_000, 15] = float("nan")
    g[150_000, 2] = float("-inf")
    g[199_999] = 1.0
    out, comm = g.clone(), LocalComm(2)
    comp = compressors.create("rowsparse")
    comp.reduce([out], ["emb"], comm)
    assert comm.sent["allgather"] == comp.wire_bytes((rows, COLS), 2, density=4 / rows)
    finite = torch.isfinite(g).all(dim=1)
    assert torch.equal(out[finite], g[finite])
    assert out[70_000, 15].isnan() and out[150_000, 2] == float("-inf")


def test_values_must_be_a_known_precision() -> None:
    with pytest.raises(CompressorError, match="'values' parameter of rowsparse must be one of"):
        compressors.create("rowsparse", values="int4")


class _EmbeddingNet(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, COLS, sparse=sparse)
        self.bag = nn.EmbeddingBag(2000, 8, mode="sum")
        self.fc = nn.Linear(COLS + 8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(ids).mean(1), self.bag(ids % 2000)], dim=1))


def _ids(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    ids = (torch.rand(32, 4, generator=gen) ** 4 * ROWS).long()  # skewed towards low rows
    return ids, torch.randint(0, 2, (32,), generator=gen)


def rank_wrap_vs_ddp(steps: int = 6) -> dict[str, Any]:
    torch.manual_seed(0)
    ours_model, ref_model = _EmbeddingNet(), _EmbeddingNet()
    ref_model.load_state_dict(ours_model.state_dict())
    ours = autotune.wrap(ours_model, autotune.Policy.from_dict({
        "version": 1, "bucket_cap_mb": 25, "default": {"compressor": "none"},
        "layers": {"emb.weight": {"compressor": "rowsparse"}, "bag.weight": {"compressor": "rowsparse"}}}))
    ref = DDP(ref_model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours_model, ref_model)]
    equal = []
    for step in range(steps):
        ids, y = _ids(step)
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad()
            F.cross_entropy(model(ids), y).backward()
        equal.append(all(torch.equal(a.grad, b.grad)
                         for a, b in zip(ours_model.parameters(), ref_model.parameters())))
        for opt in opts:
            opt.step()
    sent = sum(r.nbytes for r in ours.comm_state.last_step_records())
    return {"equal": equal, "sent": sent, "dense": sum(p.numel() * 4 for p in ours_model.parameters())}


@pytest.mark.multirank
def test_wrap_with_rowsparse_trains_an_embedding_model_exactly_as_ddp(run_ranks) -> None:
    for result in run_ranks("test_rowsparse:rank_wrap_vs_ddp"):
        assert all(result["equal"]), result["equal"]
        assert result["sent"] < result["dense"] / 10, result


def rank_sparse_embedding() -> str:
    try:
        autotune.wrap(_EmbeddingNet(sparse=True), None)
    except autotune.AutotuneError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.multirank
def test_wrap_refuses_sparse_embeddings_with_a_clear_message(run_ranks) -> None:
    message = run_ranks("test_rowsparse:rank_sparse_embedding")[0]
    assert "sparse=True" in message and "emb.weight" in message and "rowsparse" in message
