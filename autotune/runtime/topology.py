"""Where the ranks sit: hosts, and the process groups of a hierarchical exchange.

A hierarchical bucket is reduced in three stages (Horovod's hierarchical allreduce, with
a compressor on the middle one): the ranks of each host sum it onto the host's first
rank, its *leader* (uncompressed: intra-host links are fast); the leaders average the
host sums across hosts with the bucket's compressors, on a group of their own (the only
traffic on the slow link, and one rank per host sends it); each leader broadcasts the
result to its host. For ``none`` that equals a flat allreduce up to the order of the
float sums. Error feedback is the leaders' (of their host's sum); the other ranks'
compressors stay idle.

Hosts are told by ``GROUP_RANK`` (torchrun's node rank, which autotune's launcher and
emulated cluster set too), else the hostname, gathered from every rank.
"""

from __future__ import annotations

import datetime
import os
import socket
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotune.compressors.comm import all_gather_flat

__all__ = ["Hierarchy", "host_ids"]


def host_ids(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> list[int]:
    """Host index (0, 1, ... in order of first appearance) of every rank of ``group``,
    by group rank. Collective: every rank of the group calls it."""
    node = os.environ.get("GROUP_RANK")
    ident = int(node) if node is not None else zlib.crc32(socket.gethostname().encode())
    device = device or torch.device("cpu")
    mine = torch.tensor([ident], dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_flat(out, mine, group=group)
    raw = out.tolist()
    index = {h: i for i, h in enumerate(dict.fromkeys(raw))}
    return [index[h] for h in raw]


@dataclass(frozen=True)
class Hierarchy:
    """This rank's place in a hierarchical exchange, and its process groups.

    Attributes:
        hosts: hosts the job spans.
        local_size: ranks on this rank's host.
        leader: global rank of this host's leader (its first rank).
        is_leader: this rank is its host's leader.
        intra: the group of this host's ranks (the sums onto the leader).
        share: another group of this host's ranks (the leader's broadcasts), so that the
            two stages may run on two threads.
        leaders: the group of every host's leader (None on the other ranks).
        scale: what a leader multiplies its host's sum by before the exchange, so that
            the leaders' average is the mean over every rank: hosts / world size.
    """

    hosts: int
    local_size: int
    leader: int
    is_leader: bool
    intra: dist.ProcessGroup
    share: dist.ProcessGroup
    leaders: dist.ProcessGroup | None
    scale: float

    @classmethod
    def build(cls, group: dist.ProcessGroup | None, timeout: datetime.timedelta,
              device: torch.device | None = None) -> Hierarchy | None:
        """The hierarchy of ``group``'s ranks, its process groups made (collective: every
        rank of ``group`` calls it, at the same point); None when it would be flat (one
        host, or one rank per host)."""
        ids = host_ids(group, device)
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        by_host: dict[int, list[int]] = {}
        for host, rank in zip(ids, ranks):
            by_host.setdefault(host, []).append(rank)
        if len(by_host) < 2 or all(len(r) == 1 for r in by_host.values()):
            return None
        me = dist.get_rank()
        # every rank makes every group, in the same order, as new_group requires
        intra = {h: dist.new_group(ranks=r, timeout=timeout) for h, r in by_host.items()}
        share = {h: dist.new_group(ranks=r, timeout=timeout) for h, r in by_host.items()}
        leader_ranks = [r[0] for r in by_host.values()]
        leaders = dist.new_group(ranks=leader_ranks, timeout=timeout)
        mine = ids[ranks.index(me)]
        return cls(hosts=len(by_host), local_size=len(by_host[mine]), leader=by_host[mine][0],
                   is_leader=me == by_host[mine][0], intra=intra[mine], share=share[mine],
                   leaders=leaders if me in leader_ranks else None,
                   scale=len(by_host) / len(ranks))
