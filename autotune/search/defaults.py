"""The search's defaults, importable without optuna, scikit-learn or torch: ``autotune
tune --help`` prints them."""

from __future__ import annotations

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_CANDIDATES", "DEFAULT_MAX_ERROR"]

# The default compression-error budget; bench/convergence.py is its justification:
# digits trained 12 epochs under policies of error <= 0.6 ends within a point of plain
# DDP on average over paired seeds; policies of error 0.6-0.73 (PowerSGD rank 1) lose
# 1.3-2.1 points.
DEFAULT_MAX_ERROR = 0.6
DEFAULT_CANDIDATES = 4  # tuned candidates verification measures (besides the presets)
DEFAULT_BUDGET_S = 60.0  # measurement time after which the best median so far wins
