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

A profile can be taken on one machine and tuned on another. Like a policy it is only
ever JSON, validated on load (messages name the field), and saved atomically.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, NoReturn

from autotune.errors import ProfileError
from autotune.jsonio import dumps, freeze, json_type, read_json, thaw, write_atomic

__all__ = ["PROFILE_VERSION", "Profile", "load_profile"]

PROFILE_VERSION = 1
_SECTIONS = ("env", "workload", "network", "compute", "codecs", "calibration")


@dataclass(frozen=True)
class Profile:
    """A validated, read-only profile. Sections are plain JSON objects (see module doc)."""

    env: Mapping[str, Any]
    workload: Mapping[str, Any]
    network: Mapping[str, Any]
    compute: Mapping[str, Any]
    codecs: Mapping[str, Any] = field(default_factory=dict)
    # measured (policy, step time) pairs that fit the cost model's residual
    calibration: Mapping[str, Any] = field(default_factory=lambda: {"results": []})
    source: str = field(default="profile", compare=False)  # where it was read from

    def __post_init__(self) -> None:
        _validate(self.to_dict(), self.source)
        for name in _SECTIONS:
            # a deep read-only copy: later changes to the caller's dicts cannot reach it
            object.__setattr__(self, name, freeze(json.loads(dumps(thaw(getattr(self, name))))))

    # ------------------------------------------------------------- (de)serialise
    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> Profile:
        """Validate ``data`` (a parsed profile.json); errors name the field."""
        if not isinstance(data, Mapping):
            _fail(source, "(top level)", f"expected an object, got {json_type(data)}")
        unknown = sorted(set(data) - {"version", *_SECTIONS})
        if unknown:
            _fail(source, unknown[0], f"unknown key; expected {', '.join(('version',) + _SECTIONS)}")
        if data.get("version") != PROFILE_VERSION:
            _fail(source, "version", f"expected {PROFILE_VERSION}, got {data.get('version')!r}")
        for name in _SECTIONS:
            if name not in data and name != "calibration":  # calibration is optional
                _fail(source, name, "missing")
        return cls(**{name: data[name] for name in _SECTIONS if name in data}, source=source)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": PROFILE_VERSION}
        for name in _SECTIONS:
            out[name] = thaw(getattr(self, name))
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
            "env": {k: v for k, v in self.env.items() if k not in ("created", "wall_s")},
            "workload": thaw(self.workload),
            "params": [(p["name"], list(p["shape"])) for p in self.compute["params"]],
        }
        return hashlib.sha256(dumps(key, indent=None).encode()).hexdigest()[:12]

    @property
    def world_size(self) -> int:
        return int(self.env["world_size"])

    def fit(self, collective: str, link_class: str = "inter") -> Mapping[str, Any]:
        """The fitted latency/bandwidth of a collective (p2p: of a link class, falling
        back to the other class when the cluster has only one)."""
        fits = self.network["fits"]
        if collective not in fits:
            raise ProfileError(f"{self.source}: no fit for {collective!r} in network.fits")
        f = fits[collective]
        if collective == "p2p":
            return f.get(link_class) or next(iter(f.values()))
        return f

    def compute_floor_s(self) -> float:
        """Median compute-only step time (ranks side by side, no communication)."""
        return _median(self.compute["step_s"])


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate ``profile.json``; errors name the file and the field."""
    return Profile.from_dict(read_json(path, ProfileError, "profile"), source=str(path))


# ------------------------------------------------------------------ validation


def _validate(data: Mapping[str, Any], source: str) -> None:
    v = _Validator(source)
    env = v.obj(data, "env")
    for key in ("torch", "backend", "device"):
        v.string(env, f"env.{key}")
    v.integer(env, "env.world_size", low=1)
    v.integer(env, "env.hosts", low=1)
    wl = v.obj(data, "workload")
    v.string(wl, "workload.name")

    net = v.obj(data, "network")
    fits = v.obj(net, "network.fits")
    if env["world_size"] > 1 and not fits:
        _fail(source, "network.fits", "empty, but the job has more than one rank")
    for name, fit in fits.items():
        path = f"network.fits.{name}"
        entries = v.obj(fits, path).items() if name == "p2p" else [(None, fit)]
        for cls, f in entries:
            p = path if cls is None else f"{path}.{cls}"
            if not isinstance(f, Mapping):
                _fail(source, p, f"expected an object, got {json_type(f)}")
            v.number(f, f"{p}.latency_s", low=0.0)
            v.number(f, f"{p}.bandwidth_Bps", low=0.0, low_open=True)
    v.array(net, "network.samples")

    comp = v.obj(data, "compute")
    steps = v.array(comp, "compute.step_s", nonempty=True)
    for i, t in enumerate(steps):
        v.value(t, f"compute.step_s[{i}]", low=0.0, low_open=True)
    params = v.array(comp, "compute.params", nonempty=True)
    for i, p in enumerate(params):
        path = f"compute.params[{i}]"
        if not isinstance(p, Mapping):
            _fail(source, path, f"expected an object, got {json_type(p)}")
        v.string(p, f"{path}.name")
        shape = v.array(p, f"{path}.shape")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            _fail(source, f"{path}.shape", f"expected non-negative integers, got {shape!r}")
        if p.get("ready_s", 0.0) is not None:  # null: the parameter never got a gradient
            v.number(p, f"{path}.ready_s", low=0.0)

    codecs = v.obj(data, "codecs")
    for key in ("shapes", "errors"):
        if key in codecs:
            v.array(codecs, f"codecs.{key}")
    cal = v.obj(data, "calibration")
    for i, row in enumerate(v.array(cal, "calibration.results")):
        path = f"calibration.results[{i}]"
        if not isinstance(row, Mapping):
            _fail(source, path, f"expected an object, got {json_type(row)}")
        v.number(row, f"{path}.step_s", low=0.0, low_open=True)
        if row.get("policy") is not None and not isinstance(row["policy"], Mapping):
            _fail(source, f"{path}.policy", "expected a policy object or null")


class _Validator:
    """Path-aware checks: each failure names the dotted field, e.g. ``env.world_size``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def _get(self, parent: Mapping[str, Any], path: str) -> Any:
        key = path.rsplit(".", 1)[-1]
        if key not in parent:
            _fail(self.source, path, "missing")
        return parent[key]

    def obj(self, parent: Mapping[str, Any], path: str) -> Mapping[str, Any]:
        value = self._get(parent, path)
        if not isinstance(value, Mapping):
            _fail(self.source, path, f"expected an object, got {json_type(value)}")
        return value

    def array(self, parent: Mapping[str, Any], path: str, nonempty: bool = False) -> list[Any]:
        value = self._get(parent, path)
        if not isinstance(value, (list, tuple)):
            _fail(self.source, path, f"expected an array, got {json_type(value)}")
        if nonempty and not value:
            _fail(self.source, path, "expected a non-empty array")
        return list(value)

    def string(self, parent: Mapping[str, Any], path: str) -> str:
        value = self._get(parent, path)
        if not isinstance(value, str) or not value:
            _fail(self.source, path, f"expected a non-empty string, got {value!r}")
        return value

    def integer(self, parent: Mapping[str, Any], path: str, low: int) -> int:
        value = self._get(parent, path)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            _fail(self.source, path, f"expected an integer >= {low}, got {value!r}")
        return value

    def number(self, parent: Mapping[str, Any], path: str, low: float, low_open: bool = False) -> float:
        return self.value(self._get(parent, path), path, low, low_open)

    def value(self, value: Any, path: str, low: float, low_open: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            ok = value > low if low_open else value >= low
        if not ok:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            _fail(self.source, path, f"expected a number {bound}, got {value!r}")
        return float(value)


def _fail(source: str, path: str, problem: str) -> NoReturn:
    raise ProfileError(f"{source}: {path}: {problem}")


def _median(values: Any) -> float:
    ordered = sorted(float(x) for x in values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
