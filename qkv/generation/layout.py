"""Weight memory layout for batch-1 decoding on CPU.

Generating one token multiplies a single vector by every weight matrix, so decoding speed is
bounded by how fast the weights stream from memory. nn.Linear stores W as (out, in) rows;
for a (1, in) input, the BLAS kernel behind ``x @ Wᵀ`` on that layout reaches ~12 GB/s on
this project's 2-core CPU, while the same product over W stored as (in, out) reaches ~17 GB/s
(``benchmarks/generation_speed.py`` measures both). ``decode_layout`` re-lays the fp32
weights out in place: same parameters, same shapes, same values, same tied embeddings; only
the strides change (W becomes a transposed view of an (in, out) buffer). Prompt processing
(many rows at once) is a little slower in that layout; bf16 weights must keep the standard
one (the bf16 kernel is ~20× slower on transposed storage).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Layout = Literal["standard", "decode"]


def set_weight_layout(model: nn.Module, layout: Layout) -> nn.Module:
    """Re-lay out every ``nn.Linear`` weight of ``model`` in place; returns ``model``.

    ``"decode"``: (in, out) storage, for fp32 weights on CPU only (others are left alone).
    ``"standard"``: contiguous (out, in), what every other code path (saving, dtype casts,
    training) expects.
    """
    if layout not in ("standard", "decode"):
        raise ValueError(f"layout must be 'standard' or 'decode', got {layout!r}")
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if id(w) in seen:  # tied weights: re-laid out once, both modules see it
            continue
        seen.add(id(w))
        if layout == "decode":
            if w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous():
                w.data = w.data.t().contiguous().t()
        elif not w.is_contiguous():
            w.data = w.data.contiguous()
    return model


def weight_layout(model: nn.Module) -> Layout:
    """``"decode"`` if any Linear weight is stored transposed, else ``"standard"``."""
    return "decode" if any(
        isinstance(m, nn.Linear) and not m.weight.is_contiguous() for m in model.modules()
    ) else "standard"
