"""The set-ups a user could have picked without autotune, in one table.

Each preset is a method PyTorch ships (plain DDP, its fp16/bf16 compression hooks, its
PowerSGD hook at rank 1 and 4) with the policy that applies the same method through
autotune's hook. Verification measures both beside the tuned candidates, and a policy
is only emitted if no preset within the error budget measured faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Preset", "PRESETS", "preset"]


@dataclass(frozen=True)
class Preset:
    """A stock set-up and autotune's equivalent of it."""

    name: str  # short key: also the name of our equivalent in tuner baselines
    label: str  # what tables call it
    spec: dict[str, Any] = field(default_factory=lambda: {"compressor": "none"})  # our equivalent
    hook: str | None = None  # PyTorch's hook (autotune.measure.HOOKS); None: DDP's own allreduce
    rank: int = 1  # PowerSGD's matrix rank, for hook "powersgd"
    needs_nccl: bool = False  # PyTorch refuses to run the hook on another backend

    def policy(self, bucket_cap_mb: float = 25.0) -> dict[str, Any]:
        """Our equivalent, as policy JSON."""
        return {"version": 1, "bucket_cap_mb": bucket_cap_mb, "default": dict(self.spec)}

    def stock_setup(self, backend: str = "gloo") -> dict[str, Any] | None:
        """The stock set-up for :mod:`autotune.measure` (None where it cannot run)."""
        if self.needs_nccl and backend != "nccl":
            return None
        if self.hook is None:
            return {"name": f"stock:{self.name}", "kind": "ddp"}
        return {"name": f"stock:{self.name}", "kind": "hook", "hook": self.hook, "rank": self.rank}


PRESETS: tuple[Preset, ...] = (
    Preset("ddp", "plain DDP"),
    Preset("fp16", "PyTorch fp16_compress_hook", {"compressor": "fp16"}, "fp16"),
    Preset("bf16", "PyTorch bf16_compress_hook", {"compressor": "bf16"}, "bf16", needs_nccl=True),
    Preset("powersgd1", "PyTorch powerSGD_hook, rank 1", {"compressor": "powersgd", "rank": 1},
           "powersgd", 1),
    Preset("powersgd4", "PyTorch powerSGD_hook, rank 4", {"compressor": "powersgd", "rank": 4},
           "powersgd", 4),
)


def preset(name: str) -> Preset:
    """The preset called ``name``."""
    for p in PRESETS:
        if p.name == name:
            return p
    raise KeyError(f"unknown preset {name!r}; presets: {', '.join(p.name for p in PRESETS)}")
