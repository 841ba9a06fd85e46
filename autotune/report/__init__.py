"""``autotune report``: a static HTML page with PNG figures that shows the answer.

Where a step's time goes (the predicted timeline of plain DDP and of the tuned policy),
at which link rate compression starts to pay (step time against bandwidth for plain DDP,
fp16, PowerSGD and the policy), what the search traded (a study's trials as error against
predicted step time, with the Pareto front), a per-layer table, and measurements next to
predictions where a bench result or an online revision log is given.

matplotlib is an optional dependency (``pip install 'ddp-autotune[report]'``); it is
imported only here, when a report is written, and drawn with the Agg canvas.

Modules: ``data`` (predictions and inputs, no plotting), ``figures`` (matplotlib),
``page`` (the HTML).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from autotune.errors import AutotuneError
from autotune.jsonio import write_atomic

if TYPE_CHECKING:
    from autotune.policies import Policy
    from autotune.probes.profile import Profile
    from autotune.report.data import ReportData, StudyView

__all__ = ["INSTALL_HINT", "require_matplotlib", "write_report"]

INSTALL_HINT = "pip install 'ddp-autotune[report]'"


def require_matplotlib() -> None:
    """Raise a one-line :class:`AutotuneError` with the install hint if matplotlib is missing."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise AutotuneError(f"the report needs matplotlib, which is not installed: {INSTALL_HINT}") from None


def write_report(
    profile: Profile,
    out_dir: str | os.PathLike[str],
    baselines: Mapping[str, Policy | None],
    policy: Policy | None = None,
    study: StudyView | None = None,
    bench: Mapping[str, Any] | None = None,
    revisions: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Write ``out_dir/index.html`` and its figures; return the page's path.

    Figures are written first, each by a rename, and the page last, atomically: a failure
    leaves no half-written file, and an earlier page in ``out_dir`` stays whole.

    Args:
        profile: the profile the cost model is fitted to.
        out_dir: the report's directory (created if missing).
        baselines: name -> policy (None: plain DDP) to compare with; must hold ``ddp``.
        policy: the tuned policy.
        study: a study's trials (:func:`autotune.report.data.load_study`).
        bench: a bench result (:func:`autotune.report.data.load_bench`).
        revisions: online revision events (:func:`autotune.report.data.load_revisions`).

    Raises:
        AutotuneError: matplotlib is missing, or an input does not fit the profile.
    """
    require_matplotlib()
    from autotune.report import figures as fg
    from autotune.report.data import gather
    from autotune.report.page import render_page

    data = gather(profile, baselines, policy=policy, study=study, bench=bench, revisions=revisions)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[tuple[str, Callable[[ReportData], Any], bool]] = [
        ("timeline", fg.plot_timelines, True),
        ("bandwidth", fg.plot_bandwidth, data.sweep is not None),
        ("study", fg.plot_study, data.study is not None),
        ("measured", fg.plot_measured, any(m.predicted_s is not None for m in data.measured)),
    ]
    written: dict[str, str] = {}
    for key, plot, wanted in plots:
        if wanted:
            name = f"{key}.png"
            _write_png(plot(data), out / name)
            written[key] = name
    write_atomic(out / "index.html", render_page(data, written, profile.fingerprint),
                 AutotuneError, "report")
    return out / "index.html"


def _write_png(fig: Any, path: Path) -> None:
    from autotune.report.figures import save_png

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_png(fig, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
