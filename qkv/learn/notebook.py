"""`qkv learn notebook LECTURE -o FILE.ipynb`: one lecture's exercises as a Jupyter notebook.

The notebook follows the lecture index (:data:`qkv.explain.lectures.LECTURES`): a title cell
(the lecture, its notes, how to work), then per section of the lecture that has exercises a
markdown cell with the section's title and, per exercise, a markdown cell (difficulty, what to
write, where qkv shows it), a code cell with the stub (the function, its docstring with the
formula, shapes and an example, ``raise NotImplementedError``) and a check cell
``from qkv.learn import check; check("NAME", NAME);`` that prints the report (one line per check,
"not written yet" while the stub is untouched) and never raises, so that "Run all" always runs to
the end. ``--solutions`` (teachers, CI) puts the reference solutions in the code cells.

A lecture is named by a short key (``lec21``, ``lec22``, ``disc10``, ``cs231n``) or by any part of
its name; the exercises are grouped by their ``section`` (a section title of the index), so the
exercises added to the catalog appear in their lecture's notebook without a list kept here.
nbformat is imported when a notebook is built, not at import.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.errors import InputError

if TYPE_CHECKING:
    from qkv.explain.lectures import Lecture
    from qkv.learn.exercise import Exercise

_KINDS = {"lecture": "lec", "discussion": "disc"}


def require_nbformat() -> Any:
    """The nbformat module, or InputError saying how to install it."""
    try:
        import nbformat
        import nbformat.v4  # the cell builders
    except ImportError:
        raise InputError("notebooks need nbformat: `pip install 'qkv[learn]'` (or nbformat)") from None
    return nbformat


def lecture_keys() -> dict[str, Lecture]:
    """Each lecture of the index by its short key: CS189's lectures and discussions as
    ``lec21``/``disc10``, another course by its name (``cs231n``), numbered only when a course
    has several lectures in the index."""
    from qkv.explain.lectures import LECTURES

    courses = [lec.name.split()[0].lower() for lec in LECTURES]
    main = max(set(courses), key=courses.count) if courses else ""
    keys: dict[str, Lecture] = {}
    for lec, course in zip(LECTURES, courses, strict=True):
        m = re.match(r"\S+\s+(\w+)\s+(\d+)", lec.name)
        kind, number = (m.group(1).lower(), m.group(2)) if m else ("", "")
        if course == main:
            key = f"{_KINDS.get(kind, kind[:4])}{number}"
        else:
            key = course if courses.count(course) == 1 else f"{course}-{kind[:4]}{number}"
        keys[key] = lec
    return keys


def find_lecture(key: str) -> tuple[str, Lecture]:
    """(key, lecture) for a short key or a part of a lecture's name (case-insensitive);
    InputError naming the keys otherwise."""
    keys = lecture_keys()
    want = key.strip().lower()
    if want in keys:
        return want, keys[want]
    hits = [(k, lec) for k, lec in keys.items() if want and want in lec.name.lower()]
    if len(hits) == 1:
        return hits[0]
    names = {lec.name.lower(): k for k, lec in keys.items()}
    close = difflib.get_close_matches(want, [*keys, *names], n=1, cutoff=0.8)
    if close and not hits:
        k = names.get(close[0], close[0])
        return k, keys[k]
    listed = "; ".join(f"{k} ({lec.name})" for k, lec in keys.items())
    why = f"{key!r} matches several lectures" if hits else f"no lecture {key!r}"
    raise InputError(f"{why}; name one of: {listed}")


def lecture_exercises(
    lecture: Lecture, exercises: Iterable[Exercise] | None = None
) -> list[tuple[str, list[Exercise]]]:
    """(section title, its exercises) for each section of ``lecture`` that has exercises, in the
    lecture's order; ``exercises``: the pool (default every exercise of the catalog)."""
    if exercises is None:
        from qkv.learn import EXERCISES

        exercises = EXERCISES.values()
    pool = list(exercises)
    out = []
    for section in lecture.sections:
        mine = [e for e in pool if e.section == section.title]
        if mine:
            out.append((section.title, mine))
    return out


def stub_function(exercise: Exercise) -> str:
    """The stub's function alone (its signature, docstring and ``raise NotImplementedError``),
    cut from :meth:`Exercise.stub_file` so that the notebook and ``qkv learn start`` agree."""
    source = exercise.stub_file()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == exercise.name:
            return ast.get_source_segment(source, node) or source
    return source


def _what(exercise: Exercise) -> str:
    """The stub's first paragraph, on one line: what to write."""
    first = exercise.stub.strip().split("\n\n")[0]
    return " ".join(first.split())


def _stars(difficulty: int) -> str:
    return "★" * difficulty + "☆" * max(0, 3 - difficulty)


def solution_region(exercise: Exercise) -> str:
    """The stub's function (signature, docstring) whose body is the reference solution between
    nbgrader's ``### BEGIN SOLUTION`` / ``### END SOLUTION`` delimiters (what else the solution
    defines goes inside the function, first), so that ``nbgrader generate_assignment`` gives the
    students the stub with ``raise NotImplementedError()`` in its body."""
    import textwrap

    sol = exercise.solution.strip("\n")
    lines = sol.splitlines()
    before: list[str] = []
    body: list[str] = []
    for node in ast.parse(sol).body:
        if isinstance(node, ast.FunctionDef) and node.name == exercise.name:
            body = textwrap.dedent("\n".join(lines[node.body[0].lineno - 1 : node.end_lineno])).splitlines()
        else:
            first = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
            before += textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])).splitlines()
    stub = stub_function(exercise).splitlines()
    assert stub[-1].strip().startswith("raise NotImplementedError")
    region = ["### BEGIN SOLUTION", *before, *body, "### END SOLUTION"]
    return "\n".join([*stub[:-1], *(("    " + ln) if ln else "" for ln in region)])


def _nbgrader(grade_id: str, solution: bool, points: int = 0) -> dict[str, Any]:
    """nbgrader's cell metadata (schema 3): an autograded answer cell, or an autograder-tests
    cell worth ``points``."""
    meta: dict[str, Any] = {"grade": not solution, "grade_id": grade_id, "locked": not solution,
                            "schema_version": 3, "solution": solution, "task": False}
    if not solution:
        meta["points"] = points
    return meta


def _nbgrader_test(name: str, seed_offset: int) -> str:
    """An autograder-tests cell: the public checks, then nbgrader's hidden tests (the same checks
    on inputs moved by ``seed_offset``), each an assert."""
    return "\n".join([
        "from qkv.learn import check",
        "",
        f'assert check("{name}", {name}).passed, "{name}: see the report above"',
        "### BEGIN HIDDEN TESTS",
        "from qkv.learn.exercise import other_inputs",
        "",
        f"with other_inputs({seed_offset}):  # the same checks on inputs the students never saw",
        f'    assert check("{name}", {name}).passed, "{name}: fails on other inputs"',
        "### END HIDDEN TESTS",
    ])


def build(
    key: str,
    lecture: Lecture,
    exercises: Sequence[Exercise] | None = None,
    solutions: bool = False,
    nbgrader_offset: int | None = None,
) -> Any:
    """The notebook (an ``nbformat`` v4 node) of ``lecture``'s exercises (default: every
    exercise of the catalog in its sections); InputError when it has none. ``nbgrader_offset``:
    nbgrader's source notebook instead (solutions between its delimiters, each check cell an
    autograder-tests cell that asserts, with the same checks on inputs moved by this offset as
    its hidden tests)."""
    nbf = require_nbformat().v4
    sections = lecture_exercises(lecture, exercises)
    if not sections:
        have = [k for k, lec in lecture_keys().items() if lecture_exercises(lec, exercises)]
        raise InputError(
            f"{lecture.name} ({key}) has no exercises yet; the lectures with exercises: "
            f"{', '.join(have) or 'none'}"
        )
    n = sum(len(es) for _, es in sections)
    teacher = (
        "\n\n**This copy holds the reference solutions** (for teachers and CI): do not give it to "
        "students; `qkv learn notebook KEY` without `--solutions` writes theirs."
        if solutions
        else ""
    )
    if nbgrader_offset is not None:
        teacher = (
            "\n\n**nbgrader's source notebook** (for teachers): put it in `source/ASSIGNMENT/` and run "
            "`nbgrader generate_assignment ASSIGNMENT`; the students' copy loses the solutions and the "
            "hidden tests, and each check cell asserts that every check passes."
        )
    cells = [
        nbf.new_markdown_cell(
            f"# {lecture.name}: exercises\n\n"
            f"{n} function{'s' if n != 1 else ''} of this lecture to write yourself, by section "
            f"(the notes: {lecture.notes}).\n\n"
            "How to work: run the first code cell (the imports). For each exercise, replace "
            "`raise NotImplementedError` with your code, run the cell, then run the check cell below "
            "it: it prints one line per check (`ok` or `FAIL` with what went wrong: the smallest input "
            "that fails, expected vs got, and the likely cause). An exercise not written yet says so "
            "and the notebook still runs to the end. Stuck: `!qkv learn hint NAME` shows the next hint. "
            "The same checks run from a terminal on a file: `qkv learn check NAME FILE`." + teacher
        ),
        nbf.new_code_cell("import math\n\nimport torch\n\nfrom qkv.learn import check"),
    ]
    for title, mine in sections:
        cells.append(nbf.new_markdown_cell(f"## {title}"))
        for e in mine:
            cells.append(
                nbf.new_markdown_cell(
                    f"### `{e.name}` {_stars(e.difficulty)} (difficulty {e.difficulty} of 3)\n\n"
                    f"Write `{e.name}{e.signature}`: {_what(e)}\n\n"
                    f"See it in qkv: `{e.see}`. A hint: `!qkv learn hint {e.name}`."
                )
            )
            code = e.solution.strip("\n") if solutions else stub_function(e)
            test = f'from qkv.learn import check\ncheck("{e.name}", {e.name});'
            code_meta: dict[str, Any] = {"qkv": {"exercise": e.name, "role": "code"}}
            test_meta: dict[str, Any] = {"qkv": {"exercise": e.name, "role": "check"}}
            if nbgrader_offset is not None:
                code, test = solution_region(e), _nbgrader_test(e.name, nbgrader_offset)
                code_meta["nbgrader"] = _nbgrader(e.name, solution=True)
                test_meta["nbgrader"] = _nbgrader(f"check_{e.name}", solution=False, points=e.difficulty)
            cells.append(nbf.new_code_cell(code, metadata=code_meta))
            cells.append(nbf.new_code_cell(test, metadata=test_meta))
    nb = nbf.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["qkv"] = {"lecture": lecture.name, "key": key,
                          "solutions": solutions or nbgrader_offset is not None}
    return nb


def write(nb: Any, path: Path, force: bool = False) -> Path:
    """Write ``nb`` to ``path`` atomically (never over an existing file unless ``force``)."""
    from qkv.fileio import atomic_write

    nbformat = require_nbformat()
    if path.exists() and not force:
        raise InputError(f"{path} exists; pass --force to overwrite it, or name another file with -o")
    if path.exists() and path.is_dir():
        raise InputError(f"{path} is a folder; name a .ipynb file with -o")
    nbformat.validate(nb)
    return atomic_write(path, lambda tmp: nbformat.write(nb, str(tmp)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    keys = lecture_keys()
    p.description = (
        "Write one lecture's exercises as a Jupyter notebook: per section of the lecture, each "
        "exercise's stub (formula, shapes, example) and a check cell that prints its report. "
        "LECTURE is one of: " + "; ".join(f"{k} ({lec.name})" for k, lec in keys.items())
        + ", or a part of a lecture's name."
    )
    p.add_argument("lecture", metavar="LECTURE", help=f"the lecture: {', '.join(keys)} (or part of its name)")
    p.add_argument("-o", "--output", default=None, help="the notebook to write (default ./qkv-KEY.ipynb)")
    p.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    p.add_argument(
        "--solutions",
        action="store_true",
        help="put the reference solutions in the code cells (for teachers and CI; not for students)",
    )
    p.add_argument(
        "--nbgrader",
        action="store_true",
        help="write nbgrader's source notebook (for teachers): solutions between its delimiters, check "
        "cells as autograder tests that assert, hidden tests on other inputs (docs/courses.md)",
    )
    p.add_argument("--seed-offset", type=int, default=None,
                   help="with --nbgrader: how far the hidden tests move the checks' seeds (default random)")


def main(args: argparse.Namespace) -> int:
    key, lecture = find_lecture(args.lecture)
    path = Path(args.output) if args.output else Path(f"qkv-{key}.ipynb")
    if path.suffix != ".ipynb":
        raise InputError(f"-o {path}: a notebook's name ends in .ipynb (-o {path.with_suffix('.ipynb')})")
    offset = None
    if args.nbgrader:
        import secrets

        if args.solutions:
            raise InputError("--nbgrader puts the solutions in already; drop --solutions")
        offset = args.seed_offset if args.seed_offset is not None else 1000 + secrets.randbelow(1_000_000)
        if offset == 0:
            raise InputError("--seed-offset 0 would hide nothing: the hidden tests would be the public ones")
    elif args.seed_offset is not None:
        raise InputError("--seed-offset goes with --nbgrader (for `qkv learn export`, give it there)")
    nb = build(key, lecture, solutions=args.solutions, nbgrader_offset=offset)
    write(nb, path, force=args.force)
    n = sum(1 for c in nb.cells if c.get("metadata", {}).get("qkv", {}).get("role") == "check")
    print(
        f"wrote {path}: {n} exercise{'s' if n != 1 else ''} of {lecture.name}"
        + (" with the reference solutions (not for students)" if args.solutions else "")
        + (f" as nbgrader's source notebook (hidden tests' seed offset {offset})" if args.nbgrader else "")
        + f"; open it with `jupyter lab {path}` (or any notebook editor) and run the cells in order"
    )
    return 0
