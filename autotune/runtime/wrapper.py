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

import os
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from autotune.errors import PolicyError
from autotune.policies import Policy, load_policy
from autotune.runtime.hook import AutotuneState, dispatch_hook

__all__ = ["AutotuneDDP", "wrap"]


class AutotuneDDP(DistributedDataParallel):
    """``DistributedDataParallel`` with autotune's dispatcher hook registered.

    Args:
        module: the model, as for DDP.
        policy: the policy to apply; its ``bucket_cap_mb`` sets DDP's bucket size.
        compress_from_step: first step that may compress (>= 2).
        **ddp_kwargs: any other ``DistributedDataParallel`` argument.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        policy: Policy,
        *,
        compress_from_step: int = 2,
        **ddp_kwargs: Any,
    ) -> None:
        if "bucket_cap_mb" in ddp_kwargs:
            raise PolicyError(
                "bucket_cap_mb comes from the policy "
                f"(bucket_cap_mb={policy.bucket_cap_mb:g}); change it there, not in wrap()"
            )
        policy.check(module).raise_if_unknown()
        super().__init__(module, bucket_cap_mb=policy.bucket_cap_mb, **ddp_kwargs)
        self.comm_state = AutotuneState(
            policy, self.module, self.process_group, compress_from_step=compress_from_step
        )
        self.register_comm_hook(self.comm_state, dispatch_hook)

    @property
    def policy(self) -> Policy:
        """The policy being applied."""
        return self.comm_state.policy


def wrap(
    model: torch.nn.Module,
    policy: Policy | str | os.PathLike[str] | None = None,
    **ddp_kwargs: Any,
) -> AutotuneDDP:
    """Wrap ``model`` for data-parallel training under ``policy``.

    Args:
        model: the model, already on its device; the process group must be initialised.
        policy: a :class:`Policy`, a path to policy JSON, or None for plain averaging.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``device_ids``,
            ``find_unused_parameters``, ``gradient_as_bucket_view``...), plus
            ``compress_from_step``.

    Raises:
        PolicyError: the policy is malformed or names parameters the model lacks.
    """
    if policy is None:
        policy = Policy()
    elif not isinstance(policy, Policy):
        policy = load_policy(policy)
    return AutotuneDDP(model, policy, **ddp_kwargs)
