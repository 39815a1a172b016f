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

from qkv.fileio import save_figure
from qkv.viz.tokens import show_token, show_tokens


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out_path: Path) -> Path:
    fig.tight_layout()
    save_figure(fig, out_path)
    plt.close(fig)
    return Path(out_path)


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
    return _save(plt, fig, out_path)


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
    return _save(plt, fig, out_path)


def _label(token: str) -> str:
    """A token as an axis label: :func:`qkv.viz.tokens.show_token` (whitespace as ␣ ↵ ⇥)."""
    return show_token(token)


def _labels(tokens: Sequence[str]) -> list[str]:
    return show_tokens(tokens)


GRID_PANEL = 1.3  # inches per heatmap in plot_attention_grid
GRID_MARGIN = (0.9, 0.65, 0.45)  # inches: left (layer labels), top (title, head labels), bottom
GRID_DPI = 100
GRID_LABELLED = 24  # token labels on the grid's outer axes up to this many tokens


def attention_grid_size(n_layers: int, n_heads: int) -> tuple[int, int]:
    """(width, height) in pixels of :func:`plot_attention_grid`'s PNG."""
    w = GRID_MARGIN[0] + GRID_PANEL * n_heads + 0.1
    h = GRID_MARGIN[1] + GRID_MARGIN[2] + GRID_PANEL * n_layers
    return round(w * GRID_DPI), round(h * GRID_DPI)


def plot_attention_grid(weights: Tensor, tokens: Sequence[str], out_path: Path,
                        title: str = "attention") -> Path:
    """Every head of every layer: weights (L, H, T, S), one small heatmap each, layers down,
    heads across (the overview bertviz calls the model view). Each panel is scaled to its own
    maximum so that weak and sharp heads both show their pattern. Token labels appear on the
    outer axes when T <= GRID_LABELLED; for a readable single head see
    :func:`plot_attention_head`."""
    plt = _pyplot()
    w = weights.detach().float().cpu()
    L, H, T, S = w.shape
    width, height = attention_grid_size(L, H)
    fig, axes = plt.subplots(L, H, figsize=(width / GRID_DPI, height / GRID_DPI), dpi=GRID_DPI,
                             squeeze=False)
    labels = _labels(tokens)
    show = T <= GRID_LABELLED and S <= GRID_LABELLED
    for i in range(L):
        for j in range(H):
            ax = axes[i][j]
            ax.imshow(w[i, j].numpy(), cmap="viridis", vmin=0.0, vmax=float(w[i, j].max()) or 1.0,
                      aspect="auto", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(f"head {j}", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"layer {i}", fontsize=8)
            if show and j == 0:
                ax.set_yticks(range(T), labels[:T], fontsize=4)
            if show and i == L - 1:
                ax.set_xticks(range(S), labels[:S], fontsize=4, rotation=90)
    # Fixed margins (not tight_layout): the picture's size depends on L and H only.
    w_in, h_in = width / GRID_DPI, height / GRID_DPI
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / h_in, va="top")
    fig.subplots_adjust(left=GRID_MARGIN[0] / w_in, right=1 - 0.1 / w_in, top=1 - GRID_MARGIN[1] / h_in,
                        bottom=GRID_MARGIN[2] / h_in, wspace=0.08, hspace=0.08)
    save_figure(fig, out_path)
    plt.close(fig)
    return Path(out_path)


HEAD_DPI = 120
HEAD_LABELLED = 80  # token labels on both axes up to this many tokens


def attention_head_size(n_tokens: int) -> tuple[int, int]:
    """(width, height) in pixels of :func:`plot_attention_head`'s PNG for T tokens."""
    side = min(max(5.0, 0.16 * n_tokens + 2.0), 20.0)
    return round((side + 1.2) * HEAD_DPI), round(side * HEAD_DPI)


def plot_attention_head(weights: Tensor, tokens: Sequence[str], out_path: Path,
                        title: str = "attention", key_tokens: Sequence[str] | None = None) -> Path:
    """One head large: weights (T, S), queries down, keys across, every token labelled on both
    axes (up to HEAD_LABELLED tokens), with a colour bar of the weights."""
    plt = _pyplot()
    w = weights.detach().float().cpu()
    T, S = w.shape
    width, height = attention_head_size(max(T, S))
    fig, ax = plt.subplots(figsize=(width / HEAD_DPI, height / HEAD_DPI), dpi=HEAD_DPI)
    im = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=float(w.max()) or 1.0,
                   interpolation="nearest")
    rows = _labels(tokens)
    cols = _labels(key_tokens if key_tokens is not None else tokens)
    if max(T, S) <= HEAD_LABELLED:
        size = 8 if max(T, S) <= 30 else 6
        ax.set_xticks(range(S), cols[:S], fontsize=size, rotation=90)
        ax.set_yticks(range(T), rows[:T], fontsize=size)
    ax.set_xlabel("key (attended to)", fontsize=9)
    ax.set_ylabel("query (attending)", fontsize=9)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="attention weight")
    return _save(plt, fig, out_path)


def plot_alignment(weights: Tensor, source: Sequence[str], output: Sequence[str], out_path: Path,
                   title: str = "attention: output (rows) x input (columns)") -> Path:
    """One alignment matrix (T_out, S_in), output characters down, input characters across,
    as in Bahdanau et al. 2015, Fig. 3 (and the lectures' translation figure)."""
    plt = _pyplot()
    w = weights.detach().float().cpu()
    T, S = w.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.32 * S + 1.5), max(3.0, 0.32 * T + 1.2)), dpi=120)
    ax.imshow(w.numpy(), cmap="Greys", vmin=0.0, vmax=1.0, aspect="equal")

    ax.set_xticks(range(S), show_tokens(source), fontsize=8)
    ax.set_yticks(range(T), show_tokens(output), fontsize=8)
    ax.xaxis.tick_top()
    ax.set_xlabel("input", fontsize=9)
    ax.set_ylabel("output", fontsize=9)
    ax.set_title(title, fontsize=9, pad=18)
    return _save(plt, fig, out_path)


def plot_by_length(curves: dict[str, dict[str, dict[str, float]]], out_path: Path, *,
                   metric: str = "exact", train_max: int | None = None,
                   title: str = "exact match by source length") -> Path:
    """Score against source length, one line per model, in the manner of Bahdanau et al. 2015,
    Fig. 2 (BLEU against sentence length, with and without attention).

    curves: label -> {"5-10": {"exact": .., "token_accuracy": ..}, ...} (bucket "lo-hi" names,
    as ``eval.json``'s ``by_length``); plotted at each bucket's middle. ``train_max``: a dashed
    line where the training lengths end."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for label, buckets in curves.items():
        pts = []
        for name, v in buckets.items():
            lo, _, hi = name.partition("-")
            pts.append(((int(lo) + int(hi or lo)) / 2, 100 * v[metric]))
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", ms=4, lw=1.5, label=label)
    if train_max is not None:
        ax.axvline(train_max + 0.5, color="grey", ls="--", lw=1)
        ax.text(train_max + 1, 3, "longer than training", fontsize=8, color="grey")
    ax.set_xlabel("source length (symbols)")
    ax.set_ylabel(f"{metric.replace('_', ' ')} (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, out_path)
