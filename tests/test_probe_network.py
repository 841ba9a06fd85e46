"""The network probe: robust fits, and a known link rate recovered on an emulated link."""

from __future__ import annotations

import pytest

from autotune.emulate import EmulatedCluster, available
from autotune.probes.network import bus_factor, fit_line

needs_netns = pytest.mark.skipif(
    not available()[0], reason=f"needs root and iproute2 for network namespaces: {available()[1]}"
)


def test_fit_line_ignores_an_outlier() -> None:
    sizes = [1e6, 2e6, 4e6, 8e6, 16e6]
    times = [0.001 + s / 1e8 for s in sizes]
    times[2] *= 5  # one disturbed measurement
    intercept, slope = fit_line(sizes, times)
    assert slope == pytest.approx(1e-8, rel=1e-6)
    assert intercept == pytest.approx(0.001, rel=1e-3)


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("allgather", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("allreduce", 1) == 1.0


@pytest.mark.multirank
def test_probe_on_loopback_fits_every_collective(run_ranks) -> None:
    a, b = run_ranks("autotune.probes.network:probe_network", budget_s=4.0,
                     sizes=[4096, 65536, 1 << 20, 4 << 20])
    assert a == b, "every rank must hold the same results"
    assert set(a["fits"]) == {"allreduce", "allgather", "broadcast", "p2p"}
    assert set(a["fits"]["p2p"]) == {"intra"}  # both ranks on this host
    for name in ("allreduce", "allgather", "broadcast"):
        fit = a["fits"][name]
        assert fit["bandwidth_Bps"] > 0 and fit["latency_s"] >= 0
    for s in a["samples"]:
        assert len(s["times_s"]) >= 3 and s["median_s"] > 0


@needs_netns
@pytest.mark.multirank
def test_probe_recovers_a_shaped_link_rate(run_ranks) -> None:
    from autotune.launch import launch

    rate = 200e6  # bits/s; large messages take ~0.3 s, within 1% on a shaped link
    with EmulatedCluster(2, "200mbit") as cluster:
        result = launch(
            "autotune.probes.network:probe_network", placement=cluster, timeout=240,
            kwargs={"budget_s": 20.0, "sizes": [4096, 65536, 1 << 20, 4 << 20, 8 << 20]},
        )[0]
    assert result["hosts"] == [0, 1]
    # TCP/IP headers take ~4.5% of a 1500-byte frame: payload tops out near 95.6%.
    for name in ("allreduce", "broadcast"):
        bw = result["fits"][name]["busbw_Bps"] * 8
        assert 0.85 * rate < bw < 1.0 * rate, (name, bw)
    p2p = result["fits"]["p2p"]["inter"]["bandwidth_Bps"] * 8
    assert 0.85 * rate < p2p < 1.0 * rate, p2p
