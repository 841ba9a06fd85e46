"""What the report shows, computed from a profile and the optional inputs; no plotting.

Everything here is a prediction of the cost model fitted to the profile
(:class:`~autotune.models.cost_model.CostModel`), or a measurement read from a file the
user gave: a bench result (``autotune bench --json``, or
``bench/results/tuned_vs_baselines.json``), an Optuna study written by ``autotune tune
--storage``, or an online revision log (the controller's JSONL). Predictions at the
measured cluster carry the learned calibration; what-ifs at other link rates are the
timeline model alone (the calibration was learnt at the measured link only).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from autotune.compressors import PLAIN
from autotune.errors import AutotuneError
from autotune.jsonio import json_type, read_json
from autotune.links import parse_link
from autotune.models.cost_model import CostModel
from autotune.models.simulator import StepEstimate, WhatIf
from autotune.policies import Policy
from autotune.probes.profile import Profile
from autotune.search.space import ErrorModel, label_of

__all__ = [
    "Timeline", "Sweep", "Trial", "StudyView", "LayerRow", "Measured", "ReportData",
    "load_bench", "load_revisions", "load_study", "gather", "pareto_front", "rate_label",
]

# Each point is one simulated step per configuration (tens of ms for a CNN on a busy
# CPU): 6 points a decade draw smooth curves; 7 halvings of the interval between two
# points locate a crossover within 1%.
POINTS_PER_DECADE = 6
SWEEP_RANGE_BPS = (1e7, 1e11)  # 10 Mbit/s .. 100 Gbit/s, widened to hold the measured link
_BISECT = 7


@dataclass(frozen=True)
class Timeline:
    """One predicted step at the measured cluster."""

    name: str
    estimate: StepEstimate  # spans of the timeline model; ``step_s`` is calibrated


@dataclass(frozen=True)
class Sweep:
    """Predicted step time against link rate (timeline model, no calibration)."""

    rates_bps: tuple[float, ...]
    step_s: Mapping[str, tuple[float, ...]]  # configuration -> one value per rate
    compressing: frozenset[str]  # configurations that compress some gradient
    # configuration -> the highest rate at which it beats plain DDP (None: at no rate of
    # the sweep; the sweep's top rate: still there)
    pays_below_bps: Mapping[str, float | None]
    at_link_s: Mapping[str, float]  # calibrated prediction at the measured link

    @property
    def compression_pays_by(self) -> str | None:
        """The compressing configuration that beats plain DDP up to the highest rate."""
        rates = {n: r for n, r in self.pays_below_bps.items() if n in self.compressing and r}
        return max(rates, key=rates.__getitem__) if rates else None

    @property
    def compression_pays_below_bps(self) -> float | None:
        """The link rate below which some compressing configuration beats plain DDP."""
        best = self.compression_pays_by
        return None if best is None else self.pays_below_bps[best]


@dataclass(frozen=True)
class Trial:
    number: int
    step_s: float  # the study's objective: predicted step time
    error: float  # compression error (user attribute ``error``)
    feasible: bool  # within the study's error budget


@dataclass(frozen=True)
class StudyView:
    name: str
    trials: tuple[Trial, ...]
    front: tuple[int, ...]  # indices into ``trials`` of the Pareto front, by step time
    max_error: float | None  # the study's error budget


@dataclass(frozen=True)
class LayerRow:
    name: str
    shape: tuple[int, ...]
    grad_bytes: int
    ready_ms: float | None  # gradient ready, ms after backward starts
    backward_ms: float | None  # backward time of the module that owns the parameter
    compressor: str  # label of the chosen compressor ("none": plain allreduce)
    error_step: float | None  # measured relative error of one step (None: not measured)
    error_cum: float | None  # over the profiled steps, with error feedback


@dataclass(frozen=True)
class Measured:
    """A measured step time next to the model's prediction for the same set-up."""

    config: str
    link: str | None  # the link it was measured on ("loopback" when not shaped)
    rate_bps: float | None
    measured_s: float
    predicted_s: float | None  # None: the report has no policy for this configuration
    calibrated: bool  # the prediction carries the calibration (measured cluster)
    source: str


@dataclass(frozen=True)
class ReportData:
    """Everything the page and the figures show."""

    workload: str
    env: Mapping[str, Any]
    link_bps: float | None
    floor_s: float
    timelines: tuple[Timeline, ...]
    sweep: Sweep | None  # None when the profile has no link rate to scale
    layers: tuple[LayerRow, ...]
    policy: Policy | None = None
    policy_point: tuple[float, float] | None = None  # (predicted step s, error)
    study: StudyView | None = None
    measured: tuple[Measured, ...] = ()
    revisions: tuple[Mapping[str, Any], ...] = ()
    cv_error: Mapping[str, float] = field(default_factory=dict)


def rate_label(bps: float) -> str:
    """A link rate for people: ``1 Gbit``, ``250 Mbit``, ``3.2 Gbit``."""
    for scale, unit in ((1e12, "Tbit"), (1e9, "Gbit"), (1e6, "Mbit"), (1e3, "kbit")):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit"


# --------------------------------------------------------------------- inputs
def load_bench(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Read a bench result: ``autotune bench --json`` or a tuned_vs_baselines result."""
    data = read_json(path, AutotuneError, "bench result")
    if isinstance(data, dict) and isinstance(data.get("results"), list):
        return data
    if isinstance(data, dict) and isinstance(data.get("cells"), list):
        return data
    raise AutotuneError(f"{path}: expected the JSON of `autotune bench --json` (a 'results' array) "
                        f"or bench/results/tuned_vs_baselines.json (a 'cells' array), got "
                        f"{json_type(data)} with keys {', '.join(list(data)[:5]) if isinstance(data, dict) else '-'}")


def load_revisions(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the online controller's JSONL log (one decision per line)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise AutotuneError(f"{path}: cannot read the revision log: {exc}") from exc
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AutotuneError(f"{path}: line {number} is not JSON ({exc.msg}); expected the "
                                "JSONL log of autotune.wrap(..., online=True, log=...)") from None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise AutotuneError(f"{path}: line {number} has no 'event'; expected the JSONL log of "
                                "autotune.wrap(..., online=True, log=...)")
        events.append(event)
    return events


def load_study(storage: str, study_name: str | None, profile: Profile) -> StudyView:
    """The completed trials of an Optuna study written by ``autotune tune --storage``.

    Without ``study_name``: the tuner's default name for this profile, else the only
    study in the storage."""
    import optuna

    if "://" not in storage:
        raise AutotuneError(f"--study must be an Optuna storage URL such as sqlite:///study.db, got {storage!r}")
    if storage.startswith("sqlite:///"):
        # opening a missing SQLite file would silently create an empty one
        db = Path(storage.removeprefix("sqlite:///"))
        if not db.is_file():
            raise AutotuneError(f"{storage}: no such SQLite file ({db})")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        names = optuna.get_all_study_names(storage)
    except Exception as exc:  # noqa: BLE001 - any storage failure is bad input here
        raise AutotuneError(f"{storage}: cannot open the Optuna storage: {exc}") from exc
    if study_name is None:
        default = f"autotune-{profile.fingerprint}"
        if default in names or len(names) == 1:
            study_name = default if default in names else names[0]
        else:
            raise AutotuneError(f"{storage} holds {len(names)} studies ({', '.join(names[:5]) or 'none'}); "
                                "name one with --study-name")
    if study_name not in names:
        raise AutotuneError(f"{storage} has no study {study_name!r}; it holds: {', '.join(names[:5]) or 'none'}")
    study = optuna.load_study(study_name=study_name, storage=storage)
    tuned_on = study.user_attrs.get("profile_fingerprint")
    if tuned_on not in (None, profile.fingerprint):
        raise AutotuneError(f"study {study_name!r} was tuned on profile {tuned_on}, not on this "
                            f"profile ({profile.fingerprint})")
    max_error = study.user_attrs.get("max_error")
    trials = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        error = t.user_attrs.get("error")
        if t.value is None or not isinstance(error, (int, float)):
            continue
        feasible = max_error is None or error <= max_error
        trials.append(Trial(t.number, float(t.value), float(error), feasible))
    if not trials:
        raise AutotuneError(f"study {study_name!r} has no completed trials with an error to show")
    return StudyView(study_name, tuple(trials), pareto_front([(t.step_s, t.error) for t in trials]),
                     float(max_error) if max_error is not None else None)


def pareto_front(points: Sequence[tuple[float, float]]) -> tuple[int, ...]:
    """Indices of the points no other point beats in both coordinates (both minimised),
    ordered by the first."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front: list[int] = []
    best = math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return tuple(front)


# ------------------------------------------------------------------ analysis
def gather(
    profile: Profile,
    baselines: Mapping[str, Policy | None],
    policy: Policy | None = None,
    study: StudyView | None = None,
    bench: Mapping[str, Any] | None = None,
    revisions: Sequence[Mapping[str, Any]] = (),
    model: CostModel | None = None,
) -> ReportData:
    """Predict and collect what the report shows.

    Args:
        profile: the profile the cost model is fitted to.
        baselines: name -> policy (None: plain DDP with its default buckets) to compare
            with; ``autotune report`` passes ``autotune simulate``'s baselines.
        policy: the tuned policy, if any.
        study: trials of the study that produced it (:func:`load_study`).
        bench: a bench result (:func:`load_bench`) to set beside the predictions.
        revisions: the online controller's decisions (:func:`load_revisions`).
        model: a fitted cost model (default: fitted from ``profile``).
    """
    if "ddp" not in baselines or baselines["ddp"] is not None:
        raise AutotuneError("the report compares with plain DDP: baselines must map 'ddp' to None")
    if policy is not None:
        known = set(profile.compute.param_names)
        unknown = sorted(set(policy.layers) - known)
        if unknown:
            raise AutotuneError(f"the policy names parameters the profiled model lacks: "
                                f"{', '.join(unknown[:5])}")
    model = model or CostModel.fit(profile)
    configs: dict[str, Policy | None] = dict(baselines)
    if policy is not None:
        configs["policy"] = policy
    timelines = [Timeline("plain DDP", model.predict(None))]
    if policy is not None:
        chosen = policy.meta.get("chosen", "tuned")
        label = "tuned policy" if chosen == "tuned" else f"policy (the tuner chose baseline {chosen})"
        timelines.append(Timeline(label, model.predict(policy)))
    sweep = _sweep(model, configs)
    if policy is None and sweep is not None:
        # without a policy, show the baseline predicted fastest at the measured link
        best = min((n for n in baselines if n != "ddp"), key=sweep.at_link_s.__getitem__, default=None)
        if best is not None:
            timelines.append(Timeline(f"{best} (fastest baseline here)", model.predict(baselines[best])))
    point = None
    if policy is not None:
        point = (model.predict(policy).step_s, ErrorModel(profile).of(policy))
    return ReportData(
        workload=profile.workload.name,
        env=profile.env.to_dict(),
        link_bps=model.link_bps,
        floor_s=model.compute.floor_s,
        timelines=tuple(timelines),
        sweep=sweep,
        layers=tuple(_layers(profile, model, policy)),
        policy=policy,
        policy_point=point,
        study=study,
        measured=tuple(_measured(profile, model, configs, bench)) if bench is not None else (),
        revisions=tuple(revisions),
        cv_error=dict(model.cv_error or {}),
    )


def _compresses(policy: Policy | None) -> bool:
    if policy is None:
        return False
    return policy.default.name != PLAIN.name or any(s.name != PLAIN.name for s in policy.layers.values())


def _sweep(model: CostModel, configs: Mapping[str, Policy | None]) -> Sweep | None:
    if model.link_bps is None:
        return None
    lo = min(SWEEP_RANGE_BPS[0], model.link_bps / 10)
    hi = max(SWEEP_RANGE_BPS[1], model.link_bps * 10)
    steps = math.ceil(math.log10(hi / lo) * POINTS_PER_DECADE)
    rates = tuple(lo * (hi / lo) ** (i / steps) for i in range(steps + 1))

    @functools.lru_cache(maxsize=None)
    def at(name: str, rate: float) -> float:
        return model.predict(configs[name], WhatIf(bandwidth_bps=rate)).step_s

    curves = {name: tuple(at(name, r) for r in rates) for name in configs}
    pays: dict[str, float | None] = {}
    for name in configs:
        if name == "ddp":
            continue
        faster = [i for i, r in enumerate(rates) if curves[name][i] < curves["ddp"][i]]
        if not faster or faster[-1] == len(rates) - 1:
            pays[name] = rates[-1] if faster else None
            continue
        # faster at a, not at b: bisect the log-rate interval
        a, b = math.log(rates[faster[-1]]), math.log(rates[faster[-1] + 1])
        for _ in range(_BISECT):
            mid = math.exp((a + b) / 2)
            a, b = (math.log(mid), b) if at(name, mid) < at("ddp", mid) else (a, math.log(mid))
        pays[name] = math.exp(a)
    return Sweep(
        rates_bps=rates, step_s=curves,
        compressing=frozenset(n for n, p in configs.items() if _compresses(p)),
        pays_below_bps=pays,
        at_link_s={name: model.predict(p).step_s for name, p in configs.items()},
    )


def _layers(profile: Profile, model: CostModel, policy: Policy | None) -> list[LayerRow]:
    measured: dict[tuple[str, str], tuple[float, float]] = {}
    for e in profile.codecs.errors:
        rel = float(e.rel_error)
        cum = rel if e.cum_error is None else float(e.cum_error)
        measured[(label_of(e.spec), e.param)] = (rel, cum)
    modules = {m.name: m.backward_s for m in profile.compute.modules}
    # the model's ready times: scaled to steps without the probe's per-layer hooks
    ready = {p.name: p.ready_s for p in model.compute.params}
    rows = []
    for p in profile.compute.params:
        name = p.name
        shape = p.shape
        size = 2 if p.dtype in ("float16", "bfloat16") else 4
        label = label_of(policy.spec_for(name)) if policy is not None else PLAIN.name
        err = (0.0, 0.0) if label == PLAIN.name else measured.get((label, name), (None, None))
        backward = modules.get(name.rpartition(".")[0])
        rows.append(LayerRow(
            name=name, shape=shape, grad_bytes=math.prod(shape) * size,
            ready_ms=ready[name] * 1e3 if name in ready else None,
            backward_ms=None if backward is None else float(backward) * 1e3,
            compressor=label, error_step=err[0], error_cum=err[1],
        ))
    return rows


def _measured(profile: Profile, model: CostModel, configs: Mapping[str, Policy | None],
              bench: Mapping[str, Any]) -> list[Measured]:
    workload = profile.workload.name
    runs: list[tuple[str | None, int, dict[str, float], dict[str, Policy | None], str]] = []
    if "results" in bench:
        if bench.get("workload") not in (None, workload):
            raise AutotuneError(f"the bench result measured workload {bench.get('workload')!r}; "
                                f"the profile is of {workload!r}")
        medians = {}
        for r in bench["results"]:
            if isinstance(r, dict) and isinstance(r.get("name"), str) and "step_s_median" in r:
                medians[r["name"]] = float(r["step_s_median"])
        runs.append((bench.get("link"), int(bench.get("world_size") or profile.world_size),
                     medians, {}, "autotune bench"))
    else:
        cells = [c for c in bench["cells"] if isinstance(c, dict) and c.get("workload") == workload]
        if not cells:
            raise AutotuneError(f"the bench result has no cell for workload {workload!r}")
        for c in cells:
            link = c.get("link", c.get("rate"))  # "rate" in results written before links had names
            if link == "unshaped":  # loopback: no link rate to set a prediction at
                continue
            extra: dict[str, Policy | None] = {}
            if isinstance(c.get("policy"), dict):
                extra["tuned"] = Policy.from_dict(c["policy"], source=f"bench cell {link}")
            runs.append((link, profile.world_size,
                         {k: float(v) for k, v in c.get("medians_s", {}).items()}, extra,
                         str(bench.get("benchmark", "bench"))))
    def rate_of(link: Any) -> float | None:
        return parse_link(str(link)).rate_bps if link else None

    out = []
    for link, world, medians, extra, source in runs:
        rate = rate_of(link)
        same = rate == rate_of(profile.env.link) and world == profile.world_size
        # at the profiled cluster: calibrated; on another link: the timeline's what-if;
        # on an unshaped link other than the profiled one: no rate to predict at
        predictable = same or bool(rate and model.link_bps)
        what_if = None if same else WhatIf(world_size=world, bandwidth_bps=rate)
        known = {**configs, **extra}
        for name, seconds in medians.items():
            predicted: float | None = None
            cap = _cap(name)
            if name == "floor":
                predicted = model.compute.floor_s
            elif predictable and name in known:
                predicted = model.predict(known[name], what_if).step_s
            elif predictable and cap is not None:
                predicted = model.predict(Policy(bucket_cap_mb=cap), what_if).step_s
            out.append(Measured(name, link or "loopback", rate, seconds, predicted, same, source))
    return out


def _cap(name: str) -> float | None:
    """The bucket cap of the benches' ``ddp<N>mb`` configurations."""
    if name.startswith("ddp") and name.endswith("mb"):
        try:
            return float(name[3:-2])
        except ValueError:
            return None
    return None
