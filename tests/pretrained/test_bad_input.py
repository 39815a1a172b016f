"""Failures a user can cause with pretrained models: damaged or missing files, missing assets,
prompts that do not fit the context. Each ends in one exception whose message names the
problem and the fix (DESIGN.md), never a numpy or safetensors traceback.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import byte_lm

import qkv
from qkv import assets
from qkv.assets import AssetMissingError, asset_path
from qkv.pipelines import CausalLM
from qkv.pretrained import PretrainedFormatError
from qkv.pretrained.gguf_models import load_gguf_decoder as load_smollm2
from qkv.pretrained.minilm import load_minilm

MB = 1 << 20
GGUF_FIX = r"complete .*GGUF file|qkv assets install smollm2"


# --------------------------------------------------------------------------- missing assets


@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_missing_asset_names_the_install_command(name: str, monkeypatch) -> None:
    # The asset's package "is not installed": its module cannot be found.
    absent = dataclasses.replace(assets.ASSETS[name], module="qkv_test_no_such_module")
    monkeypatch.setitem(assets.ASSETS, name, absent)
    with pytest.raises(AssetMissingError, match=f"qkv assets install {name}"):
        asset_path(name)
    with pytest.raises(AssetMissingError, match=f"qkv assets install {name}"):
        qkv.load(name)


def test_unknown_model_and_dtype_are_value_errors() -> None:
    with pytest.raises(ValueError, match="minilm, smollm2"):
        qkv.load("gpt-5")
    with pytest.raises(ValueError, match="bfloat16"):
        qkv.load("minilm", dtype="float16")


# --------------------------------------------------------------------------- GGUF


def test_truncated_gguf(smollm2_file, tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    with open(smollm2_file, "rb") as f:
        bad.write_bytes(f.read(MB))  # the first 1 MB: the header, cut inside the vocabulary
    with pytest.raises(PretrainedFormatError) as e:
        load_smollm2(bad)
    msg = str(e.value)
    assert str(bad) in msg and re.search(r"damaged|truncated", msg)
    assert re.search(GGUF_FIX, msg)
    assert "Traceback" not in msg


@pytest.mark.parametrize("content", [b"GGML" + b"\0" * 64, b"PK\x03\x04 a zip file", b"GG", b""],
                         ids=["ggml", "zip", "short", "empty"])
def test_wrong_magic(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(PretrainedFormatError, match="not a GGUF file") as e:
        load_smollm2(bad)
    assert str(bad) in str(e.value) and re.search(GGUF_FIX, str(e.value))


def test_gguf_not_found(tmp_path: Path) -> None:
    with pytest.raises(PretrainedFormatError, match="not found"):
        load_smollm2(tmp_path / "nope.gguf")


def test_damaged_installed_gguf_says_reinstall(tmp_path: Path, monkeypatch) -> None:
    """When the installed asset itself is damaged, the fix is to reinstall it."""
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    monkeypatch.setattr(assets, "asset_path", lambda name: bad)
    with pytest.raises(PretrainedFormatError, match="qkv assets install smollm2"):
        qkv.load("smollm2")


# --------------------------------------------------------------------------- MiniLM folder


@pytest.fixture
def minilm_copy(minilm_folder, tmp_path: Path) -> Path:
    """The MiniLM folder copied with every file except model.safetensors (tests write their own)."""
    out = tmp_path / "minilm"
    shutil.copytree(minilm_folder, out, ignore=shutil.ignore_patterns("model.safetensors"))
    return out


def test_truncated_safetensors(minilm_folder, minilm_copy: Path) -> None:
    with open(minilm_folder / "model.safetensors", "rb") as f:
        (minilm_copy / "model.safetensors").write_bytes(f.read(MB))
    with pytest.raises(PretrainedFormatError, match="qkv assets install minilm") as e:
        load_minilm(minilm_copy)
    assert "safetensors" in str(e.value) and str(minilm_copy) in str(e.value)
    with pytest.raises(PretrainedFormatError, match="qkv assets install minilm"):
        qkv.load("minilm", path=str(minilm_copy))


@pytest.mark.parametrize("content", [b"", b"\x00" * 100, b"not safetensors at all"],
                         ids=["empty", "zeros", "text"])
def test_garbage_safetensors(minilm_copy: Path, content: bytes) -> None:
    (minilm_copy / "model.safetensors").write_bytes(content)
    with pytest.raises(PretrainedFormatError, match="qkv assets install minilm"):
        load_minilm(minilm_copy)


def test_missing_safetensors(minilm_copy: Path) -> None:
    with pytest.raises(PretrainedFormatError, match=r"not found.*qkv assets install minilm"):
        load_minilm(minilm_copy)


def test_corrupt_config_json(minilm_copy: Path) -> None:
    (minilm_copy / "config.json").write_text("{", encoding="utf-8")
    with pytest.raises(PretrainedFormatError, match=r"config\.json.*qkv assets install minilm"):
        load_minilm(minilm_copy)


def test_corrupt_tokenizer_json(minilm_folder, minilm_copy: Path) -> None:
    (minilm_copy / "model.safetensors").symlink_to(minilm_folder / "model.safetensors")
    (minilm_copy / "tokenizer.json").write_text("{", encoding="utf-8")
    with pytest.raises(PretrainedFormatError, match="qkv assets install minilm"):
        load_minilm(minilm_copy)


def test_config_that_does_not_fit_the_weights(minilm_folder, minilm_copy: Path) -> None:
    (minilm_copy / "model.safetensors").symlink_to(minilm_folder / "model.safetensors")
    config = json.loads((minilm_copy / "config.json").read_text(encoding="utf-8"))
    config["intermediate_size"] = 1000  # the checkpoint's FFN is 1536 wide
    (minilm_copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(PretrainedFormatError, match="qkv assets install minilm"):
        load_minilm(minilm_copy)


# --------------------------------------------------------------------------- prompts vs context

W = 16  # the tiny model's context


@pytest.fixture(scope="module")
def tiny_lm() -> CausalLM:
    """A CausalLM around a tiny random GPT (context 16) and a byte tokenizer (helpers.byte_lm)."""
    return byte_lm(W)


def _count_steps(lm: CausalLM, prompt: str, max_new_tokens: int, use_cache: bool) -> int:
    """Number of decoding steps (one model call each) that generate() runs."""
    calls = []
    handle = lm.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        lm.generate(prompt, max_new_tokens, use_cache=use_cache, seed=0)
    finally:
        handle.remove()
    return len(calls)


def test_tiny_tokenizer_is_one_token_per_byte(tiny_lm: CausalLM) -> None:
    assert len(tiny_lm.tokenizer.encode("abcde")) == 5
    assert len(tiny_lm.tokenizer.encode("x" * W)) == W


@pytest.mark.parametrize("n", [W, W + 1, 3 * W])
def test_prompt_longer_than_the_context(tiny_lm: CausalLM, n: int) -> None:
    with pytest.raises(ValueError, match=rf"prompt has {n} tokens.*at most {W - 1}.*shorten"):
        tiny_lm.generate("x" * n, 4)


def test_prompt_filling_the_context_but_one_gets_one_token(tiny_lm: CausalLM) -> None:
    assert _count_steps(tiny_lm, "x" * (W - 1), 10, use_cache=True) == 1


def test_empty_prompt(tiny_lm: CausalLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny_lm.generate("", 4)
    with pytest.raises(ValueError, match="empty"):
        list(tiny_lm.stream("", 4))


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("max_new", [W - 5, 100, 10_000])
def test_max_new_tokens_is_bounded_by_the_context(tiny_lm: CausalLM, use_cache: bool, max_new: int) -> None:
    """A 5-token prompt in a 16-token context: at most 11 new tokens, whatever is asked."""
    assert _count_steps(tiny_lm, "abcde", max_new, use_cache) == W - 5


def test_negative_max_new_tokens_and_missing_chat_template(tiny_lm: CausalLM) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_lm.generate("abc", -1)
    assert tiny_lm.generate("abc", 0) == ""
    with pytest.raises(ValueError, match="no chat template"):
        tiny_lm.generate("abc", 4, chat=True)
