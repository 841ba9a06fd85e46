"""Security: nothing a user may receive is unpickled or executed, except a workload file.

Policies, profiles and cost models travel between people and machines; they are JSON
only. The online controller's policy broadcast is JSON bytes in a tensor. The one place
autotune runs code from a file is ``--workload path/to/file.py:fn``, which is documented
as running that file (like ``python file.py``).
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_models import synthetic_profile

import autotune
from autotune.cli import build_parser
from autotune.policies import Policy
from autotune.workloads import resolve_workload

PACKAGE = Path(autotune.__file__).parent
REPO = PACKAGE.parent

# Modules whose loaders unpickle, or execute, what they read.
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
# torch.distributed collectives that pickle Python objects between ranks
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list"}
# (file, call) pairs that are meant to run code: a workload file is a program the user runs
ALLOWED = {("autotune/workloads.py", "exec_module")}


def findings(source: str, filename: str = "<snippet>") -> list[str]:
    """Every way ``source`` may unpickle or execute data, as ``file:line: what``."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> dotted origin (import numpy as np: np -> numpy)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[(alias.asname or alias.name).split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module.split(".")[0] in UNSAFE_MODULES:
                flag(node, f"from {node.module} import ...")

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        last = name.rsplit(".", 1)[-1]
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if name in ("eval", "exec"):
            flag(node, f"{name}()")
        elif name.split(".")[0] in UNSAFE_MODULES and last.startswith("load"):
            flag(node, f"{name}()")
        elif name == "torch.load" and not _is_const(kwargs.get("weights_only"), True):
            flag(node, "torch.load() without weights_only=True")
        elif name == "numpy.load" and "allow_pickle" in kwargs and not _is_const(kwargs["allow_pickle"], False):
            flag(node, "numpy.load(allow_pickle=...)")
        elif name == "yaml.load" and not _dotted(kwargs.get("Loader"), aliases).endswith("SafeLoader"):
            flag(node, "yaml.load() without a SafeLoader")
        elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
            flag(node, f"{name}()")
        elif last == "read_pickle":
            flag(node, f"{name}()")
        elif last in OBJECT_COLLECTIVES:
            flag(node, f"{last}() pickles objects between ranks")
        elif name.startswith("skops.io.load") and "trusted" in kwargs and not _is_const(kwargs["trusted"], None):
            flag(node, "skops.io.load(trusted=...)")
        elif last in ("exec_module", "run_path", "run_module") and (filename, last) not in ALLOWED:
            flag(node, f"{last}() runs a file's code")
    return found


def _dotted(node: ast.AST | None, aliases: dict[str, str]) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ".".join(["?", *reversed(parts)])
    root = aliases.get(node.id, node.id)
    return ".".join([root, *reversed(parts)])


def _is_const(node: ast.AST | None, value: Any) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


# ------------------------------------------------------------------ the scanner itself

UNSAFE_SNIPPETS = [
    "import pickle",
    "from pickle import loads",
    "import joblib\njoblib.load(path)",
    "import torch\ntorch.load(path)",
    "import torch as T\nT.load(path, weights_only=False)",
    "from torch import load\nload(path)",
    "import numpy as np\nnp.load(path, allow_pickle=True)",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "import yaml\nyaml.unsafe_load(text)",
    "eval(text)",
    "exec(open(path).read())",
    "import pandas as pd\npd.read_pickle(path)",
    "import torch.distributed as dist\ndist.broadcast_object_list([policy], src=0)",
    "from torch.distributed import all_gather_object\nall_gather_object(out, obj)",
    "import runpy\nrunpy.run_path(path)",
    "spec.loader.exec_module(module)",
]
SAFE_SNIPPETS = [
    "import torch\ntorch.load(path, weights_only=True)",
    "import numpy as np\nnp.load(path)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import yaml\nyaml.safe_load(text)",
    "model.eval()",
    "import json\njson.loads(text)",
    "import torch.distributed as dist\ndist.broadcast(tensor, src=0)",
]


@pytest.mark.parametrize("snippet", UNSAFE_SNIPPETS)
def test_the_scanner_flags_unsafe_loading(snippet: str) -> None:
    assert findings(snippet), snippet


@pytest.mark.parametrize("snippet", SAFE_SNIPPETS)
def test_the_scanner_passes_safe_loading(snippet: str) -> None:
    assert findings(snippet) == []


# ---------------------------------------------------------------------- the package


def test_no_code_under_autotune_unpickles_or_executes_data() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30  # the whole package, not an empty glob
    problems = [f for path in files
                for f in findings(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert problems == [], "\n".join(problems)


def test_the_one_place_that_runs_a_file_is_the_workload_loader() -> None:
    """The allow-list is not stale: the workload loader still runs the file it is given."""
    for filename, call in ALLOWED:
        source = (REPO / filename).read_text(encoding="utf-8")
        assert f".{call}(" in source, f"{filename} no longer calls {call}; shrink ALLOWED"


def test_workload_flags_say_that_a_file_is_run() -> None:
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    with_workload = {name: sub for name, sub in subcommands.items()
                     if any(a.dest == "workload" for a in sub._actions)}
    assert {"profile", "tune", "bench", "demo"} <= set(with_workload)
    for name, sub in with_workload.items():
        help_text = " ".join(sub.format_help().split())
        assert "runs that file's code" in help_text, f"autotune {name} --help"
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert "runs that file's code" in readme and "never pickle" in readme


# ------------------------------------------------- the online policy broadcast, live

NONE = {"version": 1}
FP16 = {"version": 1, "default": {"compressor": "fp16"}}


def rank_switch_with_pickle_disabled(profile: str) -> dict[str, Any]:
    """A switch announced by rank 0 reaches every rank while every pickle entry point
    (the module's and the copies torch.distributed keeps) raises."""
    import torch.distributed.distributed_c10d as c10d

    work = resolve_workload("mlp")
    ddp = autotune.wrap(work.model, Policy.from_dict(NONE), online=True, profile=profile,
                        check_every=2, patience=10**6)
    opt = torch.optim.SGD(work.model.parameters(), lr=0.05)
    used: list[str] = []

    def disabled(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            used.append(name)
            raise RuntimeError(f"pickle.{name} called during training")
        return call

    names = ["loads", "load", "dumps", "dump", "Pickler", "Unpickler"]
    saved = {n: getattr(pickle, n) for n in names}
    saved_c10d = (c10d._pickler, c10d._unpickler)
    for n in names:
        setattr(pickle, n, disabled(n))
    c10d._pickler, c10d._unpickler = disabled("Pickler"), disabled("Unpickler")
    try:
        if dist.get_rank() == 0:
            ddp.controller.propose(Policy.from_dict(FP16), reason="test")
        for step in range(8):
            x, y = work.make_batch(step)
            opt.zero_grad()
            work.loss_fn(ddp(x), y).backward()
            opt.step()
    finally:
        for n, f in saved.items():
            setattr(pickle, n, f)
        c10d._pickler, c10d._unpickler = saved_c10d
    return {"policy": ddp.policy.id, "revision": ddp.controller.revision, "used": used}


@pytest.mark.multirank
def test_the_online_policy_broadcast_needs_no_pickle(run_ranks: Any, tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile("mlp", link_bps=2e10, latency_s=1e-4).save(profile)
    results = run_ranks("test_security:rank_switch_with_pickle_disabled", profile=str(profile), timeout=240)
    fp16 = Policy.from_dict(FP16).id
    for r in results:
        assert r["used"] == []
        assert r["policy"] == fp16 and r["revision"] == 1, r
