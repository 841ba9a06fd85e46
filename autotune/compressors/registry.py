"""What compressors are called and what they take, without importing torch.

Validating a policy needs only a compressor's name and its parameter table, so both live
here, in a module that imports nothing heavy: ``autotune show policy.json`` and
``Policy.from_dict`` check every name and parameter without loading torch. The built-in
methods are *declared* below (name, implementing module, parameters); a method's module,
which imports torch, is imported by name the first time its class is needed
(:meth:`Registry.get`, :func:`create`). Its class takes its ``params`` from the
declaration (``params = REGISTRY.params(name)``), so the table is written once.

A compressor of one's own needs no declaration: ``register`` its class, as before.
"""

from __future__ import annotations

import importlib
import math
import reprlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from autotune.errors import CompressorError

if TYPE_CHECKING:
    from autotune.compressors.base import Compressor

__all__ = [
    "ERROR_FEEDBACK",
    "PLAIN",
    "REGISTRY",
    "CompressorSpec",
    "Param",
    "Registry",
    "create",
    "names",
    "register",
]


@dataclass(frozen=True)
class Param:
    """One tunable parameter of a compressor, with its range and default."""

    kind: type  # int, float, bool or str
    default: Any
    low: float | None = None  # smallest allowed value (None: unbounded)
    high: float | None = None  # largest allowed value (None: unbounded)
    low_open: bool = False  # True: ``low`` itself is not allowed
    doc: str = ""
    choices: tuple[str, ...] = ()  # the allowed values of a str parameter

    def expected(self) -> str:
        """Describe the allowed values, e.g. ``a float in the range (0, 1]``."""
        if self.kind is str:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kind = {int: "an int", float: "a float", bool: "a bool"}[self.kind]
        if self.kind is bool:
            return kind
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            return f"{kind} in the range {left}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        return kind

    def check(self, compressor: str, name: str, value: Any) -> Any:
        """Return ``value`` converted to this parameter's type, or raise."""
        if self.kind is str:
            if not (isinstance(value, str) and value in self.choices):
                raise CompressorError(
                    f"The {name!r} parameter of {compressor} must be {self.expected()}. "
                    f"Got {reprlib.repr(value)} instead."
                )
            return value
        ok_type = (
            isinstance(value, bool)
            if self.kind is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            and (self.kind is float or isinstance(value, int) or value.is_integer())
        )
        ok = ok_type
        if ok and self.kind is not bool:
            try:
                v = float(value)
            except OverflowError:  # an int beyond any float is beyond any range too
                v = math.inf
            ok = math.isfinite(v)
            if ok and self.low is not None:
                ok = v > self.low if self.low_open else v >= self.low
            if ok and self.high is not None:
                ok = v <= self.high
        if not ok:
            raise CompressorError(
                f"The {name!r} parameter of {compressor} must be {self.expected()}. "
                f"Got {reprlib.repr(value)} instead."
            )
        return self.kind(value)


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor name and the parameters the user gave; hashable, JSON-friendly."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **params: Any) -> CompressorSpec:
        return cls(name, tuple(sorted(params.items())))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompressorSpec:
        """``{"compressor": "topk", "ratio": 0.01}`` -> spec (validated)."""
        if not isinstance(data, Mapping):
            raise CompressorError(f"a compressor spec must be an object, got {data!r}")
        if "compressor" not in data:
            raise CompressorError(f"a compressor spec needs a 'compressor' key, got {dict(data)!r}")
        params = {k: v for k, v in data.items() if k != "compressor"}
        # not cls.of(name, **params): a parameter called "name" would collide
        spec = cls(data["compressor"], tuple(sorted(params.items())))
        REGISTRY.validate(spec.name, spec.kwargs)
        return spec

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> dict[str, Any]:
        return {"compressor": self.name, **self.kwargs}

    def canonical(self) -> CompressorSpec:
        """The same spec with every default filled in: equal specs compress alike."""
        return CompressorSpec.of(self.name, **REGISTRY.validate(self.name, self.kwargs))

    def label(self) -> str:
        """Short human name naming only non-default parameters, e.g. ``powersgd(rank=4)``;
        equal for specs that compress alike."""
        defaults = {k: p.default for k, p in REGISTRY.params(self.name).items()}
        shown = [(k, v) for k, v in self.params if defaults.get(k, object()) != v]
        if not shown:
            return self.name
        return f"{self.name}(" + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in shown) + ")"


class Registry:
    """Compressors by name. Rejects duplicates; unknown names get the known ones listed.

    A name is either registered (its class is known) or declared (its parameters and the
    module that registers its class are known; :meth:`get` imports that module). Checking
    parameters (:meth:`params`, :meth:`validate`) never imports a declared module.
    """

    def __init__(self) -> None:
        # every name, in the order users see, with its parameter table
        self._params: dict[str, Mapping[str, Param]] = {}
        # declared names whose class is not loaded yet: the module that registers it
        self._modules: dict[str, str] = {}
        self._classes: dict[str, type[Compressor]] = {}

    def declare(self, name: str, module: str, params: Mapping[str, Param]) -> None:
        """Declare compressor ``name``, whose class ``module`` registers when imported.

        Args:
            name: the compressor's name.
            module: the dotted module that defines and registers its class.
            params: its parameter table; the class must use this very table.

        Raises:
            ValueError: the name is already declared or registered.
        """
        if name in self._params:
            raise ValueError(f"a compressor named {name!r} is already registered")
        self._params[name] = MappingProxyType(dict(params))
        self._modules[name] = module

    def register(self, cls: type[Compressor]) -> type[Compressor]:
        """Register ``cls`` under ``cls.name`` (usable as a class decorator).

        Raises:
            ValueError: the name is taken (by another class, or declared for a module
                other than the one defining ``cls``), or a declared class's ``params``
                differ from its declaration.
        """
        name = cls.name
        if name in self._classes or (name in self._params and self._modules.get(name) != cls.__module__):
            raise ValueError(f"a compressor named {name!r} is already registered")
        if name in self._params and dict(cls.params) != dict(self._params[name]):
            raise ValueError(f"compressor {name!r}: {cls.__qualname__}.params differ from the "
                             f"parameters declared in autotune.compressors.registry")
        self._params.setdefault(name, MappingProxyType(dict(cls.params)))
        self._modules.pop(name, None)
        self._classes[name] = cls
        return cls

    def names(self) -> list[str]:
        return list(self._params)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def params(self, name: str) -> Mapping[str, Param]:
        """The parameter table of compressor ``name``, without loading its module.

        Raises:
            CompressorError: unknown name; the message lists the known ones.
        """
        if not isinstance(name, str) or name not in self._params:
            raise CompressorError(
                f"unknown compressor {name!r}; registered: {', '.join(self._params)}"
            )
        return self._params[name]

    def get(self, name: str) -> type[Compressor]:
        """The class of compressor ``name``, importing its module on first use.

        Raises:
            CompressorError: unknown name; the message lists the known ones.
        """
        self.params(name)  # unknown names fail here, with the list
        if name not in self._classes:
            module = self._modules[name]
            importlib.import_module(module)
            if name not in self._classes:
                raise RuntimeError(f"importing {module} did not register compressor {name!r}")
        return self._classes[name]

    def validate(self, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``params`` for compressor ``name``; return them with defaults filled."""
        table = self.params(name)
        unknown = sorted(set(params) - set(table))
        if unknown:
            allowed = ", ".join(table) or "none"
            raise CompressorError(
                f"compressor {name!r} has no parameter {unknown[0]!r}; its parameters are: "
                f"{allowed}"
            )
        out = {k: p.default for k, p in table.items()}
        for key, value in params.items():
            out[key] = table[key].check(name, key, value)
        return out

    def create(self, name: str, **params: Any) -> Compressor:
        return self.get(name)(**params)


REGISTRY = Registry()
register = REGISTRY.register


def create(name: str, **params: Any) -> Compressor:
    """Create a registered compressor, e.g. ``create("powersgd", rank=4)``.

    Raises:
        CompressorError: unknown name or bad parameter; the message lists what is allowed.
    """
    return REGISTRY.create(name, **params)


def names() -> list[str]:
    """Names of the registered compressors, in registration order."""
    return REGISTRY.names()


# ---------------------------------------------------------------------- the built-in methods
# Declared in the order users see them. Each module's class reads its table back with
# ``params = REGISTRY.params(name)``; a tuning hint for each is in its class's docstring.

# The switch every error-feedback method has, shared so that it reads the same on each.
ERROR_FEEDBACK = Param(bool, True, doc="add back what the last step dropped")

REGISTRY.declare("none", "autotune.compressors.none", {})
REGISTRY.declare("fp16", "autotune.compressors.cast", {})
REGISTRY.declare("bf16", "autotune.compressors.cast", {})
REGISTRY.declare("powersgd", "autotune.compressors.powersgd", {
    "rank": Param(int, 1, low=1, high=1024, doc="rank of the approximation"),
    "error_feedback": ERROR_FEEDBACK,
    "warm_start": Param(bool, True, doc="reuse last step's Q instead of a random one"),
    "min_compression_rate": Param(
        float, 2.0, low=1.0, high=1e6,
        doc="compress a matrix only if this many times fewer values travel",
    ),
    "seed": Param(int, 0, low=0, high=2**31 - 1, doc="seed of the initial Q (same on all ranks)"),
})
REGISTRY.declare("topk", "autotune.compressors.topk", {
    "ratio": Param(float, 0.01, low=0.0, high=1.0, low_open=True, doc="fraction of elements sent"),
    "error_feedback": ERROR_FEEDBACK,
})
REGISTRY.declare("int8", "autotune.compressors.int8", {
    "block": Param(int, 1024, low=8, high=2**24, doc="elements sharing one scale"),
    "seed": Param(int, 0, low=0, high=2**31 - 1, doc="seed of the rounding noise (offset by rank)"),
})
REGISTRY.declare("sign", "autotune.compressors.sign", {"error_feedback": ERROR_FEEDBACK})
REGISTRY.declare("rowsparse", "autotune.compressors.rowsparse", {
    # the keys of rowsparse's dtype table
    "values": Param(str, "fp32", choices=("fp32", "fp16", "bf16"),
                    doc="precision of the rows sent: fp32 is exact"),
})

# DDP's own exact allreduce: a policy's default, what the search and the report call
# uncompressed (``PLAIN.name`` is also its label)
PLAIN = CompressorSpec("none")
