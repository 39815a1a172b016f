"""What the two encoder-decoder models share (:mod:`qkv.models.rnn_seq2seq`,
:mod:`qkv.models.transformer`, each with its own config beside it): their output type, how a
target sequence splits into decoder inputs and outputs (teacher forcing), and the loss. Special
ids: :mod:`qkv.tokenizers.vocab`.

Shapes: B batch, S source length, T target length, V target vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

from qkv.tokenizers.vocab import PAD


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
