"""Random policies: for cost-model calibration and benchmarks, and as search seeds.

A random policy picks a bucket size and a few compressors, then gives each parameter one
of them; small tensors (where compression cannot gain) mostly stay uncompressed, as a
person writing a policy would do.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from autotune.compressors import PLAIN
from autotune.policies import Policy
from autotune.presets import BUCKET_CAPS_MB
from autotune.probes.codecs import DEFAULT_GRID

__all__ = ["CHOICES", "SAMPLED_CAPS_MB", "random_policy"]

# What is searched is what the codec probe measures: one list, kept there.
CHOICES: tuple[Mapping[str, Any], ...] = DEFAULT_GRID
# The bucket caps random policies draw from: the searched grid but 2 and 100 MB, as they
# have always drawn, so that a profile's calibration policies stay the ones it had.
SAMPLED_CAPS_MB = tuple(cap for cap in BUCKET_CAPS_MB if cap not in (2.0, 100.0))
SMALL = 16_384  # elements: below this, compression has nothing to gain


def random_policy(
    params: Sequence[tuple[str, int]], rng: random.Random, max_compressors: int = 3
) -> Policy:
    """A random mixed policy for parameters given as (name, numel)."""
    chosen = rng.sample(CHOICES, k=rng.randint(1, max_compressors))
    layers: dict[str, dict[str, Any]] = {}
    for name, numel in params:
        spec = chosen[rng.randrange(len(chosen))]
        if numel < SMALL and rng.random() < 0.8:
            spec = PLAIN.to_dict()
        if spec["compressor"] != PLAIN.name:
            layers[name] = dict(spec)
    return Policy.from_dict({
        "version": 1, "bucket_cap_mb": rng.choice(SAMPLED_CAPS_MB), "layers": layers,
        "meta": {"source": "random", "compressors": [Policy.from_dict(
            {"version": 1, "default": c}).default.label() for c in chosen]},
    })
