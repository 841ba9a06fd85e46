"""The cost model: a profile's measurements, fitted, behind one ``predict(policy)``.

``CostModel.fit(profile)`` fits the learned components (collective times from the network
probe's samples, codec times from the codec probe's shapes, and, when the profile holds
measured (policy, step time) pairs, the residual correction) and keeps the compute
times. ``predict(policy, what_if)`` runs the timeline simulator with them.

Saved as JSON parameters (``save`` / ``load_cost_model``), carrying the package version;
loading a model saved by another version refuses with a clear error.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from autotune._version import __version__
from autotune.compressors import PLAIN, REGISTRY, CompressorSpec
from autotune.errors import ProfileError
from autotune.jsonio import dumps, read_json, write_atomic
from autotune.links import parse_link
from autotune.models.estimators import (
    RESIDUAL_FEATURES,
    CodecTimeRegressor,
    CollectiveTimeRegressor,
    ResidualRegressor,
    relative_cv_error,
)
from autotune.models.simulator import (
    ComputeTimes,
    Layout,
    ParamTiming,
    StepEstimate,
    WhatIf,
    simulate,
)
from autotune.policies import Policy
from autotune.presets import PRESETS
from autotune.presets import preset as get_preset
from autotune.probes.profile import CalibrationRun, Profile

__all__ = ["CostModel", "load_cost_model", "MODEL_VERSION", "calibration_pairs", "codec_features",
           "stock_ratios"]

logger = logging.getLogger(__name__)

# 2: rowsparse's codec time reads the row density (a fourth feature it did not have)
# 3: the residual reads intra_mb (hierarchical policies' intra-host bytes)
MODEL_VERSION = 3
_RUNTIME_COLLECTIVES = ("allreduce", "allgather")  # what the runtime issues


def codec_features(spec: CompressorSpec, shape: tuple[int, ...],
                   density: float | None = None) -> list[float]:
    """``[numel, rows, cols, param]`` of a tensor under a compressor (param: its size
    knob, :attr:`~autotune.compressors.Compressor.size_param`; for data-dependent
    methods the share of rows holding a non-zero value, ``density``, None: dense; 0 for
    methods without a size knob)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    rows = int(shape[0]) if len(shape) >= 2 else numel
    cols = numel // max(rows, 1) if len(shape) >= 2 else 1
    param = REGISTRY.get(spec.name).codec_param(spec.canonical().kwargs, density)
    return [float(numel), float(rows), float(cols), param]


def calibration_pairs(results: Sequence[CalibrationRun]) -> list[tuple[Policy | None, float]]:
    """A profile's calibration results as the (policy, median step seconds) pairs
    :meth:`CostModel.fit_residual` learns from: our policies' runs (a stock set-up's run
    is PyTorch's hook, not a policy the model describes)."""
    return [(None if r.policy is None else Policy.from_dict(r.policy, source="calibration"),
             float(r.step_s)) for r in results if r.stock is None]


def _link_bps(profile: Profile) -> float | None:
    """The measured link's rate: the emulated link if named, else the allreduce's bus
    bandwidth (what the collective actually got)."""
    link = profile.env.link
    if link:
        return parse_link(str(link)).rate_bps
    fit = profile.network.fits.get("allreduce")
    return float(fit.busbw_Bps) * 8 if fit and fit.busbw_Bps is not None else None


def _intra_fit(profile: Profile) -> tuple[float, float] | None:
    """(latency s, bandwidth B/s) of the intra-host p2p fit, if the probe measured one."""
    fit = profile.network.fits.get("p2p", {}).get("intra")
    if not fit or not fit.bandwidth_Bps:
        return None
    return float(fit.latency_s), float(fit.bandwidth_Bps)


def stock_ratios(results: Sequence[CalibrationRun]) -> dict[str, float]:
    """Per preset whose stock hook does not run the way ours does
    (:attr:`~autotune.presets.Preset.runs_as_ours`): the stock set-up's step over our
    equivalent's, both as verification measured them in one interleaved job (so the
    machine's drift cancels). One ratio per stock hook, the geometric mean over its
    presets measured with both in ``results``, given to each of its presets: what the
    stock PowerSGD hook adds (full-size tensors, one bucket) does not depend on the
    rank, and the ranks' ratios measured apart differed by noise (transformer at 1
    Gbit: 0.84 and 1.15 in one job). Presets PyTorch runs as we do get none: their
    measured ratio was noise about 1 (fp16: 0.90-1.09), and scaling by it raised the
    held-out median ratio error of stop 38's grid from 4.5% to 6.6%."""
    ours = {r.policy_id: float(r.step_s) for r in results
            if r.source == "verify" and r.stock is None and r.policy_id}
    logs: dict[str, list[float]] = {}  # per stock hook: log(stock / ours) of its presets
    for r in results:
        stock = get_preset(r.stock) if r.stock is not None else None
        mine = ours.get(_equivalent(stock.name).id) if stock and not stock.runs_as_ours else None
        if mine:
            logs.setdefault(str(stock.hook), []).append(math.log(float(r.step_s) / mine))
    return {p.name: math.exp(statistics.fmean(logs[str(p.hook)])) for p in PRESETS if str(p.hook) in logs}


def _equivalent(name: str) -> Policy:
    """Our policy for a preset's stock set-up (DDP's: the plain policy)."""
    return Policy.from_dict(get_preset(name).policy(), source=f"preset {name}")


def row_densities(profile: Profile) -> dict[str, float]:
    """Per parameter, the fraction of rows holding a non-zero gradient on the busiest
    rank, from the codec probe's gradient-structure measurements (``codecs.structure``;
    empty for profiles that have none)."""
    return {name: float(s.row_density_max) for name, s in profile.codecs.structure.items()}


def compute_times(profile: Profile) -> ComputeTimes:
    """Per-rank compute from a profile, with ready times scaled to un-instrumented steps
    (the per-layer hooks that time them slow backward down a little)."""
    c = profile.compute
    backward = statistics.median(c.backward_s)
    hooked = statistics.median(c.hooked_backward_s or c.backward_s)
    scale = backward / hooked if hooked > 0 else 1.0
    densities = row_densities(profile)
    params = tuple(
        ParamTiming(p.name, p.shape,
                    (p.ready_s if p.ready_s is not None else backward / scale) * scale,
                    density=densities.get(p.name))
        for p in c.params
    )
    return ComputeTimes(
        params=params,
        forward_s=statistics.median(c.forward_s),
        backward_s=backward,
        optimizer_s=statistics.median(c.optimizer_s),
        floor_s=statistics.median(c.step_s),
        contention=1.0 if profile.env.device == "cpu" else 0.0,
    )


@dataclass
class CostModel:
    """Fitted components plus the compute times of one profile."""

    compute: ComputeTimes
    world_size: int
    comm: dict[str, CollectiveTimeRegressor]
    codec: dict[str, CodecTimeRegressor]
    codec_world: int
    link_bps: float | None
    residual: ResidualRegressor | None = None
    fingerprint: str = ""
    cv_error: dict[str, float] | None = None  # cross-validated MAPE of each component
    hosts: int = 1  # hosts of the profiled job
    # the intra-host link class's point-to-point fit (latency_s, bandwidth_Bps), when the
    # profiled job had ranks sharing a host; what hierarchical policies are simulated on
    intra: tuple[float, float] | None = None
    # per preset: its stock set-up's step over our equivalent's, both measured by
    # verification on the profiled job (stock_ratios; see predict_stock)
    stock_ratios: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, profile: Profile, residual: bool = True) -> CostModel:
        """Fit every component the profile has data for."""
        comm: dict[str, CollectiveTimeRegressor] = {}
        cv: dict[str, float] = {}
        for name in _RUNTIME_COLLECTIVES:
            rows = [(s.bytes, profile.world_size, t) for s in profile.network.samples
                    if s.collective == name for t in s.times_s]
            if not rows:
                continue
            X = np.array([[b, w] for b, w, _ in rows], dtype=float)
            y = np.array([t for _, _, t in rows], dtype=float)
            est = CollectiveTimeRegressor(collective=name)
            comm[name] = est.fit(X, y)
            cv[f"comm.{name}"] = relative_cv_error(CollectiveTimeRegressor(collective=name), X, y)
        codec: dict[str, CodecTimeRegressor] = {}
        by_name: dict[str, list[tuple[list[float], float]]] = {}
        for s in profile.codecs.shapes:
            spec = CompressorSpec.from_dict(s.spec)
            # data-dependent methods were timed at the density of the tensor timed, and
            # sparse tensors again with more rows filled
            points = [(s.row_density, s.encode_decode_s)]
            if s.denser is not None:
                points.append((s.denser.row_density, s.denser.encode_decode_s))
            by_name.setdefault(spec.name, []).extend(
                (codec_features(spec, s.shape, density), float(seconds))
                for density, seconds in points
            )
        for name, rows_ in by_name.items():
            X = np.array([r for r, _ in rows_], dtype=float)
            y = np.array([t for _, t in rows_], dtype=float)
            codec[name] = CodecTimeRegressor(compressor=name).fit(X, y)
            cv[f"codec.{name}"] = relative_cv_error(CodecTimeRegressor(compressor=name), X, y)
        model = cls(
            compute=compute_times(profile), world_size=profile.world_size, comm=comm,
            codec=codec, codec_world=profile.codecs.world_size or profile.world_size,
            link_bps=_link_bps(profile), fingerprint=profile.fingerprint, cv_error=cv,
            hosts=profile.env.hosts or 1, intra=_intra_fit(profile),
        )
        pairs = calibration_pairs(profile.calibration.results) if residual else []
        if len(pairs) >= 3:
            model.fit_residual(pairs)
        if residual:
            model.stock_ratios = stock_ratios(profile.calibration.results)
        return model

    def fit_residual(self, pairs: list[tuple[Policy | None, float]]) -> CostModel:
        """Learn the correction from measured (policy, median step seconds) pairs."""
        X = np.array([self._residual_row(self._simulate(p, WhatIf())) for p, _ in pairs])
        y = np.array([t for _, t in pairs], dtype=float)
        self.residual = ResidualRegressor().fit(X, y)
        if self.cv_error is not None:
            self.cv_error["residual"] = relative_cv_error(ResidualRegressor(), X, y)
        return self

    @staticmethod
    def _residual_row(est: StepEstimate) -> list[float]:
        row = {"simulated_s": est.simulated_s, "codec_s": est.codec_s, "comm_s": est.comm_s,
               "threaded_collectives": float(est.threaded_collectives),
               "threaded_buckets": float(est.threaded_buckets), "half_mb": est.half_bytes / 1e6,
               "intra_mb": est.intra_bytes / 1e6}
        return [row[k] for k in RESIDUAL_FEATURES]

    # --------------------------------------------------------------- predicting
    def __post_init__(self) -> None:
        # predictions repeat across a search: memoise per what-if and argument
        self._memo: dict[tuple[Any, ...], float] = {}

    def comm_time(self, what_if: WhatIf) -> Any:
        """``(collective, bytes, world) -> seconds`` under the what-if link."""
        models = dict(self.comm)
        if what_if.bandwidth_bps is not None or what_if.latency_s is not None:
            scale = 1.0
            if what_if.bandwidth_bps is not None:
                if self.link_bps is None:
                    raise ProfileError("the profile has no link rate to scale a bandwidth what-if from")
                scale = self.link_bps / what_if.bandwidth_bps
            models = {k: m.with_link(scale, what_if.latency_s) for k, m in models.items()}

        memo = self._memo

        def time(collective: str, nbytes: int, world: int) -> float:
            if world <= 1 or nbytes <= 0:
                return 0.0
            key = ("comm", what_if, collective, nbytes, world)
            if key not in memo:
                model = models.get(collective)
                if model is None:
                    raise ProfileError(f"the profile has no {collective} measurements to predict from")
                memo[key] = float(model.predict(np.array([[nbytes, world]], dtype=float))[0])
            return memo[key]

        return time

    def codec_time(self, what_if: WhatIf) -> Any:
        """``(spec, shape, world, density) -> seconds`` of encode+decode (density: the
        share of rows holding a non-zero value, which data-dependent methods read)."""
        cache = self._memo

        def time(spec: CompressorSpec, shape: tuple[int, ...], world: int,
                 density: float | None = None) -> float:
            key = ("codec", what_if.compute_speed, spec, shape, world, density)
            if key not in cache:
                model = self.codec.get(spec.name)
                if model is None:
                    raise ProfileError(
                        f"the profile has no codec measurements for {spec.name!r}; "
                        "re-run `autotune profile` with it in the codec grid"
                    )
                t = float(model.predict(np.array([codec_features(spec, shape, density)]))[0])
                if "allgather" in REGISTRY.get(spec.name).collectives and world != self.codec_world:
                    # decoding handles one payload per rank: scale the decode half
                    t = t / 2 + t / 2 * world / max(self.codec_world, 1)
                cache[key] = max(0.0, t) / what_if.compute_speed
            return cache[key]

        return time

    def layout(self, what_if: WhatIf, world: int) -> Layout:
        """Hosts and ranks per host of the what-if job (by default, ranks per host as
        profiled), and its intra-host link (the what-if's rate, else the measured one)."""
        per_host = max(1, self.world_size // max(self.hosts, 1))
        hosts = what_if.hosts or max(1, world // per_host)
        if hosts < 1 or world % hosts:
            raise ProfileError(f"{world} ranks do not spread evenly over {hosts} hosts")
        latency, bandwidth = self.intra if self.intra is not None else (None, None)
        if what_if.intra_bandwidth_bps is not None:
            bandwidth, latency = what_if.intra_bandwidth_bps / 8, latency or 0.0
        local = world // hosts

        def intra_time(nbytes: int) -> float:
            if bandwidth is None:
                raise ProfileError(
                    "the profile measured no intra-host link (one rank per host): give the "
                    "intra-host rate to predict a hierarchical policy (simulate --intra-link)")
            return latency + nbytes / bandwidth

        return Layout(hosts=hosts, local=local, intra_time=intra_time)

    def _simulate(self, policy: Policy | None, what_if: WhatIf) -> StepEstimate:
        compute = self.compute.scaled(what_if.compute_speed) if what_if.compute_speed != 1.0 else self.compute
        world = what_if.world_size or self.world_size
        if policy is None:  # plain DDP with its default buckets (small first bucket)
            layers, default, cap = {}, PLAIN, None
        else:
            layers, default, cap = policy.layers, policy.default, policy.ddp_bucket_cap_mb
        layout = (self.layout(what_if, world)
                  if policy is not None and policy.topology == "hierarchical" else None)
        return simulate(compute, layers, default, cap, world,
                        self.comm_time(what_if), self.codec_time(what_if), layout)

    def predict(self, policy: Policy | None, what_if: WhatIf | None = None) -> StepEstimate:
        """Predicted step of ``policy`` (None: plain DDP as constructed by default).

        The residual correction (what the machines' CPUs add: per-step, codec, per-collective
        and per-bucket costs, learnt where they were measured) applies on the measured
        machines, also under another link (:attr:`WhatIf.same_machines`; fitted on 1 Gbit
        it halved the held-out ratio error at 4 Gbit and 300 Mbit, bench/tuned_vs_baselines.py),
        not to what-ifs of other ranks, hosts or compute speed."""
        what_if = what_if or WhatIf()
        est = self._simulate(policy, what_if)
        if self.residual is not None and what_if.same_machines:
            corrected = float(self.residual.predict(np.array([self._residual_row(est)]))[0])
            est = StepEstimate(**{**est.__dict__, "step_s": corrected})
        return est

    def predict_stock(self, preset: str, what_if: WhatIf | None = None) -> float:
        """Predicted step seconds of a preset's stock set-up (PyTorch's own hook, or DDP).

        The model describes our policies; PyTorch's hooks run the same methods at another
        cost (its PowerSGD hook: one bucket on gloo, full-size tensors each step, 1.2-2x
        our PowerSGD in bench/vs_stock.py). So the prediction is our equivalent's, scaled
        by the stock/ours ratio verification measured, interleaved, on the profiled job
        (:func:`stock_ratios`: PowerSGD's hook only, one ratio for its ranks); without
        it, our equivalent's prediction as it is."""
        step = self.predict(_equivalent(preset), what_if).step_s
        return step * self.stock_ratios.get(preset, 1.0)

    # -------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        c = self.compute
        return {
            "version": MODEL_VERSION,
            "autotune": __version__,
            "profile_fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "codec_world": self.codec_world,
            "link_bps": self.link_bps,
            "hosts": self.hosts,
            "intra": list(self.intra) if self.intra is not None else None,
            "compute": {
                "forward_s": c.forward_s, "backward_s": c.backward_s, "optimizer_s": c.optimizer_s,
                "floor_s": c.floor_s, "contention": c.contention,
                "params": [{"name": p.name, "shape": list(p.shape), "ready_s": p.ready_s,
                            "element_size": p.element_size, "dtype": p.dtype,
                            "density": p.density} for p in c.params],
            },
            "comm": {k: v.to_json_dict() for k, v in self.comm.items()},
            "codec": {k: v.to_json_dict() for k, v in self.codec.items()},
            "residual": self.residual.to_json_dict() if self.residual is not None else None,
            "cv_error": {k: (None if v is None or math.isnan(v) else v)
                         for k, v in (self.cv_error or {}).items()},
            "stock_ratios": dict(self.stock_ratios),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "cost model") -> CostModel:
        if not isinstance(data, Mapping) or type(data.get("version")) is not int or (
            data.get("version") != MODEL_VERSION
        ):
            raise ProfileError(f"{source}: version: expected {MODEL_VERSION}")
        if data.get("autotune") != __version__:
            raise ProfileError(
                f"{source}: saved by autotune {data.get('autotune')}, this is "
                f"{__version__}; refit it from its profile"
            )
        try:
            c = data["compute"]
            compute = ComputeTimes(
                params=tuple(ParamTiming(p["name"], tuple(p["shape"]), p["ready_s"],
                                         p["element_size"], p["dtype"], p.get("density"))
                             for p in c["params"]),
                forward_s=c["forward_s"], backward_s=c["backward_s"],
                optimizer_s=c["optimizer_s"], floor_s=c["floor_s"], contention=c["contention"],
            )
            model = cls(
                compute=compute, world_size=int(data["world_size"]),
                comm={k: CollectiveTimeRegressor.from_json_dict(v) for k, v in data["comm"].items()},
                codec={k: CodecTimeRegressor.from_json_dict(v) for k, v in data["codec"].items()},
                codec_world=int(data["codec_world"]), link_bps=data["link_bps"],
                residual=(ResidualRegressor.from_json_dict(data["residual"])
                          if data.get("residual") else None),
                fingerprint=str(data.get("profile_fingerprint", "")),
                cv_error=dict(data.get("cv_error") or {}),
                hosts=int(data.get("hosts", 1)),
                intra=(tuple(float(v) for v in data["intra"])  # type: ignore[arg-type]
                       if data.get("intra") else None),
                stock_ratios={str(k): float(v) for k, v in (data.get("stock_ratios") or {}).items()},
            )
            if any(not (math.isfinite(v) and v > 0) for v in model.stock_ratios.values()):
                raise ValueError("a stock ratio is not a positive number")
            # The file is JSON someone may have edited: a model that cannot predict plain
            # DDP is refused here, not in the middle of a search.
            step = model.predict(None).step_s
            if not math.isfinite(step) or step <= 0:
                raise ValueError(f"predicts a step of {step!r} s for plain DDP")
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
            raise ProfileError(f"{source}: malformed cost model: {exc!r}") from exc
        return model

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomic(path, dumps(self.to_dict()) + "\n", ProfileError, "cost model")


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    return CostModel.from_dict(read_json(path, ProfileError, "cost model"), source=str(path))
