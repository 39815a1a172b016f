"""The captioner family: Show, Attend and Tell (Xu et al. 2015; Lecture 21): a CNN grid encoder
and an LSTM decoder that attends over the grid at every word, with soft, hard or uniform
attention. Scenes -> word vocabulary -> :class:`qkv.models.captioner.Captioner` -> exact match,
BLEU-4 and pointing accuracy (does the most attended location fall inside the object a word
names?).

Run directory: ``config.json`` of family ``"captioner"`` (the words and the longest caption),
``eval.json``, ``loss.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.data.captions import CaptionSplits, load_caption_folder, make_splits
from qkv.data.shapes import COLOURS, SHAPES, Scene
from qkv.families.base import FamilyBase, files_lines, trained_line
from qkv.models.captioner import HARD, Captioner, CaptionerConfig, HardDecode
from qkv.pipelines.captioning import ImageCaptioner, decode_captions, normalize
from qkv.tokenizers.vocab import BOS, EOS, PAD, WordVocab
from qkv.training.run import Prepared, Run


@dataclass
class CaptionDataConfig:
    """Generated scenes (how many, which colour/shape pairs held out), or a folder of your own."""

    data: str = "shapes"  # "shapes" (generated), or a folder with captions.tsv: image<TAB>caption per line
    n_train: int = 20_000  # training scenes
    n_val: int = 500  # validation scenes (a folder: a tenth of the lines)
    n_test: int = 2_000  # test scenes (seen colour/shape pairs; a folder: a tenth of the lines)
    n_heldout: int = 2_000  # test scenes with at least one object of a held-out colour/shape pair
    heldout_pairs: int = 4  # (colour, shape) pairs never seen in training
    data_seed: int = 0  # seed of the scenes and the held-out pairs

    def __post_init__(self) -> None:
        for name, least in (("n_train", 10), ("n_val", 1), ("n_test", 1), ("n_heldout", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


def to_tensors(scenes: Sequence[Scene], vocab: WordVocab, max_len: int) -> tuple[Tensor, Tensor]:
    """uint8 images (N, 3, H, W) and [BOS, words, EOS, PAD...] (N, max_len + 2)."""
    x = torch.from_numpy(np.stack([s.image for s in scenes])).permute(0, 3, 1, 2).contiguous()
    y = torch.full((len(scenes), max_len + 2), PAD, dtype=torch.long)
    for i, s in enumerate(scenes):
        ids = [BOS, *vocab.encode(s.caption)[:max_len], EOS]
        y[i, : len(ids)] = torch.tensor(ids)
    return x, y


class CaptionBatches:
    def __init__(self, splits: dict[str, tuple[Tensor, Tensor]]) -> None:
        self.splits = splits

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x, y = self.splits[split]
        idx = torch.randint(0, len(x), (batch_size,), generator=generator)
        yb = y[idx]
        T = int((yb != PAD).sum(1).max())
        return normalize(x[idx]), yb[:, :T]


def bleu4(references: Sequence[Sequence[str]], hypotheses: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU-4 (Papineni et al. 2002), one reference per hypothesis: the geometric mean
    of clipped 1-4-gram precisions times the brevity penalty."""
    matches, totals = [0] * 4, [0] * 4
    ref_len = hyp_len = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        ref_len, hyp_len = ref_len + len(ref), hyp_len + len(hyp)
        for n in range(1, 5):
            r = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
            h = Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
            matches[n - 1] += sum(min(c, r[g]) for g, c in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / max(hyp_len, 1))
    return bp * math.exp(log_p)


def _inside(x: float, y: float, boxes: Sequence[tuple[int, int, int, int]]) -> bool:
    """Whether the point lies in any box (pixel (i, j) covers [i, i+1) x [j, j+1))."""
    return any(x0 <= x <= x1 + 1 and y0 <= y <= y1 + 1 for x0, y0, x1, y1 in boxes)


def pointing(scene: Scene, words: Sequence[str], alphas: Tensor, grid: int) -> tuple[int, int, float]:
    """(hits, named words, uniform baseline's expected hits) for one generated caption: a word
    naming a colour or shape hits if its most attended grid cell's centre lies inside an object
    of the scene with that colour/shape; a uniform attention hits with the share of cell
    centres inside such an object."""
    H = scene.image.shape[0]
    cell = H / grid
    centres = [((j + 0.5) * cell, (i + 0.5) * cell) for i in range(grid) for j in range(grid)]
    hits = named = 0
    uniform = 0.0
    for w, a in zip(words, alphas, strict=False):
        if w not in COLOURS and w not in SHAPES:
            continue
        boxes = [o.box for o in scene.objects if w in (o.colour, o.shape)]
        if not boxes:
            continue  # the word names nothing in the scene: a caption error, not a pointing one
        named += 1
        x, y = centres[int(a.argmax())]
        hits += _inside(x, y, boxes)
        uniform += sum(_inside(cx, cy, boxes) for cx, cy in centres) / len(centres)
    return hits, named, uniform


def pointing_overlap(scene: Scene, words: Sequence[str], alphas: Tensor, grid: int) -> tuple[int, int, float]:
    """As :func:`pointing`, but a word hits if its most attended cell holds any pixel of an object
    with that colour/shape (``scene.ids``), not only if the cell's centre is inside its box: a
    small object can cover parts of two cells and neither centre. Uniform attention hits with the
    share of such cells."""
    g = grid
    c = scene.image.shape[0] // g
    cells = scene.ids[: g * c, : g * c].reshape(g, c, g, c).transpose(0, 2, 1, 3).reshape(g * g, -1)
    hits = named = 0
    uniform = 0.0
    for w, a in zip(words, alphas, strict=False):
        if w not in COLOURS and w not in SHAPES:
            continue
        ids = [k + 1 for k, o in enumerate(scene.objects) if w in (o.colour, o.shape)]
        if not ids:
            continue
        named += 1
        covered = np.isin(cells, ids).any(-1)  # (L,) cells holding part of such an object
        hits += bool(covered[int(a.argmax())])
        uniform += float(covered.mean())
    return hits, named, uniform


def _evaluate(model: Captioner, vocab: WordVocab, splits: CaptionSplits, max_len: int,
              beam: int = 1, hard_decode: HardDecode = "argmax") -> dict:
    """:func:`evaluate` for one way of decoding (``hard_decode``: what hard attention reads)."""
    result = {}
    for name, scenes in splits.scenes.items():
        if name == "train" or not scenes:
            continue
        x, _ = to_tensors(scenes, vocab, max_len)
        toks, alphas = decode_captions(model, x, max_len, beam=beam, hard_decode=hard_decode)
        hyps = [vocab.decode(t) for t in toks]
        right = [h == s.caption for h, s in zip(hyps, scenes, strict=True)]
        bleu = bleu4([s.caption.split() for s in scenes], [h.split() for h in hyps])
        hits = uniform = o_hits = o_uniform = 0.0
        named = 0
        by_objects: dict[int, list[bool]] = {}
        for s, h, a, ok in zip(scenes, hyps, alphas, right, strict=True):
            hh, nn_, uu = pointing(s, h.split(), a, model.cfg.grid)
            hits, named, uniform = hits + hh, named + nn_, uniform + uu
            oh, _, ou = pointing_overlap(s, h.split(), a, model.cfg.grid)
            o_hits, o_uniform = o_hits + oh, o_uniform + ou
            if s.objects:
                by_objects.setdefault(len(s.objects), []).append(ok)
        if model.cfg.attention == "uniform":  # every cell ties: the argmax means nothing, the
            hits, o_hits = uniform, o_uniform  # expected hit rate of a uniform cell is the fair score
        order = sorted(range(len(scenes)), key=lambda i: right[i])[:5]
        result[name] = {"n": len(scenes), "exact": sum(right) / len(scenes), "bleu4": bleu,
                        "pointing": hits / named if named else None,  # no boxes: no pointing
                        "pointing_uniform": uniform / named if named else None,
                        "pointing_overlap": o_hits / named if named else None,  # cell holds object pixels
                        "pointing_overlap_uniform": o_uniform / named if named else None,
                        "named_words": named,
                        "exact_by_objects": {k: sum(v) / len(v) for k, v in sorted(by_objects.items())},
                        "examples": [(scenes[i].caption, hyps[i]) for i in order]}
    return result


def evaluate(model: Captioner, vocab: WordVocab, splits: CaptionSplits, max_len: int,
             beam: int = 1) -> dict:
    """Per split but train: exact match, corpus BLEU-4, pointing accuracy (and uniform attention's
    expected pointing), exact match by number of objects, and a few examples (wrong ones first).
    Hard attention decodes reading the most attended cell (truly hard); ``"expectation"`` holds
    the same scores decoded reading Σ α_i a_i instead."""
    result = _evaluate(model, vocab, splits, max_len, beam, "argmax")
    if model.cfg.attention in HARD:
        result["expectation"] = _evaluate(model, vocab, splits, max_len, beam, "expectation")
    return result


def names_in(vocab: WordVocab) -> list[int]:
    """The ids of the words that name what a scene shows (its colours and shapes) in ``vocab``."""
    return sorted(vocab.stoi[w] for w in (*COLOURS, *SHAPES) if w in vocab.stoi)


@dataclass
class CaptionState:
    splits: CaptionSplits
    vocab: WordVocab
    max_len: int


class CaptionerFamily(FamilyBase):
    name = "captioner"
    kind = "image"
    unit = "img"
    help = "an image captioner with soft, hard or uniform attention (Show, Attend and Tell)"
    description = (
        "Train a captioner: a CNN grid encoder and an LSTM decoder that attends over the grid at "
        "every word, --attention soft (weighted average, doubly stochastic penalty), hard "
        "(one sampled location per word, REINFORCE), hard-exact (the exact sum over locations) or "
        "uniform (the plain average of the grid: the baseline); --addressing content (score each "
        "cell's features) or location (one score per cell index, never looking at the cells). "
        "Data: generated scenes of coloured shapes with "
        "captions and boxes, some colour/shape pairs held out, or --data FOLDER with a captions.tsv "
        "(image<TAB>caption per line). At the end: exact match, BLEU-4 "
        "and pointing accuracy (is the most attended location inside the named object?) next "
        "to uniform attention's.")
    model_config = CaptionerConfig
    data_config = CaptionDataConfig
    from_data = ("vocab_size", "unread_words")
    default_preset = "shapes-cpu"

    def prepare(self, model_cfg: CaptionerConfig, data_cfg: CaptionDataConfig, resume_dir,
                on_note) -> Prepared:
        if data_cfg.data == "shapes":
            splits = make_splits(data_cfg)
        else:
            fixed = ("--addressing location scores a fixed grid of cells, the same places in every "
                     "image; resize the images to one size, or use --addressing content")
            splits = load_caption_folder(data_cfg.data, model_cfg.image_size, model_cfg.channels,
                                         data_cfg.data_seed,
                                         one_size=fixed if model_cfg.addressing == "location" else None)
        for note in splits.notes:
            on_note(note)
        vocab = WordVocab.build([s.caption for s in splits.scenes["train"]])
        max_len = max(len(s.caption.split()) for s in splits.scenes["train"])
        tensors = {k: to_tensors(v, vocab, max_len) for k, v in splits.scenes.items()}
        unread = [] if model_cfg.read_back_names else names_in(vocab)
        if not model_cfg.read_back_names and not unread:
            raise ValueError("--read_back_names false feeds the colour and shape words of the generated "
                             "scenes back as UNK; these captions have none: leave it true")
        model_cfg = dataclasses.replace(model_cfg, vocab_size=len(vocab), unread_words=unread)
        return Prepared(model_cfg, CaptionBatches(tensors),
                        CaptionState(splits, vocab, max_len),
                        record={"words": vocab.symbols(), "max_len": max_len,
                                "heldout_pairs": [list(p) for p in splits.heldout]})

    def build(self, model_cfg: CaptionerConfig) -> Captioner:
        return Captioner(model_cfg)

    def evaluate(self, model: Captioner, prepared: Prepared) -> dict[str, Any]:
        st = prepared.state
        return evaluate(model, st.vocab, st.splits, st.max_len)

    def headline(self, model_cfg: CaptionerConfig, data_cfg: CaptionDataConfig) -> str:
        return f"{model_cfg.attention} attention, {data_cfg.n_train:,} generated scenes"

    def summary(self, run: Run, args: argparse.Namespace | None = None) -> str:
        lines = ["", trained_line(run, None)]
        hard = "expectation" in run.eval
        for ev, how in ((run.eval, " (reading the most attended cell)" if hard else ""),
                        (run.eval.get("expectation", {}), " (reading the expected context)")):
            for name in ("test", "heldout"):
                if name in ev:
                    e = ev[name]
                    where = ("" if e["pointing"] is None else f", pointing {e['pointing']:.1%} (uniform "
                             f"attention {e['pointing_uniform']:.1%})")
                    lines.append(f"{name}{how}: exact match {e['exact']:.1%}, BLEU-4 {e['bleu4']:.3f}"
                                 f"{where} on {e['n']:,}")
        return "\n".join(lines) + "\n" + files_lines(run) + f"  evaluation: {run.run_dir / 'eval.json'}"

    def load(self, run_dir: Path, device: str = "cpu") -> ImageCaptioner:
        _, model, (vocab, max_len) = self.read_run(run_dir, "an image captioner", lambda c: (
            CaptionerConfig(**c["model"]), (WordVocab(c["words"]), int(c["max_len"]))), device)
        return ImageCaptioner(Path(run_dir).name, model, vocab, max_len, Path(run_dir))
