"""Online revision: notice when the cluster changed, re-tune, switch every rank at once.

The controller lives beside the hook (``autotune.wrap(..., online=True)``) and acts only
between steps, at the start of a forward pass: never inside a backward pass.

* **Monitoring** (rank 0): every step's wall time, and the hook's own records of its
  collectives, from which an online fit of the link follows: the ratio of measured to
  predicted collective time over the check window (large transfers only) rescales the
  profile's link rate. When the current policy moves too little data to tell (PowerSGD
  on a fast link sends kilobytes), every rank joins a small probe allreduce at a check,
  no more often than keeps the probes within :data:`PROBE_SHARE` of the job's time.
* **Drift**: at each check (every ``check_every`` steps) two ratios are compared with
  their values when the current policy started (the step ratio's median over
  :data:`REF_WINDOWS` checks' windows, after the first ones settle): measured / predicted
  step time, and the fitted link rate. A deviation above ``threshold`` for ``patience`` consecutive checks
  is drift (hysteresis: noise does not flap the policy); a step that moved while the
  link held must also have moved for ``patience_s`` seconds (a CPU that runs slower for
  a second or two is not a change to re-tune for).
* **Revision**: rank 0 re-runs the search for the fitted link, warm-started from the
  current policy and the previous study's best, within ``budget_s``, in the background
  (a fork of rank 0 where that is safe, else a thread; training does not wait, and the
  reply is taken at a check), and keeps the result only if it is predicted to beat the
  current policy by ``min_gain``.
* **Switch**: at a check step, every rank joins a broadcast from rank 0 of a small
  header tensor and, when there is news, the new policy as JSON bytes in a uint8 tensor
  (no pickle). Every rank applies it at the announced step, between steps; error
  feedback follows the hook's documented *carry* rule (see
  :meth:`autotune.runtime.hook.AutotuneState.set_policy`).
* **Bucket size** is kept by plain online revision (the search runs with the cap
  pinned). ``wrap(model, "auto")`` changes it: its controller is given the model's
  :meth:`~autotune.runtime.AutotuneDDP.set_bucket_cap`, which rebuilds DDP's reducer
  at the announced step on every rank; once settled on a plain policy it runs it
  without the hook, as DDP's own allreduce (:meth:`Controller._go_native`).
* **Auto** (``wrap(model, "auto")``): the controller starts from plain DDP and
  explores first. Rank 0 times a few steps of DDP (the reference), instruments a few
  more (:class:`~autotune.online.live.LiveProfiler`: gradient-ready times, compute,
  copies of the live gradients); if DDP's step is then within ``HIDDEN_MARGIN`` of its
  compute floor it settles on DDP at once. Otherwise a search worker process starts on
  rank 0; on a CPU-bound job (exposed communication under :data:`LINK_BOUND` of the
  step) the steps beside its start are weighed first, and a search that slows them more
  than it could win is given up before anything else is spent. Then every rank joins a
  short network probe at one boundary (at most :data:`NETWORK_STEPS` DDP steps long); the
  worker (:mod:`autotune.online.worker`, at the lowest CPU priority,
  so training keeps its GIL and cores; on a link-bound job a fork of rank 0, which has
  everything loaded, and beside it a *stand-in* for plain DDP, a cast within the error
  budget that halves the bytes on the link, kept if it measures faster than the DDP
  start: :meth:`Controller._choose_stand_in`) probes the codecs on the copied gradients,
  builds a :class:`~autotune.probes.profile.Profile`, fits the cost model and runs the
  search; then the best candidates and the presets' equivalents are tried on live
  steps (:class:`~autotune.online.explore.Exploration`: A B A C ..., a few steps
  each), the measured best is switched to on every rank at once, saved, and drift
  watching begins; a drift re-runs the search and the trials. During exploration the
  control broadcast happens at every step.

Every decision is appended to a JSONL log; the final policy can be exported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

from autotune.errors import AutotuneError
from autotune.jsonio import check_writable
from autotune.models.cost_model import CostModel, calibration_pairs
from autotune.models.simulator import WhatIf
from autotune.online.config import OnlineConfig
from autotune.online.explore import Contender, Exploration
from autotune.online.live import LiveProfiler, live_environment
from autotune.online.search import (
    contender_from_dict,
    contender_to_dict,
    stand_in,
    trial_contenders,
)
from autotune.online.worker import ForkedSearch, SearchWorker, fork_safe
from autotune.policies import Policy
from autotune.probes.network import probe_network
from autotune.probes.profile import CalibrationRun, Profile
from autotune.search.defaults import DEFAULT_MAX_ERROR
from autotune.search.tuner import tune

if TYPE_CHECKING:
    from autotune.runtime.hook import AutotuneState, BucketRecord

__all__ = ["Controller"]

logger = logging.getLogger(__name__)

# Header of the control broadcast: [policy bytes, switch step, revision, action, steps to
# the next check, the action's argument (the network probe's budget in microseconds),
# 1 once the auto mode has settled]
_HEADER = 7
_PROBE, _NETWORK = 1, 2  # actions: a small probe allreduce; the auto mode's network probe
PROBE_BYTES = 512 * 1024  # above tbf's burst on an emulated link, cheap on a real one
LARGE_BYTES = 256 * 1024  # transfers smaller than this tell latency, not bandwidth
PROBE_SHARE = 0.02  # of the job's time, at most, spent in drift probes
# A window tells the link's rate only when its transfers were expected to take this
# long: below it, rank skew and scheduling noise on a busy host swamp the link.
MIN_SIGNAL_S = 0.01


# A step of an exploration slower than the DDP start's median by more than this counts
# as degraded (plain DDP's own noise here, CPU speed drifting, stays out of the count);
# a trial block of plain DDP itself never does: it is the job as it runs without us.
DEGRADED_MARGIN = 0.1
FIRST_TIMED_STEP = 2  # steps 0 and 1 run before and during DDP's bucket rebuild
CODEC_SHARE = 0.4  # of budget_s: the auto mode's codec probe; the search gets the rest
# the DDP start within this of its compute floor: communication is hidden, no search
HIDDEN_MARGIN = 0.05
NETWORK_STEPS = 20  # auto's network probe takes at most about this many DDP steps
# while the auto search runs, rank 0 looks for its reply every this many steps (each
# check is a broadcast that every rank waits on: on a fast link, a step's worth of it)
SEARCH_POLL_STEPS = 4
# windows whose lowest step ratio is drift's reference: a window can catch a burst of
# host load (the job's first steps, another process) that the steps after it never see,
# and load only ever adds time (two of three windows 7x slow in a loaded test run made
# their median the burst, and the slowdown after it measured as no change)
REF_WINDOWS = 3
# steps of the running search after which rank 0 weighs what it costs the job (the
# steps it slows) against the most any policy could win (the exposed communication):
# one poll's; a search that only looks affordable goes on being weighed as it runs
SEARCH_COST_STEPS = 4
# steps beside the worker's start before the network probe (the first weighing), on a
# job whose exposed communication is under LINK_BOUND of its step
WEIGH_STEPS = 4
LINK_BOUND = 0.5
# a CPU-bound job's search that has not replied is given up before its exploration's
# degraded steps could pass this (counted as the summary counts them, checked every
# poll): at idle priority on busy cores a search can take longer than a short job, and
# each step it slows costs the job while the most it could win per step is small
DEGRADED_BUDGET = 10
# a link-bound job's stand-in during the search is weighed on this many timed steps and
# kept when their median is at most STAND_IN_KEEP times the DDP start's
STAND_IN_STEPS = 4
STAND_IN_KEEP = 1.0
SEARCH_TIMEOUT_S = 120.0  # the auto search's reply, beyond 10 x budget_s: else plain DDP
GIL_SLICE_S = 0.0005  # the interpreter's switch interval while a background search runs


def probe_sizes(grad_bytes: int, smallest: int = 16 * 1024, count: int = 6) -> tuple[int, ...]:
    """The network probe's message sizes: ``smallest`` times powers of 4, up to the
    first that holds the whole gradient (no bucket is larger), at least three (the
    fit needs them) and at most ``count``."""
    sizes = [smallest * 4**i for i in range(count)]
    needed = next((i + 1 for i, size in enumerate(sizes) if size >= grad_bytes), count)
    return tuple(sizes[:max(3, needed)])


@dataclass
class _Window:
    """What rank 0 saw since the last check."""

    step_s: list[float] = field(default_factory=list)
    records: list[BucketRecord] = field(default_factory=list)
    probes: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    started: float = field(default_factory=time.perf_counter)


@contextlib.contextmanager
def _short_gil_slices(seconds: float = GIL_SLICE_S) -> Iterator[None]:
    """While a background search runs, let the interpreter hand the GIL over sooner.

    CPython makes a thread that wants the GIL wait up to the switch interval (5 ms by
    default) while another runs Python. Training takes the GIL many times a step
    (autograd hooks, the communication hook, the communication thread), so a search
    busy in Python (Optuna, the codec probe's bookkeeping) would add that wait to each;
    shorter slices keep training's steps near their speed.
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Controller:
    """Drift detection, background re-search and the synchronized switch.

    Created by :func:`autotune.wrap` with ``online=True`` (``profile`` given) or with
    the policy ``"auto"`` (``auto=True``, no profile: it is measured on the live steps);
    not used directly.

    Args:
        state: the hook's state, whose policy the controller switches.
        profile: the profile predictions are made from (None with ``auto``).
        config: the knobs.
        process_group: DDP's group.
        auto: explore from plain DDP first (see the module docstring).
        module: with ``auto``: the wrapped module, which rank 0 instruments.
        rebucket: called with a new ``bucket_cap_mb`` on every rank when a switched-to
            policy has another cap (None: caps stay as they are).
        native: with ``auto``: called with True on every rank at the same check to run
            the plain policy it settled on as DDP's own allreduce, without the hook
            (:meth:`~autotune.runtime.AutotuneDDP.set_native`), and with False when a
            compressing policy is switched to later.
    """

    def __init__(
        self, state: AutotuneState, profile: Profile | None, config: OnlineConfig,
        process_group: dist.ProcessGroup | None = None, *, auto: bool = False,
        module: torch.nn.Module | None = None, rebucket: Callable[[float], None] | None = None,
        native: Callable[[bool], None] | None = None,
    ) -> None:
        if profile is None and not auto:
            raise AutotuneError("online revision needs a profile (or auto=True)")
        if auto and module is None:
            raise AutotuneError("auto=True needs the wrapped module")
        self.state = state
        self.profile = profile
        self.config = config
        self.auto = auto
        self.rebucket = rebucket
        self.native = native if rebucket is not None else None
        self._model_name = type(module).__name__ if module is not None else "model"
        self._grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters()
                               if p.requires_grad) if module is not None else 0
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        backend = dist.get_backend(process_group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.step = 0  # optimizer steps completed (forward passes started minus one)
        self.revision = 0
        self.events: list[dict[str, Any]] = []  # every decision, as logged
        self._pending: tuple[int, Policy] | None = None  # (switch step, policy) on every rank
        self._last_boundary: float | None = None
        # steps between checks, as rank 0 last announced (every step while exploring)
        self._every = 1 if auto else config.check_every
        self._next_check = self._every
        # rank 0 only ------------------------------------------------------------
        self._model: CostModel | None = None
        self._window = _Window()
        self._lock = threading.Lock()
        self._ref: tuple[float, float] | None = None  # (step ratio, link scale) at policy start
        # checks to skip before taking the reference: the first windows hold DDP's first
        # iterations (bucket rebuild, compression starting), or steps of the old policy
        self._settle = 2
        self._ref_ratios: list[float] = []  # the reference's windows so far
        self._strikes = 0
        self._drift_since = 0.0  # when the first window of the current drift began
        self._scale = 1.0  # fitted link: measured / predicted collective time
        self._probe_next = False
        self._last_probe = (-math.inf, 0.0)  # rank 0: when the last probe ended, its seconds
        self._search: threading.Thread | None = None
        # a drift's re-search: its fork, or the reply of its thread (see _start_search)
        self._research_child: ForkedSearch | None = None
        self._research_reply: dict[str, Any] | None = None
        self._proposal: tuple[Policy, dict[str, Any]] | None = None
        self._top: list[Policy] = []
        # auto, rank 0 ------------------------------------------------------------
        self.phase = "reference" if auto else "online"
        self.summary: dict[str, Any] | None = None  # the last settled exploration's
        self._profiler: LiveProfiler | None = None
        self._ddp_steps: list[float] = []  # the DDP start's reference step times
        self._explore_from: int | None = None  # first step of the current exploration
        self._explore_times: list[float] = []  # its steps' times, for the degraded count
        self._search_steps: list[float] = []  # the steps run beside auto's search
        self._network: dict[str, Any] | None = None
        self._compute: dict[str, Any] | None = None  # the instrumented steps' compute section
        self._exploration: Exploration | None = None
        self._stall_s = 0.0  # the network probe's time (outside any step)
        self._totals = {"explorations": 0, "explore_steps": 0, "degraded_steps": 0}
        self._worker: SearchWorker | ForkedSearch | None = None
        self._fork = False  # the search forks rank 0 when it starts (see _hidden)
        self._reply: dict[str, Any] | None = None  # a thread search's reply
        # a link-bound job's stand-in while its search runs (see _choose_stand_in): the
        # policy it replaced, the stand-in's first timed step (None: not on trial) and
        # its timed steps
        self._start_policy: Policy | None = None
        self._stand_in_from: int | None = None
        self._stand_in_steps: list[float] = []
        if auto and self.rank == 0:
            self._profiler = LiveProfiler(module, state)  # type: ignore[arg-type]
        if auto and config.save is not None and self.rank == 0:
            check_writable(config.save, AutotuneError, "the policy to save")
        if self.rank == 0:
            if config.log is not None:  # fail now, not at the first decision mid-training
                check_writable(config.log, AutotuneError, "the revision log")
            state.listeners.append(self._on_record)

    # ------------------------------------------------------------------ public
    def propose(self, policy: Policy, reason: str = "proposed") -> None:
        """Rank 0: announce ``policy`` at the next check (what the re-search calls;
        usable directly, e.g. by a scheduler that knows the cluster will change)."""
        if self.rank != 0:
            raise AutotuneError("only rank 0 proposes policies; other ranks follow its broadcast")
        with self._lock:
            self._proposal = (policy, {"reason": reason})

    def export(self, path: str | os.PathLike[str]) -> None:
        """Write the policy in force as policy JSON."""
        self.state.policy.save(path)

    # --------------------------------------------------------- step boundaries
    def boundary(self) -> None:
        """Called at the start of every training forward pass, on every rank."""
        now = time.perf_counter()
        if self._last_boundary is not None:
            self.step += 1
            if self.rank == 0:
                self._window.step_s.append(now - self._last_boundary)
        if self._profiler is not None:
            self._profiler.finish(now)
        if self._pending is not None and self.step >= self._pending[0]:
            self._apply(*self._pending)
            self._pending = None
        if self.step >= self._next_check and self._last_boundary is not None:
            self._check()
        # time after the control work, so it is not counted as the next step's
        self._last_boundary = time.perf_counter() if self._last_boundary is not None else now
        if self._profiler is not None and self.phase == "instrument":
            self._profiler.arm(self._last_boundary, capture=True)

    # ------------------------------------------------------------------ checks
    def _check(self) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        payload = b""
        if self.rank == 0:
            payload, switch_step, action, every = self._decide()
            argument = round(self._network_budget_s() * 1e6) if action == _NETWORK else 0
            header[:] = torch.tensor([len(payload), switch_step, self.revision, action, every,
                                      argument, self.phase == "settled"])
        header = header.to(self.device)
        dist.broadcast(header, src=self._src(), group=self.group)
        size, switch_step, revision, action, every, argument, settled = (
            int(x) for x in header.cpu().tolist())
        self._every = every
        self._next_check = self.step + every
        if self.auto and self.rank != 0 and settled:
            self.phase = "settled"  # rank 0 announced the end of its exploration
        if size:
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            if self.rank == 0:
                data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(data, src=self._src(), group=self.group)
            policy = Policy.from_dict(json.loads(data.cpu().numpy().tobytes().decode()),
                                      source="announced policy")
            self._pending = (switch_step, policy)
            self.revision = revision
        if action == _PROBE:
            self._probe()
        elif action == _NETWORK:
            self._probe_network(argument / 1e6)
        self._go_native(bool(settled))

    def _go_native(self, settled: bool) -> None:
        """Every rank, after a check's broadcast: once auto has ``settled`` (as rank 0
        broadcast it: its re-trials after a drift are not) on a plain policy that is in
        force (no switch pending) and owes nothing (a switch's carry is paid by the
        hook in the policy's first step), run it as DDP's own allreduce without the
        hook. Decided from what every rank holds alike."""
        state = self.state
        if (self.native is None or not settled or self._pending is not None
                or state.native or not state.policy.is_plain or state.owes):
            return
        self.native(True)
        self._log({"event": "native", "step": self.step, "policy": state.policy.id})
        self._rebaseline()  # the step itself changed

    def _rebaseline(self) -> None:
        """Rank 0: drift detection starts again from the next windows (a new policy, or
        the same one run another way)."""
        if self.rank == 0:
            with self._lock:
                self._forget_reference(settle=1)

    def _forget_reference(self, settle: int) -> None:
        """Rank 0, holding ``_lock``: drift's reference is taken again, after ``settle``
        checks' windows are skipped, and the strikes against the old one are forgotten
        (kept, the first drifting window after a re-search that kept the policy counted
        as the last of ``patience``, dated from before the search)."""
        self._ref = None
        self._ref_ratios = []
        self._settle = settle
        self._strikes = 0

    def _src(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _probe(self) -> None:
        buf = torch.ones(PROBE_BYTES // 4, device=self.device)
        start = time.perf_counter()
        dist.all_reduce(buf, group=self.group)
        if self.rank == 0:
            end = time.perf_counter()
            self._last_probe = (end, end - start)
            with self._lock:
                self._window.probes.append((PROBE_BYTES, end - start))

    def _probe_due(self) -> bool:
        """Rank 0: whether a probe now keeps the probes within :data:`PROBE_SHARE` of
        the job's time (a probe makes its step that much slower)."""
        ended, seconds = self._last_probe
        return time.perf_counter() - ended >= seconds / PROBE_SHARE

    def _network_budget_s(self) -> float:
        """Rank 0: the network probe's budget, ``network_budget_s`` but at most about
        :data:`NETWORK_STEPS` steps of the DDP start (on a fast link with short steps a
        one-second probe costs more than what it could find)."""
        return min(self.config.network_budget_s, NETWORK_STEPS * statistics.median(self._ddp_steps))

    def _probe_network(self, budget_s: float) -> None:
        """Every rank, at one boundary: auto's network probe (collectives the hook
        issues), over sizes up to the model's gradient (no bucket is larger), within
        ``budget_s`` (rank 0's, broadcast: every rank must probe the same sizes)."""
        started = time.perf_counter()
        sizes = probe_sizes(self._grad_bytes)
        result = probe_network(sizes=sizes, budget_s=budget_s, reps=5,
                               min_reps=2, collectives=("allreduce", "allgather"))
        if self.rank == 0:
            self._network = result
            self._stall_s += time.perf_counter() - started
            self._log({"event": "network_probe", "step": self.step,
                       "seconds": time.perf_counter() - started,
                       "allreduce_Bps": result["fits"].get("allreduce", {}).get("bandwidth_Bps")})

    def _apply(self, step: int, policy: Policy) -> None:
        old = self.state.policy
        if self.state.native and not policy.is_plain:
            assert self.native is not None  # only it runs a policy natively
            self.native(False)  # the hook runs this policy
        self.state.set_policy(policy)
        if self.rebucket is not None and policy.bucket_cap_mb != old.bucket_cap_mb:
            self.rebucket(policy.bucket_cap_mb)
        event = {"event": "switch", "step": self.step, "announced_step": step,
                 "revision": self.revision, "old_policy": old.id, "new_policy": policy.id,
                 "bucket_cap_mb": policy.bucket_cap_mb}
        self._log(event)
        self._rebaseline()
        logger.info("switched to policy %s at step %d", policy.id, self.step)

    # ----------------------------------------------------------- rank 0 logic
    def model(self) -> CostModel:
        if self._model is None:
            if self.profile is None:
                raise AutotuneError("no profile yet: the auto mode has not measured one")
            self._model = CostModel.fit(self.profile)
        return self._model

    def _on_record(self, record: BucketRecord) -> None:
        """Hook callback (any thread): keep the record for the next check."""
        with self._lock:
            self._window.records.append(record)

    def _link_scale(self, window: _Window) -> tuple[float | None, int, float]:
        """Measured / predicted time of the window's large transfers (None: too little
        data). A plain-DDP bucket waits for the one before it on the link, so its own
        time starts when both it was handed over and the previous one had finished."""
        comm = self.model().comm_time(WhatIf())
        measured = predicted = 0.0
        volume = 0
        ratios: list[float] = []
        by_step: dict[int, list[BucketRecord]] = {}
        for r in window.records:
            by_step.setdefault(r.step, []).append(r)
        for records in by_step.values():
            free = -math.inf
            for r in sorted(records, key=lambda r: r.index):
                end = r.start + r.seconds
                seconds = r.comm_s if r.compressed else end - max(r.start, free)
                free = max(free, end)
                if r.nbytes < LARGE_BYTES or seconds <= 0:
                    continue
                expected = sum(comm(kind, nbytes, self.world)
                               for kind, nbytes in r.bytes_by_collective.items())
                predicted += expected
                measured += seconds
                volume += r.nbytes
                ratios.append(seconds / max(expected, 1e-12))
        own = volume
        for nbytes, seconds in window.probes:
            expected = comm("allreduce", nbytes, self.world)
            predicted += expected
            measured += seconds
            volume += nbytes
            ratios.append(seconds / max(expected, 1e-12))
        if volume < LARGE_BYTES or predicted <= 0:
            return None, own, predicted
        ref_scale = self._ref[1] if self._ref is not None else self._scale
        if predicted * ref_scale < MIN_SIGNAL_S:
            # transfers expected this short tell rank skew and scheduling noise, not
            # the link (what they measure only ever grows with skew)
            return None, own, predicted
        # the fastest transfers tell the link: a collective also waits for late peers
        # (rank skew), which only ever adds time
        return min(ratios), own, predicted

    def _decide(self) -> tuple[bytes, int, int, int]:
        """Rank 0 at a check: (policy JSON to announce or b"", its switch step, action,
        steps to the next check)."""
        if self.auto and self.phase != "settled":
            return self._explore()
        payload, switch = self._watch()
        if self._exploration is not None:  # a drift re-search handed over its trials
            self.phase = "trial"
            self._explore_from = self.step
            self._explore_times = []
            return payload, switch, 0, 1
        action = _PROBE if self._probe_next else 0
        return payload, switch, action, self.config.check_every

    def _watch(self) -> tuple[bytes, int]:
        """Drift detection (rank 0): a policy to announce, if any."""
        self._take_research()
        if self.profile is None:  # auto whose search failed: nothing to predict with
            with self._lock:
                self._window = _Window()
            return b"", 0
        model = self.model()
        with self._lock:
            window, self._window = self._window, _Window()
            proposal, self._proposal = self._proposal, None
        scale, own, _ = self._link_scale(window)
        # probe at a later check when the policy itself moves too little data, as
        # often as PROBE_SHARE allows
        self._probe_next = own < LARGE_BYTES and self._probe_due()
        if scale is not None:
            self._scale = scale
        if proposal is not None:
            policy, info = proposal
            self.revision += 1
            switch = self.step + self.config.lead_steps
            self._log({"event": "announce", "step": self.step, "switch_step": switch,
                       "revision": self.revision, "old_policy": self.state.policy.id,
                       "new_policy": policy.id, **info})
            return policy.to_json(indent=None).encode(), switch
        if not window.step_s or self._pending is not None:
            return b"", 0
        measured = statistics.median(window.step_s)
        link = model.link_bps / self._scale if model.link_bps else None
        predicted = model.predict(self.state.policy).step_s
        ratio = measured / predicted
        if self._ref is None:
            if self._settle > 0:
                self._settle -= 1
            else:
                self._ref_ratios.append(ratio)
                if len(self._ref_ratios) >= REF_WINDOWS:
                    self._ref = (min(self._ref_ratios), self._scale)
                    self._ref_ratios = []
            return b"", 0
        ref_ratio, ref_scale = self._ref
        step_dev = abs(ratio / ref_ratio - 1)
        link_dev = abs(math.log(self._scale / ref_scale))
        link_moved = link_dev > math.log1p(self.config.link_threshold)
        drifting = step_dev > self.config.threshold or link_moved
        self._strikes = self._strikes + 1 if drifting else 0
        now = time.perf_counter()
        if self._strikes == 1:  # the drift began with this window's steps
            self._drift_since = window.started
        # the link's own signal is evidence enough after `patience` checks; a step that
        # moved with the link held (compute) must also have lasted patience_s
        lasted = self._strikes >= self.config.patience and (
            link_moved or now - self._drift_since >= self.config.patience_s)
        if lasted and not self._researching():
            self._strikes = 0
            reason = {"event": "drift", "step": self.step, "measured_step_s": measured,
                      "predicted_step_s": predicted, "step_ratio_change": ratio / ref_ratio,
                      "link_scale": self._scale, "ref_link_scale": ref_scale,
                      "link_bps_estimate": link, "policy": self.state.policy.id}
            if not link_moved:
                # the link held and the step moved: compute got slower or faster (another
                # job on the host, a clock change), which moves how much communication
                # hides behind it; the re-search asks the model about that
                reason["compute_speed"] = ref_ratio / ratio
            self._log(reason)
            self._start_search(link, reason)
        return b"", 0

    def _start_search(self, link_bps: float | None, reason: dict[str, Any]) -> None:
        """The re-search after a drift, in the background: a fork of rank 0 where
        :func:`~autotune.online.worker.fork_safe` (a thread there stalled a 0.55 s step
        for 1.9 s at the switch back to 5 Gbit in bench/online.py: the search's Python
        holds the GIL), else a thread. Its reply is taken at a check
        (:meth:`_take_research`)."""
        current = self.state.policy

        def answer() -> dict[str, Any]:
            try:
                return self._research(current, link_bps, reason)
            except Exception as exc:  # noqa: BLE001 - a failed search keeps the policy
                return {"error": f"{type(exc).__name__}: {exc}"}

        if fork_safe():
            child = ForkedSearch()
            try:
                child.start(answer, timeout_s=SEARCH_TIMEOUT_S + 10 * self.config.budget_s)
            except OSError as exc:
                logger.warning("online re-search: no fork (%s); searching on a thread", exc)
            else:
                self._research_child = child
                return

        def run() -> None:
            with _short_gil_slices():
                reply = answer()
            with self._lock:
                self._research_reply = reply

        self._search = threading.Thread(target=run, name="autotune-research", daemon=True)
        self._search.start()

    def _researching(self) -> bool:
        """Whether a re-search runs (its reply not yet taken)."""
        if self._research_child is not None or self._research_reply is not None:
            return True
        return self._search is not None and self._search.is_alive()

    def _take_research(self) -> None:
        """Rank 0, at a check: act on the re-search's reply if it came (a proposal for
        the next check, the trials of the auto mode, or keeping the policy)."""
        reply = None
        if self._research_child is not None:
            reply = self._research_child.poll()
            if reply is not None:
                self._research_child.close(wait=False)
                self._research_child = None
        with self._lock:
            if reply is None:
                reply, self._research_reply = self._research_reply, None
        if reply is None:
            return
        if "error" in reply:
            logger.warning("online re-search failed, keeping the policy: %s", reply["error"])
            self._log({"event": "search_failed", "step": self.step, "error": reply["error"]})
            return
        self._top = [Policy.from_dict(p, source="searched policy") for p in reply["top"]]
        if "contenders" in reply:  # auto: a prediction prunes, a measurement decides
            contenders = [contender_from_dict(c) for c in reply["contenders"]]
            exploration = self._trials(contenders, reply["current"])
            self._log({"event": "retrial", "step": self.step, "search_s": reply["search_s"],
                       "contenders": list(exploration.order), "trigger": reply["trigger"]})
            with self._lock:
                self._exploration = exploration
            return
        info = reply["info"]
        if reply["policy"] is not None:
            new = Policy.from_dict(reply["policy"], source="searched policy")
            self.propose(new.with_meta(online_revision=self.revision + 1), reason="drift")
            with self._lock:
                if self._proposal is not None:
                    self._proposal = (self._proposal[0], info)
        else:
            self._log({"event": "keep", "step": self.step, "policy": reply["current"], **info})
            with self._lock:
                self._forget_reference(settle=0)  # the change is understood: re-baseline on it

    def _research(self, current: Policy, link_bps: float | None,
                  reason: dict[str, Any]) -> dict[str, Any]:
        """The re-search itself, on the fork or the thread: its reply as JSON-able data
        (``top``; auto: the trials' ``contenders`` and ``current``; else the ``policy``
        to propose, or None to keep ``current``, and ``info``)."""
        assert self.profile is not None  # drift is watched only with a profile
        model = self.model()
        what_if = WhatIf(bandwidth_bps=link_bps, compute_speed=reason.get("compute_speed", 1.0))
        max_error = self.config.max_error
        if max_error is None:
            max_error = float(current.meta.get("max_error", DEFAULT_MAX_ERROR))
        started = time.perf_counter()
        caps = None if self.rebucket is not None else (current.bucket_cap_mb,)
        result = tune(self.profile, max_error=max_error, trials=self.config.trials,
                      model=model, what_if=what_if, pinned=dict(self.config.pinned),
                      caps=caps, seeds=[current, *self._top],
                      timeout=self.config.budget_s, study_name=f"online-{self.revision + 1}",
                      top_k=self.config.candidates + 2)
        reply: dict[str, Any] = {"top": [c.policy.to_dict() for c in result.top],
                                 "current": current.id}
        if self.auto:  # a prediction prunes, a measurement decides: live trials again
            contenders, name = trial_contenders(
                self.profile, model, result, current, pinned=self.config.pinned,
                max_error=self._max_error(), rebucket=self.rebucket is not None,
                candidates=self.config.candidates, what_if=what_if)
            return {**reply, "contenders": [contender_to_dict(c) for c in contenders],
                    "current": name, "search_s": time.perf_counter() - started,
                    "trigger": reason}
        now = model.predict(current, what_if).step_s
        new = result.policy
        gain = 1 - result.policy.meta["predicted_step_s"] / now
        info = {"reason": "drift", "search_s": time.perf_counter() - started,
                "predicted_current_s": now, "predicted_new_s": new.meta["predicted_step_s"],
                "link_bps_estimate": link_bps, "trigger": reason}
        better = new.id != current.id and gain >= self.config.min_gain
        return {**reply, "policy": new.to_dict() if better else None, "info": info}

    # -------------------------------------------------------------------- auto
    def _explore(self) -> tuple[bytes, int, int, int]:
        """Rank 0, at every check until it settles (each step; every :data:`SEARCH_POLL_STEPS`
        while the search runs): the auto mode's phases (see the module
        docstring). Returns what :meth:`_decide` does."""
        with self._lock:
            window, self._window = self._window, _Window()
        last = window.step_s[-1] if window.step_s else None  # the time of step - 1
        if self._explore_from is not None and last is not None and not self._ran_plain_ddp():
            self._explore_times.extend(window.step_s)  # the steps since the last check
        if self.phase == "reference":
            if last is not None and self.step - 1 >= FIRST_TIMED_STEP:
                self._ddp_steps.append(last)
            if len(self._ddp_steps) >= self.config.profile_steps:
                self.phase = "instrument"  # armed at this boundary, after the check
                self._explore_from = self.step
            return b"", 0, 0, 1
        if self.phase == "instrument":
            assert self._profiler is not None
            if len(self._profiler.steps) < self.config.profile_steps:
                return b"", 0, 0, 1
            hidden = self._hidden()
            if hidden is not None:  # nothing to gain: plain DDP stays, no network probe
                return self._conclude(None, None, why=hidden)
            self._search_steps = []
            if self._worker is not None and not self._link_bound():
                # first weigh what the search costs, on the steps beside the worker's
                # start (its imports: the search's kind of load), before the network
                # probe stalls every rank: a search given up here costs no probe
                self.phase = "weigh"
                return b"", 0, 0, SEARCH_POLL_STEPS
            self.phase = "network"
            return b"", 0, _NETWORK, 1  # every rank probes the network after this header
        if self.phase == "weigh":
            self._search_steps.extend(window.step_s)
            why = self._search_costs_more()
            if why is not None:
                return self._give_up_search(why)
            if len(self._search_steps) < WEIGH_STEPS:
                return b"", 0, 0, SEARCH_POLL_STEPS
            self.phase = "network"
            return b"", 0, _NETWORK, 1
        if self.phase == "network":
            chosen = self._choose_stand_in()  # from the copied gradients: before the search
            self._start_auto_search(chosen)
            self.phase = "search"
            if chosen is None:
                return b"", 0, 0, SEARCH_POLL_STEPS
            self._start_policy = self.state.policy
            payload, switch = self._announce(chosen[1], {"reason": "stand-in",
                                                         "contender": chosen[0]}, lead=1)
            self._stand_in_from = switch + 1  # its first step settles
            return payload, switch, 0, SEARCH_POLL_STEPS
        if self.phase == "search":
            reply = self._poll_search()
            if reply is None:
                self._search_steps.extend(window.step_s)
                why = self._search_costs_more()
                if why is not None:
                    return self._give_up_search(why)
                back = self._weigh_stand_in(window.step_s)
                if back is not None:
                    return (*back, 0, SEARCH_POLL_STEPS)
                return b"", 0, 0, SEARCH_POLL_STEPS
            if not self._adopt(reply):  # the search failed: keep plain DDP
                return self._conclude(None, None)
            self.phase = "trial"
        exploration = self._exploration
        assert exploration is not None
        contender = exploration.tick(self.step, last)
        if contender is not None:
            payload, switch = self._announce(
                contender.policy, {"reason": "trial", "contender": contender.name}, lead=1)
            return payload, switch, 0, 1
        if exploration.done:
            winner, decision = exploration.decide()
            return self._conclude(winner, decision)
        return b"", 0, 0, 1

    def _ran_plain_ddp(self) -> bool:
        """Step ``step - 1`` was a trial block of plain DDP: the job as it would run
        without autotune (nothing of ours ran beside it), so never a degraded step."""
        exploration = self._exploration
        if self.phase != "trial" or exploration is None:
            return False
        name = exploration.running(self.step - 1)
        return name is not None and exploration.contenders[name].kind == "ddp"

    def _announce(self, policy: Policy, info: dict[str, Any], lead: int) -> tuple[bytes, int]:
        self.revision += 1
        switch = self.step + lead
        self._log({"event": "announce", "step": self.step, "switch_step": switch,
                   "revision": self.revision, "old_policy": self.state.policy.id,
                   "new_policy": policy.id, **info})
        return policy.to_json(indent=None).encode(), switch

    def _hidden(self) -> str | None:
        """Why not to tune at all, from the instrumented steps, before anything else is
        measured: when the DDP start is within :data:`HIDDEN_MARGIN` of its compute
        floor, no policy can gain more than that (the gain is bounded by the exposed
        communication), and even the network probe would cost more than it could win."""
        assert self._profiler is not None
        self._compute = self._profiler.compute_section()
        floor = statistics.median(self._compute["step_s"])
        reference = statistics.median(self._ddp_steps)
        self._log({"event": "instrumented", "step": self.step, "ddp_step_s": reference,
                   "floor_s": floor})
        if reference > (1 + HIDDEN_MARGIN) * floor:
            # a search will run. On a link-bound job it forks rank 0 when it starts,
            # which has everything loaded (a fresh worker's imports are half its work);
            # else start a fresh worker now, so that its imports overlap the network
            # probe, and its start is what the search is weighed on (not at wrap: they
            # would compete with the reference steps for the cores, and slow a job that
            # turns out to have nothing to gain)
            self._fork = self._link_bound() and fork_safe()
            if not self._fork:
                try:
                    self._worker = SearchWorker()
                except OSError as exc:
                    logger.warning("auto: no search worker (%s); the search runs on a thread", exc)
            return None
        self._profiler.close()
        self._profiler = None
        return (f"plain DDP's step ({reference * 1e3:.1f} ms) is within "
                f"{HIDDEN_MARGIN:.0%} of its compute alone ({floor * 1e3:.1f} ms): "
                f"communication is hidden, nothing to tune")

    def _link_bound(self) -> bool:
        """Whether the DDP start waits on the link for :data:`LINK_BOUND` of its step or
        more. Then the search is not weighed before the network probe: its cost could
        hardly exceed so much exposed communication, and the worker's imports overlap
        the probe's stall instead of slowing steps (300 Mbit cnn: 8 steps 1.4x slower).
        On a CPU-bound job it is weighed first, and a search given up costs no probe."""
        assert self._compute is not None
        reference = statistics.median(self._ddp_steps)
        return reference - statistics.median(self._compute["step_s"]) >= LINK_BOUND * reference

    def _search_costs_more(self) -> str | None:
        """Why to give the running search up (None: let it run), from the steps it has
        run beside: when they are slower than the DDP start by more than the DDP start's
        exposed communication (its step less its compute floor), the search costs each
        step more than any policy it could find would win back per step. A search at the
        lowest CPU priority is meant to use only what training leaves idle, but on a
        CPU-bound job (a fast link) there is nothing idle, and on some machines (virtual
        CPUs) even an idle-class process slows the training processes beside it.
        A search on a CPU-bound job that costs less than that per step but goes on
        without replying is given up too, before the exploration's degraded steps could
        pass :data:`DEGRADED_BUDGET`: a link-bound job's search is not (its possible gain
        is at least half of every step)."""
        if len(self._search_steps) < SEARCH_COST_STEPS or self._compute is None:
            return None
        reference = statistics.median(self._ddp_steps)
        floor = statistics.median(self._compute["step_s"])
        slower = statistics.median(self._search_steps) - reference
        if slower > reference - floor:
            return (f"the search slowed the steps by {slower * 1e3:.1f} ms, more than plain "
                    f"DDP leaves to win ({(reference - floor) * 1e3:.1f} ms of its "
                    f"{reference * 1e3:.1f} ms step are exposed communication): plain DDP "
                    f"stays")
        degraded = sum(t > reference * (1 + DEGRADED_MARGIN) for t in self._explore_times)
        # at a check, the next one comes a poll later (and a network probe's step first,
        # once weighed): each step up to it may be degraded, and still within the budget
        if degraded >= DEGRADED_BUDGET - SEARCH_POLL_STEPS and not self._link_bound():
            return (f"the search has not replied after {len(self._search_steps)} steps beside "
                    f"it, and {degraded} steps of the exploration were slower than plain "
                    f"DDP's ({reference * 1e3:.1f} ms) by over {DEGRADED_MARGIN:.0%}: on a "
                    f"CPU-bound job it would cost more than it could win; plain DDP stays")
        return None

    def _choose_stand_in(self) -> tuple[str, Policy] | None:
        """Rank 0, as a link-bound job's search starts: what runs instead of plain DDP
        until the trials (:func:`~autotune.online.search.stand_in`: a cast within the
        error budget that halves the bytes on the link; None: plain DDP runs on). The
        search's steps then run below the DDP start, not beside it, and the trials start
        from it (the incumbent)."""
        assert self._profiler is not None
        if not self._link_bound():
            return None
        found = stand_in(self._profiler.grads, self.state.policy, pinned=self.config.pinned,
                         max_error=self._max_error(), world_size=self.world)
        if found is None:
            return None
        name, policy, error = found
        self._log({"event": "stand_in", "step": self.step, "contender": name,
                   "policy_id": policy.id, "error": error})
        return name, policy

    def _weigh_stand_in(self, step_s: list[float]) -> tuple[bytes, int] | None:
        """Rank 0, while the search runs: once the stand-in has :data:`STAND_IN_STEPS`
        timed steps, keep it if their median is within :data:`STAND_IN_KEEP` of the DDP
        start's, else announce the policy it replaced (returned: the announcement)."""
        if self._stand_in_from is None or self._start_policy is None:
            return None
        first = self.step - len(step_s)  # the step whose time is step_s[0]
        self._stand_in_steps += [t for i, t in enumerate(step_s)
                                 if first + i >= self._stand_in_from]
        if len(self._stand_in_steps) < STAND_IN_STEPS:
            return None
        self._stand_in_from = None
        measured = statistics.median(self._stand_in_steps)
        reference = statistics.median(self._ddp_steps)
        kept = measured <= STAND_IN_KEEP * reference
        self._log({"event": "stand_in_weighed", "step": self.step, "step_s": measured,
                   "ddp_step_s": reference, "kept": kept})
        if kept:
            if self._worker is not None:  # the steps have time to spare: the search ends sooner
                self._log({"event": "search_boosted", "step": self.step,
                           "done": self._worker.boost()})
            return None
        start, self._start_policy = self._start_policy, None
        return self._announce(start, {"reason": "stand-in slower than the DDP start"}, lead=1)

    def _give_up_search(self, why: str) -> tuple[bytes, int, int, int]:
        """Rank 0: end the search for plain DDP (see :meth:`_search_costs_more`)."""
        self._stop_search()
        if self._profiler is not None:  # given up while weighed: its hooks come off
            self._profiler.close()
            self._profiler = None
        self._log({"event": "search_abandoned", "step": self.step, "why": why})
        return self._conclude(None, None, why=why)

    def _stop_search(self) -> None:
        """End the search: its worker is killed; a search thread is left to finish, and
        its reply is never read."""
        if self._worker is not None:
            self._worker.close(wait=False)
            self._worker = None

    def _start_auto_search(self, chosen: tuple[str, Policy] | None = None) -> None:
        """Hand the measurements (the instrumented steps' compute, the copied
        gradients, the network probe) to the search: on the worker process, or a
        thread. ``chosen``: the stand-in (its name and policy), the policy in force from
        the next step, from which the trials start."""
        assert self._profiler is not None and self._network is not None and self._compute is not None
        compute = self._compute
        grads = self._profiler.grads
        self._profiler.close()
        self._profiler = None
        reference = statistics.median(self._ddp_steps)
        current_name, current = chosen if chosen is not None else ("current", self.state.policy)
        request = {
            "compute": compute, "network": self._network, "env": live_environment(self._network),
            "current": current.to_dict(), "current_name": current_name,
            "model_name": self._model_name,
            "world_size": self.world, "reference_s": reference,
            "budget_s": self.config.budget_s, "codec_share": CODEC_SHARE,
            "trials": self.config.trials, "max_error": self._max_error(),
            "pinned": {k: dict(v) for k, v in self.config.pinned.items()},
            "rebucket": self.rebucket is not None, "candidates": self.config.candidates}
        if self._fork:
            self._worker = ForkedSearch()
        if self._worker is not None:
            try:
                self._worker.submit(request, grads, timeout_s=SEARCH_TIMEOUT_S + 10 * self.config.budget_s)
                return
            except OSError as exc:  # it died before the request: search here instead
                logger.warning("auto: the search worker failed (%s); searching on a thread", exc)
                self._stop_search()

        def run() -> None:
            from autotune.online.search import auto_search

            try:
                with _short_gil_slices():
                    reply = auto_search(
                        request["compute"], grads, request["network"], current,
                        **{k: v for k, v in request.items()
                           if k not in ("compute", "network", "current")})
            except Exception as exc:  # noqa: BLE001 - a failed search keeps plain DDP
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with self._lock:
                self._reply = reply

        self._search = threading.Thread(target=run, name="autotune-auto-search", daemon=True)
        self._search.start()

    def _poll_search(self) -> dict[str, Any] | None:
        """The auto search's reply once it is there (None: still searching)."""
        if self._worker is not None:
            reply = self._worker.poll()
            if reply is not None:
                self._stop_search()
            return reply
        ended = self._search is None or not self._search.is_alive()
        with self._lock:
            reply, self._reply = self._reply, None
        if reply is None and ended:
            return {"error": "the search thread ended without a reply"}
        return reply

    def _adopt(self, reply: dict[str, Any]) -> bool:
        """Take the search's profile and contenders (False: it failed)."""
        if "error" in reply:
            logger.warning("auto: the search failed, keeping plain DDP: %s", reply["error"])
            self._log({"event": "search_failed", "step": self.step, "error": reply["error"]})
            return False
        self.profile = Profile.from_dict(reply["profile"], source="live profile")
        self._model = CostModel.from_dict(reply["model"], source="the live cost model")
        self._top = [Policy.from_dict(p, source="searched policy") for p in reply["top"]]
        contenders = [contender_from_dict(c) for c in reply["contenders"]]
        current = reply["current"]
        in_force = self._pending[1] if self._pending is not None else self.state.policy
        if next(c for c in contenders if c.name == current).policy.id != in_force.id:
            # the stand-in went back to the policy it replaced while the search ran
            current = next((c.name for c in contenders if c.policy.id == in_force.id), "start")
            if current == "start":
                contenders.insert(1, Contender(current, in_force, "current"))
        self._exploration = self._trials(contenders, current)
        self._log({"event": "searched", "step": self.step, "codec_probe_s": reply["codec_probe_s"],
                   "search_s": reply["search_s"], "trials": reply["trials"],
                   "worker": self._search is None, "forked": self._fork, "current": current,
                   "timeline": reply.get("timeline"),
                   "contenders": list(self._exploration.order),
                   "predicted_s": {c.name: c.predicted_s for c in contenders}})
        return True

    def _trials(self, contenders: list[Contender], current: str) -> Exploration:
        return Exploration(contenders, current, trial_steps=self.config.trial_steps,
                           budget_steps=self.config.explore_steps)

    def _conclude(self, winner: Contender | None, decision: Any,
                  why: str | None = None) -> tuple[bytes, int, int, int]:
        """Rank 0: end an exploration on ``winner`` (None: keep the policy in force,
        for the reason ``why``): announce it, save it, log the summary; drift watching
        starts again."""
        exploration, self._exploration = self._exploration, None
        reference = statistics.median(self._ddp_steps) if self._ddp_steps else None
        current = self.state.policy
        # no winner: the policy in force stays, or the one a stand-in stood in for
        start, self._start_policy, self._stand_in_from = self._start_policy, None, None
        if winner is None:
            policy = start if start is not None and exploration is None else current
        else:
            policy = winner.policy
        ddp = None
        if winner is not None and exploration is not None:
            ddp = next((n for n in exploration.order
                        if exploration.contenders[n].kind == "ddp" and n in decision.medians), None)
        # the DDP start: every step of plain DDP with nothing of ours beside it, the
        # reference steps before the exploration and DDP's trial blocks in it
        plain = list(self._ddp_steps) if self.summary is None else []  # first exploration
        if ddp is not None and exploration is not None:
            plain += exploration.times[ddp]
        base = statistics.median(plain) if plain else reference
        summary: dict[str, Any] = {
            "settled_step": self.step + 1,
            "explore_steps": self.step + 1 - (self._explore_from or self.step),
            "degraded_steps": sum(t > base * (1 + DEGRADED_MARGIN) for t in self._explore_times)
            if base else 0,
            "stall_s": self._stall_s,
            "policy": winner.name if winner is not None else "current",
            "ddp_start_step_s": base,
        }
        if why is not None:
            summary["why"] = why
        # over every exploration of the run (a drift adds one)
        for key in ("explore_steps", "degraded_steps"):
            self._totals[key] += summary[key]
        self._totals["explorations"] += 1
        summary.update({f"total_{k}": v for k, v in self._totals.items()})
        if winner is not None and exploration is not None:
            measured = decision.medians[winner.name]
            summary.update(measured_step_s=measured, ddp_step_s=base,
                           speedup=base / measured if base else None, why=decision.reason,
                           rounds=exploration.rounds, contenders=list(exploration.order),
                           dropped=dict(exploration.dropped))
            report = exploration.report(decision)
            policy = policy.with_meta(
                tool="autotune.wrap(model, 'auto')", chosen=winner.name, error=winner.error,
                measured_step_s=measured, max_error=self._max_error(), auto=summary,
                verified=report,
                verification={"winner": decision.winner, "emitted": winner.name,
                              "why": decision.reason, "live": True})
            self._learn(exploration, decision)
        elif why is not None:
            policy = policy.with_meta(tool="autotune.wrap(model, 'auto')", chosen="current",
                                      error=0.0, max_error=self._max_error(), auto=summary,
                                      verification={"why": why, "live": True})
        payload, switch = b"", 0
        if policy.id != current.id:
            payload, switch = self._announce(policy, {"reason": "settled"}, lead=1)
        if self.config.save is not None:
            policy.save(self.config.save)
        self.summary = summary
        self.phase = "settled"
        self._log({"event": "settled", "step": self.step, "policy_id": policy.id, **summary})
        logger.info(
            "autotune auto: settled after %d steps exploring (%d degraded, slower than the DDP "
            "start) on %s (bucket_cap_mb=%g): measured %s plain DDP",
            summary["explore_steps"], summary["degraded_steps"], summary["policy"],
            policy.bucket_cap_mb,
            f"{summary['speedup']:.2f}x" if summary.get("speedup") else "as fast as")
        with self._lock:
            self._forget_reference(settle=2)
            self._window = _Window()
        self._explore_from = None
        self._explore_times = []
        return payload, switch, 0, self.config.check_every

    def _max_error(self) -> float:
        return self.config.max_error if self.config.max_error is not None else DEFAULT_MAX_ERROR

    def _learn(self, exploration: Exploration, decision: Any) -> None:
        """Add the trials' medians to the live profile's calibration, which the cost
        model's residual is fitted on for the next re-search."""
        if self.profile is None:
            return
        results = list(self.profile.calibration.results)
        for name, median in decision.medians.items():
            policy = exploration.contenders[name].policy
            plain = {k: v for k, v in policy.to_dict().items() if k != "meta"}
            results.append(CalibrationRun(policy=None if policy.id == Policy().id else plain,
                                          step_s=median))
        self.profile = replace(self.profile, calibration=replace(
            self.profile.calibration, results=tuple(results)))
        if self._model is None or len(results) < 3:
            return
        # only the residual learns from the trials: refitting every component here,
        # between two steps, would stall training for seconds
        self._model.fit_residual(calibration_pairs(results))

    # ----------------------------------------------------------------- logging
    def _log(self, event: dict[str, Any]) -> None:
        event = {"time": time.time(), "rank": self.rank, **event}
        self.events.append(event)
        if self.config.log is not None and self.rank == 0:
            with open(self.config.log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(event, default=str) + "\n")
