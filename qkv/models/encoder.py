"""A BERT-style bidirectional encoder, and the read-outs that turn its tokens into one vector.

    ids (B, T) -> word + position + token-type embeddings -> LayerNorm -> n_layers post-LN
    blocks (no causal mask; padding masked) -> hidden states (B, T, dim) -> pooling -> (B, dim)

Devlin et al. 2019 (BERT); Reimers & Gurevych 2019 (Sentence-BERT: mean pooling of the last
hidden state gives sentence embeddings whose inner products measure similarity). all-MiniLM-L6-v2
is this architecture with 6 layers, 12 heads, width 384 (Wang et al. 2020, MiniLM).
Lectures: CS189 Lec 22 (the Transformer encoder; inner-product retrieval), CS231N Lec 8.

Shapes: B batch, T tokens, dim model width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from qkv.attention import BACKENDS, Backend, LearnedPositionalEmbedding
from qkv.layers import BlockConfig, encoder_stack
from qkv.layers.mlp import MLPKind
from qkv.layers.norm import LayerNorm

Pooling = Literal["mean", "cls"]


@dataclass
class EncoderConfig:
    """Everything needed to rebuild an encoder (BERT-base defaults scaled to MiniLM's size)."""

    vocab_size: int = 30522  # WordPiece vocabulary
    max_seq_len: int = 512  # learned positions
    type_vocab_size: int = 2  # token types (segment A / B); 0 = no token-type embedding
    dim: int = 384  # model width
    n_layers: int = 6  # Transformer blocks
    n_heads: int = 12  # attention heads
    mlp_hidden: int = 1536  # MLP hidden width
    mlp: MLPKind = "gelu"  # BERT uses exact (erf) GELU
    norm_eps: float = 1e-12  # LayerNorm epsilon (BERT: 1e-12)
    norm_position: Literal["pre", "post"] = "post"  # BERT is post-LN
    dropout: float = 0.0  # dropout on embeddings, attention weights and residual branches
    pooling: Pooling = "mean"  # sentence read-out: mean of real tokens, or the [CLS] token
    backend: Backend = "sdpa"  # attention implementation

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "dim", "n_layers", "n_heads", "mlp_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {self.pooling!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def block_config(self) -> BlockConfig:
        return BlockConfig(
            dim=self.dim, n_heads=self.n_heads, mlp_hidden=self.mlp_hidden, mlp=self.mlp,
            norm="layernorm", norm_position=self.norm_position, norm_eps=self.norm_eps, bias=True,
            dropout=self.dropout, attn_dropout=self.dropout, backend=self.backend,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class EncoderOutput(NamedTuple):
    """hidden (B, T, dim): the last layer's states; per-layer weights (B, H, T, T) if asked."""

    hidden: Tensor
    weights: list[Tensor] | None = None


def mean_pool(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """(B, T, dim), (B, T) 1 = real token -> (B, dim): the average over real tokens only
    (Sentence-BERT's read-out; padding must not dilute the mean)."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def cls_pool(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """(B, T, dim) -> (B, dim): the state of the first ([CLS]) token."""
    return hidden[:, 0]


POOLERS = {"mean": mean_pool, "cls": cls_pool}


class Encoder(nn.Module):
    """Bidirectional Transformer encoder built only from ``qkv.attention`` and ``qkv.layers``."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = LearnedPositionalEmbedding(cfg.max_seq_len, cfg.dim)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.dim) if cfg.type_vocab_size else None
        # Post-LN stacks normalise after every sublayer; BERT also normalises the embeddings.
        self.emb_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.stack = encoder_stack(cfg.block_config(), cfg.n_layers)

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        backend: Backend | None = None,
        return_weights: bool = False,
    ) -> EncoderOutput:
        """ids (B, T) -> EncoderOutput(hidden (B, T, dim), weights).

        Args:
            attention_mask: (B, T), 1/True = real token, 0 = padding. Padding keys get zero
                weight; padded positions still get (meaningless) states, as in BERT.
            token_type_ids: (B, T) segment ids (default all 0).
        """
        if ids.ndim != 2:
            raise ValueError(f"ids must be (B, T) token ids, got shape {tuple(ids.shape)}")
        T = ids.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"{T} tokens exceed the encoder's max_seq_len={self.cfg.max_seq_len}; "
                             "truncate the input")
        x = self.tok_emb(ids) + self.pos_emb(T)  # (B, T, dim)
        if self.type_emb is not None:
            types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
            x = x + self.type_emb(types)
        x = self.drop(self.emb_norm(x))
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != ids.shape:
                raise ValueError(f"attention_mask must have the shape of ids {tuple(ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): True = may attend
        out = self.stack(x, mask=mask, backend=backend, return_weights=return_weights)
        return EncoderOutput(out.x, out.self_weights)

    def pool(self, hidden: Tensor, attention_mask: Tensor | None = None,
             pooling: Pooling | None = None) -> Tensor:
        """(B, T, dim) -> (B, dim) with the config's read-out (or ``pooling``)."""
        kind = pooling or self.cfg.pooling
        if kind not in POOLERS:
            raise ValueError(f"pooling must be one of {sorted(POOLERS)}, got {kind!r}")
        return POOLERS[kind](hidden, attention_mask)
