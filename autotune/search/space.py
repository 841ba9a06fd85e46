"""The search space: bucket size, and a compressor per group of similar parameters.

A flat categorical per tensor does not scale to models with hundreds of tensors (TPE
would see hundreds of independent dimensions). Parameters are grouped instead by what
decides how they should travel: whether their gradients are row-sparse (most rows zero
on the busiest rank, as the codec probe measured: embedding tables, which rowsparse
sends exactly at a fraction of the bytes), whether they are matrices (PowerSGD needs
one) and their size (log-scale bins). The study searches the bucket size and one choice per group
jointly; :mod:`autotune.search.tuner` then refines the best policy layer by layer.

The compression error of a policy comes from the codec probe's measurements on real
gradients: each parameter's relative error under its compressor (cumulative over the
captured steps, where error feedback pays back what a step dropped), combined over the
whole gradient, weighted by the parameters' gradient norms::

    error(policy) = sqrt( sum_l (e_l * |g_l|)^2 ) / sqrt( sum_l |g_l|^2 )

i.e. the relative error of the whole model's gradient if layers err independently,
unless a layer is *starved*: its own error above :data:`~autotune.search.defaults.
STARVED_LAYER_ERROR` (0.85). Then the policy's error is its worst layer's. The weighted
sum alone lets layers of small gradient norm go almost unsent: top-k 0.1% on the
transformer's 16 block matrices (30% of the gradient's energy, each at error 0.94-0.98)
scored 0.53, inside the default budget, and the model never learned (next-token accuracy
0.45 against plain DDP's 1.00 in 300 steps, bench/convergence.py), while PowerSGD rank 4,
at 0.74 overall with no layer above 0.80, lost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from autotune.compressors import PLAIN, REGISTRY, Compressor, CompressorSpec
from autotune.errors import ProfileError
from autotune.models.cost_model import row_densities
from autotune.policies import Policy
from autotune.presets import BUCKET_CAPS_MB
from autotune.probes.codecs import ROW_SPARSE_BELOW
from autotune.probes.profile import Profile
from autotune.probes.sampling import CHOICES, SMALL
from autotune.search.defaults import STARVED_LAYER_ERROR

__all__ = ["Group", "SearchSpace", "ErrorModel", "TOPOLOGY", "label_of"]

TOPOLOGY = "topology"
"""The key of a choice (beside the groups' keys) holding the policy's topology."""

# Element-count bin edges of the size groups (besides matrix / not matrix).
SIZE_EDGES = (SMALL, 262_144, 1_048_576, 4_194_304)


def label_of(spec: Mapping[str, Any] | CompressorSpec) -> str:
    s = spec if isinstance(spec, CompressorSpec) else CompressorSpec.from_dict(spec)
    return s.canonical().label()


@dataclass(frozen=True)
class Group:
    """Parameters searched together, and the compressors they may use."""

    key: str  # e.g. "matrix:262144-1048576"
    params: tuple[str, ...]
    numel: int
    options: tuple[str, ...]  # labels, from SearchSpace.specs


@dataclass
class SearchSpace:
    """Groups of parameters, the compressor options of each, and bucket caps."""

    params: dict[str, tuple[int, ...]]  # name -> shape, in the profile's order
    groups: list[Group]
    specs: dict[str, CompressorSpec]  # label -> spec of every option
    caps: tuple[float, ...] = BUCKET_CAPS_MB
    pinned: dict[str, CompressorSpec] = field(default_factory=dict)  # fixed by the user
    # topologies searched: hierarchical only where the cluster has hosts of several ranks
    topologies: tuple[str, ...] = ("flat",)
    _group_of: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_profile(
        cls, profile: Profile, choices: Sequence[Mapping[str, Any]] = CHOICES,
        caps: Sequence[float] = BUCKET_CAPS_MB, pinned: Mapping[str, Any] | None = None,
    ) -> SearchSpace:
        """Groups from the profiled parameters; options limited to measured compressors.

        Data-dependent compressors (rowsparse) are options of the row-sparse groups only,
        at any size: a dense gradient gains nothing from them, a sparse table of any
        size may. Profiles without measured gradient structure have no such groups.

        ``pinned`` maps parameter names to compressor specs (dicts or CompressorSpec)
        that the search must not change."""
        measured = {label_of(s.spec) for s in profile.codecs.shapes}
        specs = {label_of(c): CompressorSpec.from_dict(c).canonical() for c in choices}
        specs = {k: v for k, v in specs.items() if k in measured or k == PLAIN.name}
        params = profile.compute.shapes
        densities = row_densities(profile)
        members: dict[str, list[str]] = {}
        for name, shape in params.items():
            sparse = densities.get(name, 1.0) < ROW_SPARSE_BELOW
            members.setdefault(_group_key(shape, sparse), []).append(name)
        groups = []
        for key, names in members.items():
            kind = key.split(":", 1)[0]
            matrix, sparse = kind.endswith("matrix"), kind.startswith("sparse")
            small = key.endswith(f":0-{SMALL}")
            options = tuple(label for label, spec in specs.items()
                            if _offered(REGISTRY.get(spec.name), matrix, sparse, small))
            groups.append(Group(key, tuple(names), sum(math.prod(params[n]) for n in names), options))
        groups.sort(key=lambda g: -g.numel)
        fixed = {}
        for name, spec in (pinned or {}).items():
            if name not in params:
                raise ProfileError(f"pinned parameter {name!r} is not in the profiled model")
            fixed[name] = (spec if isinstance(spec, CompressorSpec) else CompressorSpec.from_dict(spec)).canonical()
        space = cls(params=params, groups=groups, specs=specs, caps=tuple(caps), pinned=fixed)
        space._group_of = {n: g.key for g in groups for n in g.params}
        return space

    def group_of(self, name: str) -> Group:
        key = self._group_of[name]
        return next(g for g in self.groups if g.key == key)

    def policy(self, cap: float, choice: Mapping[str, str], layers: Mapping[str, str] | None = None,
               meta: Mapping[str, Any] | None = None) -> Policy:
        """A policy from a cap, a label per group, and optional per-layer overrides;
        pinned parameters keep their pinned compressor whatever the choice."""
        per_layer: dict[str, dict[str, Any]] = {}
        for g in self.groups:
            for name in g.params:
                if name in self.pinned:
                    spec = self.pinned[name]
                    if spec != PLAIN:
                        per_layer[name] = spec.to_dict()
                    continue
                label = (layers or {}).get(name, choice[g.key])
                if label != PLAIN.name:
                    per_layer[name] = self.specs[label].to_dict()
        topology = {TOPOLOGY: choice[TOPOLOGY]} if choice.get(TOPOLOGY, "flat") != "flat" else {}
        return Policy.from_dict({"version": 1, "bucket_cap_mb": cap, "layers": per_layer,
                                 "meta": dict(meta or {}), **topology})

    def choice_of(self, policy: Policy) -> dict[str, str]:
        """The group choice closest to ``policy``: each group's most used option (by
        elements), for seeding a study with an existing policy."""
        out = {}
        for g in self.groups:
            weight: dict[str, int] = {}
            for name in g.params:
                label = label_of(policy.spec_for(name))
                if label in g.options:
                    weight[label] = weight.get(label, 0) + math.prod(self.params[name])
            out[g.key] = max(weight, key=weight.__getitem__) if weight else PLAIN.name
        if len(self.topologies) > 1:
            out[TOPOLOGY] = policy.topology
        return out

    def uniform_choice(self, label: str) -> dict[str, str]:
        """Each group's choice for "``label`` everywhere it applies, else none"."""
        return {g.key: (label if label in g.options else PLAIN.name) for g in self.groups}


def _offered(method: type[Compressor], matrix: bool, sparse: bool, small: bool) -> bool:
    """Whether a group of parameters may use ``method``: data-dependent methods on
    row-sparse groups only (a dense gradient gains nothing from them), at any size;
    elementwise ones on any group, others not on small tensors (compression cannot
    gain there, the elementwise methods cost nearly nothing); matrix methods on matrix
    groups only."""
    if method.density_dependent:
        return sparse
    return (method.elementwise or not small) and (matrix or not method.needs_matrix)


def _group_key(shape: tuple[int, ...], sparse: bool = False) -> str:
    """E.g. ``matrix:262144-1048576``; row-sparse parameters' kinds are ``sparse-matrix``
    and ``sparse-vector``."""
    n = math.prod(shape)
    kind = "matrix" if len(shape) >= 2 else "vector"
    if sparse:
        kind = f"sparse-{kind}"
    lo = 0
    for edge in SIZE_EDGES:
        if n < edge:
            return f"{kind}:{lo}-{edge}"
        lo = edge
    return f"{kind}:{lo}-"


class ErrorModel:
    """Compression error of a policy, from the codec probe's per-parameter errors."""

    def __init__(self, profile: Profile, metric: str = "cum_error") -> None:
        self.metric = metric
        self.errors: dict[tuple[str, str], float] = {}
        for e in profile.codecs.errors:
            error = getattr(e, metric)  # "cum_error" or "rel_error"; not measured: per step
            self.errors[(label_of(e.spec), e.param)] = float(e.rel_error if error is None
                                                             else error)
        norms = profile.codecs.grad_norms
        params = profile.compute.params
        # without norms, weight by size (a gradient's norm grows like sqrt(numel))
        self.weights = {p.name: float(norms.get(p.name, math.sqrt(math.prod(p.shape))))
                        for p in params}
        total = sum(w * w for w in self.weights.values())
        self._total = total if total > 0 else 1.0

    def layer_error(self, label: str, name: str) -> float:
        if label == PLAIN.name:
            return 0.0
        try:
            return self.errors[(label, name)]
        except KeyError:
            raise ProfileError(
                f"the profile has no measured error for {label} on {name}; "
                "re-run `autotune profile` with that compressor in the codec grid"
            ) from None

    def of(self, policy: Policy) -> float:
        """The policy's error (0 = exact): the gradient-weighted one, or its worst
        layer's where that layer is starved (its error above :data:`STARVED_LAYER_ERROR`)."""
        acc, starved = 0.0, 0.0
        for name, w in self.weights.items():
            spec = policy.spec_for(name)
            e = self.layer_error(label_of(spec), name)
            acc += (e * w) ** 2
            if e > STARVED_LAYER_ERROR:
                starved = max(starved, e)
        return max(math.sqrt(acc / self._total), starved)
