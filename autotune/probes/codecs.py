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
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from autotune import compressors
from autotune.compressors import CompressorSpec, LocalComm
from autotune.compressors.comm import all_gather_flat
from autotune.errors import ProfileError

__all__ = ["BASELINE_SPECS", "DEFAULT_GRID", "probe_codecs"]

logger = logging.getLogger(__name__)

# What the tuner chooses from by default: exact and half-precision allreduce, PowerSGD
# ranks by factors of 2, top-k ratios by factors of 10, 8-bit and 1-bit quantisation.
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
    {"compressor": "powersgd", "rank": 1},
    {"compressor": "powersgd", "rank": 2},
    {"compressor": "powersgd", "rank": 8},
    {"compressor": "topk", "ratio": 0.001},
    {"compressor": "topk", "ratio": 0.1},
)
# The compressors of the set-ups every tuning compares against besides plain DDP (fp16
# and PyTorch's PowerSGD at rank 1 and 4, everywhere), by baseline name: the tuner,
# `autotune simulate` and the report use them, and the codec probe measures them
# whatever its budget, where its grid has them.
BASELINE_SPECS: Mapping[str, Mapping[str, Any]] = {
    "fp16": {"compressor": "fp16"},
    "powersgd1": {"compressor": "powersgd", "rank": 1},
    "powersgd4": {"compressor": "powersgd", "rank": 4},
}


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
    world_size: int,
    reps: int,
    device: torch.device,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One configuration: timing per distinct shape, errors per parameter."""
    spec_dict = spec.to_dict()
    label = spec.label()
    shape_rows = []
    timer = compressors.create(spec.name, **spec.kwargs)
    for shape, name in shapes.items():
        g = grads[name][-1].to(device)
        times = []
        for rep in range(reps + 1):  # the first run builds state (Q, residual): untimed
            x, comm = g.clone(), LocalComm(world_size)
            _sync(device)
            start = time.perf_counter()
            timer.reduce([x], [name], comm)
            _sync(device)
            if rep:
                times.append(time.perf_counter() - start)
        messages = {k: int(v) for k, v in timer.wire_messages(shape, world_size).items()}
        shape_rows.append({
            "spec": spec_dict, "label": label, "shape": list(shape),
            "numel": g.numel(), "encode_decode_s": statistics.median(times),
            "wire_bytes": int(timer.wire_bytes(shape, world_size)),
            "wire_messages": messages,
        })

    error_rows = []
    comp = compressors.create(spec.name, **spec.kwargs)
    comm = LocalComm(world_size)
    for name, steps in grads.items():
        rel_steps: list[float | None] = []
        cum_steps: list[float | None] = []
        sum_g: Tensor | None = None
        sum_c: Tensor | None = None
        for grad in steps:  # in captured order: the compressor's state carries over
            out = grad.to(device, copy=True)  # compressed in the gradient's own dtype
            comp.reduce([out], [name], comm)
            g, c = grad.to(device, torch.float32), out.float()
            rel_steps.append(_rel(g - c, g))
            sum_g = g.clone() if sum_g is None else sum_g.add_(g)
            sum_c = c.clone() if sum_c is None else sum_c.add_(c)
            cum_steps.append(_rel(sum_g - sum_c, sum_g))
        # The first step has no error feedback yet; it stands alone only if it is all.
        tail = [e for e in (rel_steps[1:] or rel_steps) if e is not None]
        error_rows.append({
            "spec": spec_dict, "label": label, "param": name,
            "rel_error": statistics.fmean(tail) if tail else None,
            "rel_error_steps": rel_steps,
            "cum_error": cum_steps[-1],
            "cum_error_steps": cum_steps,
        })
    return shape_rows, error_rows


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
        distribute: share the grid among the ranks of ``group`` (round robin) and combine
            the results, which every rank returns. Each rank measures errors on its own
            gradients. Call it on every rank then.
        group: the process group for ``distribute`` (default: the world).
        device: where to run the compressors (default: where the gradients are);
            pass the training device, since codec cost on a GPU is not that on a CPU.

    Returns:
        ``{"world_size", "grid", "skipped", "shapes", "errors", "truncated", "wall_s"}``:
        ``grid`` the configurations measured; ``shapes`` one row per configuration and
        distinct shape (``encode_decode_s``, ``wire_bytes``, ``wire_messages``);
        ``errors`` one row per configuration and parameter (``rel_error``,
        ``rel_error_steps``, ``cum_error``, ``cum_error_steps``; see the module doc).

    Raises:
        ProfileError: no gradients, ragged steps, a bad world size or ``reps``.
        CompressorError: an unknown compressor or bad parameter in ``grid``.
    """
    started = time.monotonic()
    steps = _check_grads(grads)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ProfileError(f"world_size must be an int >= 1, got {world_size!r}")
    if reps < 1:
        raise ProfileError(f"reps must be >= 1, got {reps}")
    if budget_s is not None and not budget_s > 0:
        raise ProfileError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    specs = [CompressorSpec.from_dict(d) for d in (DEFAULT_GRID if grid is None else grid)]
    first = next(iter(grads.values()))[0]
    where = torch.device(device) if device is not None else first.device

    # One representative gradient per distinct shape: encode+decode time depends on the
    # shape, not on which parameter has it.
    shapes: dict[tuple[int, ...], str] = {}
    for name, gs in grads.items():
        shapes.setdefault(tuple(gs[0].shape), name)

    rank, ranks = 0, 1
    if distribute and dist.is_available() and dist.is_initialized():
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    mine = list(range(rank, len(specs), ranks))

    # the first configuration of each method, and the baselines, are measured whatever
    # the budget
    first_of_name = {spec.name: i for i, spec in reversed(list(enumerate(specs)))}
    baselines = {CompressorSpec.from_dict(d).canonical() for d in BASELINE_SPECS.values()}
    essential = set(first_of_name.values())
    essential |= {i for i, spec in enumerate(specs) if spec.canonical() in baselines}
    done: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    skipped: list[int] = []
    for index in mine:
        over = budget_s is not None and time.monotonic() - started > budget_s
        if over and index not in essential and done:
            skipped.append(index)
            continue
        t0 = time.perf_counter()
        done[index] = _measure_spec(specs[index], grads, shapes, world_size, reps, where)
        logger.debug("codec probe: %s took %.2f s", specs[index].label(),
                     time.perf_counter() - t0)
    if skipped:
        logger.info("codec probe: budget of %.1f s spent; skipped %d configurations",
                    budget_s, len(skipped))

    part: dict[str, Any] = {
        "done": {str(i): {"shapes": s, "errors": e} for i, (s, e) in done.items()},
        "skipped": skipped,
    }
    parts = _all_gather_json(part, group) if ranks > 1 else [part]
    measured: dict[int, dict[str, Any]] = {}
    all_skipped: list[int] = []
    for p in parts:
        measured.update({int(i): v for i, v in p["done"].items()})
        all_skipped.extend(p["skipped"])
    order = sorted(measured)
    return {
        "world_size": world_size,
        "steps": steps,
        "reps": reps,
        "grid": [specs[i].to_dict() for i in order],
        "skipped": [specs[i].to_dict() for i in sorted(all_skipped)],
        "shapes": [row for i in order for row in measured[i]["shapes"]],
        "errors": [row for i in order for row in measured[i]["errors"]],
        # mean gradient norm per parameter (this rank's): weights per-layer errors into
        # the error of the whole gradient
        "grad_norms": {name: float(sum(float(g.float().norm()) for g in gs) / len(gs))
                       for name, gs in grads.items()},
        "truncated": bool(all_skipped),
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
