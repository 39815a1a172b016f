"""A student's source, read as data by the grader (never run here): the file checked before a
child starts, an untouched stub told apart from a written function, what the file calls by name,
and the constructs that reach past the exercise into the interpreter.

Everything here works on the text (``ast``), so the grader learns it without running a line of
the student's code; the child (:mod:`qkv.learn.child`) sees the rest at run time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from qkv.errors import InputError

# Names that, called, run text as code or fetch attributes by computed names.
_DYNAMIC_CALLS = {"eval", "exec", "compile", "__import__", "globals", "vars", "locals", "setattr", "delattr"}
# Modules through which a function can be reached without naming it (the interpreter's insides).
_REACHING_MODULES = {"ctypes", "gc", "inspect", "importlib", "sys", "builtins", "marshal", "pickle", "types",
                     "runpy", "operator", "functools", "qkv"}
# Dunder attributes that are ordinary in a solution.
_PLAIN_DUNDERS = {"__init__", "__call__", "__name__", "__doc__", "__len__", "__getitem__", "__iter__",
                  "__class__", "__repr__", "__str__", "__post_init__"}


def read_solution(name: str, path: Path) -> str:
    """The file's source, checked before anything runs: InputError (exit 2) for a missing file,
    a syntax error (file:line) or no top-level function ``name``."""
    if not path.is_file():
        raise InputError(f"{path} is not a file; write it with `qkv learn start {name}` (or name your file)")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    tree = parse(source, str(path))
    if name not in defined(tree):
        raise InputError(
            f"{path} defines no function {name}(...): the exercise checks a function of that name"
        )
    return source


def parse(source: str, filename: str = "<file>") -> ast.Module:
    """``ast.parse`` with a syntax error as InputError naming file:line."""
    try:
        return ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise InputError(f"{filename}:{e.lineno}: syntax error: {e.msg}") from None


def defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    names = {n.name for n in tree.body if isinstance(n, kinds)}
    return names | {t.id for n in tree.body if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}


def untouched(source: str, name: str) -> bool:
    """Whether function ``name`` is still the stub: its body (after a docstring) is only
    ``raise NotImplementedError(...)``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if not fns:
        return False
    body = list(fns[-1].body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    target = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(target, ast.Name) and target.id == "NotImplementedError"


@dataclass(frozen=True)
class Reading:
    """What the source says about forbidden calls: ``named`` (forbidden names it mentions, with
    the line) and ``reaching`` (constructs that reach past the exercise, with the line)."""

    named: tuple[str, ...]
    reaching: tuple[str, ...]


def read_calls(source: str, forbidden: tuple[str, ...]) -> Reading:
    """Every mention of a forbidden name (``F.softmax``, ``x.softmax``, ``from torch import
    softmax``) and every construct that could reach a function without naming it: ``getattr``
    with a computed name, ``eval``/``exec``/``__import__``, attributes such as ``__globals__`` or
    ``torch._C`` / ``torch.ops``, and modules such as ``ctypes``, ``gc``, ``importlib``, ``sys``."""
    tree = ast.parse(source)
    wanted = set(forbidden)
    named: list[str] = []
    reaching: list[str] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            if node.attr in wanted:
                named.append(f"{node.attr} (line {line})")
            if node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in _PLAIN_DUNDERS:
                reaching.append(f"{node.attr} (line {line})")
            if node.attr in ("_C", "ops", "_VariableFunctions", "_refs", "_prims", "_decomp"):
                reaching.append(f".{node.attr} (line {line})")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in _REACHING_MODULES:
                reaching.append(f"from {node.module} import (line {line})")
            for alias in node.names:
                if alias.name in wanted:
                    named.append(f"{alias.name} (line {line})")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _REACHING_MODULES:
                    reaching.append(f"import {alias.name} (line {line})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            f = node.func.id
            if f in _DYNAMIC_CALLS:
                reaching.append(f"{f}(...) (line {line})")
            elif f == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                reaching.append(f"getattr with a computed name (line {line})")
            elif f == "getattr" and len(node.args) >= 2 and node.args[1].value in wanted:  # type: ignore[union-attr]
                named.append(f"{node.args[1].value} (line {line})")  # type: ignore[union-attr]
        elif isinstance(node, ast.Name) and node.id in ("__builtins__", "__loader__", "__spec__"):
            reaching.append(f"{node.id} (line {line})")
    return Reading(tuple(dict.fromkeys(named)), tuple(dict.fromkeys(reaching)))


_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def definitions(texts: list[str]) -> tuple[str, list[str]]:
    """The top-level imports, functions and classes of ``texts`` (notebook cells or files), in
    order, as one module (a later definition of a name overrides an earlier one, as when the
    cells run in order), and the problems met (a text that does not parse: its index and line).
    IPython lines (``%magic``, ``!shell``) and the check harness's import (``from qkv.learn import
    check``) are dropped; nothing else runs."""
    parts: list[str] = []
    problems: list[str] = []
    for n, raw in enumerate(texts, 1):
        lines = [ln for ln in raw.splitlines() if not ln.lstrip().startswith(("%", "!"))]
        text = "\n".join(lines)
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            problems.append(f"cell {n}, line {e.lineno}: syntax error: {e.msg}")
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "qkv.learn" and \
                    {a.name for a in node.names} <= {"check", "run", "get"}:
                continue  # the notebook's own check harness, not the student's function
            if isinstance(node, _KEEP):
                decorators = getattr(node, "decorator_list", None)
                start = decorators[0].lineno if decorators else node.lineno
                parts.append("\n".join(text.splitlines()[start - 1: node.end_lineno]))
    return "\n\n".join(parts) + "\n", problems


def function_source(fn: object, name: str) -> str:
    """The source to judge for a function of this session (a notebook's ``check(name, fn)``):
    the definitions of every cell run so far in IPython (or of ``fn``'s file), then ``name =
    <fn's name>`` when the two differ. InputError when no source can be found (a lambda typed
    at a prompt, a built-in)."""
    import inspect

    texts: list[str] = []
    try:
        from IPython import get_ipython  # type: ignore[import-not-found]

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and isinstance(shell.user_ns.get("In"), list):
        texts = [t for t in shell.user_ns["In"] if isinstance(t, str)]
    else:
        try:
            texts = [Path(inspect.getsourcefile(fn) or "").read_text(encoding="utf-8")]  # type: ignore[arg-type]
        except (OSError, TypeError):
            texts = []
    own = getattr(fn, "__name__", "")
    if not texts or not own.isidentifier():
        try:
            texts = ["import math\nimport torch\n", inspect.getsource(fn)]  # type: ignore[arg-type]
        except (OSError, TypeError):
            raise InputError(f"no source for {fn!r}: define {name} with `def` in a cell or a file") from None
    source, _ = definitions(texts)
    source = needed(source, own)
    if own != name:
        source += f"\n{name} = {own}\n"
    return source


def needed(source: str, root: str) -> str:
    """Only what ``root`` needs from ``source``: itself, every top-level function or class its
    body names, transitively (the last definition of a name wins, as when cells run in order),
    and the imports of names they use. A notebook's other exercises and its check cells' imports
    neither run nor count against this one (an attention solution's softmax is not the softmax
    exercise's)."""
    tree = ast.parse(source)
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[node.name] = node
    if root not in defs:
        return source
    keep, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in keep or n not in defs:
            continue
        keep.add(n)
        todo += [x.id for x in ast.walk(defs[n]) if isinstance(x, ast.Name)]
    used = {x.id for n in keep for x in ast.walk(defs[n]) if isinstance(x, ast.Name)}
    used |= {x.value.id for n in keep for x in ast.walk(defs[n])
             if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name)}

    def wanted(node: ast.Import | ast.ImportFrom) -> bool:  # star imports, and those the kept use
        return any(a.name == "*" or (a.asname or a.name).split(".")[0] in used for a in node.names)

    lines = source.splitlines()
    parts = []
    for node in tree.body:
        if (isinstance(node, ast.Import | ast.ImportFrom) and wanted(node)) or (
                node in defs.values() and getattr(node, "name", "") in keep):
            decorators = getattr(node, "decorator_list", None)
            start = decorators[0].lineno if decorators else node.lineno
            parts.append("\n".join(lines[start - 1: node.end_lineno]))
    return "\n\n".join(parts) + "\n"
