"""`qkv caption RUN_DIR IMAGE...`: caption images with a trained captioner."""

from __future__ import annotations

import argparse
from pathlib import Path

from qkv.commands.options import check_png_out


def add_caption_parser(sub) -> None:
    p = sub.add_parser(
        "caption",
        help="caption images with a trained captioner run, with one attention overlay per word",
        description="Caption each IMAGE with a run directory from `qkv train captioner` (greedy "
        "decoding, or beam search with --beam K). Images of another size or mode are converted, "
        "with a note. With --plot, draw the first image with the attention of every generated word over it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory from `qkv train captioner`")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="PNG/JPEG/... files")
    p.add_argument("--beam", type=int, default=1, metavar="K",
                   help="beam width: 1 = greedy; K > 1 keeps the K most likely captions at every word")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="write the first image with one attention overlay per word")
    p.set_defaults(func=cmd_caption)


def cmd_caption(args: argparse.Namespace) -> int:
    import sys

    import torch

    from qkv.data.images import read_image
    from qkv.families.captioner import CaptionerFamily, decode_captions, word_maps

    if args.plot is not None:
        check_png_out(args.plot, "--plot")
    if not 1 <= args.beam <= 64:
        raise ValueError(f"--beam must be between 1 and 64, got {args.beam}")
    run = CaptionerFamily().load(Path(args.run))
    model, vocab, max_len = run.model, run.vocab, run.max_len
    cfg = model.cfg
    images = []
    for path in args.images:
        x, notes = read_image(path, cfg.image_size, cfg.channels)
        for n in notes:
            print(f"qkv: note: {path}: {n}", file=sys.stderr)
        images.append(x)
    toks, alphas = decode_captions(model, torch.stack(images), max_len, beam=args.beam)
    captions = [vocab.decode(t) for t in toks]
    for path, c in zip(args.images, captions, strict=True):
        print(f"{path}: {c}")
    if args.plot is not None:
        from qkv.viz import plot_image_attention

        plot_image_attention(images[0], word_maps(captions[0], alphas[0], cfg.grid), Path(args.plot),
                             title=captions[0])
        print(f"wrote {args.plot}")
    return 0
