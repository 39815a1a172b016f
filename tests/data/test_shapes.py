"""Generated captioning scenes: boxes match the drawn pixels, captions follow the grammar,
relations follow the geometry, held-out colour/shape pairs stay out, seeds reproduce."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qkv.data.shapes import COLOURS, MARGIN, SHAPES, caption_for, make_scene, relation, split_combos


@pytest.mark.parametrize("seed", range(20))
def test_boxes_match_the_pixels_drawn(seed: int) -> None:
    scene = make_scene(random.Random(seed))
    assert 1 <= len(scene.objects) <= 3 and scene.image.shape == (64, 64, 3)
    for i, obj in enumerate(scene.objects):
        ys, xs = np.nonzero(scene.ids == i + 1)
        assert obj.box == (xs.min(), ys.min(), xs.max(), ys.max())
        # the object's pixels carry its colour (dominant channel as in the palette)
        mean = scene.image[scene.ids == i + 1].mean(0)
        want = np.array(COLOURS[obj.colour], dtype=float)
        assert np.abs(mean - want).max() < 45, (obj.colour, mean)
    assert (scene.ids > 0).sum() < 64 * 64 // 2


def test_shapes_have_their_geometry() -> None:
    """A square fills its box, a circle πr²/(2r+1)² of it, a triangle about half."""
    fills = {s: [] for s in SHAPES}
    rng = random.Random(0)
    for _ in range(60):
        scene = make_scene(rng, n_objects=1)
        o = scene.objects[0]
        x0, y0, x1, y1 = o.box
        fill = (scene.ids == 1).sum() / ((x1 - x0 + 1) * (y1 - y0 + 1))
        if o.shape == "circle":  # πr² in a (2r+1)² box, r from the box width
            r = (x1 - x0) / 2
            fill -= np.pi * r * r / (2 * r + 1) ** 2
        fills[o.shape].append(fill)
    assert min(fills["square"]) == 1.0
    assert abs(np.mean(fills["circle"])) < 0.05
    assert 0.45 < np.mean(fills["triangle"]) < 0.65


def _two_object_caption_ok(caption: str, a, b) -> bool:
    """Whether ``caption`` describes a (named first) and b by the grammar's rules."""
    (ax, ay), (bx, by) = a.centre, b.centre
    dx, dy = bx - ax, by - ay  # from the first-named object to the second
    assert abs(abs(dx) - abs(dy)) >= MARGIN  # no close calls
    want = ("left of" if dx > 0 else "right of") if abs(dx) > abs(dy) else ("above" if dy > 0 else "below")
    assert relation(a, b) == want
    order_ok = want in ("left of", "above") if a.size == b.size else a.size == "large"
    return order_ok and caption == f"a {a.words()} {want} a {b.words()}"


def test_captions_and_relations() -> None:
    rng = random.Random(3)
    for _ in range(200):
        s = make_scene(rng)
        words = s.caption.split()
        if len(s.objects) == 1:
            o = s.objects[0]
            assert s.caption == f"a {o.size} {o.colour} {o.shape}"
        elif len(s.objects) == 2:
            # the caption names the large one first, or between equals the left / upper one
            assert any(_two_object_caption_ok(s.caption, a, b) for a, b in (s.objects, s.objects[::-1]))
        else:
            assert words.count("and") == 1 and words.count(",") == 1
            named = [w for w in words if w in SHAPES]
            xs = sorted(o.centre[0] for o in s.objects)
            left_to_right = [o.shape for o in sorted(s.objects, key=lambda o: o.centre[0])]
            assert named == left_to_right and min(xs[1] - xs[0], xs[2] - xs[1]) >= MARGIN
    assert caption_for(make_scene(random.Random(1), n_objects=1).objects).startswith("a ")


def test_seeded_and_held_out() -> None:
    a, b = make_scene(random.Random(7)), make_scene(random.Random(7))
    assert np.array_equal(a.image, b.image) and a.caption == b.caption
    seen, held = split_combos(4, seed=0)
    assert len(held) == 4 and not set(seen) & set(held)
    assert {c for c, _ in seen} == set(COLOURS) and {s for _, s in seen} == set(SHAPES)
    rng = random.Random(0)
    for _ in range(30):
        for o in make_scene(rng, combos=seen).objects:
            assert (o.colour, o.shape) in seen
