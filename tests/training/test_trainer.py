"""The training loop and the language-model job: the loss goes down, the run directory is
complete, resuming is exact, divergence keeps the last good checkpoint, gradient accumulation
equals a bigger batch, and the errors a user can cause are clear."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import metrics, snapshot
from safetensors.torch import load_file
from torch import nn

from qkv.data.corpora import TokenBatches
from qkv.families import get_family
from qkv.families.gpt import LMDataConfig
from qkv.models.gpt import GPT, GPTConfig
from qkv.presets import get_preset
from qkv.tokenizers import CharTokenizer, load_tokenizer
from qkv.training import checkpoint as ckpt
from qkv.training.run import train_run
from qkv.training.trainer import (
    TrainConfig,
    Trainer,
    TrainingDivergedError,
    TrainingInterruptedError,
)

LINES = [
    "First Citizen: Before we proceed any further, hear me speak.",
    "All: Speak, speak.",
    "First Citizen: You are all resolved rather to die than to famish?",
    "All: Resolved. resolved.",
    "First Citizen: First, you know Caius Marcius is chief enemy to the people.",
    "All: We know't, we know't.",
]
TEXT = "\n".join(LINES[i % len(LINES)] for i in range(60)) + "\n"  # ~2,700 characters
RUN_FILES = {"config.json", "model.safetensors", "checkpoint", "tokenizer.json", "metrics.jsonl",
             "eval.json", "loss.png", "attention.png", "history.jsonl", "heads.png"}


def train_lm(model_cfg, cfg, data, resume: bool = False):
    """(model, tokenizer, result) of the GPT family's run lifecycle."""
    run = train_run(get_family("gpt"), model_cfg, cfg, data, resume=resume)
    return run.model, run.prepared.state.tokenizer, run.result


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture
def text_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "token-cache"))
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def configs(text: Path, out_dir: Path, *, model: dict | None = None, **train):
    """The `tiny` preset, in fp32 eager mode on the CPU, with overrides."""
    preset = get_preset("gpt", "tiny")
    model_cfg = GPTConfig(**{**preset["model"], **(model or {})})
    train_cfg = TrainConfig(**{**preset["train"], "out_dir": str(out_dir), "dtype": "fp32",
                               "compile": False, "device": "cpu", **train})
    return model_cfg, train_cfg, LMDataConfig(data=str(text))


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in metrics(run_dir) if "lr" in r}


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in metrics(run_dir) if r.get("val_loss") is not None}


def random_batches(seed: int = 0, vocab: int = 20, n: int = 2000, block: int = 16) -> TokenBatches:
    g = np.random.default_rng(seed)
    return TokenBatches(g.integers(0, vocab, n).astype(np.uint16),
                        g.integers(0, vocab, n // 4).astype(np.uint16), block)


def small_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**dict(vocab_size=20, max_seq_len=16, dim=32, n_layers=2,
                                   n_heads=4), **kw}))


def train_cfg(out_dir: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(out_dir), batch_size=4, max_iters=10, lr=3e-3, min_lr=3e-4,
                warmup_iters=2, eval_interval=2, eval_iters=2, dtype="fp32", compile=False,
                device="cpu", optimizer="adamw")
    return TrainConfig(**{**base, **kw})


# --------------------------------------------------------------------------- the LM job


@pytest.fixture
def trained(text_file: Path, tmp_path: Path):
    """A 40-step run of the tiny preset on TEXT."""
    model_cfg, cfg, data = configs(text_file, tmp_path / "run", max_iters=40, eval_interval=20)
    model, tok, result = train_lm(model_cfg, cfg, data)
    return tmp_path / "run", model, tok, result


def test_loss_goes_down_and_the_run_dir_is_complete(trained) -> None:
    run_dir, model, tok, result = trained
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES
    val = val_losses(run_dir)
    assert sorted(val) == [0, 20, 40]
    assert val[0] > math.log(tok.vocab_size) - 0.3  # about uniform at the start
    assert val[20] < val[0] - 0.3 and val[40] < val[20]
    train = train_losses(run_dir)
    assert sorted(train) == list(range(1, 41))
    assert np.mean([train[s] for s in range(36, 41)]) < np.mean([train[s] for s in range(1, 6)]) - 0.5
    assert result.step == 40 and result.best_val_loss == pytest.approx(min(val.values()))
    assert result.last_train_loss == pytest.approx(train[40])

    cfg = ckpt.read_json(run_dir / "config.json")
    assert cfg["family"] == "gpt" and cfg["train"]["max_iters"] == 40
    assert cfg["model"]["vocab_size"] == tok.vocab_size == len(set(TEXT))
    assert GPTConfig(**cfg["model"]) == model.cfg
    assert load_tokenizer(run_dir / "tokenizer.json") == CharTokenizer(TEXT)
    assert ckpt.load_state(run_dir / "checkpoint" / "optimizer.pt")["step"] == 40
    best = load_file(str(run_dir / "model.safetensors"))  # what train_lm hands back
    for name, t in model.state_dict().items():
        if name in best:
            assert torch.equal(t, best[name]), name


def test_existing_run_dir_without_resume_is_refused(trained, text_file: Path) -> None:
    run_dir = trained[0]
    before = snapshot(run_dir)
    model_cfg, cfg, data = configs(text_file, run_dir, max_iters=2)
    with pytest.raises(ValueError, match="--resume"):
        train_lm(model_cfg, cfg, data)
    assert snapshot(run_dir) == before  # nothing written, nothing added


@pytest.mark.parametrize(("n_chars", "split"), [(20, "train"), (200, "val")])
def test_text_shorter_than_one_block(tmp_path: Path, text_file: Path, n_chars: int, split: str) -> None:
    text_file.write_text(TEXT[:n_chars], encoding="utf-8")
    model_cfg, cfg, data = configs(text_file, tmp_path / "run", max_iters=2)
    with pytest.raises(ValueError, match=rf"{split} split .* block of 33"):
        train_lm(model_cfg, cfg, data)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_exact(text_file: Path, tmp_path: Path, optimizer: str) -> None:
    # Dropout draws from the global RNG, so this also checks that its state is restored.
    # Muon: its momentum buffers (and AdamW's moments for the embeddings) come back exactly.
    if optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    kw = dict(model={"dropout": 0.1}, lr_decay_iters=12, warmup_iters=4, eval_interval=3,
              optimizer=optimizer)
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    train_lm(*configs(text_file, full_dir, max_iters=12, **kw))
    train_lm(*configs(text_file, part_dir, max_iters=6, **kw))
    assert max(train_losses(part_dir)) == 6
    model_cfg, cfg, data = configs(text_file, part_dir, max_iters=12, **kw)
    train_lm(model_cfg, cfg, data, resume=True)

    full, resumed = train_losses(full_dir), train_losses(part_dir)
    assert sorted(resumed) == list(range(1, 13))  # the resumed run appends steps 7..12
    # ... and metrics.jsonl reads as the uninterrupted run's: the same rows in the same order
    # (the final evaluation of the first part, at step 6, is not written twice)
    def rows(d: Path) -> list[tuple]:
        return [(r["step"], "val_loss" in r) for r in metrics(d)]
    assert rows(part_dir) == rows(full_dir)
    for step in range(1, 13):
        assert resumed[step] == pytest.approx(full[step], rel=0, abs=1e-6), step
    assert val_losses(part_dir)[12] == pytest.approx(val_losses(full_dir)[12], rel=0, abs=1e-6)
    a = load_file(str(full_dir / "checkpoint" / "last.safetensors"))
    b = load_file(str(part_dir / "checkpoint" / "last.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    # And a run that only resumed matches one that never stopped, not a fresh one with
    # different data: the losses after step 6 differ from the first six.
    assert [full[s] for s in range(7, 13)] != [full[s] for s in range(1, 7)]


def test_resuming_a_finished_run_changes_nothing(trained, text_file: Path) -> None:
    run_dir = trained[0]
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=r"has finished \(40 of 40 steps, evaluated\).*--max_iters 80"):
        train_lm(*configs(text_file, run_dir, max_iters=40, eval_interval=20), resume=True)
    assert snapshot(run_dir) == before


def test_resume_refuses_a_changed_text(trained, text_file: Path) -> None:
    """Same characters, other order: the char tokenizer accepts it, the corpus hash does not."""
    run_dir = trained[0]
    before = snapshot(run_dir)
    text_file.write_text("\n".join(reversed(TEXT.splitlines())) + "\n", encoding="utf-8")
    want = hashlib.sha256(text_file.read_bytes()).hexdigest()[:12]
    with pytest.raises(ValueError, match=rf"--data {text_file} now has sha256 {want}…, the run was trained"):
        train_lm(*configs(text_file, run_dir, max_iters=60, eval_interval=20), resume=True)
    assert snapshot(run_dir) == before


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """The third save (step 4) hits ENOSPC writing optimizer.pt: one line naming the fix,
    checkpoint/ holds step 2's files byte for byte, no half-written folder stays; it resumes."""
    import errno

    real, calls = ckpt.save_state, []

    def full_disk(path, state):
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"\0" * 10)  # part of the file got out before the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, state)

    t = Trainer(small_gpt(), train_cfg(tmp_path, max_iters=6), random_batches(), tmp_path)
    real_save = t.save
    kept: dict[str, bytes] = {}

    def save(is_best: bool, val: float | None = None) -> None:
        kept.clear()
        kept.update(snapshot(tmp_path / "checkpoint") if (tmp_path / "checkpoint").is_dir() else {})
        real_save(is_best, val)

    t.save = save
    monkeypatch.setattr(ckpt, "save_state", full_disk)
    with pytest.raises(ckpt.CheckpointError) as e:
        t.fit()
    msg = str(e.value)
    assert "cannot save step 4" in msg and "No space left on device" in msg and "--resume" in msg
    assert "\n" not in msg
    assert kept and snapshot(tmp_path / "checkpoint") == kept  # step 2's set, untouched
    monkeypatch.setattr(ckpt, "save_state", real)
    again = Trainer(small_gpt(seed=5), train_cfg(tmp_path, max_iters=6), random_batches(), tmp_path)
    again.load_resume_state()
    assert again.step == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")]  # cleaned up


def test_ctrl_c_saves_a_resumable_checkpoint(tmp_path: Path) -> None:
    def stop_at_3(rec: dict) -> None:
        if rec.get("lr") is not None and rec["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler only sets a flag

    full = Trainer(small_gpt(), train_cfg(tmp_path / "full", max_iters=6), random_batches(),
                   tmp_path / "full")
    full.fit()
    cut = Trainer(small_gpt(), train_cfg(tmp_path / "cut", max_iters=6), random_batches(),
                  tmp_path / "cut", on_log=stop_at_3)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterruptedError, match="step 3"):
        cut.fit()
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert ckpt.load_state(tmp_path / "cut" / "checkpoint" / "optimizer.pt")["step"] == 3
    again = Trainer(small_gpt(seed=9), train_cfg(tmp_path / "cut", max_iters=6), random_batches(),
                    tmp_path / "cut")
    again.load_resume_state()
    assert again.step == 3
    again.fit()
    for (name, p), q in zip(full.model.named_parameters(), again.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_resume_with_another_optimizer_is_refused_but_auto_follows_the_run(tmp_path: Path) -> None:
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    Trainer(small_gpt(), train_cfg(tmp_path, max_iters=2, optimizer="muon"), random_batches(),
            tmp_path).fit()
    with pytest.raises(ckpt.CheckpointError, match="--optimizer muon"):
        Trainer(small_gpt(), train_cfg(tmp_path, optimizer="adamw"), random_batches(),
                tmp_path).load_resume_state()
    auto = Trainer(small_gpt(), train_cfg(tmp_path, optimizer="auto"), random_batches(), tmp_path)
    auto.load_resume_state()  # whatever auto means on this machine, the run's Muon is kept
    assert auto.optimizer_kind == "muon" and isinstance(auto.optimizers[0], torch.optim.Muon)
    assert auto.optimizers[0].state  # its momentum buffers came back


def test_resume_state_of_another_model_is_a_checkpoint_error(tmp_path: Path) -> None:
    t = Trainer(small_gpt(), train_cfg(tmp_path, max_iters=1), random_batches(), tmp_path)
    t.fit()
    other = Trainer(small_gpt(dim=16, n_heads=2), train_cfg(tmp_path), random_batches(), tmp_path)
    with pytest.raises(ckpt.CheckpointError):
        other.load_resume_state()


# --------------------------------------------------------------------------- divergence


class NaNAfter(nn.Module):
    """A GPT whose training loss turns NaN after ``after`` training forward passes."""

    def __init__(self, inner: GPT, after: int) -> None:
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, x, y):
        out = self.inner(x, y)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                return out._replace(loss=out.loss * float("nan"))
        return out


class SnapshotTrainer(Trainer):
    """Keeps the bytes of model.safetensors as they were right after each save."""

    saved: bytes = b""

    def save(self, is_best: bool, val: float | None = None) -> None:
        super().save(is_best, val)
        self.saved = (self.run_dir / "model.safetensors").read_bytes()


def test_nan_loss_raises_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    model = NaNAfter(small_gpt(), after=3)  # steps 0, 1, 2 are fine; step 3 is NaN
    t = SnapshotTrainer(model, train_cfg(tmp_path, eval_interval=2), random_batches(), tmp_path)
    with pytest.raises(TrainingDivergedError, match="step 3") as info:
        t.fit()
    msg = str(info.value)
    assert "--lr" in msg and str(tmp_path) in msg
    assert t.saved and (tmp_path / "model.safetensors").read_bytes() == t.saved
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert ckpt.load_state(tmp_path / "checkpoint" / "optimizer.pt")["step"] == 2  # the last save, not step 3
    logged = [r["train_loss"] for r in metrics(tmp_path) if "lr" in r]
    assert len(logged) == 3 and all(math.isfinite(x) for x in logged)


# --------------------------------------------------------------------------- batching


def test_grad_accum_equals_a_bigger_batch(tmp_path: Path) -> None:
    a = Trainer(small_gpt(), train_cfg(tmp_path / "a", batch_size=4, grad_accum=2),
                random_batches(), tmp_path / "a")
    b = Trainer(small_gpt(), train_cfg(tmp_path / "b", batch_size=8, grad_accum=1),
                random_batches(), tmp_path / "b")
    # The same data stream: two micro-batches of 4 are the rows of one batch of 8.
    ga, gb = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    xa = torch.cat([a._batch("train", ga)[0], a._batch("train", ga)[0]])
    assert torch.equal(xa, b._batch("train", gb)[0])

    grads: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for key, t in (("a", a), ("b", b)):  # the (clipped) gradients AdamW is about to use
        t.optimizers[0].register_step_pre_hook(
            lambda opt, args, kw, key=key, t=t: grads[key].extend(
                p.grad.clone() for p in t.model.parameters()))
    before = [p.detach().clone() for p in a.model.parameters()]
    loss_a, loss_b = a._train_step(), b._train_step()
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert len(grads["a"]) == len(grads["b"]) == len(before)
    for ga_, gb_ in zip(grads["a"], grads["b"], strict=True):
        torch.testing.assert_close(ga_, gb_, rtol=1e-5, atol=1e-8)
    # Adam's first step is about lr·sign(g), so a 1e-8 gradient difference near g = 0 can move
    # a weight by up to ~lr; compare the weights at a fraction of the step size instead.
    lr = a.optimizers[0].param_groups[0]["lr"]
    moved = 0.0
    for p, q, p0 in zip(a.model.parameters(), b.model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0.01 * lr)
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 0.5 * lr  # the step did change the weights


def test_evaluation_uses_fixed_batches(tmp_path: Path) -> None:
    t = Trainer(small_gpt(), train_cfg(tmp_path), random_batches(), tmp_path)
    state = t.data_gen.get_state()
    first = t.evaluate()
    assert t.evaluate() == first  # the same batches each time
    assert torch.equal(t.data_gen.get_state(), state)  # and the training stream is untouched
    assert t.model.training


def test_train_config_validation() -> None:
    for kw, field in [(dict(batch_size=0), "batch_size"), (dict(grad_accum=0), "grad_accum"),
                      (dict(max_iters=0), "max_iters"), (dict(warmup_iters=-1), "warmup_iters"),
                      (dict(lr=0.0), "lr"), (dict(dtype="fp8"), "dtype")]:
        with pytest.raises(ValueError, match=field):
            TrainConfig(**kw)
    assert dataclasses.asdict(TrainConfig())["lr_decay_iters"] is None
