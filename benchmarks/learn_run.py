"""`qkv learn run` measured: every exercise that has a model to run in, with its reference solution
written to a file and run exactly as a student does (`qkv learn run NAME FILE --json`, a fresh
process): the verdict, the losses of the student's model and qkv's after the same steps from the
same seed (or the greedy tokens of SmolLM2), and the wall time (the issue's goal: under a minute
where training is involved). Then a newcomer's path, timed: `qkv learn start softmax`, the
function written (the file replaced by a correct solution, as an editor would save it), `qkv
learn check softmax` passing.

    python benchmarks/learn_run.py               # ~6 minutes on 2 cores
    python benchmarks/learn_run.py --quick       # softmax, rope, additive_attention only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

NAME = "learn_run"


def qkv(*argv: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, cwd=cwd,
                       timeout=900)
    return p, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="three exercises, one of each model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from qkv.learn import EXERCISES
    from qkv.learn.inside import RUNNABLE

    if not C.have_assets(NAME, ("shakespeare", "smollm2")):
        return 0
    machine = C.machine_info()
    print(C.machine_line(machine))
    names = ("softmax", "rope", "additive_attention") if args.quick else RUNNABLE
    result: dict = {"machine": machine, "runs": {}, "newcomer": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="qkv-learn-run-") as tmp:
        folder = Path(tmp)
        for name in names:
            path = folder / f"{name}.py"
            path.write_text("import math\n\nimport torch\n" + EXERCISES[name].solution)
            plot = str(folder / f"{name}.png")
            p, wall = qkv("learn", "run", name, str(path), "-o", plot, "--json", cwd=folder)
            lines = p.stdout.strip().splitlines()
            out = json.loads(lines[-1]) if lines else {"error": p.stderr[-300:]}
            out["wall_s"] = round(wall, 1)
            result["runs"][name] = out
            n = out.get("numbers", {})
            what = (f"{n['val_yours']:.4f} vs {n['val_qkv']:.4f}" if "val_yours" in n
                    else f"{int(n.get('equal_tokens', 0))}/{int(n.get('tokens', 0))} tokens equal")
            rows.append([name, out.get("model", "?").split(" (")[0], "pass" if out.get("passed") else "FAIL",
                         what, f"{wall:.1f}"])
            print(f"{name}: {'pass' if out.get('passed') else 'FAIL'}, {what}, {wall:.1f} s", flush=True)
        # a newcomer's path
        home = folder / "newcomer"
        home.mkdir()
        t0 = time.perf_counter()
        p1, w1 = qkv("learn", "start", "softmax", cwd=home)
        stub = home / "qkv-exercises" / "softmax.py"
        body = ("    e = torch.exp(x - x.amax(dim=dim, keepdim=True))\n"
                "    return e / e.sum(dim=dim, keepdim=True)")
        stub.write_text(stub.read_text().replace('    raise NotImplementedError("write softmax")', body))
        p2, w2 = qkv("learn", "check", "softmax", cwd=home)
        total = time.perf_counter() - t0
        result["newcomer"] = {"start_s": round(w1, 2), "check_s": round(w2, 2), "total_s": round(total, 2),
                              "start_rc": p1.returncode, "check_rc": p2.returncode,
                              "check_output": p2.stdout[-400:]}
        print(f"newcomer: start {w1:.1f} s, check {w2:.1f} s (exit {p2.returncode}), total {total:.1f} s")
    C.print_table("qkv learn run: the reference solution inside each model, beside qkv's own",
                  ["exercise", "model", "verdict", "validation loss, yours vs qkv's / greedy tokens",
                   "wall, s"],
                  rows)
    out = C.write_json(NAME, result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
