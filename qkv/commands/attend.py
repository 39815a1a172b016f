"""`qkv attend MODEL_OR_RUN TEXT_OR_IMAGE`: attention of any model family as a PNG.

    text models (minilm, smollm2, gpt runs)   every layer x head as a grid of heatmaps; --layer L:
                                              that layer's heads; --layer L --head H: one head
                                              large, every token labelled on both axes
    vit runs                                  per-head overlays of one layer + rollout
    captioner runs                            the caption, one overlay per word (as `qkv caption --plot`)
    seq2seq runs                              the alignment matrix (as `qkv translate --plot`)

The numbers come from :mod:`qkv.viz.sources`, which ``qkv serve`` shares.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkv.commands.options import check_png_out


def add_attend_parser(sub) -> None:
    p = sub.add_parser(
        "attend",
        help="attention maps as PNG: heatmaps per layer and head (text), overlays (images), "
        "alignments (seq2seq)",
        description="Draw the attention of MODEL_OR_RUN over TEXT (MiniLM, SmolLM2, GPT runs: "
        "heatmaps, queries down, keys across; seq2seq runs: the alignment of output and input "
        "characters) or over IMAGE (ViT runs: each head of --layer and the rollout through all "
        "layers; captioner runs: the attention of every word of the caption). Without --layer, "
        "a text model's picture is the grid of all layers x heads (SmolLM2: 30 x 9 small panels, "
        "to find the heads worth a closer look); --layer L shows the heads of layer L with "
        "token labels, and --layer L --head H one head large. Text longer than the model's "
        "context (or --max-tokens) is truncated, with a note.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_OR_RUN",
                   help="minilm, smollm2, a run directory from `qkv train` (gpt, vit, captioner, seq2seq), "
                   "a Hugging Face checkpoint folder or a .gguf file "
                   "(llama, mistral, qwen2, gemma, gpt2, bert)")
    p.add_argument("texts", nargs="+", metavar="TEXT_OR_IMAGE",
                   help="the text to read (several words need no quotes), or an image file for "
                   "ViT and captioner runs")
    p.add_argument("-o", "--out", default="attention.png", help="where to write the PNG")
    p.add_argument("--layer", type=int, default=None,
                   help="text models: show this layer's heads; ViT: this layer's heads (default: "
                   "all layers for text models, the last for ViT); negative counts from the end")
    p.add_argument("--head", type=int, default=None,
                   help="with --layer: draw this one head large, every token labelled")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="text models: read at most this many tokens (and never more than the context)")
    p.set_defaults(func=cmd_attend, extra_texts=True)


def _note(notes: list[str]) -> None:
    for n in notes:
        print(f"qkv: note: {n}", file=sys.stderr)


def _looks_like_image(text: str) -> bool:
    from qkv.data.images import IMAGE_SUFFIXES

    return text.lower().endswith(IMAGE_SUFFIXES) and Path(text).is_file()


def _family(name: str) -> str | None:
    """The family of a run directory or pretrained name, read before loading anything."""
    from qkv.viz.sources import pretrained_names, run_family

    if Path(name).is_dir():
        return run_family(Path(name))
    return name if name in pretrained_names() else None


def cmd_attend(args: argparse.Namespace) -> int:
    from qkv.families import get_family
    from qkv.viz.sources import kind_of, load_source

    out = check_png_out(args.out, "--out")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    family = _family(args.model)
    text = " ".join(args.texts)
    if family is not None and kind_of(family) == "image":
        if len(args.texts) != 1:
            raise ValueError(f"{args.model} is a {family} run: give one image file, got {len(args.texts)} "
                             "arguments")
    elif family is not None and _looks_like_image(text):
        what = "run" if Path(args.model).is_dir() else "model"
        raise ValueError(f"{args.model} is a {family} {what} (a text model): give it text to attend "
                         f"over, not the image {text}")
    src = load_source(args.model)
    if src.kind in ("image", "seq2seq"):  # a trained run's own picture: its family draws it
        get_family(src.family).attend(src, args.texts[0] if src.kind == "image" else text,
                                      args.layer, args.head, out)
        return 0
    if args.layer is None and args.head is not None:
        raise ValueError(f"--head needs --layer (which layer's head? 0..{src.n_layers - 1})")
    return _attend_text(src, text, args.layer, args.head, args.max_tokens, out)


def _attend_text(src, text: str, layer: int | None, head: int | None, max_tokens: int, out: Path) -> int:
    from qkv.viz import plot_attention_grid, plot_attention_head, plot_attention_heads
    from qkv.viz.sources import check_layer_head, text_attention

    if layer is not None:  # checked before the forward pass; negative indices count from the end
        layer, head = check_layer_head(src, layer, head, ("--layer", "--head"))
    att = text_attention(src, text, max_tokens)
    _note(att.notes)
    T = len(att.tokens)
    if layer is None:
        L, H = att.weights.shape[:2]
        plot_attention_grid(att.weights, att.tokens, out,
                            title=f"{src.name}: {L} layers x {H} heads over {T} tokens")
        print(f"wrote {out}: {L} layers x {H} heads over {T} tokens "
              "(--layer L [--head H] for a closer look)")
        return 0
    if head is None:
        plot_attention_heads(att.weights[layer], att.tokens, out,
                             title=f"{src.name}: layer {layer}, {T} tokens")
        print(f"wrote {out}: the {src.n_heads} heads of layer {layer} over {T} tokens")
        return 0
    plot_attention_head(att.weights[layer, head], att.tokens, out,
                        title=f"{src.name}: layer {layer} head {head}")
    print(f"wrote {out}: layer {layer} head {head} over {T} tokens")
    return 0
