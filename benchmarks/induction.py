"""Heads forming while you watch: `qkv train gpt --preset induction` in a fresh process, and
what its history says: the step the model began to copy from context (the loss on the repeated
half of a line 0.5 nats below the first half's), each head type's best score at step 0 and at
the end, and the wall time.

    python benchmarks/induction.py
    python benchmarks/induction.py --keep runs/induction     # keep the run (for qkv serve's step slider)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/induction.json)")
    p.add_argument("--keep", default=None, help="train into this (new) folder and keep it")
    args = p.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    meter = C.LoadMeter()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.keep) if args.keep else Path(tmp) / "run"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "qkv", "train", "gpt", "--preset", "induction",
                               "--out_dir", str(run), "--no-progress"], capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        from qkv.lens.history import read_history

        h = read_history(run / "history.jsonl")
        assert h is not None
        import json

        ev = json.loads((run / "eval.json").read_text())
    load = meter.stop()
    copying = h.copying_from()
    per_step = ev["train_seconds"] / ev["steps"]
    rows = [["wall time of the command (s)", f"{seconds:.1f}"],
            ["training time (s)", f"{ev['train_seconds']:.1f}"],
            ["copying from context from step", str(copying)],
            ["... after (s of training)", f"{copying * per_step:.1f}" if copying is not None else "-"],
            ["loss first / repeated half at the end", f"{h.loss_first[-1]:.2f} / {h.loss_second[-1]:.2f}"]]
    best = {}
    for t, s in h.scores.items():
        b = s.flatten(1).max(1).values
        best[t] = {"start": round(float(b[0]), 4), "end": round(float(b[-1]), 4),
                   "max": round(float(b.max()), 4)}
        rows.append([f"best {t} score: step 0 -> end (max)", f"{b[0]:.3f} -> {b[-1]:.3f} ({b.max():.3f})"])
    C.print_table(f"qkv train gpt --preset induction ({C.load_line(load)})", ["what", "value"], rows)
    out = C.write_json("induction", {
        "machine": machine, "load": load, "wall_s": round(seconds, 1), "train_seconds": ev["train_seconds"],
        "steps": ev["steps"], "copying_from_step": copying, "loss_first": h.loss_first,
        "loss_second": h.loss_second,
        "history_steps": h.steps, "best_scores": best, "formed_at_0.5": h.formed()}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
