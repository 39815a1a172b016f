"""The captioner's attention weights: a scorer turns the LSTM state into a distribution over
the grid, α_t = softmax(e_t) (Xu et al. 2015, "Show, Attend and Tell", §3.1). One small module per
kind, chosen by the config (:func:`qkv.models.captioner.make_scorer`):

    additive   e_ti = w_vᵀ tanh(W_q h_{t-1} + W_k a_i)      (Bahdanau et al. 2015)
    dot        e_ti = (W_q h_{t-1})·a_i / √D                 (scaled dot product)
    location   e_t  = W h_{t-1}, one score per cell index   (never looks at the cells)
    uniform    α_ti = 1/L                                   (the baseline; nothing learned)

Each has ``keys(feats)``, what to compute once per image from the features (B, L, D) (or None),
and ``weights(h, feats, keys)``, α (B, L) from the LSTM state h (B, H); and ``state_name``, the
model attribute it is registered under: the name its parameters have always had in checkpoints,
so runs from before this module existed load as they are.

Shapes: B batch, L = g·g locations, D feature width, H LSTM width, A additive scoring width.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from qkv.attention.additive import AdditiveAttention
from qkv.attention.functional import softmax


class AdditiveScorer(AdditiveAttention):
    """Content-based, Bahdanau's MLP: e_ti = w_vᵀ tanh(W_q h + W_k a_i); W_k a_i once per image."""

    state_name = "attn"

    def keys(self, feats: Tensor) -> Tensor:
        return self.project_keys(feats)  # (B, L, A)

    def weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        return self(h, feats, projected_keys=keys).weights


class DotScorer(nn.Linear):
    """Content-based, scaled dot product: e_ti = (W_q h)·a_i / √D."""

    state_name = "query"

    def __init__(self, hidden: int, feature_dim: int) -> None:
        super().__init__(hidden, feature_dim, bias=False)

    def keys(self, feats: Tensor) -> None:
        return None

    def weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        q = self(h)  # (B, D)
        scores = (feats @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(feats.shape[-1])  # (B, L)
        return softmax(scores, dim=-1)


class LocationScorer(nn.Linear):
    """Location-based: e = W h, one score per cell index of a fixed grid of ``cells``."""

    state_name = "locate"

    def __init__(self, hidden: int, cells: int, image_size: int) -> None:
        super().__init__(hidden, cells)
        self.image_size = image_size  # for the message when a grid of another size comes

    def keys(self, feats: Tensor) -> None:
        return None

    def weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        if feats.shape[1] != self.out_features:
            raise ValueError(f"location-based addressing outputs a distribution over the {self.out_features} "
                             f"cells it was trained on and cannot address {feats.shape[1]}; give "
                             f"{self.image_size}x{self.image_size} images (content-based addressing "
                             "scores any number of cells)")
        return softmax(self(h), dim=-1)


class UniformScorer(nn.Module):
    """α_i = 1/L for every cell: no parameters (and so none that DDP would find unused)."""

    state_name = "uniform"

    def keys(self, feats: Tensor) -> None:
        return None

    def weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        return feats.new_full(feats.shape[:2], 1.0 / feats.shape[1])


Scorer = AdditiveScorer | DotScorer | LocationScorer | UniformScorer
