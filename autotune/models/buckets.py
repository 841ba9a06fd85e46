"""DDP's bucket assignment, reproduced: which parameters share a bucket, in what order.

Rules (torch.distributed's ``compute_bucket_assignment_by_size`` as DDP's reducer uses
it when it rebuilds buckets after the first iteration):

* parameters are taken in the order their gradients became ready in backward;
* a bucket closes as soon as its size reaches its limit (the parameter that crosses
  the limit stays in it); limits are ``[first_cap, cap, cap, ...]``;
* with ``bucket_cap_mb`` left to DDP's default (25 MiB), the first bucket's limit is
  ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), so that the last layers' gradients go
  out early; when the user sets ``bucket_cap_mb``, the first limit equals the cap;
* parameters of different dtypes never share a bucket;
* bucket 0 holds the first-ready gradients (the last layers); DDP hands buckets to the
  communication hook in index order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autotune.policies.policy import DDP_DEFAULT_BUCKET_CAP_MB

__all__ = ["MIB", "DEFAULT_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES", "ParamInfo", "ddp_buckets"]

MIB = 1024 * 1024
DEFAULT_CAP_MB = DDP_DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class ParamInfo:
    """What the bucket assignment needs to know of a parameter."""

    name: str
    numel: int
    element_size: int = 4
    dtype: str = "float32"


def ddp_buckets(
    params_in_ready_order: Sequence[ParamInfo], bucket_cap_mb: float | None
) -> list[list[int]]:
    """Indices (into ``params_in_ready_order``) of each bucket, in DDP's bucket order.

    Args:
        params_in_ready_order: trainable parameters, first-ready first.
        bucket_cap_mb: the cap given to DDP, or None for DDP's default (25 MiB with a
            small first bucket).
    """
    if bucket_cap_mb is None:
        cap = int(DEFAULT_CAP_MB * MIB)
        limits = [DEFAULT_FIRST_BUCKET_BYTES, cap]
    else:
        cap = int(bucket_cap_mb * MIB)
        limits = [cap]
    open_buckets: dict[str, tuple[list[int], int, int]] = {}  # dtype -> (indices, bytes, limit#)
    done: list[list[int]] = []
    for i, p in enumerate(params_in_ready_order):
        indices, size, which = open_buckets.get(p.dtype, ([], 0, 0))
        indices = indices + [i]
        size += p.numel * p.element_size
        if size >= limits[min(which, len(limits) - 1)]:
            done.append(indices)
            open_buckets[p.dtype] = ([], 0, which + 1)
        else:
            open_buckets[p.dtype] = (indices, size, which)
    done.extend(ix for ix, _, _ in open_buckets.values() if ix)
    return done
