"""Measure training-step times of several communication set-ups in one job, interleaved.

CPU speed here drifts by up to 1.5x for seconds at a time, so set-ups compared against
each other run in alternating blocks (A B A B ...) inside the same process group, and
results are medians over the blocks. Each set-up trains its own copy of the model from
the same initial weights. A step is timed from before ``zero_grad`` to after the
optimizer step, on every rank; the step time is the slowest rank's.

This module's :func:`rank_measure` runs on each rank (through :func:`autotune.launch`
or torchrun) and returns JSON-friendly results; :func:`run_bench` launches it, on the
set-ups :func:`bench_setups` lists for ``autotune bench``.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from autotune.errors import AutotuneError
from autotune.launch import Placement, launch, set_rank_threads
from autotune.policies import Policy
from autotune.policies.policy import ddp_bucket_cap
from autotune.presets import PRESETS, preset
from autotune.runtime import wrap as runtime_wrap
from autotune.trials import ratio_interval
from autotune.workloads import resolve_workload

__all__ = ["Setup", "bench_setups", "one_bucket_cap_mb", "rank_measure", "round_order", "run_bench", "summarize"]

# What a set-up is: plain DDP, a policy applied by autotune's hook, one of PyTorch's own
# communication hooks, the compute-only floor.
KINDS = ("ddp", "policy", "hook", "floor")
# a set-up whose fastest step is this many times the fastest set-up's slowest, and at
# least CLEAR_GAP_S longer, leaves after its first round (this machine's CPU speed
# drifts by up to 1.5x; a single millisecond step can spike 2x, and keeping a set-up of
# such steps costs nothing)
CLEARLY_SLOWER = 2.0
CLEAR_GAP_S = 0.05
# PyTorch's PowerSGD hook averages by plain allreduce before this step (its minimum with
# error feedback, which it checks); measuring advances its counter to it after the first
# step instead, once DDP's buckets are final (they are rebuilt at the second step's
# forward, before any compression): the hook then compresses from the second step, as
# from the third in a user's run, and at 100 Mbit one plain step less saves 3.4 s per
# stock PowerSGD set-up
STOCK_POWERSGD_FROM = 2
# A step this long is network- or compute-bound and stable to about 1% here (the CPU's
# drift is a fraction of it): with ``steady_s`` a set-up whose step takes it needs no
# further warm-up once past its first step, and two timed steps (at 100 Mbit plain DDP's
# step is 3 s: calibration's seven steps per set-up cost 20 s of it)
STEADY_STEP_S = 1.0
STEADY_STEPS = 2  # timed steps of such a set-up, its last warm-up step among them
# Futility: once the contenders have this many timed steps each, the measurement ends
# when none of them is expected to separate from the fastest in the budget and rounds
# left (:func:`_futile`). At 100 Mbit four tuned cnn candidates within 1% of each other
# spent the whole 60 s budget (25 rounds) at intervals of 0.95-1.07 against the fastest.
# From 10 steps, the grid's unshaped cells ended after 5-9 rounds, on intervals of 10
# steps that are themselves noisy (cnn: 0.95-1.13 among DDP at three bucket sizes, bf16
# and three tuned candidates).
FUTILE_MIN_STEPS = 16
# Why an adaptive measurement ended (``stopped`` in rank_measure's result).
STOPS = ("rounds", "separated", "budget", "futile")
# PyTorch's hooks: the presets' and ``allreduce`` (default_hooks.allreduce_hook: DDP's own
# averaging as a Python hook, what any hook costs beside DDP's native path)
HOOKS = (*dict.fromkeys(p.hook for p in PRESETS if p.hook is not None), "allreduce")
# What applies a policy to a model: autotune.runtime.wrap, or autotune.online.wrap
Wrap = Callable[..., torch.nn.Module]


@dataclass(frozen=True)
class Setup:
    """One communication set-up to measure."""

    name: str  # label in tables and JSON (e.g. "ddp", "policy", "powersgd1")
    kind: str = "policy"  # one of KINDS
    policy: dict[str, Any] | None = None  # policy JSON object, for kind "policy"
    bucket_cap_mb: float | None = None  # for "ddp" and "hook"; None: DDP's default buckets
    hook: str | None = None  # for kind "hook": one of HOOKS
    rank: int = 1  # PowerSGD's matrix approximation rank, for hook "powersgd"
    # For kind "policy": wrap(online=True, **online); measured by autotune.online.rank_measure
    online: dict[str, Any] | None = None
    # For kind "policy": wrap's native (None: its default, native for a plain policy)
    native: bool | None = None
    # DDP's gradient_as_bucket_view (None: the default of what builds the set-up: DDP's
    # False for "ddp" and "hook", wrap's True for "policy")
    bucket_view: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AutotuneError(f"unknown set-up kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "policy" and self.policy is None:
            raise AutotuneError(f"set-up {self.name!r} of kind 'policy' needs a policy")
        if self.kind == "hook" and self.hook not in HOOKS:
            raise AutotuneError(f"set-up {self.name!r}: hook must be one of {HOOKS}, got {self.hook!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Setup:
        return cls(**data)


@dataclass
class _Runner:
    setup: Setup
    model: torch.nn.Module  # what forward is called on (DDP or the bare module)
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    times: list[float] = field(default_factory=list)
    note: str = ""
    timer: _HookTimer | None = None  # stock hooks: their time per bucket
    powersgd: Any = None  # PyTorch's PowerSGDState, for the stock PowerSGD hook

    @property
    def steady_from(self) -> int:
        """The first step that runs as the set-up's later ones do: after DDP's bucket
        rebuild (step 0), and for PyTorch's PowerSGD hook after its first compressing
        step (step 1, :meth:`first_step_done`), which allocates its error-feedback and
        low-rank tensors: at 100 Mbit on cnn that step took 0.6 s beside 0.2 s."""
        return 2 if self.powersgd is not None else 1

    def first_step_done(self) -> None:
        """After the first step: PyTorch's PowerSGD hook compresses from the next one
        (see :data:`STOCK_POWERSGD_FROM`)."""
        if self.powersgd is not None:
            self.powersgd.iter = max(self.powersgd.iter, STOCK_POWERSGD_FROM)


class _HookTimer:
    """Wraps a stock DDP hook to time it per bucket: ``in_hook`` (its own work before it
    returns: encoding, issuing the first collective) and ``after_hook`` (from then until
    its future completes: collectives, later stages, decoding). PyTorch's hooks expose
    no finer phases; autotune's own breakdown (``comm_state``) has them."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook
        self.totals: dict[str, float] = {"in_hook": 0.0, "after_hook": 0.0}
        self.buckets = 0
        self.last: dict[int, dict[str, float]] = {}  # by bucket index, latest step

    def time_bucket(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        fut = self.hook(state, bucket)
        inside = time.perf_counter() - start
        index = bucket.index()

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            after = time.perf_counter() - start - inside
            self.totals["in_hook"] += inside
            self.totals["after_hook"] += after
            self.buckets += 1
            self.last[index] = {"in_hook": inside, "after_hook": after}
            return f.value()

        return fut.then(done)

    def as_hook(self) -> Callable[..., Any]:
        """A plain function for ``register_comm_hook`` (DDP wants a named function whose
        annotations, if any, are the real classes, not postponed strings)."""

        def timed_hook(state, bucket):  # type: ignore[no-untyped-def]
            return self.time_bucket(state, bucket)

        return timed_hook


def one_bucket_cap_mb(module: torch.nn.Module) -> float:
    """A ``bucket_cap_mb`` that puts all of ``module``'s parameters in one DDP bucket.

    PyTorch's PowerSGD hook issues collectives from future callbacks, which deadlocks or
    aborts on gloo as soon as DDP has two buckets (DDP's default splits even a 3 MiB
    model in two); on gloo it runs with this cap."""
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20 + 1.0


def _stock_hook(
    setup: Setup, module: torch.nn.Module
) -> tuple[DistributedDataParallel, str, _HookTimer, Any]:
    """DDP with one of PyTorch's own hooks, run the way it can run here; and the
    PowerSGD hook's state (None for the others)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    note, cap = "", None
    if setup.hook == "powersgd" and dist.get_backend() == "gloo":
        cap = one_bucket_cap_mb(module)
        note = ("stock powerSGD_hook run with one bucket: on gloo it deadlocks or aborts with "
                "two or more")
    model = _ddp(setup, module, cap)
    if setup.hook == "allreduce":
        state, hook = None, default_hooks.allreduce_hook
    elif setup.hook == "fp16":
        state, hook = None, default_hooks.fp16_compress_hook
    elif setup.hook == "bf16":
        if dist.get_backend() != "nccl":
            raise AutotuneError(
                f"set-up {setup.name!r}: PyTorch's bf16_compress_hook needs NCCL (CUDA 11+, "
                f"NCCL 2.10+); this job runs on {dist.get_backend()}")
        state, hook = None, default_hooks.bf16_compress_hook
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=setup.rank,
            start_powerSGD_iter=STOCK_POWERSGD_FROM,
            min_compression_rate=2, use_error_feedback=True, warm_start=True,
        )
        hook = powerSGD_hook.powerSGD_hook
    timer = _HookTimer(hook)
    model.register_comm_hook(state, timer.as_hook())
    return model, note, timer, state


def _views(setup: Setup) -> dict[str, bool]:
    """DDP's ``gradient_as_bucket_view`` where the set-up sets it."""
    return {} if setup.bucket_view is None else {"gradient_as_bucket_view": setup.bucket_view}


def _ddp(setup: Setup, module: torch.nn.Module, bucket_cap_mb: float | None = None) -> DistributedDataParallel:
    """The plain ``DistributedDataParallel`` of a "ddp" or "hook" set-up: its bucket cap
    (``bucket_cap_mb`` where the hook needs another), its bucket views, and no initial
    broadcast (:func:`_sync_parameters` made the copies equal). At DDP's default cap it
    is ``DistributedDataParallel(model)``'s own buckets, first bucket of 1 MiB included,
    as a user builds it and as ``wrap`` builds ours (``policies.ddp_bucket_cap``): DDP
    given ``bucket_cap_mb=25`` explicitly drops that first bucket, and a 3 MB model then
    runs one bucket where ours runs two."""
    cap = setup.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb
    cap = None if cap is None else ddp_bucket_cap(cap)
    caps = {} if cap is None else {"bucket_cap_mb": cap}
    return DistributedDataParallel(module, init_sync=False, **caps, **_views(setup))


def _build(setup: Setup, base: torch.nn.Module, lr: float, wrap: Wrap | None) -> _Runner:
    module = copy.deepcopy(base)
    note = ""
    timer = None
    state = None
    if setup.kind == "floor":
        model: torch.nn.Module = module  # no communication at all: the compute floor
    elif setup.kind == "ddp":
        model = _ddp(setup, module)
    elif setup.kind == "hook":
        model, note, timer, state = _stock_hook(setup, module)
    else:
        policy = Policy.from_dict(setup.policy, source=f"set-up {setup.name!r}")
        # compressing from step 0: the untimed warm-up steps then cost what the set-up's
        # steps cost, not a plain DDP step each (the timed steps are the same)
        options: dict[str, Any] = ({"online": True, **setup.online} if setup.online
                                   else {"compress_from_step": 0})
        options["init_sync"] = False
        if setup.native is not None:
            options["native"] = setup.native
        options.update(_views(setup))
        model = (wrap or runtime_wrap)(module, policy, **options)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    return _Runner(setup, model, module, optimizer, note=note, timer=timer, powersgd=state)


def _sync_parameters(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, once: each set-up's DDP is then
    built from the same copy without its own initial broadcast (``init_sync=False``),
    which on a slow link costs seconds per set-up (a 37 MB model at 100 Mbit: 3 s).
    When every rank already holds the same values (a seeded model), a fingerprint of
    them says so and nothing more is sent."""
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors:
        return
    with torch.no_grad():
        mine = _fingerprint(tensors)
        agreed = mine.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        same = torch.tensor([int(torch.equal(mine, agreed))], dtype=torch.int32, device=mine.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if same.item():
            return
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def _fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor: the sum, the sum of squares and the sum of every seventh element,
    in float64 (ranks whose values differ anywhere differ here, short of a constructed
    coincidence)."""
    rows = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(torch.float64)
        rows.append(torch.stack([flat.sum(), flat.square().sum(), flat[::7].sum()]))
    return torch.stack(rows).reshape(-1)


def _run_step(runner: _Runner, make_batch: Callable[[int], Any], loss_fn: Callable[..., Any]) -> float:
    inputs, targets = make_batch(runner.step)
    start = time.perf_counter()
    runner.optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(runner.model(inputs), targets)
    loss.backward()
    runner.optimizer.step()
    elapsed = time.perf_counter() - start
    runner.step += 1
    if runner.step == 1:
        runner.first_step_done()
    return elapsed


def round_order(items: list[Any], done: int) -> list[Any]:
    """The order in which round ``done`` (0-based) runs its set-ups' blocks: as given in
    the first round, a permutation seeded by the round afterwards, the same on every
    rank. What a block inherits from the one before it (caches, the allocator, a
    straggling thread; measured on the unshaped transformer: a fixed order put our
    ``none`` 1.05-1.08x a stock set-up it ties with in shuffled rounds) then falls on
    every set-up alike instead of always on the same one."""
    if not done:
        return list(items)
    order = list(items)
    random.Random(done).shuffle(order)
    return order


def rank_measure(
    workload: str,
    setups: Sequence[dict[str, Any]],
    rounds: int = 5,
    block: int = 5,
    warmup: int = 3,
    lr: float = 0.01,
    threads: int | None = None,
    min_rounds: int | None = None,
    budget_s: float | None = None,
    separate: Sequence[str] | None = None,
    wrap: Wrap | None = None,
    predicted: dict[str, float] | None = None,
    steady_s: float | None = None,
) -> dict[str, Any]:
    """Run every set-up for ``rounds`` interleaved blocks of ``block`` steps, each round
    in its own order (:func:`round_order`).

    Adaptive when ``separate`` names set-ups (those that may win): after ``min_rounds``
    rounds, a set-up that measured slower than the fastest of them beyond the bootstrap
    interval (:func:`autotune.trials.ratio_interval`), and any set-up not named, stops
    being measured; before that, only a set-up :data:`CLEARLY_SLOWER` than the fastest
    named one in every step does. The measurement ends when one named set-up is left,
    after ``rounds`` rounds, once ``budget_s`` seconds have passed after the first
    round (which every set-up runs, however slow: the budget is for telling the close
    ones apart), or when more rounds are futile: no contender left is expected to
    separate from the fastest in the rounds and budget left (:func:`_futile`). Rank 0
    decides from the slowest rank's times and broadcasts, so every rank agrees.

    Args:
        workload: a workload spec (built-in name, ``file.py:fn`` or ``module:fn``).
        setups: :class:`Setup` fields as dicts (JSON travels to the ranks).
        rounds: blocks per set-up (at most, when adaptive); more rounds average out
            CPU-speed drift.
        block: consecutive steps per block.
        warmup: untimed steps per set-up before the first block (DDP rebuilds its
            buckets after step 1, and compression starts at step 2).
        lr: SGD learning rate.
        threads: torch intra-op threads per rank (default: cores / local ranks).
        min_rounds: rounds every set-up runs before any is dropped (default: ``rounds``).
        budget_s: seconds of measurement after the first round after which it stops
            (None: no limit).
        separate: the set-ups that may win (None: measure all for ``rounds`` rounds).
        wrap: what applies a set-up's policy (None: :func:`autotune.runtime.wrap`). Set-ups
            that revise online need one that takes ``online=True``: launch
            :func:`autotune.online.rank_measure`, which passes :func:`autotune.online.wrap`.
        predicted: the cost model's step time per set-up name, if known: with
            ``separate``, a set-up both predicted and measured in its first step
            :data:`CLEARLY_SLOWER` than the fastest named one leaves after that step
            (:func:`_first_step_slower`).
        steady_s: without ``separate``: a set-up whose step takes at least this long
            (e.g. :data:`STEADY_STEP_S`) after its first is steady: that step ends its
            warm-up and counts as timed, and its measurement ends once its last
            :data:`STEADY_STEPS` timed steps all took that long (None: never).

    Returns:
        On every rank: per set-up, the slowest rank's time of each measured step, and
        the bytes each compressor handed to collectives in the last step; ``rounds``
        (rounds run) and ``measure_s`` (seconds spent measuring); with ``separate``,
        ``stopped``: why the measurement ended (one of :data:`STOPS`; ``"separated"``
        when one named set-up, or one set-up in all, was left).
    """
    if steady_s is not None and separate is not None:
        raise AutotuneError("rank_measure: steady_s ends a set-up's measurement on its own, "
                            "which would take it out of separate's comparison; give one of them")
    parsed = [Setup.from_dict(s) for s in setups]
    online = [s.name for s in parsed if s.online]
    if online and wrap is None:
        raise AutotuneError(f"set-up(s) {', '.join(online)} revise their policy online: measure "
                            "them with autotune.online.rank_measure, which attaches the controller")
    set_rank_threads(threads)
    work = resolve_workload(workload)
    _sync_parameters(work.model)
    runners = [_build(s, work.model, lr, wrap) for s in parsed]
    slowest: dict[int, list[float]] = {id(r): [] for r in runners}  # the slowest rank's times
    active, steady = _warm_up(runners, warmup, work.make_batch, work.loss_fn, separate, slowest,
                              predicted or {}, steady_s)
    before = {id(r): _totals(r) for r in runners}
    floor_rounds = rounds if min_rounds is None else max(1, min(min_rounds, rounds))
    started = time.perf_counter()
    budget_from: float | None = None  # the budget counts once every set-up was measured
    done = 0
    stopped = "rounds"
    while done < rounds and active:
        # a steady set-up's (steady_s) last warm-up step counted: one less this round
        counts = [max(1, STEADY_STEPS - 1) if done == 0 and id(r) in steady else block for r in active]
        for runner, count in round_order(list(zip(active, counts)), done):
            dist.barrier()  # every set-up's block starts together on all ranks
            for _ in range(count):
                runner.times.append(_run_step(runner, work.make_batch, work.loss_fn))
        # this round's steps, as the slowest rank saw them (one small allreduce)
        fresh = torch.tensor([t for r, n in zip(active, counts) for t in r.times[-n:]], dtype=torch.float64)
        dist.all_reduce(fresh, op=dist.ReduceOp.MAX)
        at = 0
        for runner, count in zip(active, counts):
            slowest[id(runner)].extend(fresh[at : at + count].tolist())
            at += count
        done += 1
        budget_from = budget_from or time.perf_counter()
        if steady_s is not None:  # the same times on every rank: every rank agrees
            active = [r for r in active if len(slowest[id(r)]) < STEADY_STEPS
                      or min(slowest[id(r)][-STEADY_STEPS:]) < steady_s]
        if separate is None:
            continue
        # one flag per active set-up (measured on), and why the measurement ends, if it does
        keep = torch.zeros(len(active) + 1, dtype=torch.uint8)
        if dist.get_rank() == 0:
            now = {r.setup.name: slowest[id(r)] for r in active}
            stop = None
            if done < floor_rounds:  # before the first test, only the clearly slower leave
                names = set(now) - _clearly_slower(now, separate)
            elif budget_s is not None and time.perf_counter() - budget_from >= budget_s:
                names, stop = set(), "budget"
            else:
                names = _contenders(now, separate)
                left = budget_s - (time.perf_counter() - budget_from) if budget_s is not None else None
                if len(names) > 1 and _futile({n: now[n] for n in names}, block,
                                              _rounds_left(now, names, block, rounds - done, left)):
                    names, stop = set(), "futile"
            keep = torch.tensor([int(r.setup.name in names) for r in active]
                                + [STOPS.index(stop) if stop else 0], dtype=torch.uint8)
        dist.broadcast(keep, src=0)
        flags = keep.tolist()
        active = [r for r, k in zip(active, flags) if k]
        if flags[-1]:
            stopped = STOPS[flags[-1]]
            break
        if len(active) <= 1 or (done >= floor_rounds and
                                len([r for r in active if r.setup.name in separate]) <= 1):
            stopped = "separated"
            break
    measure_s = time.perf_counter() - started
    measured = {id(r) for r in runners if r.times}
    results = []
    for runner in runners:
        times = slowest[id(runner)]
        entry: dict[str, Any] = {**asdict(runner.setup), "step_s": times,
                                 "step_s_median": statistics.median(times)}
        if runner.note:
            entry["note"] = runner.note
        if id(runner) not in measured:
            entry["warmup_only"] = True  # clearly slower in warm-up: its times are those
            if runner.step == 1:  # left after its first step: one-time costs are in its time
                entry["first_step_only"] = True
        breakdown = _breakdown(runner, before[id(runner)])
        if breakdown is not None:
            entry["breakdown"] = breakdown
        state = getattr(runner.model, "comm_state", None)
        native = state is not None and state.native  # a plain policy as DDP's own allreduce
        if state is not None:
            entry["policy_id"] = state.policy.id
        if state is not None and not native:
            by_comp: dict[str, int] = {}
            for rec in state.last_step_records():
                for label, nbytes in rec.bytes_by_compressor.items():
                    by_comp[label] = by_comp.get(label, 0) + nbytes
            entry["bytes_by_compressor"] = by_comp
        elif native or runner.setup.kind == "ddp" or runner.setup.hook == "fp16":
            # DDP and the fp16 hook send every gradient element (the hook as 2 bytes)
            nbytes = sum(p.numel() * p.element_size() for p in runner.module.parameters()
                         if p.requires_grad)
            entry["bytes_by_compressor"] = (
                {"fp16": nbytes // 2} if runner.setup.hook == "fp16" else {"none": nbytes}
            )
        results.append(entry)
    out = {"world_size": dist.get_world_size(), "workload": work.name, "results": results,
           "rounds": done, "measure_s": measure_s}
    if separate is not None:
        out["stopped"] = stopped
    return out


def bench_setups(presets: Sequence[str], policy: Policy | None = None) -> list[dict[str, Any]]:
    """The set-ups of a bench: the presets named (by :func:`autotune.presets.preset`
    name), as users run them (DDP's defaults, PyTorch's own hooks), then ``policy``
    (named ``"policy"``) if given, then the compute-only floor (``"floor"``)."""
    setups = [preset(name).setup(name) for name in presets]
    if policy is not None:
        setups.append({"name": "policy", "kind": "policy", "policy": policy.to_dict()})
    setups.append({"name": "floor", "kind": "floor"})
    return setups


def run_bench(
    workload: str,
    placement: Placement,
    setups: Sequence[dict[str, Any]],
    *,
    rounds: int,
    block: int = 3,
    warmup: int = 3,
    timeout: float = 7200.0,
) -> dict[str, Any]:
    """Start the ranks ``placement`` describes and measure ``setups`` on them with
    :func:`rank_measure` (every set-up for ``rounds`` interleaved blocks of ``block``
    steps after ``warmup`` untimed ones); rank 0's result. ``timeout``: seconds the
    job may take."""
    return launch("autotune.measure:rank_measure", placement=placement, timeout=timeout,
                  kwargs={"workload": workload, "setups": list(setups), "rounds": rounds,
                          "block": block, "warmup": warmup})[0]


def _warm_up(runners: Sequence[_Runner], steps: int, make_batch: Callable[[int], Any],
             loss_fn: Callable[..., Any], separate: Sequence[str] | None,
             slowest: dict[int, list[float]], predicted: dict[str, float],
             steady_s: float | None) -> tuple[list[_Runner], set[int]]:
    """Run ``steps`` untimed steps of every set-up, round-robin; returns those to
    measure, and the ids of those found steady.

    With ``separate``, a set-up :func:`_clearly_slower` than the fastest named one in
    two steady warm-up steps (from :attr:`_Runner.steady_from`: the first carries
    one-time costs, DDP's bucket rebuild follows it, and PyTorch's PowerSGD hook
    allocates its state in its first compressing step) leaves at once, those steps (the
    slowest rank's) kept as its times in ``slowest``: on a slow link plain DDP's three
    warm-up steps and first block cost more than the whole separation budget, and its
    second step already shows it 16 times slower (one step is no evidence: a single one
    of plain DDP's on the unshaped link once took 2.5 times its steady time). One the
    model predicted that much slower too leaves after its first step
    (:func:`_first_step_slower`), that step's time kept as its time. With ``steady_s``, a set-up whose
    second or later step took that long is steady: warm, that step's time kept in
    ``slowest`` as its first timed one."""
    warming = list(runners)
    ready: list[_Runner] = []  # warm before the last warm-up step (steady_s)
    for k in range(steps):
        step_s = [_run_step(runner, make_batch, loss_fn) for runner in warming]
        if (separate is None and steady_s is None) or not warming:
            continue
        latest = torch.tensor(step_s, dtype=torch.float64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)  # the same times on every rank
        now = dict(zip((r.setup.name for r in warming), latest.tolist()))
        for runner, t in zip(warming, latest.tolist()):
            if k >= runner.steady_from:
                slowest[id(runner)].append(t)
        if steady_s is not None:
            steady = [k >= r.steady_from and t >= steady_s for r, t in zip(warming, latest.tolist())]
            ready += [r for r, s in zip(warming, steady) if s]
            warming = [r for r, s in zip(warming, steady) if not s]
        if separate is None or len(warming) <= 1:
            continue
        keep = torch.ones(len(warming), dtype=torch.uint8)
        if dist.get_rank() == 0:
            if k == 0:  # a stock PowerSGD hook's first step is a plain allreduce: not its own
                own = {r.setup.name: now[r.setup.name] for r in warming if r.steady_from == 1}
                slower = _first_step_slower(own, predicted, separate)
            else:  # two steady steps at least: one spike (2.5x, seen here) is no evidence
                steady = {r.setup.name: slowest[id(r)] for r in warming if slowest[id(r)]}
                slower = {n for n in _clearly_slower(steady, separate) if len(steady[n]) >= 2}
            keep = torch.tensor([int(r.setup.name not in slower) for r in warming], dtype=torch.uint8)
        dist.broadcast(keep, src=0)
        for runner, k_ in zip(warming, keep.tolist()):
            if not k_ and not slowest[id(runner)]:  # judged on its first step: that is its time
                slowest[id(runner)].append(now[runner.setup.name])
        warming = [r for r, k_ in zip(warming, keep.tolist()) if k_]
    for runner in warming:  # measured from now on: their warm-up times are not kept
        slowest[id(runner)].clear()
    for runner in ready:  # steady: the step that showed it is its first timed one
        del slowest[id(runner)][:-1]
    order = {id(r): i for i, r in enumerate(runners)}
    return sorted(ready + warming, key=lambda r: order[id(r)]), {id(r) for r in ready}


def _first_step_slower(first: dict[str, float], predicted: dict[str, float],
                       separate: Sequence[str]) -> set[str]:
    """The set-ups whose first step took over :data:`CLEARLY_SLOWER` times the fastest
    first step among ``separate`` (and :data:`CLEAR_GAP_S` more), and which the cost
    model predicted over :data:`CLEARLY_SLOWER` times the fastest prediction among
    them too. A first step carries one-time costs (allocation, DDP's bucket rebuild),
    so its time alone proves nothing; with the prediction agreeing it does: at 100 Mbit
    plain DDP's first step is 3.5 s beside PowerSGD's 0.4 s, predicted 3.2 s beside
    0.2 s, and its second step cost three more seconds for nothing."""
    named = [n for n in separate if n in first]
    known = [predicted[n] for n in named if n in predicted]
    if not named or not known:
        return set()
    fastest, best_predicted = min(first[n] for n in named), min(known)
    return {n for n, t in first.items()
            if n in predicted and predicted[n] > CLEARLY_SLOWER * best_predicted
            and t > CLEARLY_SLOWER * fastest and t - fastest >= CLEAR_GAP_S}


def _clearly_slower(times: dict[str, list[float]], separate: Sequence[str]) -> set[str]:
    """The set-ups whose fastest step took over :data:`CLEARLY_SLOWER` times the slowest
    step of the fastest set-up of ``separate``, and :data:`CLEAR_GAP_S` more: no
    CPU-speed drift explains that, so they need not be measured again (at 100 Mbit plain DDP's step can be 30 times a
    compressed one's, and three rounds of it would spend the whole budget)."""
    best = _fastest(times, separate)
    if best is None:
        return set()
    slowest = max(times[best])
    return {n for n, t in times.items()
            if min(t) > CLEARLY_SLOWER * slowest and min(t) - slowest >= CLEAR_GAP_S}


def _contenders(times: dict[str, list[float]], separate: Sequence[str]) -> set[str]:
    """The set-ups of ``separate`` not yet shown slower than the fastest of them."""
    best = _fastest(times, separate)
    if best is None:
        return set()
    return {n for n, t in times.items()
            if n in separate and (n == best or ratio_interval(t, times[best])[0] <= 1.0)}


def _rounds_left(times: dict[str, list[float]], names: set[str], block: int, rounds: int,
                 budget_left_s: float | None) -> int:
    """Rounds the measurement can still run: at most ``rounds``, and as many as fit in
    ``budget_left_s`` (None: no limit) at ``block`` median steps of each of ``names``."""
    if budget_left_s is None:
        return max(0, rounds)
    round_s = sum(block * statistics.median(times[n]) for n in names)
    return max(0, min(rounds, int(budget_left_s / max(round_s, 1e-9))))


def _futile(times: dict[str, list[float]], block: int, rounds_left: int) -> bool:
    """Whether no rival of the fastest of ``times`` (the contenders left) is expected to
    separate from it in ``rounds_left`` more rounds of ``block`` steps: each rival's
    lower interval bound over the fastest, moved toward its ratio of medians as the
    interval narrows (with the square root of the steps), stays at or below 1. Such a
    measurement can only end tied, as the budget would end it, and a tie goes to the
    simpler set-up (:func:`autotune.trials.decide`), so stopping never emits a set-up
    slower than a simpler one measured beside it. Never before every contender has
    :data:`FUTILE_MIN_STEPS` timed steps: a few steps' interval is itself noise."""
    steps = min(len(t) for t in times.values())
    if len(times) < 2 or steps < FUTILE_MIN_STEPS:
        return False
    best = min(times, key=lambda n: statistics.median(times[n]))
    shrink = (steps / (steps + rounds_left * block)) ** 0.5
    for name, t in times.items():
        if name == best:
            continue
        ratio = statistics.median(t) / statistics.median(times[best])
        low = ratio_interval(t, times[best])[0]
        if ratio - (ratio - low) * shrink > 1.0:
            return False
    return True


def _fastest(times: dict[str, list[float]], separate: Sequence[str]) -> str | None:
    """The set-up of ``separate`` with the lowest median (None: none measured)."""
    named = [n for n in times if n in separate]
    return min(named, key=lambda n: statistics.median(times[n])) if named else None


def _totals(runner: _Runner) -> tuple[dict[str, float], int] | None:
    """Seconds by phase over all buckets so far, and the bucket count; None if the
    set-up has no timed hook (plain DDP, a plain policy run natively, the floor)."""
    state = getattr(runner.model, "comm_state", None)
    if state is not None and not state.native:
        return dict(state.breakdown_totals), state.breakdown_buckets
    if runner.timer is not None:
        return dict(runner.timer.totals), runner.timer.buckets
    return None


def _breakdown(runner: _Runner, before: tuple[dict[str, float], int] | None) -> dict[str, Any] | None:
    """This rank's mean seconds per measured step by phase, and the last step's buckets."""
    after = _totals(runner)
    if after is None or before is None:
        return None
    steps = max(1, len(runner.times))
    per_step = {k: (v - before[0].get(k, 0.0)) / steps for k, v in after[0].items()}
    state = getattr(runner.model, "comm_state", None)
    if state is not None:
        buckets = [{"index": r.index, "numel": r.numel, "path": "channel" if r.compressed else "direct",
                    "seconds": r.seconds, "breakdown": r.breakdown,
                    "collectives": [list(c) for c in r.collectives]}
                   for r in state.last_step_records()]
    else:  # a stock hook (_totals returned its timer's)
        last = runner.timer.last if runner.timer is not None else {}
        buckets = [{"index": i, "breakdown": b} for i, b in sorted(last.items())]
    return {"per_step_s": per_step, "buckets_per_step": (after[1] - before[1]) / steps,
            "last_step_buckets": buckets}


def summarize(result: dict[str, Any], baseline: str | None = None) -> list[dict[str, Any]]:
    """Median step time per set-up, its ratio to ``baseline``, and its bytes per step."""
    rows = []
    medians = {r["name"]: statistics.median(r["step_s"]) for r in result["results"]}
    for r in result["results"]:
        row = {
            "name": r["name"],
            "step_s_median": medians[r["name"]],
            "step_s": r["step_s"],
            "bytes_per_step": sum(r.get("bytes_by_compressor", {}).values()),
            "bytes_by_compressor": r.get("bytes_by_compressor", {}),
        }
        if baseline is not None and baseline in medians:
            row["ratio"] = medians[r["name"]] / medians[baseline]
        rows.append(row)
    return rows
