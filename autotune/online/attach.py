"""``autotune.wrap``: the runtime's wrap, with online revision attached when asked.

Online revision wraps the runtime rather than the runtime knowing of it:
:class:`~autotune.runtime.AutotuneDDP` calls one step-boundary callback at the start of
every training forward, and :func:`attach` registers the controller's check there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import torch

from autotune import measure
from autotune.errors import PolicyError
from autotune.online.controller import Controller, OnlineConfig
from autotune.policies import Policy
from autotune.probes.profile import Profile, load_profile
from autotune.runtime import AutotuneDDP
from autotune.runtime.wrapper import as_policy, check_wrappable

__all__ = ["ONLINE_KNOBS", "attach", "rank_measure", "wrap"]

logger = logging.getLogger(__name__)

ONLINE_KNOBS = frozenset(f.name for f in dataclasses.fields(OnlineConfig))
"""The keyword arguments of :func:`wrap` that go to the controller, not to DDP."""


def wrap(
    model: torch.nn.Module,
    policy: Policy | str | os.PathLike[str] | None = None,
    *,
    online: bool = False,
    profile: Profile | str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> AutotuneDDP:
    """Wrap ``model`` for data-parallel training under ``policy``.

    Args:
        model: the model, already on its device; the process group must be initialised.
        policy: a :class:`Policy`, a path to policy JSON, or None for plain averaging.
        online: revise the policy while training when the cluster changes (see
            :mod:`autotune.online.controller`); needs ``profile``. Every rank must run
            the same number of forward passes (no ``join()`` with uneven inputs).
        profile: with ``online``: a :class:`~autotune.probes.profile.Profile` or path.
        **kwargs: online knobs (``check_every``, ``threshold``, ``link_threshold``, ``patience``,
            ``budget_s``, ``trials``, ``min_gain``, ``max_error``, ``pinned``,
            ``lead_steps``, ``log``: see :class:`~autotune.online.OnlineConfig`),
            ``compress_from_step``, ``guard``, and any ``DistributedDataParallel`` argument
            (``device_ids``, ``find_unused_parameters``, ...).

    Raises:
        PolicyError: the policy is malformed or names parameters the model lacks; an
            online knob without ``online=True``; ``online=True`` without a profile.
        ProfileError: the profile is malformed or of another model.
    """
    policy = as_policy(policy)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in ONLINE_KNOBS}
    # Everything that can be wrong fails before DDP is built (which broadcasts the
    # parameters): the runtime's checks first, then online's.
    check_wrappable(model, policy, kwargs)
    if not online:
        if options:
            raise PolicyError(f"{', '.join(sorted(options))} apply only with online=True")
        return AutotuneDDP(model, policy, **kwargs)
    if profile is None:
        raise PolicyError("online=True needs profile= (the profile the policy was tuned on, "
                          "or any profile of this job): revisions are predicted from it")
    if not isinstance(profile, Profile):
        profile = load_profile(profile)
    profile.check_model(model, "the wrapped model")
    config = OnlineConfig(**options)
    ddp = AutotuneDDP(model, policy, **kwargs)
    attach(ddp, profile, config)
    return ddp


def attach(ddp: AutotuneDDP, profile: Profile, config: OnlineConfig) -> Controller:
    """Attach a controller revising ``ddp``'s policy online; returns it (also ``ddp.controller``).

    Raises:
        AutotuneError: the revision log cannot be written, or ``ddp`` has a step-boundary
            callback already.
    """
    state = ddp.comm_state
    if profile.world_size != state.world_size:
        logger.warning("the profile was taken on %d rank(s), this job has %d: revisions "
                       "are predicted for the profiled world size", profile.world_size,
                       state.world_size)
    controller = Controller(state, profile, config, ddp.process_group)
    ddp.on_step_boundary(controller.boundary)
    ddp.controller = controller
    return controller


def rank_measure(workload: str, setups: Sequence[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """:func:`autotune.measure.rank_measure` where a set-up may revise its policy online
    (``Setup.online``: :func:`wrap`'s ``profile`` and knobs). Runs on every rank: launch
    ``"autotune.online:rank_measure"``.
    """
    return measure.rank_measure(workload, setups, wrap=wrap, **options)
