"""Adding a model family is one file plus one registry line: a toy fifth family, written here
the way ARCHITECTURE.md tells a newcomer to, trains with `qkv train toy`, writes eval.json,
resumes, loads, and shows its attention with `qkv attend`, without a change anywhere else."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from helpers import call

from qkv import families
from qkv.families.base import FamilyBase
from qkv.models.gpt import GPT, GPTConfig
from qkv.pipelines import CausalLM
from qkv.training import checkpoint as ckpt
from qkv.training.run import Prepared

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the family's own file


@dataclass
class CountingData:
    """Digits counting up, 0123456789012...: the next digit is always knowable."""

    n_chars: int = 3000


class ToyFamily(FamilyBase):
    name, kind, unit = "toy", "decoder", "tok"
    help = "a GPT that learns to count (a test's toy family)"
    description = "Train a one-layer GPT on digits counting up."
    model_config, data_config, from_data = GPTConfig, CountingData, ("vocab_size",)
    default_preset = "tiny"
    presets: ClassVar[dict] = {"tiny": {"model": {"n_layers": 1, "dim": 16, "n_heads": 2, "max_seq_len": 16},
                        "train": {"batch_size": 8, "max_iters": 30, "eval_interval": 15, "eval_iters": 2,
                                  "lr": 3e-3, "warmup_iters": 2, "dtype": "fp32", "compile": False,
                                  "optimizer": "adamw"}}}

    def prepare(self, model_cfg, data_cfg, resume_dir, on_note) -> Prepared:
        from qkv.data.corpora import TokenBatches
        from qkv.tokenizers import CharTokenizer, save_tokenizer

        text = "".join(str(i % 10) for i in range(data_cfg.n_chars))
        tok = CharTokenizer(text)
        ids = torch.tensor(tok.encode(text)).numpy()
        cut = int(len(ids) * 0.9)
        return Prepared(replace(model_cfg, vocab_size=tok.vocab_size),
                        TokenBatches(ids[:cut], ids[cut:], model_cfg.max_seq_len), tok,
                        save=lambda d: save_tokenizer(tok, d / "tokenizer.json"),
                        items_per_row=model_cfg.max_seq_len)

    def build(self, model_cfg) -> GPT:
        return GPT(model_cfg)

    @torch.no_grad()
    def evaluate(self, model, prepared) -> dict:
        x, y = prepared.batches.get_batch("val", 32, torch.Generator().manual_seed(0))
        return {"next_digit_accuracy": float((model(x).logits.argmax(-1) == y).float().mean())}

    def headline(self, model_cfg, data_cfg) -> str:
        return f"{data_cfg.n_chars} digits"

    def summary(self, run, args=None) -> str:
        return f"next-digit accuracy {run.eval['next_digit_accuracy']:.0%}"

    def load(self, run_dir: Path, device: str = "cpu") -> CausalLM:
        from qkv.tokenizers import load_tokenizer

        cfg = ckpt.read_run_config(Path(run_dir), "toy", "a counting GPT")
        model = GPT(GPTConfig(**cfg["model"]))
        ckpt.load_weights(model, Path(run_dir) / "model.safetensors")
        tok = load_tokenizer(Path(run_dir) / "tokenizer.json")
        return CausalLM(Path(run_dir).name, model.eval(), tok, run_dir=Path(run_dir))


# --------------------------------------------------------------------------- the one registry line


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(families._registered, "toy", ToyFamily())  # families.register(ToyFamily())


def test_a_fifth_family_trains_loads_and_attends_through_the_cli(toy, tmp_path: Path) -> None:
    rc, out, err = call(["train", "--help"])
    assert rc == 0 and "toy" in out
    run = tmp_path / "toy-run"
    rc, out, err = call(["train", "toy", "--out_dir", str(run), "--no-progress"])
    assert rc == 0, err
    ev = json.loads((run / "eval.json").read_text())
    assert ev["steps"] == 30 and ev["next_digit_accuracy"] > 0.9  # chance: 10%
    assert f"next-digit accuracy {ev['next_digit_accuracy']:.0%}" in out
    assert json.loads((run / "config.json").read_text())["family"] == "toy"

    rc, out, err = call(["train", "toy", "--resume", str(run), "--max_iters", "40", "--no-progress"])
    assert rc == 0, err
    assert json.loads((run / "eval.json").read_text())["steps"] == 40

    from qkv.inference import open_model, resolve
    from qkv.pipelines import attention as sources

    ref = resolve(run)
    src = open_model(ref)
    assert (ref.label, src.kind, src.n_layers, src.n_heads, src.context) == ("toy", "decoder", 1, 2, 16)
    att = sources.text_attention(src, "0123456")
    torch.testing.assert_close(att.weights.sum(-1), torch.ones(1, 2, 7))
    steps = list(sources.generate_steps(src, src.tokenizer.encode("0123"), 6))
    assert "".join(s.token for s in steps) == "456789"  # it learnt to count
    rc, out, err = call(["attend", str(run), "0123456", "--out", str(tmp_path / "a.png")])
    assert rc == 0 and (tmp_path / "a.png").is_file(), err
