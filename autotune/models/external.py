"""Profiles from elsewhere (Zhang et al. 2020's V100 logs) in autotune's full model.

The paper's model divides network time by a compression ratio and counts nothing else.
Here the same per-layer backward profile runs through autotune's timeline with a real
compressor for each ratio, its real collective and an encode/decode cost:

* ratio 1: ``none`` (ring allreduce, as the paper);
* ratio 2: ``fp16`` (allreduce of 2-byte values);
* other ratios r: ``topk`` with ``ratio = 1 / (2 r)`` (8 bytes per kept element: value
  and index); each rank selects its own coordinates, so it needs an all_gather, whose
  traffic grows with the number of workers — the effect Agarwal et al. (2022) measured.

Encode/decode times on the GPU are not measured here (no GPU in this profile), so they
come from a bandwidth model with stated constants (:data:`V100`): each method's passes
over its data at the memory bandwidth a V100 sustains, top-k's selection as several
passes, and the decode of W payloads for all_gather methods. Change the constants to
ask "what if the codec were N times cheaper".

Collectives use the paper's ring cost: ``S*8*(N-1)/N / B`` per phase plus ``(N-1)``
vector additions of ``S/N`` bytes for the reduce-scatter; all_gather is ``(N-1)*S*8/B``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.compressors import CompressorSpec
from autotune.models.simulator import ComputeTimes, ParamTiming, simulate
from autotune.models.zhang2020 import VecAddModel, Zhang2020Profile
from autotune.policies import Policy

__all__ = ["GpuCodecCosts", "V100", "compute_from_zhang", "compressor_for_ratio", "full_model"]


@dataclass(frozen=True)
class GpuCodecCosts:
    """Stated assumptions for encode+decode on a GPU."""

    memory_Bps: float = 700e9  # sustained HBM bandwidth (V100: 900 GB/s peak)
    launch_s: float = 10e-6  # fixed cost per tensor (kernel launches)
    cast_passes: float = 3.0  # fp16: read fp32, write fp16; decode: read fp16, write fp32
    topk_passes: float = 12.0  # selection (radix select is several passes) + gather/scatter


V100 = GpuCodecCosts()


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
        return CompressorSpec.of("none")
    if ratio == 2:
        return CompressorSpec.of("fp16")
    return CompressorSpec.of("topk", ratio=1.0 / (2.0 * ratio))


def _codec_time(costs: GpuCodecCosts) -> Any:
    def time(spec: CompressorSpec, shape: tuple[int, ...], world: int) -> float:
        n = 1
        for d in shape:
            n *= d
        if spec.name == "none":
            return 0.0
        if spec.name in ("fp16", "bf16"):
            return costs.launch_s + costs.cast_passes * 4 * n / costs.memory_Bps
        if spec.name == "topk":
            k = max(1, int(spec.canonical().kwargs["ratio"] * n))
            select = costs.topk_passes * 4 * n / costs.memory_Bps
            decode = world * 8 * k / costs.memory_Bps + 4 * n / costs.memory_Bps  # scatter-add W
            return 2 * costs.launch_s + select + decode
        raise ValueError(f"no GPU cost assumption for {spec.name!r}")

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
    vec_add: VecAddModel, costs: GpuCodecCosts = V100, bucket_cap_mb: float | None = None,
) -> dict[str, Any]:
    """One what-if point of the V100 profile in autotune's timeline."""
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
