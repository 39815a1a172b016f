"""What the two encoder-decoder models share (:mod:`qkv.models.rnn_seq2seq`,
:mod:`qkv.models.transformer`): their output type, how a target sequence splits into decoder
inputs and outputs (teacher forcing), the loss, and the config that picks one of them
(:class:`Seq2SeqConfig`, :func:`build_model`). Special ids: :mod:`qkv.tokenizers.vocab`.

Shapes: B batch, S source length, T target length, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.tokenizers.vocab import PAD

Arch = Literal["rnn", "rnn-noattn", "transformer"]


class Seq2SeqOutput(NamedTuple):
    """logits (B, T, V_tgt); loss (mean over non-padding targets) when targets are given;
    cross-attention weights (B, T, S) (RNN) or per-layer (B, H, T, S) (Transformer)."""

    logits: Tensor
    loss: Tensor | None = None
    weights: Tensor | list[Tensor] | None = None


def split_targets(tgt: Tensor) -> tuple[Tensor, Tensor]:
    """[BOS, y1..yn, EOS, PAD...] (B, T+1) -> decoder inputs (B, T) and outputs (B, T)."""
    return tgt[:, :-1], tgt[:, 1:]


def seq2seq_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets, padding ignored."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=PAD)


@dataclass
class Seq2SeqConfig:
    """Architecture and sizes (the RNN fields and the Transformer fields are separate)."""

    arch: Arch = "rnn"  # rnn (+ Bahdanau attention), rnn-noattn (fixed context), transformer
    cell: Literal["gru", "lstm"] = "gru"  # RNN cell
    emb_dim: int = 64  # RNN: character embedding width
    hidden: int = 128  # RNN: encoder width per direction
    dec_hidden: int = 256  # RNN: decoder state width
    attn_dim: int = 128  # RNN: width of the additive attention's scoring MLP
    dim: int = 128  # Transformer: model width
    n_heads: int = 4  # Transformer: attention heads
    enc_layers: int = 2  # Transformer: encoder blocks
    dec_layers: int = 2  # Transformer: decoder blocks
    dropout: float = 0.0  # dropout on embeddings and (Transformer) residual branches
    max_src_len: int = 64  # longest source, in characters (set from the data when training)
    max_tgt_len: int = 16  # longest target + EOS (set from the data when training)
    src_vocab: int = 0  # set from the data
    tgt_vocab: int = 0  # set from the data

    def __post_init__(self) -> None:
        if self.arch not in ("rnn", "rnn-noattn", "transformer"):
            raise ValueError(f"arch must be rnn, rnn-noattn or transformer, got {self.arch!r}")
        if self.cell not in ("gru", "lstm"):
            raise ValueError(f"cell must be gru or lstm, got {self.cell!r}")
        for name in ("emb_dim", "hidden", "dec_hidden", "attn_dim", "dim", "n_heads", "enc_layers",
                     "dec_layers", "max_src_len", "max_tgt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")


def build_model(cfg: Seq2SeqConfig) -> nn.Module:
    """The model ``cfg.arch`` names: RNNSeq2Seq (with or without attention) or TransformerSeq2Seq."""
    from qkv.models.rnn_seq2seq import RNNSeq2Seq
    from qkv.models.transformer import TransformerSeq2Seq

    if cfg.arch == "transformer":
        return TransformerSeq2Seq(cfg.src_vocab, cfg.tgt_vocab, cfg.dim, cfg.n_heads, cfg.enc_layers,
                                  cfg.dec_layers, dropout=cfg.dropout, max_src_len=cfg.max_src_len,
                                  max_tgt_len=cfg.max_tgt_len)
    return RNNSeq2Seq(cfg.src_vocab, cfg.tgt_vocab, cfg.emb_dim, cfg.hidden, cfg.dec_hidden,
                      cfg.attn_dim, cfg.cell, attention=cfg.arch == "rnn", dropout=cfg.dropout)
