"""The tuner: an Optuna study over the search space, a per-layer refinement, and the
guard that never emits a policy predicted to lose to a baseline.

1. **Baselines first.** Plain DDP at several bucket sizes, fp16, PowerSGD rank 1 and 4
   everywhere are predicted exactly and enqueued as the study's first trials; so is
   rowsparse on the row-sparse parameters (embedding tables), where there are any.
2. **Joint search.** TPE (seeded, so a profile and a seed give one policy) over the
   bucket cap and one compressor per parameter group; objective: predicted step time;
   constraint: the policy's compression error <= ``max_error`` (Optuna's
   ``Trial.set_constraint``: infeasible trials inform the sampler but never win).
3. **Refinement.** L-GreCo-style per-layer pass over the largest tensors of the best
   trial: try every option of each layer's group and keep a change when it lowers the
   predicted step within the error budget; then re-pick the bucket cap.
4. **Guard.** If the tuned policy is not predicted to beat the best feasible baseline,
   that baseline is emitted instead.

Studies live in memory, or in any Optuna storage (``sqlite:///study.db``) where a study
of the same name is resumed and can be opened with optuna-dashboard.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from autotune.compressors import PLAIN, REGISTRY
from autotune.errors import AutotuneError, ProfileError
from autotune.models.cost_model import CostModel
from autotune.models.simulator import WhatIf
from autotune.policies import Policy
from autotune.presets import DDP_BUCKET_CAP_MB, DEFAULT_PRESETS, PRESETS
from autotune.probes.profile import Profile
from autotune.search.defaults import DEFAULT_MAX_ERROR
from autotune.search.space import ErrorModel, SearchSpace, label_of

__all__ = ["DEFAULT_MAX_ERROR", "Candidate", "TuneResult", "baseline_policies", "baselines", "tune"]

logger = logging.getLogger(__name__)

REFINE_LAYERS = 48  # largest tensors refined one by one


@dataclass(frozen=True)
class Candidate:
    """A policy with its prediction."""

    name: str
    policy: Policy
    predicted_s: float
    error: float
    feasible: bool

    def row(self, reference_s: float) -> dict[str, Any]:
        return {"name": self.name, "predicted_step_s": self.predicted_s,
                "speedup": reference_s / self.predicted_s, "error": self.error,
                "feasible": self.feasible, "policy_id": self.policy.id}


@dataclass
class TuneResult:
    """What tuning found: the emitted policy and everything it was compared with."""

    policy: Policy  # what to use (the tuned policy, or the best baseline)
    chosen: str  # "tuned" or a baseline's name
    tuned: Candidate
    baselines: list[Candidate]
    top: list[Candidate] = field(default_factory=list)  # best distinct study trials
    # the best predicted exact trial (error 0) that compresses something, when not in top
    exact: Candidate | None = None
    trials: int = 0
    wall_s: float = 0.0


def baseline_policies() -> dict[str, Policy | None]:
    """The default presets (:data:`~autotune.presets.DEFAULT_PRESETS`) as policies, by
    name: plain DDP as users construct it (None: DDP's default buckets, with its small
    first bucket), the others our equivalents. What ``autotune simulate``, ``demo`` and
    the report predict."""
    return {p.name: None if p.plain else Policy.from_dict(p.policy(None)) for p in DEFAULT_PRESETS}


def baselines(space: SearchSpace, model: CostModel, errors: ErrorModel,
              max_error: float, what_if: WhatIf | None = None) -> list[Candidate]:
    """The hand-picked set-ups a user would try, predicted exactly: our equivalent of
    every preset (:mod:`autotune.presets`) at each of its bucket caps."""
    out = []
    policies = [(name, Policy.from_dict(p.policy(cap))) for p in PRESETS for name, cap in p.variants()]
    for name, policy in policies:
        try:
            err = errors.of(policy)
        except ProfileError as exc:  # a profile taken with a grid that lacks it
            logger.warning("baseline %s left out: %s", name, exc)
            continue
        pred = model.predict(policy, what_if).step_s
        out.append(Candidate(name, policy.with_meta(baseline=name), pred, err, err <= max_error))
    return out


def tune(
    profile: Profile,
    max_error: float = DEFAULT_MAX_ERROR,
    trials: int = 200,
    seed: int = 0,
    storage: str | None = None,
    study_name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    refine: bool = True,
    top_k: int = 3,
    model: CostModel | None = None,
    what_if: WhatIf | None = None,
    pinned: dict[str, Any] | None = None,
    caps: tuple[float, ...] | None = None,
    seeds: list[Policy] | None = None,
    timeout: float | None = None,
) -> TuneResult:
    """Search the best policy for ``profile``.

    Args:
        profile: the profile to tune on.
        max_error: compression-error budget (see :class:`ErrorModel`).
        trials: Optuna trials in this run (a resumed study adds this many).
        seed: TPE's seed: the same profile and seed give the same policy.
        storage: an Optuna storage URL (e.g. ``sqlite:///study.db``), or None for memory.
        study_name: the study to create or resume (default: ``autotune-<fingerprint>``).
        progress: called with (trials done, trials) after each trial.
        refine: run the per-layer refinement of the best trial.
        top_k: distinct best trials to keep (``--verify`` measures them).
        model: a fitted cost model (default: fitted from ``profile``).
        what_if: tune for another cluster (e.g. the link the online controller measured).
        pinned: parameter name -> compressor spec the search keeps fixed.
        caps: bucket caps to search (one value pins it).
        seeds: policies enqueued after the baselines (warm start).
        timeout: seconds after which the study stops, even before ``trials``.
    """
    import optuna

    if not (max_error >= 0 and math.isfinite(max_error)):
        raise AutotuneError(f"max_error must be a finite number >= 0, got {max_error!r}")
    if trials < 1:
        raise AutotuneError(f"trials must be >= 1, got {trials}")
    started = time.perf_counter()
    model = model or CostModel.fit(profile)
    space = SearchSpace.from_profile(profile, pinned=pinned, **({"caps": caps} if caps else {}))
    errors = ErrorModel(profile)
    base = baselines(space, model, errors, max_error, what_if)
    if caps is not None or pinned:
        # baselines outside the pinned settings are shown, but cannot be emitted
        allowed = {c for c in space.caps}
        base = [b if b.policy.bucket_cap_mb in allowed and not pinned else
                Candidate(b.name, b.policy, b.predicted_s, b.error, False) for b in base]

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(
        seed=seed, multivariate=True, n_startup_trials=min(20, trials),
    )
    name = study_name or f"autotune-{profile.fingerprint}"
    study = optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    if study.user_attrs.get("profile_fingerprint") not in (None, profile.fingerprint):
        raise AutotuneError(
            f"study {name!r} was tuned on profile {study.user_attrs['profile_fingerprint']}, "
            f"not {profile.fingerprint}; use another --study-name"
        )
    study.set_user_attr("profile_fingerprint", profile.fingerprint)
    study.set_user_attr("max_error", max_error)
    if not study.trials:
        for params in _baseline_params(space):
            study.enqueue_trial(params, skip_if_exists=True)
    for seed_policy in seeds or []:
        cap = seed_policy.bucket_cap_mb if seed_policy.bucket_cap_mb in space.caps else space.caps[0]
        study.enqueue_trial({"bucket_cap_mb": cap, **space.choice_of(seed_policy)},
                            skip_if_exists=True)

    def objective(trial: optuna.Trial) -> float:
        cap = trial.suggest_categorical("bucket_cap_mb", list(space.caps))
        choice = {g.key: trial.suggest_categorical(g.key, list(g.options)) for g in space.groups}
        policy = space.policy(cap, choice)
        err = errors.of(policy)
        trial.set_user_attr("error", err)
        # feasible when <= 0: infeasible trials inform the sampler but never win
        trial.set_constraint("error", err - max_error)
        return model.predict(policy, what_if).step_s

    done = [0]

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], trials)

    study.optimize(objective, n_trials=trials, callbacks=[callback], timeout=timeout)

    ranked = _ranked_trials(study, space, max_error)
    if not ranked:
        raise AutotuneError(
            f"no policy within max_error={max_error:g} was found; even the baselines exceed "
            "it? Raise --max-error"
        )
    top = []
    seen: set[str] = set()
    for cap, choice, _ in ranked:
        policy = space.policy(cap, choice)
        if policy.id in seen:
            continue
        seen.add(policy.id)
        top.append(Candidate(f"trial{len(top) + 1}", policy, model.predict(policy, what_if).step_s,
                             errors.of(policy), True))
        if len(top) >= top_k:
            break
    exact = _best_exact(space, model, errors, ranked, seen, what_if)
    best = top[0]
    if refine:
        best = _refine(space, model, errors, max_error, *ranked[0][:2], what_if=what_if)
    feasible = [b for b in base if b.feasible]
    best_base = min(feasible, key=lambda b: b.predicted_s) if feasible else best
    meta = {
        "tool": "autotune tune",
        "seed": seed,
        "max_error": max_error,
        "profile_fingerprint": profile.fingerprint,
        "workload": profile.workload.get("name"),
        "trials": len(study.trials),
        "study_name": name,
        "predicted_step_s": best.predicted_s,
        "error": best.error,
        "baselines": {b.name: {"predicted_step_s": b.predicted_s, "error": b.error,
                               "feasible": b.feasible} for b in base},
    }
    if best is best_base or best.predicted_s < best_base.predicted_s:
        chosen, emitted = "tuned", best.policy.with_meta(**meta, chosen="tuned")
    else:
        logger.info("the tuned policy (%.4f s) does not beat %s (%.4f s): emitting the baseline",
                    best.predicted_s, best_base.name, best_base.predicted_s)
        meta.update(predicted_step_s=best_base.predicted_s, error=best_base.error)
        chosen, emitted = best_base.name, best_base.policy.with_meta(**meta, chosen=best_base.name)
    return TuneResult(policy=emitted, chosen=chosen, tuned=best, baselines=base, top=top,
                      exact=exact, trials=len(study.trials), wall_s=time.perf_counter() - started)


def _best_exact(space: SearchSpace, model: CostModel, errors: ErrorModel,
                ranked: list[tuple[float, dict[str, str], float]], seen: set[str],
                what_if: WhatIf | None) -> Candidate | None:
    """The fastest-predicted trial of error 0 (e.g. rowsparse on the embeddings, plain
    allreduce elsewhere) outside ``seen``, unless it is plain DDP at some bucket size
    (the baselines cover that), so that verification always measures the best exact
    option beside the lossy ones."""
    for cap, choice, _ in ranked:
        policy = space.policy(cap, choice)
        if policy.id in seen or errors.of(policy) != 0.0:
            continue
        specs = [policy.default, *policy.layers.values()]
        if all(spec == PLAIN for spec in specs):
            continue
        return Candidate("exact", policy, model.predict(policy, what_if).step_s, 0.0, True)
    return None


def _baseline_params(space: SearchSpace) -> list[dict[str, Any]]:
    """The baselines in the study's own terms, so TPE starts from them."""
    out = []
    cap = DDP_BUCKET_CAP_MB if DDP_BUCKET_CAP_MB in space.caps else space.caps[0]
    for p in DEFAULT_PRESETS:
        label = label_of(p.spec)
        if p.plain:  # plain DDP at each of its caps that the space has
            out += [{"bucket_cap_mb": c, **space.uniform_choice(label)} for c in p.caps if c in space.caps]
        elif label in space.specs:  # a method everywhere, at DDP's default cap (or the first)
            out.append({"bucket_cap_mb": cap, **space.uniform_choice(label)})
    # data-dependent methods (the exact exchange of non-zero rows) on the groups they are
    # offered to (row-sparse ones)
    for label, spec in space.specs.items():
        if REGISTRY.get(spec.name).density_dependent and any(label in g.options for g in space.groups):
            out.append({"bucket_cap_mb": cap, **space.uniform_choice(label)})
    return out


def _ranked_trials(study: Any, space: SearchSpace, max_error: float) -> list[tuple[float, dict[str, str], float]]:
    import optuna

    rows = []
    for t in study.trials:
        if t.state != optuna.trial.TrialState.COMPLETE or t.value is None:
            continue
        if t.user_attrs.get("error", math.inf) > max_error:
            continue
        if "bucket_cap_mb" not in t.params or any(g.key not in t.params for g in space.groups):
            continue
        rows.append((float(t.params["bucket_cap_mb"]), {g.key: t.params[g.key] for g in space.groups},
                     float(t.value)))
    rows.sort(key=lambda r: r[2])
    return rows


def _refine(space: SearchSpace, model: CostModel, errors: ErrorModel, max_error: float,
            cap: float, choice: dict[str, str], what_if: WhatIf | None = None) -> Candidate:
    """Greedy per-layer improvement of one policy, then the best bucket cap for it."""
    layers: dict[str, str] = {n: choice[g.key] for g in space.groups for n in g.params}
    free = [n for n in space.params if n not in space.pinned]
    largest = sorted(free, key=lambda n: -math.prod(space.params[n]))[:REFINE_LAYERS]

    def evaluate(cap_: float, layers_: dict[str, str]) -> tuple[float, float]:
        policy = space.policy(cap_, choice, layers_)
        return model.predict(policy, what_if).step_s, errors.of(policy)

    best_t, best_e = evaluate(cap, layers)
    for _ in range(2):  # passes
        improved = False
        for name in largest:
            current = layers[name]
            for option in space.group_of(name).options:
                if option == current:
                    continue
                layers[name] = option
                t, e = evaluate(cap, layers)
                if e <= max_error and t < best_t * (1 - 1e-6):
                    best_t, best_e, current, improved = t, e, option, True
                layers[name] = current
        if not improved:
            break
    for other in space.caps:
        t, e = evaluate(other, layers)
        if t < best_t * (1 - 1e-6):
            best_t, best_e, cap = t, e, other
    policy = space.policy(cap, choice, layers)
    return Candidate("tuned", policy, best_t, best_e, best_e <= max_error)
