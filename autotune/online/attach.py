"""``autotune.wrap``: the runtime's wrap, with online revision attached when asked.

Online revision wraps the runtime rather than the runtime knowing of it:
:class:`~autotune.runtime.AutotuneDDP` calls one step-boundary callback at the start of
every training forward, and :func:`attach` registers the controller's check there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

import torch

from autotune import measure
from autotune.errors import PolicyError
from autotune.online.config import AUTO_KNOBS, OnlineConfig
from autotune.policies import Policy
from autotune.probes.profile import Profile, load_profile
from autotune.runtime import AutotuneDDP
from autotune.runtime import wrap as runtime_wrap
from autotune.runtime.wrapper import as_policy, check_wrappable

if TYPE_CHECKING:
    from autotune.online.controller import Controller

__all__ = ["AUTO", "ONLINE_KNOBS", "attach", "rank_measure", "wrap"]

logger = logging.getLogger(__name__)

ONLINE_KNOBS = frozenset(f.name for f in dataclasses.fields(OnlineConfig))
"""The keyword arguments of :func:`wrap` that go to the controller, not to DDP."""
AUTO = "auto"  # the policy argument that tunes on the live job
AUTO_BUDGET_S = 5.0  # wrap(model, "auto")'s default budget_s: codec probe and search


def wrap(
    model: torch.nn.Module,
    policy: Policy | str | os.PathLike[str] | None = None,
    *,
    online: bool = False,
    profile: Profile | str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> AutotuneDDP:
    """Wrap ``model`` for data-parallel training under ``policy``.

    ``wrap(model, "auto", save="policy.json")`` tunes on the live job instead: it
    starts as plain DDP, profiles the first steps, searches in the background, tries
    the best candidates and the presets' equivalents on live steps interleaved with
    the policy in force, switches every rank at once to the measured best (bucket size
    included), writes it to ``save`` and keeps watching for drift (see
    :mod:`autotune.online.controller`).

    Args:
        model: the model, already on its device; the process group must be initialised.
        policy: a :class:`Policy`, a path to policy JSON, None for plain averaging, or
            ``"auto"`` (a file called ``auto``: pass ``"./auto"``).
        online: revise the policy while training when the cluster changes (see
            :mod:`autotune.online.controller`); needs ``profile``. Every rank must run
            the same number of forward passes (no ``join()`` with uneven inputs).
        profile: with ``online``: a :class:`~autotune.probes.profile.Profile` or path.
        **kwargs: online knobs (``check_every``, ``threshold``, ``link_threshold``,
            ``patience``, ``patience_s``, ``budget_s``, ``trials``, ``min_gain``,
            ``max_error``, ``pinned``, ``lead_steps``, ``log``, and with ``"auto"``
            ``explore_steps``, ``trial_steps``, ``candidates``, ``profile_steps``,
            ``network_budget_s``, ``save``: see :class:`~autotune.online.OnlineConfig`),
            ``compress_from_step``, ``guard``, ``native`` (without ``online`` or
            ``"auto"``; default: whether the policy is plain averaging, which then runs as
            DDP's own allreduce with no hook, see :class:`~autotune.runtime.AutotuneDDP`),
            and any ``DistributedDataParallel`` argument (``device_ids``,
            ``find_unused_parameters``, ...).

    Raises:
        PolicyError: the policy is malformed or names parameters the model lacks; an
            online knob without ``online=True`` or ``"auto"``; an auto knob without
            ``"auto"``; ``online=True`` without a profile; ``"auto"`` with one;
            ``native`` with ``online=True`` or ``"auto"`` (revising needs the hook).
        ProfileError: the profile is malformed or of another model.
        AutotuneError: a knob out of its range.
    """
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in ONLINE_KNOBS}
    if (online or (isinstance(policy, str) and policy == AUTO)) and kwargs.pop("native", False):
        raise PolicyError("native=True registers no hook, and revising the policy while "
                          "training (online=True or \"auto\") needs it")
    if isinstance(policy, str) and policy == AUTO:
        return _wrap_auto(model, profile, options, kwargs)
    stray = sorted(set(options) & AUTO_KNOBS)
    if stray:
        raise PolicyError(f"{', '.join(stray)} apply only with wrap(model, \"auto\")")
    policy = as_policy(policy)
    # Everything that can be wrong fails before DDP is built (which broadcasts the
    # parameters): the runtime's checks first, then online's.
    check_wrappable(model, policy, kwargs)
    if not online:
        if options:
            raise PolicyError(f"{', '.join(sorted(options))} apply only with online=True")
        return runtime_wrap(model, policy, **kwargs)  # its default: a plain policy runs natively
    if profile is None:
        raise PolicyError("online=True needs profile= (the profile the policy was tuned on, "
                          "or any profile of this job): revisions are predicted from it")
    if not isinstance(profile, Profile):
        profile = load_profile(profile)
    profile.check_model(model, "the wrapped model")
    config = OnlineConfig(**options)
    _load_controller()
    ddp = AutotuneDDP(model, policy, **kwargs)
    attach(ddp, profile, config)
    return ddp


def _wrap_auto(model: torch.nn.Module, profile: Any, options: dict[str, Any],
               ddp_kwargs: dict[str, Any]) -> AutotuneDDP:
    """``wrap(model, "auto")``: every check before DDP is built, then plain DDP (with the
    pinned parameters' compressors) and an exploring controller."""
    if profile is not None:
        raise PolicyError('wrap(model, "auto") measures its own profile on the live steps; '
                          "profile= is for wrap(model, policy, online=True)")
    # the first search runs while the user's steps go on: shorter than a re-search's
    config = OnlineConfig(**{"budget_s": AUTO_BUDGET_S, **options})
    try:
        start = Policy.from_dict({"version": 1, "layers": dict(config.pinned)}, source="pinned")
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"pinned: expected parameter name -> compressor spec, {exc}") from exc
    check_wrappable(model, start, ddp_kwargs)
    _load_controller()
    ddp = AutotuneDDP(model, start, **ddp_kwargs)
    attach(ddp, None, config, auto=True)
    return ddp


def _load_controller() -> None:
    """Import the controller's modules (scikit-learn, optuna: 1-3 s) before DDP is
    built: DDP's constructor then lines the ranks up after them. Imported later, a rank
    that imports slower holds every other rank in the first step's collectives (0.4-0.5
    s of skew in a 2-rank job's first step here, where plain DDP's takes 0.05 s)."""
    import autotune.online.controller  # noqa: F401


def attach(ddp: AutotuneDDP, profile: Profile | None, config: OnlineConfig, *,
           auto: bool = False) -> Controller:
    """Attach a controller revising ``ddp``'s policy online; returns it (also ``ddp.controller``).

    Args:
        ddp: the wrapped model.
        profile: what revisions are predicted from (None with ``auto``).
        config: the knobs.
        auto: explore from the policy in force first, measuring the profile on the live
            steps, and change bucket sizes (when ``ddp.can_rebucket``).

    Raises:
        AutotuneError: the revision log or the policy to save cannot be written, or
            ``ddp`` has a step-boundary callback already.
    """
    # deferred, within this layer: the controller loads the cost model and the search
    # (scikit-learn, optuna), which a wrap that does not revise online never needs
    from autotune.online.controller import Controller

    state = ddp.comm_state
    if profile is not None and profile.world_size != state.world_size:
        logger.warning("the profile was taken on %d rank(s), this job has %d: revisions "
                       "are predicted for the profiled world size", profile.world_size,
                       state.world_size)
    rebucket = ddp.set_bucket_cap if auto and ddp.can_rebucket else None
    if auto and rebucket is None:
        logger.warning("auto: this model's DDP buckets cannot be rebuilt (static_graph or "
                       "mixed precision); bucket_cap_mb stays %g", ddp.policy.bucket_cap_mb)
    controller = Controller(state, profile, config, ddp.process_group, auto=auto,
                            module=ddp.module if auto else None, rebucket=rebucket,
                            native=ddp.set_native if rebucket is not None else None)
    ddp.on_step_boundary(controller.boundary)
    ddp.controller = controller
    return controller


def rank_measure(workload: str, setups: Sequence[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """:func:`autotune.measure.rank_measure` where a set-up may revise its policy online
    (``Setup.online``: :func:`wrap`'s ``profile`` and knobs). Runs on every rank: launch
    ``"autotune.online:rank_measure"``.
    """
    return measure.rank_measure(workload, setups, wrap=wrap, **options)
