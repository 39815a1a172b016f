"""Image models ready to use: a trained ViT run as an :class:`ImageClassifier`, and what the
attention pictures of every image model are made of (:class:`ImageAttention`).

    clf = qkv.load("runs/vit-fashion-cpu-...")
    x, notes = clf.read_image("shoe.png")          # uint8 (C, size, size), as the model reads it
    probs = clf.classify(x[None])                  # (1, n_classes)
    att = clf.attention(x)                         # each head of the last layer + the rollout

The attention is the read-out's row of each head (the class token's, or the mean of all rows)
and its rollout through all layers (Abnar & Zuidema 2020), from the ViT's own
``backend="reference"`` forward pass. Shapes: g patches per side, K classes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from qkv.models.vit import ViT
from qkv.pipelines.kinds import Kind, LayersAndHeads, check_layer_head

ImageInput = str | os.PathLike[str] | bytes


@dataclass
class ImageAttention:
    """Attention over an image's grid of patches (ViT) or CNN cells (captioner).

    image: uint8 (C, size, size), what the model saw. maps: [(caption, (g, g) weights)].
    title: the prediction (ViT) or the caption. details: family-specific numbers for a caption
    (the server sends them as they are).
    """

    image: Tensor
    grid: int
    maps: list[tuple[str, Tensor]]
    title: str
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def read_model_image(image: ImageInput, size: int, channels: int,
                     max_pixels: int | None = None) -> tuple[Tensor, list[str]]:
    """A file path or the bytes of an upload -> uint8 (C, size, size) as a model of that input
    size reads it, and notes on what was converted (size, colour mode)."""
    from qkv.data.images import read_image

    return read_image(image, size, channels, max_pixels=max_pixels)


@torch.no_grad()
def predict(model: ViT, images: Tensor, mean: float, std: float, batch_size: int = 500) -> Tensor:
    """uint8 images (N, C, H, W) -> class probabilities (N, n_classes), in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(images), batch_size):
        x = (images[i : i + batch_size].float() / 255 - mean) / std
        out.append(model(x.to(device)).logits.float().softmax(-1).cpu())
    return torch.cat(out) if out else torch.empty(0, model.cfg.n_classes)


@torch.no_grad()
def attention_maps(model: ViT, image: Tensor, mean: float, std: float,
                   layer: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """One uint8 image (C, H, W) -> (class probabilities (K,), read-out attention per head of
    ``layer`` (H, g, g), attention rollout through all layers (g, g)); g = patches per side.

    "Read-out attention" is the class token's row for ``read_out="cls"``, else the mean of all
    rows (see :func:`qkv.attention.rollout.readout_attention`).
    """
    from qkv.attention.rollout import attention_rollout, readout_attention

    model.eval()
    cfg = model.cfg
    x = ((image.float() / 255 - mean) / std)[None].to(next(model.parameters()).device)
    out = model(x, backend="reference", return_weights=True)
    assert out.weights is not None
    g = cfg.grid
    heads = readout_attention(out.weights[layer][0].float(), cfg.read_out).reshape(-1, g, g)
    rollout = readout_attention(attention_rollout(out.weights)[0], cfg.read_out).reshape(g, g)
    return out.logits[0].float().softmax(-1).cpu(), heads.cpu(), rollout.cpu()


@dataclass
class ImageClassifier(LayersAndHeads):
    """A trained ViT run: the model, its class names and the pixel normalisation it was trained
    with ((x / 255 - mean) / std); ``dataset``: the name of the images it learned from."""

    name: str
    model: ViT
    classes: list[str]
    mean: float
    std: float
    dataset: str
    run_dir: Path
    kind: ClassVar[Kind] = "image"

    @property
    def context(self) -> int:
        """Grid cells read at once (patches)."""
        return self.model.cfg.grid ** 2

    def read_image(self, image: ImageInput, max_pixels: int | None = None) -> tuple[Tensor, list[str]]:
        """A file or an upload's bytes -> uint8 (C, size, size) as this model reads it, and notes."""
        cfg = self.model.cfg
        return read_model_image(image, cfg.image_size, cfg.channels, max_pixels)

    def classify(self, images: Tensor) -> Tensor:
        """uint8 (N, C, H, W) images of the model's size -> class probabilities (N, K)."""
        return predict(self.model, images, self.mean, self.std)

    def attention(self, image: Tensor, layer: int | None = None, layer_name: str = "layer") -> ImageAttention:
        """uint8 (C, size, size) -> each head of ``layer`` (default: the last) and the rollout
        through all layers, titled with the prediction. ``layer_name``: how the caller spells
        the layer in an error ("--layer")."""
        layer, _ = check_layer_head(self.n_layers, self.n_heads, layer, None, (layer_name, "head"))
        probs, heads, rollout = attention_maps(self.model, image, self.mean, self.std, layer=layer)
        maps = [(f"layer {layer} head {h}", heads[h]) for h in range(len(heads))] + [("rollout", rollout)]
        classes, pred = self.classes, int(probs.argmax())
        top = torch.topk(probs, min(3, len(probs)))
        cfg = self.model.cfg
        details = {"layer": layer, "prediction": classes[pred], "probability": float(probs[pred]),
                   "top": [(classes[int(i)], float(v)) for v, i in zip(top.values, top.indices, strict=True)],
                   "rollout_peak": divmod(int(rollout.argmax()), cfg.grid),
                   "patch_size": cfg.patch_size, "n_layers": cfg.n_layers}
        return ImageAttention(image, cfg.grid, maps, f"{classes[pred]} ({probs[pred]:.0%})", [], details)
