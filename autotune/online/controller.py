"""Online revision: notice when the cluster changed, re-tune, switch every rank at once.

The controller lives beside the hook (``autotune.wrap(..., online=True)``) and acts only
between steps, at the start of a forward pass: never inside a backward pass.

* **Monitoring** (rank 0): every step's wall time, and the hook's own records of its
  collectives, from which an online fit of the link follows: the ratio of measured to
  predicted collective time over the check window (large transfers only) rescales the
  profile's link rate. When the current policy moves too little data to tell (PowerSGD
  on a fast link sends kilobytes), every rank joins a small probe allreduce at the check.
* **Drift**: at each check (every ``check_every`` steps) two ratios are compared with
  their values when the current policy started: measured / predicted step time, and the
  fitted link rate. A deviation above ``threshold`` for ``patience`` consecutive checks
  is drift (hysteresis: noise does not flap the policy).
* **Revision**: rank 0 re-runs the search for the fitted link, warm-started from the
  current policy and the previous study's best, within ``budget_s``, on a background
  thread (training does not wait), and keeps the result only if it is predicted to beat
  the current policy by ``min_gain``.
* **Switch**: at a check step, every rank joins a broadcast from rank 0 of a small
  header tensor and, when there is news, the new policy as JSON bytes in a uint8 tensor
  (no pickle). Every rank applies it at the announced step, between steps; error
  feedback follows the hook's documented *carry* rule (see
  :meth:`autotune.runtime.hook.AutotuneState.set_policy`).
* **Bucket size** is kept: DDP fixes its buckets when it is constructed, and ``wrap``
  returns that DDP object to the user, so a different cap would need DDP's reducer
  rebuilt through private APIs. The search runs with the cap pinned to the current one.

Every decision is appended to a JSONL log; the final policy can be exported.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist

from autotune.errors import AutotuneError
from autotune.jsonio import check_writable
from autotune.models.simulator import WhatIf
from autotune.policies import Policy

if TYPE_CHECKING:
    from autotune.models.cost_model import CostModel
    from autotune.probes.profile import Profile
    from autotune.runtime.hook import AutotuneState, BucketRecord

__all__ = ["OnlineConfig", "Controller"]

logger = logging.getLogger(__name__)

# Header of the control broadcast: [policy bytes, switch step, revision number, probe]
_HEADER = 4
PROBE_BYTES = 512 * 1024  # above tbf's burst on an emulated link, cheap on a real one
LARGE_BYTES = 256 * 1024  # transfers smaller than this tell latency, not bandwidth
# A window tells the link's rate only when its transfers were expected to take this
# long: below it, rank skew and scheduling noise on a busy host swamp the link.
MIN_SIGNAL_S = 0.01


@dataclass(frozen=True)
class OnlineConfig:
    """Knobs of online revision (``autotune.wrap(..., online=True, **knobs)``).

    Attributes:
        check_every: steps between checks; each check costs every rank one tiny
            broadcast. Smaller reacts faster; 5-20 is typical.
        threshold: relative change of measured/predicted step time that counts as
            drift. Keep it above the step-time noise: CPU speed here drifts by up to
            1.5x for seconds at a time, hence 0.5; a link change that matters moves the
            step far more, or shows in the link signal.
        link_threshold: relative change of the fitted link rate that counts as drift
            (1.0: the link got twice as fast or slow); collective times on a loaded
            host are noisier than step times, and a link change that matters is large.
        patience: consecutive drifting checks before revising (hysteresis).
        budget_s: wall seconds the background re-search may take.
        trials: Optuna trials of a re-search.
        min_gain: a new policy must be predicted this much faster to be switched to.
        max_error: compression-error budget of the re-search (default: the policy's).
        pinned: parameter name -> compressor spec the revision must not change.
        lead_steps: a policy announced at a check applies this many steps later.
        log: JSONL file every decision is appended to (None: keep in memory only).
    """

    check_every: int = 5
    threshold: float = 0.5
    link_threshold: float = 1.0
    patience: int = 2
    budget_s: float = 10.0
    trials: int = 60
    min_gain: float = 0.05
    max_error: float | None = None
    pinned: Mapping[str, Any] = field(default_factory=dict)
    lead_steps: int = 1
    log: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.check_every < 1 or self.patience < 1 or self.lead_steps < 1:
            raise AutotuneError("check_every, patience and lead_steps must be >= 1")
        if not (self.threshold > 0 and self.link_threshold > 0):
            raise AutotuneError("threshold and link_threshold must be > 0")


@dataclass
class _Window:
    """What rank 0 saw since the last check."""

    step_s: list[float] = field(default_factory=list)
    records: list[BucketRecord] = field(default_factory=list)
    probes: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)


class Controller:
    """Drift detection, background re-search and the synchronized switch.

    Created by :func:`autotune.wrap` with ``online=True``; not used directly.
    """

    def __init__(
        self, state: AutotuneState, profile: Profile, config: OnlineConfig,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.state = state
        self.profile = profile
        self.config = config
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
        # rank 0 only ------------------------------------------------------------
        self._model: CostModel | None = None
        self._window = _Window()
        self._lock = threading.Lock()
        self._ref: tuple[float, float] | None = None  # (step ratio, link scale) at policy start
        # checks to skip before taking the reference: the first windows hold DDP's first
        # iterations (bucket rebuild, compression starting), or steps of the old policy
        self._settle = 2
        self._strikes = 0
        self._scale = 1.0  # fitted link: measured / predicted collective time
        self._probe_next = False
        self._search: threading.Thread | None = None
        self._proposal: tuple[Policy, dict[str, Any]] | None = None
        self._top: list[Policy] = []
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
        if self._pending is not None and self.step >= self._pending[0]:
            self._apply(*self._pending)
            self._pending = None
        if self.step > 0 and self.step % self.config.check_every == 0 and (
            self._last_boundary is not None
        ):
            self._check()
        # time after the control work, so it is not counted as the next step's
        self._last_boundary = time.perf_counter() if self._last_boundary is not None else now

    # ------------------------------------------------------------------ checks
    def _check(self) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        payload = b""
        if self.rank == 0:
            payload, switch_step = self._decide()
            header[:] = torch.tensor([len(payload), switch_step, self.revision, int(self._probe_next)])
        header = header.to(self.device)
        dist.broadcast(header, src=self._src(), group=self.group)
        size, switch_step, revision, probe = (int(x) for x in header.cpu().tolist())
        if size:
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            if self.rank == 0:
                data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(data, src=self._src(), group=self.group)
            policy = Policy.from_dict(json.loads(data.cpu().numpy().tobytes().decode()),
                                      source="announced policy")
            self._pending = (switch_step, policy)
            self.revision = revision
        if probe:
            self._probe()

    def _src(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _probe(self) -> None:
        buf = torch.ones(PROBE_BYTES // 4, device=self.device)
        start = time.perf_counter()
        dist.all_reduce(buf, group=self.group)
        if self.rank == 0:
            with self._lock:
                self._window.probes.append((PROBE_BYTES, time.perf_counter() - start))

    def _apply(self, step: int, policy: Policy) -> None:
        old = self.state.policy
        self.state.set_policy(policy)
        event = {"event": "switch", "step": self.step, "announced_step": step,
                 "revision": self.revision, "old_policy": old.id, "new_policy": policy.id}
        self._log(event)
        if self.rank == 0:
            with self._lock:
                self._ref = None  # re-baseline drift detection on the new policy
                self._settle = 1
                self._strikes = 0
        logger.info("switched to policy %s at step %d", policy.id, self.step)

    # ----------------------------------------------------------- rank 0 logic
    def model(self) -> CostModel:
        if self._model is None:
            from autotune.models.cost_model import CostModel

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

    def _decide(self) -> tuple[bytes, int]:
        """Rank 0 at a check: update drift state; return a policy to announce, if any."""
        model = self.model()
        with self._lock:
            window, self._window = self._window, _Window()
            proposal, self._proposal = self._proposal, None
        scale, own, _ = self._link_scale(window)
        # probe at the next check when the policy itself moves too little data
        self._probe_next = own < LARGE_BYTES
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
                self._ref = (ratio, self._scale)
            return b"", 0
        ref_ratio, ref_scale = self._ref
        step_dev = abs(ratio / ref_ratio - 1)
        link_dev = abs(math.log(self._scale / ref_scale))
        drifting = step_dev > self.config.threshold or link_dev > math.log1p(self.config.link_threshold)
        self._strikes = self._strikes + 1 if drifting else 0
        if self._strikes >= self.config.patience and (self._search is None or not self._search.is_alive()):
            self._strikes = 0
            reason = {"event": "drift", "step": self.step, "measured_step_s": measured,
                      "predicted_step_s": predicted, "step_ratio_change": ratio / ref_ratio,
                      "link_scale": self._scale, "link_bps_estimate": link,
                      "policy": self.state.policy.id}
            self._log(reason)
            self._start_search(link, reason)
        return b"", 0

    def _start_search(self, link_bps: float | None, reason: dict[str, Any]) -> None:
        current = self.state.policy

        def run() -> None:
            try:
                self._research(current, link_bps, reason)
            except Exception as exc:  # noqa: BLE001 - a failed search keeps the policy
                logger.warning("online re-search failed, keeping the policy: %s", exc)
                self._log({"event": "search_failed", "step": self.step, "error": str(exc)})

        self._search = threading.Thread(target=run, name="autotune-research", daemon=True)
        self._search.start()

    def _research(self, current: Policy, link_bps: float | None, reason: dict[str, Any]) -> None:
        from autotune.models.simulator import WhatIf
        from autotune.search.tuner import DEFAULT_MAX_ERROR, tune

        model = self.model()
        what_if = WhatIf(bandwidth_bps=link_bps) if link_bps else WhatIf()
        max_error = self.config.max_error
        if max_error is None:
            max_error = float(current.meta.get("max_error", DEFAULT_MAX_ERROR))
        started = time.perf_counter()
        result = tune(self.profile, max_error=max_error, trials=self.config.trials,
                      model=model, what_if=what_if, pinned=dict(self.config.pinned),
                      caps=(current.bucket_cap_mb,), seeds=[current, *self._top],
                      timeout=self.config.budget_s, study_name=f"online-{self.revision + 1}")
        self._top = [c.policy for c in result.top]
        now = model.predict(current, what_if).step_s
        new = result.policy
        gain = 1 - result.policy.meta["predicted_step_s"] / now
        info = {"reason": "drift", "search_s": time.perf_counter() - started,
                "predicted_current_s": now, "predicted_new_s": new.meta["predicted_step_s"],
                "link_bps_estimate": link_bps, "trigger": reason}
        if new.id != current.id and gain >= self.config.min_gain:
            self.propose(new.with_meta(online_revision=self.revision + 1), reason="drift")
            with self._lock:
                if self._proposal is not None:
                    self._proposal = (self._proposal[0], info)
        else:
            self._log({"event": "keep", "step": self.step, "policy": current.id, **info})
            with self._lock:
                self._ref = None  # the change is understood: re-baseline on it
                self._settle = 0

    # ----------------------------------------------------------------- logging
    def _log(self, event: dict[str, Any]) -> None:
        event = {"time": time.time(), "rank": self.rank, **event}
        self.events.append(event)
        if self.config.log is not None and self.rank == 0:
            with open(self.config.log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(event, default=str) + "\n")
