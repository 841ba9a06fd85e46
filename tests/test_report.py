"""`autotune report`: the page and its figures from a profile alone, with a policy, a
study, a bench result and a revision log; its failures; and the page in a real browser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from test_models import synthetic_profile

from autotune.cli import main
from autotune.models.cost_model import CostModel
from autotune.models.simulator import WhatIf
from autotune.policies import load_policy
from autotune.probes.profile import load_profile
from autotune.report.data import gather, load_bench, load_study, pareto_front
from autotune.search.tuner import baseline_policies, tune

pytest.importorskip("matplotlib", reason="the report needs matplotlib: pip install 'ddp-autotune[report]'")
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Refs(HTMLParser):
    """Every URL the page points at (src, href)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [v for k, v in attrs if k in ("src", "href") and v is not None]


def refs_of(page: Path) -> list[str]:
    parser = _Refs()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.refs


def check_report(out: Path) -> dict[str, Image.Image]:
    """The page exists, points only at files of its own directory, and each is a valid,
    non-empty PNG; returns them by name."""
    page = out / "index.html"
    assert page.is_file()
    refs = refs_of(page)
    assert refs, "the page shows no figure"
    images = {}
    for ref in refs:
        assert "/" not in ref and ":" not in ref, f"{ref}: not a file beside the page"
        data = (out / ref).read_bytes()
        assert data.startswith(PNG_MAGIC)
        with Image.open(out / ref) as img:
            img.load()  # decodes every pixel: a truncated file fails here
            assert img.width > 300 and img.height > 150
            darkest, lightest = img.convert("L").getextrema()
            assert darkest < 100 < lightest, f"{ref} is blank"
            images[ref] = img.copy()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")], "temporary files left"
    return images


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A profile on a 1 Gbit link, a policy tuned with a SQLite study, measured step times
    of the same workload (bench/results), and a real online revision log."""
    root = tmp_path_factory.mktemp("job")
    profile = synthetic_profile("cnn", link_bps=1e9)
    profile.save(root / "profile.json")
    storage = f"sqlite:///{root / 'study.db'}"
    result = tune(profile, trials=12, seed=0, storage=storage, study_name="cnn", refine=False)
    result.policy.save(root / "policy.json")
    # medians measured by bench/tuned_vs_baselines.py, shaped as `autotune bench --json`
    cell = next(c for c in json.loads((RESULTS / "tuned_vs_baselines.json").read_text())["cells"]
                if c["workload"] == "cnn" and c["link"] == "1gbit")
    bench = {"workload": "cnn", "world_size": 2, "link": "1gbit",
             "results": [{"name": n, "step_s": [cell["medians_s"][n]], "step_s_median": cell["medians_s"][n]}
                         for n in ("ddp", "fp16", "powersgd1", "powersgd4", "floor")]}
    (root / "bench.json").write_text(json.dumps(bench))
    # the decisions of a recorded online run (bench/online.py), as the controller logs them
    events = json.loads((RESULTS / "online.json").read_text())["revisions"]
    (root / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return {"root": root, "profile": root / "profile.json", "policy": root / "policy.json",
            "db": root / "study.db", "bench": root / "bench.json", "log": root / "log.jsonl"}


@pytest.fixture(scope="module")
def full_report(job: dict[str, Path]) -> Path:
    out = job["root"] / "report"
    argv = ["report", str(job["profile"]), "--policy", str(job["policy"]),
            "--study", f"sqlite:///{job['db']}", "--study-name", "cnn",
            "--bench", str(job["bench"]), "--revisions", str(job["log"]), "-o", str(out)]
    assert main(argv) == 0
    return out


def test_a_profile_alone_gives_a_timeline_and_the_bandwidth_curves(job: dict[str, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    assert main(["report", str(job["profile"]), "-o", str(out)]) == 0
    assert f"wrote {out / 'index.html'}" in capsys.readouterr().out
    images = check_report(out)
    assert sorted(images) == ["bandwidth.png", "timeline.png"]
    text = (out / "index.html").read_text()
    assert "Compression starts to pay below" in text and "plain DDP (no policy given)" in text


def test_a_full_report_shows_every_section(full_report: Path, job: dict[str, Path]) -> None:
    images = check_report(full_report)
    assert sorted(images) == ["bandwidth.png", "measured.png", "study.png", "timeline.png"]
    text = (full_report / "index.html").read_text()
    for heading in ("Where one step", "Is the network the bottleneck?", "Pareto front",
                    "Measured next to predicted", "Online revisions", "Per layer"):
        assert heading in text
    # measured numbers appear as read: the bench's DDP median, the log's first drift check
    bench = json.loads(job["bench"].read_text())
    ddp = next(r["step_s_median"] for r in bench["results"] if r["name"] == "ddp")
    assert f"{ddp * 1e3:.1f}" in text
    first = json.loads(job["log"].read_text().splitlines()[0])
    assert f"{first['measured_step_s'] * 1e3:.1f}" in text
    # every parameter of the profile has a row, with the policy's compressor
    policy = load_policy(job["policy"])
    for p in load_profile(job["profile"]).compute.params:
        label = policy.spec_for(p.name).canonical().label()
        assert f'<td class="l">{p.name}</td>' in text
        assert f'<td>{label}</td>' in text


def test_the_pareto_front_is_the_set_of_undominated_trials(job: dict[str, Path]) -> None:
    study = load_study(f"sqlite:///{job['db']}", None, load_profile(job["profile"]))
    points = [(t.step_s, t.error) for t in study.trials]
    front = set(study.front)
    assert front and study.front == pareto_front(points)
    for i, p in enumerate(points):
        dominated = any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)
        if i in front:
            assert not dominated
        elif points.count(p) == 1:  # of equal trials the front keeps one
            assert dominated


def test_the_crossover_is_where_compression_stops_beating_ddp(job: dict[str, Path]) -> None:
    profile = load_profile(job["profile"])
    model = CostModel.fit(profile)
    baselines = baseline_policies()
    data = gather(profile, baselines, model=model)
    sweep = data.sweep
    assert sweep is not None and sweep.compressing == {"fp16", "powersgd1", "powersgd4"}
    rate, by = sweep.compression_pays_below_bps, sweep.compression_pays_by
    assert rate is not None and sweep.rates_bps[0] < rate < sweep.rates_bps[-1]

    def step(name: str, bps: float) -> float:
        return model.predict(baselines[name], WhatIf(bandwidth_bps=bps)).step_s

    assert step(by, rate * 0.98) < step("ddp", rate * 0.98)
    for name in sweep.compressing:  # above it, no compressor beats plain DDP
        assert step(name, rate * 1.03) >= step("ddp", rate * 1.03)


def test_bench_cells_are_set_beside_predictions_at_their_own_link(job: dict[str, Path]) -> None:
    # bench/results/tuned_vs_baselines.json: real medians of cnn at 100 and 300 Mbit, 1 and
    # 4 Gbit (and on loopback, which has no link rate to predict at: left out)
    profile = load_profile(job["profile"])  # profiled at 1 Gbit
    model = CostModel.fit(profile)
    bench = load_bench(RESULTS / "tuned_vs_baselines.json")
    data = gather(profile, {"ddp": None}, bench=bench, model=model)
    cells = [c for c in bench["cells"] if c["workload"] == "cnn" and c["link"] != "unshaped"]
    assert len(data.measured) == sum(len(c["medians_s"]) for c in cells)
    rows = {(m.config, m.link): m for m in data.measured}
    for cell in cells:
        for name, seconds in cell["medians_s"].items():
            assert rows[(name, cell["link"])].measured_s == seconds
    here, slow = rows[("ddp", "1gbit")], rows[("ddp", "100mbit")]
    assert here.calibrated and here.predicted_s == model.predict(None).step_s
    assert not slow.calibrated
    assert slow.predicted_s == model.predict(None, WhatIf(world_size=2, bandwidth_bps=1e8)).step_s
    assert rows[("ddp5mb", "4gbit")].predicted_s is not None and rows[("tuned", "4gbit")].predicted_s
    assert rows[("floor", "100mbit")].predicted_s == model.compute.floor_s
    # configurations the report was not given are measured but not predicted
    assert rows[("fp16", "1gbit")].predicted_s is None


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--study-name", "cnn"], "--study-name needs --study"),
        (["--study", "sqlite:///missing.db"], "no such SQLite file"),
        (["--study", "STORAGE", "--study-name", "nope"], "has no study 'nope'"),
        (["--bench", "PROFILE"], "expected the JSON of `autotune bench --json`"),
        (["--revisions", "BENCH"], "line 1 has no 'event'"),
    ],
)
def test_bad_inputs_fail_in_one_line_and_write_nothing(job: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      extra: list[str], message: str) -> None:
    subs = {"STORAGE": f"sqlite:///{job['db']}", "PROFILE": str(job["profile"]),
            "BENCH": str(job["bench"])}
    argv = ["report", str(job["profile"]), "-o", str(tmp_path / "r"), *[subs.get(a, a) for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "r").exists()


def test_a_failed_run_leaves_the_earlier_report_whole(full_report: Path, job: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = (full_report / "index.html").read_bytes()
    bad = job["root"] / "other-model.json"
    bad.write_text(json.dumps({"version": 1, "layers": {"no.such.weight": {"compressor": "fp16"}}}))
    assert main(["report", str(job["profile"]), "--policy", str(bad), "-o", str(full_report)]) == 2
    assert "parameters the profiled model lacks: no.such.weight" in capsys.readouterr().err
    assert (full_report / "index.html").read_bytes() == before


def test_missing_matplotlib_gives_the_install_hint(job: dict[str, Path], tmp_path: Path) -> None:
    # a real failed import in a fresh interpreter: None in sys.modules makes `import
    # matplotlib` raise ImportError, as on a machine without the [report] extra
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from autotune.cli import main\n"
            f"sys.exit(main(['report', {str(job['profile'])!r}, '-o', {str(tmp_path / 'r')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "pip install 'ddp-autotune[report]'" in proc.stderr
    assert not (tmp_path / "r").exists()


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: Path, png: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Render ``page`` in headless Chromium into ``png`` (a fresh profile, no network)."""
    with tempfile.TemporaryDirectory() as user_dir:
        return subprocess.run(
            [chromium() or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={user_dir}", f"--screenshot={png}",
             "--window-size=1400,3000", page.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": user_dir},
        )


@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium package "
                    "(apt-get install chromium) to render the page headless; not installed here")
def test_the_page_renders_with_its_figures_in_headless_chromium(full_report: Path, tmp_path: Path) -> None:
    png = tmp_path / "page.png"
    proc = screenshot(full_report / "index.html", png)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Image.open(png) as shot:
        rgb = shot.convert("RGB")
    assert rgb.size == (1400, 3000)
    # colours that only the figures hold: plain DDP's line (bandwidth figure) and the
    # collectives' bars (timeline figure) must be on screen, so the images loaded
    colors: dict[Any, int] = {c: n for n, c in rgb.getcolors(maxcolors=1 << 24) or []}

    def near(target: tuple[int, int, int]) -> int:
        return sum(n for c, n in colors.items() if max(abs(a - b) for a, b in zip(c, target)) <= 12)

    assert near((0x4C, 0x72, 0xB0)) > 200, "plain DDP's curve is not on the page"
    assert near((0x31, 0xA3, 0x54)) > 200, "the timeline's collectives are not on the page"
