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

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from autotune.compressors import PLAIN, REGISTRY
from autotune.errors import AutotuneError, ProfileError
from autotune.models.cost_model import CostModel
from autotune.models.simulator import WhatIf
from autotune.policies import Policy
from autotune.presets import DDP_BUCKET_CAP_MB, DEFAULT_PRESETS, PRESETS
from autotune.probes.profile import Profile
from autotune.search.defaults import DEFAULT_MAX_ERROR
from autotune.search.space import TOPOLOGY, ErrorModel, SearchSpace, label_of

__all__ = ["DEFAULT_MAX_ERROR", "Candidate", "TuneConfig", "TuneResult", "baseline_policies",
           "baselines", "tune"]

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
    # policy id of a hierarchical candidate (tuned, top, exact) -> the same policy flat,
    # predicted: verification measures both, since the intra-host stages' cost is the
    # hardest part of a step to predict (CPU ranks sharing cores)
    flat: dict[str, Candidate] = field(default_factory=dict)


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


@dataclass(frozen=True)
class TuneConfig:
    """How :func:`tune` searches (``tune(profile, config)``, or its fields as keywords).

    Attributes:
        max_error: compression-error budget (see :class:`ErrorModel`); 0 allows only
            exact methods. :data:`DEFAULT_MAX_ERROR` is justified by bench/convergence.py.
        trials: Optuna trials in this run (a resumed study adds this many); 200 settles
            on the built-in workloads, more rarely pays (the refinement follows).
        seed: TPE's seed: the same profile and seed give the same policy.
        storage: an Optuna storage URL (e.g. ``sqlite:///study.db``), or None for memory.
        study_name: the study to create or resume (default: ``autotune-<fingerprint>``).
        refine: run the per-layer refinement of the best trial.
        top_k: distinct best trials to keep (verification measures them).
        what_if: tune for another cluster (e.g. the link the online controller measured).
        pinned: parameter name -> compressor spec the search keeps fixed.
        caps: bucket caps to search (one value pins it; None: the whole grid).
        seeds: policies enqueued after the baselines (warm start).
        timeout: seconds after which the study stops, even before ``trials``.
    """

    max_error: float = DEFAULT_MAX_ERROR
    trials: int = 200
    seed: int = 0
    storage: str | None = None
    study_name: str | None = None
    refine: bool = True
    top_k: int = 3
    what_if: WhatIf | None = None
    pinned: Mapping[str, Any] | None = None
    caps: tuple[float, ...] | None = None
    seeds: Sequence[Policy] = ()
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not (self.max_error >= 0 and math.isfinite(self.max_error)):
            raise AutotuneError(f"max_error must be a finite number >= 0, got {self.max_error!r}")
        if self.trials < 1:
            raise AutotuneError(f"trials must be >= 1, got {self.trials}")
        object.__setattr__(self, "seeds", tuple(self.seeds or ()))


def tune(
    profile: Profile,
    config: TuneConfig | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    model: CostModel | None = None,
    **options: Any,
) -> TuneResult:
    """Search the best policy for ``profile``: the baselines predicted, an Optuna study
    started from them, the best trial refined per layer, and the guard.

    Args:
        profile: the profile to tune on.
        config: how to search (default: :class:`TuneConfig`'s defaults).
        progress: called with (trials done, trials) after each trial.
        model: a fitted cost model (default: fitted from ``profile``).
        **options: :class:`TuneConfig` fields, overriding ``config``'s
            (``tune(profile, trials=40, seed=7)``).

    Raises:
        AutotuneError: a bad option, a study of another profile, or no policy within
            ``max_error``.
    """
    if config is not None and not isinstance(config, TuneConfig):
        raise AutotuneError(f"config must be a TuneConfig, got {type(config).__name__}; give "
                            "the other options as keywords (tune(profile, max_error=0.3))")
    cfg = dataclasses.replace(config or TuneConfig(), **options)
    started = time.perf_counter()
    model = model or CostModel.fit(profile)
    space = SearchSpace.from_profile(profile, pinned=cfg.pinned,
                                     **({"caps": cfg.caps} if cfg.caps else {}))
    if _topology_searched(model, cfg.what_if):
        space.topologies = ("flat", "hierarchical")
    errors = ErrorModel(profile)
    base = _baselines_allowed(space, model, errors, cfg)
    study = _open_study(profile, space, cfg)
    _search(study, space, model, errors, cfg, progress)

    ranked = _ranked_trials(study, space, cfg.max_error)
    if not ranked:
        raise AutotuneError(
            f"no policy within max_error={cfg.max_error:g} was found; even the baselines exceed "
            "it? Raise --max-error"
        )
    top, seen = _top_trials(space, model, errors, ranked, cfg)
    exact = _best_exact(space, model, errors, ranked, seen, cfg.what_if)
    best = top[0]
    if cfg.refine:
        best = _refine(space, model, errors, cfg.max_error, *ranked[0][:2], what_if=cfg.what_if)
    meta = _meta(profile, cfg, study, best, base)
    chosen, emitted = _guard(best, base, meta)
    flat = {c.policy.id: _flat_twin(c, model, cfg.what_if)
            for c in [best, *top, *([exact] if exact else [])] if c.policy.topology != "flat"}
    return TuneResult(policy=emitted, chosen=chosen, tuned=best, baselines=base, top=top,
                      exact=exact, trials=len(study.trials), wall_s=time.perf_counter() - started,
                      flat=flat)


def _flat_twin(c: Candidate, model: CostModel, what_if: WhatIf | None) -> Candidate:
    """``c``'s policy with a flat exchange, predicted (the same compressors: the same error)."""
    policy = Policy.from_dict(c.policy.to_dict() | {"topology": "flat"})
    return Candidate(f"{c.name}-flat", policy, model.predict(policy, what_if or WhatIf()).step_s,
                     c.error, c.feasible)


def _topology_searched(model: CostModel, what_if: WhatIf | None) -> bool:
    """Whether the (what-if) cluster has several hosts of several ranks and an intra-host
    link to predict a hierarchical exchange on: then the study searches the topology."""
    what_if = what_if or WhatIf()
    try:
        layout = model.layout(what_if, what_if.world_size or model.world_size)
    except ProfileError:
        return False
    return layout.hierarchical and (model.intra is not None or what_if.intra_bandwidth_bps is not None)


def _baselines_allowed(space: SearchSpace, model: CostModel, errors: ErrorModel,
                       cfg: TuneConfig) -> list[Candidate]:
    """The baselines predicted; with caps or parameters pinned, those outside them are
    shown but cannot be emitted (not feasible)."""
    base = baselines(space, model, errors, cfg.max_error, cfg.what_if)
    if cfg.caps is not None or cfg.pinned:
        allowed = {c for c in space.caps}
        base = [b if b.policy.bucket_cap_mb in allowed and not cfg.pinned else
                Candidate(b.name, b.policy, b.predicted_s, b.error, False) for b in base]
    return base


def _open_study(profile: Profile, space: SearchSpace, cfg: TuneConfig) -> Any:
    """Create or resume the study (refusing one of another profile); a new one starts
    from the baselines, and any study from the seed policies."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(
        seed=cfg.seed, multivariate=True, n_startup_trials=min(20, cfg.trials),
    )
    name = cfg.study_name or f"autotune-{profile.fingerprint}"
    study = optuna.create_study(storage=cfg.storage, study_name=name, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    if study.user_attrs.get("profile_fingerprint") not in (None, profile.fingerprint):
        raise AutotuneError(
            f"study {name!r} was tuned on profile {study.user_attrs['profile_fingerprint']}, "
            f"not {profile.fingerprint}; use another --study-name"
        )
    study.set_user_attr("profile_fingerprint", profile.fingerprint)
    study.set_user_attr("max_error", cfg.max_error)
    if not study.trials:
        for params in _baseline_params(space):
            study.enqueue_trial(params, skip_if_exists=True)
    for seed_policy in cfg.seeds:
        cap = seed_policy.bucket_cap_mb if seed_policy.bucket_cap_mb in space.caps else space.caps[0]
        study.enqueue_trial({"bucket_cap_mb": cap, **space.choice_of(seed_policy)},
                            skip_if_exists=True)
    return study


def _search(study: Any, space: SearchSpace, model: CostModel, errors: ErrorModel,
            cfg: TuneConfig, progress: Callable[[int, int], None] | None) -> None:
    """Run the study's trials: the cap and one option per group, the predicted step as
    the objective, the error budget as Optuna's constraint."""
    import optuna

    def objective(trial: optuna.Trial) -> float:
        cap = trial.suggest_categorical("bucket_cap_mb", list(space.caps))
        choice = {g.key: trial.suggest_categorical(g.key, list(g.options)) for g in space.groups}
        if len(space.topologies) > 1:
            choice[TOPOLOGY] = trial.suggest_categorical(TOPOLOGY, list(space.topologies))
        policy = space.policy(cap, choice)
        err = errors.of(policy)
        trial.set_user_attr("error", err)
        # feasible when <= 0: infeasible trials inform the sampler but never win
        trial.set_constraint("error", err - cfg.max_error)
        return model.predict(policy, cfg.what_if).step_s

    done = [0]

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], cfg.trials)

    study.optimize(objective, n_trials=cfg.trials, callbacks=[callback], timeout=cfg.timeout)


def _top_trials(space: SearchSpace, model: CostModel, errors: ErrorModel,
                ranked: list[tuple[float, dict[str, str], float]],
                cfg: TuneConfig) -> tuple[list[Candidate], set[str]]:
    """The ``top_k`` best distinct policies among the ranked trials, and the ids seen."""
    top: list[Candidate] = []
    seen: set[str] = set()
    for cap, choice, _ in ranked:
        policy = space.policy(cap, choice)
        if policy.id in seen:
            continue
        seen.add(policy.id)
        top.append(Candidate(f"trial{len(top) + 1}", policy,
                             model.predict(policy, cfg.what_if).step_s, errors.of(policy), True))
        if len(top) >= cfg.top_k:
            break
    return top, seen


def _meta(profile: Profile, cfg: TuneConfig, study: Any, best: Candidate,
          base: list[Candidate]) -> dict[str, Any]:
    """What the emitted policy records about its tuning."""
    return {
        "tool": "autotune tune",
        "seed": cfg.seed,
        "max_error": cfg.max_error,
        "profile_fingerprint": profile.fingerprint,
        "workload": profile.workload.name,
        "trials": len(study.trials),
        "study_name": study.study_name,
        "predicted_step_s": best.predicted_s,
        "error": best.error,
        "baselines": {b.name: {"predicted_step_s": b.predicted_s, "error": b.error,
                               "feasible": b.feasible} for b in base},
    }


def _guard(best: Candidate, base: list[Candidate], meta: dict[str, Any]) -> tuple[str, Policy]:
    """The tuned policy, unless the best feasible baseline is predicted at least as
    fast: then that baseline. ``(chosen, emitted policy with meta)``."""
    feasible = [b for b in base if b.feasible]
    best_base = min(feasible, key=lambda b: b.predicted_s) if feasible else best
    if best is best_base or best.predicted_s < best_base.predicted_s:
        return "tuned", best.policy.with_meta(**meta, chosen="tuned")
    logger.info("the tuned policy (%.4f s) does not beat %s (%.4f s): emitting the baseline",
                best.predicted_s, best_base.name, best_base.predicted_s)
    meta = {**meta, "predicted_step_s": best_base.predicted_s, "error": best_base.error}
    return best_base.name, best_base.policy.with_meta(**meta, chosen=best_base.name)


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
        choice = {g.key: t.params[g.key] for g in space.groups}
        if TOPOLOGY in t.params and t.params[TOPOLOGY] in space.topologies:
            choice[TOPOLOGY] = t.params[TOPOLOGY]
        rows.append((float(t.params["bucket_cap_mb"]), choice, float(t.value)))
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
    if len(space.topologies) > 1:  # and the other topology, with the rest as found
        flipped = {**choice, TOPOLOGY: next(
            x for x in space.topologies if x != choice.get(TOPOLOGY, "flat"))}
        kept, choice = choice, flipped  # evaluate() reads choice
        t, e = evaluate(cap, layers)
        if t < best_t * (1 - 1e-6):
            best_t, best_e = t, e
        else:
            choice = kept
    policy = space.policy(cap, choice, layers)
    return Candidate("tuned", policy, best_t, best_e, best_e <= max_error)
