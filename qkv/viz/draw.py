"""One entry point from figures (:mod:`qkv.figures`: values) to PNG files."""

from __future__ import annotations

from pathlib import Path

from qkv.figures import (
    AlignmentMap,
    AttentionMaps,
    Bars,
    ConfusionMatrix,
    EdgeGraph,
    Figure,
    HeadHistory,
    Heatmap,
    Heatmaps,
    ImageOverlays,
    LossCurve,
)
from qkv.viz.images import plot_confusion, plot_image_attention
from qkv.viz.lens import plot_bars, plot_edge_graph, plot_head_history, plot_heatmap, plot_heatmaps
from qkv.viz.plots import (
    plot_alignment,
    plot_attention_grid,
    plot_attention_head,
    plot_attention_heads,
    plot_loss_curve,
)


def draw(figure: Figure, out_path: Path) -> Path:
    """Draw ``figure`` at ``out_path`` (written atomically), as PNG, SVG or PDF by the path's
    suffix; returns the path."""
    out = Path(out_path)
    if isinstance(figure, LossCurve):
        return plot_loss_curve(figure.metrics, out, title=figure.title)
    if isinstance(figure, AttentionMaps):
        plots = {2: plot_attention_head, 3: plot_attention_heads, 4: plot_attention_grid}
        if figure.weights.ndim not in plots:
            raise ValueError("attention maps are (T, S), (H, T, S) or (L, H, T, S); got "
                             f"{tuple(figure.weights.shape)}")
        return plots[figure.weights.ndim](figure.weights, figure.tokens, out, title=figure.title)
    if isinstance(figure, AlignmentMap):
        return plot_alignment(figure.weights, figure.source, figure.output, out, title=figure.title)
    if isinstance(figure, ConfusionMatrix):
        return plot_confusion(figure.counts, figure.classes, out, title=figure.title)
    if isinstance(figure, ImageOverlays):
        return plot_image_attention(figure.image, figure.maps, out, title=figure.title)
    if isinstance(figure, Heatmap):
        return plot_heatmap(figure, out)
    if isinstance(figure, Heatmaps):
        return plot_heatmaps(figure, out)
    if isinstance(figure, Bars):
        return plot_bars(figure, out)
    if isinstance(figure, HeadHistory):
        return plot_head_history(figure, out)
    if isinstance(figure, EdgeGraph):
        return plot_edge_graph(figure, out)
    raise TypeError(f"not a figure: {type(figure).__name__}")
