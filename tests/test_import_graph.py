"""The one-way dependency rule (DESIGN.md, ARCHITECTURE.md), for every folder and top-level
module of qkv: each imports only from the layers below its own (and from its own folder), and no
module imports itself back through others. Read from the source with ``ast`` (every import, also
those inside functions and under ``TYPE_CHECKING``), so an upward import fails here even where no
test happens to execute it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "qkv"

# Lowest first. A module may import its own folder and any layer listed before its own; two
# folders in one layer are independent of each other. "qkv" is the package root (qkv.load).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("version", "errors", "figures", "fileio", "paths", "device", "presets", "assets", "owned"),  # helpers
    ("native",),  # native code built on this machine: keys, private folders, locks
    ("kernels",),  # qkv's own CPU kernels (compiled on first use)
    ("nn",),
    ("attention",),
    ("layers",),
    ("tokenizers",),
    ("data",),
    ("models",),
    ("generation",),
    ("lens",),  # reading and changing what a model computes (hooks on the blocks)
    ("viz",),  # pictures only: figures in, PNG files out
    ("training",),
    ("pipelines",),  # models ready to use, one typed value per kind
    ("pretrained", "families"),  # foreign checkpoints; model families (training and reading runs)
    ("inference",),  # what a name means, and opening it
    ("explain",),
    ("learn",),  # exercises: the lectures' functions written by a student, checked in a sandbox
    ("serve",),
    ("commands", "notebook"),
    ("cli", "qkv"),
    ("__main__",),
)
TIER = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "qkv":  # from qkv import viz
                out += [(node.lineno, f"qkv.{a.name}") for a in node.names]
    return out


def test_the_reader_sees_imports_inside_functions(tmp_path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import os\ndef g():\n    from qkv.viz import plot\n    from qkv import serve\n")
    assert imported_modules(f) == [(1, "os"), (3, "qkv.viz"), (4, "qkv"), (4, "qkv.serve")]


def _modules() -> dict[str, Path]:
    """Every module of qkv by dotted name (a package by its own name)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    """The folder or top-level module of qkv that ``module`` belongs to ("qkv" for the root)."""
    parts = module.split(".")
    return "qkv" if len(parts) == 1 else parts[1]


def _target(imported: str) -> str | None:
    """The qkv module an import statement names (``from qkv.x import y`` may name module x.y)."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def qkv_imports(path: Path) -> list[tuple[int, str]]:
    """(line, qkv module) of every import of qkv's own modules in the file: ``from pkg import
    mod`` names the module pkg.mod itself, not the package pkg."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            target = _target(name) if name == "qkv" or name.startswith("qkv.") else None
            if target is not None:
                out.append((node.lineno, target))
    return out


def _edges() -> dict[str, set[str]]:
    """module -> the qkv modules it imports."""
    return {m: {t for _, t in qkv_imports(path) if t != m} for m, path in MODULES.items()}


def test_every_folder_and_top_level_module_has_a_layer() -> None:
    unplaced = sorted({_layer(m) for m in MODULES} - set(TIER))
    assert not unplaced, f"place these in LAYERS (and ARCHITECTURE.md): {unplaced}"


@pytest.mark.parametrize("layer", [name for layer in LAYERS for name in layer])
def test_each_layer_imports_only_layers_below_it(layer: str) -> None:
    wrong = []
    for module, path in sorted(MODULES.items()):
        if _layer(module) != layer:
            continue
        for line, name in qkv_imports(path):
            other = _layer(name)
            if other != layer and TIER[other] >= TIER[layer]:
                where = f"{path.relative_to(ROOT.parent)}:{line}"
                wrong.append(f"{where} imports {name} ({other} is not below {layer})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    """No import circle at all, inside a folder too (``from x import y`` where x.y is a module
    counts as an import of x.y, not of the package x)."""
    cycles = import_cycles(_edges())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)
