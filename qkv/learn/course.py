"""A course from the exercises: a student bundle and a separate grader (``qkv learn export``), and
the command that grades a class with it (``qkv learn grade``, whose work is :mod:`qkv.learn.grading`).

``qkv learn export --course DIR [--exercises a,b | --lecture KEY]`` writes

- ``DIR/student/``: ``exercises/NAME.py`` (each stub, as ``qkv learn start`` writes it),
  ``notebooks/KEY.ipynb`` (one per lecture, :mod:`qkv.learn.notebook`) and a README (how to work,
  how to check with ``qkv learn check NAME FILE``, what to hand in). No reference solution.
- ``DIR/grader/``: ``manifest.json`` (the exercises, their points, and the seed offset that
  moves every check's random inputs to ones the students never saw: :func:`other_inputs`), a
  README for the teacher, Gradescope's ``setup.sh`` and ``run_autograder`` (also zipped as
  ``autograder.zip``) and Otter-Grader test files (``otter/tests/NAME.py``). Keep this folder
  from students: the offset is what makes the inputs unseen.

``qkv learn grade SUBMISSIONS --grader DIR/grader -o OUT`` grades a class into ``OUT/grades.csv``
and ``OUT/grades.json`` (``--format gradescope``: one submission into ``OUT/results.json``); what
it reads, runs and writes is described in :mod:`qkv.learn.grading`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.errors import InputError
from qkv.learn.grading import FORMAT, MANIFEST, grade, read_manifest, write_class, write_gradescope
from qkv.learn.judge import TIMEOUT_S

if TYPE_CHECKING:
    from qkv.learn.exercise import Exercise



# --------------------------------------------------------------------------- export


def _select(exercises: str | None, lecture: str | None) -> tuple[list[Exercise], str]:
    """The exercises to export and, in words, which."""
    from qkv.learn import EXERCISES, get
    from qkv.learn.notebook import find_lecture, lecture_exercises

    if exercises and lecture:
        raise InputError("give --exercises or --lecture, not both")
    if exercises:
        names = [n.strip() for n in exercises.split(",") if n.strip()]
        if not names:
            raise InputError("--exercises is empty; name them with commas: --exercises softmax,causal_mask")
        chosen = [get(n) for n in dict.fromkeys(names)]
        return chosen, f"{len(chosen)} exercises"
    if lecture:
        key, lec = find_lecture(lecture)
        chosen = [e for _, es in lecture_exercises(lec) for e in es]
        if not chosen:
            raise InputError(f"{lec.name} ({key}) has no exercises yet; `qkv learn list` shows them")
        return chosen, lec.name
    return list(EXERCISES.values()), "every exercise"


def _points(exercise: Exercise, policy: str) -> int:
    return exercise.difficulty if policy == "difficulty" else 1


def manifest(exercises: Sequence[Exercise], seed_offset: int, points: str = "difficulty",
             scoring: str = "all", timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The grader's manifest: what :func:`grade` reads. ``points``: "difficulty" (1-3) or "one";
    ``scoring``: "all" (an exercise's points when every check passes) or "fraction"."""
    if scoring not in ("all", "fraction"):
        raise InputError(f"scoring {scoring!r}: use 'all' or 'fraction'")
    from qkv.version import __version__

    return {
        "format": FORMAT,
        "version": 1,
        "qkv_version": __version__,
        "seed_offset": seed_offset,
        "scoring": scoring,
        "timeout_s": timeout_s,
        "exercises": [
            {"name": e.name, "section": e.section, "points": _points(e, points), "checks": len(e.checks)}
            for e in exercises
        ],
    }


def _student_readme(exercises: Sequence[Exercise], notebooks: Sequence[tuple[str, str]]) -> str:
    lines = [
        "# Exercises: attention and Transformers, written by you",
        "",
        "Each exercise is one function of the lectures (CS189 Lec 21-22 and Discussion 10, CS231N Lec 8).",
        "Install qkv (your course says how), then for each exercise:",
        "",
        "1. open `exercises/NAME.py`: its docstring gives the formula, the shapes, what not to call and",
        "   a small example; replace `raise NotImplementedError` with your code;",
        "2. check it: `qkv learn check NAME exercises/NAME.py` (exit code 0 when every check passes; each",
        "   failed check says what went wrong: the smallest input that fails, expected vs got, the likely",
        "   cause). Your file runs in a process of its own, with a time and memory limit;",
        "3. stuck? `qkv learn hint NAME` shows the next hint.",
        "",
        "Or work in a notebook: `notebooks/KEY.ipynb` holds one lecture's exercises, each with a check",
        "cell (`from qkv.learn import check; check(\"NAME\", NAME)`) that prints the same report.",
        "",
        "Hand in either the folder `exercises/` with your `NAME.py` files, or your notebook(s); keep each",
        "function's name and arguments as given. Your grade runs the same checks on other random inputs,",
        "so a function that is right passes both, and one that only fits the inputs you saw does not.",
        "",
        "## The exercises",
        "",
        "| exercise | difficulty | lecture section | see it in qkv |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{e.name}` | {e.difficulty} | {e.section} | `{e.see}` |" for e in exercises]
    if notebooks:
        lines += ["", "## Notebooks", ""] + [f"- `notebooks/{k}.ipynb`: {name}" for k, name in notebooks]
    return "\n".join(lines) + "\n"


def _grader_readme(info: dict[str, Any], student: str) -> str:
    total = sum(e["points"] for e in info["exercises"])
    return "\n".join([
        "# The grader (keep this folder from students)",
        "",
        f"`{MANIFEST}` lists the {len(info['exercises'])} exercises, their points (total {total}) and the",
        f"seed offset ({info['seed_offset']}) that moves every check's random inputs to ones the students",
        "never saw: a function that only reproduces the public checks' outputs fails here. Edit the points",
        f"in the manifest if you like; keep the offset secret. Scoring: {info['scoring']} (all: an",
        "exercise's points when every check passes, else 0; fraction: points x the fraction passed).",
        "",
        f"The students' bundle is `{student}`.",
        "",
        "## Grade a class",
        "",
        "    qkv learn grade SUBMISSIONS --grader THIS_FOLDER -o OUT",
        "",
        "SUBMISSIONS holds one folder per student (their `NAME.py` files, or their notebook) or one",
        "`STUDENT.ipynb` per student. OUT/grades.csv: one row per student, one column per exercise",
        "(the points earned), the total; OUT/grades.json: every check's",
        "outcome and, for a 0, the reason (syntax error, time limit, missing function...).",
        "`--jobs N` checks N exercises at a time, each in its own child process (default: up to 4);",
        "`--timeout S` is each exercise's time limit.",
        "",
        "## Gradescope",
        "",
        "`autograder.zip` holds `setup.sh`, `run_autograder` and the manifest at its root, as Gradescope's",
        "autograder specification asks (https://gradescope-autograders.readthedocs.io/en/latest/specs/):",
        "upload it as a programming assignment's autograder. `run_autograder` runs",
        "`qkv learn grade /autograder/submission --grader /autograder/source -o /autograder/results",
        "--format gradescope`, which writes results.json with one test per exercise. See docs/courses.md.",
        "",
        "## Otter-Grader",
        "",
        "`otter/tests/NAME.py`: one Otter test file per exercise (exception-based format) that runs qkv's",
        "checks on the student's function: a public case (0 points) and the grader's case on unseen",
        "inputs (hidden, the exercise's points). `otter check FILE -t otter/tests`, or",
        "`otter generate -t otter/tests` for Otter's own Gradescope autograder. See docs/courses.md.",
        "",
    ])


def _setup_sh(spec: str) -> str:
    return f"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu).
# qkv goes into a virtual environment of its own, with PyTorch's CPU wheels.
set -euo pipefail
apt-get install -y python3 python3-pip python3-venv
python3 -m venv /opt/qkv
/opt/qkv/bin/pip install --upgrade pip
/opt/qkv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch
cd /autograder/source
/opt/qkv/bin/pip install "{spec}"
"""


def _otter_test(name: str, points: int, seed_offset: int) -> str:
    """An Otter-Grader test file (its exception-based format) calling qkv's checks: a public case
    worth 0 points and the grader's case (the same checks on inputs moved by ``seed_offset``),
    hidden, worth the exercise's points. Checked with otter-grader 7.0 (`otter check`, `otter run`)."""
    return f'''"""{name}: qkv's checks, from an Otter test (https://otter-grader.readthedocs.io/)."""

from otter.test_files import test_case

OK_FORMAT = False

name = "{name}"
points = {points}


@test_case(points=0, hidden=False)
def test_public_inputs(env):
    from qkv.learn import run

    report = run("{name}", env["{name}"])
    assert report.passed, report.text()


@test_case(points={points}, hidden=True)
def test_unseen_inputs(env):
    from qkv.learn import run
    from qkv.learn.exercise import other_inputs

    with other_inputs({seed_offset}):
        report = run("{name}", env["{name}"])
    assert report.passed, report.text()
'''


RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission; the submission is in /autograder/submission and
# /autograder/results/results.json is the answer (one test per exercise).
set -uo pipefail
mkdir -p /autograder/results
/opt/qkv/bin/qkv learn grade /autograder/submission --grader /autograder/source \\
    -o /autograder/results --format gradescope --no-progress
"""


def export(
    course: Path,
    exercises: Sequence[Exercise],
    seed_offset: int,
    points: str = "difficulty",
    scoring: str = "all",
    qkv_spec: str | None = None,
    force: bool = False,
) -> tuple[Path, Path]:
    """Write ``course/student`` and ``course/grader`` (see the module doc); both are built in a
    temporary folder beside them and moved in place at the end, so a failure leaves nothing half
    written. Returns (student, grader)."""
    import zipfile

    from qkv.fileio import fsync_dir
    from qkv.learn.notebook import build, lecture_exercises, lecture_keys, require_nbformat
    from qkv.version import __version__

    if course.exists() and not course.is_dir():
        raise InputError(f"--course {course} is a file; name a folder")
    student, grader = course / "student", course / "grader"
    for p in (student, grader):
        if p.exists() and not force:
            raise InputError(f"{p} exists; pass --force to replace it, or name another --course folder")
    wheel = Path(qkv_spec) if qkv_spec and qkv_spec.endswith(".whl") else None
    if wheel is not None and not wheel.is_file():
        raise InputError(f"--qkv-spec {wheel}: no such wheel file")
    course.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qkv-export-", dir=course))
    try:
        s, g = tmp / "student", tmp / "grader"
        (s / "exercises").mkdir(parents=True)
        for e in exercises:
            (s / "exercises" / f"{e.name}.py").write_text(e.stub_file(), encoding="utf-8")
        notebooks = []
        nbformat = require_nbformat()
        for key, lec in lecture_keys().items():
            if lecture_exercises(lec, exercises):
                (s / "notebooks").mkdir(exist_ok=True)
                nbformat.write(build(key, lec, exercises), str(s / "notebooks" / f"{key}.ipynb"))
                notebooks.append((key, lec.name))
        (s / "README.md").write_text(_student_readme(exercises, notebooks), encoding="utf-8")
        g.mkdir()
        info = manifest(exercises, seed_offset, points, scoring)
        (g / MANIFEST).write_text(json.dumps(info, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (g / "README.md").write_text(_grader_readme(info, str(student)), encoding="utf-8")
        spec = f"qkv=={__version__}" if qkv_spec is None else qkv_spec
        if wheel is not None:
            shutil.copy2(wheel, g / wheel.name)
            spec = f"/autograder/source/{wheel.name}"
        (g / "setup.sh").write_text(_setup_sh(spec), encoding="utf-8")
        (g / "run_autograder").write_text(RUN_AUTOGRADER, encoding="utf-8")
        (g / "otter" / "tests").mkdir(parents=True)
        for e in info["exercises"]:
            text = _otter_test(e["name"], e["points"], seed_offset)
            (g / "otter" / "tests" / f"{e['name']}.py").write_text(text, encoding="utf-8")
        for f in ("setup.sh", "run_autograder"):
            (g / f).chmod(0o755)
        with zipfile.ZipFile(g / "autograder.zip", "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(g.iterdir()):
                if f.is_file() and f.name != "autograder.zip":
                    info_ = zipfile.ZipInfo(f.name)
                    info_.external_attr = (f.stat().st_mode & 0o777) << 16
                    z.writestr(info_, f.read_bytes(), zipfile.ZIP_DEFLATED)
        for p in (student, grader):
            if p.exists():
                shutil.rmtree(p)
        os.replace(s, student)
        os.replace(g, grader)
        fsync_dir(course)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return student, grader


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--course", required=True, metavar="DIR",
                   help="the folder to write: DIR/student (give it to students) and DIR/grader (keep it)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--exercises", metavar="A,B,...", help="these exercises (default: every exercise)")
    which.add_argument("--lecture", metavar="KEY",
                       help="one lecture's exercises (lec21, lec22, disc10, cs231n, or part of its name)")
    p.add_argument("--points", choices=("difficulty", "one"), default="difficulty",
                   help="an exercise's points: its difficulty (1-3) or 1 each (editable in the manifest)")
    p.add_argument("--scoring", choices=("all", "fraction"), default="all",
                   help="all: an exercise's points only when every check passes (Otter's OK tests score so); "
                   "fraction: its points times the fraction of checks passed")
    p.add_argument("--seed-offset", type=int, default=None,
                   help="how far the grader moves the checks' seeds (default: a random number)")
    p.add_argument("--qkv-spec", default=None, metavar="SPEC",
                   help="what Gradescope's setup.sh installs: a pip requirement (default qkv==VERSION) or "
                   "a path to a qkv wheel, copied into the grader")
    p.add_argument("--force", action="store_true", help="replace DIR/student and DIR/grader if they exist")


def export_main(args: argparse.Namespace) -> int:
    import secrets

    chosen, what = _select(args.exercises, args.lecture)
    offset = args.seed_offset if args.seed_offset is not None else 1000 + secrets.randbelow(1_000_000)
    if offset == 0:
        raise InputError("--seed-offset 0 would grade on the students' own inputs; choose another number")
    student, grader = export(Path(args.course), chosen, offset, args.points, args.scoring, args.qkv_spec,
                             args.force)
    print(f"wrote {student} ({what}: stubs, notebooks, README) and {grader} (manifest, Gradescope "
          f"autograder.zip): give students {student} only; grade with `qkv learn grade SUBMISSIONS "
          f"--grader {grader} -o OUT`")
    return 0


# --------------------------------------------------------------------------- grade (the command)


def add_grade_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("submissions", metavar="SUBMISSIONS",
                   help="a folder with one folder per student (NAME.py files and/or a notebook) or one "
                   "STUDENT.ipynb per student; with --format gradescope, one submission's folder")
    p.add_argument("--grader", required=True, metavar="DIR",
                   help="the grader folder `qkv learn export` wrote (its manifest.json)")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="where to write grades.csv and grades.json (results.json for gradescope)")
    p.add_argument("--format", choices=("course", "gradescope"), default="course",
                   help="course: grades.csv + grades.json for a class; gradescope: results.json for one "
                   "submission, in Gradescope's autograder format")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="exercises checked at a time, each in its own child process (default: the "
                   "cores, at most 4)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds each exercise may take, torch's import included (default: the "
                   f"manifest's, {TIMEOUT_S:g})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def grade_main(args: argparse.Namespace) -> int:
    """``qkv learn grade``: :func:`qkv.learn.grading.grade`, written and summed up (one line per
    student, the exercises scored 0 named)."""
    if args.jobs < 1:
        raise InputError(f"--jobs {args.jobs}: give at least 1")
    if args.timeout is not None and args.timeout <= 0:
        raise InputError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    info = read_manifest(Path(args.grader))
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise InputError(f"-o {out} is a file; name a folder")
    single = args.format == "gradescope"
    bar, update = _progress_bar(not args.no_progress and not single)
    try:
        rows = grade(Path(args.submissions), info, args.jobs, args.timeout, single, update,
                     hidden=[Path(args.grader), out])
    finally:
        if bar is not None:
            bar.stop()
    if single:
        g = rows[0][1]
        path = write_gradescope(out, g)
        print(f"wrote {path}: {sum(x.score for x in g):g} of {sum(x.max_score for x in g):g}")
        return 0
    csv_path, json_path = write_class(out, rows, info)
    max_total = sum(e["points"] for e in info["exercises"])
    print(f"graded {len(rows)} student{'s' if len(rows) != 1 else ''} on {len(info['exercises'])} exercises "
          f"(out of {max_total:g} points): wrote {csv_path} and {json_path}")
    for student, grades in rows:
        zeros = [g.exercise for g in grades if g.score == 0]
        zero = f"  (0 on {', '.join(zeros)})" if zeros else ""
        print(f"  {student:24s} {sum(g.score for g in grades):g}{zero}")
    return 0


def _progress_bar(show: bool) -> tuple[Any, Callable[[int, int, str], None] | None]:
    """A rich progress bar on stderr (None when not wanted or rich is absent) and its update."""
    if not show:
        return None, None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return None, None
    bar = Progress(TextColumn("[bold]grade"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
    task = bar.add_task("", total=None)
    bar.start()

    def update(done: int, total: int, what: str) -> None:
        bar.update(task, completed=done, total=total, description=what)

    return bar, update

