"""The report's HTML page: one self-contained file beside its PNG figures.

No scripts, no external style sheets or fonts: the page reads the same offline, from a
file:// URL, as attached to an issue, or served by any static server.
"""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Mapping, Sequence

from autotune.report.data import ReportData, rate_label
from autotune.report.figures import display_name

__all__ = ["render_page"]

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1180px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.env { color: #555; }
.verdict { background: #f4f8f4; border-left: 4px solid #55a868; padding: 0.6em 1em; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.6em 0; }
th, td { padding: 0.2em 0.6em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f6f6f6; position: sticky; top: 0; }
td.l, th.l { text-align: left; }
.muted { color: #888; }
"""


def _ms(seconds: float | None) -> str:
    return "&ndash;" if seconds is None else f"{seconds * 1e3:.1f}"


def _num(value: Any, fmt: str = ".3g") -> str:
    return "&ndash;" if value is None else format(value, fmt)


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> str:
    """Cells are HTML already; the first ``left`` columns are left-aligned."""
    cls = [' class="l"' if i < left else "" for i in range(len(head))]
    out = ["<table><thead><tr>"]
    out += [f"<th{cls[i]}>{h}</th>" for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td{cls[i]}>{c}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _figure(figures: Mapping[str, str], key: str, caption: str) -> str:
    if key not in figures:
        return ""
    src = escape(figures[key])
    return (f'<figure><img src="{src}" alt="{escape(caption)}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def _env_line(data: ReportData) -> str:
    env = data.env
    link = f"{env['link']} emulated link" if env.get("link") else (
        f"measured bus bandwidth {rate_label(data.link_bps)}/s" if data.link_bps else "unshaped links")
    parts = [f"{env.get('world_size')} ranks on {env.get('hosts', 1)} host(s)", link,
             f"{env.get('backend')} on {env.get('device')}", f"torch {env.get('torch')}"]
    return escape(", ".join(str(p) for p in parts))


def _verdict(data: ReportData) -> str:
    ddp = data.timelines[0].estimate
    lines = [
        f"At the profiled link, plain DDP is predicted at <b>{_ms(ddp.step_s)} ms</b> per step: "
        f"the compute-only floor is {_ms(data.floor_s)} ms, and communication that backward "
        f"does not hide adds {_ms(ddp.exposed_comm_s)} ms "
        f"({ddp.exposed_comm_s / max(ddp.step_s, 1e-12):.0%} of the step)."
    ]
    sweep = data.sweep
    if sweep is not None:
        pays = sweep.compression_pays_below_bps
        top = sweep.rates_bps[-1]
        if pays is None:
            lines.append("Compression does not pay at any link rate from "
                         f"{rate_label(sweep.rates_bps[0])}/s to {rate_label(top)}/s: the network is "
                         "not the bottleneck of this job.")
        elif pays >= top:
            lines.append(f"Compression still pays at {rate_label(top)}/s, the fastest link "
                         "considered: the network is the bottleneck of this job.")
        else:
            here = "so on the profiled link it pays" if data.link_bps and data.link_bps < pays else (
                "so on the profiled link the network is not the bottleneck")
            by = escape(display_name(sweep.compression_pays_by or ""))
            lines.append(f"Compression starts to pay below <b>{rate_label(pays)}/s</b> per host "
                         f"({by} beats plain DDP up to there), {here}.")
    if data.policy is not None and len(data.timelines) > 1:
        tuned = data.timelines[1].estimate
        lines.append(f"The tuned policy is predicted at <b>{_ms(tuned.step_s)} ms</b> "
                     f"({ddp.step_s / tuned.step_s:.2f}x plain DDP).")
    return '<p class="verdict">' + " ".join(lines) + "</p>"


def _sweep_table(data: ReportData) -> str:
    sweep = data.sweep
    if sweep is None:
        return '<p class="muted">The profile has no link rate to ask what-ifs about.</p>'
    rows = []
    ddp = sweep.at_link_s["ddp"]
    for name, at_link in sweep.at_link_s.items():
        pays = sweep.pays_below_bps.get(name)
        if name == "ddp":
            verdict = "&ndash;"
        elif pays is None:
            verdict = "never (in this range)"
        elif pays >= sweep.rates_bps[-1]:
            verdict = f"still at {rate_label(pays)}/s (the top of the range)"
        else:
            verdict = f"{rate_label(pays)}/s"
        rows.append([escape(display_name(name)), _ms(at_link), f"{ddp / at_link:.2f}x", verdict])
    return _table(["configuration", "predicted ms at the profiled link", "vs plain DDP",
                   "beats plain DDP up to"], rows)


def _study_section(data: ReportData, figures: Mapping[str, str]) -> str:
    study = data.study
    if study is None:
        return ""
    front = [study.trials[i] for i in study.front]
    rows = [[str(t.number), _ms(t.step_s), f"{t.error:.3f}", "yes" if t.feasible else "no"] for t in front]
    return ("<h2>Search: what the tuned policy gave up for its speed</h2>"
            + _figure(figures, "study", "Every trial of the study as compression error against "
                      "predicted step time; the Pareto front (no trial is both faster and more "
                      "exact) and the chosen policy are marked.")
            + "<p>Pareto front:</p>"
            + _table(["trial", "predicted ms", "error", "within budget"], rows))


def _measured_section(data: ReportData, figures: Mapping[str, str]) -> str:
    if not data.measured:
        return ""
    rows = []
    for m in data.measured:
        ratio = f"{m.measured_s / m.predicted_s:.2f}" if m.predicted_s else "&ndash;"
        kind = "" if m.predicted_s is None else ("calibrated" if m.calibrated else "what-if")
        rows.append([escape(display_name(m.config)), escape(str(m.link)), _ms(m.measured_s),
                     _ms(m.predicted_s), ratio, kind, escape(m.source)])
    return ("<h2>Measured next to predicted</h2>"
            + _figure(figures, "measured", "Median measured step time (colour) beside the cost "
                      "model's prediction (grey) for the same configuration and link.")
            + "<p>Baselines were measured as PyTorch's own hooks (fp16_compress_hook, "
              "powerSGD_hook); the predictions are of autotune's equivalents.</p>"
            + _table(["configuration", "link", "measured ms", "predicted ms", "measured / predicted",
                      "prediction", "source"], rows, left=2))


def _revisions_section(data: ReportData) -> str:
    if not data.revisions:
        return ""
    rows = []
    for ev in data.revisions:
        kind = str(ev.get("event"))
        measured = ev.get("measured_step_s")
        predicted = ev.get("predicted_step_s", ev.get("predicted_current_s"))
        link = ev.get("link_bps_estimate")
        detail = ""
        if kind in ("announce", "switch"):
            detail = f"{ev.get('old_policy')} &rarr; {ev.get('new_policy')}"
            if ev.get("predicted_new_s") is not None:
                detail += f" (new predicted {_ms(ev['predicted_new_s'])} ms)"
        elif kind == "keep":
            detail = f"kept {ev.get('policy')}"
        elif kind == "search_failed":
            detail = escape(str(ev.get("error", "")))
        rows.append([str(ev.get("step", "")), escape(kind), _ms(measured), _ms(predicted),
                     f"{rate_label(link)}/s" if isinstance(link, (int, float)) else "&ndash;",
                     escape(detail) if kind == "search_failed" else detail])
    return ("<h2>Online revisions</h2><p>The controller's decisions: measured step time at a "
            "drift check beside the prediction it was judged against, and the link it fitted.</p>"
            + _table(["step", "event", "measured ms", "predicted ms", "link estimate", "detail"],
                     rows, left=0))


def _layers_section(data: ReportData) -> str:
    rows = []
    for r in data.layers:
        rows.append([escape(r.name), escape("x".join(map(str, r.shape))), f"{r.grad_bytes / 1e6:.3f}",
                     _num(r.ready_ms, ".1f"), _num(r.backward_ms, ".2f"), escape(r.compressor),
                     _num(r.error_step, ".3f") if r.error_step is not None else '<span class="muted">not measured</span>',
                     _num(r.error_cum, ".3f") if r.error_cum is not None else "&ndash;"])
    who = "the policy" if data.policy is not None else "plain DDP (no policy given)"
    return (f"<h2>Per layer</h2><p>Compressor as chosen by {who}; errors are the codec probe's "
            "measurements on this job's real gradients (relative error of one step, and over the "
            "profiled steps with error feedback).</p>"
            + _table(["parameter", "shape", "gradient MB", "grad ready ms", "module backward ms",
                      "compressor", "error (step)", "error (cumulative)"], rows, left=2))


def render_page(data: ReportData, figures: Mapping[str, str], fingerprint: str = "") -> str:
    """The HTML of the report; ``figures`` maps figure keys to file names beside it."""
    cv = ", ".join(f"{k} {v:.0%}" for k, v in sorted(data.cv_error.items()))
    body = [
        f"<h1>autotune report: {escape(data.workload)}</h1>",
        f'<p class="env">{_env_line(data)}'
        + (f" &middot; profile {escape(fingerprint)}" if fingerprint else "") + "</p>",
        _verdict(data),
        "<h2>Where one step's time goes</h2>",
        _figure(figures, "timeline", "Predicted timeline of one step at the profiled link: "
                "forward, backward and optimizer (compute), encode/decode (codec) and collectives "
                "(comm, one channel per rank, buckets in order)."),
        "<h2>Is the network the bottleneck?</h2>",
        _figure(figures, "bandwidth", "Predicted step time against the link rate of each host. "
                "Shaded: where some compressor beats plain DDP. Diamonds: calibrated predictions "
                "at the profiled link; dots: measurements."),
        _sweep_table(data),
        _study_section(data, figures),
        _measured_section(data, figures),
        _revisions_section(data),
        _layers_section(data),
        f'<p class="muted">Cost model cross-validated errors: {escape(cv) or "n/a"}.</p>',
    ]
    title = f"autotune report: {data.workload}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(part for part in body if part) + "\n</body></html>\n")
