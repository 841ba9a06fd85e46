"""What online revision and the auto mode can be told: :class:`OnlineConfig`.

Apart from the controller, so that ``autotune.wrap`` checks its knobs without loading
what the controller needs (the cost model, scikit-learn, the search) unless asked to
revise online.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.errors import AutotuneError

__all__ = ["AUTO_KNOBS", "OnlineConfig"]


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
        patience_s: ... and, when the step moved but the link held (compute drift),
            seconds it must have lasted (from the start of its first window): with
            short steps a few checks span a fraction of a second, which a CPU running
            1.5x slower for seconds at a time outlasts (auto runs of 14 ms steps
            re-searched on it). A moved link is acted on after ``patience`` checks.
        budget_s: wall seconds the background re-search may take.
        trials: Optuna trials of a re-search.
        min_gain: a new policy must be predicted this much faster to be switched to.
        max_error: compression-error budget of the re-search (default: the policy's).
        pinned: parameter name -> compressor spec the revision must not change.
        lead_steps: a policy announced at a check applies this many steps later.
        log: JSONL file every decision is appended to (None: keep in memory only).
        explore_steps: ``wrap(model, "auto")`` only: steps the live trials may take in
            all (after the profile's steps). More steps separate closer contenders;
            each losing one costs a few degraded steps.
        trial_steps: auto: timed steps per trial block (each adds a settling step).
        candidates: auto: tuned candidates tried besides the presets' equivalents.
        profile_steps: auto: steps of plain DDP timed as the reference, and as many
            instrumented for the profile (at least 2).
        network_budget_s: auto: seconds of the network probe every rank joins once, at
            most (it is also held to about 20 steps of the DDP start).
        save: auto: where rank 0 writes the chosen policy when it settles.
    """

    check_every: int = 5
    threshold: float = 0.5
    link_threshold: float = 1.0
    patience: int = 2
    patience_s: float = 3.0
    budget_s: float = 10.0
    trials: int = 60
    min_gain: float = 0.05
    max_error: float | None = None
    pinned: Mapping[str, Any] = field(default_factory=dict)
    lead_steps: int = 1
    log: str | os.PathLike[str] | None = None
    explore_steps: int = 90
    trial_steps: int = 2
    candidates: int = 3
    profile_steps: int = 4
    network_budget_s: float = 1.0
    save: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.check_every < 1 or self.patience < 1 or self.lead_steps < 1:
            raise AutotuneError("check_every, patience and lead_steps must be >= 1")
        if not (self.threshold > 0 and self.link_threshold > 0):
            raise AutotuneError("threshold and link_threshold must be > 0")
        for name, low in (("trial_steps", 1), ("candidates", 0), ("profile_steps", 2),
                          ("trials", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise AutotuneError(f"{name} must be an integer >= {low}, got {value!r}")
        block = 2 * (self.trial_steps + 1)
        if isinstance(self.explore_steps, bool) or not isinstance(self.explore_steps, int) or (
                self.explore_steps < block):
            raise AutotuneError(
                f"explore_steps must be an integer >= {block} (one block of the policy in "
                f"force and one of a contender, trial_steps={self.trial_steps} timed steps "
                f"plus a settling step each), got {self.explore_steps!r}")
        if isinstance(self.patience_s, bool) or not isinstance(self.patience_s, (int, float)) or (
                not 0 <= self.patience_s < math.inf):
            raise AutotuneError(
                f"patience_s must be a number of seconds >= 0, got {self.patience_s!r}")
        for name in ("budget_s", "network_budget_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < math.inf):
                raise AutotuneError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.max_error is not None and not (
                isinstance(self.max_error, (int, float)) and 0 <= self.max_error < math.inf):
            raise AutotuneError(f"max_error must be a finite number >= 0, got {self.max_error!r}")
        if not isinstance(self.pinned, Mapping):
            raise AutotuneError(f"pinned must map parameter names to compressor specs, "
                                f"got {type(self.pinned).__name__}")


AUTO_KNOBS = frozenset({"explore_steps", "trial_steps", "candidates", "profile_steps",
                        "network_budget_s", "save"})
"""The knobs that only ``wrap(model, "auto")`` reads."""
