"""`qkv learn`'s exercises measured: how many each lecture section has, how long every check
takes on the reference solution (in this process, and a whole ``qkv learn check``: the function
in its child process, torch's import included, the checks in the grader: what a student waits;
the goal is ≤ 5 s per exercise on 2 cores), and the catch rate of the tests' wrong solutions
(tests/learn/test_*.py: each WRONG entry is a plausible mistake and the diagnosis its check must
give; each CORRECT entry a solution written independently of qkv's), with how many of the
failed checks' messages name the mistake or give a generic diagnosis (NaN, shape, dtype,
transpose, normalised over another axis, a constant factor, ...) rather than only expected/got.

    python benchmarks/learn_checks.py            # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import _common as C

NAME = "learn_checks"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same (it is quick)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from qkv.learn import EXERCISES
    from qkv.learn.exercise import CheckResult
    from qkv.learn.judge import run_checks

    machine = C.machine_info()
    print(C.machine_line(machine))
    rows, result = [], {"machine": machine, "exercises": {}}
    with tempfile.TemporaryDirectory(prefix="qkv-learn-bench-") as tmp:
        for name, e in EXERCISES.items():
            ns: dict = {"torch": torch, "math": math}
            exec(e.solution, ns)
            per_check = []
            for c in e.checks:
                t = time.perf_counter()
                outcome = CheckResult.of(c.name, c.run(ns[name]))  # passed: None, or a Shown reveal
                assert outcome.ok, (name, c.name, outcome.message)
                per_check.append(round(time.perf_counter() - t, 3))
            path = Path(tmp) / f"{name}.py"
            path.write_text("import math\nimport torch\n" + e.solution)
            t = time.perf_counter()
            report = run_checks(name, path)
            wall = round(time.perf_counter() - t, 2)
            assert report.passed, report.text()
            result["exercises"][name] = {"checks_s": per_check, "max_check_s": max(per_check),
                                         "qkv_learn_check_s": wall}
            rows.append([name, str(len(per_check)), f"{max(per_check):.3f}", f"{sum(per_check):.3f}",
                         f"{wall:.2f}"])
            print(f"{name}: slowest check {max(per_check):.3f} s, qkv learn check {wall:.2f} s", flush=True)
    result["sections"] = sections()
    result["catch"] = catch_rate()
    c = result["catch"]
    print(f"wrong solutions: {c['rejected']}/{c['wrong']} rejected, {c['diagnosed']}/{c['wrong']} with the "
          f"expected diagnosis, {c['generic_diagnosis']} more with a generic one, {c['only_expected_got']} "
          f"with only expected/got; independent correct solutions: {c['accepted']}/{c['correct']} accepted")
    C.print_table("qkv learn: check times on the reference solutions",
                  ["exercise", "checks", "slowest check, s", "all checks, s", "qkv learn check (child), s"],
                  rows)
    out = C.write_json(NAME + ("_quick" if args.quick else ""), result, args.out)
    print(f"wrote {out}")
    return 0


def sections() -> list[dict]:
    """Every section of the lecture index, whether a command shows it, and its exercises."""
    from qkv.explain.lectures import LECTURES
    from qkv.learn import EXERCISES

    rows = []
    for lec in LECTURES:
        for s in lec.sections:
            names = [e.name for e in EXERCISES.values() if e.section == s.title]
            rows.append({"lecture": lec.name, "section": s.title, "command": bool(s.demos),
                         "exercises": names})
    return rows


def catch_rate() -> dict:
    """Run every WRONG and CORRECT solution of tests/learn/test_*.py through its exercise."""
    import importlib.util

    from qkv.learn import run

    wrong = rejected = diagnosed = correct = accepted = generic = bare = 0
    missed: list[str] = []
    bare_examples: list[str] = []
    sys.path.insert(0, str(C.REPO_DIR / "tests"))  # the tests' helpers module
    for path in sorted((C.REPO_DIR / "tests" / "learn").glob("test_*.py")):
        if "WRONG = [" not in path.read_text():
            continue
        spec = importlib.util.spec_from_file_location(f"_learn_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        for name, fn, says in getattr(module, "WRONG", []):
            report = run(name, fn)
            wrong += 1
            rejected += not report.passed
            ok = not report.passed and any(says in c.message for c in report.checks)
            diagnosed += ok
            if not ok:
                missed.append(f"{path.name}:{name}:{fn.__name__}")
            messages = [c.message for c in report.checks if not c.ok]
            if not ok and messages:
                if any(any(w in m for w in GENERIC) for m in messages):
                    generic += 1
                else:
                    bare += 1
                    bare_examples.append(f"{name}:{fn.__name__}: {messages[0][:160]}")
        for name, fn in getattr(module, "CORRECT", {}).items():
            correct += 1
            accepted += run(name, fn).passed
    return {"wrong": wrong, "rejected": rejected, "diagnosed": diagnosed, "generic_diagnosis": generic,
            "only_expected_got": bare, "correct": correct, "accepted": accepted, "missed": missed,
            "only_expected_got_examples": bare_examples}


# The words of qkv.learn.exercise's generic diagnoses (and of its shape / dtype / NaN messages).
GENERIC = ("has NaN", "it has NaN", "it has inf", "has shape", "has dtype", "transpose",
           "normalised along dim", "rows should sum to 1", "negative probabilities", "times the answer",
           "should be a", "should return", "not written yet", "raised")


if __name__ == "__main__":
    sys.exit(main())
