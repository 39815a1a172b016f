"""`qkv learn notebook`: one notebook per lecture, built from the lecture index and the catalog
(no list of exercises kept here), written atomically and never over a file unless --force; and
executed for real (nbclient, a python3 ipykernel): with the reference solutions every check cell
reports that every check passes, with the stubs every check cell says "not written yet" and the
notebook still runs to its end."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import assert_one_line_error, call

from qkv.errors import InputError
from qkv.explain.lectures import LECTURES
from qkv.learn import EXERCISES
from qkv.learn.notebook import build, find_lecture, lecture_exercises, lecture_keys

nbformat = pytest.importorskip("nbformat")

WITH_EXERCISES = [k for k, lec in lecture_keys().items() if lecture_exercises(lec)]


def role(cell) -> str | None:
    return cell.get("metadata", {}).get("qkv", {}).get("role")


def test_every_lecture_has_a_short_key_and_names_are_matched():
    keys = lecture_keys()
    assert [lec.name for lec in keys.values()] == [lec.name for lec in LECTURES]
    assert {"lec21", "lec22", "disc10", "cs231n"} <= set(keys)
    assert find_lecture("LEC22")[1].name.startswith("CS189 Lecture 22")
    assert find_lecture("discussion")[0] == "disc10"  # a part of the name
    assert find_lecture("lec 21")[0] == "lec21"  # a near miss
    with pytest.raises(InputError, match=r"no lecture 'lec99'.*lec21 .*lec22 .*disc10 .*cs231n"):
        find_lecture("lec99")
    with pytest.raises(InputError, match="several lectures"):
        find_lecture("transformers")  # CS189 Lec 22 and CS231N Lec 8


def test_every_exercise_is_in_exactly_one_lecture_notebook():
    """Grouping is by the exercise's section title: an exercise whose section is in no lecture
    would be in no notebook."""
    seen = [e.name for lec in LECTURES for _, es in lecture_exercises(lec) for e in es]
    assert sorted(seen) == sorted(EXERCISES)


@pytest.mark.parametrize("key", WITH_EXERCISES)
def test_the_notebook_follows_the_lecture_with_a_stub_and_a_check_per_exercise(key):
    _, lec = find_lecture(key)
    nb = build(key, lec)
    nbformat.validate(nb)
    cells = nb.cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith(f"# {lec.name}")
    assert "NotImplementedError" in cells[0].source and "qkv learn check" in cells[0].source
    assert cells[1].cell_type == "code" and "import torch" in cells[1].source
    sections = [c.source[3:] for c in cells if c.cell_type == "markdown" and c.source.startswith("## ")]
    want = [title for title, _ in lecture_exercises(lec)]
    assert sections == want  # the lecture's order
    titles = [s.title for s in lec.sections]
    assert sections == sorted(sections, key=titles.index)
    names = [e.name for _, es in lecture_exercises(lec) for e in es]
    code = [c for c in cells if role(c) == "code"]
    checks = [c for c in cells if role(c) == "check"]
    assert [c.metadata["qkv"]["exercise"] for c in code] == names
    for name, c, k in zip(names, code, checks, strict=True):
        e = EXERCISES[name]
        tree = ast.parse(c.source)
        (fn,) = tree.body
        assert isinstance(fn, ast.FunctionDef) and fn.name == name
        assert " ".join(ast.get_docstring(fn).split()) == " ".join(e.stub.split())  # the whole stub
        assert "raise NotImplementedError" in c.source
        assert k.source.splitlines() == ["from qkv.learn import check", f'check("{name}", {name});']
        i = cells.index(c)
        intro = cells[i - 1]
        assert intro.cell_type == "markdown" and f"`{name}" in intro.source and e.see in intro.source
        assert f"difficulty {e.difficulty} of 3" in intro.source
        # no reference solution in the students' notebook
        body = e.solution.strip().splitlines()[1:]
        assert all(line.strip() not in c.source for line in body if len(line.strip()) >= 30)


def test_the_command_writes_atomically_and_never_over_a_file_without_force(tmp_path):
    key = WITH_EXERCISES[0]
    out = tmp_path / "lecture.ipynb"
    rc, stdout, err = call(["learn", "notebook", key, "-o", str(out)])
    assert rc == 0, err
    assert f"wrote {out}" in stdout
    nb = nbformat.read(str(out), as_version=4)
    assert nb.metadata["qkv"] == {"lecture": find_lecture(key)[1].name, "key": key, "solutions": False}
    out.write_text("mine")
    line = assert_one_line_error(*call(["learn", "notebook", key, "-o", str(out)])[::2])
    assert "exists" in line and "--force" in line and out.read_text() == "mine"
    rc, _, err = call(["learn", "notebook", key, "-o", str(out), "--force", "--solutions"])
    assert rc == 0, err
    assert nbformat.read(str(out), as_version=4).metadata["qkv"]["solutions"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["lecture.ipynb"]  # no temporary file left
    rc, _, err = call(["learn", "notebook", "nonsense", "-o", str(tmp_path / "x.ipynb")])
    line = assert_one_line_error(rc, err)
    assert "lec22" in line and "cs231n" in line
    line = assert_one_line_error(*call(["learn", "notebook", key, "-o", str(tmp_path / "x.txt")])[::2])
    assert ".ipynb" in line


def test_a_lecture_without_exercises_is_refused(tmp_path):
    key, lec = "lec21", find_lecture("lec21")[1]
    with pytest.raises(InputError, match=r"CS189 Lecture 21.*\(lec21\) has no exercises yet"):
        build(key, lec, exercises=[EXERCISES[n] for n in EXERCISES if EXERCISES[n].section not in
                                   {s.title for s in lec.sections}])
    empty = [k for k, lec in lecture_keys().items() if not lecture_exercises(lec)]
    for k in empty:  # from the command: one line
        line = assert_one_line_error(*call(["learn", "notebook", k, "-o", str(tmp_path / "x.ipynb")])[::2])
        assert "no exercises yet" in line and WITH_EXERCISES[0] in line


def test_help_lists_the_lecture_keys():
    rc, out, _ = call(["learn", "notebook", "--help"])
    assert rc == 0
    for key in lecture_keys():
        assert key in out


# --------------------------------------------------------------------------- executed


def execute_every_lecture(folder: Path, solutions: bool, keys: list[str] | None = None) -> dict[str, str]:
    """Every lecture's notebook (or those of ``keys``), executed in order in one kernel (one
    kernel start instead of one per lecture: the cells are the notebooks' own, and no two
    lectures share an exercise):
    {exercise: what its check cell printed}. A cell that raises stops here (CellExecutionError)."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient

    books = [build(key, find_lecture(key)[1], solutions=solutions) for key in keys or WITH_EXERCISES]
    nb = books[0]
    nb.cells = [c for b in books for c in b.cells]
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute()
    return {c.metadata["qkv"]["exercise"]: "".join(o.get("text", "") for o in c.outputs)
            for c in nb.cells if role(c) == "check"}


SMALLEST = min(WITH_EXERCISES, key=lambda k: sum(len(es) for _, es in lecture_exercises(find_lecture(k)[1])))


def solutions_pass(folder: Path, keys: list[str]) -> None:
    reports = execute_every_lecture(folder, solutions=True, keys=keys)
    names = [e.name for key in keys for _, es in lecture_exercises(find_lecture(key)[1]) for e in es]
    assert sorted(reports) == sorted(names) and names
    for name, text in reports.items():
        m = re.search(r"(\d+)/(\d+) checks pass: well done\s*$", text)
        assert m and m.group(1) == m.group(2) == str(len(EXERCISES[name].checks)), f"{name}:\n{text}"


def test_with_the_solutions_every_check_cell_of_the_smallest_lecture_passes(tmp_path):
    """A lecture's notebook, executed: the reference solutions pass every check from the
    notebook (an IPython kernel: the check reads the cells' source, judged through the child)."""
    solutions_pass(tmp_path, [SMALLEST])


@pytest.mark.slow  # ~90 s (a child per check); benchmarks/learn_checks.py judges every solution too
def test_with_the_solutions_every_check_cell_of_every_lecture_passes(tmp_path):
    solutions_pass(tmp_path, WITH_EXERCISES)


def test_the_stubs_run_to_the_end_and_each_check_cell_says_not_written_yet(tmp_path):
    reports = execute_every_lecture(tmp_path, solutions=False)
    assert sorted(reports) == sorted(EXERCISES)
    for name, text in reports.items():
        assert f"{name} is not written yet (it raises NotImplementedError)" in text, text
        assert "well done" not in text


def test_nbgrader_source_notebook_cells_and_its_asserting_checks(tmp_path):
    """--nbgrader: the solution between nbgrader's delimiters inside the stub's function (so the
    students' copy keeps the signature and docstring), each check cell an autograder-tests cell
    (schema 3 metadata, points = difficulty) that asserts, with hidden tests on moved seeds.
    Executed: every assert passes with the solutions in place. (nbgrader itself turned this
    notebook into a students' copy and autograded it: docs/courses.md.)"""
    key = SMALLEST
    out = tmp_path / "source.ipynb"
    rc, stdout, err = call(["learn", "notebook", key, "--nbgrader", "--seed-offset", "4321", "-o", str(out)])
    assert rc == 0, err
    assert "seed offset 4321" in stdout
    nb = nbformat.read(str(out), as_version=4)
    answers = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    tests = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(answers) == len(tests) == sum(len(es) for _, es in lecture_exercises(find_lecture(key)[1]))
    for a, t in zip(answers, tests, strict=True):
        name = a.metadata["qkv"]["exercise"]
        e = EXERCISES[name]
        assert a.metadata["nbgrader"] == {"grade": False, "grade_id": name, "locked": False,
                                          "schema_version": 3, "solution": True, "task": False}
        assert t.metadata["nbgrader"] == {"grade": True, "grade_id": f"check_{name}", "locked": True,
                                          "points": e.difficulty, "schema_version": 3, "solution": False,
                                          "task": False}
        # what nbgrader's ClearSolutions leaves: the stub's function with a body that raises
        start, end = a.source.index("### BEGIN SOLUTION"), a.source.index("### END SOLUTION")
        cleared = a.source[:start] + "raise NotImplementedError()" + a.source[end + len("### END SOLUTION"):]
        fn = ast.parse(cleared).body[0]
        assert fn.name == name and " ".join(ast.get_docstring(fn).split()) == " ".join(e.stub.split())
        assert f'assert check("{name}", {name}).passed' in t.source
        hidden = t.source[t.source.index("### BEGIN HIDDEN TESTS"):t.source.index("### END HIDDEN TESTS")]
        assert "with other_inputs(4321):" in hidden
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # an assert failing raises
    for t in tests:
        text = "".join(o.get("text", "") for o in t.outputs)
        assert text.count("checks pass: well done") == 2, text  # the public and the hidden run
    line = assert_one_line_error(*call(["learn", "notebook", key, "--seed-offset", "5",
                                        "-o", str(tmp_path / "y.ipynb")])[::2])
    assert "--nbgrader" in line
