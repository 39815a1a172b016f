"""Pictures for ``qkv explain TOPIC --plot out.png`` (matplotlib's Agg backend, no display).

Each function takes a topic's result object and writes one PNG; nothing is recomputed here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qkv.fileio import save_figure
from qkv.viz.plots import _pyplot

if TYPE_CHECKING:
    from qkv.explain.context import ContextResult
    from qkv.explain.cost import CostResult
    from qkv.explain.lookup import LookupResult
    from qkv.explain.positions import PositionsResult
    from qkv.explain.retrieval import RetrievalResult
    from qkv.explain.scaling import ScalingResult
    from qkv.explain.softmax import SoftmaxResult
    from qkv.explain.worked_example import WorkedExample


def _save(fig, plt, out: Path) -> Path:
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)
    return Path(out)


def _bars(ax, groups: list[tuple[str, list[float]]], labels: list[str]) -> None:
    """Grouped bars: one group per (name, heights), one bar per label."""
    n = len(groups)
    width = 0.8 / n
    for g, (name, heights) in enumerate(groups):
        xs = [i + (g - (n - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, heights, width, label=name)
    ax.set_xticks(range(len(labels)), labels)


def plot_softmax(r: SoftmaxResult, out: Path) -> Path:
    """Bars of the hardmax and of the softmax at every temperature."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    groups = [("hardmax", r.hardmax)] + [(f"softmax, T={t:g}", w) for t, w in zip(r.temperatures, r.tempered,
                                                                                    strict=True)]
    _bars(ax, groups, [f"x={v:g}" for v in r.values])
    ax.set_ylabel("weight")
    ax.set_ylim(0, 1.05)
    ax.set_title("hardmax vs softmax(x / T)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, plt, out)


def plot_lookup(r: LookupResult, out: Path) -> Path:
    """One panel per query: the weights on each key, hardmax and softmax at each sharpness."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(r.queries), figsize=(4.5 * len(r.queries), 3.8), dpi=120, squeeze=False)
    for ax, q, hard, soft in zip(axes[0], r.queries, r.hard, r.soft, strict=True):
        groups = [(f"hardmax → {hard.value:.2f}", hard.weights)]
        groups += [(f"s={s:g} → {a.value:.2f}", a.weights) for s, a in zip(r.sharpness, soft, strict=True)]
        _bars(ax, groups, [f"{n} ({v:g})" for n, v in zip(r.names, r.values, strict=True)])
        ax.set_title(f"query {[round(x, 3) for x in q]}")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("weight on key")
    return _save(fig, plt, out)


def plot_scaling(r: ScalingResult, out: Path) -> Path:
    """Var(qᵀk) against d, and how peaked the softmax gets, with and without 1/√d."""
    plt = _pyplot()
    d = [row.d for row in r.rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    a.loglog(d, [row.expected_var for row in r.rows], "k--", lw=1, label="d(σ⁴+2μ²σ²)")
    a.loglog(d, [row.var for row in r.rows], "o-", label="Var(qᵀk)")
    a.loglog(d, [row.var_scaled for row in r.rows], "s-", label="Var(qᵀk/√d)")
    a.set_xlabel("d")
    a.set_title("variance of the scores")
    a.legend()
    b.semilogx(d, [row.max_weight for row in r.rows], "o-", label="max weight, qᵀk")
    b.semilogx(d, [row.max_weight_scaled for row in r.rows], "s-", label="max weight, qᵀk/√d")
    b.axhline(1 / r.keys, color="gray", lw=0.8, ls=":", label=f"uniform (1/{r.keys})")
    b.set_ylim(0, 1.02)
    b.set_xlabel("d")
    b.set_title(f"softmax over {r.keys} keys")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    return _save(fig, plt, out)


def _heatmap(ax, m, rows: list[str], cols: list[str], title: str, fmt: str = "{:.2f}", vmax=None,
             vmin: float = 0.0):
    im = ax.imshow(m, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_title(title, fontsize=9)
    if len(rows) * len(cols) <= 64:
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                        color="white" if v < vmin + 0.5 * ((vmax or 1) - vmin) else "black")
    return im


def plot_worked_example(r: WorkedExample, out: Path) -> Path:
    """The attention weights, scaled and unscaled, as heatmaps (row = query, column = key)."""
    plt = _pyplot()
    names = [f"x{i + 1}" for i in range(len(r.x))]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8), dpi=120)
    scaled = f"softmax(QKᵀ/√{len(r.q[0])})" if r.scale != 1 else "softmax(QKᵀ)"
    _heatmap(axes[0], r.weights, names, names, scaled, vmax=1)
    _heatmap(axes[1], r.unscaled_weights, names, names, "softmax(QKᵀ), unscaled (Discussion 10)", vmax=1)
    return _save(fig, plt, out)


def plot_retrieval(r: RetrievalResult, out: Path) -> Path:
    """Each document's score under every representation, and the attention weights."""
    plt = _pyplot()
    panels = [("bag of words qᵀk", r.bow), ("TF-IDF cosine", r.tfidf)]
    if r.minilm is not None:
        panels.append(("MiniLM cosine", r.minilm))
    panels.append((f"attention p ({r.attention_over})", r.attention))
    labels = [d if len(d) <= 38 else d[:36] + "…" for d in r.documents]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 3, 0.45 * len(labels) + 1.5),
                             dpi=120, sharey=True)
    for ax, (title, vals) in zip(axes, panels, strict=True):
        ax.barh(range(len(vals)), vals, color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"query: {r.query!r}", fontsize=10)
    return _save(fig, plt, out)


def plot_context(r: ContextResult, out: Path) -> Path:
    """Where "it" looks in each layer (mean over heads), and the word's cosines after the last layer."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(r.it) + 1, figsize=(6 * len(r.it) + 4, 4), dpi=120,
                             gridspec_kw={"width_ratios": [3] * len(r.it) + [2]})
    for ax, it in zip(axes, r.it, strict=False):
        m = [it.mean_over_heads(layer) for layer in range(len(it.weights))]
        # [CLS] and [SEP] take most of the weight: scale the colours to the other tokens.
        words = [j for j, t in enumerate(it.tokens) if t not in ("[CLS]", "[SEP]")]
        _heatmap(ax, m, [f"layer {i + 1}" for i in range(len(m))], it.tokens,
                 f'where "it" looks: {it.sentence}\n(mean over heads; colours capped at the largest word)',
                 vmax=max(row[j] for row in m for j in words))
    b = r.bank
    names = [str(i + 1) + (f" {b.senses[i]}" if b.senses else "") for i in range(len(b.sentences))]
    low = min(min(row) for row in b.cosine[-1])
    _heatmap(axes[-1], b.cosine[-1], names, names, f"cosine of {b.word!r} vectors, last layer", vmax=1,
             vmin=low)
    return _save(fig, plt, out)


def plot_cost(r: CostResult, out: Path) -> Path:
    """Per-layer FLOPs against T (with the crossover) and KV-cache bytes per layout."""
    plt = _pyplot()
    m = r.model
    if m is None:
        raise ValueError("the cost plot shows a model: give --model (smollm2 or a GPT preset)")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    ts = [lf.t for lf in m.layers]
    a.loglog(ts, [lf.proj for lf in m.layers], "o-", label="attention projections")
    a.loglog(ts, [lf.scores for lf in m.layers], "s-", label="QKᵀ + AV")
    a.loglog(ts, [lf.mlp for lf in m.layers], "^-", label="MLP")
    a.axvline(m.crossover_scores, color="gray", ls=":", label=f"T ≈ {m.crossover_scores:,.0f}")
    a.set_xlabel("tokens T")
    a.set_ylabel("FLOPs per layer")
    a.set_title(f"{m.name}: one layer")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    labels = [f"{row.kind}\nK={row.kv_heads}" for row in m.kv]
    colors = ["tab:orange" if row.actual else "tab:blue" for row in m.kv]
    b.bar(labels, [row.bytes / 2**20 for row in m.kv], color=colors)
    b.set_ylabel("MiB")
    b.set_title(f"KV cache, {m.context:,} tokens, {m.dtype} (orange: the model)")
    b.grid(axis="y", alpha=0.3)
    return _save(fig, plt, out)


def plot_positions(r: PositionsResult, out: Path) -> Path:
    """qkv's sinusoidal table as an image (the 'continuous binary code') and PE(0)·PE(k) against k."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    im = a.imshow(r.table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    a.set_xlabel("channel (sin even, cos odd; frequency falls to the right)")
    a.set_ylabel("position p")
    a.set_title(f"sinusoidal PE, width {r.dim}")
    fig.colorbar(im, ax=a, fraction=0.046)
    b.plot(range(len(r.curve)), r.curve)
    b.set_xscale("symlog", linthresh=8)
    b.set_xlabel("distance k")
    b.set_ylabel("PE(p)·PE(p + k)  (the same for every p)")
    b.set_title("the inner product falls with distance, not monotonically")
    b.grid(alpha=0.3)
    return _save(fig, plt, out)
