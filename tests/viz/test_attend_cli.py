"""`qkv attend` for every model family: valid PNGs of the size the layout promises, the same
pictures as `qkv caption --plot` / `qkv translate --plot`, one-line errors with exit code 2.

(ViT runs: tests/training/test_vision.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_line_error, call
from pretrained.asset_skip import require_asset

from qkv.viz.plots import attention_grid_size, attention_head_size

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def png(path: Path) -> np.ndarray:
    """The picture as an array, after checking that it is a complete, valid PNG."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


# --------------------------------------------------------------------------- text models


def test_gpt_run_grid_layer_and_head(tiny_run, tmp_path: Path) -> None:
    run = str(tiny_run("gpt"))
    out = tmp_path / "grid.png"
    rc, stdout, err = call(["attend", run, "ROMEO:", "But", "soft", "-o", str(out)])  # words join
    assert rc == 0, err
    assert stdout.strip() == (f"wrote {out}: 2 layers x 4 heads over 15 tokens "
                              "(--layer L [--head H] for a closer look)")
    w, h = attention_grid_size(2, 4)
    assert png(out).shape == (h, w, 3)

    rc, stdout, err = call(["attend", run, "ROMEO: But soft", "--layer", "-1", "-o", str(out)])
    assert rc == 0 and "the 4 heads of layer 1 over 15 tokens" in stdout
    assert png(out).shape == (round(3.2 * 120), round(4 * 3.2 * 120), 3)  # plot_attention_heads: 4 in a row

    text = "ROMEO: But soft, what light through yonder window breaks?"
    rc, stdout, err = call(["attend", run, text[:32], "--layer", "0", "--head", "3", "-o", str(out)])
    assert rc == 0 and stdout.strip() == f"wrote {out}: layer 0 head 3 over 32 tokens" and not err
    w, h = attention_head_size(32)
    assert png(out).shape == (h, w, 3)
    # longer than the context: refused with the limit, as qkv lens does (one rule, issue 41)
    rc, stdout, err = call(["attend", run, text, "--layer", "0", "--head", "3", "-o", str(out)])
    assert rc == 2 and err.startswith(f"qkv: error: the text is {len(text)} tokens, more than ")
    assert err.strip().endswith("context of 32; give at most 32 tokens (a shorter text)")


def test_minilm_grid_and_one_head(tmp_path: Path) -> None:
    require_asset("minilm")  # skips with "asset missing: minilm (qkv assets install minilm)"
    out = tmp_path / "m.png"
    rc, stdout, err = call(["attend", "minilm", "The cat sat on the mat.", "-o", str(out)])
    assert rc == 0, err
    assert "6 layers x 12 heads over 9 tokens" in stdout  # [CLS] the cat sat on the mat . [SEP]
    w, h = attention_grid_size(6, 12)
    assert png(out).shape == (h, w, 3)
    rc, stdout, err = call(["attend", "minilm", "The cat sat on the mat.", "--layer", "2", "--head", "3",
                            "-o", str(out), "--max-tokens", "5"])
    assert rc == 0 and "layer 2 head 3 over 5 tokens" in stdout
    assert "truncated to the first 5 of 9 tokens (the limit here is 5 tokens)" in err
    w, h = attention_head_size(5)
    assert png(out).shape == (h, w, 3)


def test_smollm2_one_head(tmp_path: Path) -> None:
    require_asset("smollm2")
    pytest.importorskip("gguf", reason="gguf not installed: pip install 'qkv[pretrained]'")
    out = tmp_path / "s.png"
    rc, stdout, err = call(["attend", "smollm2", "Once upon a time", "--layer", "-1", "--head", "8",
                            "-o", str(out)])
    assert rc == 0, err
    assert stdout.strip() == f"wrote {out}: layer 29 head 8 over 4 tokens"  # 30 layers, 9 heads (GQA 9/3)
    w, h = attention_head_size(4)
    assert png(out).shape == (h, w, 3)


# --------------------------------------------------------------------------- other families


def _scene(path: Path) -> None:
    from PIL import Image

    img = Image.new("RGB", (64, 64), (0, 0, 0))
    img.paste((220, 40, 40), (8, 8, 30, 30))
    img.paste((40, 40, 220), (36, 36, 60, 60))
    img.save(path)


def test_captioner_run_draws_what_caption_plot_draws(tiny_run, tmp_path: Path) -> None:
    run = str(tiny_run("captioner"))
    _scene(tmp_path / "scene.png")
    rc, out_a, err = call(["attend", run, str(tmp_path / "scene.png"), "-o", str(tmp_path / "a.png")])
    assert rc == 0, err
    rc, out_b, err = call(["caption", run, str(tmp_path / "scene.png"), "--plot", str(tmp_path / "b.png")])
    assert rc == 0, err
    assert out_a.replace("a.png", "b.png") == out_b  # the caption, then "wrote ..."
    assert np.array_equal(png(tmp_path / "a.png"), png(tmp_path / "b.png"))


def test_seq2seq_run_draws_what_translate_plot_draws(tiny_run, tmp_path: Path) -> None:
    run = str(tiny_run("seq2seq"))
    rc, out_a, err = call(["attend", run, "8 août 1977", "-o", str(tmp_path / "a.png")])
    assert rc == 0, err
    rc, out_b, err = call(["translate", run, "8 août 1977", "--plot", str(tmp_path / "b.png")])
    assert rc == 0, err
    assert out_a.splitlines()[0].split() == out_b.splitlines()[0].split()  # 8 août 1977 -> ...
    assert np.array_equal(png(tmp_path / "a.png"), png(tmp_path / "b.png"))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("args, message", [
    (["{gpt}", "   "], "the text is empty"),
    (["{gpt}", "hello ✓"], "never saw"),
    (["{gpt}", "ROMEO", "--head", "1"], "--head needs --layer (which layer's head? 0..1)"),
    (["{gpt}", "ROMEO", "--layer", "2"], "--layer must be in [-2, 1] for this 2-layer model, got 2"),
    (["{gpt}", "ROMEO", "--layer", "0", "--head", "-5"], "--head must be in [-4, 3]"),
    (["{gpt}", "ROMEO", "--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["{gpt}", "ROMEO", "-o", "{tmp}/x.jpg"], "--out must name a .png, .svg or .pdf file"),
    (["{gpt}", "ROMEO", "-o", "{tmp}/no/x.png"], "does not exist"),
    (["{tmp}/nothing", "ROMEO"], "is neither a pretrained model (minilm, smollm2) nor a run directory"),
    (["bert", "ROMEO"], "'bert' is neither a pretrained model"),
    (["{tmp}", "ROMEO"], "config.json is missing"),
    (["{s2s}", "8 août 1977", "--layer", "0"], "one alignment matrix"),
    (["{s2s}", ""], "the text is empty"),
    (["{cap}", "{tmp}/scene.png", "--layer", "0"], "one attention per word"),
    (["{cap}", "{tmp}/scene.png", "{tmp}/scene.png"], "give one image file, got 2"),
    (["{cap}", "{tmp}/text.txt"], "not a readable image"),
    (["{cap}", "{tmp}/missing.png"], "image not found"),
])
def test_errors_are_one_line(tiny_run, tmp_path: Path, args: list[str], message: str) -> None:
    _scene(tmp_path / "scene.png")
    (tmp_path / "text.txt").write_text("hello")
    names = {"gpt": tiny_run("gpt"), "s2s": tiny_run("seq2seq"), "cap": tiny_run("captioner"),
             "tmp": tmp_path}
    argv = ["attend", *(a.format(**names) for a in args)]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out.png")]
    rc, _, err = call(argv)
    assert message in assert_one_line_error(rc, err)
    assert not (tmp_path / "out.png").exists()


def test_help_describes_every_family() -> None:
    rc, out, _ = call(["attend", "--help"])
    assert rc == 0
    for word in ("MiniLM", "SmolLM2", "GPT runs", "seq2seq", "ViT", "captioner", "--layer", "--head"):
        assert word in out
