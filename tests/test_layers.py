"""Layers import only downward, as docs/architecture.md's map says.

:data:`LAYERS` is the one place the order is written down: autotune's modules bottom-up,
a module maps to the layer of its top-level name (``autotune.probes.codecs`` is in
``probes``). Every import in the package is read from the AST: at module level, inside
functions, under ``if TYPE_CHECKING:``, and targets written as
``"autotune.module:function"`` (what the ranks run, the subcommands' parsers). Within a
layer anything goes; from a lower layer to a higher one nothing does, and an import of
another layer is made at module level, where a reader sees it, never deferred inside a
function (heavy third-party libraries may be: the tuner imports optuna when it runs).
The map in docs/architecture.md must name the same layers in the same order, and each of
its rows says what that layer may import.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"
DOC = PACKAGE.parent / "docs" / "architecture.md"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version", "jsonio", "links"),  # the ground floor
    ("compressors",),
    ("policies",),
    ("presets",),
    ("runtime",),
    ("workloads",),
    ("launch",),
    ("progress",),
    ("trials",),
    ("measure",),
    ("emulate",),
    ("probes",),
    ("models",),
    ("search",),
    ("online",),
    ("report",),
    # the entry points: the command line, and autotune/__init__.py, the public face,
    # whose names load on first use from the layers below
    ("cli", "__main__", ""),
)
"""autotune's layers, bottom-up; names are top-level modules or packages of autotune."""

_LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}
_TARGET = re.compile(r"^autotune(?:\.\w+)+:\w+$")  # what launch() runs on the ranks


@dataclass(frozen=True)
class Import:
    """One import of an autotune module by another."""

    importer: str  # dotted module name
    imported: str  # dotted module name (the longest prefix that is a module of the package)
    line: int
    how: str  # "module level", "deferred" (inside a function) or "launch target"


def _label(level: int) -> str:
    return " ".join(name or "autotune" for name in LAYERS[level])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The layer of a dotted module name of the package."""
    top = module.split(".")[1] if "." in module else ""
    if top not in _LEVEL:
        raise AssertionError(f"{module} is in no layer: add {top!r} to LAYERS in "
                             f"tests/test_layers.py and to the map in docs/architecture.md")
    return _LEVEL[top]


def _resolve(name: str) -> str:
    """``name`` as the module it loads: the longest prefix that is a module of ours."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts)


def imports_of(module: str) -> list[Import]:
    """Every import of a module of the package that ``module`` makes."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            how = "deferred" if inner else "module level"
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from autotune import compressors` loads the subpackage, not the face
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                         for a in child.names]
            elif isinstance(child, ast.Constant) and isinstance(child.value, str) \
                    and _TARGET.match(child.value):
                names, how = [child.value.partition(":")[0]], "launch target"
            for name in names:
                if name == "autotune" or name.startswith("autotune."):
                    found.append(Import(module, _resolve(name), child.lineno, how))
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), deferred=False)
    return found


ALL_IMPORTS = [imp for module in MODULES for imp in imports_of(module)]


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_the_scanner_sees_every_kind_of_import() -> None:
    # a few imports known to exist, one of each kind the scan must not miss
    seen = {(i.importer, i.imported, i.how) for i in ALL_IMPORTS}
    assert ("autotune.runtime.wrapper", "autotune.runtime.hook", "module level") in seen
    assert ("autotune.online.attach", "autotune.online.controller", "deferred") in seen
    assert ("autotune.cli._base", "autotune.cli.tune", "launch target") in seen  # COMMANDS
    assert ("autotune.search.verify", "autotune.measure", "launch target") in seen
    assert ("autotune.probes.codecs", "autotune.compressors", "module level") in seen  # `from autotune import compressors`


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_only_downward(module: str) -> None:
    upward = [i for i in imports_of(module) if layer_of(i.imported) > layer_of(module)]
    assert not upward, "\n".join(
        f"{MODULES[module].relative_to(PACKAGE.parent)}:{i.line}: {i.how} import of "
        f"{i.imported} (layer {_label(layer_of(i.imported))}) from layer "
        f"{_label(layer_of(module))}, which is below it" for i in upward)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_of_other_layers_are_not_deferred(module: str) -> None:
    deferred = [i for i in imports_of(module)
                if i.how == "deferred" and layer_of(i.imported) != layer_of(module)]
    assert not deferred, "\n".join(
        f"{MODULES[module].relative_to(PACKAGE.parent)}:{i.line}: import of {i.imported} "
        f"(layer {_label(layer_of(i.imported))}) inside a function: move it to the top of "
        f"the module" for i in deferred)


def _doc_rows() -> list[tuple[str, str]]:
    """(names, may import) of each row of the map in docs/architecture.md, bottom-up.

    A row starts at the left margin with the layer's modules, then two spaces and what it
    owns; its text goes on in indented lines and ends with "May import: ...".
    """
    text = DOC.read_text()
    section = text[text.index("## Layers"):]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1: block.index("```")]
    rows: list[list[str]] = []
    for line in block.splitlines():
        if line and not line.startswith(" "):
            names, _, rest = line.partition("  ")
            rows.append([names.strip(), rest])
        elif rows:
            rows[-1][1] += " " + line.strip()
    out = []
    for names, rest in rows:
        assert "May import:" in rest, f"docs/architecture.md: the row of {names} does not say what it may import"
        out.append((names, rest.rpartition("May import:")[2].strip()))
    return out


def _layer_names(cell: str) -> tuple[str, ...]:
    names = []
    for word in cell.replace(",", " ").split():
        word = word.removesuffix(".py").removesuffix("/")
        names.append("" if word == "autotune" else word)
    return tuple(names)


def test_the_documented_map_has_the_same_layers_in_the_same_order() -> None:
    documented = [_layer_names(names) for names, _ in _doc_rows()]
    assert documented == list(LAYERS)


def test_each_layer_imports_only_what_the_map_says_it_may() -> None:
    rows = _doc_rows()
    problems = []
    for level, (names, cell) in enumerate(rows):
        allowed: set[int] = {level}
        cell = cell.rstrip(".")
        if cell == "anything below":
            allowed |= set(range(level))
        elif cell and cell != "nothing":
            allowed |= {_LEVEL[name] for name in _layer_names(cell)}
        used = {layer_of(i.imported) for i in ALL_IMPORTS if layer_of(i.importer) == level}
        if used - allowed:
            extra = sorted(_label(u) for u in used - allowed)
            problems.append(f"{names}: imports {', '.join(extra)}, which its row does not allow")
    assert not problems, "\n".join(problems)
