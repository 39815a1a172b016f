"""Test helpers are written once: a helper a second test file needs moves to tests/helpers.py (or
to its folder's own module: attention/attention_cases.py, pretrained/gguf_writing.py,
serve/serve_helpers.py) and is imported from there, never copied, and no test file imports
another. Read from the source of every file under tests/, as test_import_graph.py reads qkv's.

Helpers that share only a name (each model test's ``cfg`` and ``model``, building its own
subject) are not copies; the same code under two names, or in two files, is."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(TESTS)): ast.parse(p.read_text(encoding="utf-8"))
            for p in sorted(TESTS.rglob("*.py"))}


def _what_it_does(node: ast.FunctionDef | ast.ClassDef) -> str:
    """The definition without its name, docstring and comments: its arguments and its body."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    args = ast.dump(node.args) if isinstance(node, ast.FunctionDef) else ""
    return args + ast.dump(ast.Module(body=body, type_ignores=[]))


def test_no_helper_is_written_twice() -> None:
    """Module-level functions, fixtures and classes other than tests: no two in different files
    have the same arguments and body."""
    seen: dict[str, str] = {}
    copies = []
    for path, tree in _trees().items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("test_"):
                where = f"{path}:{node.lineno} {node.name}"
                first = seen.setdefault(_what_it_does(node), where)
                if first.split(":")[0] != path:
                    copies.append(f"{where} repeats {first}")
    assert copies == [], "move the helper to tests/helpers.py and import it:\n" + "\n".join(copies)


def test_no_test_file_imports_another() -> None:
    """``from test_x import ...`` runs another test module's code a second time under another
    name; what two test files share belongs in a helpers module."""
    found = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path}:{node.lineno} imports {n}" for n in names
                      if any(part.startswith("test_") for part in n.split("."))]
    assert found == []


def test_the_checks_can_fail() -> None:
    """The two checks above see a copy and an import between test files when there is one."""
    a = ast.parse("def free_port():\n    '''One.'''\n    return 1\n").body[0]
    b = ast.parse("def port():\n    # another name, the same code\n    return 1\n").body[0]
    assert _what_it_does(a) == _what_it_does(b)
    c = ast.parse("def free_port():\n    return 2\n").body[0]
    assert _what_it_does(a) != _what_it_does(c)
