"""Learned components of the cost model, as scikit-learn estimators.

* :class:`CollectiveTimeRegressor`: seconds of one collective from (payload bytes, world
  size). An alpha-beta model with the ring algorithm's terms (``t = alpha * hops(W) +
  beta * bytes_on_link(S, W)``, both coefficients non-negative: monotone in bytes,
  linear beyond the data), plus, at the world size it was measured at, a monotone
  (isotonic) interpolation of the measured medians in log-log space, which captures what
  a line misses between small and large messages (TCP windows, tbf's burst).
* :class:`CodecTimeRegressor`: encode+decode seconds of one compressor for a tensor, from
  shape features and the compressor's parameter (rank, ratio, block); non-negative
  coefficients on features that follow each method's arithmetic.
* :class:`ResidualRegressor`: a multiplicative correction of the simulated step time,
  learnt from measured (policy, step time) pairs: what the timeline misses, such as
  communication threads competing with compute for cores.

All follow scikit-learn's conventions (explicit ``__init__`` keywords, ``fit`` returns
self, learned attributes end in ``_``, ``predict`` checks fitting) and persist as plain
JSON parameters via ``to_json_dict`` / ``from_json_dict``, never pickle.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LinearRegression
from sklearn.utils.validation import check_is_fitted, validate_data

from autotune.compressors import REGISTRY

__all__ = [
    "COLLECTIVES",
    "CollectiveTimeRegressor",
    "CodecTimeRegressor",
    "ResidualRegressor",
    "collective_terms",
    "RESIDUAL_FEATURES",
]

COLLECTIVES = ("allreduce", "allgather", "broadcast", "p2p")


def collective_terms(collective: str, nbytes: np.ndarray, world: np.ndarray) -> np.ndarray:
    """(latency hops, bytes each rank moves over its link) of a ring collective.

    ``nbytes`` is the per-rank payload (what a compressor hands to the collective).
    """
    w = np.maximum(world, 1.0)
    if collective == "allreduce":  # reduce-scatter + all-gather rings
        return np.column_stack([2 * (w - 1), 2 * (w - 1) / w * nbytes])
    if collective == "allgather":  # every rank receives the W-1 other payloads
        return np.column_stack([w - 1, (w - 1) * nbytes])
    if collective == "broadcast":  # pipelined chain
        return np.column_stack([w - 1, nbytes + 0 * w])
    if collective == "p2p":
        return np.column_stack([np.ones_like(nbytes), nbytes])
    raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")


def _positive_fit(features: np.ndarray, y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Non-negative least squares on ``features`` (no intercept), weighted."""
    reg = LinearRegression(positive=True, fit_intercept=False)
    reg.fit(features, y, sample_weight=weight)
    return np.asarray(reg.coef_, dtype=float)


class CollectiveTimeRegressor(RegressorMixin, BaseEstimator):
    """Time of one collective from ``X = [[payload_bytes, world_size], ...]``.

    Args:
        collective: ``allreduce``, ``allgather``, ``broadcast`` or ``p2p``.
        relative: weight samples by 1/y, so the fit minimises relative error (small
            messages count as much as large ones).
        interpolate: at the measured world size and inside the measured byte range,
            interpolate the measured medians monotonically instead of using the line.
    """

    def __init__(self, collective: str = "allreduce", relative: bool = True,
                 interpolate: bool = True) -> None:
        self.collective = collective
        self.relative = relative
        self.interpolate = interpolate

    def fit(self, X: Any, y: Any) -> CollectiveTimeRegressor:
        X, y = validate_data(self, X, y, y_numeric=True)
        if X.shape[1] != 2:
            raise ValueError(f"X must have 2 columns (bytes, world_size), got {X.shape[1]}")
        nbytes, world = np.abs(X[:, 0]), np.maximum(np.abs(X[:, 1]), 1.0)
        y = np.abs(y)
        terms = collective_terms(self.collective, nbytes, world)
        weight = 1.0 / np.maximum(y, 1e-9) if self.relative else np.ones_like(y)
        self.alpha_, self.beta_ = (float(c) for c in _positive_fit(terms, y, weight))
        worlds = np.unique(world)
        self.world_ = float(worlds[np.argmax([np.sum(world == w) for w in worlds])])
        at = (world == self.world_) & (nbytes > 0) & (y > 0)
        self.knots_x_ = self.knots_y_ = np.zeros(0)
        if self.interpolate and len(np.unique(nbytes[at])) >= 2:
            sizes = np.unique(nbytes[at])
            medians = np.array([np.median(y[at][nbytes[at] == s]) for s in sizes])
            iso = IsotonicRegression(increasing=True).fit(np.log(sizes), np.log(medians))
            self.knots_x_ = np.log(sizes)
            self.knots_y_ = iso.predict(np.log(sizes))
        return self

    def _line(self, nbytes: np.ndarray, world: np.ndarray) -> np.ndarray:
        terms = collective_terms(self.collective, nbytes, world)
        return terms @ np.array([self.alpha_, self.beta_])

    def predict(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "beta_")
        X = validate_data(self, X, reset=False)
        nbytes, world = np.abs(X[:, 0]), np.maximum(np.abs(X[:, 1]), 1.0)
        out = self._line(nbytes, world)
        if len(self.knots_x_):
            logb = np.log(np.maximum(nbytes, 1.0))
            inside = (world == self.world_) & (logb >= self.knots_x_[0]) & (logb <= self.knots_x_[-1])
            out[inside] = np.exp(np.interp(logb[inside], self.knots_x_, self.knots_y_))
        return out

    def with_link(self, scale_beta: float = 1.0, alpha: float | None = None) -> CollectiveTimeRegressor:
        """A copy for a what-if link: ``beta`` times ``scale_beta`` (e.g. measured rate /
        new rate), optionally another per-hop latency. Interpolation is dropped: the
        measured curve belongs to the measured link."""
        check_is_fitted(self, "beta_")
        other = CollectiveTimeRegressor(self.collective, self.relative, interpolate=False)
        other.alpha_ = self.alpha_ if alpha is None else float(alpha)
        other.beta_ = self.beta_ * scale_beta
        other.world_ = self.world_
        other.knots_x_ = other.knots_y_ = np.zeros(0)
        other.n_features_in_ = 2
        return other

    def to_json_dict(self) -> dict[str, Any]:
        check_is_fitted(self, "beta_")
        return {"params": self.get_params(), "alpha_": self.alpha_, "beta_": self.beta_,
                "world_": self.world_, "knots_x_": self.knots_x_.tolist(),
                "knots_y_": self.knots_y_.tolist()}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> CollectiveTimeRegressor:
        est = cls(**data["params"])
        est.alpha_, est.beta_, est.world_ = float(data["alpha_"]), float(data["beta_"]), float(data["world_"])
        est.knots_x_ = np.asarray(data["knots_x_"], dtype=float)
        est.knots_y_ = np.asarray(data["knots_y_"], dtype=float)
        est.n_features_in_ = 2
        return est


def _codec_features(compressor: str, X: np.ndarray) -> np.ndarray:
    """Features proportional to the method's work, as its class declares them
    (:meth:`~autotune.compressors.Compressor.codec_features`): X = [numel, rows, cols,
    param]."""
    n, rows, cols, param = (np.abs(X[:, i]) for i in range(4))
    return np.column_stack(REGISTRY.get(compressor).codec_features(np, n, rows, cols, param))


class CodecTimeRegressor(RegressorMixin, BaseEstimator):
    """Encode+decode seconds of one compressor from ``X = [[numel, rows, cols, param]]``.

    ``param`` is the compressor's size knob (PowerSGD rank, top-k ratio, int8 block;
    for rowsparse the share of rows holding a non-zero value; 0 for methods without
    one); rows/cols are the matrix view (shape[0] x the rest).

    Args:
        compressor: the compressor's registered name (selects the features).
        relative: weight samples by 1/y (relative error).
    """

    def __init__(self, compressor: str = "none", relative: bool = True) -> None:
        self.compressor = compressor
        self.relative = relative

    def fit(self, X: Any, y: Any) -> CodecTimeRegressor:
        X, y = validate_data(self, X, y, y_numeric=True)
        if X.shape[1] != 4:
            raise ValueError(f"X must have 4 columns (numel, rows, cols, param), got {X.shape[1]}")
        y = np.abs(y)
        weight = 1.0 / np.maximum(y, 1e-9) if self.relative else np.ones_like(y)
        self.coef_ = _positive_fit(_codec_features(self.compressor, X), y, weight)
        return self

    def predict(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "coef_")
        X = validate_data(self, X, reset=False)
        return _codec_features(self.compressor, X) @ self.coef_

    def to_json_dict(self) -> dict[str, Any]:
        check_is_fitted(self, "coef_")
        return {"params": self.get_params(), "coef_": self.coef_.tolist()}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> CodecTimeRegressor:
        est = cls(**data["params"])
        est.coef_ = np.asarray(data["coef_"], dtype=float)
        est.n_features_in_ = 4
        return est


RESIDUAL_FEATURES = (
    "simulated_s",  # the timeline's step time (the baseline of the correction)
    "codec_s",  # encode+decode: in situ it shares a core with backward
    "comm_s",  # time on the communication channel
    "threaded_collectives",  # collectives issued from the communication thread
    "threaded_buckets",  # buckets handed to that thread
    "half_mb",  # MB reduced as 2-byte floats: gloo sums them on the CPU
    "intra_mb",  # MB through hierarchical intra-host stages: sums and copies on the CPU,
    # beside the other ranks of the host
)


class ResidualRegressor(RegressorMixin, BaseEstimator):
    """What the timeline misses, learnt from measured (policy, step time) pairs.

    ``measured = simulated + c0 + sum_j c_j * feature_j`` with every ``c >= 0``: a fixed
    per-step overhead, extra codec cost (a core shared with backward), per-collective
    and per-bucket costs of the communication thread (wake-ups and scheduling on busy
    cores), and CPU reductions of half-precision sums. Non-negative coefficients on
    physical features extrapolate sensibly from the few policies measured; a small
    ridge penalty keeps them modest. Samples are weighted by 1/measured (relative error).

    Args:
        alpha: ridge penalty on the coefficients (features are scaled to unit spread).
    """

    def __init__(self, alpha: float = 1e-3) -> None:
        self.alpha = alpha

    def _features(self, X: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(X)), np.abs(X[:, 1:])])

    def fit(self, X: Any, y: Any) -> ResidualRegressor:
        from scipy.optimize import nnls

        X, y = validate_data(self, X, y, y_numeric=True)
        if X.shape[1] != len(RESIDUAL_FEATURES):
            raise ValueError(f"X must have {len(RESIDUAL_FEATURES)} columns {RESIDUAL_FEATURES}")
        F = self._features(X)
        self.scale_ = np.maximum(F.max(axis=0), 1e-12)
        w = 1.0 / np.maximum(np.abs(y), 1e-9)
        A = F / self.scale_ * w[:, None]
        b = (y - X[:, 0]) * w
        # ridge rows: sqrt(alpha) * I, pulling every scaled coefficient towards 0
        A = np.vstack([A, math.sqrt(self.alpha) * np.eye(F.shape[1])])
        b = np.concatenate([b, np.zeros(F.shape[1])])
        coef, _ = nnls(A, b)
        self.coef_ = coef / self.scale_
        return self

    def predict(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "coef_")
        X = validate_data(self, X, reset=False)
        return X[:, 0] + self._features(X) @ self.coef_

    def to_json_dict(self) -> dict[str, Any]:
        check_is_fitted(self, "coef_")
        return {"params": self.get_params(), "coef_": self.coef_.tolist(),
                "scale_": self.scale_.tolist()}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> ResidualRegressor:
        est = cls(**data["params"])
        est.coef_ = np.asarray(data["coef_"], dtype=float)
        est.scale_ = np.asarray(data["scale_"], dtype=float)
        est.n_features_in_ = len(RESIDUAL_FEATURES)
        return est


def relative_cv_error(estimator: BaseEstimator, X: np.ndarray, y: np.ndarray, folds: int = 5) -> float:
    """Cross-validated mean absolute percentage error (NaN with too few samples)."""
    from sklearn.base import clone
    from sklearn.model_selection import KFold

    n = len(y)
    if n < 4:
        return math.nan
    errors = []
    for train, test in KFold(n_splits=min(folds, n), shuffle=True, random_state=0).split(X):
        est = clone(estimator).fit(X[train], y[train])
        pred = est.predict(X[test])
        errors.extend(np.abs(pred - y[test]) / np.maximum(np.abs(y[test]), 1e-12))
    return float(np.mean(errors))
