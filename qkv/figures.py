"""What a picture shows, as data: the values that families and commands hand to :mod:`qkv.viz`,
which draws them (``qkv.viz.draw(figure, path)``). A top-level helper: imports nothing of qkv.

Keeping the two apart lets a model family say what its run's pictures are (the loss curve, the
last layer's attention, a confusion matrix) without drawing anything, and lets any caller draw
the same figure anywhere. Shapes: L layers, H heads, T query tokens, S keys, K classes,
g grid cells per side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor


@dataclass(frozen=True)
class LossCurve:
    """Train loss (every step, lightly smoothed) and validation loss from a run's metrics.jsonl."""

    metrics: Path
    title: str = "training loss"


@dataclass(frozen=True)
class AttentionMaps:
    """Self-attention heatmaps, queries down, keys across, drawn by the shape of ``weights``:
    (T, S) one head large with every token labelled; (H, T, S) every head of one layer;
    (L, H, T, S) every head of every layer, one small panel each."""

    weights: Tensor
    tokens: Sequence[str]
    title: str = "attention"


@dataclass(frozen=True)
class AlignmentMap:
    """An encoder-decoder's attention: output symbols (rows) over input symbols (columns),
    weights (T_out, S_in), as Bahdanau et al. 2015, Fig. 3 draw it."""

    weights: Tensor
    source: Sequence[str]
    output: Sequence[str]
    title: str = "attention: output (rows) x input (columns)"


@dataclass(frozen=True)
class ConfusionMatrix:
    """Counts (K, K), row = true class, column = predicted."""

    counts: Tensor | Sequence[Sequence[int]]
    classes: Sequence[str]
    title: str = "confusion matrix"


@dataclass(frozen=True)
class ImageOverlays:
    """An image (uint8 or float (C, H, W)) and one (caption, (g, g) weights) map over it per panel."""

    image: Tensor
    maps: Sequence[tuple[str, Tensor]]
    title: str = ""


Figure = LossCurve | AttentionMaps | AlignmentMap | ConfusionMatrix | ImageOverlays


@dataclass(frozen=True)
class Picture:
    """A figure a run keeps: what it shows and the file name it gets in the run directory."""

    file: str
    figure: Figure = field(repr=False)
