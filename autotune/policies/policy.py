"""The policy: which compressor each parameter's gradient uses, and the bucket size.

A policy is a plain JSON file that a person can read, diff and edit::

    {"version": 1, "bucket_cap_mb": 25, "default": {"compressor": "none"},
     "layers": {"fc1.weight": {"compressor": "powersgd", "rank": 4}},
     "meta": {"predicted_step_s": 0.25}}

Keys of ``layers`` are parameter names (as ``model.named_parameters()`` yields them),
not bucket indices, because DDP renumbers its buckets after the first iteration.
Parameters without an entry use ``default``. ``meta`` is free-form, JSON-only
information (predictions, baselines, the profile it was tuned on); it never changes how
gradients are communicated, so it is left out of :attr:`Policy.id`.

Policies are validated where they are built, never deep inside a backward pass, and are
only ever read from JSON: a policy may come from someone else, so it is never unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import reprlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, NoReturn

from autotune.compressors.registry import REGISTRY, CompressorSpec
from autotune.errors import CompressorError, PolicyError
from autotune.jsonio import freeze, json_type, read_json, thaw, write_atomic

if TYPE_CHECKING:
    import torch

__all__ = ["DDP_DEFAULT_BUCKET_CAP_MB", "POLICY_VERSION", "Policy", "PolicyCheck", "TOPOLOGIES",
           "ddp_bucket_cap", "load_policy"]

POLICY_VERSION = 1
"""Version of the policy JSON format this code reads and writes."""

DDP_DEFAULT_BUCKET_CAP_MB = 25.0
"""``DistributedDataParallel``'s default ``bucket_cap_mb``; a policy at this cap gets DDP's
default buckets, first bucket of 1 MiB included (:attr:`Policy.ddp_bucket_cap_mb`)."""

MAX_BUCKET_CAP_MB = 1024.0
"""Largest bucket cap accepted: beyond it DDP fuses nothing more and memory only grows."""

_KEYS = ("version", "bucket_cap_mb", "topology", "default", "layers", "meta")
TOPOLOGIES = ("flat", "hierarchical")
"""How buckets cross hosts: one collective over all ranks, or reduced inside each host,
exchanged (compressed) between one leader per host, and shared inside the host again."""
_SHOWN_UNKNOWN = 5  # unknown names listed in an error; the rest are only counted


@dataclass(frozen=True)
class PolicyCheck:
    """How a policy's layer names match a model's trainable parameters.

    Attributes:
        unknown: layer names of the policy that are no trainable parameter of the model,
            in policy order. Usually a policy tuned for another model, or a model wrapped
            differently (DDP prefixes every name with ``module.``).
        uncovered: trainable parameters with no layer entry, in model order; they use
            the policy's default. Normal for hand-written policies.
    """

    unknown: tuple[str, ...] = ()
    uncovered: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every layer name of the policy is a trainable parameter."""
        return not self.unknown

    def raise_if_unknown(self, source: str = "policy") -> None:
        """Raise if the policy names parameters the model does not train.

        Args:
            source: how the message names the policy (a file, with the model it met).

        Raises:
            PolicyError: listing up to five unknown names and how many there are.
        """
        if self.ok:
            return
        shown = ", ".join(repr(name) for name in self.unknown[:_SHOWN_UNKNOWN])
        more = len(self.unknown) - _SHOWN_UNKNOWN
        if more > 0:
            shown += f" and {more} more"
        raise PolicyError(
            f"{source}: layers: {len(self.unknown)} name(s) match no trainable parameter of "
            f"the model: {shown}"
        )


@dataclass(frozen=True)
class Policy:
    """A communication policy: bucket size and a compressor per parameter.

    Build one with :meth:`from_dict`, :func:`load_policy` or :meth:`uniform`; the
    constructor validates too, so an invalid policy object cannot exist. Mappings are
    read-only, and ``meta`` is a read-only snapshot of the JSON it was given.

    Attributes:
        bucket_cap_mb: DDP's bucket size in MiB. Larger buckets mean fewer, larger
            collectives (less latency, less overlap with backward). DDP's default is 25;
            on fast links try 50-100, on slow links with compression 10-25. At 25 the
            buckets are DDP's default ones, whose first (the last layers' gradients,
            ready first) is capped at 1 MiB so that communication starts early, exactly
            as ``DistributedDataParallel(model)``; at any other cap every bucket has
            that cap, as ``DistributedDataParallel(model, bucket_cap_mb=cap)``
            (:attr:`ddp_bucket_cap_mb`).
        default: the compressor of every parameter without a layer entry.
        layers: compressor per parameter name; names missing here use ``default``.
        meta: free-form JSON (predictions, baselines, provenance); ignored by ``id``.
        topology: ``"flat"`` (every collective over all ranks, as DDP) or
            ``"hierarchical"``: each bucket is summed inside its host uncompressed, the
            hosts' sums are exchanged with the compressors between one leader per host,
            and each leader shares the result inside its host. It pays on several
            ranks per host behind a slower network; on one rank per host, or one host,
            it runs flat. Written to JSON only when not flat.
    """

    bucket_cap_mb: float = DDP_DEFAULT_BUCKET_CAP_MB
    default: CompressorSpec = CompressorSpec("none")
    layers: Mapping[str, CompressorSpec] = field(default_factory=lambda: MappingProxyType({}))
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    topology: str = "flat"

    def __post_init__(self) -> None:
        # from_dict has already checked its input with a better prefix (the file name);
        # checking again here keeps objects built directly just as valid.
        where = "policy"
        object.__setattr__(self, "bucket_cap_mb", _bucket_cap(self.bucket_cap_mb, where))
        _topology(self.topology, where)
        if not isinstance(self.default, CompressorSpec):
            _fail(where, "default", f"expected a CompressorSpec, got {self.default!r}")
        _validate_spec(self.default, where, "default")
        if not isinstance(self.layers, Mapping):
            _fail(where, "layers", f"expected a mapping, got {type(self.layers).__name__}")
        layers: dict[str, CompressorSpec] = {}
        for name, spec in self.layers.items():
            _layer_name(name, where)
            path = f"layers[{name!r}]"
            if not isinstance(spec, CompressorSpec):
                _fail(where, path, f"expected a CompressorSpec, got {spec!r}")
            _validate_spec(spec, where, path)
            layers[name] = spec
        object.__setattr__(self, "layers", MappingProxyType(layers))
        object.__setattr__(self, "meta", _freeze_meta(self.meta, where))

    # Mappings are unhashable, so the generated __hash__ would fail; hash what __eq__
    # compares instead (the layer order does not matter to either).
    def __hash__(self) -> int:
        return hash(
            (
                self.bucket_cap_mb,
                self.topology,
                self.default,
                frozenset(self.layers.items()),
                json.dumps(thaw(self.meta), sort_keys=True),
            )
        )

    # ------------------------------------------------------------------ building

    @classmethod
    def from_dict(cls, data: Any, source: str = "policy") -> Policy:
        """Build a policy from parsed JSON, strictly.

        Args:
            data: the parsed JSON object.
            source: what the data came from (usually a file name); prefixes every message.

        Returns:
            The validated policy.

        Raises:
            PolicyError: naming the offending field, e.g.
                ``policy.json: version: expected 1, got 2``.
        """
        if not isinstance(data, Mapping):
            raise PolicyError(
                f"{source}: expected a JSON object at the top level, got {json_type(data)}"
            )
        unknown = [key for key in data if key not in _KEYS]
        if {"env", "compute", "network"} & set(unknown):
            raise PolicyError(f"{source}: this is a profile, not a policy (it has "
                              f"{', '.join(repr(k) for k in unknown[:3])})")
        if unknown:
            raise PolicyError(
                f"{source}: unknown key {unknown[0]!r}; the keys of a policy are: "
                f"{', '.join(_KEYS)}"
            )
        if "version" not in data:
            _fail(source, "version", f"missing; expected {POLICY_VERSION}")
        version = data["version"]
        # bool is an int in Python, and 1.0 == 1: neither is the version number 1
        if type(version) is not int or version != POLICY_VERSION:
            _fail(source, "version", f"expected {POLICY_VERSION}, got {reprlib.repr(version)}")

        bucket_cap_mb = _bucket_cap(data.get("bucket_cap_mb", DDP_DEFAULT_BUCKET_CAP_MB), source)
        topology = _topology(data.get("topology", "flat"), source)
        default = _parse_spec(data.get("default", {"compressor": "none"}), source, "default")

        raw_layers = data.get("layers", {})
        if not isinstance(raw_layers, Mapping):
            _fail(source, "layers", f"expected an object, got {json_type(raw_layers)}")
        layers: dict[str, CompressorSpec] = {}
        for name, raw in raw_layers.items():
            _layer_name(name, source)
            layers[name] = _parse_spec(raw, source, f"layers[{name!r}]")

        raw_meta = data.get("meta", {})
        if not isinstance(raw_meta, Mapping):
            _fail(source, "meta", f"expected an object, got {json_type(raw_meta)}")
        meta = _freeze_meta(raw_meta, source)
        return cls(bucket_cap_mb=bucket_cap_mb, default=default, layers=layers, meta=meta,
                   topology=topology)

    @classmethod
    def uniform(cls, compressor: str, bucket_cap_mb: float = DDP_DEFAULT_BUCKET_CAP_MB,
                **params: Any) -> Policy:
        """A policy in which every parameter uses one compressor.

        Args:
            compressor: a registered compressor name, e.g. ``"powersgd"``.
            bucket_cap_mb: DDP's bucket size in MiB.
            **params: the compressor's parameters, e.g. ``rank=4``.

        Raises:
            PolicyError: unknown compressor, bad parameter or bad bucket cap.
        """
        return cls(bucket_cap_mb=bucket_cap_mb, default=CompressorSpec.of(compressor, **params))

    def with_meta(self, **updates: Any) -> Policy:
        """A copy of this policy with ``meta`` updated by ``updates``.

        Raises:
            PolicyError: a value is not JSON-serialisable.
        """
        return dataclasses.replace(self, meta={**thaw(self.meta), **updates})

    # ------------------------------------------------------------------ reading

    def spec_for(self, param_name: str) -> CompressorSpec:
        """The compressor spec of ``param_name``: its layer entry, else the default.

        The spec is returned as written; group parameters by ``spec.canonical()`` so
        that ``powersgd`` and ``powersgd(rank=1)`` share one compressor.
        """
        return self.layers.get(param_name, self.default)

    def compressors(self) -> frozenset[CompressorSpec]:
        """The distinct compressors in use (default and layers), canonicalised."""
        return frozenset(
            spec.canonical() for spec in (self.default, *self.layers.values())
        )

    def check(self, model: torch.nn.Module) -> PolicyCheck:
        """Match the layer names against ``model``'s trainable parameters.

        Args:
            model: the module whose ``named_parameters()`` the policy addresses (the
                module DDP wraps, not the DDP object, whose names start ``module.``).

        Returns:
            The unknown layer names and the uncovered parameters;
            call :meth:`PolicyCheck.raise_if_unknown` to insist on a match.
        """
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        known = set(trainable)
        return PolicyCheck(
            unknown=tuple(name for name in self.layers if name not in known),
            uncovered=tuple(name for name in trainable if name not in self.layers),
        )

    @property
    def ddp_bucket_cap_mb(self) -> float | None:
        """What ``DistributedDataParallel`` is given as ``bucket_cap_mb`` for this policy:
        None (its default buckets: 25 MiB after a first bucket of 1 MiB) at DDP's default
        cap of 25, else the cap. The runtime builds DDP with it and the cost model
        simulates the same buckets."""
        return ddp_bucket_cap(self.bucket_cap_mb)

    @property
    def is_plain(self) -> bool:
        """Whether the policy is plain averaging: every parameter ``none``, flat. Such a
        policy needs no hook: :func:`autotune.wrap` runs it as DDP's own allreduce."""
        def exact_allreduce(spec: CompressorSpec) -> bool:  # the gradient itself is summed
            method = REGISTRY.get(spec.name)
            return method.elementwise and not method.lossy

        return self.topology == "flat" and all(map(exact_allreduce, self.compressors()))

    @property
    def id(self) -> str:
        """12 hex digits identifying how this policy communicates.

        Computed over the canonical JSON without ``meta``, with every compressor's
        defaults filled in and layer entries equal to the default dropped: two policies
        that compress alike share an id, whatever their meta or spelling.
        """
        default = self.default.canonical()
        layers = {
            name: canon.to_dict()
            for name, spec in self.layers.items()
            if (canon := spec.canonical()) != default
        }
        body = {
            "version": POLICY_VERSION,
            "bucket_cap_mb": float(self.bucket_cap_mb),
            "default": default.to_dict(),
            "layers": layers,
        }
        if self.topology != "flat":  # flat policies keep the ids they had before topologies
            body["topology"] = self.topology
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]

    # ------------------------------------------------------------------ writing

    def to_dict(self) -> dict[str, Any]:
        """The policy as plain JSON types, keys in file order; a fresh, mutable copy."""
        out: dict[str, Any] = {"version": POLICY_VERSION, "bucket_cap_mb": self.bucket_cap_mb}
        if self.topology != "flat":
            out["topology"] = self.topology
        out.update(default=self.default.to_dict(),
                   layers={name: spec.to_dict() for name, spec in self.layers.items()},
                   meta=thaw(self.meta))
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The policy as JSON text (keys: version, bucket_cap_mb, default, layers, meta)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the policy to ``path`` atomically (see :func:`autotune.jsonio.write_atomic`).

        Raises:
            PolicyError: the file cannot be written; the message names the path.
        """
        # Serialise before touching the file system, so that a bad policy costs nothing.
        write_atomic(path, self.to_json() + "\n", PolicyError, "policy")


def ddp_bucket_cap(bucket_cap_mb: float) -> float | None:
    """``DistributedDataParallel``'s ``bucket_cap_mb`` for a policy's cap: None (DDP's
    default buckets, first bucket of 1 MiB) at :data:`DDP_DEFAULT_BUCKET_CAP_MB`."""
    return None if bucket_cap_mb == DDP_DEFAULT_BUCKET_CAP_MB else bucket_cap_mb


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy JSON file.

    Args:
        path: the policy file.

    Returns:
        The validated policy.

    Raises:
        PolicyError: the file is missing or unreadable, is not valid JSON (the message
            gives line and column), or is not a valid policy (the message names the field).
    """
    source = str(path)
    data = read_json(path, PolicyError, "policy")
    return Policy.from_dict(data, source=source)


# ---------------------------------------------------------------------- helpers


def _fail(source: str, path: str, problem: str) -> NoReturn:
    raise PolicyError(f"{source}: {path}: {problem}")


def _bucket_cap(value: Any, source: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = 0.0 < value <= MAX_BUCKET_CAP_MB  # False for NaN; no float() of a huge int
    if not ok:
        _fail(
            source,
            "bucket_cap_mb",
            f"expected a number in the range (0, {MAX_BUCKET_CAP_MB:g}], got {reprlib.repr(value)}",
        )
    return float(value)


def _topology(value: Any, source: str) -> str:
    if not isinstance(value, str) or value not in TOPOLOGIES:
        _fail(source, "topology", f"expected one of {', '.join(map(repr, TOPOLOGIES))}, "
                                  f"got {reprlib.repr(value)}")
    return value


def _layer_name(name: Any, source: str) -> None:
    if not isinstance(name, str) or not name:
        _fail(source, "layers", f"parameter names must be non-empty strings, got {reprlib.repr(name)}")


def _parse_spec(raw: Any, source: str, path: str) -> CompressorSpec:
    try:
        return CompressorSpec.from_dict(raw)
    except CompressorError as exc:
        _fail(source, path, str(exc))


def _validate_spec(spec: CompressorSpec, source: str, path: str) -> None:
    try:
        REGISTRY.validate(spec.name, spec.kwargs)
    except CompressorError as exc:
        _fail(source, path, str(exc))


def _freeze_meta(meta: Any, source: str) -> Mapping[str, Any]:
    """A deep, read-only snapshot of ``meta``, or PolicyError if it is not pure JSON."""
    if not isinstance(meta, Mapping):
        _fail(source, "meta", f"expected a mapping, got {type(meta).__name__}")
    try:
        # The round trip proves the value can be saved (strict JSON: no NaN) and copies
        # it, so that the caller's later changes to its dict cannot reach the policy.
        plain = json.loads(json.dumps(thaw(meta), allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        _fail(
            source,
            "meta",
            "must hold only JSON values (objects, arrays, strings, finite numbers, "
            f"booleans, null): {exc}",
        )
    return freeze(plain)
