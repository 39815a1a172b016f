"""Your progress through the exercises: the last check of each, kept in qkv's cache folder
(``<cache>/learn/progress.json``, written atomically; ``QKV_CACHE_DIR`` moves it, ``=off`` keeps
nothing)."""

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
    """The last check of one exercise: passed or not, how many checks passed, when."""

    passed: bool
    ok: int
    total: int
    when: str


def path() -> Path | None:
    root = cache_root()
    return None if root is None else root / "learn" / "progress.json"


def load() -> dict[str, Attempt]:
    """Every exercise checked so far (a damaged or missing file: none)."""
    p = path()
    if p is None:
        return {}
    try:
        raw = json.loads(p.read_text())
        return {k: Attempt(bool(v["passed"]), int(v["ok"]), int(v["total"]), str(v["when"]))
                for k, v in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def record(report: Report) -> None:
    """Keep ``report`` as its exercise's last attempt (never an error: a read-only cache is fine)."""
    p = path()
    if p is None:
        return
    done = load()
    done[report.exercise] = Attempt(report.passed, sum(c.ok for c in report.checks), len(report.checks),
                                    time.strftime("%Y-%m-%d %H:%M"))
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({k: vars(v) for k, v in done.items()}, indent=1)
        atomic_write(p, lambda tmp: tmp.write_text(text))
    except OSError:
        pass
