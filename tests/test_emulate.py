"""Emulated cluster: building and tearing down namespaces, shaped rates."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

from autotune import emulate
from autotune.emulate import EmulatedCluster, cleanup_stale, measure_tcp_rate
from autotune.errors import ClusterError
from autotune.launch import launch

NEEDS = "needs root and iproute2 to create network namespaces"


@pytest.fixture(scope="module")
def netns() -> None:
    """Skip unless this process can build namespaces (checked once, not at import: the
    launched ranks import this module too)."""
    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"{NEEDS}: {why}")


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    return [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith(prefix)]


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True)
    return sorted(ln.split(":")[1].strip() for ln in out.stdout.splitlines())


def _prefix(tag: str) -> str:
    return f"att{os.getpid()}{tag}"


@pytest.fixture
def no_leak(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique name prefix; fails the test if a namespace with it outlives the test."""
    prefix = _prefix(request.node.name.split("[")[0][-8:].replace("_", ""))
    yield prefix
    left = _namespaces(prefix)
    if left:
        cleanup_stale(prefix)
        pytest.fail(f"namespaces left behind: {left}")


# ------------------------------------------------------------- placement, no root


def test_ranks_place_consecutive_ranks_on_a_host() -> None:
    cluster = EmulatedCluster(2, "1gbit", nproc_per_node=2, name_prefix="xyz")
    specs = cluster.ranks()
    assert [(s.host, s.local_rank) for s in specs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert specs[2].prefix == ("ip", "netns", "exec", "xyzh1")
    assert all(s.env == {"GLOO_SOCKET_IFNAME": "eth0"} for s in specs)
    assert cluster.master_addr == cluster.host_address(0) == "10.213.0.1"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hosts": 0}, "hosts must be"),
        ({"hosts": 2, "nproc_per_node": 0}, "nproc_per_node must be"),
        ({"hosts": 2, "name_prefix": "a/b"}, "name_prefix must be"),
        ({"hosts": 2, "link": "fast"}, "cannot parse link 'fast'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ClusterError, match=match):
        EmulatedCluster(**{"link": "1gbit", **kwargs})


def test_set_link_needs_an_entered_cluster() -> None:
    with pytest.raises(ClusterError, match="not running"):
        EmulatedCluster(2, "1gbit").set_link("100mbit")


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = emulate._probe()
    assert not ok and why.startswith("needs root to create network namespaces (this process runs as uid 1000)")
    monkeypatch.setattr(emulate, "available", lambda: (False, "needs root"))
    with pytest.raises(ClusterError, match="cannot build an emulated cluster here: needs root"):
        with EmulatedCluster(2, "1gbit"):
            pass


def test_cleanup_stale_refuses_an_empty_prefix() -> None:
    with pytest.raises(ClusterError, match="non-empty prefix"):
        cleanup_stale("")


# ------------------------------------------------------------- building, tearing down


def test_build_leaves_root_namespace_alone_and_exit_removes_all(netns: None, no_leak: str) -> None:
    root_before = _root_links()
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with EmulatedCluster(3, "100mbit", name_prefix=no_leak) as cluster:
        assert sorted(_namespaces(no_leak)) == sorted(
            [cluster.switch_namespace] + [cluster.host_namespace(i) for i in range(3)]
        )
        assert _root_links() == root_before
        addr = subprocess.run(
            ["ip", "-n", cluster.host_namespace(2), "-o", "-4", "addr", "show", "eth0"],
            check=True, capture_output=True, text=True,
        ).stdout
        assert "10.213.0.3/24" in addr
        for ns, dev in ((cluster.host_namespace(1), "eth0"), (cluster.switch_namespace, "p1")):
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],
                                   check=True, capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
    assert _namespaces(no_leak) == []
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    cluster.cleanup()  # idempotent


def test_exception_in_block_removes_all(netns: None, no_leak: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, "1gbit", name_prefix=no_leak):
            assert len(_namespaces(no_leak)) == 3
            raise RuntimeError("boom")
    assert _namespaces(no_leak) == []


def test_cleanup_works_with_processes_alive_or_killed_in_hosts(netns: None, no_leak: str) -> None:
    with EmulatedCluster(2, "1gbit", name_prefix=no_leak) as cluster:
        procs = [subprocess.Popen(["ip", "netns", "exec", cluster.host_namespace(i),
                                   "sleep", "30"]) for i in range(2)]
        procs[0].kill()
        procs[0].wait()
    try:
        assert _namespaces(no_leak) == []
    finally:
        procs[1].kill()
        procs[1].wait()


def test_delay_needs_netem(netns: None, no_leak: str) -> None:
    if emulate._netem_available():
        pytest.skip("this kernel has netem; the missing-netem error cannot be provoked")
    with pytest.raises(ClusterError, match="link delay needs the netem qdisc, which this kernel"):
        with EmulatedCluster(2, "500mbit:10ms", name_prefix=no_leak):
            pass
    with EmulatedCluster(2, "500mbit", name_prefix=no_leak) as cluster:
        with pytest.raises(ClusterError, match="netem"):
            cluster.set_link("500mbit:1ms", host=0)


_HOLDER = """
import sys, time
from autotune.emulate import EmulatedCluster
with EmulatedCluster(2, "1gbit", name_prefix=sys.argv[1]):
    print("ready", flush=True)
    time.sleep(60)
"""


def _start_holder(prefix: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, prefix], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        pytest.fail(f"cluster holder did not start: {proc.communicate()[1]}")
    assert len(_namespaces(prefix)) == 3
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_holder_removes_its_cluster(netns: None, no_leak: str, sig: int) -> None:
    proc = _start_holder(no_leak)
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert _namespaces(no_leak) == []


def test_cleanup_stale_removes_what_a_sigkilled_holder_left(netns: None, no_leak: str) -> None:
    proc = _start_holder(no_leak)
    proc.kill()
    proc.communicate(timeout=30)
    assert len(_namespaces(no_leak)) == 3  # its handlers could not run
    assert len(cleanup_stale(no_leak)) == 3
    assert cleanup_stale(no_leak) == []


# ---------------------------------------------------------------------- shaped rates


def test_tcp_runs_at_the_shaped_rate_each_way_and_follows_set_link(
    netns: None, no_leak: str
) -> None:
    nominal = 100e6
    with EmulatedCluster(2, "100mbit", name_prefix=no_leak) as cluster:
        # Each direction alone runs at the shaped rate (TCP/IP headers cost ~4%).
        for src, dst in ((0, 1), (1, 0)):
            rate = measure_tcp_rate(cluster, src, dst, 12 << 20)
            assert 0.85 <= rate / nominal <= 1.0, ((src, dst), rate)

        # Both directions at once: each NIC is full duplex, so together they carry far
        # more than one link's rate. Each flow's ACKs wait in the same tbf queue as the
        # other flow's data (as on a real NIC), which can cost one of them up to ~20%.
        rates: dict[tuple[int, int], float] = {}

        def measure(src: int, dst: int) -> None:
            rates[src, dst] = measure_tcp_rate(cluster, src, dst, 12 << 20)

        threads = [threading.Thread(target=measure, args=pair) for pair in ((0, 1), (1, 0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(0.6 <= rate / nominal <= 1.0 for rate in rates.values()), rates
        assert sum(rates.values()) / nominal >= 1.5, rates

        # Ranks on one host talk over its loopback, which is not shaped.
        assert measure_tcp_rate(cluster, 0, 0, 64 << 20) > 3 * nominal

        cluster.set_link("50mbit", host=1)
        assert cluster.links[1].rate_bps == 50e6 and cluster.links[0].rate_bps == nominal
        rate = measure_tcp_rate(cluster, 0, 1, 6 << 20)
        assert 0.85 <= rate / 50e6 <= 1.0, rate


def rank_allreduce(nbytes: int) -> dict[str, Any]:
    """Rank target: one allreduce, which namespace the rank ran in, and how long it took."""
    import torch
    import torch.distributed as dist

    tensor = torch.full((nbytes // 4,), float(dist.get_rank() + 1))
    dist.all_reduce(tensor)  # connects the ring
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    return {
        "sum": float(tensor[0]),
        "netns": os.readlink("/proc/self/ns/net"),
        "seconds": time.perf_counter() - start,
    }


@pytest.mark.multirank
def test_gloo_allreduce_across_hosts(netns: None, no_leak: str) -> None:
    with EmulatedCluster(2, "1gbit", name_prefix=no_leak) as cluster:
        results = launch("test_emulate:rank_allreduce", kwargs={"nbytes": 16 << 20},
                         placement=cluster, timeout=120, pg_timeout=60)
    assert [r["sum"] for r in results] == [6.0, 6.0]  # (1 + 2), then doubled
    assert results[0]["netns"] != results[1]["netns"]
    assert results[0]["netns"] != os.readlink("/proc/self/ns/net")
    # 2 ranks: each NIC carries the whole 16 MB once each way; allow for the unshaped
    # burst and TCP/IP headers (~95% of the rate is the ceiling).
    bus_bw = (16 << 20) * 8 / max(r["seconds"] for r in results)
    assert 0.5e9 < bus_bw < 1.05e9, bus_bw
