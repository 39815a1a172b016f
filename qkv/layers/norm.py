"""Normalisation layers: LayerNorm and RMSNorm.

LayerNorm (Ba et al. 2016): y = (x - mean(x)) / sqrt(var(x) + eps) · γ + β, over the last
dim; used by the original Transformer (post-LN), GPT-2 and ViT (pre-LN).
RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x²) + eps) · γ; no centring, no bias;
used by Llama and SmolLM2. Lecture: CS189 Lec 22 (the Transformer layer: residual + LayerNorm).

Shapes: (..., dim) -> (..., dim).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NormKind = Literal["layernorm", "rmsnorm"]


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (GPT-style models often drop it)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # PyTorch's fused kernel computes exactly the formula above (tested against fp64 math).
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # PyTorch's rms_norm computes exactly the formula above (tested against fp64 math),
        # in one call instead of six: it matters at batch 1, where each op is ~5 µs of overhead.
        if x.dtype == self.weight.dtype:
            # PyTorch's kernel accumulates bf16/fp16 in fp32 itself (bit-identical to the cast
            # path below, tested): no casts to pay for, which matters when decoding.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def make_norm(kind: NormKind, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """Build the norm named ``kind`` ("layernorm" or "rmsnorm"; RMSNorm has no bias)."""
    if kind == "layernorm":
        return LayerNorm(dim, eps, bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")
