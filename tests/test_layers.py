"""Kiln's layers import downwards only, as the layer table of docs/architecture.md says: every import of every
module under kiln/ (read from its source, imports inside functions included) must stay in its own layer or name
a layer its row allows; the allowed layers must form no circle; and no layer's modules may import each other in a
circle. No module is imported: the source is read with `ast`."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kiln"
TABLE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """kiln.runtime.scheduler → runtime, kiln.llm → llm, kiln → kiln (the public API in kiln/__init__.py)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kiln"


def imports_in(source: str, package: str) -> list[tuple[str, int]]:
    """(Kiln module, line) of every import in `source`, a module of `package`, in line order: `from kiln.x import
    name` names the module kiln.x.name where that is a module (imported through its package), kiln.x otherwise."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((name if name in MODULES else base, node.lineno))
    return sorted((name, line) for name, line in found if name == "kiln" or name.startswith("kiln."))


@functools.cache
def imported_modules(module: str) -> list[tuple[str, int]]:
    path = MODULES[module]
    return imports_in(path.read_text(), module if path.name == "__init__.py" else module.rpartition(".")[0])


def layer_table() -> tuple[dict[str, set[str]], set[str]]:
    """(layer → what its row allows: layer names, and dotted module names (that module only); the layers of the
    first row, below every layer)."""
    text = TABLE.read_text()
    rows = [line for line in text[text.index("## Layers"):].splitlines() if line.startswith("| `kiln")]
    table, foundation = {}, None
    for row in rows:
        cells = row.strip().strip("|").split("|")
        assert len(cells) == 3, f"a layer row of {TABLE.name} has {len(cells)} cells, not 3: {row[:80]}"
        allowed = set(re.findall(r"`([\w.]+)`", cells[2]))
        for path in re.findall(r"`kiln/([\w.]*?)(?:/|\.py)?`", cells[0]):
            table["kiln" if path == "__init__" else path] = allowed
        foundation = foundation or set(table)
    return table, foundation


TABLE_ROWS, FOUNDATION = layer_table()
LAYERS = sorted({layer_of(m) for m in MODULES})


def as_layer(name: str) -> str:
    """A table entry's layer: `kiln.kernels` → kernels."""
    return layer_of(name) if "." in name else name


def allowed_layers(layer: str) -> set[str]:
    return {as_layer(name) for name in TABLE_ROWS[layer]} | FOUNDATION | {layer}


def test_every_layer_has_a_row():
    assert set(LAYERS) <= set(TABLE_ROWS), f"no row in {TABLE.name} for {sorted(set(LAYERS) - set(TABLE_ROWS))}"
    unknown = {name for allowed in TABLE_ROWS.values() for name in allowed if as_layer(name) not in TABLE_ROWS}
    assert not unknown, f"the table allows layers that do not exist: {sorted(unknown)}"


def on_circles(edges: dict[str, set[str]]) -> list[str]:
    """The nodes from which following `edges` leads back to themselves."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    return sorted(node for node in edges if node in reachable(node))


def test_the_table_has_no_circle():
    """The allowed imports order the layers: following them never leads back to where it started."""
    assert not on_circles({layer: allowed_layers(layer) - {layer} - FOUNDATION for layer in TABLE_ROWS})
    assert all(allowed_layers(f) == FOUNDATION for f in FOUNDATION), "the first row's layers import no other"


@pytest.mark.parametrize("layer", LAYERS)
def test_no_upward_import(layer):
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
             for m in MODULES if layer_of(m) == layer
             for target, line in imported_modules(m) if layer_of(target) not in allowed_layers(layer)]
    assert not wrong, f"{layer} may import {sorted(allowed_layers(layer))}; upward:\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", [layer for layer in LAYERS
                                   if any("." in name for name in TABLE_ROWS.get(layer, ()))])
def test_package_only_imports(layer):
    """A dotted entry (`kiln.kernels`) allows that module's own names, not its submodules."""
    only = {name for name in TABLE_ROWS[layer] if "." in name}
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
             for m in MODULES if layer_of(m) == layer
             for target, line in imported_modules(m) if layer_of(target) in {layer_of(n) for n in only}
             and target not in only]
    assert not wrong, f"{layer} may use {sorted(only)} only, not their submodules:\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", LAYERS)
def test_no_circle_inside_a_layer(layer):
    inside = {m for m in MODULES if layer_of(m) == layer}
    found = on_circles({m: {t for t, _ in imported_modules(m) if t in inside and t != m} for m in inside})
    assert not found, f"modules of {layer} on import circles: {found}"


def test_imports_inside_functions_and_relative_ones_count():
    source = "def load():\n    from ..builder import engine\n    import kiln.kernels.cpu\nfrom . import step\n"
    assert imports_in(source, "kiln.runtime") == [("kiln.builder.engine", 2), ("kiln.kernels.cpu", 3),
                                                  ("kiln.runtime.step", 4)]
