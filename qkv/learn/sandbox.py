"""A student's file, checked in a process of its own with a time and a memory limit.

The parent (``qkv learn check``) reads the file first (a syntax error is one line with
file:line, exit 2; a file that defines no function of the exercise's name, exit 2), then runs
``python -m qkv.learn.sandbox NAME FILE RESULT OFFSET`` with a timeout. The child limits its own
address space (2 GiB above what torch and qkv took to import), keeps the student's prints in a
bounded buffer, imports the file, runs every check inside :func:`~qkv.learn.exercise.other_inputs`
(OFFSET: 0 for the public inputs, a course grader's secret offset for inputs the student never
saw, :mod:`qkv.learn.grading`) and writes the report as JSON to RESULT. An
infinite loop, a huge allocation, ``sys.exit``, a print storm or an exception becomes one clear
failed check, never a hang or a traceback from qkv. The parent never signals anything but the
child it started (a timeout kills it).
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.errors import InputError
from qkv.learn.exercise import Check, CheckResult, Report

TIMEOUT_S = 60.0  # every check of one exercise, torch's import included (each check takes ≤ 5 s)
MEMORY_ABOVE_IMPORT = 2 << 30  # bytes the student's code may allocate
PRINT_LIMIT = 64 << 10  # characters of the student's prints kept


def read_solution(name: str, path: Path) -> str:
    """The file's source, checked before anything runs: InputError (exit 2) for a missing file,
    a syntax error (file:line) or no top-level function ``name``."""
    if not path.is_file():
        raise InputError(f"{path} is not a file; write it with `qkv learn start {name}` (or name your file)")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise InputError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    if name not in names:
        raise InputError(
            f"{path} defines no function {name}(...): the exercise checks a function of that name"
        )
    return source


def run_checks(name: str, path: Path, timeout: float = TIMEOUT_S, seed_offset: int = 0) -> Report:
    """The report of exercise ``name`` on the function ``name`` of ``path``, computed in a child
    process (see the module doc); ``seed_offset``: every check's random inputs moved by it
    (:func:`~qkv.learn.exercise.other_inputs`; 0: the public inputs)."""
    read_solution(name, path)
    with tempfile.TemporaryDirectory(prefix="qkv-learn-") as tmp:
        result = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "qkv.learn.sandbox", name, str(path.resolve()), str(result),
               str(int(seed_offset))]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd=str(path.resolve().parent),
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return Report(
                name,
                (),
                f"it did not finish in {timeout:g} s (an infinite loop, or far too much "
                "work for these small inputs?)",
            )
        if result.is_file():
            data = json.loads(result.read_text())
            return Report(name, tuple(CheckResult(**c) for c in data["checks"]), data.get("error", ""))
        tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
        why = tail[0][:200] if tail else f"exit code {proc.returncode}"
        if proc.returncode and proc.returncode < 0:
            why = f"killed by signal {-proc.returncode} (out of memory?)"
        return Report(name, (), f"the check process ended without a report: {why}")


# --------------------------------------------------------------------------- the child


class _Bounded(io.TextIOBase):
    """Keeps the first PRINT_LIMIT characters written, counts the rest."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.size = 0

    def write(self, s: str) -> int:
        if self.size < PRINT_LIMIT:
            self.kept.append(s[: PRINT_LIMIT - self.size])
        self.size += len(s)
        return len(s)


def _limit_memory() -> None:
    try:
        import resource

        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = used + MEMORY_ABOVE_IMPORT
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (ImportError, OSError, ValueError):  # not Linux: the time limit still holds
        pass


def _where(e: BaseException, path: str) -> str:
    """'file.py:12' of the deepest frame in the student's file, or ''."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
    return f" ({Path(path).name}:{frames[-1].lineno})" if frames else ""


def _run_one(c: Check, fn: Callable[..., Any], name: str, path: str) -> str | None:
    """One check of the student's function: None (passed) or why not, whatever the function does."""
    try:
        return c.run(fn)
    except SystemExit as e:
        return f"your function called sys.exit({e.code!r})"
    except MemoryError:
        return "your function ran out of memory (more than 2 GiB for small inputs)"
    except NotImplementedError:
        return f"{name} is not written yet (it raises NotImplementedError)"
    except BaseException as e:
        text = " ".join(str(e).split())[:240]
        if isinstance(e, RuntimeError) and ("alloc" in text.lower() or "memory" in text.lower()):
            return f"your function ran out of memory: {text}"
        return f"your function raised {type(e).__name__}: {text}{_where(e, path)}"


def _child(name: str, path: str, result: str, offset: str = "0") -> None:
    """Import the student's file and write the report of every check (run on inputs moved by
    ``offset``) to ``result``."""
    import runpy

    import torch

    from qkv.learn.catalog import EXERCISES
    from qkv.learn.exercise import other_inputs

    torch.set_num_threads(1)
    exercise = EXERCISES[name]
    _limit_memory()
    out = _Bounded()
    sys.stdout = sys.stderr = out  # type: ignore[assignment]
    report: dict[str, Any] = {"checks": []}
    try:
        namespace = runpy.run_path(path, run_name="student")
        fn = namespace.get(name)
        if not callable(fn):
            raise TypeError(f"{name} is not a function")
    except SystemExit as e:
        report["error"] = f"the file called sys.exit({e.code!r}) while it was imported"
    except MemoryError:
        report["error"] = "the file ran out of memory while it was imported"
    except BaseException as e:
        report["error"] = (
            f"importing the file raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
            + _where(e, path)
        )
    else:
        with other_inputs(int(offset)):
            for c in exercise.checks:
                message = _run_one(c, fn, name, path)
                report["checks"].append({"name": c.name, "ok": message is None, "message": message or ""})
    if out.size > PRINT_LIMIT:
        report["checks"].append(
            {
                "name": "prints a reasonable amount",
                "ok": False,
                "message": f"it printed {out.size:,} characters; remove the prints in loops",
            }
        )
    Path(result).write_text(json.dumps(report))


if __name__ == "__main__":
    _child(*sys.argv[1:5])
