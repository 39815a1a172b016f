"""The Transformer encoder-decoder (Vaswani et al. 2017), from ``qkv.layers``.

    source ids -> embedding·√d + sinusoidal positions -> encoder blocks (bidirectional)
                                                            │ memory (B, S, d)
    target ids -> embedding·√d + sinusoidal positions -> decoder blocks: causal self-attention,
                  cross-attention to the memory (source padding masked), MLP -> logits

Pre-LN blocks (a final norm on each stack) by default; ``norm_placement="post"`` is the paper's
block (a norm after each residual sum). ``positions`` chooses how order gets in: the paper's
sinusoids added to the embeddings (default), a learned table per side, RoPE or ALiBi inside every
self-attention (cross-attention then matches by content alone), or none — for the length-
extrapolation experiment (``benchmarks/length_extrapolation.py``). Decoding one token at a time
reuses the decoder's self-attention keys and values from a :class:`~qkv.attention.KVCache`;
cross-attention reads the memory, which does not change.

Lectures: CS231N Lec 8 (the encoder-decoder Transformer, cross-attention), CS189 Lec 22.
Shapes: B batch, S source length, T target length, d width, H heads, V vocabularies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.attention import ALiBi, KVCache, LearnedPositionalEmbedding, RotaryEmbedding, sinusoidal_table
from qkv.attention.functional import Backend
from qkv.layers import BlockConfig, decoder_stack, encoder_stack
from qkv.models.config_checks import check_choices
from qkv.models.seq2seq import Seq2SeqOutput, seq2seq_loss, split_targets
from qkv.tokenizers.vocab import PAD


@dataclass
class TransformerSeq2SeqConfig:
    """Everything needed to rebuild a Transformer encoder-decoder (saved in a run's config.json)."""

    arch: Literal["transformer"] = "transformer"  # the one architecture this config builds
    dim: int = 128  # Transformer: model width
    n_heads: int = 4  # Transformer: attention heads (self- and cross-attention)
    enc_layers: int = 2  # Transformer: encoder blocks
    dec_layers: int = 2  # Transformer: decoder blocks
    mlp_hidden: int | None = None  # Transformer: the MLP's hidden width; none = 4 x dim
    dropout: float = 0.0  # dropout on the embeddings, the attention weights and residual branches
    max_src_len: int = 64  # longest source, in tokens (set from the data when training)
    max_tgt_len: int = 16  # longest target + EOS (set from the data when training)
    src_vocab: int = 0  # set from the data
    tgt_vocab: int = 0  # set from the data
    backend: Backend = "sdpa"  # Transformer: attention backend while training (pictures: reference)
    positions: Literal["sinusoidal", "learned", "rope", "alibi", "none"] = "sinusoidal"  # Transformer: order
    norm_placement: Literal["pre", "post"] = "pre"  # Transformer: norm before each sublayer or after each sum

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("dim", "n_heads", "enc_layers", "dec_layers", "max_src_len", "max_tgt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")


@dataclass
class TransformerDecoderState:
    """Memory, its mask and the self-attention KV cache; rows reorderable for beam search."""

    memory: Tensor  # (N, S, d)
    mask: Tensor  # (N, 1, 1, S) True = real source token
    cache: KVCache

    def reorder(self, index: Tensor) -> None:
        self.memory = self.memory.index_select(0, index)
        self.mask = self.mask.index_select(0, index)
        self.cache.reorder(index)


class TransformerSeq2Seq(nn.Module):
    """Encoder-decoder Transformer over token ids (PAD = 0)."""

    def __init__(self, cfg: TransformerSeq2SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.dim
        self.dim, self.max_src_len, self.max_tgt_len = dim, cfg.max_src_len, cfg.max_tgt_len
        block = BlockConfig(dim=dim, n_heads=cfg.n_heads, mlp_hidden=cfg.mlp_hidden, mlp="gelu",
                            norm_position=cfg.norm_placement, dropout=cfg.dropout, attn_dropout=cfg.dropout,
                            backend=cfg.backend)
        self.src_emb = nn.Embedding(cfg.src_vocab, dim, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(cfg.tgt_vocab, dim, padding_idx=PAD)
        longest = max(cfg.max_src_len, cfg.max_tgt_len)
        sinusoids = sinusoidal_table(longest, dim) if cfg.positions == "sinusoidal" else None
        self.register_buffer("pos", sinusoids, persistent=False)
        learned = cfg.positions == "learned"  # one table per side, as BART
        self.src_pos = LearnedPositionalEmbedding(cfg.max_src_len, dim) if learned else None
        self.tgt_pos = LearnedPositionalEmbedding(cfg.max_tgt_len, dim) if learned else None
        self.rope = RotaryEmbedding(dim // cfg.n_heads, longest) if cfg.positions == "rope" else None
        self.alibi = ALiBi(cfg.n_heads) if cfg.positions == "alibi" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = encoder_stack(block, cfg.enc_layers)
        self.decoder = decoder_stack(block, cfg.dec_layers, cross_attention=True)
        self.head = nn.Linear(dim, cfg.tgt_vocab)
        for emb in (self.src_emb, self.tgt_emb):
            nn.init.normal_(emb.weight, std=dim**-0.5)
            with torch.no_grad():
                emb.weight[PAD].zero_()

    def _embed(self, emb: nn.Embedding, table: LearnedPositionalEmbedding | None, ids: Tensor,
               offset: int = 0) -> Tensor:
        """ids (B, T) at positions offset.. -> emb(ids)·√d + the positions added to inputs (the
        sinusoids, or ``table``, this side's learned rows); RoPE and ALiBi act inside attention."""
        T = ids.shape[1]
        x = emb(ids) * math.sqrt(self.dim)
        if self.pos is not None:
            x = x + self.pos[offset:offset + T].to(x.dtype)
        if table is not None:
            x = x + table(T, offset).to(x.dtype)
        return self.drop(x)

    def _bias(self, T: int, S: int) -> Tensor | None:
        """ALiBi's −m_h·|i − j| for T queries ending at key S (self-attention only), else None."""
        return None if self.alibi is None else self.alibi(T, S)

    def encode(self, src: Tensor, *, return_weights: bool = False):
        """src (B, S) -> memory (B, S, d), source mask (B, 1, 1, S) [, encoder weights]."""
        if src.shape[1] > self.max_src_len:
            raise ValueError(f"source has {src.shape[1]} tokens; this model reads at most {self.max_src_len}")
        mask = (src != PAD)[:, None, None, :]
        S = src.shape[1]
        x = self._embed(self.src_emb, self.src_pos, src)
        out = self.encoder(x, mask=mask, rope=self.rope, bias=self._bias(S, S),
                           backend="reference" if return_weights else None, return_weights=return_weights)
        return out.x, mask, out.self_weights

    def forward(self, src: Tensor, tgt: Tensor, *, return_weights: bool = False) -> Seq2SeqOutput:
        """Teacher forcing. src (B, S); tgt (B, T+1) = [BOS, y..., EOS, PAD...]."""
        tgt_in, tgt_out = split_targets(tgt)
        if tgt_in.shape[1] > self.max_tgt_len:
            raise ValueError(f"target has {tgt_in.shape[1]} tokens; this model writes at most "
                             f"{self.max_tgt_len}")
        memory, mask, _ = self.encode(src)
        T = tgt_in.shape[1]
        x = self._embed(self.tgt_emb, self.tgt_pos, tgt_in)
        out = self.decoder(x, memory, context_mask=mask, rope=self.rope,
                           bias=self._bias(T, T), backend="reference" if return_weights else None,
                           return_weights=return_weights)
        logits = self.head(out.x)
        return Seq2SeqOutput(logits, seq2seq_loss(logits, tgt_out), out.cross_weights)

    # ------------------------------------------------------------------ step-wise decoding

    def start(self, src: Tensor) -> TransformerDecoderState:
        memory, mask, _ = self.encode(src)
        blocks = self.decoder.blocks
        cache = KVCache(len(blocks), src.shape[0], blocks[0].attn.n_kv_heads, self.max_tgt_len,
                        blocks[0].attn.head_dim, dtype=memory.dtype, device=memory.device)
        return TransformerDecoderState(memory, mask, cache)

    def step(self, state: TransformerDecoderState, prev: Tensor) -> tuple[Tensor, Tensor]:
        """prev (N,) -> logits (N, V) and the last layer's cross-attention averaged over heads
        (N, S); appends to the KV cache."""
        pos = state.cache.pos
        if pos >= self.max_tgt_len:
            raise ValueError(f"this model writes at most {self.max_tgt_len} tokens")
        x = self._embed(self.tgt_emb, self.tgt_pos, prev[:, None], offset=pos)
        out = self.decoder(x, state.memory, context_mask=state.mask, cache=state.cache, rope=self.rope,
                           bias=self._bias(1, pos + 1), backend="reference", return_weights=True)
        assert out.cross_weights is not None
        return self.head(out.x[:, -1]), out.cross_weights[-1][:, :, -1].mean(1)
