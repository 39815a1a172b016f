"""`qkv caption RUN_DIR IMAGE...`: caption images with a trained captioner."""

from __future__ import annotations

import argparse
from pathlib import Path

from qkv.commands.options import check_picture_out


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
    p.add_argument("--keep-size", action="store_true",
                   help="read each image at its own size (square, a multiple of 8 pixels) instead of "
                   "resizing it: a larger grid of cells, which content-based addressing can score and "
                   "location-based addressing (or learned cell positions) cannot")
    p.set_defaults(func=cmd_caption)


def cmd_caption(args: argparse.Namespace) -> int:
    import sys

    import torch

    from qkv.inference import open_model
    from qkv.pipelines import ImageCaptioner

    if args.plot is not None:
        check_picture_out(args.plot, "--plot")
    if not 1 <= args.beam <= 64:
        raise ValueError(f"--beam must be between 1 and 64, got {args.beam}")
    cap = open_model(args.run, family="captioner")
    assert isinstance(cap, ImageCaptioner)
    images = []
    for path in args.images:
        x, notes = cap.read_image(path, size=_own_size(path) if args.keep_size else None)
        for n in notes:
            print(f"qkv: note: {path}: {n}", file=sys.stderr)
        images.append(x)
    if args.keep_size:  # sizes may differ: one image at a time
        captions, alphas = [], []
        for x in images:
            c, a = cap.caption(x[None], beam=args.beam)
            captions, alphas = captions + c, alphas + a
    else:
        captions, alphas = cap.caption(torch.stack(images), beam=args.beam)
    for path, c in zip(args.images, captions, strict=True):
        print(f"{path}: {c}")
    if args.plot is not None:
        from qkv.figures import ImageOverlays
        from qkv.pipelines.captioning import word_maps
        from qkv.viz import draw

        grid = images[0].shape[-1] // 8  # cfg.grid unless --keep-size read another size
        draw(ImageOverlays(images[0], word_maps(captions[0], alphas[0], grid), captions[0]), Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _own_size(path: str) -> int:
    """The side of a square image whose side is a multiple of 8 (the CNN's three stride-2 stages)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from None
    if w != h or w % 8:
        raise ValueError(f"--keep-size needs square images whose side is a multiple of 8; {path} is {w}x{h}")
    return w
