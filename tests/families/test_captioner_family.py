"""Captioning evaluation against hand computations: BLEU-4 and pointing accuracy; the job
trains end to end and beats uniform attention at pointing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import PNG, assert_one_line_error, call, call_one_thread

from qkv.data.shapes import Scene, SceneObject
from qkv.families.captioner import bleu4, pointing, pointing_overlap

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


def test_pointing_by_overlap_by_hand() -> None:
    """The same check by pixels: a red blob drawn over pixels (5..9, 5..9) touches the 4 cells
    (0..1, 0..1) of an 8x8 grid; no cell centre (4, 12, ...) is inside its box (5..9)."""
    red = SceneObject("small", "red", "circle", (5, 5, 9, 9))
    ids = np.zeros((64, 64), np.int64)
    ids[5:10, 5:10] = 1
    scene = Scene(np.zeros((64, 64, 3), np.uint8), [red], ids, "a small red circle")
    alphas = torch.zeros(4, 64)
    alphas[2, 1 * 8 + 1] = 1.0  # "red": cell (1, 1) = pixels 8..15: holds pixels 8, 9 of the blob
    alphas[3, 0 * 8 + 2] = 1.0  # "circle": cell (0, 2) = pixels 16..23 across: none of it
    words = "a small red circle".split()
    assert pointing(scene, words, alphas, grid=8)[:2] == (0, 2)  # neither centre is in the box
    hits, named, uniform = pointing_overlap(scene, words, alphas, grid=8)
    assert (hits, named) == (1, 2)
    assert uniform == pytest.approx(2 * 4 / 64)


@pytest.fixture(scope="module")
def cap_run(tmp_path_factory: pytest.TempPathFactory):
    """`qkv train captioner --preset tiny` once: (run_dir, stdout). Its own run, not the
    session's tiny one: the preset as shipped, with its 100 test and 100 held-out scenes."""
    run = tmp_path_factory.mktemp("cap") / "run"
    rc, out, err = call_one_thread(["train", "captioner", "--preset", "tiny", "--out_dir", str(run),
                                    "--no-progress"])
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

    from qkv.data.shapes import make_scene

    run, _ = cap_run
    Image.fromarray(make_scene(random.Random(4)).image).save(tmp_path / "s.png")
    Image.fromarray(make_scene(random.Random(5)).image).resize((96, 96)).convert("L").save(tmp_path / "g.png")
    rc, out, err = call(["caption", str(run), str(tmp_path / "s.png"), str(tmp_path / "g.png"),
                         "--plot", str(tmp_path / "p.png")])
    assert rc == 0, err
    assert out.count(": a ") >= 1 and "resized 96x96 to 64x64" in err and "converted L to RGB" in err
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG
    rc, beam_out, err = call(["caption", str(run), str(tmp_path / "s.png"), str(tmp_path / "g.png"),
                              "--beam", "3"])
    assert rc == 0 and beam_out.count(": a ") >= 1, err
    rc, _, err = call(["caption", str(run), str(tmp_path / "s.png"), "--beam", "0"])
    assert "--beam" in assert_one_line_error(rc, err)
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    rc, _, err = call(["caption", str(run), str(tmp_path / "bad.png")])
    assert "bad.png" in assert_one_line_error(rc, err)
    rc, _, err = call(["caption", str(run), str(tmp_path / "s.png"), "--plot", str(tmp_path / "p.jpg")])
    assert ".png" in assert_one_line_error(rc, err)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"family": "vit"}')
    rc, _, err = call(["caption", str(tmp_path / "other"), str(tmp_path / "s.png")])
    assert "vit run" in assert_one_line_error(rc, err)


def _caption_folder(tmp_path, lines: list[str], n_images: int = 5):
    import random

    from PIL import Image

    from qkv.data.shapes import make_scene

    for i in range(n_images):
        im = Image.fromarray(make_scene(random.Random(i), n_objects=1).image)
        if i == 0:  # another size and mode: converted, with a note
            im = im.resize((80, 80)).convert("L")
        im.save(tmp_path / f"{i}.png")
    (tmp_path / "captions.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp_path


def test_caption_folder(tmp_path) -> None:
    from qkv.data.captions import load_caption_folder

    lines = ["# image<TAB>caption", ""] + [f"{i}.png\t a  caption number {i} " for i in range(5)]
    splits = load_caption_folder(_caption_folder(tmp_path, lines), 64, 3, seed=0)
    sizes = {k: len(v) for k, v in splits.scenes.items()}
    assert sizes == {"train": 3, "val": 1, "test": 1}
    caps = sorted(s.caption for v in splits.scenes.values() for s in v)
    assert caps == [f"a caption number {i}" for i in range(5)]  # whitespace normalised
    assert all(s.image.shape == (64, 64, 3) and s.image.dtype == np.uint8
               for v in splits.scenes.values() for s in v)
    assert len(splits.notes) == 1 and "converted 1 of 5" in splits.notes[0] and "0.png" in splits.notes[0]


@pytest.mark.parametrize("case, want", [
    ("no_file", "has no captions.tsv"),
    ("empty", "has 0 captioned image(s)"),
    ("no_caption", "line 2: no caption"),
    ("missing_image", "line 2: image not found"),
    ("corrupt", "line 1:"),
])
def test_caption_folder_errors(tmp_path, case: str, want: str) -> None:
    from qkv.data.captions import load_caption_folder

    lines = {"no_file": [], "empty": ["# only a comment"], "no_caption": ["0.png\tok", "1.png\t  "],
             "missing_image": ["0.png\tok", "9.png\tmissing"], "corrupt": ["bad.png\tbroken"]}[case]
    root = _caption_folder(tmp_path, lines, n_images=2)
    (root / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    if case == "no_file":
        (root / "captions.tsv").unlink()
    with pytest.raises(ValueError) as e:
        load_caption_folder(root, 64, 3)
    assert want in str(e.value) and "\n" not in str(e.value)


def test_train_captioner_on_a_folder_cli(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    root = _caption_folder(tmp_path / "d", ["0.png"])
    rc, _, err = call(["train", "captioner", "--preset", "tiny", "--data", str(root),
                       "--out_dir", str(tmp_path / "run"), "--no-progress"])
    assert "line 1: no caption" in assert_one_line_error(rc, err)
    assert not (tmp_path / "run" / "config.json").exists()


def _fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """Adam at 3e-3 on random batches of 32 (a fixed draw), as both short captioner runs train."""
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=g)
        loss = model(x[idx], y[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_short_run_learns_to_name_the_colour() -> None:
    """150 steps on 800 one-object scenes: the third word of the caption ("a small RED circle")
    names the object's colour on new scenes far above chance (1 in 6)."""
    import random

    from qkv.data.shapes import make_scene
    from qkv.families.captioner import decode_captions, normalize, to_tensors
    from qkv.models.captioner import Captioner, CaptionerConfig
    from qkv.tokenizers.vocab import WordVocab

    rng = random.Random(0)
    train = [make_scene(rng, n_objects=1) for _ in range(800)]
    test = [make_scene(rng, n_objects=1) for _ in range(100)]
    vocab = WordVocab.build([s.caption for s in train])
    x, y = to_tensors(train, vocab, 4)
    torch.manual_seed(0)
    m = Captioner(CaptionerConfig(vocab_size=len(vocab), width=8, emb_dim=16, hidden=64, attn_dim=32,
                                  stage_convs=1))
    _fit(m, normalize(x), y, 150)
    toks, _ = decode_captions(m, to_tensors(test, vocab, 4)[0], 4)
    words = [vocab.decode(t).split() for t in toks]
    right = sum(len(w) > 2 and w[2] == s.objects[0].colour for w, s in zip(words, test, strict=True))
    assert right >= 80, right


@pytest.mark.slow  # ~19 s; benchmarks/captioning.py --variant hard trains and measures it at full size
def test_a_short_hard_attention_run_beats_uniform_attention_on_single_objects() -> None:
    """Hard attention trained with REINFORCE (per-word reward, the soft path as control
    variate, the expected-value share annealed 1 -> 0) for 300 steps on 800 one-object scenes:
    more captions exactly right than uniform attention trained the same way, and its most
    attended cell (what it reads when decoding) inside the object far more often than chance."""
    import random

    from qkv.data.captions import CaptionSplits
    from qkv.data.shapes import make_scene
    from qkv.families.captioner import evaluate, normalize, to_tensors
    from qkv.models.captioner import Captioner, CaptionerConfig
    from qkv.tokenizers.vocab import WordVocab

    rng = random.Random(0)
    train = [make_scene(rng, n_objects=1) for _ in range(800)]
    test = [make_scene(rng, n_objects=1) for _ in range(150)]
    vocab = WordVocab.build([s.caption for s in train])
    x, y = to_tensors(train, vocab, 4)
    scores = {}
    for attention in ("hard", "uniform"):
        torch.manual_seed(0)
        m = Captioner(CaptionerConfig(vocab_size=len(vocab), width=16, emb_dim=16, hidden=64, attn_dim=32,
                                      stage_convs=1, attention=attention, hard_anneal=200))
        m.train()
        _fit(m, normalize(x), y, 300)
        scores[attention] = evaluate(m, vocab, CaptionSplits({"test": test}, [], []), 4)["test"]
    hard, uniform = scores["hard"], scores["uniform"]
    assert hard["exact"] > uniform["exact"] + 0.1, (hard["exact"], uniform["exact"])
    assert hard["pointing"] > 3 * hard["pointing_uniform"], hard


def test_beam_of_one_is_greedy_decoding(cap_run) -> None:
    """The captioner behind the shared decoders: beam search with one beam keeps exactly the
    greedy caption, its log-probability and its attention."""
    import random

    from qkv.data.shapes import make_scene
    from qkv.families.captioner import CaptionerFamily
    from qkv.generation.decode import beam_search, greedy_decode
    from qkv.pipelines.captioning import _Decoding, normalize

    run, _ = cap_run
    loaded = CaptionerFamily().load(run)
    model, max_len = loaded.model, loaded.max_len
    rng = random.Random(11)
    images = torch.from_numpy(np.stack([make_scene(rng).image for _ in range(8)])).permute(0, 3, 1, 2)
    x = normalize(images)
    g = greedy_decode(_Decoding(model), x, max_len + 1)
    b = beam_search(_Decoding(model), x, max_len + 1, beam=1)
    assert g.tokens == b.tokens
    torch.testing.assert_close(torch.tensor(g.scores), torch.tensor(b.scores))
    for wg, wb in zip(g.weights, b.weights, strict=True):
        torch.testing.assert_close(wg, wb)


def test_addressing_on_a_larger_grid_from_the_cli(tmp_path) -> None:
    """`qkv caption --keep-size`: a 128x128 scene gives a 16x16 grid. Content-based addressing
    (without learned cell positions) scores all 256 cells; location-based addressing, trained on
    64 cells, refuses in one line naming why."""
    import random

    from PIL import Image

    from qkv.data.shapes import make_scene

    scene = make_scene(random.Random(5)).image  # (64, 64, 3) uint8
    big = tmp_path / "big.png"
    Image.fromarray(scene).resize((128, 128)).save(big)
    runs = {}
    for addressing in ("content", "location"):
        run = tmp_path / addressing
        rc, _, err = call(["train", "captioner", "--preset", "tiny", "--addressing", addressing,
                             "--positions", "false", "--max_iters", "20", "--eval_iters", "1",
                             "--n_train", "100", "--n_val", "10", "--n_test", "10", "--n_heldout", "10",
                             "--out_dir", str(run), "--no-progress"])
        assert rc == 0, err
        runs[addressing] = run
    rc, out, err = call(["caption", str(runs["content"]), str(big), "--keep-size",
                         "--plot", str(tmp_path / "words.png")])
    assert rc == 0, err
    assert out.startswith(f"{big}: ") and (tmp_path / "words.png").is_file()
    rc, _, err = call(["caption", str(runs["location"]), str(big), "--keep-size"])
    line = assert_one_line_error(rc, err)
    assert "location-based addressing outputs a distribution over the 64 cells" in line
    Image.fromarray(scene).resize((100, 100)).save(tmp_path / "odd.png")
    rc, _, err = call(["caption", str(runs["content"]), str(tmp_path / "odd.png"), "--keep-size"])
    assert "multiple of 8" in assert_one_line_error(rc, err)


def test_location_addressing_refuses_a_folder_of_mixed_sizes(tmp_path) -> None:
    """Image 0 of the folder is 80x80, the rest 64x64: resized to one grid, location k would be
    another place in image 0, so location addressing refuses with one line naming both images."""
    (tmp_path / "d").mkdir()
    root = _caption_folder(tmp_path / "d", [f"{i}.png\ta shape" for i in range(5)])
    rc, _, err = call(["train", "captioner", "--preset", "tiny", "--data", str(root), "--addressing",
                       "location", "--out_dir", str(tmp_path / "run"), "--no-progress"])
    line = assert_one_line_error(rc, err)
    assert "1.png is 64x64 but 0.png is 80x80" in line and "--addressing content" in line
    assert not (tmp_path / "run").exists()
    same = tmp_path / "same"
    same.mkdir()
    for i in range(1, 5):
        (same / f"{i}.png").write_bytes((root / f"{i}.png").read_bytes())
    (same / "captions.tsv").write_text("".join(f"{i}.png\ta shape\n" for i in range(1, 5)), encoding="utf-8")
    from qkv.data.captions import load_caption_folder

    assert len(load_caption_folder(same, 64, 3, one_size="why").scenes["train"]) == 2  # one size: fine


def test_the_default_preset_runs_a_few_steps(tmp_path) -> None:
    """`qkv train captioner` with the default preset's model (centred 22-px features, names not
    read back), shortened: the run records the colour and shape words it feeds back as UNK."""
    from qkv.data.shapes import COLOURS, SHAPES

    run = tmp_path / "run"
    rc, _, err = call(["train", "captioner", "--max_iters", "3", "--n_train", "120", "--n_val", "10",
                       "--n_test", "20", "--n_heldout", "20", "--eval_interval", "3", "--eval_iters", "1",
                       "--compile", "false", "--dtype", "fp32", "--out_dir", str(run), "--no-progress"])
    assert rc == 0, err
    cfg = json.loads((run / "config.json").read_text())
    model = cfg["model"]
    assert (model["centred"], model["stage_convs"], model["read_back_names"]) == (True, 1, False)
    from qkv.tokenizers.vocab import WordVocab

    itos = WordVocab(cfg["words"]).itos
    assert sorted(itos[i] for i in model["unread_words"]) == sorted(
        w for w in itos if w in COLOURS or w in SHAPES)
    assert json.loads((run / "eval.json").read_text())["test"]["n"] == 20
