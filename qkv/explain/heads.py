"""``qkv explain heads``: how many parameters multi-head attention has — the notes give two answers.

CS189 Lec 21 copies the single head h times at full width: h sets of (W_Q, W_K, W_V), each
d × d, so "the parameters grow from 3d² to 3hd²" (and W_O maps the h·d concatenation back to
d: h·d² more). CS231N Lec 8 and Vaswani et al. (2017) give each head width d/h instead: the h
heads together have 3d², as many as one head (plus d² for W_O), and cost the same FLOPs.
Both statements are right for their design; qkv and every checkpoint it loads use the second.
Grouped-query attention (GQA) shares each key/value head among h/K query heads: W_K and W_V
shrink to K·(d/h) rows each, and so does the KV cache per token.

Each count is computed by formula and checked against the parameters of
:class:`qkv.attention.MultiHeadAttention` built that way (biases off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import MultiHeadAttention
from qkv.explain.cost import param_count

if TYPE_CHECKING:
    from rich.console import Console

MAX_PARAMS = 10**12  # counted on the meta device: no memory, but keep the numbers sane


@dataclass
class HeadsDesign:
    """One way to build h heads: head width, Q/K/V and W_O parameters, KV-cache floats per token
    per layer, and the parameter count of qkv's module built that way."""

    name: str
    source: str
    head_dim: int
    kv_heads: int
    qkv_params: int
    out_params: int
    kv_cache_per_token: int
    module_params: int

    @property
    def total(self) -> int:
        return self.qkv_params + self.out_params


@dataclass
class HeadsResult:
    d: int
    h: int
    kv_heads: int
    designs: list[HeadsDesign]


def _count(d: int, h: int, head_dim: int, kv: int) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return param_count(MultiHeadAttention(d, h, n_kv_heads=kv, head_dim=head_dim, bias=False))


def explain_heads(d: int = 768, h: int = 12, kv_heads: int = 4) -> HeadsResult:
    """The three designs for width ``d``, ``h`` query heads and ``kv_heads`` key/value heads
    (GQA). Defaults: BERT-base / ViT-B's d = 768, h = 12."""
    if d < 1 or h < 1 or d % h:
        raise ValueError(f"d must be a positive multiple of h, got d={d}, h={h}")
    if kv_heads < 1 or h % kv_heads:
        raise ValueError(f"kv_heads must divide h ({h}), got {kv_heads}")
    if 4 * h * d * d > MAX_PARAMS:
        raise ValueError(f"d={d}, h={h} makes {4 * h * d * d:,} parameters at full width; keep it under "
                         f"{MAX_PARAMS:,}")
    dh = d // h
    designs = [
        HeadsDesign("full width d", "CS189 Lec 21", d, h, 3 * h * d * d, h * d * d,
                    2 * h * d, _count(d, h, d, h)),
        HeadsDesign(f"width d/h = {dh}", "CS231N Lec 8", dh, h,
                    3 * d * d, d * d, 2 * h * dh, _count(d, h, dh, h)),
        HeadsDesign(f"GQA, {kv_heads} K/V heads", "Ainslie 2023", dh,
                    kv_heads, d * d + 2 * kv_heads * dh * d, d * d, 2 * kv_heads * dh,
                    _count(d, h, dh, kv_heads)),
    ]
    return HeadsResult(d, h, kv_heads, designs)


def render_heads(r: HeadsResult, console: Console) -> None:
    """Print the table of ``qkv explain heads``."""
    from qkv.explain._render import add_row, say, table

    t = table(f"multi-head attention, width d = {r.d}, h = {r.h} heads (biases off)",
              ["heads of", "W_Q, W_K, W_V", "W_O", "total", "qkv's module", "KV cache/token"])
    for x in r.designs:
        add_row(t, f"{x.name} ({x.source})", f"{x.qkv_params:,}", f"{x.out_params:,}", f"{x.total:,}",
                f"{x.module_params:,}", f"{x.kv_cache_per_token:,}")
    console.print(t)
    full, split = r.designs[0], r.designs[1]
    say(console, f"The notes disagree and both are right: full-width heads multiply the parameters by h "
        f"({full.total:,} = {full.total // split.total}x {split.total:,}); heads of width d/h keep one "
        "head's count and FLOPs, which is what trained models (and qkv) do. GQA saves key/value "
        f"parameters and {1 - r.designs[2].kv_cache_per_token / split.kv_cache_per_token:.0%} of the KV "
        "cache.", "dim")
