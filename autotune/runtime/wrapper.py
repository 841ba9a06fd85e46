"""``autotune.wrap``: a drop-in for ``DistributedDataParallel`` that applies a policy.

The result *is* a ``DistributedDataParallel`` (a subclass), so ``.module``,
``no_sync()``, ``join()``, ``state_dict()`` keys and ``isinstance`` checks are DDP's own;
a user changes one line::

    model = DistributedDataParallel(model)          # before
    model = autotune.wrap(model, "policy.json")     # after

The communication state (error feedback, PowerSGD's Q, the step counter) is checkpointed
separately, as with PyTorch's ``PowerSGDState``: ``model.comm_state.state_dict()``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from autotune.errors import AutotuneError, PolicyError
from autotune.policies import Policy, load_policy
from autotune.runtime.hook import AutotuneState, dispatch_hook

logger = logging.getLogger(__name__)

__all__ = ["AutotuneDDP", "wrap"]


class AutotuneDDP(DistributedDataParallel):
    """``DistributedDataParallel`` with autotune's dispatcher hook registered.

    Args:
        module: the model, as for DDP.
        policy: the policy to apply; its ``bucket_cap_mb`` sets DDP's bucket size.
        compress_from_step: first step that may compress (>= 2).
        guard: agree before compressing each bucket whether a rank has a non-finite
            gradient in it or has joined, and average it by plain allreduce then (see
            :class:`~autotune.runtime.hook.AutotuneState`).
        **ddp_kwargs: any other ``DistributedDataParallel`` argument.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        policy: Policy,
        *,
        compress_from_step: int = 2,
        guard: bool = True,
        online: bool = False,
        profile: Any = None,
        online_options: Mapping[str, Any] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if "bucket_cap_mb" in ddp_kwargs:
            raise PolicyError(
                "bucket_cap_mb comes from the policy "
                f"(bucket_cap_mb={policy.bucket_cap_mb:g}); change it there, not in wrap()"
            )
        policy.check(module).raise_if_unknown()
        _refuse_sparse_gradients(module)
        if online:
            # A bad or foreign profile, or an unknown knob, fails here, before DDP is built.
            from autotune.online import OnlineConfig
            from autotune.probes.profile import Profile, load_profile

            if profile is None:
                raise PolicyError("online=True needs profile= (the profile the policy was tuned on, "
                                  "or any profile of this job): revisions are predicted from it")
            if not isinstance(profile, Profile):
                profile = load_profile(profile)
            profile.check_model(module, "the wrapped model")
            try:
                config = OnlineConfig(**dict(online_options or {}))
            except TypeError as exc:  # an unknown knob
                raise PolicyError(f"online options: {exc}") from None
        elif online_options:
            raise PolicyError(f"{', '.join(sorted(online_options))} apply only with online=True")
        super().__init__(module, bucket_cap_mb=policy.bucket_cap_mb, **ddp_kwargs)
        self.comm_state = AutotuneState(
            policy, self.module, self.process_group, compress_from_step=compress_from_step,
            guard=guard,
        )
        self.register_comm_hook(self.comm_state, dispatch_hook)
        # Online revision is opt-in; its controller (and with it the cost model and the
        # search) loads only then, keeping the training path light.
        self.controller: Any = None
        if online:
            from autotune.online import Controller

            if profile.world_size != self.comm_state.world_size:
                logger.warning("the profile was taken on %d rank(s), this job has %d: revisions "
                               "are predicted for the profiled world size", profile.world_size,
                               self.comm_state.world_size)
            self.controller = Controller(self.comm_state, profile, config, self.process_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Between steps: where the online controller may switch policies, never inside
        # a backward pass. Evaluation passes (no grad, or eval mode) are not steps.
        if self.controller is not None and self.training and torch.is_grad_enabled():
            self.controller.boundary()
        out = super().forward(*inputs, **kwargs)
        if self.training and torch.is_grad_enabled():
            self.comm_state.forward_done()
        return out

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """DDP's join hook, marking the rank as joined while it shadows the others, so
        that the guard averages their buckets by plain allreduce (a joined rank adds
        exactly zero, as under DDP, and no compressor state moves).

        Raises:
            AutotuneError: ``divide_by_initial_world_size=False``: the hook always
                divides by the world size, as PyTorch's own hooks do.
        """
        if not kwargs.get("divide_by_initial_world_size", True):
            raise AutotuneError(
                "join(divide_by_initial_world_size=False) is not supported by autotune's "
                "hook, which divides by the initial world size (as PyTorch's own hooks do)"
            )
        return _JoinHook(super().join_hook(**kwargs), self.comm_state)

    @property
    def policy(self) -> Policy:
        """The policy being applied."""
        return self.comm_state.policy


def _refuse_sparse_gradients(module: torch.nn.Module) -> None:
    """DDP hands a comm hook an embedding's sparse gradient as a sparse tensor, which
    no compressor reads (and PyTorch's own hooks do not either)."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            raise AutotuneError(
                f"{name} comes from {type(sub).__name__}(sparse=True), whose sparse gradient "
                "DDP hands a communication hook as a sparse tensor, which autotune does not "
                "read; build it with sparse=False and give it the rowsparse compressor, "
                "which sends only the rows a step touched"
            )


class _JoinHook(JoinHook):
    """Wraps DDP's join hook: ``state.joined`` is True while this rank shadows."""

    def __init__(self, inner: JoinHook, state: AutotuneState) -> None:
        self._inner = inner
        self._state = state

    def main_hook(self) -> None:
        self._state.joined = True
        self._inner.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._state.joined = False
        self._inner.post_hook(is_last_joiner)


def wrap(
    model: torch.nn.Module,
    policy: Policy | str | os.PathLike[str] | None = None,
    *,
    online: bool = False,
    profile: Any = None,
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
        PolicyError: the policy is malformed or names parameters the model lacks.
    """
    if policy is None:
        policy = Policy()
    elif not isinstance(policy, Policy):
        policy = load_policy(policy)
    online_options = {k: kwargs.pop(k) for k in list(kwargs) if k in _ONLINE_KNOBS}
    return AutotuneDDP(model, policy, online=online, profile=profile,
                       online_options=online_options, **kwargs)


_ONLINE_KNOBS = frozenset({"check_every", "threshold", "link_threshold", "patience", "budget_s", "trials",
                           "min_gain", "max_error", "pinned", "lead_steps", "log"})
