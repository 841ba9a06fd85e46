"""autotune: an adaptive communication auto-tuner for PyTorch data-parallel training.

The public API is what ``__all__`` lists. Names load on first use, so ``import autotune``
(and ``autotune --help``) stay cheap; the training path (compressors, policies, runtime)
never imports optuna or scikit-learn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autotune._version import __version__
from autotune.errors import (
    AutotuneError,
    ClusterError,
    CompressorError,
    PolicyError,
    ProfileError,
    RankFailure,
    WorkloadError,
)

if TYPE_CHECKING:
    from autotune import compressors, workloads
    from autotune.online import wrap
    from autotune.policies import Policy, load_policy
    from autotune.runtime import AutotuneDDP
    from autotune.workloads import Workload

# public name -> module that defines it
_LAZY = {
    "AutotuneDDP": "autotune.runtime",
    "wrap": "autotune.online",  # the runtime's wrap, with online revision when asked
    "Policy": "autotune.policies",
    "load_policy": "autotune.policies",
    "Workload": "autotune.workloads",
    "compressors": "autotune.compressors",
    "workloads": "autotune.workloads",
}

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
    "load_policy",
    "workloads",
    "wrap",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
