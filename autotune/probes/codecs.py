"""Codec probe: encode+decode time, bytes on the wire and compression error per compressor.

For every compressor configuration of a grid and every distinct gradient shape, the
probe times ``compressor.reduce`` on a :class:`~autotune.compressors.comm.LocalComm` of
the cluster's world size (W identical simulated ranks, so decode handles W payloads as
on the real cluster, without a network), and takes the bytes on the wire from
``wire_messages`` (no run needed). Then, on the real gradients the compute probe
captured, it measures each parameter's relative error ``||g - C(g)|| / ||g||`` step
after step with the compressor's state (error feedback, PowerSGD's warm start) carried
over, as in training.

Two error figures per parameter, because error feedback moves error between steps:

- ``rel_error_steps``: the error of each step's update. Error feedback does *not*
  lower it, it raises it: the update carries last step's residual too (top-k 10%
  with the same gradient repeated: 0.73 every step without, 0.73, 0.94, 1.07, ...
  with). ``rel_error`` is its mean over the steps after the first.
- ``cum_error_steps``: the error of the accumulated updates,
  ``||sum_t g_t - sum_t C_t|| / ||sum_t g_t||``, which is what the model integrates and
  what error feedback keeps small (same example: 0.73, 0.66, 0.60, ... falling with
  every step). ``cum_error`` is its last value.

The errors are those of one rank's compression; with W ranks holding different
gradients the averaged update's error is lower for unbiased methods (int8), whose
noise averages out.

Large tensors are measured on their rows, so that the probe covers every configuration
and parameter within its budget (a table of 10^6 rows costs as much as a whole CNN).
Above ``sample_above`` elements a parameter gets a :class:`RowPlan`, the same rows in
every captured step:

- its **live rows**, non-zero in some captured step. An embedding table's gradient is
  mostly zero rows, and for compressors that leave zero rows alone (elementwise casts,
  PowerSGD, top-k with the same ``k``; see :func:`_on_live_rows`) the live rows alone
  give the tensor's error exactly (``measured: "live_rows"``);
- a **row sample**, for the other compressors and for timing: rows taken at one rate
  among the live and among the zero rows, so that it has the tensor's share of live
  rows (what sign's scale and int8's blocks see), the live ones every ``1/f``-th by
  gradient energy so that it spans hot and cold rows; it keeps the rows' order. It
  stands for the tensor under a configuration only where the compressor's bytes per
  element on it are within :data:`REPRESENTATIVE` of the tensor's (PowerSGD on too few
  rows would approximate another matrix); elsewhere the cell is measured in full.
  Its errors are the sample's (``measured: "sample"``, with ``energy_ratio``, the
  sample's share of the gradient energy over its share of rows: below 1 when it
  misses the heaviest rows).

Encode+decode time on a row sample is scaled by ``numel / sample numel``: every method's
work is linear in the elements (casts, int8, sign, top-k's selection and scatter), or in
``rows * cols * rank`` for PowerSGD, where a row sample keeps ``cols`` and the rank.
Each cell says how it was measured (``measured``, and ``sample`` with the rows used).

**Gradient structure.** Per parameter, the fraction of its rows (first dimension; a 1-D
tensor's elements) that hold a non-zero value, on every captured step of every rank:
``structure[name] = {"row_density_mean", "row_density_max", "row_density_std", "steps",
"ranks"}``, over the ``steps x ranks`` values (``std``: their population spread).
``row_density_max`` is what the busiest rank sends in the busiest step, which sizes the
messages of ``rowsparse`` (it sends every rank's non-zero rows, padded to the busiest
rank's count).

Data-dependent compressors (``Compressor.density_dependent``: rowsparse) are timed on
the captured gradients, with their real rows, and sized at their density: each of their
time cells records the ``row_density`` of the tensor it timed (its wire bytes are that
tensor's), and, for a sparse one, ``denser``: the time of the same tensor with rows
filled up to :data:`DENSER_AT` of them, so that the cost model's codec time can tell
the work per row sent from the pass over the whole tensor.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from autotune import compressors
from autotune.compressors import CompressorSpec, LocalComm
from autotune.compressors.comm import all_gather_flat
from autotune.errors import ProfileError
from autotune.presets import DEFAULT_PRESETS
from autotune.probes.profile import ROW_SPARSE_BELOW  # there so that `autotune show` needs no torch

__all__ = [
    "BASELINE_SPECS",
    "DEFAULT_GRID",
    "DENSER_AT",
    "MIN_LIVE_ROWS",
    "REPRESENTATIVE",
    "ROW_SPARSE_BELOW",
    "SAMPLE_ABOVE",
    "SAMPLE_NUMEL",
    "RowPlan",
    "probe_codecs",
    "row_density",
    "row_plan",
]

logger = logging.getLogger(__name__)

# What the tuner chooses from by default: exact and half-precision allreduce, PowerSGD
# ranks by factors of 2, top-k ratios by factors of 10, 8-bit and 1-bit quantisation, and
# the exact exchange of non-zero rows (embedding tables).
# One configuration of every method comes first: those are measured whatever the
# budget, so the cost model can price every method; the other sizes follow.
DEFAULT_GRID: tuple[Mapping[str, Any], ...] = (
    {"compressor": "none"},
    {"compressor": "fp16"},
    {"compressor": "bf16"},
    {"compressor": "powersgd", "rank": 4},
    {"compressor": "topk", "ratio": 0.01},
    {"compressor": "int8"},
    {"compressor": "sign"},
    {"compressor": "rowsparse"},
    {"compressor": "powersgd", "rank": 1},
    {"compressor": "powersgd", "rank": 2},
    {"compressor": "powersgd", "rank": 8},
    {"compressor": "topk", "ratio": 0.001},
    {"compressor": "topk", "ratio": 0.1},
)
# The compressors of the default presets besides plain DDP (fp16 and PyTorch's PowerSGD
# at rank 1 and 4, everywhere), by preset name: every tuning compares against them, so
# the codec probe measures them whatever its budget, where its grid has them.
BASELINE_SPECS: Mapping[str, Mapping[str, Any]] = {
    p.name: p.spec for p in DEFAULT_PRESETS if not p.plain
}


# Tensors with more elements than this are measured on their rows (4 MiB of fp32):
# below it a measurement costs milliseconds.
SAMPLE_ABOVE = 1 << 20
# Elements a row sample aims at: 1 MiB of fp32, a few milliseconds for the slowest method.
SAMPLE_NUMEL = 1 << 18
# Live (non-zero) rows a row sample keeps at least, where the tensor has that many.
MIN_LIVE_ROWS = 64
# A row sample stands for its tensor under a compressor if the bytes per element it
# would send differ by at most this fraction. This catches PowerSGD on too few rows: its
# bytes per element grow like 1/rows, and its error falls with them.
REPRESENTATIVE = 0.1
# Data-dependent compressors are timed on a sparse tensor a second time, with its rows
# filled up to this share: inside the range where rowsparse is an option, far enough from
# the sparse tables' own shares (0.1-2%) to tell work per row sent from the table's scan.
DENSER_AT = 0.25


@dataclass(frozen=True)
class RowPlan:
    """How the codec probe measures one large parameter: on which of its rows.

    Attributes:
        rows: rows of the tensor (``shape[0]``).
        live: rows non-zero in at least one captured step, ascending. Every other row
            is zero in every step, so compressors that leave zero rows alone give on
            these rows exactly what they give on the whole tensor.
        sample: a row sample at one rate among live and among zero rows (ascending),
            or None when none would be at most half the rows.
        sampled_live: live rows in ``sample``.
        energy_ratio: ``sample``'s share of the captured gradients' energy (sum of
            squares over steps) divided by its share of rows: near 1 when the sample is
            as heavy as the tensor, below 1 when it misses its heaviest rows.
    """

    rows: int
    live: Tensor
    sample: Tensor | None
    sampled_live: int
    energy_ratio: float | None

    def describe(self, mode: str, shape: Sequence[int]) -> dict[str, Any]:
        """JSON for the profile: which rows a cell was measured on."""
        index = self.live if mode == "live_rows" else self.sample
        assert index is not None  # modes are chosen only where their rows exist
        out: dict[str, Any] = {"rows": int(index.numel()), "of_rows": self.rows,
                               "numel": int(index.numel()) * math.prod(shape[1:])}
        if mode == "sample":
            out.update(live_rows=self.sampled_live, of_live_rows=int(self.live.numel()),
                       energy_ratio=self.energy_ratio)
        return out


def _systematic(items: Tensor, fraction: float, gen: torch.Generator) -> Tensor:
    """``round(fraction * len(items))`` items evenly spaced from a random start."""
    m = items.numel()
    count = min(m, round(fraction * m))
    if count == 0:
        return items[:0]
    start = float(torch.rand((), generator=gen, dtype=torch.float64))
    pos = ((torch.arange(count, dtype=torch.float64) + start) * (m / count)).long()
    return items[pos.clamp_(max=m - 1)]


def row_plan(
    name: str,
    steps: Sequence[Tensor],
    sample_above: int = SAMPLE_ABOVE,
    sample_numel: int = SAMPLE_NUMEL,
    min_live_rows: int = MIN_LIVE_ROWS,
) -> RowPlan | None:
    """The rows on which the codec probe measures parameter ``name``; None: in full.

    Only tensors of more than ``sample_above`` elements get a plan. Its row sample
    takes rows at one rate ``f`` among the live rows and among the zero rows, so that it
    has the tensor's share of live rows (which is what top-k's threshold, sign's scale
    and int8's blocks see); among the live rows every ``1/f``-th by energy, so that it
    spans the hot and the cold rows; ``f`` aims at ``sample_numel`` elements and at least
    ``min_live_rows`` live rows. The draw is seeded by the name.

    Args:
        name: the parameter's name (seeds the draw).
        steps: its captured gradients, oldest first; same shape.
        sample_above: elements above which a tensor is measured on its rows.
        sample_numel: elements a row sample aims at; more lowers the sampling noise of
            the errors, at proportional cost.
        min_live_rows: live rows a row sample keeps at least.

    Returns:
        The plan, or None when the tensor is measured in full.
    """
    first = steps[0]
    n = first.numel()
    if n <= sample_above or first.dim() == 0:
        return None
    rows = int(first.shape[0])
    energy = torch.zeros(rows, dtype=torch.float64)
    for g in steps:  # row norms in the gradient's precision, summed in float64
        norms = torch.linalg.vector_norm(g.detach().reshape(rows, -1), dim=1, dtype=torch.float32)
        energy += norms.double().cpu().pow(2)
    live = (energy > 0).nonzero().flatten()
    fraction = sample_numel / n
    if live.numel():
        fraction = max(fraction, min(min_live_rows, live.numel()) / live.numel())
    sample: Tensor | None = None
    sampled_live, ratio = 0, None
    if 2 * math.ceil(fraction * rows) <= rows:  # else a sample would save under half
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        picked_live = _systematic(live[energy[live].argsort(descending=True)], fraction, gen)
        picked_dead = _systematic((energy == 0).nonzero().flatten(), fraction, gen)
        sample = torch.cat([picked_live, picked_dead]).sort().values
        sampled_live = int(picked_live.numel())
        total = float(energy.sum())
        if total > 0 and sample.numel():
            ratio = float(energy[sample].sum()) / total / (sample.numel() / rows)
    if sample is not None and sample.numel() == 0:  # a tiny sample_numel: no rows at all
        sample = None
    if sample is None and 2 * live.numel() > rows:
        return None  # neither the live rows nor a sample would save much
    return RowPlan(rows=rows, live=live, sample=sample, sampled_live=sampled_live,
                   energy_ratio=ratio)


def row_density(grad: Tensor) -> float | None:
    """The fraction of ``grad``'s rows (first dimension; a 1-D tensor's elements) that
    hold a non-zero value, as ``rowsparse`` counts them (a NaN row is sent too); None
    for an empty tensor."""
    if grad.numel() == 0:
        return None
    rows = int(grad.shape[0]) if grad.dim() else 1
    live = grad.detach().reshape(rows, -1).ne(0).any(dim=1)
    return int(live.sum()) / rows


def _structure(per_rank: Sequence[Mapping[str, Sequence[float | None]]]) -> dict[str, Any]:
    """``codecs.structure`` from each rank's per-step row densities."""
    out: dict[str, Any] = {}
    for name in per_rank[0]:
        values = [d for rank in per_rank for d in rank.get(name, ()) if d is not None]
        if not values:
            continue
        out[name] = {
            "row_density_mean": statistics.fmean(values),
            # the busiest rank in the busiest step: what rowsparse pads every rank's rows to
            "row_density_max": max(values),
            "row_density_std": statistics.pstdev(values),
            "steps": max(len(rank.get(name, ())) for rank in per_rank),
            "ranks": len(per_rank),
        }
    return out


def _stands_for(comp: compressors.Compressor, shape: tuple[int, ...], rows: int,
                world_size: int) -> bool:
    """Whether ``comp`` sends as many bytes per element for ``rows`` of the tensor."""
    part_shape = (rows, *shape[1:])
    full = comp.wire_bytes(shape, world_size) / max(math.prod(shape), 1)
    part = comp.wire_bytes(part_shape, world_size) / max(math.prod(part_shape), 1)
    return full > 0 and abs(part / full - 1.0) <= REPRESENTATIVE


def _on_live_rows(comp: compressors.Compressor, shape: tuple[int, ...], live: int,
                  world_size: int) -> CompressorSpec | None:
    """The configuration that, given a tensor's ``live`` rows alone, does there exactly
    what ``comp`` does on the whole tensor (its other rows being zero in every step), or
    None: the compressor's own answer
    (:meth:`~autotune.compressors.Compressor.on_live_rows`), where the live rows are at
    most half the tensor's.

    Elementwise methods are such a configuration themselves; so are PowerSGD when it
    makes the same choice (compress or not, and the rank), top-k with its ratio rescaled
    to keep the same ``k``, and exact ``rowsparse``. Sign (its scale is a mean over
    every element, and zeros are sent as +-scale) and int8 (blocks span rows) have none.
    """
    if live < 1 or 2 * live > shape[0]:
        return None
    return comp.on_live_rows(shape, live, world_size)


def _check_grads(grads: Mapping[str, Sequence[Tensor]]) -> int:
    """Validate the captured gradients; return the number of steps."""
    if not grads:
        raise ProfileError("the codec probe needs captured gradients; got none "
                           "(run the compute probe with capture > 0)")
    lengths = {len(steps) for steps in grads.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ProfileError(f"every parameter needs the same number (>= 1) of captured "
                           f"steps; got {sorted(lengths)}")
    for name, steps in grads.items():
        shapes = {tuple(g.shape) for g in steps}
        if len(shapes) != 1:
            raise ProfileError(f"the captured gradients of {name!r} change shape: {sorted(shapes)}")
    return lengths.pop()


def _rel(diff: Tensor, ref: Tensor) -> float | None:
    # None when the reference is zero: a relative error is undefined there (and
    # JSON has no inf/NaN).
    ref_norm = float(ref.norm())
    diff_norm = float(diff.norm())
    if ref_norm == 0.0:
        return 0.0 if diff_norm == 0.0 else None
    return diff_norm / ref_norm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_spec(
    spec: CompressorSpec,
    grads: Mapping[str, Sequence[Tensor]],
    shapes: Mapping[tuple[int, ...], str],
    plans: Mapping[str, RowPlan],
    world_size: int,
    reps: int,
    device: torch.device,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One configuration: timing per distinct shape, errors per parameter; parameters
    with a row plan are measured on their rows where that stands for the whole."""
    timer = compressors.create(spec.name, **spec.kwargs)
    shape_rows = [_time_cell(spec, timer, shape, grads[name][-1], name, plans.get(name),
                             world_size, reps, device) for shape, name in shapes.items()]
    comm = LocalComm(world_size)
    error_rows = [_error_cell(spec, timer, name, steps, plans.get(name), world_size, device,
                              comm) for name, steps in grads.items()]
    return shape_rows, error_rows


def _time_cell(spec: CompressorSpec, timer: compressors.Compressor, shape: tuple[int, ...],
               grad: Tensor, name: str, plan: RowPlan | None, world_size: int, reps: int,
               device: torch.device) -> dict[str, Any]:
    """Encode+decode time and wire bytes of one configuration on one shape (``grad``,
    the last captured gradient of a parameter of that shape), on its row sample where
    that stands for it, scaled to the whole."""
    g = grad.to(device)
    index = plan.sample if plan is not None else None
    if index is not None and not _stands_for(timer, shape, index.numel(), world_size):
        index = None
    x0 = g if index is None else g.index_select(0, index.to(device))
    seconds = _time_reduce(timer, x0, name, world_size, reps, device)
    # data-dependent methods send what this tensor holds: sized at its density
    density = row_density(x0) if timer.density_dependent else None
    messages = {k: int(v) for k, v in timer.wire_messages(shape, world_size, density).items()}
    # every method's work is linear in the elements, or for PowerSGD in
    # rows * cols * rank, of which a row sample keeps cols and the rank
    scale = g.numel() / x0.numel()
    row: dict[str, Any] = {
        "spec": spec.to_dict(), "label": spec.label(), "shape": list(shape),
        "numel": g.numel(), "encode_decode_s": seconds * scale,
        "wire_bytes": sum(messages.values()),
        "wire_messages": messages, "measured": "full",
    }
    if density is not None:
        # the cost model reads the density it was timed at (a row sample keeps the
        # tensor's share of live rows), and, for a sparse tensor, a second point
        # with more of its rows filled, so that it can tell work per row sent from
        # the pass over the whole tensor
        row["row_density"] = density
        if density < DENSER_AT / 2 and x0.dim() and x0.shape[0] >= 2:
            denser = _denser(x0, DENSER_AT, zlib.crc32(name.encode()))
            row["denser"] = {"row_density": row_density(denser), "encode_decode_s":
                             _time_reduce(timer, denser, name, world_size, reps, device)
                             * scale}
    if index is not None:
        row.update(measured="sample",
                   sample={"param": name, "rows": int(x0.shape[0]), "numel": x0.numel(),
                           "encode_decode_s": seconds})
    return row


def _error_cell(spec: CompressorSpec, timer: compressors.Compressor, name: str,
                steps: Sequence[Tensor], plan: RowPlan | None, world_size: int,
                device: torch.device, comm: LocalComm) -> dict[str, Any]:
    """One configuration's error on one parameter's captured steps, its state carried
    from step to step: on its live rows or row sample where that is exact or stands for
    it (:func:`_error_mode`)."""
    shape = tuple(steps[0].shape)
    mode, index, run = _error_mode(spec, timer, shape, plan, world_size)
    comp = compressors.create(run.name, **run.kwargs)
    rel_steps: list[float | None] = []
    cum_steps: list[float | None] = []
    sum_g: Tensor | None = None
    sum_c: Tensor | None = None
    for grad in steps:  # in captured order: the compressor's state carries over
        if index is not None:
            grad = grad.index_select(0, index.to(grad.device))
        out = grad.to(device, copy=True)  # compressed in the gradient's own dtype
        comp.reduce([out], [name], comm)
        g, c = grad.to(device, torch.float32), out.float()
        rel_steps.append(_rel(g - c, g))
        sum_g = g.clone() if sum_g is None else sum_g.add_(g)
        sum_c = c.clone() if sum_c is None else sum_c.add_(c)
        cum_steps.append(_rel(sum_g - sum_c, sum_g))
    # The first step has no error feedback yet; it stands alone only if it is all.
    tail = [e for e in (rel_steps[1:] or rel_steps) if e is not None]
    error_row: dict[str, Any] = {
        "spec": spec.to_dict(), "label": spec.label(), "param": name,
        "rel_error": statistics.fmean(tail) if tail else None,
        "rel_error_steps": rel_steps,
        "cum_error": cum_steps[-1],
        "cum_error_steps": cum_steps,
        "measured": mode,
    }
    if plan is not None and mode != "full":
        error_row["sample"] = plan.describe(mode, shape)
    return error_row


def _time_reduce(comp: compressors.Compressor, x0: Tensor, name: str, world_size: int,
                 reps: int, device: torch.device) -> float:
    """Median seconds of ``reps`` reductions of a copy of ``x0``, after an untimed one
    (which builds state: Q, residuals)."""
    times = []
    for rep in range(reps + 1):
        x, comm = x0.clone(), LocalComm(world_size)
        _sync(device)
        start = time.perf_counter()
        comp.reduce([x], [name], comm)
        _sync(device)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _denser(x: Tensor, density: float, seed: int) -> Tensor:
    """A copy of ``x`` with zero rows, drawn at random, filled with ones until
    ``density`` of its rows are non-zero (what a data-dependent method's time reads)."""
    rows = int(x.shape[0])
    out = x.clone()
    mat = out.view(rows, -1)
    dead = (~mat.ne(0).any(dim=1)).nonzero().flatten().cpu()
    want = min(dead.numel(), math.ceil(density * rows) - (rows - dead.numel()))
    if want > 0:
        gen = torch.Generator().manual_seed(seed)
        mat[dead[torch.randperm(dead.numel(), generator=gen)[:want]].to(x.device)] = 1.0
    return out


def _time_full(spec: CompressorSpec, grad: Tensor, name: str, world_size: int,
               device: torch.device) -> float:
    """One timed encode+decode of the whole tensor, after an untimed one (state)."""
    comp = compressors.create(spec.name, **spec.kwargs)
    g = grad.to(device)
    comp.reduce([g.clone()], [name], LocalComm(world_size))
    x, comm = g.clone(), LocalComm(world_size)
    _sync(device)
    start = time.perf_counter()
    comp.reduce([x], [name], comm)
    _sync(device)
    return time.perf_counter() - start


def _error_mode(
    spec: CompressorSpec, comp: compressors.Compressor, shape: tuple[int, ...],
    plan: RowPlan | None, world_size: int,
) -> tuple[str, Tensor | None, CompressorSpec]:
    """How to measure one cell's error: ``(mode, rows or None, configuration to run)``.

    ``live_rows`` where that is exact, else ``sample`` where the row sample stands for
    the tensor, else ``full``."""
    if plan is None:
        return "full", None, spec
    live_spec = _on_live_rows(comp, shape, int(plan.live.numel()), world_size)
    if live_spec is not None:
        return "live_rows", plan.live, live_spec
    if plan.sample is not None and _stands_for(comp, shape, plan.sample.numel(), world_size):
        return "sample", plan.sample, spec
    return "full", None, spec


def probe_codecs(
    grads: Mapping[str, Sequence[Tensor]],
    world_size: int,
    grid: Sequence[Mapping[str, Any]] | None = None,
    reps: int = 5,
    budget_s: float | None = None,
    *,
    distribute: bool = False,
    group: dist.ProcessGroup | None = None,
    device: str | torch.device | None = None,
    sample_above: int | None = SAMPLE_ABOVE,
    sample_numel: int = SAMPLE_NUMEL,
) -> dict[str, Any]:
    """Time and size every compressor of ``grid`` and measure its error on real gradients.

    Args:
        grads: per parameter name, its captured gradients oldest first (the compute
            probe's ``capture``); every parameter with the same number of steps.
        world_size: ranks of the cluster to model: decode handles this many payloads
            and ``wire_messages`` is asked for this world size.
        grid: compressor specs such as ``{"compressor": "topk", "ratio": 0.01}``;
            default :data:`DEFAULT_GRID`.
        reps: timed runs per configuration and shape (median reported); 5 is enough for
            medians within a few percent on a quiet machine, raise it on a noisy one.
        budget_s: seconds after which no further configuration is started (one always
            is, per rank); the rest are listed in ``skipped`` and ``truncated`` is true.
            Large tensors are measured on rows first, so that every configuration
            fits; budget left then times the scaled cells in full, slowest first (None:
            all of them).
        distribute: share the grid among the ranks of ``group`` (round robin) and combine
            the results, which every rank returns. Each rank measures errors on its own
            gradients. Call it on every rank then.
        group: the process group for ``distribute`` (default: the world).
        device: where to run the compressors (default: where the gradients are);
            pass the training device, since codec cost on a GPU is not that on a CPU.
        sample_above: tensors with more elements are measured on their rows (live
            rows or a row sample, see the module doc); None measures every tensor in
            full (slow for large embedding tables).
        sample_numel: elements a row sample aims at. Raise it if the errors of sampled
            cells matter to a decision (their sampling noise falls like
            ``1/sqrt(sample_numel)``); the probe's time grows in proportion.

    Returns:
        ``{"world_size", "grid", "skipped", "shapes", "errors", "structure",
        "truncated", "sampling", "wall_s"}``: ``grid`` the configurations measured;
        ``shapes`` one row per configuration and distinct shape (``encode_decode_s``, ``wire_bytes``,
        ``wire_messages``, ``measured``: ``"full"``, or ``"sample"`` for a row
        sample's time scaled, with ``sample``: the parameter, rows, numel and time of
        the sample); ``errors`` one row per configuration and parameter
        (``rel_error``, ``rel_error_steps``, ``cum_error``, ``cum_error_steps``, see
        the module doc; ``measured``: ``"full"``, ``"live_rows"`` or ``"sample"``, with
        ``sample``: rows, of_rows, numel and for a sample its live rows and energy
        ratio); ``structure`` per parameter the row densities of its gradients over
        the steps and ranks (see the module doc; ``ranks`` is 1 without
        ``distribute``); ``sampling`` the thresholds used. Time cells of data-dependent
        compressors carry the ``row_density`` of the tensor timed and, where it was
        sparse, ``denser`` (``row_density``, ``encode_decode_s``) of a fuller copy.

    Raises:
        ProfileError: no gradients, ragged steps, a bad world size, ``reps`` or
            sample size.
        CompressorError: an unknown compressor or bad parameter in ``grid``.
    """
    started = time.monotonic()
    steps = _check_grads(grads)
    _check_arguments(world_size, reps, budget_s, sample_above, sample_numel)
    specs = [CompressorSpec.from_dict(d) for d in (DEFAULT_GRID if grid is None else grid)]
    first = next(iter(grads.values()))[0]
    where = torch.device(device) if device is not None else first.device
    shapes = _representatives(grads)
    plans = _row_plans(grads, sample_above, sample_numel)
    # what this rank's gradients look like: non-zero rows per step (a pass per tensor)
    densities = {name: [row_density(g) for g in gs] for name, gs in grads.items()}

    rank, ranks = 0, 1
    if distribute and dist.is_available() and dist.is_initialized():
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    mine = list(range(rank, len(specs), ranks))
    done, skipped = _measure_share(specs, mine, grads, shapes, plans, world_size, reps, where,
                                   started, budget_s)
    _retime_in_full(done, grads, world_size, where, started, budget_s)

    part: dict[str, Any] = {
        "done": {str(i): {"shapes": s, "errors": e} for i, (s, e) in done.items()},
        "skipped": skipped,
        "densities": densities,
    }
    parts = _all_gather_json(part, group) if ranks > 1 else [part]
    return _combine(parts, specs, grads, plans, world_size, steps, reps, sample_above,
                    sample_numel, started)


def _check_arguments(world_size: int, reps: int, budget_s: float | None,
                     sample_above: int | None, sample_numel: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ProfileError(f"world_size must be an int >= 1, got {world_size!r}")
    if reps < 1:
        raise ProfileError(f"reps must be >= 1, got {reps}")
    if budget_s is not None and not budget_s > 0:
        raise ProfileError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    if sample_above is not None and (sample_above < 1 or sample_numel < 1):
        raise ProfileError(f"sample_above and sample_numel must be >= 1, got {sample_above} "
                           f"and {sample_numel}")


def _representatives(grads: Mapping[str, Sequence[Tensor]]) -> dict[tuple[int, ...], str]:
    """One parameter per distinct shape: encode+decode time depends on the shape, not on
    which parameter has it."""
    shapes: dict[tuple[int, ...], str] = {}
    for name, gs in grads.items():
        shapes.setdefault(tuple(gs[0].shape), name)
    return shapes


def _row_plans(grads: Mapping[str, Sequence[Tensor]], sample_above: int | None,
               sample_numel: int) -> dict[str, RowPlan]:
    """The parameters measured on their rows (None: none), with their rows."""
    plans: dict[str, RowPlan] = {}
    if sample_above is not None:
        for name, gs in grads.items():
            plan = row_plan(name, gs, sample_above, sample_numel)
            if plan is not None:
                plans[name] = plan
    return plans


def _essential(specs: Sequence[CompressorSpec]) -> set[int]:
    """The configurations measured whatever the budget: the first of each method (so
    the cost model can price every method) and the baselines'."""
    first_of_name = {spec.name: i for i, spec in reversed(list(enumerate(specs)))}
    baselines = {CompressorSpec.from_dict(d).canonical() for d in BASELINE_SPECS.values()}
    essential = set(first_of_name.values())
    essential |= {i for i, spec in enumerate(specs) if spec.canonical() in baselines}
    return essential


_Cells = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (time rows, error rows)


def _measure_share(
    specs: Sequence[CompressorSpec], mine: Sequence[int], grads: Mapping[str, Sequence[Tensor]],
    shapes: Mapping[tuple[int, ...], str], plans: Mapping[str, RowPlan], world_size: int,
    reps: int, where: torch.device, started: float, budget_s: float | None,
) -> tuple[dict[int, _Cells], list[int]]:
    """This rank's configurations (indices ``mine`` into ``specs``) measured in turn;
    once the budget is spent, only essential ones. The cells by index, and the
    indices skipped."""
    essential = _essential(specs)
    done: dict[int, _Cells] = {}
    skipped: list[int] = []
    for index in mine:
        over = budget_s is not None and time.monotonic() - started > budget_s
        if over and index not in essential and done:
            skipped.append(index)
            continue
        t0 = time.perf_counter()
        done[index] = _measure_spec(specs[index], grads, shapes, plans, world_size, reps,
                                    where)
        logger.debug("codec probe: %s took %.2f s", specs[index].label(),
                     time.perf_counter() - t0)
    if skipped:
        logger.info("codec probe: budget of %.1f s spent; skipped %d configurations",
                    budget_s, len(skipped))
    return done, skipped


def _retime_in_full(done: Mapping[int, _Cells], grads: Mapping[str, Sequence[Tensor]],
                    world_size: int, where: torch.device, started: float,
                    budget_s: float | None) -> None:
    """With every cell covered, budget left buys full-size timings of the scaled ones,
    the slowest first (rows updated in place): scaling from a sample that fits in cache
    can miss what a large tensor costs in memory traffic and allocation (int8 on 6.4 M
    elements: 2-4x)."""
    scaled = sorted((row for s_rows, _ in done.values() for row in s_rows
                     if row["measured"] == "sample"), key=lambda r: -r["encode_decode_s"])
    for row in scaled:
        left = None if budget_s is None else budget_s - (time.monotonic() - started)
        # a warm run and one timed, of the tensor and of its fuller copy if it has one
        cost = row["encode_decode_s"] + row.get("denser", {}).get("encode_decode_s", 0.0)
        if left is not None and left < 2 * cost:
            continue
        spec = CompressorSpec.from_dict(row["spec"])
        name = row["sample"]["param"]
        full = grads[name][-1]
        row["encode_decode_s"] = _time_full(spec, full, name, world_size, where)
        row.update(measured="full", reps=1)
        if "row_density" in row:  # now timed on all of its rows
            density = row_density(full)
            comp = compressors.create(spec.name, **spec.kwargs)
            messages = {k: int(v) for k, v in
                        comp.wire_messages(tuple(row["shape"]), world_size, density).items()}
            row.update(row_density=density, wire_messages=messages,
                       wire_bytes=sum(messages.values()))
        if "denser" in row:
            denser = _denser(full, DENSER_AT, zlib.crc32(name.encode()))
            row["denser"] = {"row_density": row_density(denser),
                             "encode_decode_s": _time_full(spec, denser, name, world_size, where)}


def _combine(parts: Sequence[Mapping[str, Any]], specs: Sequence[CompressorSpec],
             grads: Mapping[str, Sequence[Tensor]], plans: Mapping[str, RowPlan],
             world_size: int, steps: int, reps: int, sample_above: int | None,
             sample_numel: int, started: float) -> dict[str, Any]:
    """The probe's result from every rank's part, configurations in grid order."""
    measured: dict[int, dict[str, Any]] = {}
    all_skipped: list[int] = []
    for p in parts:
        measured.update({int(i): v for i, v in p["done"].items()})
        all_skipped.extend(p["skipped"])
    order = sorted(measured)
    errors = [row for i in order for row in measured[i]["errors"]]
    modes = [row["measured"] for row in errors]
    if plans:
        logger.info("codec probe: of %d error cells, %d exact on live rows, %d on row "
                    "samples (%d large parameters)", len(errors), modes.count("live_rows"),
                    modes.count("sample"), len(plans))
    return {
        "world_size": world_size,
        "steps": steps,
        "reps": reps,
        "grid": [specs[i].to_dict() for i in order],
        "skipped": [specs[i].to_dict() for i in sorted(all_skipped)],
        "shapes": [row for i in order for row in measured[i]["shapes"]],
        "errors": errors,
        # mean gradient norm per parameter (this rank's): weights per-layer errors into
        # the error of the whole gradient
        "grad_norms": {name: float(sum(float(g.float().norm()) for g in gs) / len(gs))
                       for name, gs in grads.items()},
        # per parameter, its gradient's non-zero rows over every rank's captured steps
        "structure": _structure([p["densities"] for p in parts]),
        "truncated": bool(all_skipped),
        "sampling": {"above": sample_above, "numel": sample_numel,
                     "min_live_rows": MIN_LIVE_ROWS, "representative": REPRESENTATIVE},
        "wall_s": time.monotonic() - started,
    }


def _all_gather_json(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, through JSON bytes in tensors (no pickle)."""
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    # JSON ignores trailing whitespace, so spaces pad every rank's bytes to one length.
    padded = torch.full((int(length.item()),), ord(" "), dtype=torch.uint8)
    padded[: data.numel()] = data
    world = dist.get_world_size(group)
    out = torch.empty(world * padded.numel(), dtype=torch.uint8, device=device)
    all_gather_flat(out, padded.to(device), group=group)
    rows = out.view(world, -1).cpu()
    return [json.loads(row.numpy().tobytes().decode()) for row in rows]
