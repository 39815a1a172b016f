"""Pre-LN vs post-LN (CS231N Lec 8; Xiong et al. 2020): which trains stably, at which depth and
learning rate, with and without warmup.

Each cell is one `qkv train gpt` run on the bundled Shakespeare (characters, a 64-wide model of
``--n_layers`` blocks, 4 heads, context 64, batch 32, AdamW, fp32, ``--steps`` steps), the same
seed and data for every cell; only ``--norm_placement``, the depth, the peak learning rate and
the warmup change. Reported: the final validation loss, or the step at which the loss stopped
being finite (the run stops there and says so) — "diverged". Post-LN puts a norm after every
residual sum, so gradients at the first layers grow with depth at initialisation; the expected
picture is that post-LN needs warmup (or a smaller rate) where pre-LN does not.

Writes ``docs/norm_placement.png``: the training-loss curves of pre- and post-LN side by side,
one panel per depth × learning rate × warmup.

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
PLOT = C.REPO_DIR / "docs" / "norm_placement.png"


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
    losses = [x for x in rows if x.get("train_loss") is not None]  # one row per step
    bad = next((x["step"] for x in losses if not math.isfinite(x["train_loss"])), None)
    val = [x["val_loss"] for x in rows if x.get("val_loss") is not None]
    diverged = bad is not None or r.returncode != 0 or not val or not math.isfinite(val[-1])
    return {"placement": placement, "depth": depth, "lr": lr, "warmup": warmup, "rc": r.returncode,
            "curve": [[x["step"], x["train_loss"]] for x in losses],
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
    ap.add_argument("--plot", default=None, help="where the loss curves go (default docs/norm_placement.png)")
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
    plot(cells, args.steps, Path(args.plot) if args.plot else PLOT)
    print(f"wrote {out} and {args.plot or PLOT}")
    return 0


def plot(cells: list[dict], steps: int, out: Path) -> None:
    """One panel per (depth, lr, warmup): the training loss of pre-LN and post-LN against the step."""
    from qkv.fileio import save_figure
    from qkv.viz.plots import _pyplot

    keys = sorted({(c["depth"], c["lr"], c["warmup"]) for c in cells})
    cols = len({(lr, w) for _, lr, w in keys})
    rows = len({d for d, _, _ in keys})
    plt = _pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), dpi=110, squeeze=False,
                             sharey=True)
    for ax, (depth, lr, warmup) in zip(axes.flat, keys, strict=True):
        for c in cells:
            if (c["depth"], c["lr"], c["warmup"]) == (depth, lr, warmup) and c["curve"]:
                xs, ys = zip(*c["curve"], strict=True)
                ax.plot(xs, ys, label=f"{c['placement']}-LN", color="tab:blue" if c["placement"] == "pre"
                        else "tab:red")
        ax.set_title(f"depth {depth}, lr {lr:g}, warmup {warmup}", fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss")
    fig.suptitle(f"pre-LN vs post-LN GPT, {steps} steps (char-level Shakespeare, width 64)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
