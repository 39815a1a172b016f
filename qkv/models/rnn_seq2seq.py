"""RNN encoder-decoder with Bahdanau (additive) attention, and the fixed-context baseline.

    encoder: x_1..x_S -> bidirectional GRU/LSTM -> h_j = [h→_j; h←_j]          (B, S, 2H)
    decoder: s_0 = tanh(W [h→_S; h←_1])
             at step t:  e_tj = vᵀ tanh(W_q s_{t-1} + W_k h_j)   (padding: e = -inf)
                         α_t = softmax(e_t),  c_t = Σ_j α_tj h_j
                         s_t = GRU([emb(y_{t-1}); c_t], s_{t-1})
                         p(y_t) = softmax(W_o [s_t; c_t; emb(y_{t-1})])

Bahdanau, Cho & Bengio 2015 ("Neural Machine Translation by Jointly Learning to Align and
Translate"). With ``arch="rnn-noattn"`` the context is the same summary [h→_S; h←_1] at every
step (Cho et al. 2014 / Sutskever et al. 2014): the fixed-length bottleneck the lectures
start from (CS189 Lec 21, CS231N Lec 8).

Tokens: 0 = padding, 1 = BOS, 2 = EOS, 3 = unknown (``qkv.tokenizers.vocab``).
Shapes: B batch, S source length, T target length, E embedding, H encoder width per
direction, D decoder width, V vocabularies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from qkv.attention.additive import AdditiveAttention
from qkv.models.config_checks import check_choices
from qkv.models.seq2seq import Seq2SeqOutput, seq2seq_loss, split_targets
from qkv.tokenizers.vocab import PAD


@dataclass
class RNNSeq2SeqConfig:
    """Everything needed to rebuild an RNN encoder-decoder (saved in a run's config.json)."""

    arch: Literal["rnn", "rnn-noattn"] = "rnn"  # rnn: Bahdanau attention; rnn-noattn: one fixed context
    cell: Literal["gru", "lstm"] = "gru"  # RNN: cell (encoder and decoder)
    emb_dim: int = 64  # RNN: character embedding width
    hidden: int = 128  # RNN: encoder width per direction
    dec_hidden: int = 256  # RNN: decoder state width
    attn_dim: int = 128  # RNN: width of the additive attention's scoring MLP
    dropout: float = 0.0  # dropout on the embeddings and the output layer's input
    max_src_len: int = 64  # longest source, in characters (set from the data when training)
    max_tgt_len: int = 16  # longest target + EOS (set from the data when training)
    src_vocab: int = 0  # set from the data
    tgt_vocab: int = 0  # set from the data

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("emb_dim", "hidden", "dec_hidden", "attn_dim", "max_src_len", "max_tgt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def attention(self) -> bool:
        return self.arch == "rnn"


@dataclass
class RNNDecoderState:
    """What one decoding step needs; every tensor's first dimension is the batch row, so
    beam search can reorder rows with :meth:`reorder`."""

    s: Tensor  # decoder state (N, D); (h, c) packed as (N, 2D) for an LSTM
    memory: Tensor  # encoder states (N, S, 2H)
    keys: Tensor  # projected keys (N, S, A)
    mask: Tensor  # (N, S) True = real token
    fixed: Tensor  # the no-attention context (N, 2H)

    def reorder(self, index: Tensor) -> None:
        for name in ("s", "memory", "keys", "mask", "fixed"):
            setattr(self, name, getattr(self, name).index_select(0, index))


class RNNSeq2Seq(nn.Module):
    """Bidirectional GRU/LSTM encoder, GRU/LSTM decoder, additive attention (or none: the
    attention module is still built, unused, so both variants keep one set of weight names)."""

    def __init__(self, cfg: RNNSeq2SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        cell, E, H, D = cfg.cell, cfg.emb_dim, cfg.hidden, cfg.dec_hidden
        self.cell, self.attention, self.dec_hidden = cell, cfg.attention, D
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.src_emb = nn.Embedding(cfg.src_vocab, E, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(cfg.tgt_vocab, E, padding_idx=PAD)
        self.encoder = rnn(E, H, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(2 * H, D * (2 if cell == "lstm" else 1))
        self.attn = AdditiveAttention(D, 2 * H, cfg.attn_dim)
        step = nn.GRUCell if cell == "gru" else nn.LSTMCell
        self.decoder = step(E + 2 * H, D)
        self.drop = nn.Dropout(cfg.dropout)
        self.out = nn.Linear(D + 2 * H + E, cfg.tgt_vocab)

    # ------------------------------------------------------------------ encoder

    def start(self, src: Tensor) -> RNNDecoderState:
        """src (B, S) token ids, PAD-padded on the right -> the decoder's starting state."""
        mask = src != PAD
        lengths = mask.sum(1).clamp_min(1)
        emb = self.drop(self.src_emb(src))
        packed = pack_padded_sequence(emb, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, last = self.encoder(packed)
        memory, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])  # (B, S, 2H)
        h = last[0] if self.cell == "lstm" else last  # (2, B, H): forward's last, backward's first
        summary = torch.cat([h[0], h[1]], dim=-1)  # (B, 2H)
        s0 = torch.tanh(self.init_state(summary))
        return RNNDecoderState(s0, memory, self.attn.project_keys(memory), mask, summary)

    # ------------------------------------------------------------------ decoder

    def step(self, state: RNNDecoderState, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        """One decoding step: previous tokens (N,) -> logits (N, V), attention (N, S) or None.
        Updates ``state`` in place."""
        D = self.dec_hidden
        h = state.s[:, :D]
        e = self.drop(self.tgt_emb(prev))  # (N, E)
        if self.attention:
            context, weights = self.attn(h, state.memory, mask=state.mask, projected_keys=state.keys)
        else:
            context, weights = state.fixed, None
        x = torch.cat([e, context], dim=-1)
        if self.cell == "gru":
            h = self.decoder(x, h)
            state.s = h
        else:
            h, c = self.decoder(x, (h, state.s[:, D:]))
            state.s = torch.cat([h, c], dim=-1)
        logits = self.out(self.drop(torch.cat([h, context, e], dim=-1)))
        return logits, weights

    def forward(self, src: Tensor, tgt: Tensor, *, return_weights: bool = False) -> Seq2SeqOutput:
        """Teacher forcing. src (B, S); tgt (B, T+1) = [BOS, y..., EOS, PAD...]."""
        tgt_in, tgt_out = split_targets(tgt)
        state = self.start(src)
        logits, weights = [], []
        for t in range(tgt_in.shape[1]):
            lg, w = self.step(state, tgt_in[:, t])
            logits.append(lg)
            weights.append(w)
        out = torch.stack(logits, dim=1)  # (B, T, V)
        w = torch.stack(weights, dim=1) if return_weights and self.attention else None  # (B, T, S)
        return Seq2SeqOutput(out, seq2seq_loss(out, tgt_out), w)
