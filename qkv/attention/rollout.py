"""Attention rollout: how much each input token reaches each output through all layers.

One layer's attention A (T×T, rows = queries) says how a token mixes the others, but the
residual connection also passes every token straight through. Abnar & Zuidema (2020,
"Quantifying Attention Flow in Transformers") model a layer as Â = ½(A + I) with rows
renormalised, average the heads, and multiply the layers:

    R = Â_L · Â_{L-1} ··· Â_1          R[i, j]: share of input token j in output token i

Lectures: CS231N Lec 8 (ViT: where the class token looks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def attention_rollout(weights: Sequence[Tensor], residual: float = 0.5) -> Tensor:
    """Per-layer weights, each (B, H, T, T) with rows summing to 1, first layer first ->
    rollout (B, T, T), rows summing to 1.

    ``residual`` is the identity's share in each layer (0.5 as in the paper; 0 = pure attention
    products).
    """
    if not weights:
        raise ValueError("attention_rollout needs the weights of at least one layer")
    if not 0.0 <= residual < 1.0:
        raise ValueError(f"residual must be in [0, 1), got {residual}")
    B, _, T, _ = weights[0].shape
    eye = torch.eye(T, dtype=torch.float32, device=weights[0].device)
    rollout = eye.expand(B, T, T)
    for w in weights:
        a = (1 - residual) * w.float().mean(dim=1) + residual * eye  # heads averaged, (B, T, T)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a @ rollout  # later layers act on what earlier layers produced
    return rollout


def readout_attention(rows: Tensor, read_out: str) -> Tensor:
    """(..., T, T) attention or rollout -> (..., N) weights over the N patch tokens, as seen from
    the read-out: the class token's row (``cls``; its own column dropped and the rest
    renormalised) or the mean of all rows (``mean`` and ``concat``: every token feeds the head)."""
    if read_out == "cls":
        r = rows[..., 0, 1:]
        return r / r.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return rows.mean(dim=-2)
