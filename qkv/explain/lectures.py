"""The lecture index (``qkv explain --lectures``, and ``/lectures`` on ``qkv serve``): each
lecture's sections in the notes' order, with the command that demonstrates each, or why none does.

The lectures are UC Berkeley CS189 (Spring 2026) Lectures 21 and 22 with Discussion 10, and
Stanford CS231N Lecture 8; each is cited by course, lecture and title, and each row by its section's
title (:attr:`Lecture.notes`). Every command listed runs as written (tests/explain/test_lectures.py runs
each, training commands with a few steps added: :attr:`Demo.quick`); ``measured`` names the
benchmark whose results in BENCHMARKS.md answer the section at a larger scale.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

TINY_GPT = ("--preset", "tiny", "--max_iters", "4", "--eval_interval", "2", "--eval_iters", "1",
            "--compile", "false", "--dtype", "fp32", "--no-progress")
TINY_SEQ2SEQ = ("--max_iters", "2", "--eval_interval", "2", "--eval_iters", "1", "--n_train", "200",
                "--n_val", "5", "--n_test", "5", "--n_heldout", "5", "--compile", "false", "--dtype", "fp32",
                "--no-progress")
TINY_FAMILY = ("--preset", "tiny", "--max_iters", "2", "--eval_interval", "2", "--eval_iters", "1",
               "--compile", "false", "--dtype", "fp32", "--no-progress")


@dataclass(frozen=True)
class Demo:
    """One command (as a user types it) and what it shows; ``quick``: what the index's test adds
    so that a command that trains runs in seconds."""

    command: str
    shows: str
    quick: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The command's arguments after ``qkv``."""
        words = shlex.split(self.command)
        if words[0] != "qkv":
            raise ValueError(f"a demo is a qkv command, got {self.command!r}")
        return words[1:]


@dataclass(frozen=True)
class Section:
    """One section of a lecture's notes; ``missing``: why no command shows it (None when one does)."""

    title: str
    demos: tuple[Demo, ...] = ()
    measured: str | None = None  # benchmarks/NAME.py, results in BENCHMARKS.md
    missing: str | None = None


@dataclass(frozen=True)
class Lecture:
    """One lecture: its name, ``notes`` (the citation: course, term, lecture and its title, so
    that a reader finds it without our files) and its sections in the lecture's order."""

    name: str
    notes: str
    sections: tuple[Section, ...] = field(default_factory=tuple)


def _d(command: str, shows: str, quick: tuple[str, ...] = ()) -> Demo:
    return Demo(command, shows, quick)


LECTURES: tuple[Lecture, ...] = (
    Lecture("CS189 Lecture 21: from CNNs to attention", "UC Berkeley CS189, Spring 2026, Lecture 21 "
            "\"Attention and Transformers\" (the handout Lectures 21 and 22 share: its first half)", (
        Section("Why not an MLP on pixels; CNNs see locally, only the top layer sees everything",
                (_d("qkv explain cnn", "P² weights of an MLP on P pixels vs a convolution's; the receptive "
                    "field of stacked width-3 convolutions, measured by a gradient"),)),
        Section("The 'Spider-Man firefighter' photo: understanding needs the whole image",
                missing="a photograph the notes show; qkv ships no photographs (`qkv assets` lists what it "
                "has), and the receptive-field point is made by `qkv explain cnn`"),
        Section("Documents as vectors: bag of words, TF-IDF (tf 2/100, idf log(1000/300))",
                (_d("qkv explain retrieval --no-minilm",
                    "bag of words, TF-IDF and the notes' tf-idf example"),)),
        Section("RNNs; captioning as CNN features -> RNN, word by word",
                (_d("qkv train captioner --attention uniform", "the baseline: every region weighted equally",
                    TINY_FAMILY),), measured="captioning.py"),
        Section("Soft attention for captioning (Show, Attend and Tell): one distribution per word",
                (_d("qkv train captioner", "soft attention over the CNN's cells, an overlay per word; "
                    "3 seeds: 99.4-99.7% exact on never-seen colour/shape pairs, the most attended cell "
                    "inside the named object 95.6-99.4% of the time (~4 min each on 2 Zen 4 cores)",
                    TINY_FAMILY),), measured="captioning.py"),
        Section("Soft vs hard attention: z = 0.1a + 0.2b + 0.7c vs a sampled cell; REINFORCE",
                (_d("qkv explain hard-attention", "the exact gradient vs REINFORCE estimates, baselines"),
                 _d("qkv train captioner --attention hard", "hard attention trained with REINFORCE; "
                    "3 seeds: 96.5-97.0% exact on never-seen pairs, pointing 92.1-96.4% "
                    "(benchmarks/captioning.py)",
                    TINY_FAMILY))),
        Section("Location-based vs content-based addressing",
                (_d("qkv explain addressing", "softmax(W h) over fixed cells vs softmax(qᵀa_i)"),)),
    )),
    Lecture("CS189 Lecture 22: Transformers", "UC Berkeley CS189, Spring 2026, Lecture 22 "
            "\"Transformers\" (the second half of the handout \"Attention and Transformers\")", (
        Section("1 Content-based attention: hardmax vs softmax, inner-product retrieval",
                (_d("qkv explain softmax", "[1, 2, 3] -> 0.09, 0.24, 0.67 (the notes: 0.66), temperature"),
                 _d("qkv explain retrieval --no-minilm", "ranking documents by inner products"))),
        Section("2.1 Self-attention: every token a query, a key and a value; why W_Q ≠ W_K",
                (_d("qkv explain qk", "one matrix makes the scores symmetric"),
                 _d("qkv train gpt --tie_qk true", "a GPT with W_Q = W_K", TINY_GPT)),
                measured="block_ablation.py"),
        Section("2.1 Building it up: average all values, raw vectors first, then W_Q, W_K, W_V",
                (_d("qkv explain derivation", "each step on 'the food was good not bad at all'"),)),
        Section("2.2 Matrix form softmax(QKᵀ/√d)V and its implementation",
                (_d("qkv explain worked-example", "Discussion 10's tokens by hand and as matrices"),
                 _d("qkv explain scaling", "why √d"))),
        Section("2.3 Contextualisation: what 'it' refers to, 'bank' by a river or with money",
                (_d("qkv explain context", "MiniLM's 'bank' as w·river + (1 − w)·money per sentence, and "
                    "where 'it' looks"),
                 _d("qkv attend minilm \"The animal didn't cross the street because it was too tired.\" "
                    "--layer 2 -o it.png", "the attention of every head of one layer"))),
        Section("Cost: parameters O(d²) whatever n, compute O(n²); a 16K model on 1M tokens",
                (_d("qkv explain cost", "3D² vs N²D², the 16K -> 1M table, the KV cache"),),
                measured="attention_speed.py"),
        Section("2.4 Attention = a soft lookup table {A: 51, B: 42, C: 31}",
                (_d("qkv explain lookup", "hardmax gives exactly 42, softmax 41.58"),)),
        Section("3.1 Multi-head attention: h heads, concatenated, 3hd² vs 3d² parameters",
                (_d("qkv explain heads", "both parameter counts, and GQA"),
                 _d("qkv attend smollm2 \"The cat sat on the mat because it was warm.\" --layer 3 "
                    "-o heads.png",
                    "nine heads of a real model, each looking elsewhere"))),
        Section("3.2 The Transformer layer: residual + LayerNorm + MLP; pre-LN vs post-LN",
                (_d("qkv train gpt --norm_placement post", "the paper's post-LN block", TINY_GPT),),
                measured="norm_placement.py"),
        Section("3.2 The MLP is the only non-linearity besides softmax",
                (_d("qkv train gpt --mlp none", "attention-only blocks", TINY_GPT),),
                measured="block_ablation.py"),
        Section("4 Positional encodings: order must be added; requirements; learned vs sinusoidal",
                (_d("qkv explain equivariance", "without positions, a permutation just permutes the outputs"),
                 _d("qkv explain positions", "the four requirements on each encoding, R_k, RoPE"))),
        Section("4 'Sinusoids extrapolate to longer sequences'",
                (_d("qkv train seq2seq --task copy --arch transformer --positions sinusoidal",
                    "the copy task; --positions learned|rope|alibi|none to compare", TINY_SEQ2SEQ),),
                measured="length_extrapolation.py"),
    )),
    Lecture("CS189 Discussion 10", "UC Berkeley CS189, Spring 2026, Discussion 10 (self-attention by "
            "hand; why scale by √d), with its solutions", (
        Section("Q1: q, k, v of three tokens by hand; x₃'s weights ≈ 0.9975",
                (_d("qkv explain worked-example", "the unscaled table first (0.9975), then /√3"),)),
        Section("Q2: E[qᵀk], Var(qᵀk) = d, the scale factor √d",
                (_d("qkv explain scaling --mu 0.5", "the variance with a mean, sampled and by formula"),)),
        Section("(Discussion 11, forward reference) the products a KV cache saves",
                (_d("qkv explain cost --model smollm2", "rows, (query, key) pairs and FLOPs with and "
                    "without the cache; its bytes per layout"),),
                measured="pretrained_speed.py"),
    )),
    Lecture("CS231N Lecture 8: attention and Transformers", "Stanford CS231N, 2025, Lecture 8 "
            "\"Attention and Transformers\" (Justin Johnson)", (
        Section("Seq2seq RNNs and the fixed-length bottleneck",
                (_d("qkv explain bottleneck", "one context vector vs attention, exact by length",
                    ("--steps", "20", "--max-len", "8")),
                 _d("qkv train seq2seq --arch rnn-noattn --task copy", "the bottleneck model", TINY_SEQ2SEQ)),
                measured="seq2seq_copy.py"),
        Section("Attention in four steps (Bahdanau): scores, softmax, weighted sum, output; alignments",
                (_d("qkv train seq2seq --arch rnn", "GRU + Bahdanau attention on dates, an alignment plot",
                    TINY_SEQ2SEQ),), measured="seq2seq_dates.py"),
        Section("The English–French alignment (Bahdanau et al. 2015, Fig. 3): diagonal, reordering, blocks",
                missing="no parallel English–French text offline (`qkv assets`); the same alignment picture "
                "is drawn for dates and for the copy task: `qkv attend RUN TEXT` on a seq2seq run"),
        Section("Three generalisations: scaled dot product, many queries at once, keys apart from values",
                (_d("qkv explain scaling", "dot products grow like d: divide by √d"),
                 _d("qkv explain derivation", "all queries at once, keys and values apart, step by step"))),
        Section("Cross-attention and self-attention",
                (_d("qkv train seq2seq --arch transformer", "an encoder-decoder with cross-attention",
                    TINY_SEQ2SEQ),)),
        Section("Permutation equivariance", (_d("qkv explain equivariance", "f(PX) = P f(X)"),)),
        Section("Positional encodings: learned, RoPE, relative",
                (_d("qkv explain positions", "RoPE's scores depend on m − n only"),),
                measured="length_extrapolation.py"),
        Section("Masked self-attention: M_ij = 0 or −∞, rows renormalised",
                (_d("qkv explain masking", "E, M, E + M and softmax(E + M)"),)),
        Section("Multi-head attention, and its four matrix multiplications",
                (_d("qkv explain heads", "parameters of h heads; the fused projection"),
                 _d("qkv explain cost", "FLOPs of the projections vs QKᵀ and AV"))),
        Section("RNN vs CNN vs self-attention (cost per layer, sequential steps, path length)",
                (_d("qkv explain architectures", "the table by formula, and timed on this machine"),),
                measured="seq2seq_copy.py"),
        Section("The Transformer: a language model; scale from 2017 to GPT-3",
                (_d("qkv train gpt", "Shakespeare, characters", TINY_GPT),
                 _d("qkv generate smollm2 --prompt \"Once upon a time\" --max-new-tokens 8",
                    "a pretrained Llama-style model"),
                 _d("qkv explain cost --model gpt3-175b",
                    "GPT-3's 96 blocks: parameters, KV cache, FLOPs per layer (--model gpt2: 2019's 12)"))),
        Section("Vision Transformer: patches, positions, blocks, pooling",
                (_d("qkv train vit", "Fashion-MNIST, a conv stem to 7x7 patches: 93.0-93.2% test over 3 "
                    "seeds, 12.9 min on 2 Zen 4 cores (a same-size CNN, same run: 93.1-93.3%)",
                    TINY_FAMILY),),
                measured="vit_fashion.py"),
        Section("One architecture for audio (spectrogram frames) and video (space-time patches)",
                missing="qkv has no audio or video data offline (`qkv assets`); the ViT's patching is the "
                "same idea"),
    )),
)


def render_lectures(console: Console, lectures: tuple[Lecture, ...] = LECTURES) -> None:
    """Print the index: a table per lecture, a section per row, '—' where nothing shows it."""
    from qkv.explain._render import add_row, say, table

    for lec in lectures:
        t = table(f"{lec.name}  ({lec.notes})", ["section of the lecture", "try", "what it shows"])
        for s in lec.sections:
            if not s.demos:
                add_row(t, s.title, "—", f"not shown: {s.missing}")
            for i, d in enumerate(s.demos):
                shows = d.shows + (f"; measured: benchmarks/{s.measured}" if s.measured and i == 0 else "")
                add_row(t, s.title if i == 0 else "", d.command, shows)
        console.print(t)
    shown = sum(bool(s.demos) for lec in lectures for s in lec.sections)
    total = sum(len(lec.sections) for lec in lectures)
    say(console, f"{shown} of {total} sections have a command; `qkv serve` shows this index at /lectures.",
        "dim")


def lectures_html(lectures: tuple[Lecture, ...] = LECTURES) -> str:
    """The index as a standalone HTML page (escaped; no script)."""
    from html import escape

    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'><title>qkv: the lectures, "
             "section by section</title><link rel='stylesheet' href='/static/style.css'></head><body>",
             "<main class='lectures'><h1>The lectures, section by section</h1><p>Each section of the "
             "notes and the command that demonstrates it (run it in a terminal). "
             "<a href='/'>Back to the explorer</a>.</p>"]
    for lec in lectures:
        parts.append(f"<h2>{escape(lec.name)}</h2><p class='notes'>{escape(lec.notes)}</p>"
                     "<table><thead><tr><th>section of the lecture</th><th>try</th><th>what it shows</th>"
                     "</tr></thead>"
                     "<tbody>")
        for s in lec.sections:
            if not s.demos:
                parts.append(f"<tr class='missing'><td>{escape(s.title)}</td><td>—</td>"
                             f"<td>not shown: {escape(s.missing or '')}</td></tr>")
            for i, d in enumerate(s.demos):
                measured = f" (measured: benchmarks/{escape(s.measured)})" if s.measured and i == 0 else ""
                parts.append(f"<tr><td>{escape(s.title) if i == 0 else ''}</td><td><code>{escape(d.command)}"
                             f"</code></td><td>{escape(d.shows)}{measured}</td></tr>")
        parts.append("</tbody></table>")
    parts.append("</main></body></html>")
    return "".join(parts)
