"""``autotune.wrap``: a drop-in for ``DistributedDataParallel`` that applies a policy.

The result *is* a ``DistributedDataParallel`` (a subclass), so ``.module``,
``no_sync()``, ``join()``, ``state_dict()`` keys and ``isinstance`` checks are DDP's own;
a user changes one line::

    model = DistributedDataParallel(model)          # before
    model = autotune.wrap(model, "policy.json")     # after

The communication state (error feedback, PowerSGD's Q, the step counter) is checkpointed
separately, as with PyTorch's ``PowerSGDState``: ``model.comm_state.state_dict()``.

This is the runtime alone. ``autotune.wrap`` (:func:`autotune.online.wrap`) is this
wrap, and with ``online=True`` it attaches a controller through the one step-boundary
callback :class:`AutotuneDDP` keeps (:meth:`AutotuneDDP.on_step_boundary`); the runtime
imports nothing of online revision.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from autotune.errors import AutotuneError, PolicyError
from autotune.policies import Policy, load_policy
from autotune.policies.policy import ddp_bucket_cap
from autotune.runtime.hook import AutotuneState, dispatch_hook

__all__ = ["AutotuneDDP", "as_policy", "check_wrappable", "wrap"]

# DistributedDataParallel internals set_bucket_cap uses (torch 2.13)
_REBUCKET_NEEDS = ("_ddp_init_helper", "_build_params_for_reducer",
                   "_build_debug_param_to_name_mapping", "_comm_hooks", "_bucket_config",
                   "reducer", "logger")


class AutotuneDDP(DistributedDataParallel):
    """``DistributedDataParallel`` with autotune's dispatcher hook registered.

    Args:
        module: the model, as for DDP.
        policy: the policy to apply; its ``bucket_cap_mb`` sets DDP's bucket size
            (:attr:`Policy.ddp_bucket_cap_mb`: at 25, DDP's default buckets).
        compress_from_step: first step that may compress (>= 0; default 2: the first
            two steps, before and at DDP's bucket rebuild, are plain DDP).
        guard: agree before compressing each bucket whether a rank has a non-finite
            gradient in it or has joined, and average it by plain allreduce then (see
            :class:`~autotune.runtime.hook.AutotuneState`).
        native: register no hook: DDP reduces with its own C++ allreduce, as an
            unwrapped DDP (only for a plain policy, :attr:`Policy.is_plain`; the policy
            cannot change then, and ``comm_state`` records no buckets).
        **ddp_kwargs: any other ``DistributedDataParallel`` argument.
            ``gradient_as_bucket_view`` defaults to True here (DDP's own default is
            False): each ``.grad`` is a view into its bucket, so the reduced bucket is
            the gradient and nothing is copied back each step. False: DDP's default.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        policy: Policy,
        *,
        compress_from_step: int = 2,
        guard: bool = True,
        native: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        check_wrappable(module, policy, ddp_kwargs)
        if native and not policy.is_plain:
            raise PolicyError("native=True runs DDP's own allreduce, which only plain averaging "
                              "(compressor none everywhere, flat) is; this policy compresses")
        # Gradients as views into DDP's buckets unless the caller says otherwise: a hook's
        # result then is the gradient, where DDP's default copies every gradient into its
        # bucket and back each step (and without a hook DDP divides while copying in, a
        # pass a hook makes separately: the extra copy is what a hook cost beside it).
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        # at DDP's default cap, DDP's default buckets (a 1 MiB first bucket): exactly DDP(model)
        super().__init__(module, bucket_cap_mb=policy.ddp_bucket_cap_mb, **ddp_kwargs)
        self.comm_state = AutotuneState(
            policy, self.module, self.process_group, compress_from_step=compress_from_step,
            guard=guard, native=native,
        )
        if not native:
            self.register_comm_hook(self.comm_state, dispatch_hook)
        # Called at the start of every training forward (see on_step_boundary).
        self._step_boundary: Callable[[], None] | None = None
        # What revises the policy while training (autotune.online attaches one), or None.
        self.controller: Any = None

    def on_step_boundary(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at the start of every training forward: between steps,
        never inside a backward pass, so it may switch the policy (``comm_state.
        set_policy``). Evaluation passes (no grad, or eval mode) are not steps. Online
        revision registers its controller's check here.

        Raises:
            AutotuneError: a callback is registered already (one per model).
        """
        if self._step_boundary is not None:
            raise AutotuneError(f"a step-boundary callback is registered already "
                                f"({self._step_boundary!r}); a model takes one")
        self._step_boundary = callback

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._step_boundary is not None and self.training and torch.is_grad_enabled():
            self._step_boundary()
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

    @property
    def can_rebucket(self) -> bool:
        """Whether :meth:`set_bucket_cap` can rebuild this model's buckets: not with
        ``static_graph``, mixed precision, parameters DDP reduces outside its buckets,
        or a torch whose DDP lacks the internals it uses."""
        return (all(hasattr(self, a) for a in _REBUCKET_NEEDS)
                and hasattr(self.reducer, "_remove_autograd_hooks")
                and not getattr(self, "static_graph", True)
                and getattr(self, "mixed_precision", None) is None
                and not getattr(self, "_delay_all_reduce_params", ())
                and not getattr(self, "_use_python_reducer", False))

    def set_bucket_cap(self, bucket_cap_mb: float) -> None:
        """Rebuild DDP's reducer with buckets of ``bucket_cap_mb`` MiB; call between
        steps, at the same step on every rank (the online controller's announced switch).

        DDP fixes its buckets when it is built (setting ``bucket_bytes_cap`` has no
        effect), so this replaces the reducer the way DDP's constructor makes it: the
        old one's autograd hooks are removed, a new one is built over the same
        parameters with the new cap, and the communication hook is registered on it
        again. Like a fresh DDP, its first backward pass reduces everything in one
        bucket and the next forward rebuilds the buckets in gradient-ready order, on
        every rank alike. Nothing is broadcast (the parameters are already equal).

        Raises:
            AutotuneError: this model cannot be rebucketed (:attr:`can_rebucket`).
        """
        self._rebuild(bucket_cap_mb, hooked=not self.comm_state.native)

    def set_native(self, native: bool) -> None:
        """Run the plain policy in force as DDP's own allreduce (True), or through
        autotune's hook again (False); call between steps, at the same step on every
        rank (the online controller does, once it settles on a plain policy and its
        switch owes nothing: ``comm_state.owes``). The reducer is rebuilt as by
        :meth:`set_bucket_cap`, at the policy's cap, with the hook or without it: a
        hook averages in a pass of its own, where DDP's native path divides while it
        copies each gradient into its bucket (an unshaped 2-rank dlrm, gradients as
        bucket views: autotune's ``none`` 0.97-0.99x DDP's default step, natively
        0.85-0.88x), which a plain policy need not pay. Natively the policy cannot change, and
        ``comm_state`` records no buckets.

        Raises:
            AutotuneError: the buckets cannot be rebuilt (:attr:`can_rebucket`), or
                ``native`` with a policy that is not plain.
        """
        state = self.comm_state
        if bool(native) == state.native:
            return
        if native and not state.policy.is_plain:
            raise AutotuneError("only a plain policy runs as DDP's own allreduce; policy "
                                f"{state.policy.id} compresses")
        if any(hook is not dispatch_hook for hook, _ in self._comm_hooks):
            raise AutotuneError("another communication hook is registered on this model; "
                                "DDP takes one, so autotune's cannot be added or removed")
        self._rebuild(state.policy.bucket_cap_mb, hooked=not native)
        state.native = bool(native)

    def _rebuild(self, bucket_cap_mb: float, hooked: bool) -> None:
        """The reducer rebuilt over the same parameters at ``bucket_cap_mb``, with
        autotune's hook registered on it (``hooked``) or none."""
        if not self.can_rebucket:
            raise AutotuneError(
                "this model's DDP buckets cannot be rebuilt (static_graph, mixed precision, "
                "delayed all-reduce parameters or a DDP without the internals used); keep "
                f"bucket_cap_mb={self.comm_state.policy.bucket_cap_mb:g}"
            )
        from torch.nn.parallel.distributed import _BucketCapacityConfig

        self.reducer._remove_autograd_hooks()
        self._bucket_config = _BucketCapacityConfig.create(
            # at DDP's default cap, DDP's default buckets, as the constructor made them
            bucket_cap_mb=ddp_bucket_cap(bucket_cap_mb),  # type: ignore[arg-type]  # a float too
            bucket_cap_mb_list=None,
            use_python_reducer=self._use_python_reducer,
        )
        self.bucket_bytes_cap = self._bucket_config.bucket_bytes_cap
        self.bucket_bytes_cap_list = []
        self.bucket_bytes_cap_default = (self._bucket_config.first_bucket_bytes_cap
                                         < self._bucket_config.bucket_bytes_cap)
        parameters, expect_sparse = self._build_params_for_reducer()
        names = self._build_debug_param_to_name_mapping(parameters)
        self._ddp_init_helper(parameters, expect_sparse, names, False)
        self._has_rebuilt_buckets = False
        if hooked and all(hook is not dispatch_hook for hook, _ in self._comm_hooks):
            self._comm_hooks.append((dispatch_hook, self.comm_state))  # wrapped natively
        for hook, state in self._comm_hooks:  # any other hook registered stays registered
            if hook is dispatch_hook and not hooked:
                continue
            if self.logger is not None:
                self.logger._set_comm_hook_name(hook.__qualname__)
            dist._register_comm_hook(self.reducer, state, hook)


def check_wrappable(module: torch.nn.Module, policy: Policy, ddp_kwargs: Mapping[str, Any]) -> None:
    """The checks :class:`AutotuneDDP` makes before it builds DDP.

    Raises:
        PolicyError: ``ddp_kwargs`` sets ``bucket_cap_mb`` (the policy does), or the policy
            names parameters the module lacks.
        AutotuneError: the module has a sparse-gradient embedding.
    """
    if "bucket_cap_mb" in ddp_kwargs:
        raise PolicyError(
            "bucket_cap_mb comes from the policy "
            f"(bucket_cap_mb={policy.bucket_cap_mb:g}); change it there, not in wrap()"
        )
    policy.check(module).raise_if_unknown()
    _refuse_sparse_gradients(module)


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


def as_policy(policy: Policy | str | os.PathLike[str] | None) -> Policy:
    """``policy`` as a :class:`Policy`: itself, loaded from a path, or plain averaging for None.

    Raises:
        PolicyError: the file is not a valid policy.
    """
    if policy is None:
        return Policy()
    return policy if isinstance(policy, Policy) else load_policy(policy)


def wrap(
    model: torch.nn.Module,
    policy: Policy | str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> AutotuneDDP:
    """Wrap ``model`` for data-parallel training under ``policy``, without online revision
    (``autotune.wrap`` adds it: :func:`autotune.online.wrap`).

    A plain policy (:attr:`Policy.is_plain`, e.g. None) runs natively by default: no hook,
    DDP's own C++ allreduce, an unwrapped DDP's speed or better (each gradient a view
    into its bucket, unless ``gradient_as_bucket_view=False``). Pass ``native=False`` to
    run it through autotune's hook anyway (its per-bucket breakdown in ``comm_state``).

    Args:
        model: the model, already on its device; the process group must be initialised.
        policy: a :class:`Policy`, a path to policy JSON, or None for plain averaging.
        **kwargs: ``compress_from_step``, ``guard``, ``native``, and any
            ``DistributedDataParallel`` argument (``device_ids``, ``find_unused_parameters``, ...).

    Raises:
        PolicyError: the policy is malformed or names parameters the model lacks.
    """
    policy = as_policy(policy)
    kwargs.setdefault("native", policy.is_plain)
    return AutotuneDDP(model, policy, **kwargs)
