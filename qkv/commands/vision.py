"""`qkv classify RUN_DIR IMAGE...` for trained ViT runs (`qkv attend` is in attend.py)."""

from __future__ import annotations

import argparse
import json
import sys


def add_classify_parser(sub) -> None:
    p = sub.add_parser(
        "classify",
        help="classify images with a trained ViT run (top-k classes with probabilities)",
        description="Classify image files with a run directory from `qkv train vit`. Images of "
        "another size or colour mode are converted to what the model was trained on, with a note.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory from `qkv train vit`")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="PNG/JPEG/... files")
    p.add_argument("--top", type=int, default=3, help="how many classes to show per image")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_classify)


def cmd_classify(args: argparse.Namespace) -> int:
    import torch

    from qkv.inference import open_model
    from qkv.pipelines import ImageClassifier

    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    clf = open_model(args.run, family="vit")
    assert isinstance(clf, ImageClassifier)
    images = []
    for path in args.images:
        x, notes = clf.read_image(path)
        for n in notes:
            print(f"qkv: note: {path}: {n}", file=sys.stderr)
        images.append(x)
    probs = clf.classify(torch.stack(images))
    classes = clf.classes
    k = min(args.top, len(classes))
    results = []
    for path, p in zip(args.images, probs, strict=True):
        top = torch.topk(p, k)
        results.append({"image": path, "top": [{"class": classes[int(i)], "probability": float(v)}
                                               for v, i in zip(top.values, top.indices, strict=True)]})
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
        return 0
    for r in results:
        print(r["image"])
        for t in r["top"]:
            bar = "█" * round(20 * t["probability"])
            print(f"  {t['probability']:7.2%}  {t['class']:<16} {bar}")
    return 0
