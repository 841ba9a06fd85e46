"""The step-time simulator: a timeline of one data-parallel training step on one rank.

Ranks are symmetric, so one rank's timeline is the job's. The step is::

    forward | backward ----------------------------| optimizer
              buckets become ready as their last gradient is ready (DDP's order)
              channel: [encode|collectives|decode] bucket 0, then bucket 1, ...

* Backward: the profile's gradient-ready times; DDP's bucket assignment for the policy's
  ``bucket_cap_mb`` (:mod:`autotune.models.buckets`). A bucket is handed over when its
  last gradient is ready and all earlier buckets have been (DDP launches in order).
* Channel: one per rank. autotune's runtime runs a compressed bucket's encode, its
  collectives and its decode on one communication thread in bucket order; DDP's plain
  allreduce shares the same link. So bucket work is serial: a bucket starts when it is
  ready and the previous bucket has finished.
* Contention: encode/decode runs on the CPU next to the backward pass. With
  ``contention`` = 1 (CPU ranks, one core each) codec work that overlaps backward delays
  it one for one; with 0 (a GPU's separate stream) it does not.
* Hierarchical policies (``topology: "hierarchical"``, :class:`Layout` given): every
  bucket goes through three stages: summed onto the host's leader over the intra-host
  link (``ceil(log2(ranks per host))`` hops of the whole bucket) on a first channel,
  then on a second one the groups' collectives among the leaders (world = hosts) and
  the leader's broadcast back (as many hops), so the next bucket's sum overlaps this
  one's exchange, as the runtime pipelines them. The leader's timeline is the job's
  (the other ranks wait for it).
* The step ends when backward and the channel are both done, plus the optimizer and
  whatever else the compute-only step held (zero_grad, data): ``floor - backward``.

All times in seconds. The simulator knows nothing of scikit-learn: it takes callables
for collective and codec times, so the same timeline runs on fitted models, on a
paper's assumptions, or in tests on hand-made numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from autotune.compressors import REGISTRY, Compressor, CompressorSpec
from autotune.compressors.base import AllreduceCompressor
from autotune.models.buckets import ParamInfo, ddp_buckets

__all__ = [
    "ParamTiming",
    "ComputeTimes",
    "WhatIf",
    "Message",
    "GroupPlan",
    "BucketEvent",
    "StepEstimate",
    "simulate",
    "group_messages",
    "Layout",
]

CommTime = Callable[[str, int, int], float]  # (collective, payload bytes, world) -> s
# (spec, shape, world, row density or None) -> s
CodecTime = Callable[[CompressorSpec, tuple[int, ...], int, float | None], float]


@dataclass(frozen=True)
class ParamTiming:
    """A trainable parameter as the timeline sees it."""

    name: str
    shape: tuple[int, ...]
    ready_s: float  # gradient ready, seconds after backward starts
    element_size: int = 4
    dtype: str = "float32"
    # fraction of rows (first dimension) holding a non-zero gradient on the busiest rank,
    # as the codec probe measured it; None: not measured (taken as dense). Data-dependent
    # methods (rowsparse) size their messages by it.
    density: float | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ComputeTimes:
    """One rank's compute in a step, without communication."""

    params: tuple[ParamTiming, ...]  # any order; sorted by ready time when used
    forward_s: float
    backward_s: float
    optimizer_s: float
    floor_s: float  # the measured compute-only step (>= forward + backward + optimizer)
    contention: float = 1.0  # share of codec work that delays backward (CPU: 1, GPU: ~0)

    def scaled(self, speed: float) -> ComputeTimes:
        """The same model on hardware ``speed`` times faster."""
        return ComputeTimes(
            params=tuple(ParamTiming(p.name, p.shape, p.ready_s / speed, p.element_size, p.dtype,
                                     p.density) for p in self.params),
            forward_s=self.forward_s / speed, backward_s=self.backward_s / speed,
            optimizer_s=self.optimizer_s / speed, floor_s=self.floor_s / speed,
            contention=self.contention,
        )


@dataclass(frozen=True)
class WhatIf:
    """Overrides of the measured cluster (None: as measured)."""

    world_size: int | None = None
    bandwidth_bps: float | None = None  # link rate, bits per second
    latency_s: float | None = None  # per-hop latency
    compute_speed: float = 1.0  # compute (and codec) this many times faster
    hosts: int | None = None  # hosts the ranks spread over (None: ranks per host as measured)
    intra_bandwidth_bps: float | None = None  # intra-host link rate (None: as measured)

    @property
    def same_machines(self) -> bool:
        """Whether only the inter-host link differs from the measured cluster: the same
        ranks on the same hosts and CPUs, whose own costs still hold."""
        return (self.world_size is None and self.compute_speed == 1.0 and self.hosts is None
                and self.intra_bandwidth_bps is None)


@dataclass(frozen=True)
class Layout:
    """Hosts and ranks per host, and the intra-host link a hierarchical step uses."""

    hosts: int
    local: int  # ranks per host
    intra_time: Callable[[int], float]  # seconds of one intra-host hop of n bytes

    @property
    def hierarchical(self) -> bool:
        """Whether a hierarchical exchange differs from a flat one here."""
        return self.hosts > 1 and self.local > 1

    @property
    def hops(self) -> int:
        return max(1, (self.local - 1).bit_length())


@dataclass(frozen=True)
class Message:
    collective: str
    nbytes: int


@dataclass(frozen=True)
class GroupPlan:
    """Parameters of one bucket sharing a compressor: one reduction."""

    spec: CompressorSpec
    params: tuple[ParamTiming, ...]
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class BucketEvent:
    """What one bucket did on the timeline (seconds from the start of backward)."""

    index: int
    params: int
    numel: int
    ready_s: float
    start_s: float
    end_s: float
    codec_s: float
    comm_s: float
    wire_bytes: int
    collectives: int
    spans: tuple[tuple[str, str, float, float], ...] = ()  # (track, label, start, end)
    threaded: bool = False  # reduced on the communication thread (not DDP's allreduce)
    half_bytes: int = 0
    intra_bytes: int = 0  # moved by the intra-host stages of a hierarchical bucket


@dataclass(frozen=True)
class StepEstimate:
    """Predicted step time and where it goes."""

    step_s: float
    compute_s: float  # the compute-only floor (at the what-if compute speed)
    forward_s: float
    backward_s: float  # backward wall, slowed by codec contention
    optimizer_s: float
    codec_s: float  # encode+decode on this rank
    comm_s: float  # collectives on the channel
    exposed_comm_s: float  # channel time after backward ended
    wire_bytes: int
    collectives: int
    world_size: int
    buckets: tuple[BucketEvent, ...] = field(default=())
    simulated_s: float = 0.0  # the timeline's step before any learned correction
    threaded_buckets: int = 0  # buckets reduced on the communication thread
    threaded_collectives: int = 0  # collectives that thread issued
    half_bytes: int = 0  # bytes reduced as 2-byte floats (summed on the CPU by gloo)
    intra_bytes: int = 0  # bytes through hierarchical buckets' intra-host sum and share

    def breakdown(self) -> dict[str, float]:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "codec_s": self.codec_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s}


def group_messages(
    spec: CompressorSpec, shapes: Sequence[tuple[int, ...]], world: int,
    densities: Sequence[float | None] | None = None,
) -> list[Message]:
    """The collectives one group issues, with their payload sizes, as the compressor
    declares them (:meth:`~autotune.compressors.Compressor.group_messages`): the group's
    tensors travel together, one collective per stage, as the runtime sends them.
    ``densities`` (per shape, None: dense) size data-dependent methods' messages.
    """
    return [Message(kind, nbytes)
            for kind, nbytes in _compressor(spec).group_messages(shapes, world, densities)]


@functools.lru_cache(maxsize=256)
def _compressor(spec: CompressorSpec) -> Compressor:
    """One instance per spec, only asked for sizes (no state is touched)."""
    return REGISTRY.create(spec.name, **spec.kwargs)


def plan_buckets(
    compute: ComputeTimes, layers: Mapping[str, CompressorSpec], default: CompressorSpec,
    bucket_cap_mb: float | None, world: int,
) -> list[tuple[list[ParamTiming], list[GroupPlan]]]:
    """DDP's buckets for the policy, each with its per-compressor groups."""
    ordered = sorted(compute.params, key=lambda p: p.ready_s)
    infos = [ParamInfo(p.name, p.numel, p.element_size, p.dtype) for p in ordered]
    out = []
    for indices in ddp_buckets(infos, bucket_cap_mb):
        members = [ordered[i] for i in indices]
        groups: dict[CompressorSpec, list[ParamTiming]] = {}
        for p in members:
            spec = layers.get(p.name, default).canonical()
            groups.setdefault(spec, []).append(p)
        plans = [
            GroupPlan(spec, tuple(ps), tuple(group_messages(spec, [p.shape for p in ps], world,
                                                             [p.density for p in ps])))
            for spec, ps in groups.items()
        ]
        out.append((members, plans))
    return out


def simulate(
    compute: ComputeTimes,
    layers: Mapping[str, CompressorSpec],
    default: CompressorSpec,
    bucket_cap_mb: float | None,
    world_size: int,
    comm_time: CommTime,
    codec_time: CodecTime,
    layout: Layout | None = None,
) -> StepEstimate:
    """Simulate one step under a policy.

    Args:
        compute: the rank's compute times (already at the what-if speed).
        layers / default / bucket_cap_mb: the policy (None cap: DDP's default buckets).
        world_size: ranks in the job.
        comm_time: seconds of one collective.
        codec_time: encode+decode seconds of one tensor under a compressor, given its
            measured row density (None: not measured), which data-dependent methods read.
        layout: given for a hierarchical policy: the hosts, ranks per host and intra-host
            link its three stages run on (flat when it has one host or one rank per host).
    """
    hier = layout if layout is not None and layout.hierarchical else None
    exchange_world = hier.hosts if hier is not None else world_size
    buckets = plan_buckets(compute, layers, default, bucket_cap_mb, exchange_world)
    backward = compute.backward_s
    # Codec work that overlaps backward slows it, which moves the ready times, which
    # moves the codec work: iterate to a fixed point (a few rounds converge).
    for _ in range(4):
        stretch = backward / compute.backward_s if compute.backward_s > 0 else 1.0
        events = _channel(buckets, stretch, comm_time, codec_time, exchange_world, hier)
        overlap = sum(_overlap(s, e, 0.0, backward) for ev in events
                      for track, _, s, e in ev.spans if track == "codec")
        new_backward = compute.backward_s + compute.contention * overlap
        if abs(new_backward - backward) < 1e-9:
            break
        backward = new_backward
    channel_end = max((ev.end_s for ev in events), default=0.0)
    exposed = max(0.0, channel_end - backward)
    other = max(0.0, compute.floor_s - compute.backward_s)  # forward, optimizer, the rest
    step = other + backward + exposed
    return StepEstimate(
        step_s=step, compute_s=compute.floor_s, forward_s=compute.forward_s,
        backward_s=backward, optimizer_s=compute.optimizer_s,
        codec_s=sum(ev.codec_s for ev in events), comm_s=sum(ev.comm_s for ev in events),
        exposed_comm_s=exposed, wire_bytes=sum(ev.wire_bytes for ev in events),
        collectives=sum(ev.collectives for ev in events), world_size=world_size,
        buckets=tuple(events), simulated_s=step,
        threaded_buckets=sum(1 for ev in events if ev.threaded),
        threaded_collectives=sum(ev.collectives for ev in events if ev.threaded),
        half_bytes=sum(ev.half_bytes for ev in events),
        intra_bytes=sum(ev.intra_bytes for ev in events),
    )


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _channel(
    buckets: list[tuple[list[ParamTiming], list[GroupPlan]]], stretch: float,
    comm_time: CommTime, codec_time: CodecTime, world: int, hier: Layout | None = None,
) -> list[BucketEvent]:
    events: list[BucketEvent] = []
    free = 0.0  # the channel (hierarchical: the second one, the exchange and the share)
    free_first = 0.0  # hierarchical: the first channel, the intra-host sums
    for index, (members, groups) in enumerate(buckets):
        ready = max(p.ready_s for p in members) * stretch
        t = start = max(ready, free if hier is None else free_first)
        spans: list[tuple[str, str, float, float]] = []
        codec_total = comm_total = 0.0
        wire = calls = half = 0
        numel = sum(p.numel for p in members)
        direct = hier is None and len(groups) == 1 and isinstance(
            _compressor(groups[0].spec), AllreduceCompressor)
        bucket_bytes = sum(p.numel * p.element_size for p in members)
        if hier is not None:  # summed onto the leader inside the host
            dt = hier.hops * hier.intra_time(bucket_bytes)
            spans.append(("comm", f"intra reduce {bucket_bytes / 1e6:.2f} MB", t, t + dt))
            t += dt
            comm_total += dt
            calls += 1
            # the next bucket's sum may start now; this one's exchange waits for the
            # second channel (the runtime's pipeline, runtime/hook.py)
            free_first, t = t, max(t, free)
        if direct and not _compressor(groups[0].spec).lossy:  # DDP's own allreduce of the bucket
            nbytes = sum(p.numel * p.element_size for p in members)
            dt = comm_time("allreduce", nbytes, world)
            spans.append(("comm", f"allreduce {nbytes / 1e6:.2f} MB", t, t + dt))
            t += dt
            comm_total, wire, calls = dt, nbytes, 1
        else:
            for g in groups:
                codec = sum(codec_time(g.spec, p.shape, world, p.density) for p in g.params)
                label = g.spec.label()
                # half before the collectives (encode), half after (decode)
                spans.append(("codec", f"encode {label}", t, t + codec / 2))
                t += codec / 2
                if _compressor(g.spec).half_precision:
                    half += sum(m.nbytes for m in g.messages)
                for m in g.messages:
                    dt = comm_time(m.collective, m.nbytes, world)
                    spans.append(("comm", f"{m.collective} {label} {m.nbytes / 1e6:.3f} MB", t, t + dt))
                    t += dt
                    comm_total += dt
                    wire += m.nbytes
                    calls += 1
                spans.append(("codec", f"decode {label}", t, t + codec / 2))
                t += codec / 2
                codec_total += codec
        if hier is not None:  # the leader's broadcast of the result inside the host
            dt = hier.hops * hier.intra_time(bucket_bytes)
            spans.append(("comm", f"intra share {bucket_bytes / 1e6:.2f} MB", t, t + dt))
            t += dt
            comm_total += dt
            calls += 1
        threaded = not direct  # fp16/bf16 buckets go the stock hooks' way, not the thread
        intra = 2 * hier.hops * bucket_bytes if hier is not None else 0
        events.append(BucketEvent(index, len(members), numel, ready, start, t, codec_total,
                                  comm_total, wire, calls, tuple(spans), threaded, half, intra))
        free = t
    return events
