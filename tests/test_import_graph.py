"""The one-way dependency rule (DESIGN.md): the library's lower layers never import its higher
ones. Read from the source with ``ast`` (every import, also those inside functions), so an
upward import fails here even where no test happens to execute it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "qkv"
LOWER = ("nn", "attention", "layers", "models", "training", "generation", "tokenizers", "data")
HIGHER = ("qkv.viz", "qkv.serve", "qkv.commands", "qkv.cli", "qkv.families")


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


def upward_imports(layer: str, higher: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT.parent)}:{line} imports {mod}"
        for path in sorted((ROOT / layer).rglob("*.py"))
        for line, mod in imported_modules(path)
        if any(mod == h or mod.startswith(h + ".") for h in higher)
    ]


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_never_import_higher_ones(layer: str) -> None:
    upward = upward_imports(layer, HIGHER)
    assert not upward, "upward imports:\n" + "\n".join(upward)


# Among the higher layers: families sit below what users see (they may draw with viz, inside
# functions), and viz sits below serve and the command line.
USER_FACING = ("qkv.serve", "qkv.commands", "qkv.cli")
ABOVE = {"families": USER_FACING, "viz": USER_FACING}


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_families_and_viz_never_import_the_command_line_or_the_server(layer: str) -> None:
    upward = upward_imports(layer, ABOVE[layer])
    assert not upward, "upward imports:\n" + "\n".join(upward)
