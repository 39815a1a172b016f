"""``qkv explain masking`` and ``qkv explain qk``: what the causal mask does to the scores, and
why queries and keys have matrices of their own.

Masking (CS231N Lec 8, "Masked Self Attention"): after the scores E = QKᵀ/√d, add a matrix M
with M_ij = 0 where j ≤ i (may look) and −∞ where j > i (the future); softmax(E + M) then gives
exactly 0 to the future, because e^−∞ = 0, and each row is renormalised over the keys it may
see: row i equals softmax(E_i,0..i) of its allowed scores alone. So position i's output is what
it would be if the later tokens did not exist — which is why a decoder can be trained on every
position at once and still generate one token at a time (and why a KV cache is exact).

Q ≠ K (CS189 Lec 21: "retrieval is asymmetric: how much swam attends to river is not how much
river attends to swam"): with one matrix for both, W_Q = W_K = W, the scores
s_ij = (W x_i)·(W x_j) = s_ji form a symmetric matrix, whatever W is; with two matrices,
s_ij = x_iᵀ W_Qᵀ W_K x_j need not equal s_ji. (The weights after the row softmax are not
symmetric either way: each row is divided by its own sum.)

Both computed with :class:`qkv.attention.MultiHeadAttention` (random weights, float64, the
reference backend) and :func:`qkv.attention.causal_mask`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import MultiHeadAttention, causal_mask
from qkv.attention.functional import softmax

if TYPE_CHECKING:
    from rich.console import Console

TOKENS = ["the", "cat", "sat", "down"]
QK_TOKENS = ["swam", "river", "bank", "money"]


@dataclass
class MaskingResult:
    """Scores E (T, T), the mask M (0 / −inf), E + M and the weights softmax(E + M); checks:
    ``row_vs_prefix``: max |row i − softmax(E_i,0..i)| (renormalised over the allowed keys);
    ``future_weight``: the largest weight on a future key (exactly 0); ``layer_vs_manual``: the
    layer's own causal weights against softmax(E + M); ``prefix_output``: max |output at i with
    all T tokens − output at i from tokens 0..i alone|."""

    tokens: list[str]
    dim: int
    scores: list[list[float]]
    mask: list[list[float]]
    masked: list[list[float]]
    weights: list[list[float]]
    row_vs_prefix: float
    future_weight: float
    layer_vs_manual: float
    prefix_output: float


def _layer(dim: int, seed: int) -> MultiHeadAttention:
    with torch.random.fork_rng(devices=[]):  # seed the layer's weights, leave the global RNG
        torch.manual_seed(seed)
        return MultiHeadAttention(dim, 1, backend="reference").double().eval()


def _scores(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """E = QKᵀ/√d (T, T) of the single head, from the layer's own projections."""
    q, k, _ = layer._project(x, None, None, 0)  # (1, 1, T, D)
    return (q[0, 0] @ k[0, 0].T) / math.sqrt(q.shape[-1])


def explain_masking(dim: int = 8, seed: int = 0) -> MaskingResult:
    """Four tokens through one random single-head attention layer, causally masked."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    layer = _layer(dim, seed)
    T = len(TOKENS)
    x = torch.randn(1, T, dim, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    with torch.no_grad():
        E = _scores(layer, x)
        allowed = causal_mask(T, T)  # (T, T) bool, True = may attend
        M = torch.zeros(T, T, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        W = softmax(E + M, dim=-1)
        row = max(float((W[i, : i + 1] - torch.softmax(E[i, : i + 1], -1)).abs().max()) for i in range(T))
        out = layer(x, is_causal=True, return_weights=True)
        prefix = max(float((layer(x[:, : i + 1], is_causal=True).out[0, i] - out.out[0, i]).abs().max())
                     for i in range(T))
    return MaskingResult(TOKENS, dim, E.tolist(), M.tolist(), (E + M).tolist(), W.tolist(), row,
                         float(W.triu(1).abs().max()), float((out.weights[0, 0] - W).abs().max()), prefix)


def _num(v: float) -> str:
    return "−∞" if v == float("-inf") else f"{v:.3f}" if v else "0"


def render_masking(r: MaskingResult, console: Console) -> None:
    """Print the tables of ``qkv explain masking``."""
    from qkv.explain._render import add_row, say, table
    from qkv.viz.tokens import show_tokens

    say(console, "Rows: queries i, columns: keys j (CS231N Lec 8, Masked Self Attention).", "dim")
    for title, m in (("E = QKᵀ/√d", r.scores), ("M: 0 if j ≤ i, −∞ if j > i", r.mask), ("E + M", r.masked),
                     ("softmax(E + M)", r.weights)):
        t = table(title, ["", *show_tokens(r.tokens)])
        for tok, row in zip(show_tokens(r.tokens), m, strict=True):
            add_row(t, tok, *(_num(v) for v in row))
        console.print(t)
    c = table("checks", ["claim", "max |difference|"])
    add_row(c, "row i = softmax of its allowed scores E_i,0..i alone (renormalised)",
            f"{r.row_vs_prefix:.1e}")
    add_row(c, "largest weight on a future key (e^−∞ = 0)", f"{r.future_weight:.1e}")
    add_row(c, "the layer's own causal weights (is_causal=True) = softmax(E + M)", f"{r.layer_vs_manual:.1e}")
    add_row(c, "output at i with all tokens = output at i from tokens 0..i alone", f"{r.prefix_output:.1e}")
    console.print(c)
    say(console, "The future gets exactly 0 and each row sums to 1 over the keys it may see. So training "
        "can score every position of a text at once, and generation, which only ever has the tokens so "
        "far, computes the same thing.", "dim")


@dataclass
class QKResult:
    """Scores (T, T) of one head with W_Q = W_K (``tied``) and with separate matrices; their
    largest asymmetry max |s_ij − s_ji|; ``hand``: max |tied − (W x_i)·(W x_j)/√d| by hand."""

    tokens: list[str]
    dim: int
    tied: list[list[float]]
    separate: list[list[float]]
    tied_asymmetry: float
    separate_asymmetry: float
    tied_weights_asymmetry: float
    hand: float


def explain_qk(dim: int = 8, seed: int = 0) -> QKResult:
    """One random single-head layer, as built and with its key rows set to its query rows."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    sep = _layer(dim, seed)
    tied = _layer(dim, seed)
    with torch.no_grad():
        w = tied.qkv.weight  # (3·dim, dim): rows [W_Q | W_K | W_V]
        w[dim : 2 * dim] = w[:dim]
        if tied.qkv.bias is not None:
            tied.qkv.bias[dim : 2 * dim] = tied.qkv.bias[:dim]
        T = len(QK_TOKENS)
        x = torch.randn(1, T, dim, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        s_tied, s_sep = _scores(tied, x), _scores(sep, x)
        wq, bq = w[:dim], (tied.qkv.bias[:dim] if tied.qkv.bias is not None else 0)
        proj = x[0] @ wq.T + bq  # W x_i (+ b), by hand
        hand = float((s_tied - proj @ proj.T / math.sqrt(dim)).abs().max())
        p = torch.softmax(s_tied, -1)
    return QKResult(QK_TOKENS, dim, s_tied.tolist(), s_sep.tolist(), float((s_tied - s_tied.T).abs().max()),
                    float((s_sep - s_sep.T).abs().max()), float((p - p.T).abs().max()), hand)


def render_qk(r: QKResult, console: Console) -> None:
    """Print the tables of ``qkv explain qk``."""
    from qkv.explain._render import add_row, say, table
    from qkv.viz.tokens import show_tokens

    say(console, "Scores s_ij of one head; rows: queries i, columns: keys j (CS189 Lec 21).", "dim")
    for title, m in ((f"W_Q = W_K: (W x_i)·(W x_j)/√{r.dim}", r.tied), ("W_Q ≠ W_K", r.separate)):
        t = table(title, ["", *show_tokens(r.tokens)])
        for tok, row in zip(show_tokens(r.tokens), m, strict=True):
            add_row(t, tok, *(f"{v:.3f}" for v in row))
        console.print(t)
    c = table("how far from symmetric", ["scores", "max |s_ij − s_ji|"])
    add_row(c, "W_Q = W_K", f"{r.tied_asymmetry:.1e}")
    add_row(c, "W_Q ≠ W_K", f"{r.separate_asymmetry:.3f}")
    add_row(c, "W_Q = W_K, after the row softmax", f"{r.tied_weights_asymmetry:.3f}")
    console.print(c)
    say(console, f"With one matrix, how much {r.tokens[0]!r} attends to {r.tokens[1]!r} scores the same "
        f"as how much {r.tokens[1]!r} attends to {r.tokens[0]!r} (checked by hand: {r.hand:.0e}); two "
        "matrices let the relation be one-way (CS189 Lec 21). The weights differ only because each row "
        "is normalised by its own sum.", "dim")
