"""qkv.viz.draw: each figure value (qkv.figures) becomes the picture its plot function draws, the
layout of attention maps chosen by their shape; anything else is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv import figures
from qkv.viz import draw, plots
from qkv.viz import images as image_plots


def _same_png(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_each_figure_draws_what_its_plot_function_draws(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(2, 3, 5, 5, generator=g).softmax(-1)  # (L, H, T, S)
    tokens = list("abcde")
    cases = [
        (figures.AttentionMaps(w, tokens, "grid"),
         lambda out: plots.plot_attention_grid(w, tokens, out, "grid")),
        (figures.AttentionMaps(w[1], tokens, "heads"),
         lambda out: plots.plot_attention_heads(w[1], tokens, out, "heads")),
        (figures.AttentionMaps(w[1, 2], tokens, "one"),
         lambda out: plots.plot_attention_head(w[1, 2], tokens, out, "one")),
        (figures.AlignmentMap(w[0, 0, :3], list("xyz12"), list("abc")),
         lambda out: plots.plot_alignment(w[0, 0, :3], list("xyz12"), list("abc"), out)),
        (figures.ConfusionMatrix([[3, 1], [0, 4]], ["a", "b"], "cm"),
         lambda out: image_plots.plot_confusion([[3, 1], [0, 4]], ["a", "b"], out, "cm")),
        (figures.ImageOverlays(torch.zeros(1, 8, 8, dtype=torch.uint8), [("m", w[0, 0, :4, :4])], "t"),
         lambda out: image_plots.plot_image_attention(torch.zeros(1, 8, 8, dtype=torch.uint8),
                                                      [("m", w[0, 0, :4, :4])], out, "t")),
    ]
    for i, (figure, direct) in enumerate(cases):
        a, b = tmp_path / f"{i}-draw.png", tmp_path / f"{i}-direct.png"
        assert draw(figure, a) == a
        direct(b)
        assert _same_png(a, b), type(figure).__name__
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "train_loss": 2.0}\n{"step": 2, "val_loss": 1.5}\n')
    draw(figures.LossCurve(metrics), tmp_path / "loss-draw.png")
    plots.plot_loss_curve(metrics, tmp_path / "loss-direct.png")
    assert _same_png(tmp_path / "loss-draw.png", tmp_path / "loss-direct.png")


def test_attention_maps_of_another_shape_and_non_figures_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\(T, S\), \(H, T, S\) or \(L, H, T, S\); got \(5,\)"):
        draw(figures.AttentionMaps(torch.ones(5), list("abcde")), tmp_path / "x.png")
    with pytest.raises(TypeError, match="not a figure: str"):
        draw("loss", tmp_path / "x.png")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing written
