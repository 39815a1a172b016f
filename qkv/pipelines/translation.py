"""A trained seq2seq run ready to use: texts in, translations and their alignments out.

    tr = qkv.load("runs/seq2seq-dates-cpu-...")
    outs, weights = tr.translate(["8 août 1977"])      # ["1977-08-08"], [(T_out, S_in)]
    ali = tr.alignment("8 août 1977")                  # the matrix Bahdanau et al. 2015 draw (Fig. 3)

Inputs are normalised as in training (:func:`qkv.data.dates.normalize_source`); characters the
run never saw are read as unknown, with a note. Shapes: T_out output, S_in input characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from qkv.data.dates import normalize_source
from qkv.errors import InputError
from qkv.models.rnn_seq2seq import RNNSeq2SeqConfig
from qkv.models.transformer import TransformerSeq2SeqConfig
from qkv.pipelines.kinds import Kind
from qkv.tokenizers.vocab import PAD, CharVocab

Seq2SeqConfig = RNNSeq2SeqConfig | TransformerSeq2SeqConfig  # what a seq2seq run was built from


def encode_sources(texts: Sequence[str], vocab: CharVocab, max_len: int) -> Tensor:
    """(N, max_len) source ids, PAD-padded, each text cut at ``max_len`` characters."""
    x = torch.full((len(texts), max_len), PAD, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = vocab.encode(t)[:max_len]
        x[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return x


@torch.no_grad()
def decode_texts(model: nn.Module, cfg: Seq2SeqConfig, src_vocab: CharVocab, tgt_vocab: CharVocab,
                 texts: Sequence[str], beam: int = 1, batch_size: int = 256,
                 length_penalty: float = 1.0) -> tuple[list[str], list[Tensor | None]]:
    """Translate already-normalised texts (no longer than ``cfg.max_src_len``); returns the
    outputs and each output's attention over its source characters (out_len, in_len)."""
    from qkv.generation.decode import beam_search, greedy_decode

    model.eval()
    device = next(model.parameters()).device
    outs: list[str] = []
    weights: list[Tensor | None] = []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        x = encode_sources(chunk, src_vocab, cfg.max_src_len)
        x = x[:, : max(1, max(len(t) for t in chunk))].to(device)
        res = (greedy_decode(model, x, cfg.max_tgt_len) if beam == 1 else
               beam_search(model, x, cfg.max_tgt_len, beam=beam, length_penalty=length_penalty))
        outs += [tgt_vocab.decode(t) for t in res.tokens]
        weights += [None if w is None else w[:, : len(t)] for w, t in zip(res.weights, chunk, strict=True)]
    return outs, weights


@dataclass
class Alignment:
    """A seq2seq run's attention: every output character (rows) over the input characters
    (columns), (T_out, S_in) — Bahdanau et al. 2015, Fig. 3. For Transformer runs: the last
    decoder layer's cross-attention, averaged over heads."""

    source: list[str]
    output: list[str]
    weights: Tensor
    text: str
    notes: list[str]


@dataclass
class Translator:
    """A trained encoder-decoder with its two character vocabularies (config: the model's)."""

    name: str
    model: nn.Module
    cfg: Seq2SeqConfig
    src: CharVocab
    tgt: CharVocab
    run_dir: Path
    kind: ClassVar[Kind] = "seq2seq"
    n_layers: ClassVar[int] = 1  # one alignment: output x input
    n_heads: ClassVar[int] = 1

    @property
    def context(self) -> int:
        """The longest input, in characters."""
        return self.cfg.max_src_len

    @property
    def has_attention(self) -> bool:
        return self.cfg.arch != "rnn-noattn"

    def prepare(self, texts: Sequence[str], truncate: bool = False) -> tuple[list[str], list[str]]:
        """Normalised inputs and notes (characters never seen in training, read as unknown).
        An empty input is an InputError; one longer than the run's longest is one too, or with
        ``truncate`` cut to it, with a note."""
        out, notes = [], []
        for text in texts:
            t = normalize_source(text)
            if not t:
                raise InputError("empty input: the text is empty; type a date such as '8 août 1977'")
            if len(t) > self.context and not truncate:
                raise InputError(f"input is {len(t)} characters; this model was trained on at most "
                                 f"{self.context}: shorten it")
            if len(t) > self.context:
                notes.append(f"truncated to the first {self.context} of {len(t)} characters (the longest "
                             "input this model was trained on)")
                t = t[: self.context]
            unknown = self.src.unknown(t)
            if unknown:
                notes.append(f"{t!r}: characters never seen in training, read as unknown: "
                             + " ".join(repr(c) for c in unknown))
            out.append(t)
        return out, notes

    def translate(self, texts: Sequence[str], beam: int = 1,
                  length_penalty: float = 1.0) -> tuple[list[str], list[Tensor | None]]:
        """Already-prepared texts -> outputs and each one's attention (T_out, S_in), or None for
        a run without attention."""
        return decode_texts(self.model, self.cfg, self.src, self.tgt, texts, beam=beam,
                            length_penalty=length_penalty)

    def alignment(self, text: str) -> Alignment:
        """Translate ``text`` greedily and return the alignment matrix; InputError for empty
        input and for runs without attention (``--arch rnn-noattn``)."""
        if not self.has_attention:
            raise InputError(f"{self.name} is arch {self.cfg.arch}: it has no attention to show")
        [t], notes = self.prepare([text], truncate=True)
        [out], [w] = self.translate([t])
        if not out:
            raise InputError("the model produced an empty output; nothing to show")
        assert w is not None
        return Alignment(list(t), list(out), w.float().cpu(), out, notes)
