"""Learn by doing: the lectures' mechanisms as exercises that check themselves.

    qkv learn                      # the exercises, by lecture section, with your progress
    qkv learn start softmax        # writes ./qkv-exercises/softmax.py: the stub to fill in
    qkv learn check softmax        # runs its checks on your file (isolated, time and memory limits)
    qkv learn hint softmax         # the next hint

From Python (a notebook): ``from qkv.learn import check; check("softmax", my_softmax)`` prints
the same report and returns it, judged the same way as the command: the function's source (the
definitions of the cells run so far) runs in a child process with the same limits, the checks in
this one. Each check compares with an independent reference (PyTorch's
own ops, float64 formulas, the lectures' numbers such as Discussion 10's 0.9975), tries the
edge cases a careless solution breaks, and says what is wrong when it recognises the mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.learn.catalog import EXERCISES
    from qkv.learn.exercise import Exercise, Report

DEFAULT_DIR = "qkv-exercises"  # where `qkv learn start` writes and `check`/`run` look


def __getattr__(name: str) -> Any:
    """EXERCISES, Exercise and Report, imported when first asked for: ``qkv.learn.launch``
    (which starts a child before torch is imported) must not import torch with this package."""
    if name == "EXERCISES":
        from qkv.learn.catalog import EXERCISES

        return EXERCISES
    if name in ("Exercise", "Report", "CheckResult"):
        from qkv.learn import exercise

        return getattr(exercise, name)
    raise AttributeError(f"module 'qkv.learn' has no attribute {name!r}")


def get(name: str) -> Exercise:
    """The exercise called ``name`` (InputError naming the exercises otherwise)."""
    from qkv.learn.catalog import get as get_exercise

    return get_exercise(name)


def run(name: str, fn: Callable[..., Any]) -> Report:
    """Every check of exercise ``name`` on ``fn``, in this process: no isolation and no time
    limit, so nothing it says can be trusted as a grade (qkv's own tests and benchmarks use it to
    run thousands of checks quickly); :func:`check` and ``qkv learn check`` judge in a child."""
    from qkv.learn.exercise import CheckResult, Report

    exercise = get(name)
    results = []
    for c in exercise.checks:
        try:
            message = c.run(fn)
        except NotImplementedError:
            message = f"{name} is not written yet (it raises NotImplementedError)"
        except Exception as e:
            message = f"your function raised {type(e).__name__}: {' '.join(str(e).split())[:240]}"
        results.append(CheckResult.of(c.name, message))
    return Report(name, tuple(results))


def check(name: str, fn: Callable[..., Any], timeout: float | None = None) -> Report:
    """Every check of exercise ``name`` on ``fn``, judged as ``qkv learn check`` judges a file
    (:func:`qkv.learn.judge.judge`: ``fn``'s source runs in a child with a time limit, default
    60 s), printed (one line per check, the reason under a failed one) and returned. The next
    check's child is started as this one ends (one process, idle until used, ended with this
    one), so a notebook's checks answer in about a second."""
    from qkv.learn import launch
    from qkv.learn.judge import TIMEOUT_S, judge
    from qkv.learn.source import function_source

    exercise = get(name)
    launch.ahead()  # the child starts now, while the function's source is read
    report = judge(exercise, function_source(fn, name), TIMEOUT_S if timeout is None else timeout,
                   filename="notebook.py")
    print(report.text())
    launch.ahead()  # and the next check's child imports torch while the student reads this one
    return report


__all__ = ["EXERCISES", "Exercise", "Report", "check", "get", "run"]
