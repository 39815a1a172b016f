"""Loss curves and attention heatmaps as PNG files (matplotlib's Agg backend, no display).

matplotlib is an optional dependency (``pip install 'qkv[train]'``); the functions raise
ImportError with that hint when it is missing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(metrics_path: Path, out_path: Path, title: str = "training loss") -> Path:
    """Train loss (every step, lightly smoothed) and validation loss (each evaluation)."""
    plt = _pyplot()
    train, val = [], []
    for line in Path(metrics_path).read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("val_loss") is not None:
            val.append((rec["step"], rec["val_loss"]))
        elif rec.get("train_loss") is not None:
            train.append((rec["step"], rec["train_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        steps, losses = zip(*train, strict=True)
        ema, smooth = 0.0, []
        for i, x in enumerate(losses, start=1):  # debiased moving average, as TensorBoard shows
            ema = 0.9 * ema + 0.1 * x
            smooth.append(ema / (1 - 0.9**i))
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8)
        ax.plot(steps, smooth, color="tab:blue", lw=1.5, label="train (smoothed)")
    if val:
        steps, losses = zip(*val, strict=True)
        ax.plot(steps, losses, "o-", color="tab:orange", lw=1.5, ms=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return Path(out_path)


def plot_attention_heads(
    weights: Tensor,
    tokens: Sequence[str],
    out_path: Path,
    title: str = "attention",
) -> Path:
    """Grid of heatmaps, one per head: weights (H, T, S), row = query, column = key."""
    plt = _pyplot()
    w = weights.detach().float().cpu()
    H = w.shape[0]
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    T = w.shape[1]
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), dpi=120, squeeze=False)
    labels = [t if t.strip() else repr(t)[1:-1] for t in tokens]
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= H:
            ax.axis("off")
            continue
        ax.imshow(w[h].numpy(), cmap="viridis", vmin=0.0, vmax=float(w[h].max()) or 1.0)
        ax.set_title(f"head {h}", fontsize=9)
        if T <= 40:
            ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
            ax.set_yticks(range(len(labels)), labels, fontsize=6)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return Path(out_path)


def plot_alignment(weights: Tensor, source: Sequence[str], output: Sequence[str], out_path: Path,
                   title: str = "attention: output (rows) x input (columns)") -> Path:
    """One alignment matrix (T_out, S_in), output characters down, input characters across,
    as in Bahdanau et al. 2015, Fig. 3 (and the lectures' translation figure)."""
    plt = _pyplot()
    w = weights.detach().float().cpu()
    T, S = w.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.32 * S + 1.5), max(3.0, 0.32 * T + 1.2)), dpi=120)
    ax.imshow(w.numpy(), cmap="Greys", vmin=0.0, vmax=1.0, aspect="equal")

    def show(c: str) -> str:
        return "␣" if c == " " else c

    ax.set_xticks(range(S), [show(c) for c in source], fontsize=8)
    ax.set_yticks(range(T), [show(c) for c in output], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_xlabel("input", fontsize=9)
    ax.set_ylabel("output", fontsize=9)
    ax.set_title(title, fontsize=9, pad=18)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return Path(out_path)
