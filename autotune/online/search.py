"""The auto mode's search, as plain functions of JSON-able data.

:func:`auto_search` turns what rank 0 measured on the live steps into a profile, fits
the cost model, runs the Optuna search and picks the contenders of the live trials; it
returns everything as JSON-able data, so it runs the same in the search worker process
(:mod:`autotune.online.worker`, the default: training keeps the GIL and the cores) and
on a thread (the fallback when no worker can be started). :func:`trial_contenders` is
also what a drift re-search uses.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from autotune import compressors
from autotune.compressors.comm import LocalComm
from autotune.errors import ProfileError
from autotune.models.cost_model import CostModel
from autotune.models.simulator import WhatIf
from autotune.online.explore import Contender
from autotune.online.live import live_profile
from autotune.policies import Policy
from autotune.presets import DEFAULT_PRESETS
from autotune.search.space import ErrorModel
from autotune.search.tuner import tune
from autotune.search.verify import candidates as spread_candidates

if TYPE_CHECKING:
    import torch

    from autotune.probes.profile import Profile
    from autotune.search.tuner import TuneResult

__all__ = ["PRUNE_ABOVE", "auto_search", "contender_from_dict", "contender_to_dict",
           "stand_in", "trial_contenders"]

# contenders predicted slower than the best prediction by more than this are not tried
# (the model's errors, 16-21% in the ratio to DDP, stay inside it); plain DDP and the
# policy in force always are
PRUNE_ABOVE = 1.3
# the stand-in's error is measured on at most this many elements of each gradient
STAND_IN_SAMPLE = 1 << 20
# ... and on the gradients scaled by this too: a cast whose range the gradients would
# leave if they grew this much (fp16 above 65504 is inf) is no stand-in
STAND_IN_HEADROOM = 64.0


def trial_contenders(
    profile: Profile, model: CostModel, result: TuneResult, current: Policy, *,
    pinned: Mapping[str, Any], max_error: float, rebucket: bool, candidates: int,
    what_if: WhatIf | None = None, current_name: str = "current",
) -> tuple[list[Contender], str]:
    """The contenders of live trials, simplest first: plain DDP, the policy in force,
    the presets' equivalents within the error budget, the tuned candidates; those
    predicted far slower than the fastest prediction are left out. Returns them and
    the name of the one that is the policy in force.

    Args:
        rebucket: bucket-size changes can be applied (else every contender keeps the
            current cap).
        current_name: what the policy in force is called among them (auto's stand-in:
            its preset's name).
    """
    what_if = what_if or WhatIf()
    errors = ErrorModel(profile)
    pinned = {k: dict(v) for k, v in pinned.items()}

    def overlay(policy: Policy) -> Policy:
        data = {k: v for k, v in policy.to_dict().items() if k != "meta"}
        if pinned:
            data["layers"] = {**data.get("layers", {}), **pinned}
        return Policy.from_dict(data, source="trial policy")

    def error(policy: Policy) -> float | None:
        try:
            return errors.of(policy)
        except ProfileError:  # a compressor the codec probe did not reach
            return None

    def contender(name: str, policy: Policy, kind: str) -> Contender | None:
        e = error(policy)
        if e is None or (kind != "ddp" and e > max_error):
            return None
        return Contender(name, policy, kind, e, model.predict(policy, what_if).step_s)

    ddp = overlay(Policy(bucket_cap_mb=Policy().bucket_cap_mb if rebucket
                         else current.bucket_cap_mb))
    pool = [contender("ddp", ddp, "ddp"), contender(current_name, overlay(current), "current")]
    for b in result.baselines:
        policy = overlay(b.policy)
        if not rebucket and policy.bucket_cap_mb != current.bucket_cap_mb:
            continue
        pool.append(contender(b.name, policy, "baseline"))
    for tuned in spread_candidates(result, candidates):
        pool.append(contender(tuned.name, tuned.policy, "candidate"))
    in_force = overlay(current)
    if any(e is not None and e.name == current_name and e.policy.id != in_force.id
           for e in pool[2:]):  # another cap's variant of the stand-in's preset
        current_name = "current"
        pool[1] = pool[1] and replace(pool[1], name=current_name)
    chosen: list[Contender] = []
    seen: dict[str, str] = {}  # policy id -> the (simplest) contender's name
    best = min([model.predict(current, what_if).step_s] + [
        e.predicted_s for e in pool if e is not None and e.predicted_s is not None])
    for entry in pool:
        if entry is None or entry.policy.id in seen:
            continue
        if entry.kind not in ("ddp", "current") and entry.predicted_s is not None and (
                entry.predicted_s > PRUNE_ABOVE * best):
            continue
        seen[entry.policy.id] = entry.name
        chosen.append(entry)
    found = seen.get(in_force.id)
    if found is None:  # over the error budget: still what runs between trials
        chosen.insert(1, Contender(current_name, in_force, "current", 0.0, None))
        found = current_name
    return chosen, found


def contender_to_dict(c: Contender) -> dict[str, Any]:
    return {"name": c.name, "policy": c.policy.to_dict(), "kind": c.kind, "error": c.error,
            "predicted_s": c.predicted_s}


def contender_from_dict(data: Mapping[str, Any]) -> Contender:
    return Contender(str(data["name"]), Policy.from_dict(data["policy"], source="trial policy"),
                     str(data["kind"]), float(data["error"]),
                     None if data["predicted_s"] is None else float(data["predicted_s"]))


def auto_search(
    compute: Mapping[str, Any], grads: Mapping[str, Sequence[torch.Tensor]],
    network: Mapping[str, Any], current: Policy, *, env: Mapping[str, Any], model_name: str,
    world_size: int,
    reference_s: float, budget_s: float, codec_share: float, trials: int, max_error: float,
    pinned: Mapping[str, Any], rebucket: bool, candidates: int, current_name: str = "current",
) -> dict[str, Any]:
    """From the live measurements to the trials' contenders (no collectives).

    Args:
        compute, grads, network: what rank 0 measured (see :mod:`autotune.online.live`).
        env: :func:`~autotune.online.live.live_environment`.
        current: the policy in force (plain DDP at the start, or :func:`stand_in`),
            called ``current_name`` among the contenders.
        reference_s: the DDP start's median step, the profile's calibration.
        budget_s: seconds for the codec probe and the search together; ``codec_share``
            of it for the codec probe.

    Returns:
        ``profile`` (its dict), ``model`` (the fitted cost model's dict: fitting it
        again where training runs would stall a step for seconds), ``top`` (the
        search's best policies, as dicts),
        ``contenders`` (:func:`contender_to_dict` each), ``current`` (the name of the
        policy in force among them), ``codec_probe_s``, ``search_s``, ``trials``.
    """
    started = time.perf_counter()
    profile = live_profile(compute, grads, network, env=env, model_name=model_name,
                           world_size=world_size, codec_budget_s=codec_share * budget_s,
                           calibration=[{"policy": None, "step_s": reference_s}])
    probed = time.perf_counter()
    model = CostModel.fit(profile)
    caps = None if rebucket else (current.bucket_cap_mb,)
    result = tune(profile, max_error=max_error, trials=trials, model=model,
                  pinned=dict(pinned), caps=caps, seeds=[current],
                  timeout=max(budget_s - (probed - started), 0.2 * budget_s),
                  study_name="auto", top_k=candidates + 2)
    contenders, in_force = trial_contenders(
        profile, model, result, current, pinned=pinned, max_error=max_error,
        rebucket=rebucket, candidates=candidates, current_name=current_name)
    return {"profile": profile.to_dict(), "model": model.to_dict(),
            "top": [c.policy.to_dict() for c in result.top],
            "contenders": [contender_to_dict(c) for c in contenders], "current": in_force,
            "codec_probe_s": probed - started, "search_s": time.perf_counter() - probed,
            "trials": result.trials}


def stand_in(grads: Mapping[str, Sequence[torch.Tensor]], current: Policy, *,
             pinned: Mapping[str, Any], max_error: float, world_size: int,
             ) -> tuple[str, Policy, float] | None:
    """What a link-bound job runs while its auto search is busy, instead of plain DDP:
    the preset whose method is a stateless elementwise cast (no state to carry over a
    switch, no guard: it runs as PyTorch's stock hook does) with the fewest wire bytes
    for these gradients and then the smallest error, at ``current``'s bucket cap, with
    the ``pinned`` layers. Its error is measured here on the captured gradients (the
    last step's, at most :data:`STAND_IN_SAMPLE` elements of each, and again scaled by
    :data:`STAND_IN_HEADROOM`), the worst parameter's; None when no such preset is
    within ``max_error`` (exact only, or gradients near the cast's range).

    Returns:
        (its name, as the preset's variant at that cap, the policy, its measured error)
        or None.
    """
    last = {name: steps[-1] for name, steps in grads.items() if steps}
    best: tuple[int, float, int, str, Policy] | None = None
    for order, preset in enumerate(DEFAULT_PRESETS):
        data = preset.policy(current.bucket_cap_mb)
        if pinned:
            data["layers"] = {k: dict(v) for k, v in pinned.items()}
        policy = Policy.from_dict(data, source="stand-in policy")
        methods: dict[Any, compressors.Compressor] = {}
        wire, error = 0, 0.0
        for name, grad in last.items():
            if name in pinned:
                continue
            spec = policy.spec_for(name)
            comp = methods.get(spec)
            if comp is None:
                comp = methods[spec] = compressors.create(spec.name, **spec.kwargs)
            if comp.guarded or not comp.lossy:  # stateful, or exact (plain DDP)
                break
            wire += comp.wire_bytes(tuple(grad.shape), world_size)
            error = max(error, _cast_error(comp, grad, name, world_size))
            if not error <= max_error:
                break
        else:
            if methods and (best is None or (wire, error, order) < best[:3]):
                best = (wire, error, order, preset.variant_name(policy.bucket_cap_mb), policy)
    return None if best is None else (best[3], best[4], best[1])


def _cast_error(comp: compressors.Compressor, grad: torch.Tensor, name: str,
                world_size: int) -> float:
    """``comp``'s relative error on (a sample of) ``grad`` and on it scaled by
    :data:`STAND_IN_HEADROOM` (inf: it left the range)."""
    sample = grad.detach().reshape(-1)[:STAND_IN_SAMPLE].float()
    worst = 0.0
    for scale in (1.0, STAND_IN_HEADROOM):
        ref = sample * scale
        out = ref.clone()
        comp.reduce([out], [name], LocalComm(world_size))
        ref_norm = float(ref.norm())
        diff = float((ref - out).norm())
        if not math.isfinite(diff):
            return math.inf
        worst = max(worst, diff / ref_norm if ref_norm > 0 else (0.0 if diff == 0 else math.inf))
    return worst
