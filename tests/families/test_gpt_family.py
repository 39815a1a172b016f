"""`qkv train` and `qkv generate` end to end: --help generated from the config dataclasses,
one-line errors with exit code 2, a tiny run with its sample and plots, reproducible and
cache-independent generation, damaged run directories, and --resume."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PNG, assert_one_line_error, call, call_one_thread, metrics
from helpers import TINY_TEXT as TEXT

from qkv.families.gpt import LMDataConfig
from qkv.models.gpt import GPTConfig
from qkv.presets import GPT_PRESETS
from qkv.training.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """`qkv train --preset tiny --max_iters 20 ...` once for the module: (run_dir, stdout). Its
    own run, not the session's tiny one: the tests below read what this command printed, its
    20 steps and its choices left to the machine (dtype, device), and resume it to 30."""
    root = tmp_path_factory.mktemp("cli")
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    run_dir = root / "run"
    rc, out, err = call_one_thread(["train", "--preset", "tiny", "--max_iters", "20", "--data", str(text),
                                    "--out_dir", str(run_dir), "--compile", "false", "--no-progress"],
                                   root / "token-cache")
    assert rc == 0, out + err
    return run_dir, out


@pytest.fixture
def run_copy(trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the trained run (for tests that change it)."""
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "token-cache"))
    dst = tmp_path / "run"
    shutil.copytree(trained[0], dst)
    return dst


# --------------------------------------------------------------------------- parsing


def test_train_help_lists_every_field_and_preset() -> None:
    rc, out, _ = call(["train", "gpt", "--help"])
    assert rc == 0
    for cls in (GPTConfig, TrainConfig, LMDataConfig):
        for f in dataclasses.fields(cls):
            if f.name != "vocab_size":  # set from the tokenizer, not an option
                assert f"--{f.name}" in out, f.name
    assert "--vocab_size" not in out
    for name in GPT_PRESETS:
        assert name in out
    assert "context length in tokens" in out  # the field comments are the help text
    assert "--resume" in out


def test_unknown_preset_is_one_line() -> None:
    rc, _, err = call(["train", "--preset", "nosuch"])
    line = assert_one_line_error(rc, err)
    assert "nosuch" in line and "tiny" in line


def test_invalid_model_config_names_the_field(tmp_path: Path) -> None:
    rc, _, err = call(["train", "--preset", "tiny", "--dim", "30", "--n_heads", "4",
                       "--out_dir", str(tmp_path / "run")])
    line = assert_one_line_error(rc, err)
    assert "dim" in line and "30" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["--lr", "abc"], ["--positions", "absolute"],
                                  ["--compile", "maybe"], ["--max_iters", "1.5"]])
def test_bad_option_values_are_argparse_errors(argv: list[str]) -> None:
    rc, _, err = call(["train", "--preset", "tiny", *argv])
    assert rc == 2
    assert f"qkv train gpt: error: argument {argv[0]}" in err and "Traceback" not in err


def test_dash_and_underscore_spellings_are_the_same_option(tmp_path: Path) -> None:
    for flag in ("--max-seq-len", "--max_seq_len"):
        rc, _, err = call(["train", "--preset", "tiny", flag, "0", "--out_dir", str(tmp_path)])
        assert "max_seq_len" in assert_one_line_error(rc, err)


# --------------------------------------------------------------------------- training


def test_train_end_to_end(trained) -> None:
    run_dir, out = trained
    assert {"config.json", "model.safetensors", "checkpoint",
            "tokenizer.json", "metrics.jsonl", "loss.png", "attention.png"} <= {
        p.name for p in run_dir.iterdir()}
    assert "--- sample" in out
    sample = out.split("--- sample (temperature 0.8, top-k 200) ---", 1)[1].split("\n---", 1)[0]
    assert len(sample) > 100 and set(sample) <= set(TEXT)  # 300 tokens of the corpus's characters
    assert "trained 20 steps" in out
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["model"]["dim"] == GPT_PRESETS["tiny"]["model"]["dim"]
    assert cfg["train"]["max_iters"] == 20 and cfg["train"]["compile"] is False
    # the device *preference* (auto), not what it resolved to here: a resume on a GPU machine,
    # or under torchrun, picks its own device again
    assert cfg["train"]["device"] == "auto"
    steps = [r["step"] for r in metrics(run_dir) if "lr" in r]
    assert steps == list(range(1, 21))


@pytest.mark.parametrize("name", ["loss.png", "attention.png"])
def test_plots_are_valid_pngs(trained, name: str) -> None:
    import matplotlib.image as mpimg

    path = trained[0] / name
    assert path.read_bytes()[:8] == PNG
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.01  # not a blank canvas


def test_resume_continues_from_step_20(run_copy: Path) -> None:
    before = metrics(run_copy)
    rc, out, err = call(["train", "--resume", str(run_copy), "--max_iters", "30", "--no-progress"])
    assert rc == 0, out + err
    new = metrics(run_copy)[len(before):]
    assert [r["step"] for r in new if "lr" in r] == list(range(21, 31))
    # tiny evaluates every 25 steps, and always at the end.
    assert [r["step"] for r in new if r.get("val_loss") is not None] == [25, 30]
    assert "trained 30 steps" in out


def test_resume_of_a_missing_run(tmp_path: Path) -> None:
    rc, _, err = call(["train", "--resume", str(tmp_path / "nowhere")])
    assert "nowhere" in assert_one_line_error(rc, err)


def test_resume_of_a_foreign_directory(tmp_path: Path) -> None:
    """A folder whose config.json is not a qkv run (e.g. a Hugging Face model folder)."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    rc, _, err = call(["train", "--resume", str(tmp_path)])
    assert "config.json" in assert_one_line_error(rc, err)


def test_resume_refuses_model_changes(run_copy: Path) -> None:
    rc, _, err = call(["train", "--resume", str(run_copy), "--dim", "64"])
    assert "dim" in assert_one_line_error(rc, err)


# --------------------------------------------------------------------------- generation


def generate(run_dir: Path, *args: str) -> tuple[int, str, str]:
    return call(["generate", str(run_dir), *args])


def test_seeded_generation_is_reproducible(trained) -> None:
    run_dir = trained[0]
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "1"]
    rc1, out1, _ = generate(run_dir, *args)
    rc2, out2, _ = generate(run_dir, *args)
    assert rc1 == rc2 == 0
    assert out1 == out2 and out1.startswith("ROMEO:") and len(out1) == len("ROMEO:") + 20 + 1
    rc3, out3, _ = generate(run_dir, *args[:-1], "2")
    assert rc3 == 0 and out3 != out1
    # The same through a fresh interpreter: `python -m qkv generate`.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "qkv", "generate", str(run_dir), *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == out1
    assert "tokens in" in proc.stderr


def test_greedy_generation_same_with_and_without_cache(trained) -> None:
    args = ["--prompt", "JULIET: O", "--max-new-tokens", "40", "--temperature", "0"]
    rc1, cached, err = generate(trained[0], *args)
    rc2, uncached, err2 = generate(trained[0], *args, "--no-cache")
    assert rc1 == rc2 == 0
    assert cached == uncached and len(cached) == len("JULIET: O") + 40 + 1
    assert "KV cache" in err and "no cache" in err2


def test_compile_longer_than_its_cache_decodes_eagerly_and_says_so(trained) -> None:
    """The tiny preset's 32-token context is the saved (and the jit-compiled) step's cache:
    9 + 40 tokens do not fit, so the request decodes eagerly (the same tokens), nothing is
    built, and the stats line says so."""
    args = ["--prompt", "JULIET: O", "--max-new-tokens", "40", "--temperature", "0"]
    rc1, eager, _ = generate(trained[0], *args)
    rc2, out, err = generate(trained[0], *args, "--compile")
    assert rc1 == rc2 == 0 and out == eager
    assert "eager: prompt + new tokens exceed the saved step's 32-token cache" in err
    rc3, out, err = generate(trained[0], *args, "--compile", "jit")
    assert rc3 == 0 and out == eager
    assert "eager: prompt + new tokens exceed the compiled step's 32-token cache" in err


def test_long_prompt_is_cropped_with_a_warning(trained) -> None:
    prompt = TEXT[:100]  # the tiny preset's context is 32 tokens
    rc, out, err = generate(trained[0], "--prompt", prompt, "--max-new-tokens", "10",
                            "--temperature", "0")
    assert rc == 0
    assert "warning: prompt has 100 tokens" in err and "keeping the last 31" in err
    rc, short, _ = generate(trained[0], "--prompt", prompt[-31:], "--max-new-tokens", "10",
                            "--temperature", "0")
    assert out[len(prompt):] == short[31:]  # the same continuation as the cropped prompt's


def test_prompt_with_an_unseen_character(trained) -> None:
    rc, _, err = generate(trained[0], "--prompt", "ROMEO: ☃", "--max-new-tokens", "5")
    assert "'☃'" in assert_one_line_error(rc, err)


def test_not_a_run_directory(tmp_path: Path) -> None:
    rc, _, err = generate(tmp_path, "--max-new-tokens", "5")
    assert "config.json" in assert_one_line_error(rc, err)
    rc, _, err = generate(tmp_path / "nowhere", "--max-new-tokens", "5")
    assert "nowhere" in assert_one_line_error(rc, err)


def test_truncated_weights(run_copy: Path) -> None:
    path = run_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    rc, _, err = generate(run_copy, "--max-new-tokens", "5")
    assert "model.safetensors" in assert_one_line_error(rc, err)


def test_negative_token_count(trained) -> None:
    rc, _, err = generate(trained[0], "--max-new-tokens", "-1")
    assert "--max-new-tokens" in assert_one_line_error(rc, err)
