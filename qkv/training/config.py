"""What a training run is configured with and hands back: :class:`TrainConfig` (every field a
`qkv train` option), :class:`TrainResult`, the :class:`BatchSource` a family's data provides,
and the loop's two ways of stopping early."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from qkv.training.optim import OptimizerKind

DType = Literal["auto", "fp32", "bf16", "fp16"]


@dataclass
class TrainConfig:
    """Optimisation settings shared by every model family (each overridable as --field)."""

    out_dir: str = "runs/gpt"  # run directory: checkpoints, metrics, plots
    batch_size: int = 32  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimiser step
    max_iters: int = 2000  # optimiser steps
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # final learning rate of the cosine schedule
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: int | None = None  # cosine length (default: max_iters)
    weight_decay: float = 0.1  # decoupled decay on matrices (not on biases/norms), AdamW and Muon
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    # Muon orthogonalises in bf16 where the hardware has it, else in fp32.
    optimizer: OptimizerKind = "auto"  # muon: Muon (hidden matrices) + AdamW (rest); adamw; auto = muon
    muon_lr: float = 0.02  # Muon's peak learning rate (same warmup and decay as lr)
    eval_interval: int = 250  # steps between evaluations/checkpoints
    eval_iters: int = 20  # validation batches per evaluation
    dtype: DType = "auto"  # auto = measured: bf16 autocast if faster than fp32 here (GPUs: bf16/fp16)
    compile: bool | None = None  # torch.compile; none = auto: GPUs yes; CPUs if the run can repay it
    seed: int = 1337
    device: str = "auto"  # auto = cuda if available, else cpu

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {self.warmup_iters}")
        if self.lr <= 0 or self.min_lr < 0:
            raise ValueError(f"lr must be > 0 and min_lr >= 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.dtype not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, fp32, bf16 or fp16, got {self.dtype!r}")
        if self.optimizer not in ("auto", "adamw", "muon"):
            raise ValueError(f"optimizer must be auto, adamw or muon, got {self.optimizer!r}")
        if self.muon_lr <= 0:
            raise ValueError(f"muon_lr must be > 0, got {self.muon_lr}")


class BatchSource(Protocol):
    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(inputs, targets) on the CPU for split "train" or "val", drawn with ``generator``."""
        ...


class TrainingDivergedError(Exception):
    """The loss became NaN/inf; the last good checkpoint is kept."""


class TrainingInterruptedError(Exception):
    """Ctrl-C: a resumable checkpoint was written."""


@dataclass
class TrainResult:
    step: int
    best_val_loss: float
    last_train_loss: float
    seconds: float
    tokens_per_s: float
