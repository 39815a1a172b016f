"""`qkv learn run` measured: every exercise that has a model to run in, with its reference solution
written to a file and run exactly as a student does (`qkv learn run NAME FILE --json`, a fresh
process): the verdict, the losses of the student's model and qkv's after the same steps from the
same seed (or the greedy tokens of SmolLM2), and the wall time (the issue's goal: under a minute
where training is involved). Then a newcomer's path, timed: `qkv learn start softmax`, the
function written (the file replaced by a correct solution, as an editor would save it), `qkv
learn check softmax` passing. Last, a wrong function in each model (a plausible mistake whose
first forward pass already differs): the time to its verdict (the issue's goal: ≤ 30 s), and
where the run says it first differs.

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

# exercise -> (the mistake, the reference solution's line it replaces, the wrong line)
WRONG = {
    "softmax": ("normalised over the first axis", "e / e.sum(dim=dim, keepdim=True)",
                "e / e.sum(dim=0, keepdim=True)"),
    "layer_norm": ("the standard deviation without eps inside the root, then eps 1e-1 outside it",
                   "torch.sqrt(var + eps)", "(torch.sqrt(var) + 0.1)"),
    "rope": ("the rotation's sign flipped", "x1 * cos - x2 * sin, x2 * cos + x1 * sin",
             "x1 * cos + x2 * sin, x2 * cos - x1 * sin"),
    "additive_attention": ("no tanh", "torch.tanh((query @ w_q)[:, None, :] + keys @ w_k)",
                           "((query @ w_q)[:, None, :] + keys @ w_k)"),
}


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
        wrong_rows = []
        for name, (mistake, right, wrong) in WRONG.items():
            if name not in names:
                continue
            solution = EXERCISES[name].solution
            assert right in solution, (name, right)
            path = folder / "wrong" / f"{name}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text("import math\n\nimport torch\n" + solution.replace(right, wrong))
            p, wall = qkv("learn", "run", name, str(path), "-o", str(folder / f"{name}-wrong.png"), "--json",
                          cwd=folder)
            lines = p.stdout.strip().splitlines()
            out = json.loads(lines[-1]) if lines else {"error": p.stderr[-300:]}
            verdict = out.get("verdict", out.get("error", "?"))
            result.setdefault("wrong", {})[name] = {"mistake": mistake, "passed": out.get("passed"),
                                                    "verdict": verdict, "wall_s": round(wall, 1),
                                                    "rc": p.returncode}
            wrong_rows.append([name, mistake, "caught" if out.get("passed") is False else "MISSED",
                               f"{wall:.1f}", verdict[:70]])
            print(f"wrong {name}: {'caught' if out.get('passed') is False else 'MISSED'} in {wall:.1f} s: "
                  f"{verdict}", flush=True)
    C.print_table("qkv learn run: the reference solution inside each model, beside qkv's own",
                  ["exercise", "model", "verdict", "validation loss, yours vs qkv's / greedy tokens",
                   "wall, s"],
                  rows)
    C.print_table("qkv learn run: a wrong function, the time to its verdict (goal ≤ 30 s)",
                  ["exercise", "mistake", "verdict", "wall, s", "what it says"], wrong_rows)
    out = C.write_json(NAME + ("_quick" if args.quick else ""), result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
