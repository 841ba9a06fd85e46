"""The one DDP communication hook and its state.

DDP allows one hook per model, so a single dispatcher applies the whole policy: for each
bucket it groups the parameters by compressor (policy keys are parameter names, which
survive DDP's bucket rebuild) and reduces each group with one collective per stage.

* Buckets whose parameters all use one stateless single-allreduce method (``none``,
  ``fp16``, ``bf16``: :class:`~autotune.compressors.base.AllreduceCompressor`) are
  encoded in the hook and go straight to an async allreduce on DDP's own process group,
  decoded when it completes, exactly as DDP's default hook and PyTorch's
  ``fp16_compress_hook`` do: the policy that does nothing costs nothing, and fp16 costs
  what the stock hook costs.
* Other buckets are handed to the rank's :class:`~autotune.runtime.channel.Channel`,
  which runs them in bucket order on a process group of its own (see channel.py for why).
* Every bucket's time is broken down (:attr:`BucketRecord.breakdown`, see
  :data:`PHASES`): per step and bucket in :meth:`AutotuneState.last_step_records`,
  summed over a step in :meth:`AutotuneState.step_breakdown`, and since construction in
  :attr:`AutotuneState.breakdown_totals`.
* Policies with ``topology: "hierarchical"`` reduce every bucket in three stages (see
  topology.py): summed onto each host's leader on the channel, then, on a second
  channel, exchanged between the leaders with the bucket's compressors and broadcast
  inside each host; so one bucket's intra-host sum overlaps the previous one's
  exchange on the slow link. Their process groups are made when such a policy is first
  set (on every rank, between steps).
* Nothing is compressed before step ``compress_from_step`` (default 2): DDP rebuilds its
  buckets after the first iteration, so the first two steps are exactly DDP's. Compressor
  state is keyed by parameter name, not bucket, so compressing from step 0 is sound too:
  measurement does, so that its untimed warm-up steps cost a compressed step each, not a
  plain one (on a 100 Mbit link, a cnn's plain step takes 16 times its PowerSGD step).
* The **guard**: before compressing a bucket, the ranks agree, in one 8-byte allreduce
  (issued by the hook on a third group and awaited by the thread, so it overlaps the
  compression of earlier buckets), whether any of them holds a non-finite value in it
  or has joined (``DDP.join()`` with uneven inputs, where a joined rank shadows the
  others' buckets with zeros). Direct buckets need no guard: a NaN or a joined rank's
  zeros pass through their allreduce as through DDP's, and they keep no state. If so, every rank averages that bucket by plain allreduce instead: a NaN or Inf reaches
  every rank exactly as under DDP (so a ``GradScaler`` or the user's own check sees it
  and skips the step everywhere), a joined rank contributes exactly zero, and no
  compressor state (error feedback, PowerSGD's Q, int8's counters) is touched.
  A compressor that changes no state before it calls ``comm.admit()``
  (``encodes_before_guard``: PowerSGD) encodes while the agreement is on its way, and a
  bucket of it alone issues none: the two flags ride on its first allreduce, so neither
  a pass over the bucket in the backward pass nor a collective of their own is paid
  (see :class:`_Gate`).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from autotune.compressors import Compressor, CompressorSpec, GroupComm, create
from autotune.compressors.base import AllreduceCompressor
from autotune.compressors.comm import GuardFallback
from autotune.errors import AutotuneError, RankFailure
from autotune.runtime.channel import Channel
from autotune.runtime.topology import Hierarchy

if TYPE_CHECKING:
    from autotune.policies import Policy

__all__ = ["AutotuneState", "BucketRecord", "PHASES", "dispatch_hook", "STATE_VERSION"]

# Where a bucket's time goes, in the order it is spent (seconds; keys of
# BucketRecord.breakdown, only those a bucket spent time in):
PHASES = (
    "wait",  # the communication path idle before the bucket was handed over: backward
    # compute since forward ended (first bucket of a step) or since the previous
    # bucket finished, whichever is later
    "guard",  # the hook's finiteness check and issuing the guard's allreduce
    "queue",  # handed over, waiting behind earlier buckets for the communication thread
    # (hierarchical buckets: also between their intra-host sum and their exchange)
    "guard_wait",  # the thread waiting for the guard's agreement
    "intra_reduce",  # hierarchical buckets: summing the bucket onto the host's leader
    "flatten",  # copies into the compressor's working layout (views cost nothing)
    "encode",  # compressor work before and between its collectives
    "allreduce",  # in allreduce collectives (direct buckets: issue to completion,
    # including waiting behind earlier buckets on DDP's group)
    "allgather",  # in all_gather collectives
    "decode",  # compressor work after its last collective
    "copy_back",  # copies of the result into the gradient bucket
    "intra_share",  # hierarchical buckets: the leader's broadcast of the result inside
    # the host (on the other ranks, this includes waiting for the leaders' exchange)
)

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 2 adds the rank and world size (error feedback is per rank)

# Hierarchical buckets of one elementwise method move in chunks of this many bytes, so
# that a chunk's intra-host sum overlaps the previous chunk's exchange. Each chunk costs
# its collectives' latency (about a millisecond on gloo), so larger chunks suit links
# with high latency, smaller ones fast links with large buckets.
CHUNK_BYTES = 4 * 2**20


@dataclass
class BucketRecord:
    """What one bucket's reduction did in one step."""

    step: int
    index: int  # DDP's bucket index (0 holds the last layers)
    numel: int  # gradient elements in the bucket
    compressed: bool  # False for the direct allreduce path
    bytes_by_collective: dict[str, int] = field(default_factory=dict)
    bytes_by_compressor: dict[str, int] = field(default_factory=dict)  # by spec label
    start: float = 0.0  # perf_counter at hook entry
    seconds: float = 0.0  # hook entry to completion
    comm_s: float = 0.0  # of which in collectives (compressed buckets; see Comm.seconds)
    job_s: float = 0.0  # of which the communication thread worked on it (codec + comm)
    guard_s: float = 0.0  # the guard's work in the hook (finiteness check, issuing its allreduce)
    guard_wait_s: float = 0.0  # the thread's wait for the guard's result (mostly for the slowest rank)
    # why a bucket the policy compresses went by plain allreduce: "nonfinite" (a rank
    # had a NaN/Inf in it), "joined" (a rank had joined), or "" (it was compressed)
    fallback: str = ""
    # seconds by phase (see PHASES); they add up to `wait` + `seconds`, up to the
    # interpreter's own time between phases
    breakdown: dict[str, float] = field(default_factory=dict)
    # each collective the bucket issued, in order: (kind, bytes, seconds)
    collectives: list[tuple[str, int, float]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_collective.values())


@dataclass(frozen=True)
class _Group:
    compressor: Compressor
    label: str
    names: tuple[str, ...]
    slices: tuple[tuple[int, int, torch.Size], ...]  # (offset, numel, shape) in the bucket


@dataclass(frozen=True)
class _Plan:
    groups: tuple[_Group, ...]
    # one group whose compressor is an AllreduceCompressor: encoded in the hook, async
    # allreduce on DDP's group, decoded on completion (no guard, no thread)
    direct: AllreduceCompressor | None


def _group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    pg = group if group is not None else dist.group.WORLD
    try:
        # the backend serving this group's tensors: NCCL's lives under "cuda"
        device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
        backend = pg._get_backend(device)  # type: ignore[union-attr]
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


class AutotuneState:
    """State of the dispatcher hook: the policy, per-compressor state and statistics.

    Args:
        policy: the policy to apply; swap it between steps with :meth:`set_policy`.
        module: the wrapped model, whose parameter names key the policy.
        process_group: DDP's process group (default: the world).
        compress_from_step: first step that may compress (>= 0; 2 by default, after
            DDP's bucket rebuild, so that the first two steps are DDP's own).
        guard: agree across ranks, before compressing each bucket, whether a rank has a
            non-finite gradient in it or has joined, and average it by plain allreduce
            if so (see the module docstring). Costs one 8-byte allreduce per compressed
            bucket; switch it off only for jobs that never see a NaN or Inf gradient and
            never use ``join()``, or error feedback may be poisoned.
    """

    def __init__(
        self,
        policy: Policy,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        compress_from_step: int = 2,
        guard: bool = True,
        native: bool = False,
    ) -> None:
        if isinstance(compress_from_step, bool) or not isinstance(compress_from_step, int) \
                or compress_from_step < 0:
            raise AutotuneError(
                f"compress_from_step must be an int >= 0, got {compress_from_step!r}")
        # hyperparameters
        self.policy = policy
        self.compress_from_step = compress_from_step
        self.guard = guard  # fixed at construction: its process group is made here
        # no hook registered (a plain policy run as DDP's own allreduce): steps are
        # counted at each training forward, and the policy cannot change
        self.native = native

        # internal state
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.compressors: dict[CompressorSpec, Compressor] = {}
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self.step = 0  # advances when the last bucket of a backward pass is handed over
        self._carry: dict[str, torch.Tensor] = {}  # residuals owed after a policy switch
        self._comm: GroupComm | None = None  # on a group of its own, made on first use
        self.joined = False  # this rank has joined and shadows the others (set by wrap's join hook)
        self._side_group = self._make_side_group(process_group)
        # The guard's agreements are issued from the hook, in bucket order, as soon as a
        # bucket is ready, on a group of their own (the channel owns the side group), so
        # they run in the background while earlier buckets are still being compressed.
        self._guard_group = self._make_side_group(process_group) if guard else None
        self._channel = Channel(name=f"autotune-comm-{self.rank}")
        _OPEN.add(self)
        self._exact = create("none")  # before compress_from_step, and the guard's fallback
        # hosts and their groups, for hierarchical policies: made when one is first set
        self._hierarchy: Hierarchy | None = None
        self._hierarchy_built = False
        self._leader_comm: GroupComm | None = None
        self._channel2: Channel | None = None  # hierarchical buckets' later stages
        self._prepare_topology(policy)

        # statistics
        self._lock = threading.Lock()
        self._records: dict[int, list[BucketRecord]] = {}  # this step's and the last one's
        self.bytes_by_compressor: Counter[str] = Counter()  # since construction
        self.nonfinite_steps = 0  # steps where some rank had a NaN/Inf in a compressed bucket
        self.nonfinite_buckets = 0  # such buckets, over all steps
        self._nonfinite_step = -1  # the last such step (one warning per step)
        # called with every finished BucketRecord (from the thread that finished it)
        self.listeners: list[Callable[[BucketRecord], None]] = []
        self.breakdown_totals: Counter[str] = Counter()  # seconds by phase, all buckets so far
        self.breakdown_buckets = 0  # buckets those totals cover
        # (step, when) the communication path last became free: the end of the forward
        # pass or the latest finished bucket of that step (for BucketRecord "wait")
        self._free: tuple[int, float] = (-1, 0.0)

    @staticmethod
    def _make_side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        # Collective on all ranks, like DDP's construction; same timeout as DDP's group.
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return dist.new_group(ranks=ranks, timeout=_group_timeout(group))

    # ----------------------------------------------------------------- policy
    def set_policy(self, policy: Policy) -> None:
        """Apply ``policy`` from the next bucket on; call between steps only.

        Error-feedback rule (**carry**), the same on every rank: a parameter whose
        compressor changes hands what its old compressor's error feedback still owed to
        its next gradient, which then goes out under the new compressor, so no
        compensation is lost; its other per-parameter state (PowerSGD's warm-start Q,
        int8's counter) is dropped. Parameters whose compressor stays keep all state.

        Raises:
            AutotuneError: the model was wrapped natively (no hook) and ``policy`` is not
                plain averaging.
        """
        if self.native and not policy.is_plain:
            raise AutotuneError("this model was wrapped as plain DDP without autotune's hook "
                                "(native=True), so it cannot switch to a compressing policy; "
                                "wrap it with native=False")
        for name in self._names.values():
            old = self.policy.spec_for(name).canonical()
            if old == policy.spec_for(name).canonical():
                continue
            comp = self.compressors.get(old)
            owed = comp.release(name) if comp is not None else None
            if owed is not None:
                self._carry[name] = owed + self._carry.pop(name, 0)
        self._prepare_topology(policy)
        self.policy = policy
        self._plans.clear()
        in_use = {s.canonical() for s in policy.compressors()}
        self.compressors = {s: c for s, c in self.compressors.items() if s in in_use}

    @property
    def owes(self) -> bool:
        """Whether a policy switch's error feedback is still to be paid (see
        :meth:`set_policy`): the hook pays it with the parameters' next gradients."""
        return bool(self._carry)

    def _prepare_topology(self, policy: Policy) -> None:
        """Make the hierarchy's process groups the first time a hierarchical policy is set
        (collective: every rank sets the same policy at the same step)."""
        if policy.topology != "hierarchical" or self._hierarchy_built:
            return
        pg = self.process_group if self.process_group is not None else dist.group.WORLD
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(pg) == "nccl" else torch.device("cpu"))
        self._hierarchy = Hierarchy.build(self.process_group, _group_timeout(self.process_group),
                                          device)
        self._hierarchy_built = True
        if self._hierarchy is None:
            logger.info("topology 'hierarchical' runs flat here: one host, or one rank per host")
        else:
            logger.info("hierarchical exchange: %d hosts, %d ranks on this one (leader: rank %d)",
                        self._hierarchy.hosts, self._hierarchy.local_size, self._hierarchy.leader)

    @property
    def hierarchy(self) -> Hierarchy | None:
        """The hierarchy the policy in force reduces over (None: flat)."""
        return self._hierarchy if self.policy.topology == "hierarchical" else None

    def compressor(self, spec: CompressorSpec) -> Compressor:
        canonical = spec.canonical()
        comp = self.compressors.get(canonical)
        if comp is None:
            comp = create(canonical.name, **canonical.kwargs)
            self.compressors[canonical] = comp
        return comp

    def _plan(self, bucket: dist.GradBucket) -> _Plan:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        by_spec: dict[CompressorSpec, list[tuple[str, int, int, torch.Size]]] = {}
        offset = 0
        for p in params:
            name = self._names.get(id(p))
            if name is None:
                raise AutotuneError("DDP handed the hook a parameter the wrapped model lacks")
            spec = self.policy.spec_for(name).canonical()
            by_spec.setdefault(spec, []).append((name, offset, p.numel(), p.shape))
            offset += p.numel()
        groups = tuple(
            _Group(
                compressor=self.compressor(spec),
                label=spec.label(),
                names=tuple(m[0] for m in members),
                slices=tuple((m[1], m[2], m[3]) for m in members),
            )
            for spec, members in by_spec.items()
        )
        only = groups[0].compressor if len(groups) == 1 else None
        direct = isinstance(only, AllreduceCompressor) and self.hierarchy is None
        plan = _Plan(groups=groups, direct=only if direct else None)  # type: ignore[arg-type]
        self._plans[key] = plan
        return plan

    # ------------------------------------------------------------------- hook
    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        step = self.step
        if bucket.is_last():
            self.step += 1
        buffer = bucket.buffer()
        # A joined rank's buffer is DDP's zeros, shadowing the others: it contributes
        # exactly zero, so what a policy switch still owes waits for a real gradient.
        joined = self.joined
        plan = self._plan(bucket)
        paid = self._pay_carry(plan, buffer) if self._carry and not joined else {}
        free_step, free_at = self._free
        wait = max(0.0, start - free_at) if free_step == step else 0.0
        if step < self.compress_from_step:
            return self._direct(self._exact, buffer, bucket.index(), step, start, wait, "none")
        if plan.direct is not None:
            return self._direct(plan.direct, buffer, bucket.index(), step, start, wait,
                                plan.groups[0].label)
        record = BucketRecord(step, bucket.index(), buffer.numel(), True, start=start)
        record.breakdown["wait"] = wait
        agreement = None
        # one compressor that takes the guard's flags along (encodes_before_guard): they
        # ride on its first allreduce, decided there on every rank alike
        rides = (self._guard_group is not None and len(plan.groups) == 1
                 and plan.groups[0].compressor.encodes_before_guard and self.hierarchy is None)
        if self._guard_group is not None and any(g.compressor.guarded for g in plan.groups) \
                and not rides:
            agreement = self._start_agreement(buffer, joined)
            record.guard_s = record.breakdown["guard"] = time.perf_counter() - start
        handed = time.perf_counter()
        if self.hierarchy is not None:
            return self._submit_hierarchical(plan, buffer, self.hierarchy, record, agreement,
                                             paid, handed)
        log: list[tuple[str, float, float, int]] = []

        def job() -> torch.Tensor:
            comm = self._get_comm()
            began = time.perf_counter()
            record.breakdown["queue"] = began - handed
            # Awaited late where the first compressor encodes before it (see
            # Compressor.encodes_before_guard) and the agreement is still on its way:
            # then the encoding overlaps it, and the ranks' skew it waits out.
            late = (agreement is not None and plan.groups[0].compressor.encodes_before_guard
                    and not agreement[0].is_completed())
            fallback = agreement is not None and not late and self._agree_fallback(*agreement, record)
            worked = time.perf_counter()
            comm.log = log
            if late or rides:
                comm.gate = _Gate(self, record, log, agreement, joined)
            try:
                if fallback:
                    self._reduce_exact(buffer, paid, comm, record)
                else:
                    try:
                        self._reduce_groups(plan, buffer, comm, log, record)
                    except GuardFallback:
                        self._reduce_exact(buffer, paid, comm, record)
            finally:
                comm.log = None
                comm.gate = None
            end = time.perf_counter()
            _account(record, log, worked, end)
            record.job_s = end - began
            self._finish(record)
            return buffer

        return self._channel.submit(job, buffer.device)

    def _reduce_exact(self, buffer: torch.Tensor, paid: dict[str, torch.Tensor], comm: GroupComm,
                      record: BucketRecord) -> None:
        """The guard's fallback: the bucket averaged by plain allreduce over every rank."""
        if record.fallback == "nonfinite":  # the step will be skipped: still owed
            self._carry.update(paid)
        self._exact.reduce([buffer], ("bucket",), comm)
        record.bytes_by_compressor["none"] = buffer.numel() * buffer.element_size()

    def _submit_hierarchical(
        self, plan: _Plan, buffer: torch.Tensor, hierarchy: Hierarchy, record: BucketRecord,
        agreement: tuple[Any, torch.Tensor, torch.Tensor] | None, paid: dict[str, torch.Tensor],
        handed: float,
    ) -> torch.futures.Future[torch.Tensor]:
        """A hierarchical bucket as a two-stage pipeline (topology.py's three stages): the
        channel sums it onto the host's leader; a second channel runs the leaders'
        exchange and the leader's broadcast. So the slow link is not idle while the fast
        one sums the next bucket. Every group is used by one thread only, in bucket order
        (intra: the first channel; leaders and share: the second), which keeps gloo's
        collectives matched on every rank.

        A bucket of one elementwise method (``none``, ``fp16``, ``bf16``) moves in chunks
        of :data:`CHUNK_BYTES`, so even its own sum and exchange overlap: only the first
        chunk's sum and the last one's broadcast are exposed. Other methods need whole
        tensors (PowerSGD's matrices, row-sparse rows) and go as one piece."""
        numel = buffer.numel()
        elementwise = len(plan.groups) == 1 and isinstance(plan.groups[0].compressor, AllreduceCompressor)
        size = max(1, CHUNK_BYTES // buffer.element_size()) if elementwise else numel
        spans = [(a, min(a + size, numel)) for a in range(0, numel, size)]
        log: list[tuple[str, float, float, int]] = []  # appended by both threads
        times: dict[str, float] = {}
        summed: dict[int, float] = {}  # chunk start -> when its sum was done

        def first_stage(a: int, b: int) -> Callable[[], torch.Tensor]:
            def job() -> torch.Tensor:
                if a == 0:
                    times["began"] = time.perf_counter()
                    record.breakdown["queue"] = times["began"] - handed
                    fallback = agreement is not None and self._agree_fallback(*agreement, record)
                    times["worked"] = time.perf_counter()
                    if fallback:  # over every rank, flat; the later stages only finish it
                        comm = self._get_comm()
                        comm.log = log
                        try:
                            self._reduce_exact(buffer, paid, comm, record)
                        finally:
                            comm.log = None
                if not record.fallback:
                    start = time.perf_counter()
                    dist.reduce(buffer[a:b], dst=hierarchy.leader, group=hierarchy.intra)
                    summed[a] = end = time.perf_counter()
                    log.append(("intra_reduce", start, end, (b - a) * buffer.element_size()))
                return buffer
            return job

        def second_stage(a: int, b: int, first: torch.futures.Future[torch.Tensor],
                         last: bool) -> Callable[[], torch.Tensor]:
            def job() -> torch.Tensor:
                try:
                    first.wait()
                except Exception:  # the first stage failed: its error, not a copy of it
                    raise self._channel.failure or RankFailure(
                        "the first stage of a hierarchical reduction failed") from None
                if not record.fallback:
                    self._exchange(plan, buffer, (a, b) if elementwise else None, hierarchy,
                                   log, record, summed[a])
                if not last:
                    return buffer
                end = time.perf_counter()
                _account(record, log, times["worked"], end)
                record.job_s = end - times["began"]
                self._finish(record)
                return buffer
            return job

        second = self._second_channel()
        for i, (a, b) in enumerate(spans):
            first = self._channel.submit(first_stage(a, b), buffer.device)
            done = second.submit(second_stage(a, b, first, i == len(spans) - 1), buffer.device)
        # the second channel runs in order: the last piece done means every piece done
        return done

    @staticmethod
    def _reduce_groups(plan: _Plan, buffer: torch.Tensor, comm: GroupComm,
                       log: list[tuple[str, float, float, int]], record: BucketRecord) -> None:
        """Average the bucket across ``comm``'s ranks, each group with its compressor."""
        for group in plan.groups:
            if not group.compressor.encodes_before_guard:
                comm.admit()  # the guard's agreement first, if still pending
            before = len(log)
            tensors = [buffer[o : o + n].view(shape) for o, n, shape in group.slices]
            group.compressor.reduce(tensors, group.names, comm)
            _count_sent(record, group.label, log[before:])

    def _exchange(self, plan: _Plan, buffer: torch.Tensor, span: tuple[int, int] | None,
                  hierarchy: Hierarchy, log: list[tuple[str, float, float, int]],
                  record: BucketRecord, summed: float) -> None:
        """The later stages of a hierarchical bucket (or of its chunk ``span``), once
        its host's sum is on the leader: the leaders' exchange with the bucket's
        compressors, then the leader's broadcast inside the host."""
        start = time.perf_counter()
        log.append(("queue", summed, start, 0))  # behind earlier pieces' exchange
        piece = buffer if span is None else buffer[span[0]:span[1]]
        if hierarchy.is_leader:
            if self._leader_comm is None:
                self._leader_comm = GroupComm(hierarchy.leaders)
            comm = self._leader_comm
            comm.log = log
            try:
                piece.mul_(hierarchy.scale)  # the leaders' average is then every rank's mean
                if span is None:
                    self._reduce_groups(plan, buffer, comm, log, record)
                else:  # one elementwise method: the chunk as one tensor
                    group = plan.groups[0]
                    before = len(log)
                    group.compressor.reduce([piece], ("bucket",), comm)
                    _count_sent(record, group.label, log[before:])
            finally:
                comm.log = None
        start = time.perf_counter()
        dist.broadcast(piece, src=hierarchy.leader, group=hierarchy.share)
        log.append(("intra_share", start, time.perf_counter(), piece.numel() * piece.element_size()))

    def _second_channel(self) -> Channel:
        if self._channel2 is None:
            self._channel2 = Channel(name=f"autotune-hier-{self.rank}")
        return self._channel2

    def _direct(
        self, comp: AllreduceCompressor, buffer: torch.Tensor, index: int, step: int,
        start: float, wait: float, label: str,
    ) -> torch.futures.Future[torch.Tensor]:
        """The stock hooks' path: encode here, async allreduce on DDP's group, decode in
        its completion callback."""
        record = BucketRecord(step, index, buffer.numel(), False, start=start)
        record.breakdown["wait"] = wait
        payload = comp.encode(buffer, self.world_size)
        nbytes = payload.numel() * payload.element_size()
        record.bytes_by_collective["allreduce"] = nbytes
        record.bytes_by_compressor[label] = nbytes
        issued = time.perf_counter()
        record.breakdown["encode"] = issued - start
        fut = dist.all_reduce(payload, group=self.process_group, async_op=True).get_future()  # type: ignore[union-attr]

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            began = time.perf_counter()
            comp.decode(f.value()[0], buffer)
            record.comm_s = record.breakdown["allreduce"] = began - issued
            record.breakdown["decode"] = time.perf_counter() - began
            record.collectives.append(("allreduce", nbytes, began - issued))
            self._finish(record)
            return buffer

        return fut.then(done)

    def _start_agreement(
        self, buffer: torch.Tensor, joined: bool
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Issue the guard's allreduce of (ranks with a non-finite value in this bucket,
        ranks joined) without waiting for it; on the buffer's device, so a GPU job does
        not synchronise the backward pass here."""
        # One pass, no copy: a sum is non-finite if any element is (or if it overflows
        # fp32, which then costs a harmless plain allreduce).
        bad = ~torch.isfinite(buffer.sum(dtype=torch.float32))
        flags = _guard_flags(bad, joined)
        work = dist.all_reduce(flags, group=self._guard_group, async_op=True)
        return work, flags, bad

    def _agree_fallback(
        self, work: Any, flags: torch.Tensor, bad: torch.Tensor, record: BucketRecord,
        log: list[tuple[str, float, float, int]] | None = None,
    ) -> bool:
        """The guard (see the module docstring), on the communication thread: True on
        every rank if any rank has a non-finite value in this bucket or has joined.
        Its wait goes to the bucket's breakdown, or to ``log`` when awaited in the
        middle of a compressor's work (which the breakdown is then made from)."""
        began = time.perf_counter()
        here = bool(bad)
        work.wait()
        n_bad, n_joined = (int(v) for v in flags.tolist())
        ended = time.perf_counter()
        record.guard_wait_s = ended - began
        if log is None:
            record.breakdown["guard_wait"] = ended - began
        else:
            log.append(("guard_wait", began, ended, 0))
        return self._judge(record, n_bad, n_joined, here)

    def _judge(self, record: BucketRecord, n_bad: int, n_joined: int, here: bool) -> bool:
        """The guard's verdict from the ranks' summed flags (see _agree_fallback)."""
        if n_bad:
            record.fallback = "nonfinite"
            self._report_nonfinite(record, n_bad, here)
        elif n_joined:
            record.fallback = "joined"
        return bool(n_bad or n_joined)

    def _report_nonfinite(self, record: BucketRecord, ranks: int, here: bool) -> None:
        with self._lock:
            self.nonfinite_buckets += 1
            first = record.step != self._nonfinite_step
            if first:
                self._nonfinite_step = record.step
                self.nonfinite_steps += 1
        if first and (self.rank == 0 or here):
            logger.warning(
                "step %d: non-finite gradient on %d of %d ranks%s (first in bucket %d); "
                "buckets holding one are averaged by plain allreduce this step, so every "
                "rank sees it as under DDP, and compressor state is left untouched",
                record.step, ranks, self.world_size,
                f", this rank ({self.rank}) among them" if here else "", record.index,
            )

    def _pay_carry(self, plan: _Plan, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add what a previous compressor's error feedback owed (see set_policy); returns
        what was paid, owed again if the bucket then goes uncompressed."""
        paid = {}
        for group in plan.groups:
            for name, (offset, numel, _) in zip(group.names, group.slices):
                owed = self._carry.pop(name, None)
                if owed is not None:
                    buffer[offset : offset + numel].add_(owed.reshape(-1).to(buffer))
                    paid[name] = owed
        return paid

    def _get_comm(self) -> GroupComm:
        if self._comm is None:
            self._comm = GroupComm(self._side_group)
        return self._comm

    def forward_done(self) -> None:
        """Mark the end of a training forward pass: the first bucket's ``wait`` (the
        backward compute before it) is measured from here. Called by ``wrap``'s model."""
        if self.native:  # no hook counts the backward passes
            self.step += 1
        self._free = (self.step, time.perf_counter())

    def _finish(self, record: BucketRecord) -> None:
        end = time.perf_counter()
        record.seconds = end - record.start
        with self._lock:
            if record.step == self._free[0]:
                self._free = (record.step, max(self._free[1], end))
            self.breakdown_totals.update(record.breakdown)
            self.breakdown_buckets += 1
            steps = self._records.setdefault(record.step, [])
            steps.append(record)
            for old in [s for s in self._records if s < record.step - 1]:
                del self._records[old]
            for label, nbytes in record.bytes_by_compressor.items():
                self.bytes_by_compressor[label] += nbytes
        for listener in self.listeners:
            listener(record)

    def step_breakdown(self) -> dict[str, float]:
        """Seconds by phase (:data:`PHASES`) summed over the buckets of the latest step."""
        out: Counter[str] = Counter()
        for record in self.last_step_records():
            out.update(record.breakdown)
        return {k: out[k] for k in PHASES if k in out}

    def last_step_records(self) -> list[BucketRecord]:
        """The buckets of the latest step, by index. Complete when read between steps:
        DDP waits for every bucket before ``backward()`` returns."""
        with self._lock:
            if not self._records:
                return []
            return sorted(self._records[max(self._records)], key=lambda r: r.index)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Step counter and every compressor's state; tensors, numbers and strings only,
        so ``torch.load(..., weights_only=True)`` reads it back. Error feedback is this
        rank's own: save the state of every rank (e.g. one file per rank)."""
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "policy_id": self.policy.id,
            "rank": self.rank,
            "world_size": self.world_size,
            "compressors": {
                json.dumps(spec.to_dict(), sort_keys=True): comp.state_dict()
                for spec, comp in self.compressors.items()
            },
            "carry": {k: v.detach().clone() for k, v in self._carry.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, saved by this rank of a job of this size.

        Restored under another world size, or on another rank, the error feedback
        (residuals, and what a policy switch still owed) belongs to no rank of this job:
        it is reset, with a warning. What all ranks share (the step counter, PowerSGD's
        Q, int8's counters) is kept, so any rank's saved state may be loaded then.
        """
        if not isinstance(state, Mapping) or state.get("version") not in (1, STATE_VERSION):
            got = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise AutotuneError(
                f"expected an autotune comm state of version {STATE_VERSION}, got {got!r}"
            )
        if state.get("policy_id") != self.policy.id:
            logger.warning(
                "loading comm state saved under policy %s into policy %s; compressors the "
                "new policy does not use are dropped",
                state.get("policy_id"), self.policy.id,
            )
        self.step = int(state["step"])
        self._carry = {k: v.detach().clone() for k, v in state.get("carry", {}).items()}
        self._plans.clear()
        in_use = {s.canonical() for s in self.policy.compressors()}
        for key, comp_state in state.get("compressors", {}).items():
            spec = CompressorSpec.from_dict(json.loads(key)).canonical()
            if spec in in_use:
                self.compressor(spec).load_state_dict(comp_state)
        # version 1 states carry no rank or world size: taken as this job's
        saved = (state.get("rank", self.rank), state.get("world_size", self.world_size))
        if saved != (self.rank, self.world_size):
            dropped = len(self._carry) + sum(c.reset_error_feedback() for c in self.compressors.values())
            self._carry = {}
            logger.warning(
                "comm state saved by rank %s of %s loaded on rank %d of %d: error feedback "
                "is per rank, so it is reset (%d residuals dropped); the step counter and "
                "state shared by all ranks are kept",
                saved[0], saved[1], self.rank, self.world_size, dropped,
            )

    def close(self) -> None:
        """Stop the communication thread and let go of the hook's own process groups
        (the state reduces nothing after this). Run for every open state at interpreter
        exit too: a gloo group whose last reference goes during the interpreter's
        finalization, with its worker threads, can abort the process (seen here as
        "terminate called without an active exception" after a run had finished)."""
        self._channel.close()
        if self._channel2 is not None:
            self._channel2.close()
        self._comm = None
        self._side_group = None  # type: ignore[assignment]
        self._guard_group = None
        _OPEN.discard(self)


# every state not closed yet, closed at exit while the interpreter is whole
_OPEN: weakref.WeakSet[AutotuneState] = weakref.WeakSet()


@atexit.register
def _close_open_states() -> None:
    for state in list(_OPEN):
        try:
            state.close()
        except Exception:  # noqa: BLE001 - at exit, nothing to report to
            pass


_COLLECTIVES = ("allreduce", "allgather")


def _count_sent(record: BucketRecord, label: str, entries: list[tuple[str, float, float, int]]) -> None:
    """Add the bytes that the collectives among ``entries`` (a communicator log's
    tail, where the other stage's thread may also have logged) moved to ``label``'s."""
    sent = sum(nbytes for kind, _, _, nbytes in entries if kind in _COLLECTIVES)
    record.bytes_by_compressor[label] = record.bytes_by_compressor.get(label, 0) + sent


def _guard_flags(bad: torch.Tensor, joined: bool) -> torch.Tensor:
    """A rank's guard flags, summed over ranks by an allreduce and read by
    :meth:`AutotuneState._judge`: (a non-finite value here, this rank has joined)."""
    return torch.stack([bad.to(torch.float32), torch.tensor(float(joined), device=bad.device)])


class _Gate:
    """One bucket's guard, left to its compressor (``Comm.admit``, ``Gate`` in
    compressors/comm.py): the agreement issued in the hook, awaited late; or, without
    one (``agreement`` None), flags that ride on the compressor's first allreduce."""

    def __init__(self, state: AutotuneState, record: BucketRecord,
                 log: list[tuple[str, float, float, int]],
                 agreement: tuple[Any, torch.Tensor, torch.Tensor] | None, joined: bool) -> None:
        self.state, self.record, self.log = state, record, log
        self.agreement, self.joined = agreement, joined
        self.rides = agreement is None
        self.bad: torch.Tensor | None = None

    def flags(self, bad: torch.Tensor) -> torch.Tensor:
        self.bad = bad
        return _guard_flags(bad, self.joined)

    def decide(self, summed: torch.Tensor | None) -> bool:
        if self.agreement is not None:
            return self.state._agree_fallback(*self.agreement, self.record, self.log)
        if summed is None:
            raise AutotuneError("the guard rides on the compressor's allreduce: admit() "
                                "needs the summed flags")
        n_bad, n_joined = (int(v) for v in summed.tolist())
        return self.state._judge(self.record, n_bad, n_joined,
                                 self.bad is not None and bool(self.bad))


def _account(record: BucketRecord, log: list[tuple[str, float, float, int]], began: float,
             end: float) -> None:
    """Fill a channel bucket's breakdown from its communicator log: logged collectives
    and phases as they are; the rest of the job's time is encoding up to the end of the
    last collective and decoding after it."""
    bd = record.breakdown
    last = max((e for kind, _, e, _ in log if kind in _COLLECTIVES), default=end)
    marked_before = marked_after = 0.0
    for kind, s, e, nbytes in log:
        bd[kind] = bd.get(kind, 0.0) + (e - s)
        if kind in _COLLECTIVES:
            record.collectives.append((kind, nbytes, e - s))
            record.bytes_by_collective[kind] = record.bytes_by_collective.get(kind, 0) + nbytes
            record.comm_s += e - s
        if e <= last:
            marked_before += e - s
        else:
            marked_after += e - s
    bd["encode"] = max(0.0, (last - began) - marked_before)
    if end > last:
        bd["decode"] = max(0.0, (end - last) - marked_after)


def dispatch_hook(state, bucket):  # type: ignore[no-untyped-def]
    """The DDP communication hook: ``ddp.register_comm_hook(state, dispatch_hook)``."""
    return state(bucket)


# DDP compares the hook's annotations with the real classes; postponed (string)
# annotations would fail that check, so they are set here as objects.
dispatch_hook.__annotations__ = {
    "state": AutotuneState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
