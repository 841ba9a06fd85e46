"""What starting autotune imports: ``autotune --help`` and ``autotune show`` load no heavy
library they do not need (torch included), a subcommand loads only its own module,
validating a policy loads no torch, and the training path never loads optuna or
scikit-learn.

Checked by module name in a fresh interpreter (``-X importtime`` lists every module it
imports), not by timing: this machine's CPU speed drifts.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_show import POLICY
from test_models import synthetic_profile

from autotune.cli._base import COMMANDS
from autotune.policies import Policy

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "optuna", "sklearn")


@functools.cache  # one fresh interpreter per command line: each one that loads torch costs seconds
def imported(*argv: str) -> frozenset[str]:
    """The top-level packages ``python -X importtime *argv`` imports (it must exit 0)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rpartition("|")[2].strip().split(".")[0])
    assert "autotune" in names, "no import was listed: is -X importtime still the format?"
    return frozenset(names)


@pytest.mark.parametrize("argv", [["--help"], ["show", "--help"], ["--version"]])
def test_help_imports_no_torch_optuna_or_sklearn(argv: list[str]) -> None:
    heavy = set(HEAVY) & imported("-m", "autotune", *argv)
    assert not heavy, f"autotune {' '.join(argv)} imported {sorted(heavy)}"


def _modules(*argv: str) -> set[str]:
    """The subcommand modules (``autotune.cli.<name>``) that ``autotune *argv`` loads.

    Read from ``sys.modules`` after the command, in a fresh interpreter: ``-X importtime``
    does not list a module loaded by ``importlib.import_module``, as the subcommands are.
    """
    code = ("import contextlib, io, sys\nfrom autotune.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    status = main({list(argv)!r})\n"
            "print(status, *sorted(m for m in sys.modules if m.startswith('autotune.cli.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, *names = proc.stdout.split()
    assert status == "0", proc.stderr[-2000:]
    return set(names) & {f"autotune.cli.{n}" for n in COMMANDS}


def test_main_help_loads_no_subcommand_module() -> None:
    assert not _modules("--help")


def test_a_subcommand_loads_its_own_module_and_the_ones_it_uses() -> None:
    # tune prints verification tables and checks the out path like profile does; it does
    # not load bench, demo, launch, report, show or simulate
    assert _modules("tune", "--help") == {"autotune.cli.tune",
                                                            "autotune.cli.profile"}


def test_tune_help_imports_no_optuna() -> None:
    # the tuner imports optuna when it runs a study, not when it is imported
    assert "optuna" not in imported("-m", "autotune", "tune", "--help")


@pytest.fixture(scope="module")  # module scope: the cached command lines name these paths
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("show")
    Policy.from_dict(POLICY).save(d / "policy.json")
    synthetic_profile("mlp").save(d / "profile.json")
    return {"policy": d / "policy.json", "profile": d / "profile.json"}


@pytest.mark.parametrize("kind", ["policy", "profile"])
def test_show_imports_no_optuna_or_sklearn(files: dict[str, Path], kind: str) -> None:
    heavy = {"optuna", "sklearn"} & imported("-m", "autotune", "show", str(files[kind]))
    assert not heavy, f"autotune show {kind}.json imported {sorted(heavy)}"


def test_show_policy_imports_no_torch(files: dict[str, Path]) -> None:
    # validating a policy reads the compressors' parameter tables (compressors/registry.py),
    # not their modules, which import torch
    assert "torch" not in imported("-m", "autotune", "show", str(files["policy"]))


def test_validating_a_policy_imports_no_torch(files: dict[str, Path]) -> None:
    # a policy's id and labels fill in defaults from the same tables
    code = (f"from autotune.policies import load_policy; p = load_policy({str(files['policy'])!r}); "
            "p.id, p.default.label(), [s.label() for s in p.layers.values()]")
    assert "torch" not in imported("-c", code)


def test_show_profile_imports_no_torch(files: dict[str, Path]) -> None:
    assert "torch" not in imported("-m", "autotune", "show", str(files["profile"]))


def test_the_training_path_imports_no_optuna_or_sklearn() -> None:
    heavy = {"optuna", "sklearn"} & imported(
        "-c", "import autotune; autotune.wrap, autotune.Policy, autotune.AutotuneDDP")
    assert not heavy, f"the training path imported {sorted(heavy)}"
