"""The compressor contract (the registry and the parameter tables, which need no torch,
are in :mod:`autotune.compressors.registry`; this module re-exports them).

A compressor reduces a *group* of gradient tensors (those of one DDP bucket that share
this compressor) across ranks: it encodes them, runs its collectives on a
:class:`~autotune.compressors.comm.Comm`, decodes, and writes the averaged result back
in place. All tensors of a group travel in one collective per stage, so a bucket costs
one collective per compressor and stage, whatever the number of parameters in it.

Only the payload travels; the context (error-feedback memory, PowerSGD's Q, random
state) stays on the rank, in the compressor, and is saved with ``state_dict()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Mapping, Sequence

import torch

from autotune.compressors.comm import Comm
from autotune.compressors.memory import ErrorFeedback
from autotune.compressors.registry import (
    ERROR_FEEDBACK,
    REGISTRY,
    CompressorSpec,
    Param,
    Registry,
    create,
    names,
    register,
)
from autotune.errors import CompressorError

__all__ = [
    "AllreduceCompressor",
    "ErrorFeedbackCompressor",
    "ERROR_FEEDBACK",
    "Collective",
    "Param",
    "Compressor",
    "CompressorSpec",
    "Registry",
    "REGISTRY",
    "register",
    "create",
    "names",
]

Collective = Literal["allreduce", "allgather"]
Shape = Sequence[int]


class Compressor(ABC):
    """Reduce a group of gradients across ranks, compressed.

    Subclasses set the class attributes and implement :meth:`reduce` and
    :meth:`wire_messages`; the class attributes and the other methods describe the
    method to the cost model, the search and the codec probe, none of which name a
    method. Error-feedback methods derive from :class:`ErrorFeedbackCompressor`.
    """

    name: ClassVar[str]
    # collectives one reduction issues, in order; the cost model reads these
    collectives: ClassVar[tuple[Collective, ...]]
    # tunable parameters; every other keyword is rejected
    params: ClassVar[Mapping[str, Param]] = {}
    # False for exact methods (allreduce in the gradient's own dtype)
    lossy: ClassVar[bool] = True
    # False for methods that keep no state and pass a NaN/Inf, and a joined rank's zeros,
    # through exactly as DDP's allreduce would: the runtime's guard is not needed for them
    guarded: ClassVar[bool] = True
    # True for guarded methods whose reduce changes no state before it calls
    # ``comm.admit()``, which it does before its first collective: the runtime then lets
    # it encode while the guard's agreement is still on its way
    encodes_before_guard: ClassVar[bool] = False
    # True for methods whose bytes and work depend on the gradient's values (rowsparse:
    # its non-zero rows), not on its shape alone: wire_messages reads ``density``, and
    # the codec probe times them on the captured gradients and records the density
    density_dependent: ClassVar[bool] = False
    # True for methods that act on each element alone, in one allreduce: they cost next
    # to nothing, so the search offers them to small tensors too
    elementwise: ClassVar[bool] = False
    # True for methods that compress matrices only (a gradient viewed as shape[0] x the
    # rest; others travel whole): the search offers them to matrix groups only
    needs_matrix: ClassVar[bool] = False
    # True for methods whose allreduce sums 2-byte floats, which gloo does on the CPU
    # (the cost model's residual counts those bytes)
    half_precision: ClassVar[bool] = False
    # the parameter that sets a configuration's bytes and work (PowerSGD's rank, top-k's
    # ratio, int8's block), the cost model's fourth codec feature; None: there is none
    size_param: ClassVar[str | None] = None

    def __init__(self, **kwargs: Any) -> None:
        self.config: dict[str, Any] = REGISTRY.validate(self.name, kwargs)

    @property
    def spec(self) -> CompressorSpec:
        return CompressorSpec.of(self.name, **self.config)

    @abstractmethod
    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        """Average ``tensors`` across ranks through ``comm``, compressed, in place.

        Args:
            tensors: this rank's gradients of one group (views into a DDP bucket).
            names: their parameter names, the keys of per-tensor state.
            comm: the collectives of this rank's group.
        """

    @abstractmethod
    def wire_messages(
        self, shape: Shape, world_size: int, density: float | None = None
    ) -> dict[Collective, int]:
        """Bytes this rank hands to each collective for one tensor of ``shape``.

        Computable without running the compressor; what :meth:`reduce` sends for a group
        is the sum over its tensors. ``density`` is the fraction of the tensor's rows
        (first dimension) that hold a non-zero value on the rank touching the most of
        them; only data-dependent methods (``rowsparse``) read it, and None means dense.
        """

    def wire_bytes(self, shape: Shape, world_size: int, density: float | None = None) -> int:
        """Total bytes this rank hands to collectives for one tensor of ``shape``."""
        return sum(self.wire_messages(shape, world_size, density).values())

    def group_messages(
        self, shapes: Sequence[Shape], world_size: int,
        densities: Sequence[float | None] | None = None,
    ) -> list[tuple[Collective, int]]:
        """The collectives one reduction of a group of tensors of ``shapes`` issues, in
        order, with the bytes this rank hands to each; what the cost model times.

        By default one message per collective kind, in the order of :attr:`collectives`,
        carrying :meth:`wire_messages` summed over the tensors; kinds that carry nothing
        are left out. ``densities`` (per shape, None: dense) size data-dependent methods.
        """
        totals: dict[Collective, int] = {}
        for shape, density in zip(shapes, densities or [None] * len(shapes)):
            for kind, nbytes in self.wire_messages(shape, world_size, density).items():
                totals[kind] = totals.get(kind, 0) + nbytes
        return [(kind, totals[kind]) for kind in dict.fromkeys(self.collectives) if kind in totals]

    @classmethod
    def codec_param(cls, config: Mapping[str, Any], density: float | None = None) -> float:
        """The fourth of the cost model's codec inputs ``[numel, rows, cols, param]``: the
        value of :attr:`size_param` in ``config`` (a full configuration), 0 without one;
        data-dependent methods return the density (None: dense, 1) instead."""
        if cls.density_dependent:
            return 1.0 if density is None else float(density)
        return float(config[cls.size_param]) if cls.size_param is not None else 0.0

    @staticmethod
    def codec_features(xp: Any, numel: Any, rows: Any, cols: Any, param: Any) -> list[Any]:
        """Columns proportional to this method's encode+decode work, on which the cost
        model fits non-negative coefficients.

        Args:
            xp: the array namespace of the inputs (numpy), so that compressors need not
                import it.
            numel, rows, cols, param: arrays of one value per tensor (rows x cols: the
                matrix view; param: :meth:`codec_param`).

        Returns:
            The columns. The default, for methods that pass over the elements a fixed
            number of times: a constant and the element count.
        """
        return [xp.ones_like(numel), numel]

    def on_live_rows(self, shape: Shape, live: int, world_size: int) -> CompressorSpec | None:
        """The configuration that, run on the ``live`` rows of a tensor of ``shape`` that
        are not zero in every step, does there exactly what this one does on the whole
        tensor (whose other rows are zero); None where no configuration does.

        The codec probe then measures a large tensor's error on its live rows alone.
        Methods whose result on a row depends on the zero rows (a scale over every
        element, blocks that span rows) have none; the default says so.
        """
        return None

    def release(self, name: str) -> torch.Tensor | None:
        """Forget parameter ``name`` (it moves to another compressor) and return what
        its error feedback still owed, to be added to its next gradient; None if
        nothing is owed. Warm starts and counters of ``name`` are dropped."""
        return None

    def reset_error_feedback(self) -> int:
        """Drop every residual of the error feedback; returns how many were dropped.
        State every rank shares stays. Methods without error feedback have none."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state (error feedback, warm starts, random state); tensors only."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise CompressorError(f"{self.name} keeps no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.label()})"


class AllreduceCompressor(Compressor):
    """A stateless method whose reduction is one allreduce of an elementwise encoding of
    the gradients (``none``, ``fp16``, ``bf16``).

    A non-finite value or a joined rank's zeros pass through such a reduction exactly as
    through DDP's own allreduce, and there is no state they could poison, so the runtime
    runs these methods the way PyTorch's stock hooks do: :meth:`encode` in the hook,
    the allreduce issued asynchronously on DDP's group, :meth:`decode` when it
    completes, with no guard and no hand-off to the communication thread.
    Subclasses implement :meth:`encode` and :meth:`decode`.
    """

    collectives: ClassVar[tuple[Collective, ...]] = ("allreduce",)
    guarded: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True

    @abstractmethod
    def encode(self, flat: torch.Tensor, world_size: int) -> torch.Tensor:
        """The payload whose sum over ranks :meth:`decode` turns into the average of
        ``flat`` (a flat gradient, which may be overwritten); may be ``flat`` itself."""

    @abstractmethod
    def decode(self, summed: torch.Tensor, flat: torch.Tensor) -> None:
        """Write the average into ``flat`` from the summed payload."""

    def reduce(self, tensors: Sequence[torch.Tensor], names: Sequence[str], comm: Comm) -> None:
        with comm.phase("flatten"):
            flat = flatten(tensors)
        payload = self.encode(flat, comm.world_size)
        comm.all_reduce(payload)
        self.decode(payload, flat)
        with comm.phase("copy_back"):
            unflatten_into(flat, tensors)

    def on_live_rows(self, shape: Shape, live: int, world_size: int) -> CompressorSpec | None:
        return self.spec  # what happens to a row does not depend on the others


class ErrorFeedbackCompressor(Compressor):
    """A method that adds back, next step, what its compression dropped this step
    (``sign``, ``topk``, ``powersgd``).

    The residuals live in ``self.memory``, an
    :class:`~autotune.compressors.memory.ErrorFeedback` keyed by parameter name and
    switched by the ``error_feedback`` parameter (:data:`ERROR_FEEDBACK`, which every
    subclass lists); they are the ``"memory"`` entry of the state, are owed back when a
    parameter moves to another compressor (:meth:`release`) and are dropped by
    :meth:`reset_error_feedback`. Subclasses with more state list its keys in
    :attr:`state_keys` and extend :meth:`state_dict` / :meth:`load_state_dict`.
    """

    state_keys: ClassVar[tuple[str, ...]] = ("memory",)  # what state_dict holds

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory = ErrorFeedback(self.config["error_feedback"])

    def _compensated_flat(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(m, add)``: the flat fp32 tensor this step encodes, ``m + add`` once ``add``
        (None: nothing) is added in, which encoders do chunk by chunk while each chunk
        is in cache.

        With error feedback ``m`` is ``name``'s residual, rewritten in place into the new
        residual, and ``add`` the gradient; on the first step (no residual of the
        gradient's size) ``m`` is a copy of the gradient, stored as the residual. Without
        it ``m`` is the gradient itself where it is fp32 (encoders only read it until
        the payload is taken), else an fp32 copy.

        Args:
            name: the parameter's name, the key of its residual.
            grad: its flat gradient.
        """
        if not self.memory.enabled:
            return (grad if grad.dtype == torch.float32 else grad.float()), None
        m = self.memory.flat_residual(name, grad)
        if m is None:  # first step: the residual starts as the gradient
            m = grad.to(torch.float32, copy=True)
            self.memory.store(name, m)
            return m, None
        return m, grad

    def release(self, name: str) -> torch.Tensor | None:
        return self.memory.pop(name)

    def reset_error_feedback(self) -> int:
        return self.memory.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - set(self.state_keys)
        if unknown:
            raise CompressorError(f"unexpected keys in {self.name} state: {sorted(unknown)}")
        self.memory.load_state_dict(state.get("memory", {}))


def numel(shape: Shape) -> int:
    """Number of elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` in order: a view when they already lie
    back to back in memory (a whole DDP bucket usually does), else a copy."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    first = tensors[0]
    if all(t.is_contiguous() for t in tensors):
        size = first.element_size()
        expected = first.data_ptr()
        adjacent = True
        for t in tensors:
            if t.data_ptr() != expected or t.dtype != first.dtype:
                adjacent = False
                break
            expected += t.numel() * size
        if adjacent:
            total = sum(t.numel() for t in tensors)
            return first.as_strided((total,), (1,), first.storage_offset())
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors``, unless it is already a view of them."""
    if tensors and flat.data_ptr() == tensors[0].data_ptr():
        return  # flatten() returned a view: the result is already in place
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
