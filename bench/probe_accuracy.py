"""Benchmark: do the probes measure what is there?

For each link rate, on 2 emulated hosts (one rank each):
  * the TCP payload rate a plain socket transfer gets on that link,
  * `autotune profile --workload cnn --hosts 2 --link RATE`: its fitted point-to-point and
    allreduce (bus) bandwidth next to that TCP rate (target within 10%), the sum of
    per-layer backward times next to the measured backward wall time (target within
    10%), and the command's wall time.
Plus the wall time of `autotune profile` for `cnn` on 2 local ranks (target under 90 s).

Needs root (network namespaces). Writes JSON (default bench/results/probe_accuracy.json)
and prints a table.

    python bench/probe_accuracy.py [--rates 100mbit,1gbit,5gbit] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autotune.emulate import EmulatedCluster, measure_tcp_rate
from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic
from autotune.links import parse_link
from autotune.probes.profile import Compute, Profile, load_profile


def _profile(args: list[str], out: Path) -> tuple[Profile, float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "profile", "--workload", "cnn", "--out", str(out), *args],
        capture_output=True, text=True, timeout=1200,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"autotune profile {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return load_profile(out), wall


def _compute_check(compute: Compute) -> dict[str, float]:
    """Per-layer backward times summed against the backward wall time of the same step on
    the same rank (median over steps and ranks), and what timing every layer costs."""
    hooked = statistics.median(compute.hooked_backward_s or ())
    clean = statistics.median(compute.backward_s)
    cov = compute.extra["backward_coverage"]
    return {"backward_wall_s": hooked, "clean_backward_wall_s": clean,
            "hook_overhead": hooked / clean,
            "module_ratio": cov["modules"], "ready_ratio": cov["ready"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100mbit,1gbit,5gbit")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/probe_accuracy.json"))
    args = parser.parse_args(argv)
    console = Console(width=200)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            link = parse_link(rate)
            nbytes = int(max(12e6, link.rate_bps / 8 * 1.5))  # >= 1.5 s of transfer
            with EmulatedCluster(2, link) as cluster:
                tcp = [measure_tcp_rate(cluster, 0, 1, nbytes) for _ in range(3)]
            tcp_bps = sorted(tcp)[1]
            console.print(f"{rate}: TCP payload {tcp_bps / 1e6:.0f} Mbit/s; profiling...")
            prof, wall = _profile(
                ["--hosts", "2", "--nproc-per-node", "1", "--link", rate,
                 "--budget-s", str(args.budget_s)], Path(tmp) / f"{rate}.json",
            )
            fits = prof.network.fits
            p2p = fits["p2p"]["inter"].bandwidth_Bps * 8
            allreduce = fits["allreduce"].busbw_Bps * 8
            rows.append({
                "rate": rate, "nominal_bps": link.rate_bps, "tcp_bps": tcp_bps, "tcp_runs_bps": tcp,
                "p2p_bps": p2p, "p2p_vs_tcp": p2p / tcp_bps,
                "allreduce_busbw_bps": allreduce, "allreduce_vs_tcp": allreduce / tcp_bps,
                "fits": prof.network.to_dict()["fits"], "profile_wall_s": wall,
                **_compute_check(prof.compute),
            })
        console.print("cnn on 2 local ranks (loopback): profiling...")
        local, local_wall = _profile(["--nproc-per-node", "2", "--budget-s", str(args.budget_s)],
                                     Path(tmp) / "local.json")
    result = {
        "benchmark": "probe_accuracy", "workload": "cnn", "rates": rows,
        "local": {"profile_wall_s": local_wall, "target_s": 90, **_compute_check(local.compute)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=2), AutotuneError, "benchmark results")

    table = Table(title="probe accuracy: 2 emulated hosts, 1 rank each, cnn")
    for col in ("link", "TCP payload Mbit/s", "p2p fit", "p2p/TCP", "allreduce busbw fit",
                "allreduce/TCP", "backward wall ms",
                "sum of layers / wall (modules | ready)", "timed/clean backward", "profile wall s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["rate"], f"{r['tcp_bps'] / 1e6:.0f}", f"{r['p2p_bps'] / 1e6:.0f}", f"{r['p2p_vs_tcp']:.3f}",
            f"{r['allreduce_busbw_bps'] / 1e6:.0f}", f"{r['allreduce_vs_tcp']:.3f}",
            f"{r['backward_wall_s'] * 1e3:.1f}",
            f"{r['module_ratio']:.3f} | {r['ready_ratio']:.3f}", f"{r['hook_overhead']:.3f}",
            f"{r['profile_wall_s']:.0f}",
        )
    console.print(table)
    loc = result["local"]
    console.print(
        f"autotune profile, cnn on 2 local ranks: {local_wall:.0f} s wall (target < 90 s); "
        f"backward wall {loc['backward_wall_s'] * 1e3:.1f} ms (timed steps; clean "
        f"{loc['clean_backward_wall_s'] * 1e3:.1f} ms), sum of layers / wall "
        f"{loc['module_ratio']:.3f} (modules) | {loc['ready_ratio']:.3f} (ready)"
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
