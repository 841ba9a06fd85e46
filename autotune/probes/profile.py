"""The profile: everything the probes measured about one job on one cluster, as JSON.

``profile.json`` holds an environment fingerprint, the workload's parameters, and every
raw sample and fit of the network, compute and codec probes::

    {"version": 1,
     "env": {"torch": ..., "backend": "gloo", "device": "cpu", "world_size": 2, "hosts": 2, ...},
     "workload": {"name": "cnn", "parameters": ..., "tensors": ...},
     "network": {"fits": {"allreduce": {"latency_s": ..., "bandwidth_Bps": ...}, ...},
                 "samples": [...], ...},
     "compute": {"step_s": [...], "params": [{"name": ..., "ready_s": ...}, ...], ...},
     "codecs": {"shapes": [...], "errors": [...], ...}}

In code each section is a typed, frozen :class:`Section` (:class:`Env`,
:class:`Workload`, :class:`Network`, :class:`Compute`, :class:`Codecs`,
:class:`Calibration`), and so is each record inside one, an :class:`Entry` (a
parameter's timing, a network sample or fit, a codec cell, a calibration run):
consumers read attributes, JSON stays at the file edge. A profile can be taken on one
machine and tuned on another. Like a policy it is validated at construction (messages
name the field) and saved atomically.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import reprlib
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, NoReturn, TypeVar

from autotune.compressors.registry import CompressorSpec
from autotune.errors import AutotuneError, ProfileError
from autotune.jsonio import dumps, freeze, json_type, read_json, thaw, write_atomic
from autotune.links import parse_link
from autotune.policies import Policy
from autotune.presets import PRESETS

__all__ = ["PROFILE_VERSION", "ROW_SPARSE_BELOW", "Calibration", "CalibrationRun", "CodecCost",
           "CodecError", "Codecs", "Compute", "DensityTiming", "Entry", "Env", "ModuleTiming",
           "Network", "NetworkFit", "NetworkSample", "Profile", "ProfiledParam", "RowSample",
           "RowStructure", "Section", "Workload", "load_profile"]

PROFILE_VERSION = 1
PRESET_NAMES = frozenset(p.name for p in PRESETS)  # what a stock calibration run may name
# A parameter whose busiest rank leaves more than half of its gradient's rows zero is
# row-sparse: the search gives it rowsparse as an option, `autotune show` lists it. The
# codec probe measures it (codecs.structure); it lives here, with the profile, so that
# showing a profile needs no torch.
ROW_SPARSE_BELOW = 0.5
_META = ("extra", "origin")  # a section's fields that are not JSON keys of their own
_ENTRY_META = ("extra", "_keys")  # and a record's
_E = TypeVar("_E", bound="Entry")
# field name -> how the field's validated JSON becomes the records it holds (a field not
# named holds read-only JSON)
_Builders = Mapping[str, Callable[[Any], Any]]


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One record inside a section (a parameter's timing, a network fit, a codec cell):
    typed attributes for what autotune reads; the record's other (descriptive) keys are
    kept, read-only, in ``extra``.

    Its section validates the record and builds it (:meth:`from_dict`), so that messages
    name its place (``compute.params[3].shape``); ``to_dict`` writes back what
    ``from_dict`` read, key for key and in the same order. A record built in code is
    validated when its section is built (which builds it again from its JSON).
    """

    ENTRIES: ClassVar[_Builders] = {}  # fields that hold records of their own
    ALWAYS: ClassVar[frozenset[str]] = frozenset()  # written even when None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # the keys as read, in order: to_dict writes back the same keys, nulls included, in
    # the file's order (a record built in code: the fields set and ALWAYS, then extra)
    _keys: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", freeze(self.extra))

    @classmethod
    def from_dict(cls: type[_E], data: Mapping[str, Any]) -> _E:
        """The record from JSON its section has validated."""
        names = _entry_fields(cls)
        return cls(**{k: _typed(cls.ENTRIES, k, v) for k, v in data.items() if k in names},
                   extra={k: v for k, v in data.items() if k not in names}, _keys=tuple(data))

    def to_dict(self) -> dict[str, Any]:
        keys = self._keys or (*(name for name in _entry_fields(type(self))
                                if getattr(self, name) is not None or name in self.ALWAYS),
                              *self.extra)
        return {k: thaw(self.extra[k]) if k in self.extra else _to_json(getattr(self, k))
                for k in keys}


@dataclass(frozen=True, kw_only=True)
class ProfiledParam(Entry):
    """A parameter in ``compute.params`` (``extra``: numel, ready_order)."""

    name: str
    shape: tuple[int, ...]
    ready_s: float | None = None  # its gradient ready in backward (None: it never got one)
    dtype: str | None = None  # "float32", ...; None (profiles before dtypes): float32


@dataclass(frozen=True, kw_only=True)
class ModuleTiming(Entry):
    """A leaf module in ``compute.modules``: its forward and backward seconds, if timed."""

    name: str
    forward_s: float | None = None
    backward_s: float | None = None
    type: str | None = None  # its class, e.g. "Conv2d"


@dataclass(frozen=True, kw_only=True)
class NetworkSample(Entry):
    """One message size of one collective in ``network.samples`` (``extra``: median_s,
    the algorithm and bus bandwidths, the rank pair of a p2p sample)."""

    collective: str
    bytes: int
    times_s: tuple[float, ...]
    link_class: str | None = None  # p2p: "intra" or "inter" host


@dataclass(frozen=True, kw_only=True)
class NetworkFit(Entry):
    """``t = latency_s + bytes / bandwidth_Bps`` of a collective (or of p2p on a link
    class) in ``network.fits`` (``extra``: algbw_Bps, large_intercept_s, sizes)."""

    latency_s: float
    bandwidth_Bps: float  # per-rank payload bytes per second
    busbw_Bps: float | None = None  # what the link carried (nccl-tests' bus bandwidth)
    fit_bytes: tuple[int, ...] | None = None  # the message sizes the bandwidth was fitted on


@dataclass(frozen=True, kw_only=True)
class DensityTiming(Entry):
    """A codec cell timed again with more of its tensor's rows filled (``denser``)."""

    row_density: float
    encode_decode_s: float


@dataclass(frozen=True, kw_only=True)
class RowSample(Entry):
    """The rows a codec cell was measured on (its ``sample``; ``extra``: live_rows,
    of_live_rows)."""

    rows: int
    numel: int
    of_rows: int | None = None  # the tensor's rows (error cells)
    param: str | None = None  # the parameter whose rows were timed (time cells)
    encode_decode_s: float | None = None  # the sample's own time, before scaling (time cells)
    # the sample's share of the gradient's energy over its share of rows (row samples of
    # error cells): near 1 when the sample is as heavy as the tensor
    energy_ratio: float | None = None


@dataclass(frozen=True, kw_only=True)
class CodecCost(Entry):
    """A compressor's time and wire size on one tensor shape, in ``codecs.shapes``
    (``extra``: label, numel, wire_messages, reps)."""

    ENTRIES: ClassVar[_Builders] = {"denser": DensityTiming.from_dict,
                                    "sample": RowSample.from_dict}
    spec: Mapping[str, Any]  # the compressor spec's JSON
    shape: tuple[int, ...]
    encode_decode_s: float
    wire_bytes: float
    row_density: float | None = None  # data-dependent compressors: of the tensor timed
    denser: DensityTiming | None = None  # and of a copy with more rows filled
    measured: str | None = None  # "full" or "sample" (None, profiles before sampling: full)
    sample: RowSample | None = None  # measured "sample": the rows timed


@dataclass(frozen=True, kw_only=True)
class CodecError(Entry):
    """A compressor's relative error on one parameter's gradients, in ``codecs.errors``
    (``extra``: label, the errors of each step)."""

    ENTRIES: ClassVar[_Builders] = {"sample": RowSample.from_dict}
    spec: Mapping[str, Any]  # the compressor spec's JSON
    param: str
    rel_error: float  # per step
    cum_error: float | None = None  # of the sums over the captured steps
    measured: str | None = None  # "full", "live_rows" or "sample" (None: full)
    sample: RowSample | None = None  # measured on rows: which


@dataclass(frozen=True, kw_only=True)
class RowStructure(Entry):
    """A parameter's gradient rows holding a non-zero value (fractions), in
    ``codecs.structure``."""

    row_density_max: float  # the busiest rank in the busiest step: what the cost model reads
    row_density_mean: float | None = None
    row_density_std: float | None = None
    steps: int | None = None
    ranks: int | None = None


@dataclass(frozen=True, kw_only=True)
class CalibrationRun(Entry):
    """A measured step time of a policy on the profiled job, in ``calibration.results``
    (``extra``: every step's time); or, with ``stock``, of a preset's stock set-up
    (PyTorch's own hook), which the cost model's residual does not learn from: it scales
    the model's predictions of that preset's stock set-up instead
    (:meth:`autotune.models.cost_model.CostModel.predict_stock`)."""

    ALWAYS: ClassVar[frozenset[str]] = frozenset({"policy"})
    policy: Mapping[str, Any] | None = None  # the policy's JSON; None: plain DDP
    step_s: float  # the median
    source: str | None = None  # who measured it: "verify", or None (the profile job)
    policy_id: str | None = None  # verify's: the policy's id, replaced when measured again
    stock: str | None = None  # a preset's name: its stock set-up was measured, not a policy


def _entry_fields(kind: type[Entry]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind) if f.name not in _ENTRY_META)


def _array(kind: type[Entry]) -> Callable[[Any], tuple[Any, ...]]:
    return lambda values: tuple(kind.from_dict(v) for v in values)


def _by_name(kind: type[Entry]) -> Callable[[Any], Mapping[str, Any]]:
    return lambda values: MappingProxyType({k: kind.from_dict(v) for k, v in values.items()})


def _fits(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``network.fits``: a NetworkFit per collective, and per link class under "p2p"."""
    return MappingProxyType({
        name: _by_name(NetworkFit)(fit) if name == "p2p" else NetworkFit.from_dict(fit)
        for name, fit in values.items()})


def _typed(builders: _Builders, name: str, value: Any) -> Any:
    """A field's validated JSON as the field holds it."""
    build = builders.get(name)
    return freeze(value) if build is None or value is None else build(value)


def _to_json(value: Any) -> Any:
    """Plain JSON of a field: records as their dicts."""
    if isinstance(value, Entry):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


class Section:
    """One section of a profile: typed attributes for what autotune reads, validated at
    construction; the section's other (descriptive) keys are kept, read-only, in
    ``extra`` so that ``to_dict`` writes back what ``from_dict`` read.

    A field left None is absent (a required one fails validation as "missing"); an
    optional collection left empty is not written.
    """

    KEY: ClassVar[str] = ""
    ALWAYS: ClassVar[frozenset[str]] = frozenset()  # written even when None
    ENTRIES: ClassVar[_Builders] = {}  # fields that hold records (Entry)

    def __post_init__(self) -> None:
        where = (f"{self.origin}: {self.KEY}: must hold only JSON values (objects, arrays, "
                 "strings, finite numbers, booleans, null)")
        try:
            plain = self._plain()
        except RecursionError as exc:
            raise ProfileError(f"{where}: nested too deeply") from exc
        self._check(_Validator(self.origin), plain)  # names the field of a bad value
        try:
            # Through JSON text: what is kept is exactly what to_dict() writes, and later
            # changes to the caller's values cannot reach this section.
            plain = json.loads(dumps(plain))
        except (TypeError, ValueError, RecursionError) as exc:
            raise ProfileError(f"{where}: {exc}") from exc
        names = self._names()
        for name in names:  # an absent one keeps its default, read-only
            value = plain[name] if name in plain else _to_json(getattr(self, name))
            object.__setattr__(self, name, _typed(self.ENTRIES, name, value))
        object.__setattr__(self, "extra", freeze({k: v for k, v in plain.items() if k not in names}))

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name not in _META)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "profile") -> Any:
        """The section from its JSON object; errors name the field."""
        if not isinstance(data, Mapping):
            _fail(origin, cls.KEY, f"expected an object, got {json_type(data)}")
        names = cls._names()
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**{k: data[k] for k in names if k in data}, extra=extra, origin=origin)

    def to_dict(self) -> dict[str, Any]:
        return self._plain()

    def _plain(self) -> dict[str, Any]:
        out = {k: thaw(v) for k, v in self.extra.items()}
        for f in fields(self):
            if f.name in _META:
                continue
            value = getattr(self, f.name)
            # an optional collection: one whose default is an empty array or object
            collection = f.default_factory is not MISSING or f.default not in (None, MISSING)
            if (value is None and f.name not in self.ALWAYS) or (collection and not value):
                continue
            out[f.name] = _to_json(value)
        return out

    @classmethod
    def _check(cls, v: _Validator, data: Mapping[str, Any]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Env(Section):
    """Where the profile was taken (``extra``: versions, device name, created, wall_s...)."""

    KEY: ClassVar[str] = "env"
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"link"})
    torch: str = None  # type: ignore[assignment]  # required (None: missing)
    backend: str = None  # type: ignore[assignment]
    device: str = None  # type: ignore[assignment]
    world_size: int = None  # type: ignore[assignment]
    hosts: int = None  # type: ignore[assignment]
    link: str | None = None  # the emulated link, if any
    extra: Mapping[str, Any] = field(default_factory=dict)
    origin: str = field(default="profile", compare=False)

    @classmethod
    def _check(cls, v: _Validator, env: Mapping[str, Any]) -> None:
        for key in ("torch", "backend", "device"):
            v.string(env, f"env.{key}")
        world = v.integer(env, "env.world_size", low=1)
        v.integer(env, "env.hosts", low=1, high=world)
        if env.get("link") is not None:
            try:
                parse_link(v.string(env, "env.link"))
            except AutotuneError as exc:
                _fail(v.source, "env.link", str(exc))


@dataclass(frozen=True)
class Workload(Section):
    """What was profiled (``extra``: its parameter and tensor counts)."""

    KEY: ClassVar[str] = "workload"
    name: str = None  # type: ignore[assignment]  # required
    spec: str | None = None  # how to build it again (a built-in name, file.py:fn, "live")
    extra: Mapping[str, Any] = field(default_factory=dict)
    origin: str = field(default="profile", compare=False)

    @classmethod
    def _check(cls, v: _Validator, wl: Mapping[str, Any]) -> None:
        v.string(wl, "workload.name")
        v.optional(wl, "workload.spec", v.string)


@dataclass(frozen=True)
class Network(Section):
    """Collective and point-to-point fits and their raw samples."""

    KEY: ClassVar[str] = "network"
    ENTRIES: ClassVar[_Builders] = {"fits": _fits, "samples": _array(NetworkSample)}
    # collective -> NetworkFit; "p2p": link class -> NetworkFit
    fits: Mapping[str, Any] = None  # type: ignore[assignment]  # required
    samples: tuple[NetworkSample, ...] = None  # type: ignore[assignment]  # required
    extra: Mapping[str, Any] = field(default_factory=dict)
    origin: str = field(default="profile", compare=False)

    @classmethod
    def _check(cls, v: _Validator, net: Mapping[str, Any]) -> None:
        fits = v.obj(net, "network.fits")
        for name, fit in fits.items():
            path = f"network.fits.{name}"
            entries = v.obj(fits, path).items() if name == "p2p" else [(None, fit)]
            for link_class, f in entries:
                p = path if link_class is None else f"{path}.{link_class}"
                if not isinstance(f, Mapping):
                    _fail(v.source, p, f"expected an object, got {json_type(f)}")
                v.number(f, f"{p}.latency_s", low=0.0, high=MAX_SECONDS)
                v.number(f, f"{p}.bandwidth_Bps", low=0.0, low_open=True, high=MAX_BYTES)
                v.optional(f, f"{p}.busbw_Bps", v.number, low=0.0, low_open=True, high=MAX_BYTES)
                for j, size in enumerate(v.optional(f, f"{p}.fit_bytes", v.array) or ()):
                    v.value(size, f"{p}.fit_bytes[{j}]", low=0.0, high=MAX_BYTES)
        for i, s in enumerate(v.array(net, "network.samples")):
            path = f"network.samples[{i}]"
            v.is_obj(s, path)
            v.string(s, f"{path}.collective")
            v.integer(s, f"{path}.bytes", low=0, high=MAX_BYTES)
            v.seconds_array(s, f"{path}.times_s")
            v.optional(s, f"{path}.link_class", v.string)


@dataclass(frozen=True)
class Compute(Section):
    """Step-phase times and per-parameter gradient-ready times."""

    KEY: ClassVar[str] = "compute"
    ENTRIES: ClassVar[_Builders] = {"params": _array(ProfiledParam),
                                    "modules": _array(ModuleTiming)}
    step_s: tuple[float, ...] = None  # type: ignore[assignment]  # required, each > 0
    forward_s: tuple[float, ...] = None  # type: ignore[assignment]  # required
    backward_s: tuple[float, ...] = None  # type: ignore[assignment]  # required
    optimizer_s: tuple[float, ...] = None  # type: ignore[assignment]  # required
    hooked_step_s: tuple[float, ...] | None = None
    hooked_backward_s: tuple[float, ...] | None = None
    # in module order
    params: tuple[ProfiledParam, ...] = None  # type: ignore[assignment]  # required
    modules: tuple[ModuleTiming, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    origin: str = field(default="profile", compare=False)

    @classmethod
    def _check(cls, v: _Validator, comp: Mapping[str, Any]) -> None:
        for key in ("step_s", "forward_s", "backward_s", "optimizer_s"):
            v.seconds_array(comp, f"compute.{key}", nonempty=True, positive=key == "step_s")
        for key in ("hooked_step_s", "hooked_backward_s"):
            v.optional(comp, f"compute.{key}", v.seconds_array)
        names: set[str] = set()
        for i, p in enumerate(v.array(comp, "compute.params", nonempty=True)):
            path = f"compute.params[{i}]"
            v.is_obj(p, path)
            name = v.string(p, f"{path}.name")
            if name in names:
                _fail(v.source, f"{path}.name", f"{name!r} appears twice")
            names.add(name)
            v.shape(p, f"{path}.shape")
            if p.get("ready_s", 0.0) is not None:  # null: the parameter never got a gradient
                v.number(p, f"{path}.ready_s", low=0.0, high=MAX_SECONDS)
            v.optional(p, f"{path}.dtype", v.string)
        for i, m in enumerate(v.optional(comp, "compute.modules", v.array) or ()):
            path = f"compute.modules[{i}]"
            v.is_obj(m, path)
            v.string(m, f"{path}.name")
            v.optional(m, f"{path}.type", v.string)
            for key in ("forward_s", "backward_s"):
                if m.get(key) is not None:
                    v.number(m, f"{path}.{key}", low=0.0, high=MAX_SECONDS)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, in module order."""
        return {p.name: p.shape for p in self.params}


@dataclass(frozen=True)
class Codecs(Section):
    """Each compressor's measured cost and error on the profiled gradients."""

    KEY: ClassVar[str] = "codecs"
    ENTRIES: ClassVar[_Builders] = {"shapes": _array(CodecCost), "errors": _array(CodecError),
                                   "structure": _by_name(RowStructure)}
    world_size: int | None = None  # ranks the wire sizes were measured for
    grid: tuple[Any, ...] = ()  # the compressor specs measured
    skipped: tuple[Any, ...] = ()  # the specs the time budget cut
    shapes: tuple[CodecCost, ...] = ()
    errors: tuple[CodecError, ...] = ()
    structure: Mapping[str, RowStructure] = field(default_factory=dict)  # parameter name ->
    sampling: Mapping[str, Any] = field(default_factory=dict)  # {"above"?, "numel"?}
    grad_norms: Mapping[str, float] = field(default_factory=dict)  # parameter name -> norm
    extra: Mapping[str, Any] = field(default_factory=dict)
    origin: str = field(default="profile", compare=False)

    @classmethod
    def _check(cls, v: _Validator, codecs: Mapping[str, Any]) -> None:
        v.optional(codecs, "codecs.world_size", v.integer, low=1)
        for key in ("grid", "skipped"):  # the configurations measured, and those the budget cut
            for i, spec in enumerate(v.optional(codecs, f"codecs.{key}", v.array) or ()):
                v.spec_value(spec, f"codecs.{key}[{i}]")
        for i, s in enumerate(v.optional(codecs, "codecs.shapes", v.array) or ()):
            path = f"codecs.shapes[{i}]"
            v.is_obj(s, path)
            v.spec(s, f"{path}.spec")
            v.shape(s, f"{path}.shape")
            v.number(s, f"{path}.encode_decode_s", low=0.0, high=MAX_SECONDS)
            v.number(s, f"{path}.wire_bytes", low=0.0, high=MAX_BYTES)
            # data-dependent compressors: the fraction of rows non-zero in the tensor timed,
            # and the time of a copy with more rows filled
            v.optional(s, f"{path}.row_density", v.number, low=0.0, high=1.0)
            if v.optional(s, f"{path}.denser", v.obj) is not None:
                v.number(s["denser"], f"{path}.denser.row_density", low=0.0, high=1.0)
                v.number(s["denser"], f"{path}.denser.encode_decode_s", low=0.0, high=MAX_SECONDS)
            # how the time was measured: absent (profiles before row sampling) is "full"; a
            # cell timed again in full keeps the sample it was first timed on
            mode = v.optional(s, f"{path}.measured", v.choice, options=("full", "sample"))
            if mode == "sample" or s.get("sample") is not None:
                sample = v.obj(s, f"{path}.sample")
                v.string(sample, f"{path}.sample.param")
                v.integer(sample, f"{path}.sample.rows", low=1)
                v.integer(sample, f"{path}.sample.numel", low=1, high=MAX_NUMEL)
                v.number(sample, f"{path}.sample.encode_decode_s", low=0.0, high=MAX_SECONDS)
        for i, e in enumerate(v.optional(codecs, "codecs.errors", v.array) or ()):
            path = f"codecs.errors[{i}]"
            v.is_obj(e, path)
            v.spec(e, f"{path}.spec")
            v.string(e, f"{path}.param")
            v.number(e, f"{path}.rel_error", low=0.0, high=MAX_RATIO)
            v.optional(e, f"{path}.cum_error", v.number, low=0.0, high=MAX_RATIO)
            mode = v.optional(e, f"{path}.measured", v.choice,
                              options=("full", "live_rows", "sample"))
            if mode in ("live_rows", "sample") or e.get("sample") is not None:
                sample = v.obj(e, f"{path}.sample")
                of_rows = v.integer(sample, f"{path}.sample.of_rows", low=1, high=MAX_NUMEL)
                v.integer(sample, f"{path}.sample.rows", low=1, high=of_rows)
                v.integer(sample, f"{path}.sample.numel", low=1, high=MAX_NUMEL)
                v.optional(sample, f"{path}.sample.energy_ratio", v.number, low=0.0, high=MAX_RATIO)
        # gradient structure: absent in profiles from before it was measured; that its
        # keys are profiled parameters is the profile's check (it needs compute)
        structure = v.optional(codecs, "codecs.structure", v.obj) or {}
        for name, entry in structure.items():  # keys are parameter names, which hold dots
            path = f"codecs.structure[{name!r}]"
            v.is_obj(entry, path)
            # fractions of rows; the cost model reads the busiest rank's, the others describe
            most = v.number(entry, f"{path}.row_density_max", low=0.0, high=1.0)
            mean = v.optional(entry, f"{path}.row_density_mean", v.number, low=0.0, high=1.0)
            if mean is not None and mean > most + 1e-9:
                _fail(v.source, f"{path}.row_density_mean",
                      f"{mean:g} is above row_density_max {most:g}: a mean cannot exceed the maximum")
            # the population spread of values in [0, 1] is at most 1/2
            v.optional(entry, f"{path}.row_density_std", v.number, low=0.0, high=0.5)
            v.optional(entry, f"{path}.steps", v.integer, low=1)
            v.optional(entry, f"{path}.ranks", v.integer, low=1)
        sampling = v.optional(codecs, "codecs.sampling", v.obj) or {}
        v.optional(sampling, "codecs.sampling.above", v.integer, low=1)
        v.optional(sampling, "codecs.sampling.numel", v.integer, low=1)
        norms = v.optional(codecs, "codecs.grad_norms", v.obj) or {}
        for name, norm in norms.items():  # keys are parameter names, which hold dots
            v.value(norm, f"codecs.grad_norms[{name!r}]", low=0.0, high=MAX_RATIO)


@dataclass(frozen=True)
class Calibration(Section):
    """Measured (policy, step time) pairs that fit the cost model's residual."""

    KEY: ClassVar[str] = "calibration"
    ENTRIES: ClassVar[_Builders] = {"results": _array(CalibrationRun)}
    results: tuple[CalibrationRun, ...] = None  # type: ignore[assignment]  # required
    extra: Mapping[str, Any] = field(default_factory=dict)
    origin: str = field(default="profile", compare=False)

    @classmethod
    def _check(cls, v: _Validator, cal: Mapping[str, Any]) -> None:
        for i, row in enumerate(v.array(cal, "calibration.results")):
            path = f"calibration.results[{i}]"
            v.is_obj(row, path)
            v.number(row, f"{path}.step_s", low=0.0, low_open=True, high=MAX_SECONDS)
            if row.get("policy") is not None:
                v.policy(row["policy"], f"{path}.policy")
            for key in ("source", "policy_id", "stock"):
                v.optional(row, f"{path}.{key}", v.string)
            if row.get("stock") is not None and row["stock"] not in PRESET_NAMES:
                _fail(v.source, f"{path}.stock", f"not a preset: {row['stock']!r} (presets: "
                                                 f"{', '.join(sorted(PRESET_NAMES))})")


_SECTION_TYPES: dict[str, type[Section]] = {
    kind.KEY: kind for kind in (Env, Workload, Network, Compute, Codecs, Calibration)}
_SECTIONS = tuple(_SECTION_TYPES)


@dataclass(frozen=True)
class Profile:
    """A validated, read-only profile of typed sections (see module doc). Each section
    may be given as its JSON object; it is validated and typed on construction."""

    env: Env
    workload: Workload
    network: Network
    compute: Compute
    codecs: Codecs = field(default_factory=dict)  # type: ignore[assignment]
    calibration: Calibration = field(default_factory=lambda: {"results": []})  # type: ignore[assignment]
    source: str = field(default="profile", compare=False)  # where it was read from

    def __post_init__(self) -> None:
        for name, kind in _SECTION_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kind):  # a typed section validated when it was built
                object.__setattr__(self, name, kind.from_dict(value, origin=self.source))
        # what one section says of another
        if self.env.world_size > 1 and not self.network.fits:
            _fail(self.source, "network.fits", "empty, but the job has more than one rank")
        v = _Validator(self.source)
        names = set(self.compute.param_names)
        for name, entry in self.codecs.structure.items():
            path = f"codecs.structure[{name!r}]"
            if name not in names:
                _fail(self.source, path, f"not a profiled parameter (compute.params has no {name!r})")
            v.optional(entry.to_dict(), f"{path}.ranks", v.integer, low=1, high=self.env.world_size)

    # ------------------------------------------------------------- (de)serialise
    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> Profile:
        """Validate ``data`` (a parsed profile.json); errors name the field."""
        if not isinstance(data, Mapping):
            _fail(source, "(top level)", f"expected an object, got {json_type(data)}")
        unknown = sorted(set(data) - {"version", *_SECTIONS})
        if {"layers", "default", "bucket_cap_mb"} & set(unknown):
            _fail(source, "(top level)", "this is a policy, not a profile (it has "
                                         f"{', '.join(repr(k) for k in unknown[:3])})")
        if unknown:
            _fail(source, unknown[0], f"unknown key; expected {', '.join(('version',) + _SECTIONS)}")
        version = data.get("version")
        # bool is an int in Python, and 1.0 == 1: neither is the version number 1
        if type(version) is not int or version != PROFILE_VERSION:
            _fail(source, "version", f"expected {PROFILE_VERSION}, got {_short(version)}")
        for name in _SECTIONS:
            if name not in data and name != "calibration":  # calibration is optional
                _fail(source, name, "missing")
        return cls(**{name: data[name] for name in _SECTIONS if name in data}, source=source)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": PROFILE_VERSION}
        for name in _SECTIONS:
            out[name] = getattr(self, name).to_dict()
        return out

    def to_json(self, indent: int | None = 1) -> str:
        return dumps(self.to_dict(), indent=indent)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a failure leaves any old file intact."""
        write_atomic(path, self.to_json() + "\n", ProfileError, "profile")

    # ---------------------------------------------------------------- queries
    @property
    def fingerprint(self) -> str:
        """12 hex digits identifying the environment and the model's parameters."""
        key = {
            "env": {k: v for k, v in self.env.to_dict().items() if k not in ("created", "wall_s")},
            "workload": self.workload.to_dict(),
            "params": [(p.name, list(p.shape)) for p in self.compute.params],
        }
        return hashlib.sha256(dumps(key, indent=None).encode()).hexdigest()[:12]

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def fit(self, collective: str, link_class: str = "inter") -> NetworkFit:
        """The fitted latency/bandwidth of a collective (p2p: of a link class, falling
        back to the other class when the cluster has only one)."""
        fits = self.network.fits
        if collective not in fits:
            raise ProfileError(f"{self.source}: no fit for {collective!r} in network.fits")
        f = fits[collective]
        if collective == "p2p":
            return f.get(link_class) or next(iter(f.values()))
        return f

    def check_model(self, model: Any, what: str = "the model") -> None:
        """Insist that ``model``'s trainable parameters are the profiled ones.

        Names and shapes must match (order need not): the profile's timings, codec costs
        and errors are per parameter, and a policy tuned on it names them.

        Args:
            model: a ``torch.nn.Module``.
            what: how messages name the model, e.g. ``"--workload mlp"``.

        Raises:
            ProfileError: naming the first difference and how many there are.
        """
        theirs = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        ours = self.compute.shapes
        if theirs == ours:
            return
        missing = [n for n in ours if n not in theirs]
        extra = [n for n in theirs if n not in ours]
        reshaped = [n for n in ours if n in theirs and ours[n] != theirs[n]]
        if missing or extra:
            first = (f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the profile lacks")
            detail = f"{len(missing)} profiled parameter(s) missing, {len(extra)} not profiled; it {first}"
        else:
            n = reshaped[0]
            detail = f"{len(reshaped)} parameter(s) differ in shape, e.g. {n!r}: {theirs[n]} vs {ours[n]}"
        raise ProfileError(
            f"{self.source}: {what} is not the profiled model ({self.workload.name}): {detail}; "
            "profile this workload first"
        )

    def compute_floor_s(self) -> float:
        """Median compute-only step time (ranks side by side, no communication)."""
        return _median(self.compute.step_s)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate ``profile.json``; errors name the file and the field."""
    return Profile.from_dict(read_json(path, ProfileError, "profile"), source=str(path))


# ------------------------------------------------------------------ validation

# Upper bounds on physical quantities: far beyond any real job, low enough that sums and
# squares in the cost model stay finite (a profile from a file is untrusted input).
MAX_SECONDS = 1e6
MAX_BYTES = 2**50
MAX_NUMEL = 2**48
MAX_RATIO = 1e6  # relative errors, gradient norms


class _Validator:
    """Path-aware checks: each failure names the dotted field, e.g. ``env.world_size``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def _get(self, parent: Mapping[str, Any], path: str) -> Any:
        key = path.rsplit(".", 1)[-1]
        if key not in parent:
            _fail(self.source, path, "missing")
        return parent[key]

    def optional(self, parent: Mapping[str, Any], path: str, check: Any, **kwargs: Any) -> Any:
        """``check(parent, path, ...)`` if the key is there (and not null), else None."""
        if parent.get(path.rsplit(".", 1)[-1]) is None:
            return None
        return check(parent, path, **kwargs)

    def is_obj(self, value: Any, path: str) -> None:
        if not isinstance(value, Mapping):
            _fail(self.source, path, f"expected an object, got {json_type(value)}")

    def obj(self, parent: Mapping[str, Any], path: str) -> Mapping[str, Any]:
        value = self._get(parent, path)
        self.is_obj(value, path)
        return value

    def array(self, parent: Mapping[str, Any], path: str, nonempty: bool = False) -> list[Any]:
        value = self._get(parent, path)
        if not isinstance(value, (list, tuple)):
            _fail(self.source, path, f"expected an array, got {json_type(value)}")
        if nonempty and not value:
            _fail(self.source, path, "expected a non-empty array")
        return list(value)

    def choice(self, parent: Mapping[str, Any], path: str, options: tuple[str, ...]) -> str:
        value = self._get(parent, path)
        if value not in options:
            _fail(self.source, path, f"expected one of {', '.join(map(repr, options))}, "
                                     f"got {_short(value)}")
        return str(value)

    def string(self, parent: Mapping[str, Any], path: str) -> str:
        value = self._get(parent, path)
        if not isinstance(value, str) or not value:
            _fail(self.source, path, f"expected a non-empty string, got {_short(value)}")
        return value

    def integer(self, parent: Mapping[str, Any], path: str, low: int, high: int | None = None) -> int:
        value = self._get(parent, path)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        if not ok or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            _fail(self.source, path, f"expected an integer {bound}, got {_short(value)}")
        return value

    def number(self, parent: Mapping[str, Any], path: str, low: float, low_open: bool = False,
               high: float = math.inf) -> float:
        return self.value(self._get(parent, path), path, low, low_open, high)

    def value(self, value: Any, path: str, low: float, low_open: bool = False,
              high: float = math.inf) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            try:
                ok = math.isfinite(value) and (value > low if low_open else value >= low)
            except OverflowError:  # an int too large for a float
                ok = False
            ok = ok and value <= high
        if not ok:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            if high != math.inf:
                bound += f" and <= {high:g}"
            _fail(self.source, path, f"expected a number {bound}, got {_short(value)}")
        return float(value)

    def seconds_array(self, parent: Mapping[str, Any], path: str, nonempty: bool = False,
                      positive: bool = False) -> list[float]:
        values = self.array(parent, path, nonempty=nonempty)
        for i, t in enumerate(values):
            self.value(t, f"{path}[{i}]", low=0.0, low_open=positive, high=MAX_SECONDS)
        return values

    def shape(self, parent: Mapping[str, Any], path: str) -> list[int]:
        shape = self.array(parent, path)
        ok = all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        if not ok or math.prod(shape) > MAX_NUMEL:
            _fail(self.source, path, "expected non-negative integers with a product <= "
                                     f"2**48, got {_short(shape)}")
        return shape

    def spec(self, parent: Mapping[str, Any], path: str) -> None:
        self.spec_value(self._get(parent, path), path)

    def spec_value(self, value: Any, path: str) -> None:
        try:
            CompressorSpec.from_dict(value)
        except AutotuneError as exc:
            _fail(self.source, path, str(exc))

    def policy(self, value: Any, path: str) -> None:
        try:
            Policy.from_dict(value, source=path)
        except AutotuneError as exc:
            raise ProfileError(f"{self.source}: {exc}") from exc


def _short(value: Any) -> str:
    """repr of a value from a file, cut to a readable length."""
    return reprlib.repr(value)


def _fail(source: str, path: str, problem: str) -> NoReturn:
    raise ProfileError(f"{source}: {path}: {problem}")


def _median(values: Any) -> float:
    ordered = sorted(float(x) for x in values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
