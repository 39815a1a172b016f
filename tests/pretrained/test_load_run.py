"""qkv.load(RUN_DIR): a run directory from `qkv train` loads by its family, as `qkv generate` and
`qkv attend` load it. The reference is the run's own files read plainly (config.json's model
options into a GPTConfig, model.safetensors by safetensors) and the `qkv generate` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import call
from safetensors.torch import load_file, load_model

import qkv
from qkv.models.gpt import GPT, GPTConfig
from qkv.pipelines import CausalLM


def _plain_gpt(run: Path) -> GPT:
    model = GPT(GPTConfig(**json.loads((run / "config.json").read_text())["model"]))
    load_model(model, str(run / "model.safetensors"))  # a tied embedding is stored once
    return model.eval()


def test_a_gpt_run_is_a_causal_lm(tiny_run) -> None:
    run = tiny_run("gpt")
    lm = qkv.load(run)
    assert isinstance(lm, CausalLM) and lm.name == "gpt-tiny" and lm.stop_ids == ()  # characters: no end
    ref = _plain_gpt(run)
    x = torch.tensor([lm.tokenizer.encode("ROMEO: O")])
    with torch.no_grad():
        assert torch.equal(lm.model(x).logits, ref(x).logits)
    rc, out, err = call(["generate", str(run), "--prompt", "ROMEO: O", "--temperature", "0",
                         "--max-new-tokens", "12"])
    assert rc == 0, err
    assert out == "ROMEO: O" + lm.generate("ROMEO: O", 12) + "\n"  # greedy, as the command
    assert qkv.load(str(run), weights="int8").weights == "int8"
    assert qkv.load(run, cache=False).name == "gpt-tiny"  # qkv.pretrained.load's keywords too
    with pytest.raises(ValueError, match="path= is for the named models"):
        qkv.load(run, path="elsewhere")
    assert lm.to("bfloat16").model.lm_head.weight.dtype == torch.bfloat16


def test_a_run_of_another_family_is_its_loaded_run(tiny_run) -> None:
    run = tiny_run("vit")
    loaded = qkv.load(run)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["family"] == "vit" and type(loaded).__name__ == "ImageClassifier"
    weights = load_file(str(run / "model.safetensors"))
    ours = loaded.model.state_dict()
    assert weights.keys() == ours.keys() and all(torch.equal(weights[k], ours[k]) for k in weights)
    with pytest.raises(ValueError, match="dtype= and weights= are for GPT runs"):
        qkv.load(run, dtype="bfloat16")


def test_a_folder_that_is_neither_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"family": "nonsense"}')
    with pytest.raises(ValueError, match="family 'nonsense', which this qkv does not know"):
        qkv.load(tmp_path)
    (tmp_path / "config.json").write_text('{"dim": 3}')
    with pytest.raises(ValueError, match="neither a qkv family nor a Hugging Face model_type"):
        qkv.load(tmp_path)
