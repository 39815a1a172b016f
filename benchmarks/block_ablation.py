"""What the MLP and separate queries/keys buy: GPT with ``--mlp none`` and ``--tie_qk`` beside the
full block (CS189 Lec 21-22: the MLP is the only non-linearity besides softmax; with W_Q = W_K the
scores are symmetric, so "swam attends to river" forces "river attends to swam").

Each cell is one `qkv train gpt` run on the bundled Shakespeare (characters, width 64, 4 heads,
context 64, batch 32, AdamW, lr 3e-3 with 50 warmup steps, fp32, ``--steps`` steps), the same
data and seeds for every cell; only the block changes:

- ``full``: attention + MLP, separate W_Q and W_K, ``--layers`` blocks;
- ``no MLP``: attention-only blocks, the same depth (a third of the parameters per block);
- ``no MLP, 3x deeper``: attention-only, three times the blocks: about the full model's
  parameters (4d² per attention-only block, 12d² per full block);
- ``W_Q = W_K``: the full block with one matrix for queries and keys (d² fewer per block).

Reported per cell: parameters, the final validation loss (mean over ``--seeds``), seconds, and
the largest asymmetry max |s_ij − s_ji| / max |s_ij| of the trained model's first-layer scores
(before the mask) on a validation line — 0 for the tied model by construction.

    python benchmarks/block_ablation.py              # 8 runs, ~10 minutes on 2 cores
    python benchmarks/block_ablation.py --steps 100 --seeds 0
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
import torch

NAME = "block_ablation"
PLOT = C.REPO_DIR / "docs" / "block_ablation.png"


def variants(layers: int) -> dict[str, list[str]]:
    return {
        "full": ["--n_layers", str(layers)],
        "no MLP": ["--n_layers", str(layers), "--mlp", "none"],
        "no MLP, 3x deeper": ["--n_layers", str(3 * layers), "--mlp", "none"],
        "W_Q = W_K": ["--n_layers", str(layers), "--tie_qk", "true"],
    }


def score_asymmetry(run: Path, text: str) -> float:
    """max |s_ij − s_ji| / max |s_ij| over the heads of the first layer's pre-mask scores."""
    import qkv

    lm = qkv.load(str(run))
    model = lm.model.eval()
    ids = torch.tensor([lm.tokenizer.encode(text)[: model.cfg.max_seq_len]])
    blk = model.stack.blocks[0]
    with torch.no_grad():
        h = model.tok_emb(ids) + model.pos_emb(ids.shape[1])
        q, k, _ = blk.attn._project(blk.norm1(h), None, None, 0)  # (1, H, T, Dh)
        s = q @ k.transpose(-1, -2)
    return float((s - s.transpose(-1, -2)).abs().max() / s.abs().max())


def run(out: Path, flags: list[str], steps: int, seed: int) -> dict:
    argv = [sys.executable, "-m", "qkv", "train", "gpt", "--preset", "tiny", *flags, "--dim", "64",
            "--n_heads", "4", "--max_seq_len", "64", "--batch_size", "32", "--lr", "0.003",
            "--warmup_iters", "50", "--max_iters", str(steps), "--eval_interval", str(steps),
            "--eval_iters", "10",
            "--optimizer", "adamw", "--dtype", "fp32", "--compile", "false", "--seed", str(seed),
            "--out_dir", str(out), "--no-progress"]
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"qkv train failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [x["val_loss"] for x in rows if x.get("val_loss") is not None]
    params = json.loads((out / "config.json").read_text())
    return {"val_loss": val[-1], "seconds": round(seconds, 1), "config": params["model"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="blocks of the full model")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
            "It is the east, and Juliet is the sun.")
    cells = []
    with tempfile.TemporaryDirectory(prefix="qkv-ablation-") as tmp:
        for name, flags in variants(args.layers).items():
            runs = []
            for seed in seeds:
                out = Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}-{seed}"
                runs.append(run(out, flags, args.steps, seed))
                runs[-1]["asymmetry"] = score_asymmetry(out, text)
                from qkv.models.gpt import GPT, GPTConfig

                runs[-1]["params"] = GPT(GPTConfig(**runs[-1].pop("config"))).num_params()
                r = runs[-1]
                print(f"{name}, seed {seed}: val loss {r['val_loss']:.3f}, {r['params']:,} params, "
                      f"score asymmetry {r['asymmetry']:.2g} ({r['seconds']:.0f} s)", flush=True)
            losses = [r["val_loss"] for r in runs]
            cells.append({"variant": name, "flags": flags, "params": runs[0]["params"],
                          "val_loss_mean": round(sum(losses) / len(losses), 4), "val_losses": losses,
                          "seconds_mean": round(sum(r["seconds"] for r in runs) / len(runs), 1),
                          "asymmetry": max(r["asymmetry"] for r in runs)})
    C.print_table(f"final validation loss after {args.steps} steps, mean of seeds {args.seeds} "
                  "(char-level Shakespeare, width 64)",
                  ["block", "parameters", "val loss", "seconds", "max |s_ij − s_ji| / max |s|"],
                  [[c["variant"], f"{c['params']:,}", f"{c['val_loss_mean']:.3f}",
                    f"{c['seconds_mean']:.0f}", f"{c['asymmetry']:.2g}"] for c in cells])
    plot(cells, args.steps)
    out = C.write_json(NAME, {"machine": machine, "steps": args.steps, "seeds": seeds,
                              "layers": args.layers, "cells": cells}, args.out)
    print(f"wrote {out} and {PLOT}")
    return 0 if all(math.isfinite(c["val_loss_mean"]) for c in cells) else 1


def plot(cells: list[dict], steps: int) -> None:
    from qkv.fileio import save_figure
    from qkv.viz.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    names = [c["variant"] for c in cells]
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:green"]
    ax.bar(names, [c["val_loss_mean"] for c in cells], color=colors[: len(cells)])
    for i, c in enumerate(cells):
        ax.text(i, c["val_loss_mean"], f"{c['val_loss_mean']:.3f}\n{c['params'] / 1e3:.0f}k params",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"validation loss after {steps} steps")
    lo = min(c["val_loss_mean"] for c in cells)
    ax.set_ylim(lo * 0.9, max(c["val_loss_mean"] for c in cells) * 1.08)
    ax.set_title("what the MLP and separate W_Q, W_K buy (Shakespeare characters)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, PLOT)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
