"""Rich tables summarising a profile (``autotune profile`` and ``autotune show``)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune.compressors import CompressorSpec
from autotune.probes.profile import ROW_SPARSE_BELOW, NetworkFit, Profile
from autotune.search.defaults import PRUNE_PREDICTED

__all__ = ["codec_coverage", "print_profile"]


def _mbit(bps: float) -> str:
    return f"{bps * 8 / 1e6:,.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _spec_label(spec: Mapping[str, Any]) -> str:
    return CompressorSpec.from_dict(spec).label()


def print_profile(console: Console, profile: Profile, top: int = 10) -> None:
    """Link classes with their fits, the heaviest layers, and codec costs."""
    env = profile.env
    console.print(Text.assemble(
        ("profile ", "bold"), (profile.fingerprint, "bold cyan"),
        f"  {profile.workload.name} on {env.world_size} ranks, {env.hosts} host(s)"
        f"{', link ' + env.link if env.link else ''}, {env.backend}/{env.device},"
        f" torch {env.torch}",
    ))
    _network(console, profile)
    _compute(console, profile, top)
    _codecs(console, profile)
    _structure(console, profile, top)
    cal = [r for r in profile.calibration.results if r.stock is None]
    stock = sorted({r.stock for r in profile.calibration.results if r.stock is not None})
    if cal:
        steps = sorted(r.step_s for r in cal)
        console.print(f"calibration: {len(cal)} policies measured on the live job "
                      f"({steps[0] * 1e3:.0f}-{steps[-1] * 1e3:.0f} ms per step); they fit the "
                      "cost model's residual")
    if stock:
        console.print(f"stock set-ups measured beside our equivalents: {', '.join(stock)}; "
                      "their ratio scales the model's predictions of them")


def _network(console: Console, profile: Profile) -> None:
    fits = profile.network.fits
    if not fits:
        console.print("network: a single rank, nothing to probe")
        return
    table = Table(title="network: t(bytes) = latency + bytes / bandwidth", title_justify="left")
    for col in ("collective", "link class", "latency us", "bandwidth Mbit/s",
                "bus bw Mbit/s", "fitted on", "largest measured"):
        table.add_column(col, justify="left" if col in ("collective", "link class") else "right")
    largest: dict[str, int] = {}
    for s in profile.network.samples:
        key = s.collective if s.collective != "p2p" else f"p2p:{s.link_class}"
        largest[key] = max(largest.get(key, 0), s.bytes)

    def row(name: str, cls: str, f: NetworkFit, key: str) -> None:
        fitted = f.fit_bytes
        span = f"{fitted[0] / 2**20:g}-{fitted[-1] / 2**20:g} MiB" if fitted else ""
        busbw = f.busbw_Bps if f.busbw_Bps is not None else f.bandwidth_Bps
        table.add_row(name, cls, f"{f.latency_s * 1e6:,.0f}", _mbit(f.bandwidth_Bps),
                      _mbit(busbw), span, f"{largest.get(key, 0) / 2**20:g} MiB")

    for name, f in fits.items():
        if name == "p2p":
            for cls, g in f.items():
                row("p2p", cls, g, f"p2p:{cls}")
        else:
            row(name, "all ranks", f, name)
    console.print(table)


def _compute(console: Console, profile: Profile, top: int) -> None:
    c = profile.compute
    med = {k: statistics.median(getattr(c, k)) for k in ("step_s", "forward_s", "backward_s", "optimizer_s")}
    console.print(
        "compute (slowest rank, median): " + ", ".join(
            f"{k.removesuffix('_s')} {_ms(v)} ms" for k, v in med.items()
        ) + "  [dim](step = the compute-only floor, ranks side by side)[/dim]"
    )
    params = sorted(c.params, key=lambda p: -math.prod(p.shape))[:top]
    modules = {m.name: m for m in c.modules}
    table = Table(title=f"the {len(params)} layers with the most gradient bytes", title_justify="left")
    for col in ("parameter", "shape", "grad MB", "ready at ms", "layer backward ms"):
        table.add_column(col, justify="left" if col == "parameter" else "right")
    for p in params:
        module = modules.get(p.name.rsplit(".", 1)[0])
        back = module.backward_s if module is not None else None
        table.add_row(Text(p.name), "x".join(map(str, p.shape)),
                      f"{math.prod(p.shape) * 4 / 1e6:.2f}",
                      _ms(p.ready_s) if p.ready_s is not None else "never",
                      _ms(back) if back is not None else "")
    console.print(table)
    slow = sorted(c.modules, key=lambda m: -(m.backward_s or 0.0))[:top]
    if slow:
        t2 = Table(title=f"the {len(slow)} layers with the most backward time", title_justify="left")
        for col in ("module", "type", "forward ms", "backward ms"):
            t2.add_column(col, justify="left" if col in ("module", "type") else "right")
        for m in slow:
            t2.add_row(Text(m.name), m.type or "", _ms(m.forward_s or 0.0), _ms(m.backward_s or 0.0))
        console.print(t2)


def _codecs(console: Console, profile: Profile) -> None:
    codecs = profile.codecs
    shapes = codecs.shapes
    if not shapes:
        return
    params = profile.compute.params
    count: dict[tuple[int, ...], int] = {}
    for p in params:
        count[p.shape] = count.get(p.shape, 0) + 1
    per_spec: dict[str, dict[str, float]] = {}
    for s in shapes:
        label = _spec_label(s.spec)
        n = count.get(s.shape, 0)
        agg = per_spec.setdefault(
            label, {"time": 0.0, "bytes": 0.0, "err_num": 0.0, "cum_num": 0.0, "err_den": 0.0}
        )
        agg["time"] += s.encode_decode_s * n
        agg["bytes"] += s.wire_bytes * n
    numel = {p.name: math.prod(p.shape) for p in params}
    for e in codecs.errors:
        label = _spec_label(e.spec)
        if label in per_spec:
            w = numel.get(e.param, 1)
            per_spec[label]["err_num"] += e.rel_error * w
            per_spec[label]["cum_num"] += (e.rel_error if e.cum_error is None else e.cum_error) * w
            per_spec[label]["err_den"] += w
    full = sum(numel.values()) * 4
    table = Table(title="codecs over the whole model (per step and rank)", title_justify="left")
    for col in ("compressor", "encode+decode ms", "wire MB", "vs fp32", "error per step",
                "error over steps"):
        table.add_column(col, justify="left" if col == "compressor" else "right")
    for label, a in per_spec.items():
        den = a["err_den"] or float("nan")
        table.add_row(label, _ms(a["time"]), f"{a['bytes'] / 1e6:.2f}",
                      f"{a['bytes'] / full:.3f}" if full else "",
                      f"{a['err_num'] / den:.3f}", f"{a['cum_num'] / den:.3f}")
    console.print(table)
    console.print("[dim]errors: ||g - C(g)|| / ||g|| on real gradients, weighted by size; "
                  "'over steps' compares sums over the captured steps, where error feedback "
                  "pays back what one step dropped[/dim]")
    coverage = codec_coverage(profile)
    if coverage["extrapolated_errors"] or coverage["live_rows"] or coverage["scaled_times"]:
        ratios = coverage["energy_ratios"]
        spread = f" (energy ratio {min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
        console.print(
            f"codec probe on the rows of {coverage['sampled_params']} large parameter(s): "
            f"{coverage['extrapolated_errors']} of {coverage['errors']} error cells "
            f"extrapolated from row samples{spread}, {coverage['live_rows']} exact on "
            f"live rows; {coverage['scaled_times']} of {coverage['times']} encode+decode "
            "times scaled from row samples"
        )
    if coverage["missing"]:
        skipped = ", ".join(_spec_label(s) for s in codecs.skipped)
        console.print(f"[yellow]codec probe stopped at its time budget: {coverage['missing']} "
                      f"cells missing{' (' + skipped + ' not measured)' if skipped else ''}"
                      "[/yellow]")


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


def _structure(console: Console, profile: Profile, top: int) -> None:
    """The row-sparse gradients the codec probe found (profiles before it measured
    them: nothing)."""
    structure = profile.codecs.structure
    if not structure:
        return
    shapes = profile.compute.shapes
    sparse = sorted((name for name, s in structure.items() if s.row_density_max < ROW_SPARSE_BELOW),
                    key=lambda n: -math.prod(shapes.get(n, ())))
    if not sparse:
        console.print(f"gradient rows: all {len(structure)} gradients measured are dense (the "
                      f"busiest rank's has non-zero values in >= {_percent(ROW_SPARSE_BELOW)} "
                      "of its rows)")
        return
    first = structure[sparse[0]]
    over = f"{first.steps or '?'} steps x {first.ranks or '?'} rank(s)"
    table = Table(title="row-sparse gradients", title_justify="left")
    for col in ("parameter", "shape", "mean", "busiest", "spread"):
        table.add_column(col, justify="left" if col == "parameter" else "right")
    for name in sparse[:top]:
        s = structure[name]
        mean, std = s.row_density_mean, s.row_density_std
        table.add_row(Text(name), "x".join(map(str, shapes.get(name, []))),
                      _percent(mean) if mean is not None else "",
                      _percent(s.row_density_max),
                      _percent(std) if std is not None else "")
    console.print(table)
    rest = len(sparse) - top
    console.print(f"[dim]share of rows holding a non-zero value, over {over}: 'busiest' "
                  "(the most any rank had in a step) sizes rowsparse's messages, 'spread' is "
                  f"the standard deviation; {f'{rest} more row-sparse, ' if rest > 0 else ''}"
                  f"{len(structure) - len(sparse)} dense[/dim]")


def codec_coverage(profile: Profile) -> dict[str, Any]:
    """How the codec probe measured the profile's cells.

    Returns:
        ``errors`` (parameter x configuration cells measured), ``missing`` (cells of the
        grid's configurations and the profiled parameters without an error),
        ``extrapolated_errors`` (on row samples), ``live_rows`` (exact on live rows),
        ``times`` and ``scaled_times`` (encode+decode per shape, and of those scaled
        from a row sample), ``sampled_params`` (parameters measured on rows) and the
        row samples' ``energy_ratios``. Profiles from before row sampling count every
        cell as measured in full.
    """
    codecs = profile.codecs
    errors = codecs.errors
    times = codecs.shapes
    params = profile.compute.param_names
    labels = {_spec_label(s) for s in (*codecs.grid, *codecs.skipped)}
    have = {(_spec_label(e.spec), e.param) for e in errors}
    missing = sum(1 for label in labels for name in params if (label, name) not in have)
    on_rows = [e for e in errors if e.measured not in (None, "full")]
    sampled = [e for e in on_rows if e.measured == "sample"]
    return {
        "errors": len(errors),
        "missing": missing,
        "extrapolated_errors": len(sampled),
        "live_rows": len(on_rows) - len(sampled),
        "times": len(times),
        "scaled_times": sum(1 for s in times if s.measured == "sample"),
        "sampled_params": len({e.param for e in on_rows}),
        "energy_ratios": sorted({float(e.sample.energy_ratio) for e in sampled
                                 if e.sample is not None and e.sample.energy_ratio is not None}),
    }


# why verification's measurement ended (rank_measure's ``stopped``), for its table
STOPPED = {
    "separated": "one contender was left, the others measured slower beyond noise",
    "budget": "its {budget:.0f} s budget ran out",
    "futile": "no contender left could separate from the fastest in the budget left",
    "rounds": "its round limit",
}


def print_verification(out: Any, meta: Mapping[str, Any]) -> None:
    """The measured table of a verified policy's meta, and why the winner won (``autotune tune``,
    ``show`` and ``demo``)."""
    report = meta.get("verified") or {}
    summary = meta.get("verification") or {}
    rows = {n: r for n, r in report.items() if not n.startswith("_") and isinstance(r, Mapping)}
    if not rows:
        return
    # plain DDP's steady time: one timed on its first step alone carries one-time costs
    steady = [rows[n] for n in ("stock:ddp", "ddp") if n in rows and not rows[n].get("first_step_only")]
    ddp = steady[0].get("measured_step_s") if steady else None
    table = Table(title="measured on the live job, interleaved (median step of the slowest rank)")
    for col in ("set-up", "kind", "measured ms", "vs plain DDP", "vs fastest (95% interval)",
                "predicted ms", "error", "within budget"):
        table.add_column(col, justify="left" if col in ("set-up", "kind") else "right")
    for name, r in sorted(rows.items(), key=lambda kv: kv[1].get("measured_step_s", 0.0)):
        mark = "  <- won" if name == summary.get("winner") else ""
        if name == summary.get("emitted") and name != summary.get("winner"):
            mark = "  <- written"
        elif name == summary.get("emitted"):
            mark = "  <- won, written"
        interval = r.get("interval_vs_fastest")
        error = r.get("error")
        table.add_row(
            name + mark, str(r.get("kind", "")),
            f"{r['measured_step_s'] * 1e3:.1f}" + ("*" if r.get("first_step_only") else ""),
            f"{r['measured_step_s'] / ddp:.2f}x" if ddp else "",
            f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "",
            f"{r['predicted_step_s'] * 1e3:.1f}" if r.get("predicted_step_s") else "",
            f"{error:.3f}" if error is not None else "",
            "yes" if r.get("feasible") else "no",
        )
    out.print(table)
    if any(r.get("first_step_only") for r in rows.values()):
        out.print("* its first step only, one-time costs included: predicted and measured over "
                  "twice the fastest, so not timed again", soft_wrap=True)
    pruned = summary.get("pruned") or {}
    if pruned:
        listed = ", ".join(f"{n} ({s * 1e3:.0f} ms)" for n, s in sorted(pruned.items(), key=lambda kv: kv[1]))
        out.print(f"not measured, predicted over {PRUNE_PREDICTED:g}x the fastest prediction: {listed}",
                  soft_wrap=True)
    if summary.get("pruned_over_budget"):
        out.print("not measured, bucket-size variants over the error budget (they cannot win): "
                  + ", ".join(summary["pruned_over_budget"]), soft_wrap=True)
    if summary.get("stopped") in STOPPED:
        out.print(f"measured {summary.get('rounds')} rounds in {summary.get('measure_s') or 0:.0f} s; ended: "
                  + STOPPED[summary["stopped"]].format(budget=summary.get("budget_s") or 0), soft_wrap=True)
    if summary.get("why"):
        out.print(f"verdict: {summary['why']}", soft_wrap=True)
