"""``rowsparse``: exchange only the rows of a gradient that hold a non-zero value.

An embedding's gradient is row-sparse: a batch touches a few of its rows, and DDP (with
``nn.Embedding(sparse=False)``, as models are usually written) still allreduces the
whole dense table. Here each rank finds its non-zero rows (one reduction over the
table), the ranks all-gather their row counts, and then, for each tensor, either
all-gather the touched rows with their indices and add them up (``index_add_``), or,
where the union would carry more than a dense allreduce, allreduce it densely. Every
rank takes the same decision from the same counts. It is exact: for the rows it sends
it adds what every rank holds, and the rows it does not send are zero on every rank
(up to float summation order; for two ranks bitwise a plain allreduce's result).

Cost model: ring allreduce moves ``2 (W-1)/W`` of a tensor's bytes through each rank,
all_gather ``(W-1)`` payloads, so rows go sparse when ``W * sparse_bytes < 2 *
dense_bytes`` (:func:`sparse_pays`). Wire bytes depend on the data: ``wire_messages``
takes the fraction of rows touched (``density``), which the codec probe measures.

``values`` sends the rows in half precision (``fp16``/``bf16``): half the bytes, no
longer exact. Tensors are viewed as ``(shape[0], rest)``; a 1-D tensor's rows are its
elements. ``nn.Embedding(sparse=True)``: DDP puts each sparse gradient in a bucket of
its own and hands the hook a sparse tensor, which no compressor here reads; ``wrap``
refuses such models (``sparse=False`` with ``rowsparse`` sends the same rows).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from autotune.compressors.base import (
    REGISTRY,
    Collective,
    Compressor,
    CompressorSpec,
    Shape,
    flatten,
    numel,
    register,
    unflatten_into,
)
from autotune.compressors.comm import Comm

__all__ = ["RowSparse", "sparse_pays"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_COUNT_BYTES = 8  # one int64 row count per tensor in the first all_gather
_SCAN_NUMEL = 1 << 20  # elements per chunk of the scan for non-zero rows (4 MB of |x|)


def _rows_cols(shape: Shape) -> tuple[int, int]:
    rows = int(shape[0]) if len(shape) else 1
    return rows, numel(shape) // max(rows, 1)


def _sparse_words(rows: int, cols: int, value_bytes: int) -> tuple[int, int]:
    """int32 words of one rank's payload for ``rows`` rows of ``cols`` values: the
    values (padded to whole words) and the indices."""
    return math.ceil(rows * cols * value_bytes / 4), rows


def _nonzero_rows(mat: torch.Tensor) -> torch.Tensor:
    """Indices of the rows of ``mat`` holding a non-zero value (a NaN or Inf row too).

    A row's sum of absolute values is zero only where every value is (adding
    non-negative floats never rounds below the larger one), and NaN and Inf stay
    non-zero: the rows of the inf-norm, at 8-30x less time on a CPU (a 400000 x 16
    table: ~10 ms instead of 60-110). Chunks of rows keep the temporary ``|x|`` small."""
    step = max(1, _SCAN_NUMEL // max(mat.shape[1], 1))
    if mat.shape[0] <= step:
        sums = mat.abs().sum(dim=1)
    else:
        sums = torch.cat([chunk.abs().sum(dim=1) for chunk in mat.split(step)])
    return sums.ne(0).nonzero().squeeze(1)


def sparse_pays(max_rows: int, rows: int, cols: int, world_size: int, value_bytes: int = 4) -> bool:
    """Whether all-gathering ``max_rows`` rows per rank moves fewer bytes through each
    rank than a dense ring allreduce of the ``rows x cols`` fp32 tensor."""
    if world_size < 2:
        return False
    sparse = sum(_sparse_words(max_rows, cols, value_bytes)) * 4
    return world_size * sparse < 2 * rows * cols * 4


@register
class RowSparse(Compressor):
    """Send only non-zero rows (exact). Tuning: nothing to tune for the exact method;
    ``values="bf16"`` halves the bytes of the rows at bf16's precision."""

    name = "rowsparse"
    # counts, then the tensors that go dense, then the rows of those that go sparse
    collectives: tuple[Collective, ...] = ("allgather", "allreduce", "allgather")
    params = REGISTRY.params(name)  # values: the keys of _DTYPES
    guarded = False  # stateless; a NaN row is sent like any other, a joined rank sends none
    density_dependent = True  # bytes and work follow the non-zero rows

    @property
    def lossy(self) -> bool:  # type: ignore[override]
        return self.config["values"] != "fp32"

    @property
    def _value_dtype(self) -> torch.dtype:
        return _DTYPES[self.config["values"]]

    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        rows, cols = _rows_cols(shape)
        d = 1.0 if density is None else min(max(float(density), 0.0), 1.0)
        touched = min(rows, math.ceil(d * rows - 1e-9))
        size = self._value_dtype.itemsize
        if sparse_pays(touched, rows, cols, world_size, size):
            return {"allgather": _COUNT_BYTES + sum(_sparse_words(touched, cols, size)) * 4}
        return {"allgather": _COUNT_BYTES, "allreduce": rows * cols * 4}

    @staticmethod
    def codec_features(xp: Any, numel: Any, rows: Any, cols: Any, param: Any) -> list[Any]:
        # a pass over the tensor finding its non-zero rows (a reduction per row), then
        # work on the rows sent (gathered from every rank, added up): param is their share
        return [xp.ones_like(numel), numel, rows, numel * xp.minimum(param, 1.0)]

    def on_live_rows(self, shape: Shape, live: int, world_size: int) -> CompressorSpec | None:
        # exact: zero error on any rows (with half-precision rows it chooses sparse or
        # dense by the share of live rows, which the live rows alone would change)
        return None if self.lossy else self.spec

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        world = comm.world_size
        mats = [t.view(*_rows_cols(t.shape)) if t.is_contiguous() else t.reshape(*_rows_cols(t.shape))
                for t in tensors]
        # a row is sent when any of its values is non-zero (a NaN or Inf row too)
        local = [_nonzero_rows(m) for m in mats]
        counts = comm.all_gather(torch.tensor([len(i) for i in local], dtype=torch.int64))
        most = counts.max(dim=0).values.tolist()
        size = self._value_dtype.itemsize
        sparse = [sparse_pays(most[k], *m.shape, world, size) for k, m in enumerate(mats)]

        dense = [t for t, s in zip(tensors, sparse) if not s]
        if dense:
            with comm.phase("flatten"):
                flat = flatten(dense)
            comm.all_reduce(flat.div_(world))
            with comm.phase("copy_back"):
                unflatten_into(flat, dense)
        chosen = [k for k, s in enumerate(sparse) if s]
        if not chosen:
            return
        # one payload of int32 words per rank: each tensor's rows (padded with zero rows
        # at index 0, which add nothing), then their indices
        layout, offset = [], 0
        for k in chosen:
            value_words, index_words = _sparse_words(most[k], mats[k].shape[1], size)
            layout.append((k, offset, value_words, offset + value_words))
            offset += value_words + index_words
        payload = torch.zeros(offset, dtype=torch.int32, device=mats[0].device)
        for k, start, value_words, at in layout:
            n, cols = len(local[k]), mats[k].shape[1]
            rows = payload[start : start + value_words].view(self._value_dtype)[: n * cols].view(n, cols)
            if self._value_dtype == mats[k].dtype:
                torch.index_select(mats[k], 0, local[k], out=rows)
            else:
                rows.copy_(mats[k].index_select(0, local[k]))
            payload[at : at + n] = local[k].to(torch.int32)
        gathered = comm.all_gather(payload)  # (W, words)
        for k, start, value_words, at in layout:
            m, cols, rows_each = mats[k], mats[k].shape[1], most[k]
            values = gathered[:, start : start + value_words].contiguous().view(self._value_dtype)
            # divided before the sum, as DDP and the plain allreduce do
            values = values[:, : rows_each * cols].reshape(world * rows_each, cols).to(m.dtype)
            values.div_(world)
            index = gathered[:, at : at + rows_each].reshape(-1).long()
            # rows this rank did not touch are zero already; those it did are replaced
            m.index_fill_(0, local[k], 0)
            m.index_add_(0, index, values)
            if not tensors[k].is_contiguous():
                tensors[k].copy_(m.view_as(tensors[k]))
