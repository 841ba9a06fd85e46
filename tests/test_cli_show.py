"""Specification of ``autotune show`` and of how the CLI reports bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.policies import Policy, load_policy

ROOT = Path(__file__).resolve().parents[1]

POLICY = {
    "version": 1,
    "bucket_cap_mb": 40,
    "default": {"compressor": "fp16"},
    "layers": {
        "encoder.layers.0.self_attn.in_proj_weight": {"compressor": "powersgd", "rank": 4},
        "fc2.weight": {"compressor": "topk", "ratio": 0.01},
    },
    "meta": {"predicted_step_s": 0.25},
}


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(POLICY))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter, as a user's shell would (stdout is a pipe)."""
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; raise SystemExit(main())", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_show_prints_the_policy_as_a_table(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(good)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert Policy.from_dict(POLICY).id in out
    assert "bucket cap: 40 MB" in out and "default: fp16" in out
    # long names are written whole even though stdout is no terminal
    for name in POLICY["layers"]:
        assert name in out
    assert "powersgd" in out and "rank=4" in out and "ratio=0.01" in out
    assert "meta.predicted_step_s: 0.25" in out


def test_show_json_prints_the_canonical_json(
    good: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", str(good), "--json"]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out) == Policy.from_dict(POLICY).to_dict()
    assert out == load_policy(good).to_json() + "\n"


def test_show_in_a_fresh_process_exits_0(good: Path) -> None:
    result = run_cli("show", str(good))
    assert result.returncode == 0, result.stderr
    assert "fc2.weight" in result.stdout
    assert "encoder.layers.0.self_attn.in_proj_weight" in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize(
    "content, message",
    [
        pytest.param('{"version": 1,\n', "malformed JSON at line 2, column 1", id="malformed"),
        pytest.param(None, "cannot read policy or profile: No such file or directory", id="missing"),
        pytest.param(
            '{"version": 1, "layers": {"fc1.weight": {"compressor": "gzip"}}}',
            "layers['fc1.weight']: unknown compressor 'gzip'; registered: none,",
            id="unknown-compressor",
        ),
        pytest.param(
            '{"version": 1, "layers": {"fc1.weight": {"compressor": "powersgd", "rank": 0}}}',
            "The 'rank' parameter of powersgd must be an int in the range [1, 1024]. Got 0",
            id="bad-rank",
        ),
    ],
)
def test_show_bad_policy_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "policy.json"
    if content is not None:
        path.write_text(content)
    assert main(["show", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert err.startswith(f"autotune: error: {path}: ")
    assert message in err


def test_bad_policy_in_a_fresh_process_gives_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text("{not json")
    result = run_cli("show", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"autotune: error: {path}: malformed JSON at line 1, column 2: "
        "Expecting property name enclosed in double quotes"
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: COMMAND"),
        (["show"], "the following arguments are required: FILE.json"),
        (["show", "p.json", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("autotune: error: ")
    assert message in err


def test_help_shows_defaults_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # help wraps to the terminal width
    assert "--json" in out and "(default: False)" in out


def test_version_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    import autotune

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"autotune {autotune.__version__}"


def test_keyboard_interrupt_exits_130(
    good: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("autotune.cli.show.read_json", interrupted)
    assert main(["show", str(good)]) == 130
    assert "Traceback" not in capsys.readouterr().err
