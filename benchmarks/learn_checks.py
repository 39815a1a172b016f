"""How long `qkv learn check` takes: every exercise's checks on its reference solution, in this
process (the checks alone) and through ``qkv learn check`` in a fresh child process (what a
student waits: the child's torch import included). The issue's goal: each check ≤ 5 s on 2 cores.

    python benchmarks/learn_checks.py            # ~1 minute on 2 cores
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
    from qkv.learn.sandbox import run_checks

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
                assert c.run(ns[name]) is None, (name, c.name)
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
    C.print_table("qkv learn: check times on the reference solutions",
                  ["exercise", "checks", "slowest check, s", "all checks, s", "qkv learn check (child), s"],
                  rows)
    out = C.write_json(NAME, result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
