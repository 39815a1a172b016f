"""Captioning data: generated scenes of coloured shapes split so that some colour/shape pairs
are only ever seen at test time, or a folder of your own images with a ``captions.tsv``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkv.data.shapes import Scene, make_scene, split_combos


@dataclass
class CaptionSplits:
    scenes: dict[str, list[Scene]]
    seen: list[tuple[str, str]]
    heldout: list[tuple[str, str]]
    notes: list[str] = dataclasses.field(default_factory=list)  # how a folder's images were converted


CAPTIONS_FILE = "captions.tsv"


def load_caption_folder(root: str | Path, image_size: int, channels: int, seed: int = 0,
                        one_size: str | None = None) -> CaptionSplits:
    """Your own data: ``root/captions.tsv`` holds one ``image<TAB>caption`` per line (image paths
    relative to the folder; blank lines and lines starting with # are skipped). Images of another
    size or mode are converted (a note says how many). A shuffled tenth each (at least one) goes to
    validation and test. There are no boxes, so pointing accuracy is not measured.
    ``one_size``: why every image must have the same size (location-based addressing: cell k must
    be the same place in every image), or None to resize any size.
    Raises ValueError naming the line for a line without a caption or an unreadable image, or for
    an image whose size differs from the first one's when ``one_size`` is given."""
    from qkv.data.images import read_image

    root = Path(root)
    tsv = root / CAPTIONS_FILE
    if not root.is_dir():
        raise ValueError(f"--data {root}: not a folder; give 'shapes' or a folder with {CAPTIONS_FILE}")
    if not tsv.is_file():
        raise ValueError(f"{root} has no {CAPTIONS_FILE}: write one line per image, "
                         "'image.png<TAB>a caption of it'")
    try:
        lines = tsv.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{tsv} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    scenes: list[Scene] = []
    converted: list[str] = []
    first: tuple[int, int, str] | None = None  # width, height, name of the first image (one_size)
    for no, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, caption = line.partition("\t")
        if not caption.strip():
            raise ValueError(f"{tsv} line {no}: no caption; write 'image.png<TAB>a caption of it'")
        try:
            x, notes = read_image(root / name.strip(), image_size, channels)
        except ValueError as e:
            raise ValueError(f"{tsv} line {no}: {e}") from None
        if one_size is not None:
            w, h = _size_of(root / name.strip())
            first = first or (w, h, name.strip())
            if (w, h) != first[:2]:
                raise ValueError(f"{tsv} line {no}: {name.strip()} is {w}x{h} but {first[2]} is "
                                 f"{first[0]}x{first[1]}; {one_size}")
        if notes:
            converted.append(f"{name.strip()}: {', '.join(notes)}")
        img = x.permute(1, 2, 0).numpy()
        scenes.append(Scene(img, [], np.zeros(img.shape[:2], np.int64), " ".join(caption.split())))
    if len(scenes) < 3:
        raise ValueError(f"{tsv} has {len(scenes)} captioned image(s); it needs at least 3 "
                         "(train, validation, test)")
    random.Random(seed).shuffle(scenes)
    k = max(1, len(scenes) // 10)
    notes = [f"converted {len(converted)} of {len(scenes)} images to {image_size}x{image_size} "
             f"{'RGB' if channels == 3 else 'grey'} (e.g. {converted[0]})"] if converted else []
    return CaptionSplits({"train": scenes[2 * k:], "val": scenes[:k], "test": scenes[k:2 * k]}, [], [], notes)


def _size_of(path: Path) -> tuple[int, int]:
    """(width, height) from the image's header (read_image has already opened it)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def make_splits(cfg) -> CaptionSplits:
    """Scenes for ``cfg`` (a CaptionDataConfig: n_train, n_val, n_test, n_heldout, heldout_pairs,
    data_seed). Train/val/test scenes use only the seen pairs; every held-out scene has at least one
    object with a held-out pair (the others drawn from everything)."""
    seen, held = split_combos(cfg.heldout_pairs, cfg.data_seed)
    rng = random.Random(cfg.data_seed)
    scenes = {name: [make_scene(rng, combos=seen) for _ in range(n)]
              for name, n in (("train", cfg.n_train), ("val", cfg.n_val), ("test", cfg.n_test))}
    heldout = []
    while len(heldout) < cfg.n_heldout and held:
        s = make_scene(rng)
        if any((o.colour, o.shape) in held for o in s.objects):
            heldout.append(s)
    if heldout:
        scenes["heldout"] = heldout
    return CaptionSplits(scenes, seen, held)
