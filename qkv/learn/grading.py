"""Grading a class: reading the students' submissions, running every exercise's checks on inputs
they never saw, and the grades as CSV, JSON or Gradescope's results.json.

``qkv learn grade SUBMISSIONS --grader DIR/grader -o OUT`` (the CLI is :mod:`qkv.learn.course`,
beside ``qkv learn export``, which writes the grader's manifest) grades a class: SUBMISSIONS holds
one folder per student (``NAME.py`` files and/or notebooks, searched in subfolders too) or one
notebook per student (``STUDENT.ipynb``). From a notebook the top-level imports, functions and
classes of every code cell are kept (the last definition of a name wins, as when the cells run in
order); nothing else of the notebook runs. Each exercise of each student is judged by
:func:`qkv.learn.judge.judge`: the student's function runs in a child process of its own (time,
memory and process limits; as root an unprivileged user of its own slot, the grader's, the
submissions' and the output folders hidden, no network), the checks, on the grader's seed offset
(:func:`~qkv.learn.exercise.other_inputs`), run here, where the child cannot reach; a broken
submission (a syntax error, an infinite loop, a missing function, an exception, an import of qkv)
scores 0 for that exercise, with the
reason in ``grades.json``, and grading goes on. ``OUT/grades.csv`` has one row per student, one
column per exercise (the points earned: by default all of the exercise's points when every check
passes and 0 otherwise, as Otter's OK tests score; ``--scoring fraction`` at export: the points
times the fraction of checks passed) and the total; ``OUT/grades.json`` has every check's
outcome. ``--format gradescope`` grades one submission (SUBMISSIONS is that submission's folder,
/autograder/submission) into ``OUT/results.json`` in Gradescope's format
(https://gradescope-autograders.readthedocs.io/en/latest/specs/).
"""

from __future__ import annotations

import ast
import csv
import io
import json
import queue
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qkv.errors import InputError
from qkv.learn.judge import TIMEOUT_S, Isolation, run_checks
from qkv.learn.similarity import Match, closest, summary

MANIFEST = "manifest.json"  # the grader's file, written by `qkv learn export`
FORMAT = "qkv-learn-grader"  # its "format" field

Rows = list[tuple[str, list["Grade"]]]  # (student, a grade per exercise of the manifest)


# --------------------------------------------------------------------------- reading submissions


_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def notebook_source(paths: Sequence[Path]) -> tuple[str, list[str]]:
    """The top-level imports, functions and classes of the notebooks' code cells, in order, as
    one module (:func:`qkv.learn.source.definitions`: a later definition of a name overrides an
    earlier one, as when the cells run in order), and the problems met (a cell that does not
    parse: notebook, cell and line). Nothing else of the notebook runs."""
    from qkv.learn.notebook import require_nbformat
    from qkv.learn.source import definitions

    nbformat = require_nbformat()
    parts: list[str] = []
    problems: list[str] = []
    for path in paths:
        try:
            nb = nbformat.read(str(path), as_version=4)
        except Exception as e:  # nbformat raises several types for a damaged file
            problems.append(f"{path.name}: not a readable notebook ({type(e).__name__})")
            continue
        cells = [c.source for c in nb.cells if c.get("cell_type") == "code"]
        text, found = definitions(cells)
        parts.append(text)
        problems += [f"{path.name}, code {p}" for p in found]
    return "\n\n".join(parts), problems


@dataclass
class Submission:
    """One student's files: ``NAME.py`` files by exercise, and notebooks."""

    student: str
    files: dict[str, Path] = field(default_factory=dict)
    notebooks: list[Path] = field(default_factory=list)


def _files(folder: Path, names: Sequence[str]) -> Submission:
    sub = Submission(folder.name)
    found = sorted((p for p in folder.rglob("*") if p.is_file() and ".ipynb_checkpoints" not in p.parts),
                   key=lambda p: (len(p.parts), str(p)))
    for p in found:
        if p.suffix == ".py" and p.stem in names and p.stem not in sub.files:
            sub.files[p.stem] = p
        elif p.suffix == ".ipynb":
            sub.notebooks.append(p)
    return sub


def find_submissions(root: Path, names: Sequence[str], single: bool = False) -> list[Submission]:
    """The students of ``root``: each folder (``NAME.py`` files and/or notebooks, in subfolders
    too) and each ``STUDENT.ipynb`` directly in it; ``single``: ``root`` is one submission."""
    if not root.is_dir():
        raise InputError(f"{root} is not a folder of submissions")
    if single:
        sub = _files(root, names)
        sub.student = "submission"
        return [sub]
    subs = []
    for p in sorted(root.iterdir()):
        if p.name.startswith((".", "_")):
            continue
        if p.is_dir():
            subs.append(_files(p, names))
        elif p.suffix == ".ipynb":
            subs.append(Submission(p.stem, {}, [p]))
    if not subs:
        loose = [p.name for p in root.glob("*.py")]
        hint = (f" (it holds {', '.join(loose[:3])}: one student's files? put each student's in a folder "
                "of their own, or grade one submission with --format gradescope)") if loose else ""
        raise InputError(f"{root} holds no student folder and no STUDENT.ipynb{hint}")
    return subs


# --------------------------------------------------------------------------- grading


@dataclass(frozen=True)
class Grade:
    """One exercise of one student: points earned of ``max_score``, and why when not all."""

    exercise: str
    score: float
    max_score: float
    passed: int
    total: int
    reason: str = ""
    source: str = ""
    checks: tuple[dict[str, Any], ...] = ()
    report: str = ""
    similar: Match | None = None  # the most similar other solution (for review, never deducted)
    notes: tuple[str, ...] = ()  # what the grader could not isolate for this job

    def as_dict(self) -> dict[str, Any]:
        out = {"score": self.score, "max_score": self.max_score, "checks_passed": self.passed,
               "checks_total": self.total, "reason": self.reason, "source": self.source,
               "checks": list(self.checks)}
        if self.similar is not None:
            out["similar"] = {"to": self.similar.other, "score": round(self.similar.score, 3)}
        if self.notes:
            out["isolation_notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class Job:
    """One exercise of one student to grade: the file holding the function, or why there is none."""

    student: str
    exercise: str
    points: float
    path: Path | None
    missing: str
    source: str


def _grade_one(job: Job, seed_offset: int, timeout: float, fraction: bool, isolation: Isolation) -> Grade:
    """The grade of one job: its function run in a child, its checks here, on inputs moved by
    ``seed_offset``."""
    name, points, source = job.exercise, job.points, job.source
    if job.path is None:
        return Grade(name, 0.0, points, 0, 0, job.missing, source)
    try:
        report = run_checks(name, job.path, timeout, seed_offset=seed_offset, isolation=isolation)
    except InputError as e:
        return Grade(name, 0.0, points, 0, 0, str(e), source)
    ok = sum(c.ok for c in report.checks)
    total = len(report.checks)
    if report.error:
        reason = report.error
    else:
        failed = [c for c in report.checks if not c.ok]
        reason = "" if not failed else "; ".join(f"{c.name}: {c.message}" for c in failed[:2])[:600]
    if report.error or not total:
        score = 0.0
    else:
        score = round(points * ok / total, 3) if fraction else (float(points) if ok == total else 0.0)
    return Grade(name, score, points, ok, total, reason, source,
                 tuple(c.as_dict() for c in report.checks), report.text(), notes=report.notes)


def _jobs(sub: Submission, exercises: Sequence[dict[str, Any]], work: Path) -> list[Job]:
    """What to run for one student: per exercise its ``NAME.py``, else the notebooks' functions
    gathered in one file, else nothing (a 0 with the reason)."""
    nb_file, problems = None, []
    if sub.notebooks and any(e["name"] not in sub.files for e in exercises):
        text, problems = notebook_source(sub.notebooks)
        folder = work / f"{len(list(work.iterdir()))}"
        folder.mkdir()
        nb_file = folder / "notebook.py"
        nb_file.write_text(text, encoding="utf-8")
    out = []
    for e in exercises:
        name = e["name"]
        if name in sub.files:
            out.append(Job(sub.student, name, e["points"], sub.files[name], "", str(sub.files[name])))
        elif nb_file is not None:
            defined = {n.name for n in ast.parse(nb_file.read_text()).body if isinstance(n, _KEEP[2:])}
            src = ", ".join(p.name for p in sub.notebooks)
            if name in defined:
                out.append(Job(sub.student, name, e["points"], nb_file, "", src))
            else:
                why = f"no {name}.py, and no notebook cell defines {name}(...)" + "".join(
                    f"; {p}" for p in problems)
                out.append(Job(sub.student, name, e["points"], None, why, src))
        else:
            out.append(Job(sub.student, name, e["points"], None,
                           f"no {name}.py (and no notebook) in the submission", ""))
    return out


def read_manifest(grader: Path) -> dict[str, Any]:
    """The grader's manifest (``grader`` is its folder or the file), checked."""
    path = grader / MANIFEST if grader.is_dir() else grader
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"--grader {grader}: no {MANIFEST} (`qkv learn export` writes it)") from None
    except (OSError, ValueError) as e:
        raise InputError(f"--grader {grader}: cannot read {path.name} ({e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not info.get("exercises"):
        raise InputError(f"{path} is not a qkv grader manifest; `qkv learn export --course DIR` writes one")
    from qkv.learn import get

    for e in info["exercises"]:
        get(e["name"])  # an exercise this qkv does not have: InputError naming them
    return info


def grade(
    submissions: Path,
    info: dict[str, Any],
    jobs: int = 1,
    timeout: float | None = None,
    single: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    hidden: Sequence[Path] = (),
) -> Rows:
    """(student, a grade per exercise of the manifest) for every student of ``submissions``;
    ``jobs`` exercises checked at a time, each in a child process with the time limit ``timeout``
    (default: the manifest's); ``single``: ``submissions`` is one submission's folder;
    ``progress(done, total, what)`` is called as jobs finish; ``hidden``: folders besides
    ``submissions`` that no student's code may see (the grader's, the output)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    exercises = info["exercises"]
    names = [e["name"] for e in exercises]
    subs = find_submissions(submissions, names, single)
    limit = float(timeout if timeout is not None else info.get("timeout_s", TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="qkv-grade-") as tmp:
        todo = [j for sub in subs for j in _jobs(sub, exercises, Path(tmp))]
        results: dict[tuple[str, str], Grade] = {}
        if progress is not None:
            progress(0, len(todo), "")
        slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(max(1, jobs)):
            slots.put(i)
        hide = [submissions, *(hidden or ())]
        fraction = info.get("scoring") == "fraction"

        def one(j: Job) -> Grade:
            slot = slots.get()  # a slot per running job: as root, its own unprivileged user
            try:
                return _grade_one(j, int(info["seed_offset"]), limit, fraction,
                                  Isolation.for_grading(slot, hide))
            finally:
                slots.put(slot)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(one, j): j for j in todo}
            for done, fut in enumerate(as_completed(futures), 1):
                j = futures[fut]
                results[(j.student, j.exercise)] = fut.result()
                if progress is not None:
                    progress(done, len(todo), f"{j.student}: {j.exercise}")
        texts = {(j.student, j.exercise): j.path.read_text(encoding="utf-8", errors="replace")
                 for j in todo if j.path is not None}
    for n in names:  # the most similar other solution, per student and exercise (for review)
        from qkv.learn import get

        found = closest(n, {s: t for (s, e), t in texts.items() if e == n}, get(n).solution)
        for s, match in found.items():
            results[(s, n)] = replace(results[(s, n)], similar=match)
    return [(s.student, [results[(s.student, n)] for n in names]) for s in subs]


# --------------------------------------------------------------------------- the grades, written


SIMILAR_COLUMN = "similar (to review; never deducted)"


def _csv(rows: Rows, names: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["student", *names, "total", SIMILAR_COLUMN])
    for student, grades in rows:
        w.writerow([student, *(f"{g.score:g}" for g in grades), f"{sum(g.score for g in grades):g}",
                    summary(g.similar for g in grades if g.similar is not None)])
    return buf.getvalue()


def _json(rows: Rows, info: dict[str, Any]) -> dict[str, Any]:
    max_total = sum(e["points"] for e in info["exercises"])
    return {
        "exercises": [{"name": e["name"], "points": e["points"]} for e in info["exercises"]],
        "max_total": max_total,
        "students": [
            {"student": s, "total": round(sum(g.score for g in gs), 3), "max_total": max_total,
             "exercises": {g.exercise: g.as_dict() for g in gs}}
            for s, gs in rows
        ],
    }


def _gradescope(grades: list[Grade]) -> dict[str, Any]:
    """Gradescope's results.json: per exercise a visible test (its score and which checks passed,
    by name) and a test of 0 points with the checks' details, ``after_published``: the hidden
    inputs' numbers are seen only once the grades are published. The grader's own stdout is
    hidden from students."""
    tests = []
    for g in grades:
        if g.checks:
            names = "\n".join(f"{'ok  ' if c['ok'] else 'FAIL'}  {c['name']}" for c in g.checks)
            summary_text = f"{g.passed}/{g.total} checks pass on inputs you have not seen\n{names}"
        else:
            summary_text = f"0 points: {g.reason}"
        tests.append({"name": g.exercise, "score": g.score, "max_score": g.max_score, "output": summary_text,
                      "visibility": "visible"})
        if g.checks and g.passed < g.total:
            tests.append({"name": f"{g.exercise}: what failed", "score": 0, "max_score": 0,
                          "output": g.report or g.reason, "visibility": "after_published"})
    return {"score": round(sum(g.score for g in grades), 3), "tests": tests, "visibility": "visible",
            "stdout_visibility": "hidden"}


def _write(path: Path, text: str) -> None:
    from qkv.fileio import atomic_write

    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_class(out: Path, rows: Rows, info: dict[str, Any]) -> tuple[Path, Path]:
    """``out/grades.csv`` (one row per student, one column per exercise, the total) and
    ``out/grades.json`` (every check's outcome), each written atomically; returns their paths."""
    names = [e["name"] for e in info["exercises"]]
    csv_path, json_path = out / "grades.csv", out / "grades.json"
    _write(csv_path, _csv(rows, names))
    _write(json_path, json.dumps(_json(rows, info), indent=1, ensure_ascii=False) + "\n")
    return csv_path, json_path


def write_gradescope(out: Path, grades: list[Grade]) -> Path:
    """``out/results.json`` in Gradescope's autograder format, written atomically; returns its path."""
    path = out / "results.json"
    _write(path, json.dumps(_gradescope(grades), indent=1, ensure_ascii=False) + "\n")
    return path
