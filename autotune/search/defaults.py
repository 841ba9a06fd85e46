"""The search's defaults, importable without optuna, scikit-learn or torch: ``autotune
tune --help`` prints them."""

from __future__ import annotations

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_CANDIDATES", "DEFAULT_EXACT_MARGIN", "DEFAULT_MAX_ERROR",
           "PRUNE_PREDICTED", "STARVED_LAYER_ERROR", "candidate_pool"]

# The default compression-error budget; bench/convergence.py is its justification (3
# paired seeds each, accuracy against plain DDP's): on digits (12 epochs at 100 Mbit) the
# budget's policy, PowerSGD rank 4 at 0.37, loses 1.0 point (worst seed 1.8), PowerSGD
# rank 1 at 0.70 (PyTorch's hook with error feedback as users run it, or ours) 1.9-2.8;
# on the cnn (100 steps) the policies verification emitted at 1 Gbit, 300 and 100 Mbit
# (sign, sign + bf16, sign + top-k; 0.31-0.49) lose 0.3-1.2, rank 4 (0.69) 2.1, rank 1
# (0.95) 42; on the transformer (300 steps) the emitted policies (sign + fp16, 0.23), the
# budget's policy for 100 Mbit (0.35) and rank 4 (0.74) lose nothing, rank 1 (0.94) 12.
# Conservative on the transformer, about right on the cnn and digits.
DEFAULT_MAX_ERROR = 0.6
# A layer whose own error is above this is starved (it receives almost none of its
# gradient): a policy with one is scored at that layer's error, not the weighted one.
# bench/convergence.py --workload transformer: the block matrices at 0.94-0.98 (top-k
# 0.1%) left the model unable to learn (accuracy 0.45 vs 1.00); PowerSGD rank 4, no layer
# above 0.80, lost nothing there (its layers reach 0.84 on the cnn). Between the two.
STARVED_LAYER_ERROR = 0.85
DEFAULT_CANDIDATES = 4  # tuned candidates verification measures (besides the presets)
DEFAULT_BUDGET_S = 60.0  # measurement time after which the best median so far wins
# An exact set-up (error 0: plain DDP, rowsparse, a lossless mix) measured within this
# fraction of a faster lossy winner is emitted instead. Off by default: the promise is
# never to emit a policy measured slower than a baseline within the error budget, and
# ties within noise already go to the simpler. A user who would rather give up a few
# percent of step time than add gradient error sets it (e.g. 0.05: at 300 Mbit on dlrm
# top-k on one table bought 3%, bench/embeddings.py), or lowers the error budget.
DEFAULT_EXACT_MARGIN = 0.0
# Verification does not measure a bucket-size variant of a preset (e.g. DDP at 1 MB)
# that the model predicts this many times the fastest prediction: the model's worst
# ratio error seen in verification is 36%, and at 100 Mbit DDP at 1, 5 and 100 MB
# (predicted 16x PowerSGD's step) cost 10 s of first steps before they were dropped.
# The presets themselves are always measured.
PRUNE_PREDICTED = 3.0


def candidate_pool(k: int) -> int:
    """Distinct trials ``tune`` keeps (``top_k``) for verification to pick ``k``
    candidates from, spread over their Pareto front."""
    return max(1, 4 * k)
