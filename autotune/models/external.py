"""Profiles from elsewhere (Zhang et al. 2020's V100 logs) in autotune's full model.

The paper's model divides network time by a compression ratio and counts nothing else.
Here the same per-layer backward profile runs through autotune's timeline with a real
compressor for each ratio, its real collective and an encode/decode cost:

* ratio 1: ``none`` (ring allreduce, as the paper);
* ratio 2: ``fp16`` (allreduce of 2-byte values);
* other ratios r: ``topk`` with ``ratio = 1 / (2 r)`` (8 bytes per kept element: value
  and index); each rank selects its own coordinates, so it needs an all_gather, whose
  traffic grows with the number of workers — the effect Agarwal et al. (2022) measured.

Encode/decode times: measured ones where there are, from ``bench/codec_throughput.py``
(its JSON, ``--device cuda`` for a GPU: :class:`MeasuredCodecCosts`); the Zhang profile
itself has none. Without a measurement they come from a bandwidth model with stated
constants (:data:`V100`, the fallback and the default): each method's passes over its
data at the memory bandwidth a V100 sustains, top-k's selection as several passes, and
the decode of W payloads for all_gather methods. Change the constants to ask "what if
the codec were N times cheaper".

Collectives use the paper's ring cost: ``S*8*(N-1)/N / B`` per phase plus ``(N-1)``
vector additions of ``S/N`` bytes for the reduce-scatter; all_gather is ``(N-1)*S*8/B``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Protocol

from autotune.compressors import PLAIN, REGISTRY, CompressorSpec
from autotune.compressors.cast import FP16
from autotune.compressors.topk import TopK
from autotune.errors import ProfileError
from autotune.jsonio import read_json
from autotune.models.simulator import ComputeTimes, ParamTiming, simulate
from autotune.models.zhang2020 import VecAddModel, Zhang2020Profile
from autotune.policies import Policy

__all__ = [
    "CodecCosts",
    "GpuCodecCosts",
    "MeasuredCodecCosts",
    "V100",
    "compute_from_zhang",
    "compressor_for_ratio",
    "full_model",
]


class CodecCosts(Protocol):
    """Encode+decode seconds of one tensor of ``numel`` fp32 elements under ``spec``,
    in a job of ``world`` ranks."""

    def seconds(self, spec: CompressorSpec, numel: int, world: int) -> float: ...


@dataclass(frozen=True)
class GpuCodecCosts:
    """Stated assumptions for encode+decode on a GPU."""

    memory_Bps: float = 700e9  # sustained HBM bandwidth (V100: 900 GB/s peak)
    launch_s: float = 10e-6  # fixed cost per tensor (kernel launches)
    cast_passes: float = 3.0  # fp16: read fp32, write fp16; decode: read fp16, write fp32
    topk_passes: float = 12.0  # selection (radix select is several passes) + gather/scatter


    def seconds(self, spec: CompressorSpec, numel: int, world: int) -> float:
        n = numel
        method = REGISTRY.get(spec.name)
        if method.elementwise and not method.lossy:  # the gradient itself is sent
            return 0.0
        if method.half_precision:
            return self.launch_s + self.cast_passes * 4 * n / self.memory_Bps
        if issubclass(method, TopK):
            k = max(1, int(spec.canonical().kwargs["ratio"] * n))
            select = self.topk_passes * 4 * n / self.memory_Bps
            decode = world * 8 * k / self.memory_Bps + 4 * n / self.memory_Bps  # scatter-add W
            return 2 * self.launch_s + select + decode
        raise ValueError(f"no GPU cost assumption for {spec.name!r}")


V100 = GpuCodecCosts()


@dataclass(frozen=True)
class CodecFit:
    """Measured encode+decode seconds of one configuration as
    ``fixed_s + per_mb_s * MB + per_mb_rank_s * MB * world`` (MB of fp32 gradient)."""

    spec: CompressorSpec  # canonical
    fixed_s: float  # per tensor, whatever its size (kernel launches, Python)
    per_mb_s: float  # per MB of gradient: encode, and what decode costs once
    per_mb_rank_s: float  # per MB and rank: decoding W payloads (0 if measured at one W)

    def seconds(self, numel: int, world: int) -> float:
        mb = 4 * numel / 2**20
        return self.fixed_s + mb * (self.per_mb_s + self.per_mb_rank_s * world)


@dataclass(frozen=True)
class MeasuredCodecCosts:
    """Encode+decode costs measured by ``bench/codec_throughput.py``.

    Per configuration measured, a non-negative least-squares fit of its seconds against
    size and world size (:class:`CodecFit`; the term in W needs two world sizes, e.g.
    ``--world-size 2 8``). A spec that was not measured takes the fit of the same
    method's nearest measured configuration by its size knob (``size_param``, log
    distance: top-k's ratio, on which its cost depends little, selection being a
    threshold pass; PowerSGD's rank; int8's block), a method without one by name. A
    method not measured at all raises ``ValueError``.
    """

    device: str  # where the codecs ran ("cuda", "cpu")
    device_name: str
    fits: tuple[CodecFit, ...]

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], device: str = "cuda") -> MeasuredCodecCosts:
        """Read the benchmark's JSON; ``device`` must be the one it measured on.

        Raises:
            ProfileError: unreadable or malformed file, another device, no rows.
        """
        data = read_json(path, ProfileError, "codec throughput results")
        where = data.get("device") if isinstance(data, dict) else None
        if where != device:
            raise ProfileError(f"{path}: codec costs measured on {where!r}, not {device!r} "
                               f"(run bench/codec_throughput.py --device {device})")
        points: dict[CompressorSpec, list[tuple[float, int, float]]] = {}
        try:
            for row in data["rows"]:
                spec = CompressorSpec.from_dict(row["spec"]).canonical()
                mb = 4 * int(row["numel"]) / 2**20
                points.setdefault(spec, []).append((mb, int(row["world_size"]), float(row["codec_s"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{path}: malformed codec throughput row: {exc}") from exc
        if not points:
            raise ProfileError(f"{path}: no codec measurements")
        fits = tuple(_fit(spec, pts) for spec, pts in points.items())
        return cls(device=device, device_name=str(data.get("device_name", "")), fits=fits)

    def fit_for(self, spec: CompressorSpec) -> CodecFit:
        """The fit used for ``spec`` (see the class docstring)."""
        spec = spec.canonical()
        same = [f for f in self.fits if f.spec.name == spec.name]
        if not same:
            measured = sorted({f.spec.name for f in self.fits})
            raise ValueError(f"no measured codec cost for {spec.name!r}; measured: {', '.join(measured)}")
        for f in same:
            if f.spec == spec:
                return f
        key = REGISTRY.get(spec.name).size_param
        if key is None:
            return same[0]
        want = math.log(spec.kwargs[key])
        return min(same, key=lambda f: abs(math.log(f.spec.kwargs[key]) - want))

    def seconds(self, spec: CompressorSpec, numel: int, world: int) -> float:
        return self.fit_for(spec).seconds(numel, world)


def _fit(spec: CompressorSpec, points: list[tuple[float, int, float]]) -> CodecFit:
    """Non-negative least squares of seconds on [1, MB, MB * W] (fewer terms where the
    points cannot tell them apart)."""
    import numpy as np
    from scipy.optimize import nnls

    mb = np.array([p[0] for p in points])
    world = np.array([p[1] for p in points], dtype=float)
    secs = np.array([p[2] for p in points])
    columns = [np.ones_like(mb), mb, mb * world]
    use = [len(set(mb.tolist())) > 1, True, len(set(world.tolist())) > 1]
    x = np.stack([c for c, u in zip(columns, use) if u], axis=1)
    # relative errors matter: weight each point by 1 / its time
    weight = 1.0 / np.maximum(secs, 1e-12)
    coef, _ = nnls(x * weight[:, None], secs * weight)
    full = iter(coef.tolist())
    fixed, per_mb, per_rank = (next(full) if u else 0.0 for u in use)
    return CodecFit(spec=spec, fixed_s=fixed, per_mb_s=per_mb, per_mb_rank_s=per_rank)


def compute_from_zhang(profile: Zhang2020Profile) -> ComputeTimes:
    """The V100 log as compute times: layers as 1-D fp32 tensors (the log has sizes, not
    shapes), forward + optimizer = iteration - backward."""
    params = tuple(
        ParamTiming(f"layer{i}", (max(1, layer.grad_bytes // 4),), ready)
        for i, (layer, ready) in enumerate(zip(profile.layers, profile.ready_s))
    )
    rest = max(0.0, profile.iteration_s - profile.backward_s)
    return ComputeTimes(params=params, forward_s=rest, backward_s=profile.backward_s,
                        optimizer_s=0.0, floor_s=profile.iteration_s, contention=0.0)


def compressor_for_ratio(ratio: float) -> CompressorSpec:
    """A real compressor achieving ``ratio`` (see module docstring)."""
    if ratio == 1:
        return PLAIN
    if ratio == 2:
        return CompressorSpec.of(FP16.name)
    return CompressorSpec.of(TopK.name, ratio=1.0 / (2.0 * ratio))


def _codec_time(costs: CodecCosts) -> Any:
    def time(spec: CompressorSpec, shape: tuple[int, ...], world: int,
             density: float | None = None) -> float:
        n = 1
        for d in shape:
            n *= d
        return costs.seconds(spec, n, world)

    return time


def _ring_comm(bandwidth_bps: float, vec_add: VecAddModel) -> Any:
    def time(collective: str, nbytes: int, world: int) -> float:
        if world <= 1 or nbytes <= 0:
            return 0.0
        phase = nbytes * 8 * (world - 1) / world / bandwidth_bps
        if collective == "allreduce":
            return 2 * phase + (world - 1) * float(vec_add.time(nbytes / world))
        if collective == "allgather":
            return (world - 1) * nbytes * 8 / bandwidth_bps
        raise ValueError(f"no ring cost for {collective!r}")

    return time


def full_model(
    profile: Zhang2020Profile, world_size: int, bandwidth_bps: float, compression: float,
    vec_add: VecAddModel, costs: CodecCosts = V100, bucket_cap_mb: float | None = None,
) -> dict[str, Any]:
    """One what-if point of the V100 profile in autotune's timeline; ``costs``: the
    codecs' (:class:`MeasuredCodecCosts` from the benchmark's JSON, or stated
    constants, :data:`V100` by default)."""
    spec = compressor_for_ratio(compression)
    compute = compute_from_zhang(profile)
    est = simulate(compute, {}, spec, bucket_cap_mb, world_size,
                   _ring_comm(bandwidth_bps, vec_add), _codec_time(costs))
    return {
        "name": "full", "model": profile.name, "world_size": world_size,
        "bandwidth_bps": bandwidth_bps, "compression": compression,
        "compressor": spec.label(), "step_s": est.step_s, "codec_s": est.codec_s,
        "exposed_comm_s": est.exposed_comm_s,
        "scaling_factor": profile.iteration_s / est.step_s,
        "policy": Policy(default=spec).to_dict() if bucket_cap_mb is None else None,
    }
