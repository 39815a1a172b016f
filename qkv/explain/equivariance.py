"""``qkv explain equivariance``: attention ignores order until positions are added.

Self-attention is permutation equivariant: shuffle the input tokens and the outputs are
shuffled the same way, each output unchanged, f(PX) = P f(X) (CS231N Lec 8; CS189 Lec 22).
It treats its input as a set. Adding a position vector to each token (sinusoidal here,
Vaswani et al. 2017 §3.5) breaks the symmetry, and so does a causal mask (a decoder sees only
earlier tokens). The lecture's example: "the food was good not bad at all" and "the food was
bad not good at all" hold the same words, so without positions their mean-pooled outputs are
identical and no read-out can tell praise from complaint.

Computed with :class:`qkv.attention.MultiHeadAttention` (random weights, float64) and
:func:`qkv.attention.sinusoidal_table`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import MultiHeadAttention, sinusoidal_table

if TYPE_CHECKING:
    from rich.console import Console

SENTENCE_A = "the food was good not bad at all"
SENTENCE_B = "the food was bad not good at all"


@dataclass
class EquivarianceCase:
    """max |f(PX) − P f(X)| for one setting; ``equivariant`` when it is at rounding level."""

    name: str
    max_abs_diff: float
    equivariant: bool


@dataclass
class EquivarianceResult:
    """cases: the permutation test. pooled_diff[name]: ‖mean f(A) − mean f(B)‖ for the two
    sentences (same words, two orders), with and without positions."""

    tokens: int
    dim: int
    heads: int
    seed: int
    permutation: list[int]
    cases: list[EquivarianceCase]
    sentence_a: str
    sentence_b: str
    pooled_diff: dict[str, float]


TOL = 1e-10  # float64 rounding of a few matrix products is ~1e-15


MAX_TOKENS = MAX_DIM = 4096  # a few hundred MB at most: a worked example, not a stress test


def explain_equivariance(tokens: int = 6, dim: int = 16, heads: int = 2, seed: int = 0) -> EquivarianceResult:
    """Permute ``tokens`` random tokens of width ``dim`` through one attention layer.

    Args:
        tokens: how many tokens (>= 2). dim: model width (even, divisible by ``heads``).
        seed: seeds the tokens, the weights and the permutation (never the identity).
    """
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2 to permute anything, got {tokens}")
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be even and >= 2 (sinusoidal positions pair channels), got {dim}")
    if heads < 1 or dim % heads:
        raise ValueError(f"heads must divide dim ({dim}), got {heads}")
    scores = heads * tokens * tokens * 8  # one float64 score per head and pair of tokens
    if tokens > MAX_TOKENS or dim > MAX_DIM:
        raise ValueError(f"tokens and dim must be at most {MAX_TOKENS} and {MAX_DIM} (a live example; "
                         f"{tokens} tokens x {heads} heads need {scores / 1e9:,.1f} GB of float64 scores, "
                         f"a width of {dim} {dim * dim * 4 * 8 / 1e9:,.1f} GB of weights), got {tokens} "
                         f"and {dim}")
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # seed the layer's initial weights, leave the global RNG
        torch.manual_seed(seed)
        layer = MultiHeadAttention(dim, heads, backend="reference").double().eval()
    perm = torch.randperm(tokens, generator=g)
    while torch.equal(perm, torch.arange(tokens)):
        perm = torch.randperm(tokens, generator=g)
    x = torch.randn(1, tokens, dim, generator=g, dtype=torch.float64)  # (B=1, T, dim)
    pos = sinusoidal_table(tokens, dim).double()  # (T, dim)

    def f(inp: torch.Tensor, causal: bool = False) -> torch.Tensor:
        with torch.no_grad():
            return layer(inp, is_causal=causal).out

    def case(name: str, out: torch.Tensor, out_perm: torch.Tensor) -> EquivarianceCase:
        diff = float((out_perm - out[:, perm]).abs().max())
        return EquivarianceCase(name, diff, diff < TOL)

    cases = [
        case("self-attention, no positions", f(x), f(x[:, perm])),
        case("+ sinusoidal positions", f(x + pos), f(x[:, perm] + pos)),
        case("causal mask (decoder), no positions", f(x, True), f(x[:, perm], True)),
    ]
    # The lecture's sentences: one random vector per word, the same for both sentences.
    words = sorted(set(SENTENCE_A.split()))
    emb = dict(zip(words, torch.randn(len(words), dim, generator=g, dtype=torch.float64), strict=True))
    sa, sb = (torch.stack([emb[w] for w in s.split()])[None] for s in (SENTENCE_A, SENTENCE_B))
    pa = sinusoidal_table(sa.shape[1], dim).double()
    pooled = {
        "no positions": float((f(sa).mean(1) - f(sb).mean(1)).norm()),
        "+ sinusoidal positions": float((f(sa + pa).mean(1) - f(sb + pa).mean(1)).norm()),
    }
    return EquivarianceResult(tokens, dim, heads, seed, perm.tolist(), cases, SENTENCE_A, SENTENCE_B,
                              pooled)


def render_equivariance(r: EquivarianceResult, console: Console) -> None:
    """Print the tables of ``qkv explain equivariance``."""
    from qkv.explain._render import add_row, say, table

    t = table(f"{r.tokens} random tokens of width {r.dim} through one {r.heads}-head attention layer; "
              f"permutation P = {r.permutation}  (CS231N Lec 8)",
              ["setting", "max |f(PX) − P f(X)|", "f(PX) = P f(X)?"])
    for c in r.cases:
        add_row(t, c.name, f"{c.max_abs_diff:.2e}", "yes: equivariant" if c.equivariant else "no")
    console.print(t)
    s = table("same words, another order  (CS189 Lec 22)", ["tokens", "‖mean f(A) − mean f(B)‖"])
    for name, diff in r.pooled_diff.items():
        add_row(s, name, f"{diff:.2e}")
    console.print(s)
    say(console, f"A = {r.sentence_a!r}, B = {r.sentence_b!r}: without positions the two "
        "sentences are the same set of words, and attention gives the same pooled vector.", "dim")
    say(console, "The notes call self-attention permutation-invariant in one place (CS189 Lec 21) and "
        "equivariant in others (CS231N Lec 8): it is equivariant, the outputs permuted with the inputs "
        "(first table); what is invariant is an order-free summary of them, such as the mean above.",
        "yellow")
