"""Pre-LN vs post-LN (CS231N Lec 8; Xiong et al. 2020): which trains stably, at which depth and
learning rate, with and without warmup.

Each cell is one `qkv train gpt` run on the bundled Shakespeare (characters, a 64-wide model of
``--n_layers`` blocks, 4 heads, context 64, batch 32, AdamW, fp32, ``--steps`` steps), the same
seed and data for every cell; only ``--norm_placement``, the depth, the peak learning rate and
the warmup change. Reported: the final validation loss, or the step at which the loss stopped
being finite (the run stops there and says so) — "diverged". Post-LN puts a norm after every
residual sum, so gradients at the first layers grow with depth at initialisation; the expected
picture is that post-LN needs warmup (or a smaller rate) where pre-LN does not.

    python benchmarks/norm_placement.py                 # 16 runs, ~5 minutes on 2 cores
    python benchmarks/norm_placement.py --depths 2 --lrs 0.003 --steps 100
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

NAME = "norm_placement"


def run(out: Path, placement: str, depth: int, lr: float, warmup: int, steps: int) -> dict:
    argv = [sys.executable, "-m", "qkv", "train", "gpt", "--preset", "tiny", "--norm_placement", placement,
            "--n_layers", str(depth), "--dim", "64", "--n_heads", "4", "--max_seq_len", "64",
            "--batch_size", "32",
            "--lr", str(lr), "--warmup_iters", str(warmup), "--max_iters", str(steps),
            "--eval_interval", str(steps), "--eval_iters", "5", "--optimizer", "adamw", "--dtype", "fp32",
            "--compile", "false", "--seed", "0", "--out_dir", str(out), "--no-progress"]
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").is_file() else []
    losses = [x for x in rows if "loss" in x]
    bad = next((x["step"] for x in losses if not math.isfinite(x["loss"])), None)
    val = [x["val_loss"] for x in rows if x.get("val_loss") is not None]
    diverged = bad is not None or r.returncode != 0 or not val or not math.isfinite(val[-1])
    return {"placement": placement, "depth": depth, "lr": lr, "warmup": warmup, "rc": r.returncode,
            "final_val_loss": None if diverged else round(val[-1], 4), "diverged_at": bad,
            "diverged": diverged, "seconds": round(seconds, 1),
            "said": (r.stderr or r.stdout).strip().splitlines()[-1:] if r.returncode else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="2,8")
    ap.add_argument("--lrs", default="0.001,0.01")
    ap.add_argument("--warmups", default="0,50")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    cells = []
    with tempfile.TemporaryDirectory(prefix="qkv-norm-") as tmp:
        for depth in map(int, args.depths.split(",")):
            for lr in map(float, args.lrs.split(",")):
                for warmup in map(int, args.warmups.split(",")):
                    for placement in ("pre", "post"):
                        out = Path(tmp) / f"{placement}-{depth}-{lr}-{warmup}"
                        c = run(out, placement, depth, lr, warmup, args.steps)
                        cells.append(c)
                        shown = "diverged" + (f" at step {c['diverged_at']}" if c["diverged_at"] else "") \
                            if c["diverged"] else f"val loss {c['final_val_loss']:.3f}"
                        print(f"depth {depth}, lr {lr:g}, warmup {warmup}, {placement}-LN: {shown} "
                              f"({c['seconds']:.0f} s)", flush=True)
    rows = []
    for depth in map(int, args.depths.split(",")):
        for lr in map(float, args.lrs.split(",")):
            for warmup in map(int, args.warmups.split(",")):
                got = {c["placement"]: c for c in cells
                       if (c["depth"], c["lr"], c["warmup"]) == (depth, lr, warmup)}

                def show(c: dict) -> str:
                    if c["diverged"]:
                        return "diverged" + (f" (step {c['diverged_at']})" if c["diverged_at"] else "")
                    return f"{c['final_val_loss']:.3f}"

                rows.append([str(depth), f"{lr:g}", str(warmup), show(got["pre"]), show(got["post"])])
    C.print_table(f"final validation loss after {args.steps} steps (char-level Shakespeare, width 64)",
                  ["depth", "peak lr", "warmup", "pre-LN", "post-LN"], rows)
    out = C.write_json(NAME, {"machine": machine, "steps": args.steps, "cells": cells}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
