"""Links: the rate and delay of one host's NIC, as tc writes them (``"1gbit"``,
``"500mbit:10ms"``).

The ground floor: profiles record the link they were taken on, the cost model and the
report read it back, and the emulated cluster shapes NICs to it; none of them needs the
others to parse one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from autotune.errors import ClusterError

__all__ = ["Link", "LinkLike", "as_link", "parse_link"]

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_LINK_RE = re.compile(
    r"^\s*(?P<rate>\d+(?:\.\d*)?|\.\d+)\s*(?P<runit>[a-z]+)"
    r"(?:\s*:\s*(?P<delay>\d+(?:\.\d*)?|\.\d+)\s*(?P<dunit>[a-z]+))?\s*$",
    re.IGNORECASE,
)
_LINK_FORMS = (
    "RATE[:DELAY] where RATE is a number with a unit of bit, kbit, mbit, gbit or tbit "
    "(e.g. '1gbit', '2.5gbit', '100mbit') and DELAY a number with a unit of us, ms or s "
    "(e.g. '500mbit:10ms')"
)


@dataclass(frozen=True)
class Link:
    """The shape of one host's NIC, applied in each direction."""

    rate_bps: float  # bits per second, each direction
    # One-way latency between two hosts with this link, in seconds; None for none.
    # Half of it is added on each side of the NIC, so host-to-host RTT is 2 x delay_s.
    delay_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rate_bps > 0:
            raise ClusterError(f"a link rate must be > 0 bit/s, got {self.rate_bps!r}")
        if self.delay_s is not None and not self.delay_s >= 0:
            raise ClusterError(f"a link delay must be >= 0 s, got {self.delay_s!r}")

    def __str__(self) -> str:
        text = _format_rate(self.rate_bps)
        if self.delay_s:
            text += f":{self.delay_s * 1e3:g}ms"
        return text


LinkLike = Union[Link, str]


def _format_rate(rate_bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:g}{unit}"
    return f"{rate_bps:g}bit"


def parse_link(text: str) -> Link:
    """Parse a tc-like link description.

    Args:
        text: ``RATE[:DELAY]``, e.g. ``"1gbit"``, ``"2.5gbit"``, ``"500mbit:10ms"``.
            Rates use tc's decimal units (``kbit`` = 1000 bit/s); a unit is required,
            since tc reads a bare number as bit/s, which is rarely what was meant.

    Returns:
        The parsed :class:`Link`.

    Raises:
        ClusterError: ``text`` is not of that form.
    """
    match = _LINK_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ClusterError(f"cannot parse link {text!r}: expected {_LINK_FORMS}")
    runit = match["runit"].lower()
    if runit not in _RATE_UNITS:
        raise ClusterError(
            f"cannot parse link {text!r}: unknown rate unit {match['runit']!r}; "
            f"expected {_LINK_FORMS}"
        )
    delay: float | None = None
    if match["delay"] is not None:
        dunit = match["dunit"].lower()
        if dunit not in _DELAY_UNITS:
            raise ClusterError(
                f"cannot parse link {text!r}: unknown delay unit {match['dunit']!r}; "
                f"expected {_LINK_FORMS}"
            )
        delay = float(match["delay"]) * _DELAY_UNITS[dunit]
    rate = float(match["rate"]) * _RATE_UNITS[runit]
    if rate <= 0:
        raise ClusterError(f"cannot parse link {text!r}: the rate must be > 0")
    return Link(rate_bps=rate, delay_s=delay)


def as_link(link: LinkLike) -> Link:
    """``link`` as a :class:`Link`, parsing a string with :func:`parse_link`."""
    if isinstance(link, Link):
        return link
    if isinstance(link, str):
        return parse_link(link)
    raise ClusterError(f"expected a Link or a string such as '1gbit', got {link!r}")
