"""Choosing by measurement: the fastest wins when it is faster beyond noise; a simpler
set-up that ties with it wins instead."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.trials import decide, ratio_interval, separated


def _times(median: float, n: int = 12, spread: float = 0.02, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(median * (1 + spread * rng.standard_normal(n)))


def test_a_clear_winner_is_separated_and_named_with_its_margin() -> None:
    times = {"ddp": _times(1.0, seed=1), "tuned": _times(0.5, seed=2)}
    d = decide(times, ["ddp", "tuned"])
    assert d.winner == d.fastest == "tuned"
    assert d.separated and separated(times)
    low, high = d.intervals["ddp"]
    assert 1.0 < low <= 2.0 <= high or 1.0 < low < high
    assert "beyond noise" in d.reason and "ddp" in d.reason


def test_a_tie_goes_to_the_simpler_set_up() -> None:
    times = {"ddp": _times(1.0, seed=1), "fp16": _times(0.60, seed=2), "tuned": _times(0.595, seed=3)}
    d = decide(times, ["ddp", "fp16", "tuned"])
    assert d.fastest == "tuned" and d.winner == "fp16"
    assert not d.separated and not separated(times)
    assert "simpler wins" in d.reason


def test_a_tie_with_a_less_simple_set_up_keeps_the_fastest() -> None:
    times = {"ddp": _times(1.0, seed=1), "fp16": _times(0.595, seed=2), "tuned": _times(0.60, seed=3)}
    d = decide(times, ["ddp", "fp16", "tuned"])
    assert d.winner == d.fastest == "fp16"
    assert not d.separated


def test_equal_medians_go_to_the_simpler() -> None:
    times = {"ddp": [1.0, 1.0, 1.0], "none": [1.0, 1.0, 1.0]}
    assert decide(times, ["ddp", "none"]).winner == "ddp"


def test_interval_brackets_the_ratio_of_medians() -> None:
    a, b = _times(1.2, seed=4), _times(1.0, seed=5)
    low, high = ratio_interval(a, b)
    assert low < float(np.median(a) / np.median(b)) < high


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="order must name every set-up"):
        decide({"a": [1.0], "b": [2.0]}, ["a"])
    with pytest.raises(ValueError):
        ratio_interval([], [1.0])
    assert not separated({"a": [1.0]})
