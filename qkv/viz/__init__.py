"""Pictures: loss curves and attention maps (matplotlib, written to PNG)."""

from qkv.viz.plots import plot_attention_heads, plot_loss_curve

__all__ = ["plot_attention_heads", "plot_loss_curve"]
