"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Each ``plot_*`` function takes :class:`~autotune.report.data.ReportData` and returns a
``Figure``; :func:`save_png` writes one. Colours are fixed per configuration so the same
set-up looks the same in every figure.
"""

from __future__ import annotations

import os
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from autotune.models.trace import trace_events
from autotune.presets import PRESETS
from autotune.report.data import ReportData, rate_label

__all__ = ["plot_timelines", "plot_bandwidth", "plot_study", "plot_measured", "save_png"]

COLORS = {**{p.name: p.color for p in PRESETS if p.color is not None},
          "policy": "#c44e52", "tuned": "#c44e52", "floor": "#7f7f7f"}
_SPAN_COLORS = {"forward": "#9ecae1", "backward": "#3182bd", "optimizer": "#bdbdbd",
                "encode": "#fdae6b", "decode": "#e6550d", "allreduce": "#31a354",
                "allgather": "#a1d99b"}
_LANES = ("compute", "codec", "comm")
_NAMES = {**{p.name: p.display or p.name for p in PRESETS},
          "policy": "tuned policy", "floor": "compute floor"}
DPI = 110


def display_name(config: str) -> str:
    return _NAMES.get(config, config)


def _color(config: str, index: int = 0) -> str:
    return COLORS.get(config, f"C{index % 10}")


def save_png(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Render ``fig`` with the Agg canvas to a PNG file."""
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=DPI)


def _span_kind(name: str) -> str:
    return name.split(" ", 1)[0]


def plot_timelines(data: ReportData) -> Figure:
    """One step per configuration: compute, encode/decode and collectives on one axis."""
    rows = len(data.timelines)
    fig = Figure(figsize=(11, 1.9 * rows + 0.9), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    seen: dict[str, Any] = {}
    for ax, timeline in zip(axes, data.timelines):
        est = timeline.estimate
        events = trace_events(est)["traceEvents"]
        for ev in events:
            if ev.get("ph") != "X":
                continue
            lane = len(_LANES) - 1 - _LANES.index(ev["cat"])
            kind = _span_kind(ev["name"])
            color = _SPAN_COLORS.get(kind, "#636363")
            bars = ax.broken_barh([(ev["ts"] / 1e3, ev["dur"] / 1e3)], (lane - 0.38, 0.76),
                                  facecolors=color, edgecolors="white", linewidth=0.4)
            seen.setdefault(kind, bars)
        ax.axvline(est.step_s * 1e3, color="black", linestyle="--", linewidth=1)
        ax.text(est.step_s * 1e3, len(_LANES) - 0.45, f" step {est.step_s * 1e3:.0f} ms",
                va="top", ha="left", fontsize=9)
        ax.set_yticks(range(len(_LANES)), [lane for lane in reversed(_LANES)])
        ax.set_ylim(-0.6, len(_LANES) - 0.4)
        ax.set_title(f"{timeline.name}: exposed communication {est.exposed_comm_s * 1e3:.0f} ms, "
                     f"encode/decode {est.codec_s * 1e3:.0f} ms, {est.wire_bytes / 1e6:.1f} MB on the "
                     f"wire in {est.collectives} collectives", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    longest = max(max(t.estimate.step_s, t.estimate.simulated_s) for t in data.timelines)
    axes[-1].set_xlim(0, longest * 1e3 * 1.12)  # room for the step labels
    axes[-1].set_xlabel("ms from the start of the step (dashed: predicted step, calibrated)")
    order = [k for k in _SPAN_COLORS if k in seen]
    fig.legend([seen[k] for k in order], order, loc="outside lower center", ncols=len(order),
               fontsize=9, frameon=False)
    return fig


def _rate_axis(ax: Any) -> None:
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: rate_label(x)))


def plot_bandwidth(data: ReportData) -> Figure:
    """Step time against link rate: is the network the bottleneck of this job?"""
    sweep = data.sweep
    if sweep is None:
        raise ValueError("no sweep to plot")
    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    rates = sweep.rates_bps
    for i, (name, values) in enumerate(sweep.step_s.items()):
        strong = name in ("ddp", "policy")
        ax.plot(rates, [v * 1e3 for v in values], color=_color(name, i), label=display_name(name),
                linewidth=2.6 if strong else 1.6, zorder=3 if strong else 2)
    ax.axhline(data.floor_s * 1e3, color=COLORS["floor"], linestyle=":", linewidth=1,
               label="compute-only floor")
    pays = sweep.compression_pays_below_bps
    if pays is not None:
        ax.axvspan(rates[0], pays, color="#55a868", alpha=0.08, zorder=0)
        ax.axvline(pays, color="#2d7a3e", linewidth=1.2)
        by = display_name(sweep.compression_pays_by or "")
        ax.annotate(f"compression pays below {rate_label(pays)}/s ({by})", (pays, 0.97),
                    xycoords=("data", "axes fraction"), ha="right", va="top", fontsize=9,
                    color="#2d7a3e", xytext=(-4, 0), textcoords="offset points")
    if data.link_bps is not None:
        ax.axvline(data.link_bps, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"profiled link {rate_label(data.link_bps)}/s", (data.link_bps, 0.91),
                    xycoords=("data", "axes fraction"), ha="left", va="top", fontsize=9,
                    xytext=(4, 0), textcoords="offset points")
        for i, (name, value) in enumerate(sweep.at_link_s.items()):
            ax.scatter([data.link_bps], [value * 1e3], marker="D", s=28, facecolors="white",
                       edgecolors=_color(name, i), zorder=4)
    measured = [(rate, m) for m in data.measured
                if (rate := m.rate_bps) is not None and m.config in sweep.step_s]
    for rate, m in measured:
        ax.scatter([rate], [m.measured_s * 1e3], marker="o", s=46, color=_color(m.config),
                   edgecolors="black", linewidths=0.8, zorder=5)
    if measured:
        ax.scatter([], [], marker="o", s=46, color="white", edgecolors="black", label="measured")
    ax.scatter([], [], marker="D", s=28, facecolors="white", edgecolors="black",
               label="predicted at the profiled link (calibrated)")
    _rate_axis(ax)
    ax.set_yscale("log")
    ax.set_xlabel("link rate per host (bit/s)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"{data.workload} on {data.env.get('world_size')} ranks: step time against link rate "
                 "(lines: timeline model)", fontsize=11, loc="left")
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=9, loc="upper right", bbox_to_anchor=(1, 0.86))
    return fig


def plot_study(data: ReportData) -> Figure:
    """The study's trials: compression error against predicted step time."""
    study = data.study
    if study is None:
        raise ValueError("no study to plot")
    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    ok = [t for t in study.trials if t.feasible]
    bad = [t for t in study.trials if not t.feasible]
    ax.scatter([t.step_s * 1e3 for t in ok], [t.error for t in ok], s=16, color="#4c72b0",
               alpha=0.6, label=f"trial within the error budget ({len(ok)})")
    if bad:
        ax.scatter([t.step_s * 1e3 for t in bad], [t.error for t in bad], s=16, marker="x",
                   color="#999999", alpha=0.7, label=f"trial over the budget ({len(bad)})")
    front = [study.trials[i] for i in study.front]
    ax.step([t.step_s * 1e3 for t in front], [t.error for t in front], where="post",
            color="#c44e52", linewidth=1.6, label=f"Pareto front ({len(front)} trials)")
    ax.scatter([t.step_s * 1e3 for t in front], [t.error for t in front], s=30, color="#c44e52",
               zorder=3)
    if study.max_error is not None:
        ax.axhline(study.max_error, color="black", linestyle="--", linewidth=1,
                   label=f"error budget {study.max_error:g}")
    if data.policy_point is not None:
        step, err = data.policy_point
        ax.scatter([step * 1e3], [err], marker="*", s=260, color="#ffbf00", edgecolors="black",
                   zorder=5, label=f"chosen policy ({step * 1e3:.0f} ms, error {err:.3f})")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("compression error of the whole gradient")
    ax.set_title(f"study {study.name!r}: {len(study.trials)} trials", fontsize=11, loc="left")
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=9)
    return fig


def plot_measured(data: ReportData) -> Figure:
    """Measured step time beside the prediction for the same set-up and link."""
    rows = [m for m in data.measured if m.predicted_s is not None]
    fig = Figure(figsize=(10, 0.42 * len(rows) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    labels = [f"{display_name(m.config)} @ {m.link}" for m in rows]
    ys = list(range(len(rows)))
    ax.barh([y + 0.2 for y in ys], [m.predicted_s * 1e3 for m in rows], height=0.38,  # type: ignore[operator]
            color="#bdbdbd", label="predicted")
    ax.barh([y - 0.2 for y in ys], [m.measured_s * 1e3 for m in rows], height=0.38,
            color=[_color(m.config) for m in rows], label="measured (median)")
    ax.set_yticks(ys, labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.set_title("measured against predicted", fontsize=11, loc="left")
    ax.grid(axis="x", which="both", alpha=0.25)
    ax.legend(fontsize=9, loc="lower right")
    return fig
