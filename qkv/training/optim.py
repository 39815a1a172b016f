"""Optimiser and learning-rate schedule.

AdamW (Loshchilov & Hutter 2019) with two parameter groups: weight decay on matrices
(linear layers, embeddings), none on vectors (biases, norm gains) — decaying a norm's gain
towards 0 only fights the normalisation. Schedule: linear warmup, then cosine decay to
``min_lr`` (as in nanoGPT / GPT-3).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
) -> torch.optim.AdamW:
    """AdamW with decay/no-decay groups; the fused kernel where PyTorch has one, else foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    seen: set[int] = set()
    decay, no_decay = [], []
    for p in params:
        if id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs: dict = {"lr": lr, "betas": betas}
    if "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cpu", "cuda"):
        kwargs["fused"] = True  # one kernel over all parameters (CPU and CUDA since torch 2.4)
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """Linear warmup over ``warmup`` steps, cosine from ``lr`` to ``min_lr`` until ``decay_steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup) / max(1, decay_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
