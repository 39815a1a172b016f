"""`qkv attend MODEL_OR_RUN TEXT_OR_IMAGE`: attention of any model family as a PNG (or SVG / PDF).

    text models (minilm, smollm2, gpt runs)   every layer x head as a grid of heatmaps; --layer L:
                                              that layer's heads; --layer L --head H: one head
                                              large, every token labelled on both axes
    vit runs                                  per-head overlays of one layer + rollout
    captioner runs                            the caption, one overlay per word (as `qkv caption --plot`)
    seq2seq runs                              the alignment matrix (as `qkv translate --plot`)

The numbers come from :mod:`qkv.pipelines` (the server reads the same), the pictures from
:mod:`qkv.viz`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.commands.options import LONG_TEXT_RULE, check_picture_out

if TYPE_CHECKING:
    from qkv.pipelines import CausalLM, ImageCaptioner, ImageClassifier, SentenceEncoder, Translator


def add_attend_parser(sub) -> None:
    p = sub.add_parser(
        "attend",
        help="attention maps as PNG or SVG: heatmaps per layer and head (text), overlays (images), "
        "alignments (seq2seq)",
        description="Draw the attention of MODEL_OR_RUN over TEXT (MiniLM, SmolLM2, GPT runs: "
        "heatmaps, queries down, keys across; seq2seq runs: the alignment of output and input "
        "characters) or over IMAGE (ViT runs: each head of --layer and the rollout through all "
        "layers; captioner runs: the attention of every word of the caption). Without --layer, "
        "a text model's picture is the grid of all layers x heads (SmolLM2: 30 x 9 small panels, "
        "to find the heads worth a closer look); --layer L shows the heads of layer L with "
        "token labels, and --layer L --head H one head large. " + LONG_TEXT_RULE + " --max-tokens "
        "draws the first N tokens of a text that fits, with a note.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_OR_RUN",
                   help="minilm, smollm2, a run directory from `qkv train` (gpt, vit, captioner, seq2seq), "
                   "a Hugging Face checkpoint folder or a .gguf file "
                   "(llama, mistral, qwen2, gemma, gpt2, bert); a bundled name always means the "
                   "bundled model (a folder of that name: ./NAME)")
    p.add_argument("texts", nargs="+", metavar="TEXT_OR_IMAGE",
                   help="the text to read (several words need no quotes), or an image file for "
                   "ViT and captioner runs")
    p.add_argument("-o", "--out", default="attention.png",
                   help="where to write the picture: .png, or .svg / .pdf (vector, for slides and "
                   "papers)")
    p.add_argument("--layer", type=int, default=None,
                   help="text models: show this layer's heads; ViT: this layer's heads (default: "
                   "all layers for text models, the last for ViT); negative counts from the end")
    p.add_argument("--head", type=int, default=None,
                   help="with --layer: draw this one head large, every token labelled")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="text models: draw at most the first this many tokens of a text that fits the "
                   "context (a longer text is refused)")
    p.set_defaults(func=cmd_attend, extra_texts=True)


def _note(notes: list[str], prefix: str = "") -> None:
    for n in notes:
        print(f"qkv: note: {prefix}{n}", file=sys.stderr)


def _looks_like_image(text: str) -> bool:
    from qkv.data.images import IMAGE_SUFFIXES

    return text.lower().endswith(IMAGE_SUFFIXES) and Path(text).is_file()


def cmd_attend(args: argparse.Namespace) -> int:
    from qkv.inference import open_model
    from qkv.inference.loading import resolve_model
    from qkv.pipelines import ImageCaptioner, ImageClassifier, Translator

    out = check_picture_out(args.out, "--out")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    ref = resolve_model(args.model)  # what the name means, before anything loads
    if ref.note:
        print(f"qkv: note: {ref.note}", file=sys.stderr)
    text = " ".join(args.texts)
    if ref.kind == "image" and len(args.texts) != 1:
        raise ValueError(f"{args.model} is a {ref.label} run: give one image file, got {len(args.texts)} "
                         "arguments")
    if ref.kind != "image" and _looks_like_image(text):
        what = "run" if ref.source == "run" else "model"
        raise ValueError(f"{args.model} is a {ref.label} {what} (a text model): give it text to attend "
                         f"over, not the image {text}")
    model = open_model(ref)
    if isinstance(model, ImageClassifier | ImageCaptioner):
        return _attend_image(model, args.texts[0], args.layer, args.head, out)
    if isinstance(model, Translator):
        return _attend_alignment(model, text, args.layer, args.head, out)
    if args.layer is None and args.head is not None:
        raise ValueError(f"--head needs --layer (which layer's head? 0..{model.n_layers - 1})")
    return _attend_text(model, text, args.layer, args.head, args.max_tokens, out)


def _attend_text(lm: CausalLM | SentenceEncoder, text: str, layer: int | None, head: int | None,
                 max_tokens: int, out: Path) -> int:
    """Every layer x head, one layer's heads, or one head large."""
    from qkv.figures import AttentionMaps
    from qkv.lens.cache import encode
    from qkv.pipelines import check_layer_head
    from qkv.pipelines.attention import text_attention
    from qkv.viz import draw

    if layer is not None:  # checked before the forward pass; negative indices count from the end
        layer, head = check_layer_head(lm.n_layers, lm.n_heads, layer, head, ("--layer", "--head"))
    encode(lm, text)  # a text longer than the context: refused with the limit, as qkv lens does
    att = text_attention(lm, text, max_tokens)
    _note(att.notes)
    T = len(att.tokens)
    if layer is None:
        L, H = att.weights.shape[:2]
        title = f"{lm.name}: {L} layers x {H} heads over {T} tokens"
        draw(AttentionMaps(att.weights, att.tokens, title), out)
        print(f"wrote {out}: {L} layers x {H} heads over {T} tokens (--layer L [--head H] for a closer look)")
    elif head is None:
        draw(AttentionMaps(att.weights[layer], att.tokens, f"{lm.name}: layer {layer}, {T} tokens"), out)
        print(f"wrote {out}: the {lm.n_heads} heads of layer {layer} over {T} tokens")
    else:
        title = f"{lm.name}: layer {layer} head {head}"
        draw(AttentionMaps(att.weights[layer, head], att.tokens, title), out)
        print(f"wrote {out}: layer {layer} head {head} over {T} tokens")
    return 0


def _attend_image(model: ImageClassifier | ImageCaptioner, image: str, layer: int | None,
                  head: int | None, out: Path) -> int:
    """A ViT run: every head of a layer and the rollout; a captioner: the caption, a map per word."""
    from qkv.figures import ImageOverlays
    from qkv.pipelines import ImageClassifier
    from qkv.viz import draw

    vit = isinstance(model, ImageClassifier)
    if head is not None or (layer is not None and not vit):
        raise ValueError("a ViT run shows every head of --layer, over the image; drop --head" if vit else
                         "a captioner has one attention per word (no layers or heads); drop --layer/--head")
    x, notes = model.read_image(image)
    _note(notes, f"{image}: ")
    att = model.attention(x, layer, layer_name="--layer")
    if not vit:
        print(f"{image}: {att.title}")
    draw(ImageOverlays(att.image, att.maps, f"{Path(image).name}: {att.title}" if vit else att.title), out)
    if not vit:
        print(f"wrote {out}")
        return 0
    d = att.details
    print(f"predicted {d['prediction']} ({d['probability']:.1%}); wrote {out}")
    (r, c), g, p = d["rollout_peak"], att.grid, d["patch_size"]
    print(f"rollout peaks at patch row {r}, column {c} of the {g}x{g} grid ({p}x{p} pixels each)")
    return 0


def _attend_alignment(tr: Translator, text: str, layer: int | None, head: int | None, out: Path) -> int:
    """A seq2seq run: the alignment matrix of the translation."""
    from qkv.figures import AlignmentMap
    from qkv.viz import draw

    if layer is not None or head is not None:
        raise ValueError("a seq2seq run's picture is one alignment matrix (output x input); drop "
                         "--layer/--head")
    ali = tr.alignment(text)
    _note(ali.notes)
    draw(AlignmentMap(ali.weights, ali.source, ali.output), out)
    print(f"{''.join(ali.source)}  ->  {ali.text}")
    print(f"wrote {out}")
    return 0
