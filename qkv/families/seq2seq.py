"""The seq2seq family: an encoder-decoder over characters, human-written dates -> ISO 8601
(Lectures 20-23): a bidirectional GRU encoder with a Bahdanau-attention decoder (``rnn``), the
same with one fixed context vector (``rnn-noattn``: the bottleneck attention removes), or a
Transformer encoder-decoder with cross-attention (``transformer``). Pairs -> character
vocabularies -> :func:`build_model` (an :class:`~qkv.models.rnn_seq2seq.RNNSeq2Seq` or a
:class:`~qkv.models.transformer.TransformerSeq2Seq`, each from its own config) -> exact match
per split and input length.

Run directory: ``config.json`` of family ``"seq2seq"`` (model config and both vocabularies),
``eval.json``, ``loss.png``, ``alignment.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from qkv.data.dates import DatePairs, load_pairs, make_date_pairs
from qkv.families.base import FamilyBase, files_lines, loss_curve, trained_line
from qkv.figures import AlignmentMap, Picture
from qkv.models.config_checks import check_choices
from qkv.models.rnn_seq2seq import RNNSeq2Seq, RNNSeq2SeqConfig
from qkv.models.transformer import TransformerSeq2Seq, TransformerSeq2SeqConfig
from qkv.pipelines.translation import Seq2SeqConfig, Translator, decode_texts, encode_sources
from qkv.tokenizers.vocab import BOS, EOS, PAD, CharVocab
from qkv.training.run import Prepared, Run, command_line


@dataclass
class Seq2SeqDataConfig:
    """Which pairs: generated dates (default), generated random strings to copy or to translate
    symbol by symbol (where the fixed-context bottleneck bites), or a tab-separated file."""

    task: Literal["dates", "copy", "substitute"] = "dates"  # what is generated (without --data)
    data: str | None = None  # a UTF-8 file of source<TAB>target lines instead (task dates only)
    n_train: int = 50_000  # training pairs
    n_val: int = 2_000  # validation pairs
    n_test: int = 5_000  # test pairs (dates: seen locale/style combinations; copy: lengths as training)
    n_heldout: int = 5_000  # dates: held-out locale/style combinations; copy: strings longer than training
    min_len: int = 5  # copy/substitute: shortest training string
    max_len: int = 60  # copy/substitute: longest training string
    long_len: int = 80  # copy/substitute: longest held-out string (max_len + 1 .. long_len)
    data_seed: int = 0  # seed of the generated pairs and of every split

    def __post_init__(self) -> None:
        from qkv.data.copy import TASKS

        if self.task not in ("dates", *TASKS):
            raise ValueError(f"task must be dates, copy or substitute, got {self.task!r}")
        if self.task != "dates" and self.data:
            raise ValueError(f"--task {self.task} generates its own strings; drop --data (or use "
                             "--task dates with a file of pairs)")
        for name, least in (("n_train", 10), ("n_val", 1), ("n_test", 1), ("n_heldout", 0), ("min_len", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not self.min_len <= self.max_len <= self.long_len or self.max_len > 500 or self.long_len > 1000:
            raise ValueError(f"string lengths must satisfy min_len <= max_len <= long_len (max_len <= 500, "
                             f"long_len <= 1000), got {self.min_len}, {self.max_len}, {self.long_len}")
        if self.task != "dates" and self.n_heldout and self.long_len == self.max_len:
            raise ValueError("held-out strings are longer than max_len: raise --long_len or set "
                             "--n_heldout 0")


Arch = Literal["rnn", "rnn-noattn", "transformer"]


@dataclass
class Seq2SeqOptions(TransformerSeq2SeqConfig, RNNSeq2SeqConfig):
    """The model options of `qkv train seq2seq`: every field of both architectures' configs
    (inherited, so each is declared once, beside its model), ``--arch`` choosing which config
    (:meth:`model_config`) the model is built from; the other's fields are ignored. A run's
    config.json records the architecture's config only (:meth:`to_dict`)."""

    arch: Arch = "rnn"  # rnn (+ Bahdanau attention), rnn-noattn (fixed context), transformer
    dropout: float = 0.0  # dropout on embeddings and (Transformer) residual branches

    def __post_init__(self) -> None:
        check_choices(self)
        self.model_config()  # every check of the architecture's own config, now

    def model_config(self) -> Seq2SeqConfig:
        """The config of the architecture ``arch`` names, from the fields it has."""
        cls: type = TransformerSeq2SeqConfig if self.arch == "transformer" else RNNSeq2SeqConfig
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.model_config())


def build_model(cfg: Seq2SeqConfig) -> nn.Module:
    """The model ``cfg`` describes: an RNNSeq2Seq (with or without attention) or a TransformerSeq2Seq."""
    if isinstance(cfg, Seq2SeqOptions):  # both configs at once: build what --arch names
        cfg = cfg.model_config()
    return TransformerSeq2Seq(cfg) if isinstance(cfg, TransformerSeq2SeqConfig) else RNNSeq2Seq(cfg)


@dataclass
class PairState:
    pairs: DatePairs
    src: CharVocab
    tgt: CharVocab


def encode_split(pairs: Sequence[tuple[str, str]], src: CharVocab, tgt: CharVocab,
                 max_src: int, max_tgt: int) -> tuple[Tensor, Tensor]:
    """(N, max_src) source ids and (N, max_tgt + 1) [BOS, target, EOS] ids, PAD-padded; pairs
    longer than the limits are cut (training data is measured first, so only user files can be)."""
    x = encode_sources([s for s, _ in pairs], src, max_src)
    y = torch.full((len(pairs), max_tgt + 1), PAD, dtype=torch.long)
    for i, (_, t) in enumerate(pairs):
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
    if data_cfg.task != "dates":
        from qkv.data.copy import make_copy_pairs

        return make_copy_pairs(data_cfg.task, data_cfg.n_train, data_cfg.n_val, data_cfg.n_test,
                               data_cfg.n_heldout, data_cfg.min_len, data_cfg.max_len, data_cfg.long_len,
                               seed=data_cfg.data_seed)
    return make_date_pairs(data_cfg.n_train, data_cfg.n_val, data_cfg.n_test, data_cfg.n_heldout,
                           seed=data_cfg.data_seed)


def length_buckets(lengths: Sequence[int], edges: Sequence[int] = (0, 10, 15, 20, 25, 30, 1000)
                   ) -> list[tuple[int, int]]:
    """(first, last) length of each bucket (edge_i, edge_i+1] that holds any of ``lengths``."""
    return [(a + 1, b) for a, b in itertools.pairwise(edges)
            if any(a < n <= b for n in lengths)]


def token_accuracy(pred: str, target: str) -> tuple[int, int]:
    """(target positions predicted right, target length): position by position, so a dropped
    or extra symbol early in the output costs every position after it."""
    return sum(p == t for p, t in zip(pred, target, strict=False)), len(target)


def evaluate(model: nn.Module, cfg: Seq2SeqConfig, src_vocab: CharVocab, tgt_vocab: CharVocab,
             pairs: DatePairs, beam: int = 1) -> dict[str, Any]:
    """Exact match (the whole output equal to the target) and per-position accuracy, per split
    and per input length."""
    result: dict[str, Any] = {}
    for name, split in pairs.splits().items():
        if name == "train" or not split:
            continue
        preds, _ = decode_texts(model, cfg, src_vocab, tgt_vocab, [s for s, _ in split], beam=beam)
        hits = [p == t for p, (_, t) in zip(preds, split, strict=True)]
        lengths = [len(s) for s, _ in split]
        buckets = {}
        tokens = [token_accuracy(p, t) for p, (_, t) in zip(preds, split, strict=True)]
        for lo, hi in length_buckets(lengths, pairs.length_edges):
            sel = [i for i, n in enumerate(lengths) if lo <= n <= hi]
            right, total = sum(tokens[i][0] for i in sel), sum(tokens[i][1] for i in sel)
            buckets[f"{lo}-{hi if hi < 1000 else ''}"] = {
                "n": len(sel), "exact": sum(hits[i] for i in sel) / len(sel),
                "token_accuracy": right / max(total, 1)}
        errors = [(s, t, p) for (s, t), p, h in zip(split, preds, hits, strict=True) if not h][:10]
        result[name] = {"n": len(split), "exact": sum(hits) / len(split), "by_length": buckets,
                        "token_accuracy": sum(r for r, _ in tokens) / max(sum(n for _, n in tokens), 1),
                        "examples_wrong": errors}
    return result


class Seq2SeqFamily(FamilyBase):
    name = "seq2seq"
    kind = "seq2seq"
    unit = "pair"
    help = "an encoder-decoder on human-written dates -> ISO 8601 (RNN or Transformer)"
    description = (
        "Train a sequence-to-sequence model: --arch rnn (bidirectional GRU encoder, GRU decoder "
        "with Bahdanau attention), rnn-noattn (the same with a fixed context: the bottleneck) or "
        "transformer (encoder-decoder with cross-attention). With no options: dates generated "
        "with Babel in 24 locales and 4 styles ('8 août 1977' -> 1977-08-08); --data FILE.tsv "
        "takes source<TAB>target lines instead. At the end: exact-match accuracy on the test "
        "split and on held-out locale/style combinations, by input length, and an alignment plot.")
    model_config = Seq2SeqOptions
    data_config = Seq2SeqDataConfig
    from_data = ("max_src_len", "max_tgt_len", "src_vocab", "tgt_vocab")
    default_preset = "dates-cpu"
    # --task copy and substitute bring their own preset (random strings of 5-60 letters)
    task_presets: ClassVar[dict[str, str]] = {"copy": "copy-cpu", "substitute": "copy-cpu"}

    def prepare(self, model_cfg: Seq2SeqOptions, data_cfg: Seq2SeqDataConfig, resume_dir,
                on_note) -> Prepared:
        """Vocabularies and length limits from the training pairs (generated strings: from every
        split, so the model can be asked for the longer held-out ones)."""
        pairs = load_pairs_for(data_cfg)
        src = CharVocab.build([s for s, _ in pairs.train])
        tgt = CharVocab.build([t for _, t in pairs.train])
        measured = (pairs.train if data_cfg.task == "dates" else
                    [p for split in pairs.splits().values() for p in split])
        cfg = dataclasses.replace(model_cfg, src_vocab=len(src), tgt_vocab=len(tgt),
                                  max_src_len=max(len(s) for s, _ in measured),
                                  max_tgt_len=max(len(t) for _, t in measured) + 1)  # + EOS
        splits = {name: encode_split(p, src, tgt, cfg.max_src_len, cfg.max_tgt_len)
                  for name, p in pairs.splits().items()}
        record = {"name": pairs.name, "sizes": {k: len(v) for k, v in pairs.splits().items()},
                  "heldout_combos": [list(c) for c in pairs.unseen],
                  "dropped_ambiguous": pairs.dropped_ambiguous}
        return Prepared(cfg, PairBatches(splits), PairState(pairs, src, tgt), data_record=record,
                        record={"src_chars": src.symbols(), "tgt_chars": tgt.symbols()})

    def build(self, model_cfg: Seq2SeqOptions) -> nn.Module:
        return build_model(model_cfg)

    def check_resume(self, saved: dict[str, Any], prepared: Prepared) -> None:
        st = prepared.state
        if saved.get("src_chars") != st.src.symbols() or saved.get("tgt_chars") != st.tgt.symbols():
            raise ValueError(f"the training pairs changed since {saved['train']['out_dir']} was started "
                             "(other characters); start a new run instead of resuming")

    def evaluate(self, model: nn.Module, prepared: Prepared) -> dict[str, Any]:
        st = prepared.state
        return evaluate(model, prepared.model_cfg.model_config(), st.src, st.tgt, st.pairs)

    def _example(self, run: Run) -> tuple[str, str, Tensor | None]:
        st, cfg = run.prepared.state, run.prepared.model_cfg.model_config()
        example = st.pairs.test[0][0][: cfg.max_src_len]
        [out], [w] = decode_texts(run.model, cfg, st.src, st.tgt, [example])
        return example, out, w

    def pictures(self, run: Run) -> dict[str, Picture]:
        pics = {"loss plot": loss_curve(run)}
        example, out, w = self._example(run)
        if w is not None and len(out):
            figure = AlignmentMap(w, list(example), list(out))
            pics["alignment of the example"] = Picture("alignment.png", figure)
        return pics

    def headline(self, model_cfg: Seq2SeqOptions, data_cfg: Seq2SeqDataConfig) -> str:
        d = data_cfg
        what = d.data or ("generated dates" if d.task == "dates" else
                          f"{d.task} of random strings, lengths {d.min_len}-{d.max_len}")
        return f"arch {model_cfg.arch}, {what}"

    def summary(self, run: Run, args: argparse.Namespace | None = None) -> str:
        lines = ["", trained_line(run, "pairs")]
        for name in ("test", "heldout"):
            if name in run.eval:
                e = run.eval[name]
                by_len = "  ".join(f"{k}: {v['exact']:.1%}" for k, v in e["by_length"].items())
                what = run.prepared.state.pairs.heldout_what if name == "heldout" else "test"
                lines.append(f"{what} exact match {e['exact']:.2%} of {e['n']:,}  (by input length {by_len})")
        example, out, _ = self._example(run)
        lines.append(f"example: {example!r} -> {out!r}")
        return ("\n".join(lines) + "\n" + files_lines(run, {"weights": run.run_dir / "model.safetensors"})
                + "translate: "
                + command_line(["qkv", "translate", str(run.run_dir), example, "--plot", "alignment.png"]))

    def load(self, run_dir: Path, device: str = "cpu") -> Translator:
        def parse(c: dict) -> tuple[Seq2SeqOptions, tuple]:
            options = Seq2SeqOptions(**c["model"])  # the architecture's fields, or (older runs) all
            return options, (options.model_config(), CharVocab(c["src_chars"]), CharVocab(c["tgt_chars"]))

        _, model, (cfg, src, tgt) = self.read_run(run_dir, "a sequence-to-sequence model", parse, device)
        return Translator(Path(run_dir).name, model, cfg, src, tgt, Path(run_dir))
