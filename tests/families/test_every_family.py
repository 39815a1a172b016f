"""Every registered family, end to end, the same from Python as from the command line: train the
tiny preset with ``train_run`` and with ``qkv train`` (the session's tiny runs, which every tool's
tests read), then load, decode/predict and attend each run both ways. Same seed and settings, so
the two runs must agree bit for bit: weights, ``eval.json``, outputs and attention pictures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_STEPS, TINY_TRAIN, call, single_thread, tiny_data, tiny_train
from PIL import Image
from safetensors.torch import load_file

from qkv.families import get_family
from qkv.inference import open_model
from qkv.pipelines import attention as sources
from qkv.presets import PresetChoice, get_preset, preset_train
from qkv.training.run import train_run
from qkv.training.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("gpt", "vit", "seq2seq", "captioner")
# The session's tiny runs (tests/conftest.py's tiny_run) are the CLI's runs; the Python runs get
# the same settings (tests/helpers.py): fixed choices, so the two cannot choose differently.
TRAIN, STEPS = TINY_TRAIN, TINY_STEPS


@pytest.fixture(scope="module")
def runs(tiny_run, tmp_path_factory):
    """family -> (Python run dir, CLI run dir, the Python Run, CLI stdout). The CLI run is the
    session's ``qkv train FAMILY --preset tiny ...``; the Python one is trained here the same way
    (one thread, as the CLI's: config.json records the threads, and they may change the sums)."""
    root = tmp_path_factory.mktemp("families")
    made = {}
    for name in FAMILIES:
        cli_dir = tiny_run(name)  # first: skips the ViT without scikit-learn
        f = get_family(name)
        preset = get_preset(name, "tiny")
        data = tiny_data(name, tiny_run.root)  # the same text file: config.json records its path
        py_dir = root / f"{name}-py"
        with single_thread(root / "cache"):
            run = train_run(f, f.model_config(**f.draft_model(dict(preset["model"]))),
                            TrainConfig(**{**preset_train(preset, "adamw"), **tiny_train(name),
                                           "out_dir": str(py_dir)}),
                            f.data_config(**{**preset.get("data", {}), **data}),
                            preset=PresetChoice("tiny", None, ""))  # what the CLI records of --preset tiny
        made[name] = (py_dir, cli_dir, run, tiny_run.stdout(name))
    return made


def _eval(run_dir: Path) -> dict:
    ev = json.loads((run_dir / "eval.json").read_text())
    ev.pop("train_seconds")
    return ev


@pytest.mark.parametrize("name", FAMILIES)
def test_python_and_cli_runs_are_the_same_run(runs, name: str) -> None:
    py_dir, cli_dir, run, out = runs[name]
    a, b = load_file(str(py_dir / "model.safetensors")), load_file(str(cli_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"
    assert _eval(py_dir) == _eval(cli_dir)  # eval.json either way, with the same numbers
    assert run.eval is not None  # what train_run returns is what it wrote
    returned = {k: v for k, v in run.eval.items() if k != "train_seconds"}
    assert json.loads(json.dumps(returned)) == _eval(py_dir)
    assert _eval(py_dir)["steps"] == {**TRAIN, **STEPS.get(name, {})}["max_iters"]
    files = {p.name for p in py_dir.iterdir()}
    assert files == {p.name for p in cli_dir.iterdir()} and "loss.png" in files
    for path in run.files.values():  # what the Python run says it wrote, the CLI printed too
        assert path.is_file() and path.name in out
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (py_dir, cli_dir))
    cfg_a["train"].pop("out_dir"), cfg_b["train"].pop("out_dir")
    assert cfg_a == cfg_b


def test_gpt_eval_is_the_cross_entropy_of_fixed_windows(runs) -> None:
    """The GPT's eval.json val_loss, recomputed with F.cross_entropy on the windows it names."""
    py_dir, _, run, _ = runs["gpt"]
    x, y = run.prepared.batches.get_batch("val", 64, torch.Generator().manual_seed(0))
    model = get_family("gpt").load(py_dir).model
    with torch.no_grad():
        logits = model(x).logits.double()
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert _eval(py_dir)["val_loss"] == pytest.approx(expected, rel=1e-5)


def _image(run, path: Path) -> Path:
    if run.family == "vit":
        img = run.prepared.state.test_x[0]  # uint8 (C, H, W)
    else:
        from qkv.data.shapes import make_scene

        img = torch.from_numpy(make_scene(random.Random(3)).image).permute(2, 0, 1)
    arr = img.permute(1, 2, 0).numpy()
    Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(path)
    return path


@pytest.mark.parametrize("name", FAMILIES)
def test_load_decode_attend_the_same_from_python_and_cli(runs, name: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    py_dir, cli_dir, run, _ = runs[name]
    f = get_family(name)
    loaded = f.load(py_dir)
    if name == "gpt":
        from qkv.generation import generate

        tok = loaded.tokenizer
        ids = torch.tensor([tok.encode("ROMEO")])
        new = [int(t[0]) for t in generate(loaded.model, ids, 8, temperature=0.0)]
        for d in (py_dir, cli_dir):
            rc, out, err = call(["generate", str(d), "--prompt", "ROMEO", "--max-new-tokens", "8",
                                 "--temperature", "0"])
            assert rc == 0, err
            assert out.rstrip("\n") == "ROMEO" + tok.decode(new)
        what, reading = "ROMEO: But soft", sources.text_attention
    elif name == "vit":
        from qkv.families.vit import predict

        image = _image(run, tmp_path / "x.png")
        x = open_model(py_dir).read_image(image)[0]
        probs = predict(loaded.model, x[None], loaded.mean, loaded.std)[0]
        for d in (py_dir, cli_dir):
            rc, out, err = call(["classify", str(d), str(image), "--json", "--top", "3"])
            assert rc == 0, err
            top = torch.topk(probs, 3)
            got = json.loads(out)[0]["top"]
            assert [t["class"] for t in got] == [loaded.classes[int(i)] for i in top.indices]
            np.testing.assert_allclose([t["probability"] for t in got], top.values.numpy(), rtol=1e-5)
        what, reading = str(image), lambda m, path: m.attention(m.read_image(path)[0])
    elif name == "seq2seq":
        from qkv.families.seq2seq import decode_texts

        [expected], _ = decode_texts(loaded.model, loaded.cfg, loaded.src, loaded.tgt, ["8 août 1977"])
        for d in (py_dir, cli_dir):
            rc, out, err = call(["translate", str(d), "8 août 1977", "--json"])
            assert rc == 0, err
            assert json.loads(out) == [{"input": "8 août 1977", "output": expected}]
        what, reading = "8 août 1977", lambda m, text: m.alignment(text)
    else:
        from qkv.families.captioner import decode_captions

        image = _image(run, tmp_path / "x.png")
        x = open_model(py_dir).read_image(image)[0]
        toks, _ = decode_captions(loaded.model, x[None], loaded.max_len)
        for d in (py_dir, cli_dir):
            rc, out, err = call(["caption", str(d), str(image)])
            assert rc == 0, err
            assert out.rstrip("\n") == f"{image}: {loaded.vocab.decode(toks[0])}"
        what, reading = str(image), lambda m, path: m.attention(m.read_image(path)[0])
    # attention: the same numbers from both runs (Python), the same picture (CLI)
    a, b = (reading(open_model(d), what) for d in (py_dir, cli_dir))
    wa = [a.weights] if hasattr(a, "weights") else [m for _, m in a.maps]
    wb = [b.weights] if hasattr(b, "weights") else [m for _, m in b.maps]
    assert len(wa) == len(wb) > 0 and all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
    pngs, said = [], []
    for d in (py_dir, cli_dir):  # under one name, as titles show it
        (tmp_path / d.name).mkdir()
        (tmp_path / d.name / "run").symlink_to(d)
        monkeypatch.chdir(tmp_path / d.name)
        rc, out, err = call(["attend", "run", what, "--out", "attention.png"])
        assert rc == 0, err
        pngs.append((tmp_path / d.name / "attention.png").read_bytes())
        said.append(out)
    assert pngs[0] == pngs[1] and said[0] == said[1]
