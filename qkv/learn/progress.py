"""Your progress through the exercises: the last check of each file of each, and the quizzes you played
(``qkv learn quiz``: date, model, score, total), kept in qkv's cache folder
(``<cache>/learn/progress.json``, written atomically; ``QKV_CACHE_DIR`` moves it, ``=off`` keeps
nothing). The quizzes sit under the key ``QUIZ_KEY``, beside the exercises' attempts.

An exercise keeps one attempt per file checked (the file's absolute path), so checking another
file never overwrites a pass: the exercise counts as passed while any of its files' last checks
passed, and ``load`` reports that file's attempt."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from qkv.fileio import atomic_write
from qkv.learn.exercise import Report
from qkv.paths import cache_root


@dataclass(frozen=True)
class Attempt:
    """The last check of one file of an exercise: passed or not, how many checks passed, when,
    which file ("" for a function checked from Python)."""

    passed: bool
    ok: int
    total: int
    when: str
    file: str = ""
    status: str = ""  # the report's: "unwritten", "refused", "error" or "" (checked)

    def state(self) -> str:
        """In words: passed, not written yet, its file does not run, or n/m checks."""
        if self.passed:
            return "passed"
        return {"unwritten": "not written yet", "refused": "refused (imports qkv)",
                "error": "its file does not run"}.get(self.status, f"{self.ok}/{self.total} checks")


def path() -> Path | None:
    root = cache_root()
    return None if root is None else root / "learn" / "progress.json"


@dataclass(frozen=True)
class QuizScore:
    """One quiz played: when, on which model, how many answers were right out of how many."""

    when: str
    model: str
    score: int
    total: int


QUIZ_KEY = "__quiz__"  # no exercise has this name (exercises are Python function names)
QUIZ_KEEP = 200  # the most recent quizzes kept


def _raw() -> dict:
    p = path()
    if p is None:
        return {}
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _save(raw: dict) -> None:
    p = path()
    if p is None:
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(raw, indent=1)
        atomic_write(p, lambda tmp: tmp.write_text(text))
    except OSError:
        pass


def _attempt(v: object, file: str) -> Attempt | None:
    try:
        return Attempt(bool(v["passed"]), int(v["ok"]), int(v["total"]), str(v["when"]), file,  # type: ignore[index]
                       str(v.get("status", "")))  # type: ignore[union-attr]
    except (KeyError, TypeError, ValueError):
        return None


def _files(v: object) -> dict[str, Attempt]:
    """One exercise's attempts by file (an entry written before files were kept: file "")."""
    if isinstance(v, dict) and isinstance(v.get("files"), dict):
        found = {f: _attempt(a, f) for f, a in v["files"].items()}
    else:
        found = {"": _attempt(v, "")}
    return {f: a for f, a in found.items() if a is not None}


def load() -> dict[str, Attempt]:
    """Every exercise checked so far, as its best file's last attempt: a passing one if any (the
    latest of those), else the latest (a damaged or missing file: none; a damaged entry: skipped)."""
    out = {}
    for k, v in _raw().items():
        if k == QUIZ_KEY:
            continue
        attempts = sorted(_files(v).values(), key=lambda a: (a.passed, a.when))
        if attempts:
            out[k] = attempts[-1]
    return out


def record(report: Report, file: Path | None = None) -> None:
    """Keep ``report`` as the last attempt of ``file`` (its absolute path; None: a function
    checked from Python) for its exercise, beside the other files' (never an error: a read-only
    cache is fine); the quizzes in the file are kept."""
    raw = _raw()
    key = "" if file is None else str(Path(file).resolve())
    files = {f: vars(a) for f, a in _files(raw.get(report.exercise)).items()}
    files[key] = vars(Attempt(report.passed, sum(c.ok for c in report.checks), len(report.checks),
                              time.strftime("%Y-%m-%d %H:%M:%S"), key,
                              report.status or ("error" if report.error else "")))
    raw[report.exercise] = {"files": files}
    _save(raw)


def quizzes() -> list[QuizScore]:
    """Every quiz kept, oldest first (damaged entries skipped)."""
    out = []
    entries = _raw().get(QUIZ_KEY)
    for v in entries if isinstance(entries, list) else []:
        try:
            out.append(QuizScore(str(v["when"]), str(v["model"]), int(v["score"]), int(v["total"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def record_quiz(model: str, score: int, total: int) -> QuizScore:
    """Keep a quiz's score beside the exercises' attempts (atomically; never an error)."""
    q = QuizScore(time.strftime("%Y-%m-%d %H:%M"), model, int(score), int(total))
    raw = _raw()
    raw[QUIZ_KEY] = [vars(x) for x in [*quizzes(), q][-QUIZ_KEEP:]]
    _save(raw)
    return q


def quiz_summary() -> str | None:
    """One line for ``qkv learn progress``: quizzes played, right answers in all, the last one
    (None before the first quiz)."""
    done = quizzes()
    if not done:
        return None
    right, asked = sum(q.score for q in done), sum(q.total for q in done)
    last = done[-1]
    return (f"{len(done)} quiz{'zes' if len(done) != 1 else ''} played, {right}/{asked} answers right; "
            f"last: {last.score}/{last.total} on {last.model} ({last.when})")
