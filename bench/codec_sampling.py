"""Benchmark: how close the codec probe's row samples come to measuring in full.

For each workload, one process (one thread) captures 4 steps of gradients with the
compute probe, then runs the codec probe twice over the default grid: on rows (the
default) and with every tensor in full (``sample_above=None``). For every error cell the
first run measured on live rows or on a row sample, it compares the errors (per step
and cumulative) with the full measurement. For times, which a shared machine's noise
swamps in two separate runs, it times encode+decode of every large shape in full and
on the probe's row sample alternately (``--time-reps`` each, the fastest kept) and
compares the sample's time scaled by numel with the full one. It reports the probe's
wall time both ways.

Writes JSON (default bench/results/codec_sampling.json) and prints a table.

    python bench/codec_sampling.py [--workloads dlrm,cnn] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from autotune import compressors
from autotune.compressors import CompressorSpec, LocalComm
from autotune.jsonio import dumps, write_atomic
from autotune.probes.codecs import DEFAULT_GRID, _stands_for, probe_codecs, row_plan
from autotune.probes.compute import probe_compute
from autotune.probes.run import CAPTURE_STEPS
from autotune.workloads import resolve_workload


def _time(spec: CompressorSpec, x: torch.Tensor, name: str) -> float:
    comp = compressors.create(spec.name, **spec.kwargs)
    comp.reduce([x.clone()], [name], LocalComm(2))  # state (Q, residual) first
    y = x.clone()
    start = time.perf_counter()
    comp.reduce([y], [name], LocalComm(2))
    return time.perf_counter() - start


def compare(workload: str, reps: int, time_reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    work = resolve_workload(workload)
    _, grads = probe_compute(work, steps=CAPTURE_STEPS, warmup=1, capture=CAPTURE_STEPS)
    sampled = probe_codecs(grads, world_size=2, reps=reps)
    full = probe_codecs(grads, world_size=2, reps=reps, sample_above=None)
    errors = {(r["label"], r["param"]): r for r in full["errors"]}
    cells = []
    for row in sampled["errors"]:
        if row["measured"] != "full":
            ref = errors[row["label"], row["param"]]
            for key in ("rel_error", "cum_error"):
                cells.append({"kind": key, "mode": row["measured"], "label": row["label"],
                              "param": row["param"], "sample": row["sample"],
                              "sampled": row[key], "full": ref[key]})
    shapes: dict[tuple[int, ...], str] = {}
    for name, gs in grads.items():
        shapes.setdefault(tuple(gs[0].shape), name)
    for shape, name in shapes.items():
        plan = row_plan(name, grads[name])
        if plan is None or plan.sample is None:
            continue
        g = grads[name][-1]
        part = g.index_select(0, plan.sample)
        for d in DEFAULT_GRID:
            spec = CompressorSpec.from_dict(d)
            comp = compressors.create(spec.name, **spec.kwargs)
            if not _stands_for(comp, shape, plan.sample.numel(), 2):
                continue
            t_full, t_part = [], []
            for _ in range(time_reps):  # alternately, so that drift hits both alike
                t_full.append(_time(spec, g, name))
                t_part.append(_time(spec, part, name))
            cells.append({"kind": "time", "label": spec.label(), "shape": list(shape),
                          "sample_numel": part.numel(), "full": min(t_full),
                          "sampled": min(t_part) * g.numel() / part.numel()})
    modes = [r["measured"] for r in sampled["errors"]]
    return {"workload": workload, "wall_s": {"sampled": sampled["wall_s"], "full": full["wall_s"]},
            "cells": len(sampled["errors"]), "live_rows_cells": modes.count("live_rows"),
            "sampled_cells": modes.count("sample"), "comparisons": cells}


def _summary(result: dict[str, Any], kind: str, mode: str | None = None) -> tuple[int, float, float]:
    rows = [c for c in result["comparisons"] if c["kind"] == kind and c["full"] is not None
            and c["sampled"] is not None and (mode is None or c.get("mode") == mode)]
    if kind == "time":  # relative: extrapolated / measured
        ratios = [c["sampled"] / c["full"] for c in rows if c["full"] > 0]
        if not ratios:
            return 0, float("nan"), float("nan")
        return len(rows), statistics.median(ratios), max(abs(r - 1) for r in ratios)
    diffs = [abs(c["sampled"] - c["full"]) for c in rows]
    if not diffs:
        return 0, float("nan"), float("nan")
    return len(rows), statistics.median(diffs), max(diffs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="dlrm,cnn")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--time-reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/codec_sampling.json"))
    args = parser.parse_args(argv)
    results = [compare(w, args.reps, args.time_reps) for w in args.workloads.split(",")]
    write_atomic(args.out, dumps({"results": results}, indent=1) + "\n", RuntimeError, "results")
    console = Console()
    table = Table(title="codec probe on rows against full measurement (1 thread)")
    for col in ("workload", "what", "cells", "median", "worst"):
        table.add_column(col, justify="left" if col in ("workload", "what") else "right")
    for r in results:
        w = r["workload"]
        table.add_row(w, "probe wall s, on rows / in full", "",
                      f"{r['wall_s']['sampled']:.1f} / {r['wall_s']['full']:.1f}", "")
        table.add_row(w, "error cells: live rows, sample, all", "",
                      f"{r['live_rows_cells']}, {r['sampled_cells']}, {r['cells']}", "")
        n, med, worst = _summary(r, "time")
        table.add_row(w, "time: scaled sample / full (worst: |ratio - 1|)", str(n),
                      f"{med:.2f}", f"{worst:.2f}")
        for mode in ("live_rows", "sample"):
            for kind in ("rel_error", "cum_error"):
                n, med, worst = _summary(r, kind, mode)
                if n:
                    table.add_row(w, f"{kind} on {mode.replace('_', ' ')}: |diff| to full",
                                  str(n), f"{med:.1e}", f"{worst:.1e}")
    console.print(table)
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
