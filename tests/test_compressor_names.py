"""No module outside ``compressors/`` decides anything by a compressor's name.

What a method is — its messages, its codec-cost features, whether it needs a matrix,
sums half-precision floats, is elementwise, depends on the data, its size knob, what it
does on a tensor's live rows — its class declares (:class:`autotune.compressors.Compressor`);
the simulator, the cost model, the search, the codec probe and the external models ask
the class. So a new method is one new module in ``compressors/``. This scanner walks the
AST of every module of the package outside ``compressors/`` and ``presets.py`` (the table
of PyTorch's set-ups, which names its methods) and flags a registered name (or a label
such as ``powersgd(rank=4)``) that is compared with, collected into a set of methods, or
used as a key of a dispatch table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import autotune
from autotune import compressors

PACKAGE = Path(autotune.__file__).parent
REPO = PACKAGE.parent
NAMES = frozenset(compressors.names())
# Modules that may name methods: the methods themselves, and the presets' table.
EXEMPT = ("autotune/compressors/", "autotune/presets.py")
# (file, word) pairs where the word is not a compressor's name, with why
ALLOWED = {
    # PyTorch's own hooks, by the names Setup.hook gives them in bench JSON; these lines
    # pick the hook's function and the bytes it sends
    ("autotune/measure.py", "fp16"): "PyTorch's fp16_compress_hook",
    ("autotune/measure.py", "bf16"): "PyTorch's bf16_compress_hook",
    ("autotune/measure.py", "powersgd"): "PyTorch's powerSGD_hook",
    ("autotune/cli/demo.py", "none"): "--link none: no emulated link",
}


def _is_name(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    word = node.value
    return word in NAMES or (word.endswith(")") and word.split("(", 1)[0] in NAMES)


def _names_in(node: ast.AST) -> list[str]:
    """The names among a literal collection's elements (``frozenset({...})`` too)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 \
            and node.func.id in ("frozenset", "set", "tuple", "list"):
        return _names_in(node.args[0])
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if _is_name(e)]  # type: ignore[attr-defined]
    return []


def findings(source: str, filename: str = "<snippet>") -> list[str]:
    """Every decision by a compressor's name in ``source``, as ``file:line: what``."""
    found: set[tuple[int, str, str]] = set()
    for node in ast.walk(ast.parse(source, filename)):
        words: list[str] = []
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                words += [operand.value] if _is_name(operand) else _names_in(operand)  # type: ignore[attr-defined]
            what = "compares with"
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_names_in(node)) >= 2:
            words, what = _names_in(node), "a set of methods"
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if k is not None and _is_name(k)]  # type: ignore[attr-defined]
            words, what = (keys, "a table keyed by") if len(keys) >= 2 else ([], "")
        for word in words:
            if (filename, word.split("(", 1)[0]) not in ALLOWED:
                found.add((getattr(node, "lineno", 0), what, word))
    return [f"{filename}:{line}: {what} {word!r}" for line, what, word in sorted(found)]


# ------------------------------------------------------------------ the scanner itself

FLAGGED = [
    'if spec.name == "powersgd": pass',
    'x = spec.name in ("fp16", "bf16")',
    'x = label != "powersgd(rank=4)"',
    '_CHEAP = ("none", "fp16", "bf16")',
    '_ELEMENTWISE = frozenset({"none", "fp16"})',
    'x = label in _CHEAP or name not in ["topk"]',
    'key = {"topk": "ratio", "powersgd": "rank"}.get(spec.name)',
]
PASSED = [
    'spec = {"compressor": "none"}',
    'grid = [{"compressor": "topk", "ratio": 0.01}, {"compressor": "sign"}]',
    'x = spec.name == PLAIN.name',
    'x = cls.elementwise and not cls.needs_matrix',
    'x = link == "1gbit"',
    'bytes_by = {"none": nbytes}',
    'help = "fp16, bf16 or powersgd"',
]


@pytest.mark.parametrize("snippet,flagged", [(s, True) for s in FLAGGED] + [(s, False) for s in PASSED])
def test_the_scanner_flags_decisions_by_name_not_data_nor_traits(snippet: str, flagged: bool) -> None:
    assert bool(findings(snippet)) == flagged, snippet


# ---------------------------------------------------------------------- the package


def test_no_module_outside_compressors_decides_by_a_compressor_name() -> None:
    scanned = {str(p.relative_to(REPO)): p for p in sorted(PACKAGE.rglob("*.py"))}
    scanned = {rel: p for rel, p in scanned.items() if not rel.startswith(EXEMPT)}
    assert "autotune/models/simulator.py" in scanned and len(scanned) > 30  # not an empty glob
    problems = [f for rel, p in scanned.items() for f in findings(p.read_text(encoding="utf-8"), rel)]
    assert problems == [], "ask the compressor's class instead:\n" + "\n".join(problems)


def test_the_allow_list_is_not_stale() -> None:
    for filename, word in ALLOWED:
        assert f'"{word}"' in (REPO / filename).read_text(encoding="utf-8"), \
            f"{filename} no longer names {word!r}; shrink ALLOWED"
