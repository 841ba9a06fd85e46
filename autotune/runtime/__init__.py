"""The runtime: one DDP communication hook applying a policy, behind ``wrap``."""

from __future__ import annotations

from autotune.runtime.hook import AutotuneState, BucketRecord, dispatch_hook
from autotune.runtime.wrapper import AutotuneDDP, wrap

__all__ = ["AutotuneDDP", "AutotuneState", "BucketRecord", "dispatch_hook", "wrap"]
