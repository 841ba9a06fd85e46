"""Error feedback: what compression dropped this step is added back next step.

``compensate`` returns gradient + residual; after encoding, ``update`` stores
compensated - decoded(local). Memory is per parameter name, so it survives DDP's bucket
rebuild and a policy that moves a parameter between buckets.

On the training path, large tensors are better served by ``compensate_into``, which
works in the residual's own buffer: a fresh buffer of tens of MB costs more than the arithmetic
on it (the allocator returns it to the OS and every page faults again on the next step),
so the residual is kept in one buffer per parameter, rewritten in place each step.

A compressor may leave a residual's last step undone (:meth:`ErrorFeedback.defer`): sign
compression's residual is ``M - scale * sign(M)``, a pass over the whole tensor that its
next encoding can make in the same loop as it adds the next gradient in. Everything that
reads a residual here (compensating, releasing, checkpointing, ``residuals``) settles it
first, so only the compressor that deferred it, taking the step back with
:meth:`ErrorFeedback.take_deferred`, ever sees it unsettled.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from autotune.errors import CompressorError

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residual memory keyed by parameter name; switched off with ``enabled=False``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._residuals: dict[str, torch.Tensor] = {}
        # name -> what makes its stored tensor the residual, in place (see defer)
        self._deferred: dict[str, Callable[[torch.Tensor], None]] = {}
        # name -> a second buffer, written by compensate_aside (never state)
        self._spares: dict[str, torch.Tensor] = {}

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """The residuals by parameter name, every deferred step settled."""
        for name in list(self._deferred):
            self._settle(name)
        return self._residuals

    def store(self, name: str, residual: torch.Tensor) -> None:
        """Keep ``residual`` as ``name``'s (replacing any, and any step deferred on it)."""
        self._deferred.pop(name, None)
        self._residuals[name] = residual

    def defer(self, name: str, settle: Callable[[torch.Tensor], None]) -> None:
        """``name``'s stored tensor becomes its residual once ``settle(stored)`` has
        rewritten it in place; until then anything that reads it here settles it first."""
        self._deferred[name] = settle

    def take_deferred(self, name: str) -> Callable[[torch.Tensor], None] | None:
        """The step deferred on ``name``'s residual, now the caller's to make (None if
        none): its stored tensor stays unsettled."""
        return self._deferred.pop(name, None)

    def _settle(self, name: str) -> None:
        settle = self._deferred.pop(name, None)
        if settle is not None and name in self._residuals:
            settle(self._residuals[name])

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` + this name's residual, as a new fp32 tensor (grad is untouched)."""
        out = grad.detach().to(torch.float32, copy=True)
        if self.enabled:
            self._settle(name)
            residual = self._residuals.get(name)
            # compressors may store the residual flat or as a matrix: match by size
            if residual is not None and residual.numel() == out.numel():
                out += residual.to(out.device).view_as(out)
        return out

    def compensate_into(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` + this name's residual, written into the name's residual buffer (fp32,
        contiguous, shaped as ``grad``, reused from step to step) and returned; the
        caller then overwrites that buffer with the new residual. None when error
        feedback is off. The buffer being the name's own, the arithmetic on it does not
        depend on where ``grad`` lies in a bucket (BLAS kernels may round differently for
        differently aligned operands), so results stay bitwise reproducible when DDP
        lays its buckets out differently, e.g. right after a restart."""
        if not self.enabled:
            return None
        residual = self._matching(name, grad)
        if residual is not None:
            residual.add_(grad)
        else:
            residual = grad.detach().to(torch.float32, memory_format=torch.contiguous_format,
                                        copy=True)
        self._residuals[name] = residual
        return residual

    def _matching(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        """``name``'s residual (settled) as an fp32 tensor shaped as ``grad`` on its
        device, where one of its size is stored fp32 and contiguous; else None."""
        self._settle(name)
        residual = self._residuals.get(name)
        if residual is None or residual.numel() != grad.numel() \
                or residual.dtype != torch.float32 or not residual.is_contiguous():
            return None
        return residual.to(grad.device).view(grad.shape)

    def compensate_aside(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        """As :meth:`compensate_into`, but into a spare buffer of the name's, the residual
        left as it was: the compressor may encode before it knows whether it will
        compress this step at all (the runtime's guard, awaited late), and a step it
        does not take leaves no trace. :meth:`adopt` makes the spare the residual (and
        the old residual the next step's spare: no allocation after the first steps,
        at the cost of a second buffer per name). None when error feedback is off."""
        if not self.enabled:
            return None
        residual = self._matching(name, grad)
        spare = self._spares.get(name)
        if spare is None or spare.shape != grad.shape or spare.device != grad.device:
            spare = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
            self._spares[name] = spare
        if residual is not None:
            torch.add(residual, grad, out=spare)
        else:
            spare.copy_(grad.detach())
        return spare

    def adopt(self, name: str) -> None:
        """The spare :meth:`compensate_aside` wrote becomes ``name``'s residual buffer
        (the caller then rewrites it in place into the new residual)."""
        spare = self._spares.pop(name)
        old = self._residuals.get(name)
        self._residuals[name] = spare
        if old is not None and old.shape == spare.shape and old.dtype == spare.dtype \
                and old.device == spare.device and old.is_contiguous():
            self._spares[name] = old

    def flat_residual(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        """``name``'s residual as a flat, contiguous fp32 tensor on ``grad``'s device
        (stored back in that form, so that the caller can rewrite it in place), or None
        if it has none of ``grad``'s size."""
        self._settle(name)
        residual = self._residuals.get(name)
        if residual is None or residual.numel() != grad.numel():
            return None
        if residual.dtype != torch.float32 or residual.device != grad.device or not residual.is_contiguous():
            residual = residual.to(grad.device, torch.float32).contiguous()
        residual = residual.view(-1)
        self._residuals[name] = residual
        return residual

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remember what this rank's compression dropped."""
        if self.enabled:
            self.store(name, compensated - decoded)

    def pop(self, name: str) -> torch.Tensor | None:
        """Remove and return ``name``'s residual (None if it has none)."""
        self._settle(name)
        self._spares.pop(name, None)
        return self._residuals.pop(name, None)

    def clear(self) -> int:
        """Forget every residual; returns how many there were."""
        count = len(self._residuals)
        self._residuals = {}
        self._deferred = {}
        self._spares = {}
        return count

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CompressorError(f"error-feedback memory of {key!r} must be a tensor")
        self._residuals = {k: v.detach().clone() for k, v in state.items()}
        self._deferred = {}
        self._spares = {}
