"""What a model reads and what its attention pictures show: the four kinds, and the one check of
a layer/head request that every kind shares.

    encoder   text in, self-attention of every layer and head (MiniLM, BERT folders and GGUFs)
    decoder   text in and out, causal self-attention (GPT runs, SmolLM2, Llama/Qwen2/... files)
    image     an image in, attention over its grid (ViT runs: heads and rollout; captioners: words)
    seq2seq   text in and out, the alignment of output and input (seq2seq runs)
"""

from __future__ import annotations

from typing import Any, Literal

from qkv.errors import InputError

Kind = Literal["encoder", "decoder", "image", "seq2seq"]
KINDS: tuple[Kind, ...] = ("encoder", "decoder", "image", "seq2seq")


def check_layer_head(n_layers: int, n_heads: int, layer: int | None, head: int | None,
                     names: tuple[str, str] = ("layer", "head")) -> tuple[int, int | None]:
    """(layer in [0, L) (None: the last), head in [0, H) or None); negative indices count from
    the end. InputError naming the valid range (``names``: how the caller spells the two)."""
    L, H = n_layers, n_heads
    layer = L - 1 if layer is None else layer
    if not -L <= layer < L:
        raise InputError(f"{names[0]} must be in [{-L}, {L - 1}] for this {L}-layer model, got {layer}")
    if head is not None and not -H <= head < H:
        raise InputError(f"{names[1]} must be in [{-H}, {H - 1}] for this {H}-head model, got {head}")
    return layer % L, None if head is None else head % H


class LayersAndHeads:
    """``n_layers`` and ``n_heads`` of a pipeline whose model's config names them (GPT, Encoder,
    ViT): the attention a picture can choose from."""

    model: Any

    @property
    def n_layers(self) -> int:
        return self.model.cfg.n_layers

    @property
    def n_heads(self) -> int:
        return self.model.cfg.n_heads
