"""autotune: an adaptive communication auto-tuner for PyTorch data-parallel training.

The public API is what ``__all__`` lists. Importing ``autotune`` loads only the training
path (compressors, policies, runtime); the probes, cost models and search load when
first used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from autotune import compressors
from autotune.errors import (
    AutotuneError,
    ClusterError,
    CompressorError,
    PolicyError,
    ProfileError,
    RankFailure,
    WorkloadError,
)
from autotune.launch import launch
from autotune.policies import Policy, load_policy
from autotune.runtime import AutotuneDDP, wrap
from autotune.workloads import Workload

try:
    __version__ = version("ddp-autotune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AutotuneDDP",
    "AutotuneError",
    "ClusterError",
    "CompressorError",
    "Policy",
    "PolicyError",
    "ProfileError",
    "RankFailure",
    "Workload",
    "WorkloadError",
    "__version__",
    "compressors",
    "launch",
    "load_policy",
    "wrap",
]
