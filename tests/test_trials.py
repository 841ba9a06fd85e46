"""Choosing by measurement: the fastest wins when it is faster beyond noise; a simpler
set-up that ties with it wins instead."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.trials import decide, method_key, ratio_interval, separated, separated_tau, simplicity_ranks


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


def test_one_method_at_two_bucket_sizes_is_equally_simple() -> None:
    small = {"default": "powersgd", "bucket_cap_mb": 25.0, "meta": {"label": "a"}}
    large = {**small, "bucket_cap_mb": 100.0, "meta": {}}
    fp16 = {"default": "fp16", "bucket_cap_mb": 25.0}
    assert method_key(small) == method_key(large) != method_key(fp16)
    order = ["ddp", "psgd25", "fp16", "psgd100"]
    keys = {"ddp": None, "psgd25": method_key(small), "fp16": method_key(fp16),
            "psgd100": method_key(large)}
    ranks = simplicity_ranks(order, keys)
    assert ranks == {"ddp": 0, "psgd25": 1, "fp16": 2, "psgd100": 1}
    # a tie between the two bucket sizes goes to the lower median, not the listed-first
    times = {"ddp": _times(1.0, seed=1), "psgd25": _times(0.60, seed=2),
             "fp16": _times(0.9, seed=4), "psgd100": _times(0.595, seed=3)}
    assert decide(times, order, simplicity=ranks).winner == "psgd100"
    assert decide(times, order).winner == "psgd25"


def test_of_equally_simple_set_ups_tied_with_a_faster_one_the_lower_median_wins() -> None:
    # plain DDP at two bucket sizes tie with a tuned policy a little faster: the simpler
    # method wins, and of its two bucket sizes the faster, not the one listed first
    order = ["ddp1mb", "ddp", "tuned"]
    ranks = {"ddp1mb": 0, "ddp": 0, "tuned": 2}
    times = {n: [m * f for f in (1.0, 1.05, 0.95) * 4]
             for n, m in (("ddp1mb", 1.0), ("ddp", 0.99), ("tuned", 0.985))}
    d = decide(times, order, simplicity=ranks)
    assert d.fastest == "tuned" and not d.separated
    assert d.winner == "ddp" and "ddp ties with the fastest, tuned" in d.reason


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


def test_tau_counts_only_the_pairs_the_measurement_tells_apart() -> None:
    # three DDP bucket sizes measured alike, fp16 and PowerSGD clearly apart
    alike = _times(3.3, seed=1)
    times = {"ddp": alike, "ddp1mb": alike[::-1], "ddp5mb": alike[1:] + alike[:1],
             "fp16": _times(1.7, seed=4), "psgd": _times(0.2, seed=5)}
    right = {"ddp": 3.2, "ddp1mb": 3.13, "ddp5mb": 3.14, "fp16": 1.7, "psgd": 0.3}
    tau, pairs = separated_tau(right, times)
    assert pairs == 7 and tau == 1.0  # the three alike pairs are not counted
    wrong = {**right, "fp16": 0.1}  # fp16 predicted faster than PowerSGD: 1 of 7 discordant
    assert separated_tau(wrong, times) == ((6 - 1) / 7, 7)
    assert separated_tau(right, {"ddp": times["ddp"], "ddp1mb": times["ddp1mb"]}) == (None, 0)
