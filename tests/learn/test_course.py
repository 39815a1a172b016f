"""`qkv learn export` and `qkv learn grade`: a student bundle with no solution in it, a separate
grader whose seeds the students never saw, and a class graded into CSV and JSON where a broken
submission (syntax error, wrong function, missing function, infinite loop) is a 0 with its reason
and never stops the grading; Gradescope's results.json for one submission.

The correct solutions below are written here (not the catalog's); the "cheating" softmax is
built from the public checks' own inputs: it passes `qkv learn check` and fails the grader."""

from __future__ import annotations

import csv
import json
import runpy
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call

from qkv.learn import EXERCISES, run
from qkv.learn.course import manifest
from qkv.learn.exercise import other_inputs
from qkv.learn.grading import notebook_source

nbformat = pytest.importorskip("nbformat")
pytestmark = pytest.mark.usefixtures("one_thread")

SOFTMAX = """
import torch

def softmax(x, dim=-1):
    shifted = x - x.max(dim=dim, keepdim=True).values
    num = shifted.exp()
    return num / num.sum(dim=dim, keepdim=True)
"""
CAUSAL = """
import torch

def causal_mask(T):
    return torch.ones(T, T, dtype=torch.bool).tril()
"""
SOFTMAX_DIM0 = """
import torch

def softmax(x, dim=-1):
    e = (x - x.max()).exp()
    return e / e.sum(0, keepdim=True)
"""


def solution_texts(text: str) -> list[str]:
    """What must not appear in a student's file: the body of a reference solution (as a whole,
    whitespace normalised) and each of its distinctive lines."""
    body = textwrap.dedent("\n".join(text.strip("\n").splitlines()[1:]))
    return [" ".join(body.split()), *[ln.strip() for ln in body.splitlines() if len(ln.strip()) >= 30]]


def test_export_writes_a_student_bundle_without_solutions_and_a_separate_grader(tmp_path):
    course = tmp_path / "course"
    rc, _, err = call(["learn", "export", "--course", str(course)])
    assert rc == 0, err
    student, grader = course / "student", course / "grader"
    assert sorted(p.name for p in course.iterdir()) == ["grader", "student"]  # nothing half written left
    # a stub per exercise, exactly what `qkv learn start` writes
    for e in EXERCISES.values():
        assert (student / "exercises" / f"{e.name}.py").read_text() == e.stub_file()
    readme = (student / "README.md").read_text()
    assert "qkv learn check NAME exercises/NAME.py" in readme and "qkv learn hint" in readme
    assert all(f"`{name}`" in readme for name in EXERCISES)
    notebooks = sorted((student / "notebooks").glob("*.ipynb"))
    assert notebooks, "one notebook per lecture with exercises"
    cells = [c for p in notebooks for c in nbformat.read(str(p), as_version=4).cells]
    in_notebooks = [c.metadata["qkv"]["exercise"] for c in cells
                    if c.metadata.get("qkv", {}).get("role") == "code"]
    assert sorted(in_notebooks) == sorted(EXERCISES)
    # no reference solution anywhere in the students' bundle (files as text, notebooks' cells too)
    texts = {}
    for p in student.rglob("*"):
        if p.is_file():
            raw = p.read_text(encoding="utf-8")
            if p.suffix == ".ipynb":
                raw += "\n" + "\n".join(c.source for c in nbformat.read(str(p), as_version=4).cells)
            texts[p] = (raw, " ".join(raw.split()))
    for e in EXERCISES.values():
        for piece in solution_texts(e.solution):
            leaks = [str(p) for p, (raw, flat) in texts.items() if piece in raw or piece in flat]
            assert not leaks, f"{e.name}'s solution ({piece[:60]!r}) is in {leaks}"
    # the grader: manifest, instructions, Gradescope's two scripts at the zip's root
    info = json.loads((grader / "manifest.json").read_text())
    assert [x["name"] for x in info["exercises"]] == list(EXERCISES)
    assert [x["points"] for x in info["exercises"]] == [e.difficulty for e in EXERCISES.values()]
    assert isinstance(info["seed_offset"], int) and info["seed_offset"] != 0 and info["scoring"] == "all"
    assert str(info["seed_offset"]) not in readme
    import zipfile

    with zipfile.ZipFile(grader / "autograder.zip") as z:
        assert {"setup.sh", "run_autograder", "manifest.json"} <= set(z.namelist())
        assert (z.getinfo("run_autograder").external_attr >> 16) & 0o111  # executable
        assert "qkv learn grade /autograder/submission" in z.read("run_autograder").decode()
    # Otter-Grader's test files: a public case (0 points) and the grader's, hidden, on moved seeds
    otter = {p.stem: p.read_text() for p in (grader / "otter" / "tests").glob("*.py")}
    assert sorted(otter) == sorted(EXERCISES)
    assert f"with other_inputs({info['seed_offset']}):" in otter["softmax"]
    assert "OK_FORMAT = False" in otter["softmax"] and 'name = "softmax"' in otter["softmax"]
    # never over an existing bundle without --force
    line = assert_one_line_error(*call(["learn", "export", "--course", str(course)])[::2])
    assert "exists" in line and "--force" in line
    rc, _, err = call(["learn", "export", "--course", str(course), "--force", "--exercises", "softmax"])
    assert rc == 0, err
    assert [p.name for p in (student / "exercises").iterdir()] == ["softmax.py"]


def test_the_otter_test_file_passes_a_right_function_and_fails_a_cheat(tmp_path, monkeypatch):
    """The exported Otter test, run as Otter runs it (its test functions given the student's
    globals as ``env``), with a stand-in for ``otter.test_files.test_case`` (Otter itself ran these
    files: docs/courses.md)."""
    import sys
    import types

    rc, _, err = call(["learn", "export", "--course", str(tmp_path / "c"), "--exercises", "softmax",
                       "--seed-offset", "99"])
    assert rc == 0, err
    fake = types.ModuleType("otter.test_files")
    fake.test_case = lambda **kw: (lambda f: f)
    monkeypatch.setitem(sys.modules, "otter", types.ModuleType("otter"))
    monkeypatch.setitem(sys.modules, "otter.test_files", fake)
    ns = runpy.run_path(str(tmp_path / "c" / "grader" / "otter" / "tests" / "softmax.py"))
    good = runpy.run_path(str(_write(tmp_path / "good.py", SOFTMAX)))
    ns["test_public_inputs"](good)
    ns["test_unseen_inputs"](good)
    cheat = runpy.run_path(str(cheating_softmax(tmp_path / "cheat.py")))
    ns["test_public_inputs"](cheat)
    with pytest.raises(AssertionError, match="softmax"):
        ns["test_unseen_inputs"](cheat)


def test_export_chooses_exercises_by_name_or_by_lecture(tmp_path):
    rc, _, err = call(["learn", "export", "--course", str(tmp_path / "a"), "--lecture", "lec22",
                       "--points", "one", "--seed-offset", "77", "--scoring", "fraction"])
    assert rc == 0, err
    from qkv.learn.notebook import find_lecture, lecture_exercises

    info = json.loads((tmp_path / "a" / "grader" / "manifest.json").read_text())
    want = [e.name for _, es in lecture_exercises(find_lecture("lec22")[1]) for e in es]
    assert [x["name"] for x in info["exercises"]] == want
    assert {x["points"] for x in info["exercises"]} == {1} and info["seed_offset"] == 77
    assert info["scoring"] == "fraction"
    assert [p.name for p in (tmp_path / "a" / "student" / "notebooks").iterdir()] == ["lec22.ipynb"]
    line = assert_one_line_error(*call(["learn", "export", "--course", str(tmp_path / "b"),
                                        "--exercises", "softmax,sofmax"])[::2])
    assert "sofmax" in line and "did you mean softmax" in line
    line = assert_one_line_error(*call(["learn", "export", "--course", str(tmp_path / "c"),
                                        "--seed-offset", "0"])[::2])
    assert "seed-offset 0" in line
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_a_notebooks_functions_are_read_without_running_it(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%matplotlib inline\nimport torch\nprint('runs nothing')"),
        nbformat.v4.new_code_cell("def causal_mask(T):\n    return None  # first try"),
        nbformat.v4.new_code_cell("def softmax(x, dim=-1)\n    return x"),
        nbformat.v4.new_code_cell("@torch.no_grad()\ndef causal_mask(T):\n"
                                  "    return torch.ones(T, T).bool().tril()"),
        nbformat.v4.new_code_cell("from qkv.learn import check\ncheck('causal_mask', causal_mask)\n1 / 0"),
    ])
    path = tmp_path / "s.ipynb"
    nbformat.write(nb, str(path))
    text, problems = notebook_source([path])
    assert problems == ["s.ipynb, code cell 3, line 1: syntax error: expected ':'"]
    assert "print(" not in text and "check(" not in text and "1 / 0" not in text
    ns = runpy.run_path(str(_write(tmp_path / "m.py", text)))
    assert ns["causal_mask"](3).tolist() == torch.ones(3, 3).bool().tril().tolist()  # the last one wins


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cheating_softmax(path: Path) -> Path:
    """A softmax that returns the public checks' expected outputs, looked up from the very inputs
    those checks draw, and something wrong elsewhere (smooth, so gradcheck is content)."""
    table = {}

    def key(x, dim):
        return json.dumps([list(x.shape), dim, str(x.dtype), x.detach().flatten().tolist()])

    def recorder(x, dim=-1):
        if not x.requires_grad:
            table[key(x, dim)] = torch.softmax(x.double(), dim=dim).to(x.dtype).flatten().tolist()
        return torch.softmax(x, dim=dim)

    run("softmax", recorder)
    assert len(table) >= 5
    return _write(path, f'''import json
import torch

TABLE = json.loads(r"""{json.dumps(table)}""")


def softmax(x, dim=-1):
    key = json.dumps([list(x.shape), dim, str(x.dtype), x.detach().flatten().tolist()])
    if not x.requires_grad and key in TABLE:
        return torch.tensor(TABLE[key], dtype=x.dtype).reshape(x.shape)
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / (e.sum(dim=dim, keepdim=True) + 1.0)
''')


def student_notebook(path: Path) -> Path:
    """Carol's notebook: softmax with a syntax error, causal_mask right (after a wrong first try)."""
    cells = [
        nbformat.v4.new_markdown_cell("# my work"),
        nbformat.v4.new_code_cell("import torch\nfrom qkv.learn import check"),
        nbformat.v4.new_code_cell("def softmax(x, dim=-1)\n    return x.exp() / x.exp().sum(dim)"),
        nbformat.v4.new_code_cell("def causal_mask(T):\n    return torch.ones(T, T, dtype=torch.bool)"),
        nbformat.v4.new_code_cell(CAUSAL),
        nbformat.v4.new_code_cell('check("causal_mask", causal_mask)'),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(path))
    return path


@pytest.fixture
def grader(tmp_path) -> Path:
    rc, _, err = call(["learn", "export", "--course", str(tmp_path / "course"), "--exercises",
                       "softmax,causal_mask", "--points", "one", "--seed-offset", "1234"])
    assert rc == 0, err
    return tmp_path / "course" / "grader"


def test_a_class_is_graded_into_csv_and_json_and_a_broken_submission_never_stops_it(tmp_path, grader):
    subs = tmp_path / "submissions"
    _write(subs / "alice" / "softmax.py", SOFTMAX)  # all correct
    _write(subs / "alice" / "causal_mask.py", CAUSAL)
    _write(subs / "bob" / "hw" / "softmax.py", SOFTMAX_DIM0)  # one exercise wrong (in a subfolder)
    _write(subs / "bob" / "hw" / "causal_mask.py", CAUSAL)
    student_notebook(subs / "carol.ipynb")  # a notebook: a syntax error in softmax's cell
    _write(subs / "erin" / "softmax.py", "def soft_max(x, dim=-1):\n    return x\n")  # no softmax
    cheat = cheating_softmax(subs / "mallory" / "softmax.py")
    # the cheat passes the public checks...
    public = run("softmax", runpy.run_path(str(cheat))["softmax"])
    assert public.passed, public.text()
    # ... and not the same checks on the grader's inputs
    with other_inputs(1234):
        assert not run("softmax", runpy.run_path(str(cheat))["softmax"]).passed

    out = tmp_path / "out"
    rc, stdout, err = call(["learn", "grade", str(subs), "--grader", str(grader), "-o", str(out),
                            "--jobs", "2", "--timeout", "240", "--no-progress"])
    assert rc == 0, err
    assert "graded 5 students on 2 exercises" in stdout
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert [r["student"] for r in rows] == ["alice", "bob", "carol", "erin", "mallory"]
    table = {r["student"]: (r["softmax"], r["causal_mask"], r["total"]) for r in rows}
    assert table == {
        "alice": ("1", "1", "2"),
        "bob": ("0", "1", "1"),
        "carol": ("0", "1", "1"),
        "erin": ("0", "0", "0"),
        "mallory": ("0", "0", "0"),
    }
    data = json.loads((out / "grades.json").read_text())
    assert data["max_total"] == 2 and [e["name"] for e in data["exercises"]] == ["softmax", "causal_mask"]
    by = {s["student"]: s for s in data["students"]}
    assert by["alice"]["total"] == 2 and by["alice"]["exercises"]["softmax"]["reason"] == ""
    assert by["alice"]["exercises"]["softmax"]["checks_passed"] == len(EXERCISES["softmax"].checks)
    bob = by["bob"]["exercises"]["softmax"]
    assert bob["score"] == 0 and "normalised along dim 0" in bob["reason"]
    assert 0 < bob["checks_passed"] < bob["checks_total"]
    carol = by["carol"]["exercises"]
    assert "carol.ipynb, code cell 2, line 1: syntax error" in carol["softmax"]["reason"]
    assert carol["causal_mask"]["score"] == 1 and carol["causal_mask"]["source"] == "carol.ipynb"
    assert "defines no function softmax" in by["erin"]["exercises"]["softmax"]["reason"]
    assert "no causal_mask.py" in by["erin"]["exercises"]["causal_mask"]["reason"]
    mallory = by["mallory"]["exercises"]["softmax"]
    assert mallory["score"] == 0 and "expected" in mallory["reason"]  # failed on inputs it never saw


def test_gradescope_results_for_one_submission_and_an_infinite_loop_is_a_zero(tmp_path, grader):
    sub = tmp_path / "submission"
    _write(sub / "softmax.py", SOFTMAX)
    _write(sub / "causal_mask.py", CAUSAL)
    results = tmp_path / "results"
    rc, _, err = call(["learn", "grade", str(sub), "--grader", str(grader), "-o", str(results),
                       "--format", "gradescope", "--timeout", "240"])
    assert rc == 0, err
    data = json.loads((results / "results.json").read_text())
    assert data["score"] == 2
    assert [(t["name"], t["score"], t["max_score"]) for t in data["tests"]] == [
        ("softmax", 1, 1), ("causal_mask", 1, 1)]
    assert all(t["visibility"] == "visible" and " checks pass on inputs you have not seen" in t["output"]
               for t in data["tests"])
    assert data["stdout_visibility"] == "hidden"

    # a wrong softmax: its score and check names visible, the hidden inputs' numbers after publication
    _write(sub / "softmax.py", "def softmax(x, dim=-1):\n    return x.exp() / x.exp().sum(0)\n")
    rc, _, err = call(["learn", "grade", str(sub), "--grader", str(grader), "-o", str(results),
                       "--format", "gradescope", "--timeout", "240"])
    tests = {t["name"]: t for t in json.loads((results / "results.json").read_text())["tests"]}
    assert rc == 0 and tests["softmax"]["score"] == 0 and "FAIL" in tests["softmax"]["output"], err
    assert "expected" not in tests["softmax"]["output"]  # no numbers of the hidden inputs before publication
    details = tests["softmax: what failed"]
    assert details["visibility"] == "after_published" and details["max_score"] == 0
    assert "expected" in details["output"]

    _write(sub / "causal_mask.py", "def causal_mask(T):\n    while True:\n        pass\n")
    (sub / "softmax.py").unlink()
    rc, _, err = call(["learn", "grade", str(sub), "--grader", str(grader), "-o", str(results),
                       "--format", "gradescope", "--timeout", "8"])
    assert rc == 0, err
    data = json.loads((results / "results.json").read_text())
    assert data["score"] == 0
    assert "no softmax.py" in data["tests"][0]["output"]
    assert "did not finish in 8 s" in data["tests"][1]["output"]


def test_bad_grading_input_is_one_line(tmp_path, grader):
    line = assert_one_line_error(*call(["learn", "grade", str(tmp_path), "--grader", str(tmp_path / "none"),
                                        "-o", str(tmp_path / "o")])[::2])
    assert "manifest.json" in line
    loose = tmp_path / "loose"
    _write(loose / "softmax.py", SOFTMAX)
    line = assert_one_line_error(*call(["learn", "grade", str(loose), "--grader", str(grader),
                                        "-o", str(tmp_path / "o")])[::2])
    assert "no student folder" in line and "softmax.py" in line
    line = assert_one_line_error(*call(["learn", "grade", str(tmp_path / "nope"), "--grader", str(grader),
                                        "-o", str(tmp_path / "o")])[::2])
    assert "not a folder" in line
    bad = _write(tmp_path / "g" / "manifest.json", json.dumps(manifest([EXERCISES["softmax"]], 5)).replace(
        '"softmax"', '"no_such_exercise"', 1))
    line = assert_one_line_error(*call(["learn", "grade", str(loose), "--grader", str(bad.parent),
                                        "-o", str(tmp_path / "o")])[::2])
    assert "no_such_exercise" in line
