"""`qkv train vit`, `qkv classify` and `qkv attend` end to end on scikit-learn's digits, plus
the evaluation helpers against hand computations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PNG, assert_one_line_error, call, call_one_thread, child_env, free_port, metrics

from qkv.data.images import ImageData
from qkv.families.vit import ViTFamily, confusion_matrix, fit_model_config, predict
from qkv.models.vit import ViTConfig

pytest.importorskip("sklearn")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_confusion_matrix_by_hand() -> None:
    labels = torch.tensor([0, 0, 1, 2, 2, 2])
    preds = torch.tensor([0, 1, 1, 2, 0, 2])
    want = [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    assert confusion_matrix(labels, preds, 3).tolist() == want


def test_model_config_follows_the_data() -> None:
    x = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    y = torch.zeros(4, dtype=torch.long)
    data = ImageData("toy", ("a", "b", "c"), x, y, x, y, x, y)
    cfg = fit_model_config(ViTConfig(patch_size=4), data)
    assert (cfg.image_size, cfg.channels, cfg.n_classes) == (8, 3, 3)
    with pytest.raises(ValueError, match="use --patch_size 2 or 4 or 8"):
        fit_model_config(ViTConfig(patch_size=7), data)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory):
    """`qkv train vit --preset tiny` (digits, 200 steps) once: (run_dir, stdout). Its own run,
    not the session's tiny one: the preset as shipped must learn (accuracy > 80%) and resume
    from step 200."""
    run_dir = tmp_path_factory.mktemp("vit") / "run"
    rc, out, err = call_one_thread(["train", "vit", "--preset", "tiny", "--out_dir", str(run_dir),
                                    "--no-progress"])
    assert rc == 0, out + err
    return run_dir, out


def _test_split():
    from qkv.data.images import load_digits

    return load_digits()


def test_train_vit_end_to_end(vit_run) -> None:
    run_dir, out = vit_run
    assert {"config.json", "model.safetensors", "checkpoint", "metrics.jsonl",
            "eval.json", "confusion.png", "loss.png", "attention.png"} <= {p.name for p in run_dir.iterdir()}
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["family"] == "vit" and cfg["data"]["classes"] == [str(i) for i in range(10)]
    assert (cfg["model"]["image_size"], cfg["model"]["channels"], cfg["model"]["n_classes"]) == (8, 1, 10)
    # eval.json agrees with an independent recount from the saved weights
    ev = json.loads((run_dir / "eval.json").read_text())
    run = ViTFamily().load(run_dir)
    model, info = run.model, {"classes": run.classes, "mean": run.mean, "std": run.std}
    data = _test_split()
    preds = predict(model, data.test_x, info["mean"], info["std"]).argmax(-1)
    acc = float((preds == data.test_y).float().mean())
    assert ev["accuracy"] == pytest.approx(acc) and f"test accuracy {acc:.2%}" in out
    assert acc > 0.8  # 200 steps on 1,237 digits: learnt, not guessed (chance = 10%)
    cm = torch.tensor(ev["confusion"])
    assert int(cm.sum()) == 360 and int(cm.trace()) == int((preds == data.test_y).sum())
    for name in ("confusion.png", "attention.png", "loss.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG


def test_vit_resume_continues(vit_run, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(vit_run[0], run)
    rc, out, err = call(["train", "vit", "--resume", str(run), "--max_iters", "210", "--no-progress"])
    assert rc == 0, out + err
    steps = [r["step"] for r in metrics(run)]
    assert steps[-1] == 210 and "trained 210 steps" in out


def test_resume_with_the_wrong_family(vit_run) -> None:
    rc, _, err = call(["train", "gpt", "--resume", str(vit_run[0])])
    line = assert_one_line_error(rc, err)
    assert "vit run" in line and "qkv train vit --resume" in line


def _save_digit(path: Path, index: int = 0) -> tuple[torch.Tensor, int]:
    from PIL import Image

    data = _test_split()
    x = data.test_x[index]
    Image.fromarray(x[0].numpy()).save(path)
    return x, int(data.test_y[index])


def test_classify_matches_the_model(vit_run, tmp_path: Path) -> None:
    run_dir = vit_run[0]
    x, _ = _save_digit(tmp_path / "d.png")
    rc, out, err = call(["classify", str(run_dir), str(tmp_path / "d.png"), "--top", "4", "--json"])
    assert rc == 0, err
    [result] = json.loads(out)
    run = ViTFamily().load(run_dir)
    model, info = run.model, {"classes": run.classes, "mean": run.mean, "std": run.std}
    probs = predict(model, x[None], info["mean"], info["std"])[0]
    top = torch.topk(probs, 4)
    assert [t["class"] for t in result["top"]] == [info["classes"][int(i)] for i in top.indices]
    np.testing.assert_allclose([t["probability"] for t in result["top"]], top.values.numpy(), rtol=1e-5)
    rc, out, _ = call(["classify", str(run_dir), str(tmp_path / "d.png")])
    assert rc == 0 and f"{top.values[0]:.2%}" in out


def test_classify_converts_other_sizes_and_modes(vit_run, tmp_path: Path) -> None:
    from PIL import Image

    Image.fromarray(np.full((32, 24, 3), 128, dtype=np.uint8)).save(tmp_path / "big.jpg")
    rc, _, err = call(["classify", str(vit_run[0]), str(tmp_path / "big.jpg"), "--top", "1"])
    assert rc == 0, err
    assert "converted RGB to grey" in err and "resized 24x32 to 8x8" in err


def test_classify_errors(vit_run, trained_gpt_like, tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    rc, _, err = call(["classify", str(vit_run[0]), str(tmp_path / "bad.png")])
    assert "bad.png is not a readable image" in assert_one_line_error(rc, err)
    rc, _, err = call(["classify", str(trained_gpt_like), str(tmp_path / "bad.png")])
    assert "is a gpt run" in assert_one_line_error(rc, err)
    rc, _, err = call(["classify", str(tmp_path / "nowhere"), str(tmp_path / "bad.png")])
    assert "not a directory" in assert_one_line_error(rc, err)
    rc, _, err = call(["classify", str(vit_run[0]), str(tmp_path / "bad.png"), "--top", "0"])
    assert "--top" in assert_one_line_error(rc, err)


@pytest.fixture
def trained_gpt_like(tmp_path: Path) -> Path:
    """A directory whose config.json says family gpt (all the family check reads)."""
    d = tmp_path / "gptrun"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"family": "gpt", "model": {}, "train": {}, "data": {}}))
    return d


def test_attend_writes_overlays(vit_run, tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    _save_digit(tmp_path / "d.png", 3)
    out_png = tmp_path / "att.png"
    rc, out, err = call(["attend", str(vit_run[0]), str(tmp_path / "d.png"), "-o", str(out_png),
                         "--layer", "0"])
    assert rc == 0, err
    img = mpimg.imread(out_png)
    # one image panel + 4 heads + rollout in one row, 2.2 x 2.4 inches each at 120 dpi
    assert img.shape[:2] == (round(2.4 * 120), round(6 * 2.2 * 120))
    assert "rollout peaks at patch row" in out and "layer 0" not in err


def test_attend_errors(vit_run, trained_gpt_like, tmp_path: Path) -> None:
    _save_digit(tmp_path / "d.png")
    rc, _, err = call(["attend", str(vit_run[0]), str(tmp_path / "d.png"), "--layer", "5",
                       "-o", str(tmp_path / "a.png")])
    assert "--layer must be in [-2, 1]" in assert_one_line_error(rc, err)
    rc, _, err = call(["attend", str(trained_gpt_like), str(tmp_path / "d.png")])
    assert "gpt run" in assert_one_line_error(rc, err)
    rc, _, err = call(["attend", str(vit_run[0]), str(tmp_path / "d.png"), "-o", str(tmp_path / "a.jpg")])
    assert ".png" in assert_one_line_error(rc, err)


def test_train_vit_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, _, err = call(["train", "vit", "--preset", "tiny", "--patch_size", "3",
                       "--out_dir", str(tmp_path / "r1")])
    assert "--patch_size 2 or 4 or 8" in assert_one_line_error(rc, err)
    assert not (tmp_path / "r1").exists()
    (tmp_path / "one" / "cls").mkdir(parents=True)
    rc, _, err = call(["train", "vit", "--preset", "tiny", "--dataset", str(tmp_path / "one"),
                       "--out_dir", str(tmp_path / "r2")])
    assert "no images" in assert_one_line_error(rc, err)
    import qkv.assets

    monkeypatch.setattr(qkv.assets, "_files", lambda asset: None)  # as if nothing were installed
    rc, _, err = call(["train", "vit", "--preset", "tiny", "--dataset", "mnist",
                       "--out_dir", str(tmp_path / "r3")])
    assert "qkv assets install mnist" in assert_one_line_error(rc, err)
    rc, _, err = call(["train", "vit", "--dataset", "fashion-mnist", "--out_dir", str(tmp_path / "r4")])
    assert "qkv assets install fashion-mnist" in assert_one_line_error(rc, err)


def test_train_help_lists_the_families() -> None:
    rc, out, _ = call(["train", "--help"])
    assert rc == 0 and "gpt" in out and "vit" in out
    rc, out, _ = call(["train", "vit", "--help"])
    assert rc == 0
    for option in ("--dataset", "--patch_size", "--read_out", "--positions", "--shift", "--flip",
                   "--lr", "fashion-cpu"):
        assert option in out
    assert "--n_classes" not in out and "--channels" not in out


def test_train_vit_under_torchrun(tmp_path: Path) -> None:
    """The ViT job inherits DDP from the shared Trainer: 2 gloo processes, rank 0 writes."""
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "qkv", "train", "vit",
           "--preset", "tiny", "--max_iters", "6", "--eval_interval", "3", "--out_dir", str(run),
           "--no-progress"]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x 2 processes" in proc.stdout and proc.stdout.count("test accuracy") == 1
    steps = [r["step"] for r in metrics(run)]
    assert steps == sorted(steps) and steps[-1] == 6  # one writer: no interleaved duplicates
    assert json.loads((run / "eval.json").read_text())["n"] == 360


def test_the_default_preset_runs_a_few_steps(tmp_path) -> None:
    """`qkv train vit` with the fashion-cpu preset's choices (a convolutional stem 32 wide with a
    stride-1 convolution, label smoothing, flips), shortened and on the digits: they reach
    config.json as the preset says."""
    run = tmp_path / "run"
    rc, _, err = call(["train", "vit", "--dataset", "digits", "--patch_size", "4", "--max_iters", "3",
                       "--eval_interval", "3", "--eval_iters", "1", "--compile", "false", "--dtype", "fp32",
                       "--erase", "0.5", "--out_dir", str(run), "--no-progress"])
    assert rc == 0, err
    cfg = json.loads((run / "config.json").read_text())
    model = cfg["model"]
    assert (model["stem"], model["stem_width"], model["stem_refine"], model["patch_overlap"],
            model["label_smoothing"]) == ("conv", 32, 1, 0, 0.1)
    assert (cfg["data"]["flip"], cfg["data"]["erase"]) == (True, 0.5)
    assert 0 <= json.loads((run / "eval.json").read_text())["accuracy"] <= 1
    # the conv stem's tokens are still one per patch cell: the maps and the rollout are drawn
    import matplotlib.image as mpimg

    assert (run / "attention.png").is_file()
    _save_digit(tmp_path / "d.png", 3)
    rc, out, err = call(["attend", str(run), str(tmp_path / "d.png"), "-o", str(tmp_path / "att.png")])
    assert rc == 0, err
    img = mpimg.imread(tmp_path / "att.png")
    assert img.shape[:2] == (round(2.4 * 120), round(6 * 2.2 * 120))  # image + 4 heads + rollout
    assert "rollout peaks at patch row" in out
