"""Pictures only: figures in (:mod:`qkv.figures`), PNG files out (loss curves, attention maps,
confusion matrices, attention over images). Nothing here loads a model or reads input; what a
model attends to comes from :mod:`qkv.pipelines`."""

from qkv.viz.draw import draw
from qkv.viz.images import plot_confusion, plot_image_attention
from qkv.viz.plots import (
    plot_alignment,
    plot_attention_grid,
    plot_attention_head,
    plot_attention_heads,
    plot_by_length,
    plot_loss_curve,
)
from qkv.viz.tokens import show_token, show_tokens

__all__ = ["draw", "plot_alignment", "plot_attention_grid", "plot_attention_head", "plot_attention_heads",
           "plot_by_length", "plot_confusion", "plot_image_attention", "plot_loss_curve",
           "show_token", "show_tokens"]
