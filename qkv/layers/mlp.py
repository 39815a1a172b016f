"""Position-wise feed-forward networks: the "MLP" half of every Transformer layer.

MLP: fc_out(act(fc_in(x))), with ReLU (Vaswani et al. 2017) or GELU (GPT-2, BERT, ViT;
Hendrycks & Gimpel 2016; "gelu_tanh" is GPT-2's tanh approximation).
SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"; Llama):
w_down(silu(w_gate(x)) ⊙ w_up(x)). GeGLU, the same with a GELU gate (tanh form: Gemma).
Lecture: CS189 Lec 22 (attention mixes tokens, the MLP transforms each token on its own).

Shapes: (B, T, dim) -> (B, T, dim) through a hidden width F.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import Linear

MLPKind = Literal["gelu", "gelu_tanh", "relu", "swiglu", "geglu_tanh", "none"]

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """Two linear layers with an activation between: dim -> hidden -> dim."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        activation: Literal["gelu", "gelu_tanh", "relu"] = "gelu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        self.act = _ACTIVATIONS[activation]
        self.fc_in = Linear(dim, hidden_dim, bias=bias)
        self.fc_out = Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class _GatedMLP(nn.Module):
    """w_down(gate(w_gate x) * w_up x); subclasses name the gate."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.w_gate = Linear(dim, hidden_dim, bias=bias)
        self.w_up = Linear(dim, hidden_dim, bias=bias)
        self.w_down = Linear(hidden_dim, dim, bias=bias)

    def gate(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(self.gate(self.w_gate(x)) * self.w_up(x))


class SwiGLU(_GatedMLP):
    """Gated MLP: w_down(silu(w_gate x) * w_up x)."""

    def gate(self, x: Tensor) -> Tensor:
        return F.silu(x)


class GeGLU(_GatedMLP):
    """Gated MLP with a GELU gate (tanh approximation, as Gemma): w_down(gelu(w_gate x) * w_up x).

    A sibling of SwiGLU, not a subclass: code that fuses SwiGLU's gate
    (``qkv.layers.quant.Int4SwiGLU``) hard-codes SiLU and selects it by ``isinstance``.
    """

    def gate(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


class NoMLP(nn.Module):
    """``--mlp none``: an attention-only block. The MLP sublayer adds nothing (zeros), so the
    block is x + Attn(x) and softmax is its only non-linearity (CS189 Lec 22: the MLP is the other
    one). Kept as a module so the MLP's place in the block (and hooks on it) stays the same."""

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(()).expand_as(x)


def make_mlp(kind: MLPKind, dim: int, hidden_dim: int, bias: bool = True) -> nn.Module:
    """Build the feed-forward network named ``kind`` (dropout, if any, is the block's, on the
    residual branch)."""
    if kind == "none":
        return NoMLP()
    if kind == "swiglu":
        return SwiGLU(dim, hidden_dim, bias)
    if kind == "geglu_tanh":
        return GeGLU(dim, hidden_dim, bias)
    if kind not in _ACTIVATIONS:
        kinds = [*_ACTIVATIONS, "swiglu", "geglu_tanh", "none"]
        raise ValueError(f"mlp must be one of {kinds}, got {kind!r}")
    return MLP(dim, hidden_dim, kind, bias)
