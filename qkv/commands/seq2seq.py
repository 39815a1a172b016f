"""`qkv translate RUN_DIR TEXT...`: run a trained sequence-to-sequence model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qkv.commands.options import check_picture_out


def add_translate_parser(sub) -> None:
    p = sub.add_parser(
        "translate",
        help="translate with a trained seq2seq run (dates -> ISO 8601), with an alignment plot",
        description="Translate each TEXT with a run directory from `qkv train seq2seq`. With "
        "--plot, also draw the attention of every output character over the input characters "
        "(the alignment matrix; RNN + attention and Transformer runs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory from `qkv train seq2seq`")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="inputs, e.g. '8 août 1977'")
    p.add_argument("--beam", type=int, default=1, help="beam width (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam search: rank by log p / length^this (0 = raw probability)")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="write the alignment heatmap of the first text here")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_translate, extra_texts=True)


def cmd_translate(args: argparse.Namespace) -> int:
    import sys

    from qkv.inference import open_model
    from qkv.pipelines import Translator

    if args.beam < 1:
        raise ValueError(f"--beam must be >= 1, got {args.beam}")
    if args.plot is not None:
        check_picture_out(args.plot, "--plot")
    tr = open_model(args.run, family="seq2seq")
    assert isinstance(tr, Translator)
    texts, notes = tr.prepare(args.texts)
    for n in notes:
        print(f"qkv: warning: {n}", file=sys.stderr)
    outs, weights = tr.translate(texts, beam=args.beam, length_penalty=args.length_penalty)
    if args.json:
        print(json.dumps([{"input": t, "output": o} for t, o in zip(texts, outs, strict=True)],
                         ensure_ascii=False, indent=2))
    else:
        width = max(len(t) for t in texts)
        for t, o in zip(texts, outs, strict=True):
            print(f"{t:<{width}}  ->  {o}")
    if args.plot is not None:
        from qkv.figures import AlignmentMap
        from qkv.viz import draw

        w = weights[0]
        if w is None:
            raise ValueError(f"this run is arch {tr.cfg.arch}: it has no attention to plot")
        if not outs[0]:
            raise ValueError("the model produced an empty output; nothing to plot")
        draw(AlignmentMap(w, list(texts[0]), list(outs[0])), Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
