"""Compute probe: per-layer forward/backward time and gradient-ready times, no communication.

Run on every rank of a process group at once: each rank trains its own copy of the
workload's bare model (no DDP) side by side with the others, so the result is the
compute-only floor of a step on this cluster, contention between co-running ranks
included, that no communication policy can beat.

Steps alternate between *hooked* and *clean*. Hooked steps carry the instrumentation:
a forward pre-hook and hook on every leaf module, hooks on the autograd nodes each leaf
module created, and a post-accumulate-grad hook on every parameter. Clean steps carry
none, and give the step, forward, backward and optimizer wall times that a cost model
should predict; ``hooked_step_s`` shows what the hooks cost.

Why autograd-node hooks and not ``register_full_backward_hook``: full backward hooks wrap
a module's inputs and outputs in a ``BackwardHookFunction`` view, and any in-place op on
those views fails, not only in in-place modules (``nn.ReLU(inplace=True)``) but in the
module *before* one, and before torchvision's ``out += identity``; they also fire as
soon as the output gradient arrives when no input requires a gradient, so the first
layer's weight-gradient time is lost (measured: 0 ms instead of 2.3 ms for a 3x3 conv on
32x32 inputs). Instead, a module's backward is the set of autograd nodes created during
its forward (sequence numbers between its pre-hook and hook) that its outputs reach;
each node's pre-hook and hook bracket its execution, and the module's backward time is
the sum over its nodes. That changes no graph, works with in-place ops, and attributes
each node to exactly one module. What no leaf module owns (functional ops in a parent's
``forward`` such as residual adds, ``F.relu``, pooling, and the loss) is left out, so
the module sum is below the backward wall time; the parameters' gradient-ready times
cover everything and are what a timeline simulator should schedule on.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autotune.compressors.comm import all_gather_flat
from autotune.errors import ProfileError
from autotune.workloads import Workload

__all__ = ["probe_compute", "backward_sum_vs_wall"]

logger = logging.getLogger(__name__)

# The autograd sequence counter tells which nodes a module's forward created. It is a
# private API; without it module backward times are skipped (and the result says so).
_next_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)

# Step-level series, in the order they travel in one tensor across ranks.
_STEP_KEYS = ("step_s", "forward_s", "backward_s", "optimizer_s", "hooked_step_s",
              "hooked_backward_s")


class _Clock:
    """Marks moments: ``perf_counter`` on CPU; CUDA events on the current stream, read
    only after :meth:`sync`, since kernels run asynchronously."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


def _tensors(obj: Any) -> list[Tensor]:
    """The tensors in a module's inputs or outputs (nested tuples, lists, dicts)."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(item, device) for item in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@dataclass
class _Marks:
    """Raw marks of one hooked step, resolved to seconds after the step."""

    forward: list[list[tuple[Any, Any]]]  # per module: (start, end) per call
    backward: list[list[list[Any]]]  # per module: [start, end] per autograd node
    ready: list[Any]  # per parameter: mark when its gradient was accumulated (or None)
    open_calls: list[list[tuple[Any, int]]]  # per module: (start mark, sequence floor)


class _Instruments:
    """The hooks of a hooked step: attached before it, removed after it."""

    def __init__(self, leaves: Sequence[nn.Module], params: Sequence[Tensor], clock: _Clock,
                 time_backward: bool) -> None:
        self.leaves = leaves
        self.params = params
        self.clock = clock
        self.time_backward = time_backward
        self.marks = self._fresh()
        self._handles: list[Any] = []

    def _fresh(self) -> _Marks:
        n = len(self.leaves)
        return _Marks([[] for _ in range(n)], [[] for _ in range(n)], [None] * len(self.params),
                      [[] for _ in range(n)])

    def attach(self) -> None:
        self.marks = self._fresh()
        for i, module in enumerate(self.leaves):
            self._handles.append(module.register_forward_pre_hook(self._pre(i)))
            self._handles.append(module.register_forward_hook(self._post(i)))
        for j, param in enumerate(self.params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._ready(j)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            seq = _next_sequence_nr() if self.time_backward else 0
            self.marks.open_calls[i].append((self.clock.mark(), seq))
        return hook

    def _post(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            end = self.clock.mark()  # first, so the bookkeeping below is not timed
            start, floor = self.marks.open_calls[i].pop()
            self.marks.forward[i].append((start, end))
            if self.time_backward:
                self._watch_nodes(i, output, floor, _next_sequence_nr())
        return hook

    def _watch_nodes(self, i: int, output: Any, floor: int, ceil: int) -> None:
        # The nodes this call created are those reachable from its outputs whose sequence
        # numbers fall in [floor, ceil); the walk stops at anything older (the inputs'
        # producers) and at AccumulateGrad nodes (their sequence number is the maximum).
        stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if not floor <= node._sequence_nr() < ceil:
                continue
            slot: list[Any] = [None, None]
            self.marks.backward[i].append(slot)
            node.register_prehook(self._node_start(slot))
            node.register_hook(self._node_end(slot))
            stack.extend(nxt for nxt, _ in node.next_functions)

    def _node_start(self, slot: list[Any]) -> Any:
        def hook(grad_outputs: Any) -> None:
            slot[0] = self.clock.mark()
        return hook

    def _node_end(self, slot: list[Any]) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            slot[1] = self.clock.mark()
        return hook

    def _ready(self, j: int) -> Any:
        def hook(param: Tensor) -> None:
            self.marks.ready[j] = self.clock.mark()
        return hook


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _coll_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_same_structure(names: Sequence[str], group: dist.ProcessGroup | None) -> None:
    """Fail clearly if ranks hold different models (values are matched by position)."""
    key = torch.tensor([len(names), zlib.crc32("\n".join(names).encode())], dtype=torch.int64,
                       device=_coll_device(group))
    low, high = key.clone(), key.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ProfileError(
            "the compute probe needs the same model on every rank; ranks differ in their "
            f"modules or parameters (this rank has {len(names)} named entries)"
        )


def _median_over_ranks(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Elementwise median across ranks of a 1-D float64 tensor (NaN = missing)."""
    world = dist.get_world_size(group)
    local = values.to(_coll_device(group))
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_flat(gathered, local, group=group)
    return _nanmedian(gathered.view(world, -1).cpu(), dim=0)


def _nanmedian(x: Tensor, dim: int) -> Tensor:
    # quantile(0.5) averages the two middle values; torch.median would take the lower
    # one, i.e. always the faster of two ranks.
    return torch.nanquantile(x, 0.5, dim=dim)


def _number(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


@dataclass
class _Subject:
    """The probed copy of the model, its optimizer, and what times its steps."""

    work: Workload
    model: nn.Module
    params: list[tuple[str, nn.Parameter]]  # trainable parameters, in named_parameters order
    leaves: list[tuple[str, nn.Module]]  # leaf modules, in named_modules order
    device: torch.device
    clock: _Clock
    optimizer: torch.optim.Optimizer
    tools: _Instruments
    time_backward: bool  # module backward times need the autograd sequence counter
    batch_no: int = 0  # the next batch to draw

    @classmethod
    def of(cls, work: Workload, lr: float) -> _Subject:
        model = copy.deepcopy(work.model)
        model.train()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params:
            raise ProfileError(f"workload {work.name!r} has no trainable parameters to probe")
        device = params[0][1].device
        clock = _Clock(device)
        # Fixed options: no weight decay, so SGD leaves .grad as backward wrote it and
        # gradients can be captured after the timed step.
        optimizer = torch.optim.SGD([p for _, p in params], lr=lr, momentum=0.9)
        leaves = [(n, m) for n, m in model.named_modules() if next(m.children(), None) is None]
        time_backward = _next_sequence_nr is not None
        if not time_backward:
            logger.warning("this torch has no autograd sequence counter; module backward times "
                           "are skipped (gradient-ready times are still measured)")
        tools = _Instruments([m for _, m in leaves], [p for _, p in params], clock, time_backward)
        return cls(work, model, params, leaves, device, clock, optimizer, tools, time_backward)

    def step(self, hooked: bool) -> dict[str, Any]:
        """One training step; its wall times, and with ``hooked`` its per-layer marks."""
        clock = self.clock
        inputs, targets = _to(self.work.make_batch(self.batch_no), self.device)
        self.batch_no += 1
        if hooked:
            self.tools.attach()
        try:
            t0 = clock.mark()
            self.optimizer.zero_grad(set_to_none=True)
            t1 = clock.mark()
            loss = self.work.loss_fn(self.model(inputs), targets)
            t2 = clock.mark()
            loss.backward()
            t3 = clock.mark()
            self.optimizer.step()
            t4 = clock.mark()
            clock.sync()
        finally:
            self.tools.detach()
        out: dict[str, Any] = {
            "step_s": clock.seconds(t0, t4),
            "forward_s": clock.seconds(t1, t2),
            "backward_s": clock.seconds(t2, t3),
            "optimizer_s": clock.seconds(t0, t1) + clock.seconds(t3, t4),
        }
        if hooked:
            m = self.tools.marks
            out["module_forward"] = [sum(clock.seconds(a, b) for a, b in calls)
                                     for calls in m.forward]
            out["module_backward"] = [
                sum(clock.seconds(a, b) for a, b in nodes if a is not None and b is not None)
                for nodes in m.backward
            ]
            out["ready"] = [math.nan if r is None else clock.seconds(t2, r) for r in m.ready]
        return out


@dataclass
class _Steps:
    """What the measured steps gave, on this rank."""

    clean: list[dict[str, Any]]
    hooked: list[dict[str, Any]]
    captured: list[dict[str, Tensor]]  # gradients of the last clean steps, oldest first
    truncated: bool  # stopped early by the budget


def _check_arguments(steps: int, warmup: int, capture: int, budget_s: float | None) -> None:
    if steps < 1 or warmup < 0 or capture < 0:
        raise ProfileError(
            f"the compute probe needs steps >= 1, warmup >= 0 and capture >= 0; got "
            f"steps={steps}, warmup={warmup}, capture={capture}"
        )
    if budget_s is not None and not budget_s > 0:
        raise ProfileError(f"budget_s must be a positive number of seconds, got {budget_s!r}")


def _any_rank(flag: bool, distributed: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` is set on any rank (one small allreduce, which also keeps the
    ranks' steps side by side)."""
    value = torch.tensor([float(flag)])
    if distributed:
        value = value.to(_coll_device(group))
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item() > 0


def _run_steps(subject: _Subject, steps: int, warmup: int, budget_s: float | None,
               capture: int, started: float, distributed: bool,
               group: dist.ProcessGroup | None) -> _Steps:
    """Warm up, then hooked and clean steps in pairs until ``steps`` pairs or the budget."""
    for _ in range(warmup):
        subject.step(hooked=False)
    if warmup:
        subject.step(hooked=True)  # the hooks' own first-call costs stay out of the medians
    done = _Steps([], [], [], False)
    for i in range(steps):
        done.hooked.append(subject.step(hooked=True))
        done.clean.append(subject.step(hooked=False))
        if capture:
            done.captured.append({n: p.grad.detach().to("cpu", copy=True)
                                  for n, p in subject.params if p.grad is not None})
            del done.captured[:-capture]
        over = budget_s is not None and time.monotonic() - started > budget_s and i + 1 >= 3
        if _any_rank(over, distributed, group) and i + 1 < steps:
            done.truncated = True
            logger.info("compute probe: budget of %.1f s spent after %d steps", budget_s, i + 1)
            break
    return done


def _step_series(done: _Steps, distributed: bool, group: dist.ProcessGroup | None) -> Tensor:
    """The step-level series (rows in :data:`_STEP_KEYS` order), each step the slowest
    rank's."""
    series = torch.tensor(
        [[c[key] for c in done.clean] for key in _STEP_KEYS[:4]]
        + [[h["step_s"] for h in done.hooked], [h["backward_s"] for h in done.hooked]],
        dtype=torch.float64,
    )
    if distributed:
        series = series.to(_coll_device(group))
        dist.all_reduce(series, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's step
        series = series.cpu()
    return series


def _per_layer(done: _Steps, leaves: int, params: int, distributed: bool,
               group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per module forward and backward, per parameter ready time (medians over steps,
    then over ranks), and the backward coverage of modules and ready times."""
    hooked = done.hooked
    k = len(hooked)

    def per_step(key: str, width: int) -> Tensor:
        values = [h[key] for h in hooked]
        return _nanmedian(torch.tensor(values, dtype=torch.float64).view(k, width), dim=0)

    fwd = per_step("module_forward", leaves)
    bwd = per_step("module_backward", leaves)
    ready = per_step("ready", params)
    # How much of each backward pass the per-layer breakdown accounts for, compared
    # within the same step on the same rank (across ranks or steps, CPU drift swamps it).
    coverage = torch.tensor([
        [sum(h["module_backward"]) / h["backward_s"] for h in hooked],
        [max((r for r in h["ready"] if not math.isnan(r)), default=0.0) / h["backward_s"]
         for h in hooked],
    ], dtype=torch.float64).median(dim=1).values
    if distributed:
        merged = _median_over_ranks(torch.cat([fwd, bwd, ready, coverage]), group)
        fwd, bwd, ready, coverage = merged.split([len(fwd), len(bwd), len(ready), 2])
    return fwd, bwd, ready, coverage


def _ready_order(ready: list[float | None]) -> list[int | None]:
    """Each parameter's position by ready time (None where it has none); from the
    aggregated times, so order and times never disagree."""
    ranked = sorted((t, j) for j, t in enumerate(ready) if t is not None)
    order: list[int | None] = [None] * len(ready)
    for position, (_, j) in enumerate(ranked):
        order[j] = position
    return order


def _gradients(captured: list[dict[str, Tensor]]) -> dict[str, list[Tensor]]:
    """Captured snapshots regrouped by parameter name, oldest first."""
    grads: dict[str, list[Tensor]] = {}
    for snapshot in captured:
        for name, g in snapshot.items():
            grads.setdefault(name, []).append(g)
    return grads


def probe_compute(
    work: Workload,
    steps: int = 10,
    warmup: int = 3,
    budget_s: float | None = None,
    capture: int = 0,
    *,
    lr: float = 0.01,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, Any], dict[str, list[Tensor]]]:
    """Measure the compute-only step of ``work`` on this rank, aggregated over ranks.

    Call it on every rank of an initialised process group at once (or in a single
    process without one). Ranks do not communicate during a step; between steps they
    agree on whether to stop, which also keeps their steps side by side. The model is
    copied, so ``work.model`` is left untouched. Threads are whatever the caller set
    (``torch.set_num_threads``); the result reports them.

    Args:
        work: the workload; its model's device (CPU or CUDA) is where the probe runs.
        steps: hooked steps and as many clean ones, interleaved; more steps give steadier
            medians (CPU speed here drifts by up to 1.5x for seconds at a time).
        warmup: untimed clean steps first (allocator, momentum buffers, caches).
        budget_s: wall-clock seconds after which measuring stops, at the end of a pair
            of steps but never before 3 pairs; the result then has ``truncated: true``.
        capture: keep the gradients of the last ``capture`` clean steps (cloned, on CPU)
            for the codec probe.
        lr: SGD learning rate (momentum 0.9), applied to the copy of the model.
        group: the process group to aggregate over (default: the world, if initialised).

    Returns:
        ``(result, grads)``. ``result`` is JSON-friendly, times in seconds: per-step lists
        ``step_s``, ``forward_s``, ``backward_s``, ``optimizer_s`` (clean steps) and
        ``hooked_step_s``, ``hooked_backward_s``, each the slowest rank's value of the
        step; ``modules`` (every leaf module: ``name``, ``type``, ``forward_s``,
        ``backward_s``) and ``params`` (``name``, ``shape``, ``numel``, ``dtype``,
        ``ready_s`` from the start of backward, ``ready_order``), each value the median
        over steps on a rank, then over ranks. ``grads`` maps each parameter name to its
        captured gradients, oldest first (empty if ``capture`` is 0).

    Raises:
        ProfileError: bad arguments, or ranks hold different models.
    """
    _check_arguments(steps, warmup, capture, budget_s)
    started = time.monotonic()
    distributed = _distributed()
    subject = _Subject.of(work, lr)
    if distributed:
        _check_same_structure([n for n, _ in subject.leaves] + [n for n, _ in subject.params], group)
    done = _run_steps(subject, steps, warmup, budget_s, capture, started, distributed, group)
    series = _step_series(done, distributed, group)
    fwd, bwd, ready, coverage = _per_layer(done, len(subject.leaves), len(subject.params),
                                           distributed, group)
    ready_list = [_number(x) for x in ready.tolist()]
    order = _ready_order(ready_list)
    time_backward = subject.time_backward
    result: dict[str, Any] = {
        "steps": len(done.clean),
        "warmup": warmup,
        "device": subject.device.type,
        "threads": torch.get_num_threads(),
        "world_size": dist.get_world_size(group) if distributed else 1,
        **{key: series[row].tolist() for row, key in enumerate(_STEP_KEYS)},
        "modules": [
            {"name": name, "type": type(module).__name__, "forward_s": _number(f),
             "backward_s": _number(b) if time_backward else None}
            for (name, module), f, b in zip(subject.leaves, fwd.tolist(), bwd.tolist())
        ],
        "params": [
            {"name": name, "shape": list(p.shape), "numel": p.numel(),
             "dtype": str(p.dtype).removeprefix("torch."), "ready_s": ready_list[j],
             "ready_order": order[j]}
            for j, (name, p) in enumerate(subject.params)
        ],
        "backward_coverage": {
            # median over steps (and ranks) of breakdown / backward wall, same step
            "modules": _number(coverage[0].item()) if time_backward else None,
            "ready": _number(coverage[1].item()),
        },
        "backward_timing": "autograd-nodes" if time_backward else "none",
        "backward_hooks_skipped": [] if time_backward else [n for n, _ in subject.leaves],
        "truncated": done.truncated,
    }
    return result, _gradients(done.captured)


def backward_sum_vs_wall(
    result: dict[str, Any], source: Literal["modules", "ready"] = "modules"
) -> tuple[float, float]:
    """Compare the per-layer backward breakdown with the measured backward wall time.

    Args:
        result: what :func:`probe_compute` returned.
        source: ``"modules"`` sums the leaf modules' backward times (functional ops in
            parents and the loss are missing from it); ``"ready"`` sums the gaps between
            consecutive gradient-ready times, i.e. the last gradient's ready time, which
            covers everything up to it.

    Returns:
        ``(breakdown_s, wall_s)``; ``wall_s`` is the median clean backward time.
    """
    wall = float(torch.tensor(result["backward_s"], dtype=torch.float64).quantile(0.5))
    if source == "modules":
        total = sum(m["backward_s"] or 0.0 for m in result["modules"])
    elif source == "ready":
        total = max((p["ready_s"] for p in result["params"] if p["ready_s"] is not None),
                    default=0.0)
    else:
        raise ProfileError(f"source must be 'modules' or 'ready', got {source!r}")
    return float(total), wall
