"""Generated captioning scenes: coloured shapes on a canvas, a caption from a small grammar,
and where every object is (issue 7; no captioning data ships offline).

    scene = 1-3 objects, each a (size, colour, shape) drawn without overlap on a noisy
            background of a random dark tint
    caption, 1 object:   "a small red circle"
             2 objects:  "a large blue square above a small green triangle"
                         (the relation from the centres: above / below / left of / right of;
                         the large object first, and between two of one size the left or upper)
             3 objects:  "a red circle , a blue square and a green triangle" (left to right)

Every caption is the only right one: scenes whose relation would be a close call (|dx| within
MARGIN pixels of |dy|) or whose objects' left-to-right order is (centres within MARGIN) are
redrawn, and the rules above fix which of two objects is named first.

Every object's bounding box and its pixel mask (an id map: 0 = background, i + 1 = object i)
are recorded, so attention can be scored against where the object really is. Deterministic by
seed. ``split_combos`` holds out some (colour, shape) pairs that never appear in training.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 230),
    "yellow": (230, 210, 40), "purple": (160, 60, 200), "white": (235, 235, 235),
}
SIZES = {"small": (5, 7), "large": (10, 13)}  # half-width ranges in pixels
MARGIN = 4.0  # pixels: how clear a relation or a left-to-right order must be


@dataclass
class SceneObject:
    size: str
    colour: str
    shape: str
    box: tuple[int, int, int, int]  # (x0, y0, x1, y1), inclusive pixel bounds of the drawn mask

    @property
    def centre(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2

    def words(self, with_size: bool = True) -> str:
        return f"{self.size} {self.colour} {self.shape}" if with_size else f"{self.colour} {self.shape}"


@dataclass
class Scene:
    image: np.ndarray  # uint8 (H, W, 3)
    objects: list[SceneObject]
    ids: np.ndarray  # int (H, W): 0 background, i + 1 where object i was drawn
    caption: str


def _mask(shape: str, cx: int, cy: int, r: int, size: int) -> np.ndarray:
    """Boolean (size, size) mask of one shape centred at (cx, cy) with half-width r."""
    yy, xx = np.mgrid[0:size, 0:size]
    if shape == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    if shape == "square":
        return (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
    # an upright isosceles triangle: apex at (cx, cy - r), base from (cx - r, cy + r) to (cx + r, cy + r)
    inside_y = (yy >= cy - r) & (yy <= cy + r)
    half = (yy - (cy - r)) / 2.0  # the half-width grows from 0 at the apex to r at the base
    return inside_y & (np.abs(xx - cx) <= half)


def relation(a: SceneObject, b: SceneObject) -> str:
    """Where ``a`` is with respect to ``b``, from their centres (image y grows downwards)."""
    (ax, ay), (bx, by) = a.centre, b.centre
    if abs(ax - bx) > abs(ay - by):
        return "left of" if ax < bx else "right of"
    return "above" if ay < by else "below"


def well_posed(objects: list[SceneObject]) -> bool:
    """Whether the caption's relation / order is clear by at least MARGIN pixels."""
    if len(objects) == 2:
        (ax, ay), (bx, by) = objects[0].centre, objects[1].centre
        return abs(abs(ax - bx) - abs(ay - by)) >= MARGIN
    xs = sorted(o.centre[0] for o in objects)
    return all(b - a >= MARGIN for a, b in itertools.pairwise(xs))


def caption_for(objects: list[SceneObject]) -> str:
    if len(objects) == 1:
        return f"a {objects[0].words()}"
    if len(objects) == 2:
        a, b = objects
        if a.size == b.size:  # the left one (a horizontal relation) or the upper one first
            a, b = sorted(objects, key=lambda o: o.centre[0 if relation(a, b).endswith("of") else 1])
        elif a.size == "small":
            a, b = b, a
        return f"a {a.words()} {relation(a, b)} a {b.words()}"
    ordered = sorted(objects, key=lambda o: o.centre[0])
    names = [f"a {o.words(with_size=False)}" for o in ordered]
    return " , ".join(names[:-1]) + " and " + names[-1]


def make_scene(rng: random.Random, size: int = 64, n_objects: int | None = None,
               combos: list[tuple[str, str]] | None = None, noise: float = 12.0) -> Scene:
    """One scene; ``combos`` limits the (colour, shape) pairs drawn."""
    n = n_objects if n_objects is not None else rng.choice((1, 1, 2, 2, 3))
    pairs = combos or [(c, s) for c in COLOURS for s in SHAPES]
    for _ in range(100):
        scene = _draw(rng, size, n, pairs, noise)
        if n == 1 or well_posed(scene.objects):
            return scene
    raise RuntimeError("could not draw a scene with a clear caption; use fewer objects or a larger canvas")


def _draw(rng: random.Random, size: int, n: int, pairs: list[tuple[str, str]], noise: float) -> Scene:
    nrng = np.random.default_rng(rng.randrange(2**32))
    tint = np.array([rng.randrange(0, 50) for _ in range(3)], dtype=np.float64)
    img = np.clip(tint + nrng.normal(0, noise, (size, size, 3)), 0, 255)
    ids = np.zeros((size, size), dtype=np.int64)
    objects: list[SceneObject] = []
    for i in range(n):
        for _ in range(200):  # place without touching the others (2-pixel gap)
            colour, shape = rng.choice(pairs)
            sz = rng.choice(tuple(SIZES))
            r = rng.randint(*SIZES[sz])
            cx, cy = rng.randint(r + 1, size - r - 2), rng.randint(r + 1, size - r - 2)
            m = _mask(shape, cx, cy, r, size)
            grown = np.zeros_like(m)
            ys, xs = np.nonzero(m)
            grown[max(ys.min() - 2, 0):ys.max() + 3, max(xs.min() - 2, 0):xs.max() + 3] = True
            if not (grown & (ids > 0)).any():
                break
        else:
            raise RuntimeError("could not place the objects; use fewer or a larger canvas")
        ids[m] = i + 1
        shade = np.array(COLOURS[colour], dtype=np.float64) * rng.uniform(0.85, 1.0)
        img[m] = np.clip(shade + nrng.normal(0, noise / 2, (int(m.sum()), 3)), 0, 255)
        objects.append(SceneObject(sz, colour, shape, (int(xs.min()), int(ys.min()),
                                                       int(xs.max()), int(ys.max()))))
    return Scene(img.astype(np.uint8), objects, ids, caption_for(objects))


def split_combos(n_heldout: int = 4, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(seen, held-out) (colour, shape) pairs: the held-out ones never appear in training, and
    every colour and every shape still appears in training with something else."""
    rng = random.Random(seed)
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    rng.shuffle(pairs)
    held: list[tuple[str, str]] = []
    for c, s in pairs:
        if len(held) == n_heldout:
            break
        if any(c == hc for hc, _ in held) or sum(s == hs for _, hs in held) >= len(COLOURS) // 3:
            continue  # at most one held-out pair per colour, and a few per shape
        held.append((c, s))
    seen = [p for p in pairs if p not in held]
    return sorted(seen), sorted(held)
