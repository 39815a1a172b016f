"""GPT: a decoder-only Transformer language model.

    tokens (B, T) -> token embedding (+ positions) -> n_layers causal blocks -> norm -> lm_head
    -> logits (B, T, vocab); trained to predict token t+1 from tokens 0..t.

Radford et al. 2018/2019 (GPT, GPT-2); the same class also holds Llama-style models
(RMSNorm, SwiGLU, RoPE, GQA, no biases) such as SmolLM2. Lectures: CS189 Lec 22 and
CS231N Lec 8 (masked self-attention, the decoder-only Transformer).

Shapes: B batch, T length, V vocabulary, dim model width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import (
    BACKENDS,
    ALiBi,
    Backend,
    BatchKVCache,
    KVCache,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
)
from qkv.layers import BlockConfig, decoder_stack
from qkv.layers.mlp import MLPKind
from qkv.layers.norm import NormKind
from qkv.nn.linear import Linear

PositionKind = Literal["learned", "sinusoidal", "rope", "alibi", "none"]


@dataclass
class GPTConfig:
    """Everything needed to rebuild a GPT (saved as ``config.json`` in a run directory)."""

    vocab_size: int = 256  # set from the tokenizer when training
    max_seq_len: int = 256  # context length in tokens (nanoGPT's block_size)
    dim: int = 384  # model width
    n_layers: int = 6  # Transformer blocks
    n_heads: int = 6  # query heads per attention layer
    n_kv_heads: int | None = None  # key/value heads: none = n_heads (MHA), fewer = GQA, 1 = MQA
    head_dim: int | None = None  # per-head width (none = dim / n_heads)
    mlp_hidden: int | None = None  # MLP hidden width (none = 4 * dim)
    mlp: MLPKind = "gelu"  # feed-forward network
    norm: NormKind = "layernorm"  # normalisation layer
    norm_eps: float = 1e-5  # epsilon of the norms
    norm_placement: Literal["pre", "post"] = "pre"  # norm before each sublayer (GPT-2) or after each sum
    positions: PositionKind = "learned"  # how the model knows token order
    rope_theta: float = 10000.0  # RoPE base (with --positions rope)
    tie_embeddings: bool = True  # share the token embedding with the output layer
    embed_scale: bool = False  # multiply the token embeddings by √dim (Gemma)
    dropout: float = 0.0  # dropout on embeddings, attention weights and residual branches
    bias: bool = True  # biases in linear layers and LayerNorm
    qkv_bias: bool | None = None  # biases on the q/k/v projections only (Qwen2); none = bias
    tie_qk: bool = False  # one matrix for queries and keys, W_Q = W_K: symmetric scores (CS189 Lec 21)
    backend: Backend = "sdpa"  # attention implementation: sdpa (fast), chunked, reference

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "dim", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv})")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.positions not in ("learned", "sinusoidal", "rope", "alibi", "none"):
            raise ValueError(
                "positions must be one of learned, sinusoidal, rope, alibi, none; "
                f"got {self.positions!r}"
            )
        if self.tie_qk and kv != self.n_heads:
            raise ValueError(f"tie_qk (W_Q = W_K) needs as many key/value heads as query heads: leave out "
                             f"n_kv_heads (got {kv} for {self.n_heads} query heads)")
        if self.mlp == "none" and self.mlp_hidden is not None:
            raise ValueError(f"mlp_hidden ({self.mlp_hidden}) has no effect with mlp none (attention-only "
                             "blocks); leave it out")
        if self.norm_placement not in ("pre", "post"):
            raise ValueError(f"norm_placement must be pre or post, got {self.norm_placement!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def resolved_head_dim(self) -> int:
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def resolved_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def block_config(self) -> BlockConfig:
        return BlockConfig(
            dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, mlp_hidden=self.mlp_hidden, mlp=self.mlp, norm=self.norm,
            norm_position=self.norm_placement, norm_eps=self.norm_eps, bias=self.bias, qkv_bias=self.qkv_bias,
            dropout=self.dropout, tie_qk=self.tie_qk,
            attn_dropout=self.dropout, backend=self.backend, causal=True,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def position_bias(alibi: ALiBi | None, offset: int | Tensor, T: int, end: int) -> Tensor | None:
    """The attention bias of T queries at ``offset`` onwards over keys 0..end-1: ALiBi's
    (Press et al. 2022) distance penalties, per row when ``offset`` is a (B,) tensor of positions
    (a running batch); None for every other kind of position."""
    if alibi is None:
        return None
    return alibi.rows(offset, T, end) if isinstance(offset, Tensor) else alibi(T, end)


class GPTOutput(NamedTuple):
    """logits (B, T, V) (or (B, 1, V) with ``last_only``); loss when targets were given;
    per-layer attention weights (B, H, T, S) when asked for."""

    logits: Tensor
    loss: Tensor | None = None
    weights: list[Tensor] | None = None


class GPT(nn.Module):
    """Decoder-only Transformer built only from ``qkv.attention`` and ``qkv.layers``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb: nn.Module | None = None
        self.rope: RotaryEmbedding | None = None
        self.alibi: ALiBi | None = None
        if cfg.positions == "learned":
            self.pos_emb = LearnedPositionalEmbedding(cfg.max_seq_len, cfg.dim)
        elif cfg.positions == "sinusoidal":
            self.pos_emb = SinusoidalPositionalEmbedding(cfg.max_seq_len, cfg.dim)
        elif cfg.positions == "rope":
            self.rope = RotaryEmbedding(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta)
        elif cfg.positions == "alibi":
            self.alibi = ALiBi(cfg.n_heads)
        self.drop = nn.Dropout(cfg.dropout)
        self.stack = decoder_stack(cfg.block_config(), cfg.n_layers, cross_attention=False)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # Press & Wolf 2017: one matrix, both ends
        self.apply(self._init_weights)
        # GPT-2: scale the residual-branch output projections by 1/√(2·n_layers) so the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "fc_out.weight", "w_down.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without position tables (as nanoGPT reports)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and isinstance(self.pos_emb, LearnedPositionalEmbedding):
            n -= self.pos_emb.weight.numel()
        return n

    def make_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A preallocated KV cache sized for this model (K heads per layer, not H)."""
        p = self.tok_emb.weight
        return KVCache(
            self.cfg.n_layers, batch_size, self.cfg.resolved_kv_heads,
            max_seq_len or self.cfg.max_seq_len, self.cfg.resolved_head_dim,
            dtype=dtype or p.dtype, device=device or p.device,
        )

    def embed(self, idx: Tensor, offset: int | Tensor = 0) -> Tensor:
        """idx (B, T) token ids at positions ``offset`` onwards (per row: a (B,) tensor) -> the
        residual stream's input x (B, T, dim): token embeddings, scaled (Gemma) and with learned or
        sinusoidal positions added where the model has them (RoPE and ALiBi act inside attention)."""
        x = self.tok_emb(idx)  # (B, T, dim)
        if self.cfg.embed_scale:
            x = x * self.cfg.dim**0.5  # Gemma: embeddings on the scale of the residual stream
        if self.pos_emb is not None:
            x = x + self.pos_emb(idx.shape[1], offset)  # (T, dim) broadcast over B; per row (B, T, dim)
        return x

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        last_only: bool = False,
        backend: Backend | None = None,
        return_weights: bool = False,
        weights_layers: Collection[int] | None = None,
    ) -> GPTOutput:
        """idx (B, T) token ids -> GPTOutput(logits, loss, weights).

        Args:
            targets: (B, T) next-token ids; -100 = ignore. Gives the mean cross-entropy.
            cache: decode incrementally: idx holds only the new tokens, which sit at
                positions cache.pos onwards; the cache is advanced by T.
            last_only: compute logits for the last position only (generation).
            weights_layers: with ``return_weights``, only these layers compute weights (the
                explicit reference attention), the rest run ``backend``; their entries are None.
        """
        if idx.ndim != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        T = idx.shape[1]
        offset = 0 if cache is None else cache.pos
        if isinstance(cache, BatchKVCache):  # rows at their own positions: one token each
            if T != 1:
                raise ValueError(f"a BatchKVCache step takes one token per row, got {T}; prefill each "
                                 "row alone into BatchKVCache.row(b)")
            end = cache.span + T  # each row attends over its own keys only (attend_rows)
        else:
            end = offset + T
        if end > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds the model's context "
                f"max_seq_len={self.cfg.max_seq_len}; crop the input"
            )
        x = self.embed(idx, offset)  # (B, T, dim)
        bias = position_bias(self.alibi, offset, T, end)
        if self.training and self.cfg.dropout > 0:
            x = self.drop(x)
        out = self.stack(x, bias=bias, rope=self.rope, cache=cache, backend=backend,
                         return_weights=return_weights, weights_layers=weights_layers)
        h = out.x[:, -1:] if last_only else out.x
        logits = self.lm_head(h)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
            )
        return GPTOutput(logits, loss, out.self_weights)
