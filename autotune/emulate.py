"""Emulated cluster: a network namespace per host, a bridge between them, NICs shaped by tc.

Each emulated host is a Linux network namespace with one NIC, ``eth0``, whose other end
is a port of a bridge that lives in a "switch" namespace of its own, so the root
namespace is never touched. Every host's NIC is shaped with ``tbf`` in both directions
(egress of ``eth0`` is the host's upload, egress of the bridge port towards the host is
its download), which gives each host a full-duplex link of the requested rate, as a real
NIC behind a non-blocking switch has. Ranks placed on a host run under
``ip netns exec <host>``; ranks on the same host reach each other over that host's
loopback, unshaped, as they would on a real machine.

Typical use, with the local launcher::

    with EmulatedCluster(hosts=2, link="1gbit") as cluster:
        results = launch("mypkg.mod:fn", placement=cluster)
        cluster.set_link("100mbit", host=1)  # takes effect at once, even mid-job

Creating namespaces needs root and iproute2; :func:`available` says whether this
process can, and why not. Link delay needs the ``netem`` qdisc, which not every kernel
offers; asking for a delay where it is missing raises :class:`ClusterError`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any, Callable, Sequence, Union

from autotune.errors import ClusterError
from autotune.launch import RankSpec
from autotune.links import Link, LinkLike, as_link

__all__ = [
    "EmulatedCluster",
    "available",
    "cleanup_stale",
    "measure_tcp_rate",
]

logger = logging.getLogger(__name__)

# Name of every host's NIC inside its namespace; ranks bind gloo to it.
NIC = "eth0"
# Hosts get 10.213.0.<i+1>; the subnet exists only inside the cluster's namespaces,
# so concurrent clusters may all use it without colliding.
SUBNET_PREFIX = "10.213.0."
MAX_HOSTS = 250
# Seconds of queue tbf may hold before dropping. TCP only needs about a bandwidth-delay
# product of queue (microseconds here); a few ms absorbs veth's bursts at 5 Gbit without
# drops while keeping queueing delay small for the latency probes.
QUEUE_S = 0.010
# tbf's bucket: room for a few 64 KB GSO super-packets and at least ~1 ms of traffic (so
# the hrtimer that refills it keeps up at high rates). With a 64 KB bucket tbf must split
# every full super-packet, and a 2-rank gloo allreduce over 500 Mbit NICs reached only
# 70-85% of the rate; 100-256 KB gave 94-96%. Larger buckets let more of the start of
# every message through unshaped (192 KB is 15 ms at 100 Mbit).
MIN_BURST_BYTES = 192 * 1024
BURST_S = 0.001


# --------------------------------------------------------------------------- commands


class _Runner:
    """Runs iproute2 commands; remembers the one in flight so a signal handler can wait."""

    def __init__(self) -> None:
        self.inflight: subprocess.Popen[str] | None = None

    def __call__(self, *cmd: str, timeout: float = 30.0) -> str:
        logger.debug("running %s", " ".join(cmd))
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        except OSError as exc:
            raise ClusterError(f"cannot run {' '.join(cmd)!r}: {exc}") from exc
        self.inflight = proc
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.communicate()
            raise ClusterError(f"{' '.join(cmd)!r} did not finish in {timeout:g} s") from exc
        finally:
            self.inflight = None
        if proc.returncode != 0:
            raise ClusterError(
                f"{' '.join(cmd)!r} failed with status {proc.returncode}: {err.strip()}"
            )
        return out

    def wait_inflight(self, timeout: float = 10.0) -> None:
        proc = self.inflight
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()


_run = _Runner()


def _list_namespaces() -> list[str]:
    # Lines read "name" or "name (id: 3)".
    out = _run("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """Delete the named namespaces; returns the ones that could not be deleted."""
    failed = []
    for name in names:
        try:
            _run("ip", "netns", "delete", name)
        except ClusterError as exc:
            # Already gone (a concurrent cleanup won the race) is success.
            if name in _list_namespaces():
                logger.warning("could not delete namespace %s: %s", name, exc)
                failed.append(name)
    return failed


def cleanup_stale(prefix: str) -> list[str]:
    """Remove every network namespace whose name starts with ``prefix``.

    Use it after a process that held a cluster was killed outright (SIGKILL), which
    leaves its namespaces behind. Removing a namespace removes the interfaces in it.

    Args:
        prefix: the cluster's ``name_prefix``; must be non-empty, so that this never
            removes every namespace on the machine.

    Returns:
        The names of the namespaces removed.

    Raises:
        ClusterError: ``prefix`` is empty, or a namespace could not be removed.
    """
    if not prefix:
        raise ClusterError("cleanup_stale needs a non-empty prefix")
    names = [n for n in _list_namespaces() if n.startswith(prefix)]
    failed = _delete_namespaces(names)
    if failed:
        raise ClusterError(f"could not remove namespaces {failed}")
    return names


# -------------------------------------------------------------------------- probes

_probe_lock = threading.Lock()
_available: tuple[bool, str] | None = None
_netem: bool | None = None


def _scratch_name() -> str:
    return f"atprobe{os.getpid()}{secrets.token_hex(2)}"


def available() -> tuple[bool, str]:
    """Whether this process can build an emulated cluster, and if not, why.

    The first call builds a scratch namespace with a shaped veth pair and removes it;
    the answer is cached.

    Returns:
        ``(True, "")`` or ``(False, reason)``.
    """
    global _available
    with _probe_lock:
        if _available is None:
            _available = _probe()
        return _available


def _probe() -> tuple[bool, str]:
    if sys.platform != "linux":
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, (f"needs root to create network namespaces (this process runs as uid "
                       f"{os.geteuid()}); run as root, or without --hosts/--link on local ranks")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"needs iproute2 ({' and '.join(missing)} not found on PATH)"
    name = _scratch_name()
    try:
        _run("ip", "netns", "add", name)
    except ClusterError as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        _run("ip", "-n", name, "link", "add", "name", "va", "type", "veth",
             "peer", "name", "vb")
        _run("tc", "-n", name, "qdisc", "add", "dev", "va", "root",
             *_tbf_args(Link(1e9)))
        _run("ip", "netns", "exec", name, "true")
    except ClusterError as exc:
        return False, f"cannot build a shaped link in a namespace: {exc}"
    finally:
        _delete_namespaces([name])
    return True, ""


def _netem_available() -> bool:
    """Whether the kernel offers netem; probed once in a scratch namespace."""
    global _netem
    with _probe_lock:
        if _netem is None:
            name = _scratch_name()
            _run("ip", "netns", "add", name)
            try:
                _run("tc", "-n", name, "qdisc", "add", "dev", "lo", "root",
                     "netem", "delay", "1ms")
                _netem = True
            except ClusterError as exc:
                logger.debug("netem probe failed: %s", exc)
                _netem = False
            finally:
                _delete_namespaces([name])
        return _netem


def _tbf_args(link: Link) -> list[str]:
    rate_Bps = link.rate_bps / 8
    burst = int(max(MIN_BURST_BYTES, rate_Bps * BURST_S))
    limit = int(burst + rate_Bps * QUEUE_S)
    return ["handle", "1:", "tbf", "rate", f"{link.rate_bps:.0f}bit",
            "burst", str(burst), "limit", str(limit)]


# ------------------------------------------------------------------------- cluster

_counter = itertools.count()
_Handler = Union[Callable[[int, Union[FrameType, None]], Any], int, None]


class EmulatedCluster:
    """``hosts`` emulated machines joined by a switch, each NIC shaped to ``link``.

    Use it as a context manager: entering builds the namespaces, leaving (normally, by
    an exception, or by SIGINT/SIGTERM to this process) removes everything it built.
    It is a :class:`autotune.launch.Placement`: pass it to
    :func:`autotune.launch.launch` as ``placement=``.

    Args:
        hosts: number of emulated hosts (1 to 250).
        link: every host's NIC, e.g. ``"1gbit"`` or a :class:`Link`; rate applies to
            each direction separately (full duplex).
        nproc_per_node: ranks per host; rank ``r`` runs on host ``r // nproc_per_node``.
        name_prefix: prefix of the namespace names (host ``i`` is ``<prefix>h<i>``, the
            switch ``<prefix>sw``); by default one unique to this process and cluster.
            Pass it to :func:`cleanup_stale` to remove what a killed process left.

    Raises:
        ClusterError: bad arguments; on enter, when namespaces cannot be built here.
    """

    def __init__(
        self,
        hosts: int,
        link: LinkLike,
        nproc_per_node: int = 1,
        name_prefix: str | None = None,
    ) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ClusterError(f"hosts must be an int in [1, {MAX_HOSTS}], got {hosts!r}")
        if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ClusterError(f"nproc_per_node must be an int >= 1, got {nproc_per_node!r}")
        if name_prefix is None:
            # pid + counter + random: unique across processes, clusters and pid reuse.
            name_prefix = f"at{os.getpid()}{next(_counter)}{secrets.token_hex(2)}"
        # Host names append "h<i>" and the switch "sw"; a namespace name is a file name.
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", name_prefix):
            raise ClusterError(
                f"name_prefix must be 1-40 letters, digits, '_', '.' or '-', "
                f"got {name_prefix!r}"
            )
        self.hosts = hosts
        self.nproc_per_node = nproc_per_node
        self.name_prefix = name_prefix
        self.master_addr = self.host_address(0)  # Placement protocol
        self._links: list[Link] = [as_link(link)] * hosts
        self._active = False
        self._cleaning = False
        self._old_handlers: dict[int, _Handler] = {}

    # ------------------------------------------------------------------ naming

    @property
    def switch_namespace(self) -> str:
        """Name of the namespace that holds the bridge."""
        return f"{self.name_prefix}sw"

    def host_namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        self._check_host(i)
        return f"{self.name_prefix}h{i}"

    def host_address(self, i: int) -> str:
        """IPv4 address of host ``i``'s NIC."""
        self._check_host(i)
        return f"{SUBNET_PREFIX}{i + 1}"

    @property
    def links(self) -> tuple[Link, ...]:
        """Each host's current link."""
        return tuple(self._links)

    @property
    def world_size(self) -> int:
        """Number of ranks: ``hosts * nproc_per_node``."""
        return self.hosts * self.nproc_per_node

    def _check_host(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self.hosts:
            raise ClusterError(f"host must be an int in [0, {self.hosts}), got {i!r}")

    def _port(self, i: int) -> str:
        return f"p{i}"  # bridge port towards host i, in the switch namespace

    # --------------------------------------------------------------- placement

    def ranks(self) -> Sequence[RankSpec]:
        """One :class:`RankSpec` per rank, for :func:`autotune.launch.launch`."""
        return [
            RankSpec(
                host=r // self.nproc_per_node,
                local_rank=r % self.nproc_per_node,
                prefix=("ip", "netns", "exec", self.host_namespace(r // self.nproc_per_node)),
                # Without it gloo binds to the hostname's address (127.0.0.1 here) and
                # peers on other hosts cannot reach it.
                env={"GLOO_SOCKET_IFNAME": NIC},
            )
            for r in range(self.world_size)
        ]

    def free_port(self) -> int:
        """A TCP port free on host 0, for ``MASTER_PORT``.

        The caller's own namespace does not have host 0's address, so a port cannot be
        chosen by binding to it there.
        """
        self._check_active()
        out = _run(
            "ip", "netns", "exec", self.host_namespace(0), sys.executable, "-c",
            "import socket; s = socket.socket(); "
            f"s.bind(({self.master_addr!r}, 0)); print(s.getsockname()[1])",
        )
        return int(out.strip())

    # ------------------------------------------------------------------ shaping

    def set_link(self, link: LinkLike, host: int | None = None) -> None:
        """Change one host's link, or every host's, at once; a running job sees it.

        Args:
            link: the new link, e.g. ``"100mbit"`` or a :class:`Link`.
            host: the host to change; ``None`` for every host.

        Raises:
            ClusterError: a bad link, a delay without netem, or a tc failure.
        """
        self._check_active()
        new = as_link(link)
        targets = range(self.hosts) if host is None else [host]
        for i in targets:
            self._check_host(i)
        if new.delay_s:
            self._require_netem()
        for i in targets:
            self._shape(i, new)

    def _require_netem(self) -> None:
        if not _netem_available():
            raise ClusterError("link delay needs the netem qdisc, which this kernel does not offer")

    def _shape(self, i: int, link: Link) -> None:
        old = self._links[i] if self._active else None
        sides = ((self.host_namespace(i), NIC), (self.switch_namespace, self._port(i)))
        for ns, dev in sides:
            # replace changes tbf in place (no packets dropped) when one is there.
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *_tbf_args(link))
            if link.delay_s:
                # Half on each side: host-to-host one-way delay = delay_s.
                _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:1",
                     "handle", "10:", "netem", "delay", f"{link.delay_s / 2 * 1e6:.0f}us",
                     "limit", "100000")
            elif old is not None and old.delay_s:
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "parent", "1:1")
        self._links[i] = link
        logger.debug("host %d link set to %s", i, link)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> EmulatedCluster:
        if self._active:
            raise ClusterError(f"cluster {self.name_prefix} is already entered")
        ok, why = available()
        if not ok:
            raise ClusterError(f"cannot build an emulated cluster here: {why}")
        if any(link.delay_s for link in self._links):
            self._require_netem()
        self._install_handlers()
        atexit.register(self.cleanup)
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise
        self._active = True
        logger.info(
            "emulated cluster %s: %d hosts x %d ranks, links %s",
            self.name_prefix, self.hosts, self.nproc_per_node, self._links[0],
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def _build(self) -> None:
        sw = self.switch_namespace
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "name", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.host_namespace(i)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Created from inside the switch namespace with the peer placed straight
            # into the host's: no interface ever appears in the root namespace.
            _run("ip", "-n", sw, "link", "add", "name", self._port(i), "type", "veth",
                 "peer", "name", NIC, "netns", ns)
            _run("ip", "-n", sw, "link", "set", self._port(i), "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.host_address(i)}/24", "dev", NIC)
            _run("ip", "-n", ns, "link", "set", NIC, "up")
            self._shape(i, self._links[i])

    def cleanup(self) -> None:
        """Remove every namespace (and so every interface) of this cluster.

        Idempotent; safe to call from a signal handler, at exit, or after ranks were
        killed. Namespaces are found by name, so a half-built cluster is removed too.
        """
        if self._cleaning:
            return
        self._cleaning = True
        try:
            # A signal may land while an ip command is creating something: let it finish
            # first, or what it creates would outlive the cleanup.
            _run.wait_inflight()
            prefix = self.name_prefix
            names = [n for n in _list_namespaces()
                     if n == self.switch_namespace
                     or (n.startswith(prefix + "h") and n[len(prefix) + 1:].isdigit())]
            failed = _delete_namespaces(names)
            if failed:
                raise ClusterError(f"could not remove namespaces {failed}")
            if names:
                logger.info("removed emulated cluster %s", prefix)
        finally:
            self._active = False
            self._cleaning = False
            self._restore_handlers()
            atexit.unregister(self.cleanup)

    def _check_active(self) -> None:
        if not self._active:
            raise ClusterError(
                f"cluster {self.name_prefix} is not running; use it in a 'with' block"
            )

    # ------------------------------------------------------------------ signals

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Only the main thread may set handlers; atexit still covers normal exits.
            logger.debug("not in the main thread: no signal handlers for %s", self.name_prefix)
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.getsignal(sig)
            if old == signal.SIG_IGN:
                continue  # the process chose to survive it, so the cluster should too
            self._old_handlers[sig] = old
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            # Leave alone a handler someone installed after ours.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        logger.info("signal %d: removing emulated cluster %s", signum, self.name_prefix)
        try:
            self.cleanup()  # also restores the previous handler
        except ClusterError as exc:
            logger.error("cleanup on signal %d failed: %s", signum, exc)
        if callable(old):
            old(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        elif old == signal.SIG_DFL:
            # Die of the same signal, so the parent sees the usual exit status.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN handlers were never replaced; None (set from C) is treated as ignore.


# ------------------------------------------------------------------- measurement

_RECEIVER = """
import socket, sys, time
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
n = int(sys.argv[2])
buf = bytearray(1 << 20)
view = memoryview(buf)
first = conn.recv_into(view)
t0 = time.perf_counter()
got = first
while got < n:
    k = conn.recv_into(view)
    if k == 0:
        break
    got += k
t1 = time.perf_counter()
print(first, got, t1 - t0, flush=True)
"""

_SENDER = """
import socket, sys
n = int(sys.argv[3])
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = memoryview(bytes(1 << 20))
sent = 0
while sent < n:
    k = min(len(chunk), n - sent)
    sock.sendall(chunk[:k])
    sent += k
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
"""


def measure_tcp_rate(
    cluster: EmulatedCluster, src_host: int, dst_host: int, nbytes: int,
    timeout: float = 120.0,
) -> float:
    """TCP payload rate from one host to another, in bits per second.

    A receiver in ``dst_host``'s namespace times the transfer from its first received
    chunk to its last, so connection setup and the unshaped start that tbf's burst lets
    through are left out. Make ``nbytes`` worth at least a second at the link rate
    (e.g. 12 MB at 100 Mbit) for a figure within a percent or two.

    Args:
        cluster: an entered cluster.
        src_host: the sending host.
        dst_host: the receiving host; the same as ``src_host`` measures its loopback.
        nbytes: payload bytes to send.
        timeout: seconds the transfer may take.

    Returns:
        Payload bits per second.

    Raises:
        ClusterError: the transfer failed or timed out.
    """
    cluster._check_active()
    if nbytes < 2 << 20:
        raise ClusterError(f"nbytes must be at least 2 MiB to time a transfer, got {nbytes}")
    addr = cluster.host_address(dst_host)
    recv = subprocess.Popen(
        ["ip", "netns", "exec", cluster.host_namespace(dst_host), sys.executable, "-c",
         _RECEIVER, addr, str(nbytes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    send: subprocess.Popen[str] | None = None
    try:
        assert recv.stdout is not None
        port_line = recv.stdout.readline().strip()
        if not port_line.isdigit():
            _, err = recv.communicate(timeout=5)
            raise ClusterError(f"TCP receiver on host {dst_host} failed: {err.strip()}")
        send = subprocess.Popen(
            ["ip", "netns", "exec", cluster.host_namespace(src_host), sys.executable, "-c",
             _SENDER, addr, port_line, str(nbytes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + timeout
        out, err = recv.communicate(timeout=timeout)
        _, serr = send.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if recv.returncode != 0 or send.returncode != 0:
            raise ClusterError(
                f"TCP transfer from host {src_host} to host {dst_host} failed: "
                f"{(err + serr).strip()}"
            )
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(
            f"TCP transfer of {nbytes} bytes from host {src_host} to host {dst_host} "
            f"did not finish in {timeout:g} s"
        ) from exc
    finally:
        for proc in (recv, send):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    first, got, elapsed = out.split()
    if int(got) < nbytes:
        raise ClusterError(f"TCP receiver got {got} of {nbytes} bytes")
    return (int(got) - int(first)) * 8 / float(elapsed)
