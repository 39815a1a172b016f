"""`qkv classify RUN_DIR IMAGE...` and `qkv attend RUN_DIR IMAGE` for trained ViT runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.commands.options import check_png_out


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


def _load_images(paths: list[str], size: int, channels: int):
    """[(path, uint8 (C, H, W))], notes printed to stderr."""
    from qkv.data.images import read_image

    out = []
    for path in paths:
        x, notes = read_image(path, size, channels)
        for n in notes:
            print(f"qkv: note: {path}: {n}", file=sys.stderr)
        out.append((path, x))
    return out


def cmd_classify(args: argparse.Namespace) -> int:
    import torch

    from qkv.training.vision import load_vit_run, predict

    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    model, info = load_vit_run(Path(args.run))
    cfg = model.cfg
    images = _load_images(args.images, cfg.image_size, cfg.channels)
    probs = predict(model, torch.stack([x for _, x in images]), info["mean"], info["std"])
    k = min(args.top, len(info["classes"]))
    results = []
    for (path, _), p in zip(images, probs, strict=True):
        top = torch.topk(p, k)
        results.append({"image": path, "top": [{"class": info["classes"][int(i)], "probability": float(v)}
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


def add_attend_parser(sub) -> None:
    p = sub.add_parser(
        "attend",
        help="where a trained ViT looks: per-head attention and rollout over the image, as PNG",
        description="Overlay on IMAGE the attention of a run from `qkv train vit`: the read-out's "
        "attention in each head of one layer (the class token's row; the mean over tokens for "
        "mean/concat read-outs) and the attention rollout through all layers (Abnar & Zuidema "
        "2020). Attention maps of text models (MiniLM, SmolLM2, GPT runs) are not built yet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory from `qkv train vit`")
    p.add_argument("image", metavar="IMAGE", help="a PNG/JPEG/... file")
    p.add_argument("-o", "--out", default="attention.png", help="where to write the PNG")
    p.add_argument("--layer", type=int, default=-1, help="which layer's heads to show (-1 = last)")
    p.set_defaults(func=cmd_attend)


def cmd_attend(args: argparse.Namespace) -> int:
    from qkv.training import checkpoint as ckpt
    from qkv.training.vision import attention_maps, load_vit_run
    from qkv.viz import plot_image_attention

    run = Path(args.run)
    if run.is_dir() and (run / "config.json").is_file():
        family = ckpt.read_json(run / "config.json")
        family = family.get("family") if isinstance(family, dict) else None
        if family in ("gpt",):
            raise ValueError(f"{run} is a gpt run; `qkv attend` draws ViT runs only so far (text "
                             f"models are not built yet); its training wrote {run / 'attention.png'}")
    out = check_png_out(args.out, "--out")
    model, info = load_vit_run(run)
    cfg = model.cfg
    if not -cfg.n_layers <= args.layer < cfg.n_layers:
        raise ValueError(f"--layer must be in [{-cfg.n_layers}, {cfg.n_layers - 1}] for this "
                         f"{cfg.n_layers}-layer model, got {args.layer}")
    [(path, image)] = _load_images([args.image], cfg.image_size, cfg.channels)
    probs, heads, rollout = attention_maps(model, image, info["mean"], info["std"], layer=args.layer)
    layer = args.layer % cfg.n_layers
    maps = [(f"layer {layer} head {h}", heads[h]) for h in range(len(heads))] + [("rollout", rollout)]
    pred = int(probs.argmax())
    plot_image_attention(image, maps, out, title=f"{Path(path).name}: {info['classes'][pred]} "
                         f"({probs[pred]:.0%})")
    print(f"predicted {info['classes'][pred]} ({probs[pred]:.1%}); wrote {out}")
    peak = divmod(int(rollout.argmax()), cfg.grid)
    print(f"rollout peaks at patch row {peak[0]}, column {peak[1]} of the {cfg.grid}x{cfg.grid} grid "
          f"({cfg.patch_size}x{cfg.patch_size} pixels each)")
    return 0
