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
PyTorch orthogonalises in bf16; on a CPU without bf16 instructions qkv runs the same
iteration in fp32 (:class:`Muon`), where emulated bf16 would be ~100× slower.

Schedule: linear warmup, then cosine decay to ``min_lr`` (as in nanoGPT / GPT-3). Every
parameter group carries an ``lr_scale``; the schedule sets ``lr = lr_at(...) * lr_scale``, so
Muon's learning rate (``muon_lr``) follows the same warmup and decay as AdamW's.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal

import torch
from torch import Tensor, nn

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


def resolve_optimizer(kind: OptimizerKind) -> Literal["adamw", "muon"]:
    """The optimiser ``auto`` stands for: Muon wherever PyTorch has it, else AdamW."""
    if kind != "auto":
        return kind
    return "muon" if muon_available() else "adamw"


def muon_ns_dtype(device_type: str, native_bf16: bool) -> torch.dtype:
    """Where the Newton–Schulz products run fast: bf16 on GPUs and on CPUs with bf16
    instructions (PyTorch's choice), fp32 on CPUs that would emulate bf16 (~100× slower)."""
    return torch.bfloat16 if device_type == "cuda" or native_bf16 else torch.float32


def fp32_newton_schulz(device: str) -> bool:
    """Whether Muon's Newton–Schulz products will run in fp32 on ``device`` (a CPU without
    bf16 instructions), which the cpu preset's recipe accounts for."""
    from qkv.device import cpu_has_native_bf16

    dev = "cuda" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "cpu"
    return muon_ns_dtype(dev, cpu_has_native_bf16()) == torch.float32


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """Keller Jordan's quintic Newton–Schulz iteration towards the orthogonal factor of g,
    in ``dtype``: X ← X/‖X‖, then ``steps`` times S = XXᵀ, X ← aX + (bS + cS²)X (on the wide
    side of g). The same iteration as ``torch.optim.Muon``'s, which fixes bf16."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    return (x.T if tall else x).to(g.dtype)


class Muon(torch.optim.Muon if muon_available() else torch.optim.Optimizer):  # type: ignore[misc]
    """``torch.optim.Muon`` with its Newton–Schulz iteration in ``ns_dtype``.

    With bf16 (the default) every step is PyTorch's own. With fp32 the same update is
    computed here — momentum ``B ← μB + (1 − μ)g``, Nesterov ``u = (1 − μ)g + μB``,
    ``W ← W(1 − ηλ) − η·√max(1, rows/cols)·NS(u)`` — because on a CPU without bf16
    instructions PyTorch's bf16 products are emulated and one step would take seconds.
    """

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["adjust_lr_fn"] not in (None, "original"):
                raise ValueError("qkv's fp32 Muon step implements the original lr adjustment only")
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            mu, lr = group["momentum"], group["lr"]
            for p, g, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(g, 1 - mu)
                u = g.lerp(buf, mu) if group["nesterov"] else buf
                u = newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(u, alpha=-lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))
        return loss


def make_optimizers(
    model: nn.Module,
    kind: Literal["adamw", "muon"],
    lr: float,
    muon_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
    muon_momentum: float = 0.95,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> list[torch.optim.Optimizer]:
    """[AdamW] or [Muon for the hidden matrices, AdamW for the rest].

    Muon uses PyTorch's default learning-rate adjustment (``lr·√max(1, rows/cols)``, Keller
    Jordan's original) and decoupled weight decay, and orthogonalises in ``ns_dtype`` (see
    :func:`muon_ns_dtype`); its groups carry ``lr_scale = muon_lr / lr`` so one schedule
    drives both optimisers.
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
        muon = Muon(hidden, lr=muon_lr, weight_decay=weight_decay, momentum=muon_momentum, ns_dtype=ns_dtype)
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
