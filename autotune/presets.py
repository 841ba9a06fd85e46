"""The set-ups a user could have picked without autotune, in one table, and the bucket
sizes searched.

Each preset is a method PyTorch ships (plain DDP, its fp16/bf16 compression hooks, its
PowerSGD hook at rank 1 and 4) with the policy that applies the same method through
autotune's hook, the bucket caps it is predicted at, and how the report draws it.
Everything that compares against "the baselines" iterates this table: the tuner (which
predicts and enqueues them), verification (which measures both the stock set-up and our
equivalent beside the tuned candidates, and emits a policy only if no preset within
the error budget measured faster), the profile's calibration, the codec probe (which
measures their compressors whatever its budget), ``autotune simulate``, ``bench``,
``demo`` and the report.

Plain data only (and the policies' constant of DDP's default cap): importable from any
layer without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.policies.policy import DDP_DEFAULT_BUCKET_CAP_MB

__all__ = [
    "Preset",
    "PRESETS",
    "DEFAULT_PRESETS",
    "DDP_BUCKET_CAP_MB",
    "BUCKET_CAPS_MB",
    "preset",
]

DDP_BUCKET_CAP_MB = DDP_DEFAULT_BUCKET_CAP_MB  # DistributedDataParallel's default bucket_cap_mb
# The bucket caps (MB) the search tries: DDP's 25 and a spread around it.
BUCKET_CAPS_MB: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)


@dataclass(frozen=True)
class Preset:
    """A stock set-up and autotune's equivalent of it."""

    name: str  # short key: also the name of our equivalent in tuner baselines
    label: str  # what tables call it
    spec: dict[str, Any] = field(default_factory=lambda: {"compressor": "none"})  # our equivalent
    hook: str | None = None  # PyTorch's hook (autotune.measure.HOOKS); None: DDP's own allreduce
    rank: int = 1  # PowerSGD's matrix rank, for hook "powersgd"
    needs_nccl: bool = False  # PyTorch refuses to run the hook on another backend
    display: str = ""  # what figures and the report's tables call it ("": the name)
    color: str | None = None  # its colour in every figure (None: matplotlib's cycle)
    # the bucket caps (MB, from BUCKET_CAPS_MB) at which the tuner predicts our
    # equivalent; at any cap but DDP's default its name gets the cap (ddp5mb)
    caps: tuple[float, ...] = (DDP_BUCKET_CAP_MB,)

    @property
    def plain(self) -> bool:
        """Plain DDP: no compression."""
        return self.hook is None

    @property
    def runs_as_ours(self) -> bool:
        """PyTorch runs the method the way our hook does: DDP's own allreduce, or the
        fp16/bf16 hooks' encode, async allreduce, decode (the hook's direct path), so
        the stock set-up costs what our equivalent costs. Its PowerSGD hook does not
        (one bucket on gloo, full-size tensors each step)."""
        return self.hook in (None, "fp16", "bf16")

    def policy(self, bucket_cap_mb: float | None = DDP_BUCKET_CAP_MB) -> dict[str, Any]:
        """Our equivalent, as policy JSON (``bucket_cap_mb`` None: the key left out,
        which means DDP's default too)."""
        cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        return {"version": 1, **cap, "default": dict(self.spec)}

    def variants(self) -> list[tuple[str, float]]:
        """(name, bucket cap) of our equivalent at each of :attr:`caps`."""
        return [(self.variant_name(cap), cap) for cap in self.caps]

    def variant_name(self, bucket_cap_mb: float) -> str:
        """What our equivalent at ``bucket_cap_mb`` is called (``fp16``, ``ddp5mb``)."""
        if bucket_cap_mb == DDP_BUCKET_CAP_MB:
            return self.name
        return f"{self.name}{bucket_cap_mb:g}mb"

    def setup(self, name: str | None = None) -> dict[str, Any]:
        """The stock set-up for :mod:`autotune.measure`, called ``name`` (default
        ``stock:<preset>``), whatever the backend."""
        name = f"stock:{self.name}" if name is None else name
        if self.hook is None:
            return {"name": name, "kind": "ddp"}
        return {"name": name, "kind": "hook", "hook": self.hook, "rank": self.rank}

    def stock_setup(self, backend: str = "gloo") -> dict[str, Any] | None:
        """The stock set-up for :mod:`autotune.measure` (None where it cannot run)."""
        if self.needs_nccl and backend != "nccl":
            return None
        return self.setup()


# PowerSGD's equivalents at DDP's cap and at the largest: each bucket costs two small
# allreduces (P and Q) whose latency adds up on a slow link, and the stock hook runs
# with one bucket on gloo (the largest cap is one bucket for models up to its size),
# measured 20% faster than 25 MB buckets on a 100 Mbit link for the cnn workload
_POWERSGD_CAPS = (DDP_BUCKET_CAP_MB, BUCKET_CAPS_MB[-1])

PRESETS: tuple[Preset, ...] = (
    Preset("ddp", "plain DDP", display="plain DDP", color="#4c72b0",
           caps=(1.0, 5.0, DDP_BUCKET_CAP_MB, 100.0)),
    Preset("fp16", "PyTorch fp16_compress_hook", {"compressor": "fp16"}, "fp16",
           display="fp16", color="#dd8452"),
    Preset("bf16", "PyTorch bf16_compress_hook", {"compressor": "bf16"}, "bf16", needs_nccl=True,
           display="bf16"),
    Preset("powersgd1", "PyTorch powerSGD_hook, rank 1", {"compressor": "powersgd", "rank": 1},
           "powersgd", 1, display="PowerSGD rank 1", color="#55a868", caps=_POWERSGD_CAPS),
    Preset("powersgd4", "PyTorch powerSGD_hook, rank 4", {"compressor": "powersgd", "rank": 4},
           "powersgd", 4, display="PowerSGD rank 4", color="#8172b3", caps=_POWERSGD_CAPS),
)
# The presets PyTorch runs on any backend (its bf16 hook needs NCCL): what a profile
# calibrates on, `autotune simulate`, `bench` and the report show by default, the tuner
# enqueues first and the codec probe always measures.
DEFAULT_PRESETS: tuple[Preset, ...] = tuple(p for p in PRESETS if not p.needs_nccl)


def preset(name: str) -> Preset:
    """The preset called ``name``."""
    for p in PRESETS:
        if p.name == name:
            return p
    raise KeyError(f"unknown preset {name!r}; presets: {', '.join(p.name for p in PRESETS)}")
