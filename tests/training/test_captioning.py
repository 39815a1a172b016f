"""Captioning evaluation against hand computations: BLEU-4 and pointing accuracy; the job
trains end to end and beats uniform attention at pointing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkv.data.shapes import Scene, SceneObject
from qkv.training.captioning import bleu4, pointing

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bleu4_by_hand() -> None:
    ref = "a small red circle above a blue square".split()
    assert bleu4([ref], [ref]) == pytest.approx(1.0)
    hyp = "a small red circle above a red square".split()  # one wrong word of 8
    # n-gram matches: 7/8, 5/7, 4/6, 3/5 (hand-counted); same length: no brevity penalty
    want = math.exp((math.log(7 / 8) + math.log(5 / 7) + math.log(4 / 6) + math.log(3 / 5)) / 4)
    assert bleu4([ref], [hyp]) == pytest.approx(want)
    short = "a small red circle".split()  # all n-grams match; brevity penalty exp(1 - 8/4)
    assert bleu4([ref], [short]) == pytest.approx(math.exp(1 - 8 / 4))
    assert bleu4([ref], ["square".split()]) == 0.0


def test_pointing_by_hand() -> None:
    """A 64x64 scene, an 8x8 grid (cells of 8 px): a red square in box (8..23, 8..23) covers the
    4 cells (1..2, 1..2) whose centres lie inside; a blue circle elsewhere."""
    red = SceneObject("large", "red", "square", (8, 8, 23, 23))
    blue = SceneObject("small", "blue", "circle", (40, 40, 50, 50))
    scene = Scene(np.zeros((64, 64, 3), np.uint8), [red, blue], np.zeros((64, 64), np.int64),
                  "a large red square above a small blue circle")
    words = "a large red square above".split()
    alphas = torch.zeros(5, 64)
    alphas[2, 1 * 8 + 2] = 1.0  # "red": row 1, column 2 -> centre (20, 12): inside the red box
    alphas[3, 6 * 8 + 6] = 1.0  # "square": centre (52, 52): inside the blue circle's box, not red's
    hits, named, uniform = pointing(scene, words, alphas, grid=8)
    assert (hits, named) == (1, 2)
    assert uniform == pytest.approx(2 * 4 / 64)  # each named word: 4 of 64 cell centres inside


@pytest.fixture(scope="module")
def cap_run(tmp_path_factory: pytest.TempPathFactory):
    from test_train_cli import call

    run = tmp_path_factory.mktemp("cap") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc, out, err = call(["train", "captioner", "--preset", "tiny", "--out_dir", str(run),
                             "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, out + err
    return run, out


def test_train_captioner_end_to_end(cap_run) -> None:
    import json

    run, out = cap_run
    ev = json.loads((run / "eval.json").read_text())
    assert ev["test"]["n"] == 100 and ev["heldout"]["n"] == 100
    for split in ("test", "heldout"):
        e = ev[split]
        assert 0 <= e["exact"] <= 1 and 0 <= e["bleu4"] <= 1
        assert 0 < e["pointing_uniform"] < 0.5  # objects cover a small share of the grid
    assert "pointing" in out and json.loads((run / "config.json").read_text())["family"] == "captioner"


def test_caption_command(cap_run, tmp_path) -> None:
    import random

    from PIL import Image
    from test_train_cli import PNG, assert_one_line_error, call

    from qkv.data.shapes import make_scene

    run, _ = cap_run
    Image.fromarray(make_scene(random.Random(4)).image).save(tmp_path / "s.png")
    Image.fromarray(make_scene(random.Random(5)).image).resize((96, 96)).convert("L").save(tmp_path / "g.png")
    rc, out, err = call(["caption", str(run), str(tmp_path / "s.png"), str(tmp_path / "g.png"),
                         "--plot", str(tmp_path / "p.png")])
    assert rc == 0, err
    assert out.count(": a ") >= 1 and "resized 96x96 to 64x64" in err and "converted L to RGB" in err
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG
    rc, _, err = call(["caption", str(run), str(tmp_path / "s.png"), "--plot", str(tmp_path / "p.jpg")])
    assert ".png" in assert_one_line_error(rc, err)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"family": "vit"}')
    rc, _, err = call(["caption", str(tmp_path / "other"), str(tmp_path / "s.png")])
    assert "vit run" in assert_one_line_error(rc, err)
