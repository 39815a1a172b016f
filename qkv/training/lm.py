"""The language-model job behind `qkv train` / `qkv train gpt`: corpus -> tokenizer -> GPT ->
the training loop -> sample, loss plot, attention map.

Run directory layout: see :mod:`qkv.training.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from qkv import __version__
from qkv.models.gpt import GPT, GPTConfig
from qkv.training import checkpoint as ckpt
from qkv.training.distributed import DistInfo
from qkv.training.trainer import TrainConfig, Trainer, TrainResult


@dataclass
class LMDataConfig:
    """Where the text comes from and how it becomes tokens."""

    data: str | None = None  # a UTF-8 text file; none = the 42 Shakespeare works
    tokenizer: Literal["char", "bpe"] = "char"  # characters, or byte-level BPE trained on the text
    bpe_vocab_size: int = 2048  # BPE vocabulary size (with --tokenizer bpe)
    val_fraction: float = 0.1  # the last 10% of the tokens are held out

    def __post_init__(self) -> None:
        if self.tokenizer not in ("char", "bpe"):
            raise ValueError(f"tokenizer must be 'char' or 'bpe', got {self.tokenizer!r}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")


class TokenBatches:
    """Random windows of ``block_size + 1`` tokens from the train or val split."""

    def __init__(self, train: np.ndarray, val: np.ndarray, block_size: int) -> None:
        from qkv.data.corpora import get_batch

        self._get = get_batch
        self.splits = {"train": train, "val": val}
        self.block_size = block_size
        for name, arr in self.splits.items():
            if len(arr) <= block_size:
                raise ValueError(
                    f"the {name} split has {len(arr)} tokens, fewer than one block of "
                    f"{block_size + 1}; use a longer text or a smaller --max_seq_len"
                )

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return self._get(self.splits[split], batch_size, self.block_size, generator)


def build_tokenizer(data_cfg: LMDataConfig, text: str):
    from qkv.tokenizers import BPETokenizer, CharTokenizer

    if data_cfg.tokenizer == "char":
        return CharTokenizer(text)
    return BPETokenizer.train([text], vocab_size=data_cfg.bpe_vocab_size)


def prepare_data(data_cfg: LMDataConfig, block_size: int, tokenizer=None):
    """(corpus, tokenizer, TokenBatches); builds the tokenizer unless one is given (resume)."""
    from qkv.data.corpora import load_text, token_cache, train_val_split

    corpus = load_text(Path(data_cfg.data) if data_cfg.data else None)
    tok = tokenizer if tokenizer is not None else build_tokenizer(data_cfg, corpus.text)
    tokens = token_cache(corpus, tok)
    train, val = train_val_split(tokens, data_cfg.val_fraction)
    return corpus, tok, TokenBatches(train, val, block_size)


def run_config(model_cfg: GPTConfig, train_cfg: TrainConfig, data_cfg: LMDataConfig, corpus) -> dict:
    return {
        "family": "gpt",
        "qkv_version": __version__,
        "model": model_cfg.to_dict(),
        "train": dataclasses.asdict(train_cfg),
        "data": {**dataclasses.asdict(data_cfg), "corpus": corpus.name, "sha256": corpus.sha256},
        "tokenizer": "tokenizer.json",
    }


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def train_lm(
    model_cfg: GPTConfig,
    train_cfg: TrainConfig,
    data_cfg: LMDataConfig,
    *,
    resume: bool = False,
    dist: DistInfo | None = None,
    on_log=None,
) -> tuple[GPT, Any, TrainResult]:
    """Train (or resume) a GPT into ``train_cfg.out_dir``; returns (model, tokenizer, result)."""
    from qkv.tokenizers import load_tokenizer, save_tokenizer

    dist = dist or DistInfo()
    run_dir = Path(train_cfg.out_dir)
    if not resume and is_run_dir(run_dir):
        raise ValueError(
            f"{run_dir} already holds a run; continue it with --resume {run_dir} "
            "or choose another --out_dir"
        )
    tok = load_tokenizer(run_dir / "tokenizer.json") if resume else None
    corpus, tok, batches = prepare_data(data_cfg, model_cfg.max_seq_len, tok)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=tok.vocab_size)
    torch.manual_seed(train_cfg.seed)
    model = GPT(model_cfg)
    trainer = Trainer(model, train_cfg, batches, run_dir, dist, on_log,
                      tokens_per_batch=model_cfg.max_seq_len)
    if resume:
        trainer.load_resume_state()
    elif dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, run_dir / "tokenizer.json")
        ckpt.write_json(run_dir / "config.json", run_config(model_cfg, train_cfg, data_cfg, corpus))
    result = trainer.fit()
    if dist.is_main:  # the best weights are what a user gets back
        ckpt.load_weights(model, run_dir / "model.safetensors")
    return model, tok, result


def load_lm_run(run_dir: Path, device: str = "cpu") -> tuple[GPT, Any, dict]:
    """Rebuild a trained GPT and its tokenizer from a run directory (best weights)."""
    from qkv.tokenizers import load_tokenizer

    run_dir = Path(run_dir)
    cfg = ckpt.read_run_config(run_dir, "gpt", "a GPT language model")
    if not isinstance(cfg.get("model"), dict):
        raise ckpt.CheckpointError(f"{run_dir}/config.json has no model config: the run directory is damaged")
    try:
        model_cfg = GPTConfig(**cfg["model"])
    except (TypeError, ValueError) as e:
        raise ckpt.CheckpointError(f"{run_dir}/config.json has an invalid model config: {e}") from None
    model = GPT(model_cfg)
    ckpt.load_weights(model, run_dir / "model.safetensors")
    try:
        tok = load_tokenizer(run_dir / "tokenizer.json")
    except (OSError, ValueError) as e:
        raise ckpt.CheckpointError(f"cannot load {run_dir}/tokenizer.json: {e}") from None
    return model.to(device).eval(), tok, cfg


def sample_text(
    model: GPT, tok, prompt: str, max_new_tokens: int, temperature: float = 0.8,
    top_k: int | None = 200, top_p: float | None = None, seed: int = 0,
) -> str:
    """Prompt -> prompt + continuation (convenience for the end of training)."""
    from qkv.generation import generate

    ids = torch.tensor([tok.encode(prompt)], dtype=torch.long, device=next(model.parameters()).device)
    gen = torch.Generator(device=ids.device).manual_seed(seed)
    new = [int(t[0]) for t in generate(model, ids, max_new_tokens, temperature=temperature,
                                       top_k=top_k, top_p=top_p, generator=gen)]
    return prompt + tok.decode(new)


def default_run_dir(family: str, preset: str) -> str:
    return f"runs/{family}-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
