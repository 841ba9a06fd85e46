"""Zhang et al. 2020's per-layer profiles and their cost model, re-implemented.

"Is Network the Bottleneck of Distributed Training?" (NetAI 2020) published per-layer
backward timings and gradient sizes of ResNet-50, ResNet-101 and VGG-16 on V100 GPUs
(``*.bk.log``), the time of a GPU vector addition by size (``cuda_vec_add.log``), and a
simple model of data-parallel training on a fully used network. This module reads those
files and re-implements that model from its description (not from the paper's code), so
that our own simulator can be checked against it and can answer the same what-if
questions at GPU-cluster scale.

The model, as :func:`paper_model` computes it:

1. Walking the layers in gradient-ready order, gradients are grouped into *flushes*. A
   layer is first added to the pending group; *then* the group is flushed, at that
   layer's ready time, if the backward time since the last flush (the sum of the group's
   waits) is ``>= flush_ms`` or its bytes are ``>= flush_bytes``. So the layer that crosses
   a threshold travels in the flush it completes. Whatever is pending when the backward
   pass ends is flushed then.
2. A flush of ``S`` bytes is a ring allreduce over ``N`` workers on a ``B`` bit/s link:
   reduce-scatter ``S*8*(N-1)/N / B / c + (N-1) * vec_add(S/N)``, then all-gather
   ``S*8*(N-1)/N / B / c``. The compression ratio ``c`` divides network time only;
   encode/decode time is ignored, as in the paper.
3. Flushes run one after another on one channel: each starts when it is ready and the
   previous one has finished.
4. Exposed communication is the time from the end of the backward pass to the end of the
   last flush; the scaling factor is ``T / (T + exposed)`` with ``T`` the single-GPU
   iteration time.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterable, NoReturn, overload

import numpy as np

from autotune.errors import ProfileError

__all__ = [
    "ITERATION_S",
    "Layer",
    "VecAddModel",
    "Zhang2020Profile",
    "default_vec_add",
    "paper_grid",
    "paper_model",
    "read_vec_add",
    "read_zhang2020",
]

logger = logging.getLogger(__name__)

# Single-GPU iteration time at batch 32 (seconds), from the same source as the logs: the
# ``T`` of the scaling factor. The logs themselves hold only the backward pass.
ITERATION_S: dict[str, float] = {
    "resnet50": 0.12808580219559176,
    "resnet101": 0.19200599479476405,
    "vgg16": 0.19452352295080985,
}

VEC_ADD_FILE = "cuda_vec_add.log"
_PROFILE_SUFFIX = ".bk.log"


# --------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class Layer:
    """One gradient of the backward pass, in the order gradients become ready."""

    wait_s: float  # backward compute between the previous gradient being ready and this one
    grad_bytes: int  # fp32 gradient size


@dataclass(frozen=True)
class Zhang2020Profile:
    """A per-layer backward profile from Zhang et al. 2020 (see :func:`read_zhang2020`)."""

    name: str  # model name, from the file name: "resnet50"
    layers: tuple[Layer, ...]  # in gradient-ready order
    iteration_s: float  # single-GPU iteration time (forward + backward + update), the T
    source: str = field(default="", compare=False)  # file it was read from ("" if built)

    @property
    def backward_s(self) -> float:
        """Length of the backward pass: the sum of the layers' waits."""
        return math.fsum(layer.wait_s for layer in self.layers)

    @property
    def ready_s(self) -> tuple[float, ...]:
        """Time, from the start of the backward pass, at which each gradient is ready."""
        return tuple(accumulate(layer.wait_s for layer in self.layers))

    @property
    def total_bytes(self) -> int:
        """Bytes of all gradients together."""
        return sum(layer.grad_bytes for layer in self.layers)


def _fail(path: str | os.PathLike[str], line: int | None, message: str) -> NoReturn:
    where = f"{os.fspath(path)}:{line}" if line is not None else os.fspath(path)
    raise ProfileError(f"{where}: {message}")


def _model_name(path: Path) -> str:
    name = path.name
    if name.endswith(_PROFILE_SUFFIX):
        return name[: -len(_PROFILE_SUFFIX)]
    return name.split(".", 1)[0]


def _parse_count(path: Path, lineno: int, text: str, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        _fail(path, lineno, f"expected {what} as a positive integer, got {text.strip()!r}")
    if value < 1:
        _fail(path, lineno, f"expected {what} as a positive integer, got {value}")
    return value


def _parse_layer(path: Path, lineno: int, text: str) -> Layer:
    fields = [f.strip() for f in text.split(",")]
    if len(fields) != 2:
        _fail(path, lineno, f"expected 'wait_us,grad_bytes', got {text.strip()!r}")
    try:
        wait_us = float(fields[0])
        grad_bytes = int(fields[1])
    except ValueError:
        _fail(path, lineno, f"expected 'wait_us,grad_bytes' as numbers, got {text.strip()!r}")
    if not math.isfinite(wait_us) or wait_us < 0:
        _fail(path, lineno, f"wait_us must be a finite number >= 0, got {fields[0]!r}")
    if grad_bytes < 0:
        _fail(path, lineno, f"grad_bytes must be >= 0, got {fields[1]!r}")
    return Layer(wait_s=wait_us * 1e-6, grad_bytes=grad_bytes)


def read_zhang2020(
    path: str | os.PathLike[str], iteration_s: float | None = None
) -> Zhang2020Profile:
    """Read a ``*.bk.log`` per-layer backward profile.

    The format: line 1 a comment; line 2 the number of batches recorded (only ``1``,
    meaning the values are already averaged, is documented and accepted); line 3 the
    number of layers ``L``; then ``L`` lines ``wait_us,grad_bytes`` in gradient-ready
    order. Blank lines after the last layer are ignored.

    Args:
        path: the log file. Its name gives the model name (``resnet50.bk.log`` ->
            ``"resnet50"``).
        iteration_s: single-GPU iteration time in seconds. Defaults to the published
            figure for the model (:data:`ITERATION_S`); required for any other model.

    Returns:
        The profile.

    Raises:
        ProfileError: the file cannot be read or is malformed (the message names the file
            and line), or the model is unknown and ``iteration_s`` was not given.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        _fail(path, None, f"cannot read the profile: {exc}")

    name = _model_name(path)
    if iteration_s is None:
        if name not in ITERATION_S:
            _fail(
                path,
                None,
                f"no published iteration time for model {name!r} (known: "
                f"{', '.join(sorted(ITERATION_S))}); pass iteration_s=",
            )
        iteration_s = ITERATION_S[name]
    finite = isinstance(iteration_s, numbers.Real) and math.isfinite(iteration_s)
    if not finite or iteration_s <= 0:
        _fail(path, None, f"iteration_s must be a finite number > 0, got {iteration_s!r}")

    if len(lines) < 3:
        _fail(
            path,
            len(lines) + 1,
            "expected a comment, the batch count and the layer count "
            f"on lines 1-3, but the file ends after {len(lines)} line(s)",
        )
    batches = _parse_count(path, 2, lines[1], "the number of batches")
    if batches != 1:
        # Only averaged profiles are described; dividing by an undocumented count would
        # be a guess about what the file holds.
        _fail(path, 2, f"expected 1 batch (an averaged profile), got {batches}")
    count = _parse_count(path, 3, lines[2], "the number of layers")

    body = lines[3:]
    while body and not body[-1].strip():
        body.pop()
    if len(body) != count:
        line = 3 + min(len(body), count) + 1
        _fail(path, line, f"line 3 announces {count} layers, the file holds {len(body)}")
    layers = tuple(_parse_layer(path, 4 + i, text) for i, text in enumerate(body))
    return Zhang2020Profile(
        name=name, layers=layers, iteration_s=float(iteration_s), source=os.fspath(path)
    )


# --------------------------------------------------------------------------- vector add
@dataclass(frozen=True)
class VecAddModel:
    """Time of one element-wise vector addition on the GPU, by vector size in bytes.

    Piecewise-linear through the measured points, made monotone (a running maximum over
    sizes: the small-size measurements are noise around a ~10 us launch floor, and adding
    more bytes is never cheaper). Below the smallest point the time is that point's (the
    floor); beyond the largest it grows along the last segment's slope, or at the last
    point's seconds-per-byte if that slope is not positive. With no points the time is
    zero (no reduction cost).
    """

    nbytes: tuple[float, ...]  # sizes, strictly increasing
    seconds: tuple[float, ...]  # non-decreasing times at those sizes
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.nbytes) != len(self.seconds):
            raise ValueError(
                f"VecAddModel needs as many sizes as times, got {len(self.nbytes)} and "
                f"{len(self.seconds)}"
            )
        x = np.asarray(self.nbytes, dtype=float)
        y = np.asarray(self.seconds, dtype=float)
        if x.size and (np.any(np.diff(x) <= 0) or np.any(np.diff(y) < 0) or y[0] < 0):
            raise ValueError(
                "VecAddModel needs increasing sizes and non-decreasing times >= 0; "
                "build it with VecAddModel.from_points"
            )

    @classmethod
    def from_points(cls, points: Iterable[tuple[float, float]], source: str = "") -> VecAddModel:
        """Build from ``(bytes, seconds)`` samples in any order, possibly repeated."""
        pts = sorted((float(b), float(s)) for b, s in points)
        merged: dict[float, float] = {}
        for b, s in pts:
            merged[b] = max(s, merged.get(b, s))  # a repeated size keeps its slowest sample
        x = np.array(list(merged), dtype=float)
        y = np.maximum.accumulate(np.array(list(merged.values()), dtype=float)) if merged else x
        return cls(nbytes=tuple(x.tolist()), seconds=tuple(y.tolist()), source=source)

    @classmethod
    def zero(cls) -> VecAddModel:
        """A model with no reduction cost."""
        return cls(nbytes=(), seconds=())

    @property
    def _tail_slope(self) -> float:
        x, y = self.nbytes, self.seconds
        if len(x) >= 2 and y[-1] > y[-2]:
            return (y[-1] - y[-2]) / (x[-1] - x[-2])
        return y[-1] / x[-1] if x[-1] > 0 else 0.0

    @overload
    def time(self, nbytes: float) -> float: ...
    @overload
    def time(self, nbytes: np.ndarray) -> np.ndarray: ...

    def time(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """Seconds to add two vectors of ``nbytes`` bytes each (scalar or array)."""
        q = np.asarray(nbytes, dtype=float)
        if not self.nbytes:
            out = np.zeros_like(q)
        else:
            x = np.asarray(self.nbytes)
            y = np.asarray(self.seconds)
            out = np.interp(q, x, y)
            beyond = q > x[-1]
            out = np.where(beyond, y[-1] + self._tail_slope * (q - x[-1]), out)
            out = np.maximum(out, 0.0)
        return float(out) if out.ndim == 0 else out

    __call__ = time


def read_vec_add(path: str | os.PathLike[str]) -> VecAddModel:
    """Read ``cuda_vec_add.log`` (lines ``bytes,seconds``) into a :class:`VecAddModel`.

    Raises:
        ProfileError: the file cannot be read, holds no sample, or a line is malformed
            (the message names the file and line).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        _fail(path, None, f"cannot read the vector-add timings: {exc}")
    points: list[tuple[float, float]] = []
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        fields = [f.strip() for f in text.split(",")]
        try:
            if len(fields) != 2:
                raise ValueError
            nbytes, seconds = float(fields[0]), float(fields[1])
        except ValueError:
            _fail(path, lineno, f"expected 'bytes,seconds', got {text.strip()!r}")
        if not (math.isfinite(nbytes) and nbytes > 0):
            _fail(path, lineno, f"bytes must be a finite number > 0, got {fields[0]!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            _fail(path, lineno, f"seconds must be a finite number >= 0, got {fields[1]!r}")
        points.append((nbytes, seconds))
    if not points:
        _fail(path, None, "no 'bytes,seconds' sample in the file")
    return VecAddModel.from_points(points, source=os.fspath(path))


def default_vec_add(profile: Zhang2020Profile | str | os.PathLike[str]) -> VecAddModel:
    """The reduction cost that goes with a profile: ``cuda_vec_add.log`` beside its file.

    Looks for ``cuda_vec_add.log`` in the folder of the profile's file (the layout the
    paper ships). If there is none, or the profile was not read from a file, the reduction
    is taken to cost nothing and a warning is logged: the result then underestimates
    communication by ``(N-1) * vec_add(S/N)`` per flush.

    Args:
        profile: a profile read by :func:`read_zhang2020`, or the path of its file.

    Raises:
        ProfileError: the file exists but is malformed.
    """
    source = profile.source if isinstance(profile, Zhang2020Profile) else os.fspath(profile)
    candidate = Path(source).parent / VEC_ADD_FILE if source else None
    if candidate is not None and candidate.is_file():
        return read_vec_add(candidate)
    logger.warning(
        "no %s next to profile %r: reduction cost taken as zero", VEC_ADD_FILE, source or "(built)"
    )
    return VecAddModel.zero()


# --------------------------------------------------------------------------- the model
def _check_positive(name: str, value: float, minimum: float = 0.0, strict: bool = True) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        relation = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {relation} {minimum}, got {value!r}")
    return float(value)


def _flushes(
    profile: Zhang2020Profile, flush_s: float, flush_bytes: int
) -> list[tuple[float, int]]:
    """``(ready_s, bytes)`` of each flush, by the rule in the module docstring."""
    out: list[tuple[float, int]] = []
    now = pending_s = 0.0
    pending_bytes = 0
    for layer in profile.layers:
        now += layer.wait_s
        pending_s += layer.wait_s
        pending_bytes += layer.grad_bytes
        if pending_s >= flush_s or pending_bytes >= flush_bytes:
            if pending_bytes:  # nothing to send: only the clock moved
                out.append((now, pending_bytes))
            pending_s, pending_bytes = 0.0, 0
    if pending_bytes:
        out.append((now, pending_bytes))
    return out


def paper_model(
    profile: Zhang2020Profile,
    world_size: int,
    bandwidth_bps: float,
    compression: float = 1.0,
    vec_add: VecAddModel | None = None,
    flush_ms: float = 5.0,
    flush_bytes: int = 64 * 2**20,
) -> dict[str, Any]:
    """Step time and scaling factor of data-parallel training by the paper's model.

    See the module docstring for the model. It assumes the network is fully used: no
    latency term, no protocol overhead, and no encode/decode cost for compression.
    Under it the scaling factor never falls with more bandwidth or more compression, and
    never rises with more workers (N >= 2) as long as ``vec_add``'s time per byte does
    not grow with size, which holds for the shipped measurements.

    Args:
        profile: the per-layer backward profile.
        world_size: number of workers ``N`` (>= 1; one worker communicates nothing).
        bandwidth_bps: link bandwidth ``B`` in bits per second (e.g. ``10e9``).
        compression: ratio ``c`` dividing the bytes on the wire (> 0; 1 = none).
        vec_add: reduction cost; ``None`` uses :func:`default_vec_add` (the
            ``cuda_vec_add.log`` beside the profile's file, else zero with a warning).
        flush_ms: backward time after which pending gradients are flushed (>= 0). The
            paper uses 5 ms; smaller values overlap more but send more small messages.
        flush_bytes: pending gradient bytes that trigger a flush (>= 0); the paper uses
            64 MiB.

    Returns:
        ``step_s`` (``T + exposed``), ``exposed_comm_s``, ``scaling_factor``
        (``T / step_s``), ``iteration_s`` (``T``), ``backward_s``, ``comm_s`` (the sum of
        the flushes' durations) and ``flushes``: one dict per flush with ``bytes``,
        ``ready_s``, ``start_s``, ``end_s``, ``network_s`` and ``reduce_s``, times
        measured from the start of the backward pass.

    Raises:
        ValueError: an argument is out of range.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    bandwidth_bps = _check_positive("bandwidth_bps", bandwidth_bps)
    compression = _check_positive("compression", compression)
    flush_s = _check_positive("flush_ms", flush_ms, strict=False) * 1e-3
    if isinstance(flush_bytes, bool) or not isinstance(flush_bytes, int) or flush_bytes < 0:
        raise ValueError(f"flush_bytes must be an int >= 0, got {flush_bytes!r}")
    if vec_add is None:
        vec_add = default_vec_add(profile)

    n = world_size
    share = (n - 1) / n  # fraction of a flush each worker sends in each ring phase
    flushes: list[dict[str, Any]] = []
    channel_free = 0.0
    for ready, size in _flushes(profile, flush_s, flush_bytes):
        phase_s = size * 8 * share / bandwidth_bps / compression  # one ring phase on the wire
        network_s = 2 * phase_s  # reduce-scatter + all-gather
        reduce_s = (n - 1) * vec_add.time(size / n) if n > 1 else 0.0
        start = max(ready, channel_free)
        channel_free = start + network_s + reduce_s
        flushes.append(
            {
                "bytes": size,
                "ready_s": ready,
                "start_s": start,
                "end_s": channel_free,
                "network_s": network_s,
                "reduce_s": reduce_s,
            }
        )

    backward_s = profile.backward_s
    exposed = max(0.0, channel_free - backward_s) if flushes else 0.0
    t = profile.iteration_s
    return {
        "step_s": t + exposed,
        "exposed_comm_s": exposed,
        "scaling_factor": t / (t + exposed),
        "iteration_s": t,
        "backward_s": backward_s,
        "comm_s": math.fsum(f["end_s"] - f["start_s"] for f in flushes),
        "flushes": flushes,
    }


def paper_grid(
    profile: Zhang2020Profile,
    world_sizes: Iterable[int],
    bandwidths_bps: Iterable[float],
    compressions: Iterable[float] = (1.0,),
    vec_add: VecAddModel | None = None,
) -> list[dict[str, Any]]:
    """:func:`paper_model` over a grid, as flat rows (world size, then bandwidth, then c).

    Args:
        profile: the per-layer backward profile.
        world_sizes: numbers of workers.
        bandwidths_bps: link bandwidths in bits per second.
        compressions: compression ratios.
        vec_add: reduction cost; ``None`` resolves :func:`default_vec_add` once.

    Returns:
        One dict per point: ``name`` (``"paper"``), ``model`` (the profile's name),
        ``world_size``, ``bandwidth_bps``, ``compression``, ``step_s``,
        ``exposed_comm_s``, ``scaling_factor``.
    """
    if vec_add is None:
        vec_add = default_vec_add(profile)
    bandwidths = list(bandwidths_bps)
    ratios = list(compressions)
    rows: list[dict[str, Any]] = []
    for n in world_sizes:
        for b in bandwidths:
            for c in ratios:
                r = paper_model(profile, n, b, c, vec_add=vec_add)
                rows.append(
                    {
                        "name": "paper",
                        "model": profile.name,
                        "world_size": n,
                        "bandwidth_bps": b,
                        "compression": c,
                        "step_s": r["step_s"],
                        "exposed_comm_s": r["exposed_comm_s"],
                        "scaling_factor": r["scaling_factor"],
                    }
                )
    return rows
