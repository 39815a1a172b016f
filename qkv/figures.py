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


@dataclass(frozen=True)
class Heatmap:
    """Values (R, C) as coloured cells: rows down, columns across, optional text in each cell.

    ``diverging``: centred on 0, blue below and red above (effects, attributions); otherwise one
    colour from low to high (probabilities, scores). ``label`` names the colour bar."""

    values: Tensor
    rows: Sequence[str]
    columns: Sequence[str]
    title: str = ""
    cells: Sequence[Sequence[str]] | None = None
    label: str = ""
    diverging: bool = False


@dataclass(frozen=True)
class Heatmaps:
    """Several heatmaps side by side under one title (e.g. one per head type)."""

    panels: Sequence[Heatmap]
    title: str = ""


@dataclass(frozen=True)
class Bars:
    """Horizontal bars, first at the top: ``labels`` and their ``values`` (probabilities, logit
    contributions); negative values extend left of zero."""

    labels: Sequence[str]
    values: Sequence[float]
    title: str = ""
    xlabel: str = ""


@dataclass(frozen=True)
class HeadHistory:
    """Heads forming during training: per head type, the best head's score at each recorded
    step (and every head's, faintly), beside the loss on repeated random tokens.

    steps (N,); scores: type -> (N, L, H); loss_first / loss_second (N,): the loss on the first
    and the second copy of the repeated sequence; ``formed``: the step each type first reached
    its threshold, or None; ``copying``: the step the model began to copy from context, or None."""

    steps: Sequence[int]
    scores: dict[str, Tensor]
    loss_first: Sequence[float]
    loss_second: Sequence[float]
    formed: dict[str, int | None] = field(default_factory=dict)
    title: str = "heads during training"
    copying: int | None = None  # the step the repeat's loss fell well below the first copy's


@dataclass(frozen=True)
class EdgeGraph:
    """The strongest edges between a model's components, drawn as a graph: ``edges`` are
    (sender, receiver, value), senders named "embed", "a<layer>.<head>", "m<layer>", receivers
    "a<layer>.<head>.q|k|v", "m<layer>" or "logits" (:class:`qkv.lens.Edges`); ``layers`` and
    ``heads`` place them: layers left to right, heads down, the MLP below its layer's heads."""

    edges: Sequence[tuple[str, str, float]]
    layers: int
    heads: int
    title: str = ""
    label: str = ""


Figure = (LossCurve | AttentionMaps | AlignmentMap | ConfusionMatrix | ImageOverlays | Heatmap | Heatmaps
          | Bars | HeadHistory | EdgeGraph)


@dataclass(frozen=True)
class Picture:
    """A figure a run keeps: what it shows and the file name it gets in the run directory."""

    file: str
    figure: Figure = field(repr=False)
