"""Pictures of what a model does: heatmaps (logit lens, head effects, patching, head scores), bars
(next-token probabilities, logit attribution), heads forming during training and the strongest
edges between components. PNG, SVG or PDF by the file's suffix."""

from __future__ import annotations

from pathlib import Path

from qkv.figures import Bars, EdgeGraph, HeadHistory, Heatmap, Heatmaps
from qkv.fileio import save_figure
from qkv.viz.plots import _labels, _pyplot, _save

CELL = 0.42  # inches per heatmap cell
MAX_TEXT_CELLS = 900  # write each cell's text only up to this many cells


def _panel(ax, fig, hm: Heatmap) -> None:
    v = hm.values.detach().float().cpu()
    if hm.diverging:
        lim = float(v.abs().nan_to_num(0.0).max()) or 1.0
        im = ax.imshow(v.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    else:
        im = ax.imshow(v.numpy(), cmap="viridis", aspect="auto", interpolation="nearest")
    R, C = v.shape
    ax.set_yticks(range(R), _labels(hm.rows), fontsize=7)
    ax.set_xticks(range(C), _labels(hm.columns), fontsize=7, rotation=90)
    if hm.cells is not None and R * C <= MAX_TEXT_CELLS:
        lo, hi = float(v.nan_to_num(0.0).min()), float(v.nan_to_num(0.0).max())
        for i in range(R):
            for j in range(C):
                x = float(v[i, j])
                dark = (abs(x) > 0.6 * max(abs(lo), abs(hi))) if hm.diverging else x < lo + 0.5 * (hi - lo)
                ax.text(j, i, _labels([hm.cells[i][j]])[0], ha="center", va="center", fontsize=6,
                        color="white" if dark else "black")
    ax.set_title(hm.title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label=hm.label)


def _size(hm: Heatmap) -> tuple[float, float]:
    R, C = hm.values.shape[-2:]
    return min(2.5 + CELL * C, 30.0), min(1.8 + CELL * 0.8 * R, 30.0)


def plot_heatmap(hm: Heatmap, out_path: Path) -> Path:
    """One heatmap, sized to its cells."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=_size(hm), dpi=110)
    _panel(ax, fig, hm)
    return _save(plt, fig, out_path)


def plot_heatmaps(hms: Heatmaps, out_path: Path) -> Path:
    """Heatmaps side by side, one title above."""
    plt = _pyplot()
    sizes = [_size(p) for p in hms.panels]
    fig, axes = plt.subplots(1, len(hms.panels), figsize=(sum(w for w, _ in sizes), max(h for _, h in sizes)),
                             dpi=110, squeeze=False)
    for ax, hm in zip(axes[0], hms.panels, strict=True):
        _panel(ax, fig, hm)
    fig.suptitle(hms.title, fontsize=10)
    return _save(plt, fig, out_path)


def plot_bars(bars: Bars, out_path: Path) -> Path:
    """Horizontal bars, the first label at the top, each value written at its bar's end."""
    plt = _pyplot()
    n = len(bars.values)
    fig, ax = plt.subplots(figsize=(6.5, 1.0 + 0.3 * n), dpi=110)
    ys = list(range(n))[::-1]
    colors = ["#c0392b" if v < 0 else "#2e86c1" for v in bars.values]
    ax.barh(ys, bars.values, color=colors)
    ax.set_yticks(ys, _labels(bars.labels), fontsize=8)
    for y, v in zip(ys, bars.values, strict=True):
        ax.text(v, y, f" {v:.3g} ", va="center", ha="left" if v >= 0 else "right", fontsize=7)
    ax.axvline(0, color="black", linewidth=0.6)
    ax.margins(x=0.18)
    ax.set_xlabel(bars.xlabel)
    ax.set_title(bars.title, fontsize=10)
    return _save(plt, fig, out_path)


# The caption under heads.png: what the right panel's probe is, so that its loss rising above the
# uniform guess on a model trained on text (any run, not only the induction preset's) is not read
# as "training made it worse". Kept for every run: the probe is the same for all of them.
PROBE_CAPTION = (
    "The probe: random tokens, each sequence repeated twice. Nothing predicts the first copy, so its loss "
    "starts near the uniform guess ln(vocabulary); a model trained on text learns to expect text, so on "
    "random tokens its loss can rise above that guess (it is not getting worse on its own data). The "
    "second copy's loss falling below the first's is copying from context: what induction heads do.")


def plot_head_history(h: HeadHistory, out_path: Path) -> Path:
    """Left: each head type's best head over the steps (every head faint behind it), the step it
    formed marked. Right: the loss on the first and the second copy of the repeated tokens, with
    :data:`PROBE_CAPTION` under both (what the probe is, and why its first-copy loss may rise)."""
    import textwrap

    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.7), dpi=110)
    steps = list(h.steps)
    for i, (name, s) in enumerate(h.scores.items()):
        color = f"C{i}"
        flat = s.reshape(len(steps), -1).float()
        ax.plot(steps, flat.numpy(), color=color, alpha=0.12, linewidth=0.8)
        ax.plot(steps, flat.max(1).values.numpy(), color=color, linewidth=2, label=f"{name} (best head)")
        if h.formed.get(name) is not None:
            ax.axvline(h.formed[name], color=color, linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_title("head scores", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.plot(steps, list(h.loss_first), label="first copy (unpredictable)")
    if h.copying is not None:
        ax2.axvline(h.copying, color="black", linestyle="--", linewidth=1, label="copying from context")
    ax2.plot(steps, list(h.loss_second), label="second copy (a repeat)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("cross-entropy (nats/token)")
    ax2.set_title("loss on repeated random tokens", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(h.title, fontsize=11)
    fig.text(0.5, 0.01, "\n".join(textwrap.wrap(PROBE_CAPTION, 150)), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    save_figure(fig, out_path)
    plt.close(fig)
    return Path(out_path)


def _node(name: str, layers: int, heads: int) -> tuple[float, float, str]:
    """Where a component sits (x = layer, y = head; the MLP under the heads), and the input a
    receiver's edge enters by ("q", "k", "v" or "")."""
    if name == "embed":
        return -1.0, (heads - 1) / 2, ""
    if name == "logits":
        return float(layers), (heads - 1) / 2, ""
    if name.startswith("m"):
        return int(name[1:]) + 0.45, float(heads), ""
    parts = name[1:].split(".")
    return float(parts[0]), float(parts[1]), parts[2] if len(parts) > 2 else ""


def plot_edge_graph(g: EdgeGraph, out_path: Path) -> Path:
    """The edges as arrows from sender to receiver, width by |value|, red positive and blue
    negative (as the diverging heatmaps), each labelled with the input it enters by (q, k, v)."""
    plt = _pyplot()
    size = (min(3.0 + 0.9 * (g.layers + 2), 24.0), min(2.0 + 0.45 * (g.heads + 1), 16.0))
    fig, ax = plt.subplots(figsize=size, dpi=110)
    top = max((abs(v) for _, _, v in g.edges), default=1.0) or 1.0
    used: set[str] = set()
    for sender, receiver, value in g.edges:
        x0, y0, _ = _node(sender, g.layers, g.heads)
        x1, y1, part = _node(receiver, g.layers, g.heads)
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", color="#c0392b" if value > 0 else "#2e86c1",
                                    lw=0.6 + 3.4 * abs(value) / top, alpha=0.8, shrinkA=6, shrinkB=6,
                                    connectionstyle="arc3,rad=0.12"))
        if part:
            ax.text(0.3 * x0 + 0.7 * x1, 0.3 * y0 + 0.7 * y1, part, fontsize=7, ha="center", va="center")
        used.add(sender)
        used.add(receiver if not part else receiver.rsplit(".", 1)[0])
    for name in sorted(used):
        x, y, _ = _node(name, g.layers, g.heads)
        ax.scatter([x], [y], s=60, color="#34495e", zorder=3)
        ax.text(x, y - 0.28, name, fontsize=7, ha="center", va="top")
    ax.set_xlim(-1.6, g.layers + 0.6)
    ax.set_ylim(g.heads + 0.8, -0.9)
    ticks = ["embed", *(str(i) for i in range(g.layers)), "logits"]
    ax.set_xticks(range(-1, g.layers + 1), ticks, fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("layer")
    ax.set_title(g.title + (f"\n{g.label}" if g.label else ""), fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    return _save(plt, fig, out_path)
