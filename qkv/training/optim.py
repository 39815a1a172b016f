"""Optimisers and the learning-rate schedule.

AdamW (Loshchilov & Hutter 2019) with two parameter groups: weight decay on matrices
(linear layers, embeddings), none on vectors (biases, norm gains) — decaying a norm's gain
towards 0 only fights the normalisation.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; PyTorch's own
``torch.optim.Muon``): SGD with Nesterov momentum whose update for each hidden weight matrix is
orthogonalised by a few Newton–Schulz iterations (every singular value pushed towards 1), so
that every direction of the matrix learns at the same rate. It is meant for the 2-D weights
*inside* the network; the embeddings, the output head and every vector (norm gains, biases)
stay with AdamW, as in modded-nanogpt and nanochat. On a small character-level GPT it reaches
nanoGPT's final loss in about a third of the steps (``benchmarks/train_speed.py``).

Schedule: linear warmup, then cosine decay to ``min_lr`` (as in nanoGPT / GPT-3). Every
parameter group carries an ``lr_scale``; the schedule sets ``lr = lr_at(...) * lr_scale``, so
Muon's learning rate (``muon_lr``) follows the same warmup and decay as AdamW's.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal

import torch
from torch import nn

OptimizerKind = Literal["auto", "adamw", "muon"]


def make_optimizer(
    model: nn.Module | list[nn.Parameter],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
) -> torch.optim.AdamW:
    """AdamW with decay/no-decay groups; the fused kernel where PyTorch has one, else foreach."""
    params = model if isinstance(model, list) else [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [], []
    for p in _unique(params):
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    kwargs: dict = {"lr": lr, "betas": betas}
    if "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cpu", "cuda"):
        kwargs["fused"] = True  # one kernel over all parameters (CPU and CUDA since torch 2.4)
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


def muon_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices for Muon, everything else for AdamW).

    Hidden matrices: the 2-D weights of ``nn.Linear`` layers, except an output head (a module
    whose name ends in ``head``) and any weight shared with an ``nn.Embedding`` (tied
    embeddings). Embeddings, heads, convolutions, recurrent cells and vectors go to AdamW.
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden: list[nn.Parameter] = []
    for name, m in model.named_modules():
        if (isinstance(m, nn.Linear) and m.weight.requires_grad and not name.endswith("head")
                and id(m.weight) not in embedded):
            hidden.append(m.weight)
    hidden = _unique(hidden)
    ids = {id(p) for p in hidden}
    rest = [p for p in _unique([p for p in model.parameters() if p.requires_grad]) if id(p) not in ids]
    return hidden, rest


def muon_available() -> bool:
    """PyTorch has ``torch.optim.Muon`` (2.9 and later)."""
    return hasattr(torch.optim, "Muon")


def resolve_optimizer(kind: OptimizerKind, device_type: str, native_bf16: bool) -> Literal["adamw", "muon"]:
    """The optimiser ``auto`` stands for: Muon where its Newton–Schulz products run fast.

    ``torch.optim.Muon`` orthogonalises in bf16. On a CPU without bf16 instructions those
    products are emulated (~100× slower than fp32 here), which would make each step seconds
    long, so ``auto`` takes AdamW there; ``--optimizer muon`` still forces Muon.
    """
    if kind != "auto":
        return kind
    if not muon_available():
        return "adamw"
    return "muon" if device_type == "cuda" or native_bf16 else "adamw"


def make_optimizers(
    model: nn.Module,
    kind: Literal["adamw", "muon"],
    lr: float,
    muon_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
    muon_momentum: float = 0.95,
) -> list[torch.optim.Optimizer]:
    """[AdamW] or [Muon for the hidden matrices, AdamW for the rest].

    Muon uses PyTorch's default learning-rate adjustment (``lr·√max(1, rows/cols)``, Keller
    Jordan's original) and decoupled weight decay; its groups carry ``lr_scale = muon_lr / lr``
    so one schedule drives both optimisers.
    """
    if kind == "adamw":
        return [make_optimizer(model, lr, weight_decay, betas, device_type)]
    if kind != "muon":
        raise ValueError(f"optimizer must be auto, adamw or muon, got {kind!r}")
    if not muon_available():
        raise ValueError(f"--optimizer muon needs torch >= 2.9 (this is {torch.__version__}); "
                         "use --optimizer adamw")
    hidden, rest = muon_params(model)
    opts: list[torch.optim.Optimizer] = []
    if hidden:
        muon = torch.optim.Muon(hidden, lr=muon_lr, weight_decay=weight_decay, momentum=muon_momentum)
        for group in muon.param_groups:
            group["lr_scale"] = muon_lr / lr
        opts.append(muon)
    if rest:
        opts.append(make_optimizer(rest, lr, weight_decay, betas, device_type))
    return opts


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """Linear warmup over ``warmup`` steps, cosine from ``lr`` to ``min_lr`` until ``decay_steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup) / max(1, decay_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Each parameter once (tied weights appear twice in a module's parameters)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
