"""The GPT family: a character- or BPE-level language model on text (Lecture 23's decoder-only
Transformer). Corpus -> tokenizer -> :class:`qkv.models.gpt.GPT` -> validation loss, a sample,
the loss curve and the last layer's attention over held-out text.

Run directory: ``config.json`` (family ``"gpt"``, the corpus name and its sha256), the
tokenizer (``tokenizer.json``), checkpoints, ``eval.json`` (validation loss on fixed windows),
``loss.png``, ``attention.png``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from qkv.families.base import FamilyBase, files_lines, loss_curve, trained_line
from qkv.figures import AttentionMaps, Picture
from qkv.models.gpt import GPT, GPTConfig
from qkv.pipelines.text import CausalLM, sample_prompt
from qkv.training import checkpoint as ckpt
from qkv.training.run import Prepared, Run


@dataclass
class LMDataConfig:
    """Where the text comes from and how it becomes tokens."""

    data: str | None = None  # a UTF-8 text file; none = --builtin's text
    builtin: Literal["shakespeare", "repeats"] = "shakespeare"  # without --data; repeats: letters twice
    tokenizer: Literal["char", "bpe"] = "char"  # characters, or byte-level BPE (<|endoftext|> ends a doc)
    bpe_vocab_size: int = 2048  # BPE vocabulary size, <|endoftext|> included (with --tokenizer bpe)
    val_fraction: float = 0.1  # the last 10% of the tokens are held out

    def __post_init__(self) -> None:
        if self.builtin not in ("shakespeare", "repeats"):
            raise ValueError(f"builtin must be 'shakespeare' or 'repeats', got {self.builtin!r}")
        if self.tokenizer not in ("char", "bpe"):
            raise ValueError(f"tokenizer must be 'char' or 'bpe', got {self.tokenizer!r}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")


@dataclass
class LMState:
    corpus: Any  # qkv.data.corpora.Corpus
    tokenizer: Any


def build_tokenizer(data_cfg: LMDataConfig, text: str):
    from qkv.tokenizers import BPETokenizer, CharTokenizer

    if data_cfg.tokenizer == "char":
        return CharTokenizer(text)
    return BPETokenizer.train([text], vocab_size=data_cfg.bpe_vocab_size)


def prepare_data(data_cfg: LMDataConfig, block_size: int, tokenizer=None):
    """(corpus, tokenizer, TokenBatches); builds the tokenizer unless one is given (resume)."""
    from qkv.data.corpora import (
        REPEATS,
        Corpus,
        TokenBatches,
        load_text,
        repeats_text,
        token_cache,
        train_val_split,
    )

    if data_cfg.data is None and data_cfg.builtin == "repeats":
        corpus = Corpus.from_text(repeats_text(), name=REPEATS)
    else:
        corpus = load_text(Path(data_cfg.data) if data_cfg.data else None)
    tok = tokenizer if tokenizer is not None else build_tokenizer(data_cfg, corpus.text)
    train, val = train_val_split(token_cache(corpus, tok), data_cfg.val_fraction)
    return corpus, tok, TokenBatches(train, val, block_size)


def sample_text(model: GPT, tok, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = 200, top_p: float | None = None, seed: int = 0) -> str:
    """Prompt -> prompt + continuation (the end-of-training sample)."""
    from qkv.generation import generate
    from qkv.tokenizers import stop_ids

    ids = torch.tensor([tok.encode(prompt)], dtype=torch.long, device=next(model.parameters()).device)
    stops = stop_ids(tok)
    new = [int(t[0]) for t in generate(model, ids, max_new_tokens, temperature=temperature,
                                       top_k=top_k, top_p=top_p, seed=seed, stop_ids=stops)]
    return prompt + tok.decode(new)


def _prompt_hint(run: Run) -> str:
    """A prompt for the hint after training: the first word of the run's own text, quoted as a
    person types it (``"ALL'S"``, not shlex's ``'ALL'"'"'S'``)."""
    from qkv.training.run import command_line

    words = run.prepared.state.corpus.text.split()
    return command_line([words[0][:24] if words else "a"])


class GPTFamily(FamilyBase):
    name = "gpt"
    kind = "decoder"
    unit = "tok"
    help = "a character- or BPE-level GPT on text (default: Shakespeare)"
    description = (
        "Train a GPT. With no options: the `cpu` preset of a character-level GPT on the 42 "
        "Shakespeare works (install them with `qkv assets install shakespeare`), then print a "
        "sample and write the run directory, a loss plot and an attention heatmap.")
    model_config = GPTConfig
    data_config = LMDataConfig
    from_data = ("vocab_size",)
    default_preset = "cpu"

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sample-tokens", type=int, default=300,
                            help="length of the sample printed at the end")

    def prepare(self, model_cfg: GPTConfig, data_cfg: LMDataConfig, resume_dir, on_note) -> Prepared:
        from dataclasses import replace

        from qkv.lens.heads import probe_avoid
        from qkv.lens.history import history_probe
        from qkv.tokenizers import load_tokenizer, save_tokenizer, stop_ids

        tok = load_tokenizer(resume_dir / "tokenizer.json") if resume_dir else None
        corpus, tok, batches = prepare_data(data_cfg, model_cfg.max_seq_len, tok)
        # every head scored at each evaluation (history.jsonl, heads.png): heads forming
        probe = history_probe(tok.vocab_size, model_cfg.max_seq_len, probe_avoid(tok, tuple(stop_ids(tok))))
        return Prepared(replace(model_cfg, vocab_size=tok.vocab_size), batches, LMState(corpus, tok),
                        record={"tokenizer": "tokenizer.json"},
                        data_record={"corpus": corpus.name, "sha256": corpus.sha256},
                        save=lambda d: save_tokenizer(tok, d / "tokenizer.json"),
                        items_per_row=model_cfg.max_seq_len, history=probe)

    def build(self, model_cfg: GPTConfig) -> GPT:
        return GPT(model_cfg)

    def check_resume(self, saved: dict[str, Any], prepared: Prepared) -> None:
        """The text must be the one the run started on (its sha256 is in config.json)."""
        data, now = saved.get("data", {}), prepared.data_record["sha256"]
        if data.get("sha256") not in (None, now):
            raise ValueError(f"the text changed since {saved['train']['out_dir']} was started: --data "
                             f"{data.get('data') or 'shakespeare'} now has sha256 {now[:12]}…, the run "
                             f"was trained on {data['sha256'][:12]}…; restore that text, or start a new run")

    @torch.no_grad()
    def evaluate(self, model: GPT, prepared: Prepared, n_windows: int = 64) -> dict[str, Any]:
        """Mean next-token loss over ``n_windows`` fixed validation windows (same every run)."""
        gen = torch.Generator().manual_seed(0)
        x, y = prepared.batches.get_batch("val", n_windows, gen)
        device = next(model.parameters()).device
        losses = [float(model(x[i : i + 16].to(device), y[i : i + 16].to(device)).loss) * len(x[i : i + 16])
                  for i in range(0, len(x), 16)]
        loss = sum(losses) / len(x)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0)), "val_windows": len(x),
                "tokens_per_window": x.shape[1]}

    def pictures(self, run: Run) -> dict[str, Picture]:
        tok = run.prepared.state.tokenizer
        x, _ = run.prepared.batches.get_batch("val", 1, torch.Generator().manual_seed(0))
        text = tok.decode(x[0, :32].tolist())
        from qkv.lens.history import read_history
        from qkv.training.run import HISTORY

        out = {"loss plot": loss_curve(run),
               "attention map (last layer)": Picture("attention.png", attention_map(run.model, tok, text))}
        history = read_history(run.run_dir / HISTORY)
        if history is not None and len(history.steps) > 1:
            out["heads during training"] = Picture("heads.png", history.figure(
                f"{run.run_dir.name}: head scores on repeated random tokens at each evaluation"))
        return out

    def headline(self, model_cfg: GPTConfig, data_cfg: LMDataConfig) -> str:
        return f"{model_cfg.n_layers} layers x {model_cfg.dim} wide, context {model_cfg.max_seq_len}"

    def summary(self, run: Run, args: argparse.Namespace | None = None) -> str:
        tok = run.prepared.state.tokenizer
        n = getattr(args, "sample_tokens", 300)
        sample = sample_text(run.model, tok, sample_prompt(tok), n)
        from qkv.lens.history import formed_lines, read_history
        from qkv.training.run import HISTORY

        history = read_history(run.run_dir / HISTORY)
        heads = "".join(f"{line}\n" for line in formed_lines(history)) if history is not None else ""
        return (f"\n{trained_line(run, 'tok')}\nvalidation loss {run.eval['val_loss']:.4f} on "
                f"{run.eval['val_windows']} fixed windows\n{heads}"
                f"\n--- sample (temperature 0.8, top-k 200) ---{sample}\n---\n"
                + files_lines(run, {"weights": run.run_dir / "model.safetensors"})
                + f"generate more: qkv generate {run.run_dir} --prompt {_prompt_hint(run)}")

    def load(self, run_dir: Path, device: str = "cpu") -> CausalLM:
        """The run as a decoder (fp32, its best weights), stopping at its ``<|endoftext|>`` and
        continuing a newline when no prompt is given."""
        from qkv.tokenizers import load_tokenizer, stop_ids

        _, model, _ = self.read_run(run_dir, "a GPT language model",
                                    lambda c: (GPTConfig(**c["model"]), None), device)
        try:
            tok = load_tokenizer(Path(run_dir) / "tokenizer.json")
        except (OSError, ValueError) as e:
            raise ckpt.CheckpointError(f"cannot load {run_dir}/tokenizer.json: {e}") from None
        return CausalLM(Path(run_dir).name, model, tok, stop_ids=stop_ids(tok), run_dir=Path(run_dir),
                        default_prompt=sample_prompt(tok))


def attention_map(model: GPT, tok, text: str, max_tokens: int = 32) -> AttentionMaps:
    """The last layer's heads on the first ``max_tokens`` tokens of ``text``."""
    ids = tok.encode(text)[:max_tokens]
    x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    model.eval()
    with torch.no_grad():
        out = model(x, backend="reference", return_weights=True)
    labels = [tok.decode([i]) for i in ids]
    return AttentionMaps(out.weights[-1][0], labels, title=f"last layer attention ({len(ids)} tokens)")

