"""Links as tc writes them: parsing, the accepted forms named on a bad one, printing."""

from __future__ import annotations

import pytest

from autotune.errors import ClusterError
from autotune.links import Link, as_link, parse_link


@pytest.mark.parametrize(
    "text, rate, delay",
    [
        ("1gbit", 1e9, None),
        ("100mbit", 1e8, None),
        ("5gbit", 5e9, None),
        ("2.5gbit", 2.5e9, None),
        ("800kbit", 8e5, None),
        ("1200bit", 1200.0, None),
        ("500mbit:10ms", 5e8, 0.010),
        ("1Gbit:250us", 1e9, 250e-6),
        (" 1gbit : 1.5s ", 1e9, 1.5),
    ],
)
def test_parse_link(text: str, rate: float, delay: float | None) -> None:
    link = parse_link(text)
    assert link.rate_bps == pytest.approx(rate)
    assert link.delay_s == (None if delay is None else pytest.approx(delay))


@pytest.mark.parametrize(
    "text", ["", "fast", "100", "1gb", "1gbps", "-1gbit", "0mbit", "1gbit:10", "1gbit:10min",
             "1gbit:", "gbit", "1gbit:10ms:1ms"],
)
def test_parse_link_rejects_with_accepted_forms(text: str) -> None:
    with pytest.raises(ClusterError) as info:
        parse_link(text)
    assert repr(text) in str(info.value)
    if text != "0mbit":
        assert "kbit, mbit, gbit" in str(info.value)


def test_link_prints_as_parsed() -> None:
    assert str(parse_link("500mbit:10ms")) == "500mbit:10ms"
    assert str(parse_link("2.5gbit")) == "2.5gbit"
    with pytest.raises(ClusterError, match="rate must be > 0"):
        Link(rate_bps=0)


def test_as_link_takes_a_link_or_its_text() -> None:
    link = Link(rate_bps=1e9)
    assert as_link(link) is link
    assert as_link("1gbit") == link
    with pytest.raises(ClusterError, match="expected a Link or a string"):
        as_link(1e9)  # type: ignore[arg-type]
