"""The sequence-to-sequence job behind `qkv train seq2seq`: pairs -> character vocabularies ->
RNN + Bahdanau / RNN without attention / Transformer -> the shared Trainer -> exact-match
accuracy per split and input length.

Run directory: as for the GPT (:mod:`qkv.training.checkpoint`), ``config.json`` of family
``"seq2seq"`` holding the model config and both vocabularies, plus ``eval.json``.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from qkv import __version__
from qkv.data.dates import DatePairs, load_pairs, make_date_pairs, normalize_source
from qkv.models.rnn_seq2seq import RNNSeq2Seq
from qkv.models.transformer import TransformerSeq2Seq
from qkv.tokenizers.vocab import BOS, EOS, PAD, CharVocab
from qkv.training import checkpoint as ckpt
from qkv.training.distributed import DistInfo
from qkv.training.trainer import TrainConfig, Trainer, TrainResult

Arch = Literal["rnn", "rnn-noattn", "transformer"]


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


@dataclass
class Seq2SeqDataConfig:
    """Which pairs: generated dates (default) or a tab-separated file."""

    data: str | None = None  # a UTF-8 file of source<TAB>target lines; none = generated dates
    n_train: int = 50_000  # dates: training pairs
    n_val: int = 2_000  # dates: validation pairs
    n_test: int = 5_000  # dates: test pairs (seen locale/style combinations)
    n_heldout: int = 5_000  # dates: pairs in the held-out locale/style combinations
    data_seed: int = 0  # seed of the generated pairs and of every split

    def __post_init__(self) -> None:
        for name, least in (("n_train", 10), ("n_val", 1), ("n_test", 1), ("n_heldout", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


def build_model(cfg: Seq2SeqConfig) -> nn.Module:
    if cfg.arch == "transformer":
        return TransformerSeq2Seq(cfg.src_vocab, cfg.tgt_vocab, cfg.dim, cfg.n_heads, cfg.enc_layers,
                                  cfg.dec_layers, dropout=cfg.dropout, max_src_len=cfg.max_src_len,
                                  max_tgt_len=cfg.max_tgt_len)
    return RNNSeq2Seq(cfg.src_vocab, cfg.tgt_vocab, cfg.emb_dim, cfg.hidden, cfg.dec_hidden,
                      cfg.attn_dim, cfg.cell, attention=cfg.arch == "rnn", dropout=cfg.dropout)


def encode_split(pairs: Sequence[tuple[str, str]], src: CharVocab, tgt: CharVocab,
                 max_src: int, max_tgt: int) -> tuple[Tensor, Tensor]:
    """(N, max_src) source ids and (N, max_tgt + 1) [BOS, target, EOS] ids, PAD-padded; pairs
    longer than the limits are cut (training data is measured first, so only user files can be)."""
    x = torch.full((len(pairs), max_src), PAD, dtype=torch.long)
    y = torch.full((len(pairs), max_tgt + 1), PAD, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        ids = src.encode(s)[:max_src]
        x[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        tids = [BOS, *tgt.encode(t)[: max_tgt - 1], EOS]
        y[i, : len(tids)] = torch.tensor(tids, dtype=torch.long)
    return x, y


class PairBatches:
    """Random batches of (source, target) ids for the Trainer, trimmed to their longest row."""

    def __init__(self, splits: dict[str, tuple[Tensor, Tensor]]) -> None:
        self.splits = splits

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x, y = self.splits[split]
        idx = torch.randint(0, len(x), (batch_size,), generator=generator)
        xb, yb = x[idx], y[idx]
        S = int((xb != PAD).sum(1).max())
        T = int((yb != PAD).sum(1).max())
        return xb[:, : max(S, 1)], yb[:, : max(T, 2)]


def load_pairs_for(data_cfg: Seq2SeqDataConfig) -> DatePairs:
    if data_cfg.data:
        return load_pairs(data_cfg.data, seed=data_cfg.data_seed)
    return make_date_pairs(data_cfg.n_train, data_cfg.n_val, data_cfg.n_test, data_cfg.n_heldout,
                           seed=data_cfg.data_seed)


def prepare(model_cfg: Seq2SeqConfig, pairs: DatePairs) -> tuple[Seq2SeqConfig, CharVocab, CharVocab]:
    """Vocabularies from the training pairs; length limits from the training data."""
    src = CharVocab.build([s for s, _ in pairs.train])
    tgt = CharVocab.build([t for _, t in pairs.train])
    max_src = max(len(s) for s, _ in pairs.train)
    max_tgt = max(len(t) for _, t in pairs.train) + 1  # + EOS
    cfg = dataclasses.replace(model_cfg, src_vocab=len(src), tgt_vocab=len(tgt), max_src_len=max_src,
                              max_tgt_len=max_tgt)
    return cfg, src, tgt


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
        x, _ = encode_split([(t, "") for t in chunk], src_vocab, tgt_vocab, cfg.max_src_len, 2)
        x = x[:, : max(1, max(len(t) for t in chunk))].to(device)
        res = (greedy_decode(model, x, cfg.max_tgt_len) if beam == 1 else
               beam_search(model, x, cfg.max_tgt_len, beam=beam, length_penalty=length_penalty))
        outs += [tgt_vocab.decode(t) for t in res.tokens]
        weights += [None if w is None else w[:, : len(t)] for w, t in zip(res.weights, chunk, strict=True)]
    return outs, weights


def length_buckets(lengths: Sequence[int]) -> list[tuple[int, int]]:
    edges = [0, 10, 15, 20, 25, 30, 1000]
    return [(a + 1, b) for a, b in itertools.pairwise(edges)
            if any(a < n <= b for n in lengths)]


def evaluate(model: nn.Module, cfg: Seq2SeqConfig, src_vocab: CharVocab, tgt_vocab: CharVocab,
             pairs: DatePairs, beam: int = 1) -> dict[str, Any]:
    """Exact match (the whole output equal to the target) per split and per input length."""
    result: dict[str, Any] = {}
    for name, split in pairs.splits().items():
        if name == "train" or not split:
            continue
        preds, _ = decode_texts(model, cfg, src_vocab, tgt_vocab, [s for s, _ in split], beam=beam)
        hits = [p == t for p, (_, t) in zip(preds, split, strict=True)]
        lengths = [len(s) for s, _ in split]
        buckets = {}
        for lo, hi in length_buckets(lengths):
            sel = [h for h, n in zip(hits, lengths, strict=True) if lo <= n <= hi]
            buckets[f"{lo}-{hi if hi < 1000 else ''}"] = {"n": len(sel), "exact": sum(sel) / len(sel)}
        errors = [(s, t, p) for (s, t), p, h in zip(split, preds, hits, strict=True) if not h][:10]
        result[name] = {"n": len(split), "exact": sum(hits) / len(split), "by_length": buckets,
                        "examples_wrong": errors}
    return result


def run_config(model_cfg: Seq2SeqConfig, train_cfg: TrainConfig, data_cfg: Seq2SeqDataConfig,
               pairs: DatePairs, src: CharVocab, tgt: CharVocab) -> dict:
    return {
        "family": "seq2seq",
        "qkv_version": __version__,
        "model": dataclasses.asdict(model_cfg),
        "train": dataclasses.asdict(train_cfg),
        "data": {**dataclasses.asdict(data_cfg), "name": pairs.name,
                 "sizes": {k: len(v) for k, v in pairs.splits().items()},
                 "heldout_combos": [list(c) for c in pairs.unseen],
                 "dropped_ambiguous": pairs.dropped_ambiguous},
        "src_chars": src.symbols(),
        "tgt_chars": tgt.symbols(),
    }


def train_seq2seq(model_cfg: Seq2SeqConfig, train_cfg: TrainConfig, data_cfg: Seq2SeqDataConfig, *,
                  resume: bool = False, dist: DistInfo | None = None, on_log=None):
    """Train (or resume) into ``train_cfg.out_dir``: (model (best weights), cfg, src vocab,
    tgt vocab, pairs, result)."""
    dist = dist or DistInfo()
    run_dir = Path(train_cfg.out_dir)
    if not resume and (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                         "or choose another --out_dir")
    pairs = load_pairs_for(data_cfg)
    model_cfg, src, tgt = prepare(model_cfg, pairs)
    splits = {name: encode_split(p, src, tgt, model_cfg.max_src_len, model_cfg.max_tgt_len)
              for name, p in pairs.splits().items()}
    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg)
    trainer = Trainer(model, train_cfg, PairBatches(splits), run_dir, dist, on_log, tokens_per_batch=1)
    if resume:
        saved = ckpt.read_json(run_dir / "config.json")
        if saved.get("src_chars") != src.symbols() or saved.get("tgt_chars") != tgt.symbols():
            raise ValueError(f"the training pairs changed since {run_dir} was started (other "
                             "characters); start a new run instead of resuming")
        trainer.load_resume_state()
    elif dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(run_dir / "config.json", run_config(model_cfg, train_cfg, data_cfg, pairs, src, tgt))
    result: TrainResult = trainer.fit()
    if dist.is_main:
        ckpt.load_weights(model, run_dir / "model.safetensors")
    return model, model_cfg, src, tgt, pairs, result


def load_seq2seq_run(run_dir: Path, device: str = "cpu"):
    """(model (eval mode), cfg, src vocab, tgt vocab) from a run directory."""
    run_dir = Path(run_dir)
    saved = ckpt.read_run_config(run_dir, "seq2seq", "a sequence-to-sequence model")
    try:
        cfg = Seq2SeqConfig(**saved["model"])
        src, tgt = CharVocab(saved["src_chars"]), CharVocab(saved["tgt_chars"])
    except (TypeError, ValueError, KeyError) as e:
        raise ckpt.CheckpointError(f"{run_dir}/config.json is damaged ({type(e).__name__}: {e})") from None
    model = build_model(cfg)
    ckpt.load_weights(model, run_dir / "model.safetensors")
    return model.to(device).eval(), cfg, src, tgt


def prepare_inputs(texts: Sequence[str], cfg: Seq2SeqConfig, src: CharVocab) -> list[str]:
    """Normalise user texts; ValueError for empty or over-long ones; a warning (stderr) for
    characters never seen in training (they become <unk>)."""
    out = []
    for text in texts:
        t = normalize_source(text)
        if not t:
            raise ValueError("empty input: give a date such as '8 août 1977'")
        if len(t) > cfg.max_src_len:
            raise ValueError(f"input is {len(t)} characters; this model was trained on at most "
                             f"{cfg.max_src_len}: shorten it")
        unknown = src.unknown(t)
        if unknown:
            print(f"qkv: warning: {t!r}: characters never seen in training, read as unknown: "
                  f"{' '.join(repr(c) for c in unknown)}", file=sys.stderr)
        out.append(t)
    return out
