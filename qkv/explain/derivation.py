"""``qkv explain derivation``: self-attention built up in the notes' order, one step at a time.

CS189 Lec 22 (and its guide, 001): first the parameter-free proposal, "average every token's
value", which treats all context as equally important; then content-based weights from the raw
vectors, p_ij = softmax_j(x_iᵀx_j), z_i = Σ_j p_ij x_j ("values are first the raw x_i"); then
learned queries and keys (W_Q, W_K: "attention is a layer"), then values W_V x_j. CS231N Lec 8
generalises the same way: a scaled dot product instead of a learned f_att, all queries at once
(E = QKᵀ/√d, one matrix product) and keys apart from values. Each step is computed on the notes'
sentence with random word vectors, and the last step is checked against the matrix form and
against :class:`qkv.attention.MultiHeadAttention` with the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import MultiHeadAttention

if TYPE_CHECKING:
    from rich.console import Console

SENTENCE = "the food was good not bad at all"
SWAPPED = "the food was bad not good at all"


@dataclass
class Step:
    """One step: its formula, the mean weight a token puts on itself, how far apart two tokens'
    outputs are at most (0: every token gets the same output), and how far the two sentences'
    outputs for the word 'good' are (0: word order made no difference)."""

    name: str
    formula: str
    self_weight: float
    spread: float
    order_matters: float


@dataclass
class DerivationResult:
    dim: int
    tokens: list[str]
    steps: list[Step]
    loop_vs_matrix: float  # max |row-by-row step 4 − softmax(QKᵀ/√d)V|
    layer_vs_matrix: float  # max |MultiHeadAttention (1 head, same weights, no out_proj) − matrix|


def _step(name: str, formula: str, weights: torch.Tensor, out: torch.Tensor, out_swapped: torch.Tensor,
          where: tuple[int, int]) -> Step:
    spread = float(torch.cdist(out, out).max())
    a, b = where
    moved = float((out[a] - out_swapped[b]).norm())
    return Step(name, formula, float(weights.diagonal().mean()), spread, moved)


def explain_derivation(dim: int = 16, seed: int = 0) -> DerivationResult:
    """The four steps on the notes' sentence, words as seeded random vectors of width ``dim``."""
    if not 2 <= dim <= 1024:
        raise ValueError(f"dim must be in 2..1024, got {dim}")
    g = torch.Generator().manual_seed(seed)
    words = sorted(set(SENTENCE.split()))
    emb = dict(zip(words, torch.randn(len(words), dim, generator=g, dtype=torch.float64), strict=True))
    x = torch.stack([emb[w] for w in SENTENCE.split()])  # (T, d)
    xs = torch.stack([emb[w] for w in SWAPPED.split()])
    T = x.shape[0]
    where = (SENTENCE.split().index("good"), SWAPPED.split().index("good"))
    wq, wk, wv = (torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim) for _ in range(3))
    steps = []
    uniform = torch.full((T, T), 1.0 / T, dtype=torch.float64)
    steps.append(_step("average every value", "z_i = (1/n) Σ_j x_j", uniform, uniform @ x, uniform @ xs,
                       where))

    def soft(q: torch.Tensor, k: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.softmax(q @ k.T / scale, dim=-1)

    p = soft(x, x)
    steps.append(_step("content-based, raw vectors", "z_i = Σ_j softmax_j(x_iᵀ x_j) x_j", p, p @ x,
                       soft(xs, xs) @ xs, where))
    p = soft(x @ wq.T, x @ wk.T)
    ps = soft(xs @ wq.T, xs @ wk.T)
    steps.append(_step("learned queries and keys", "z_i = Σ_j softmax_j((W_Q x_i)ᵀ(W_K x_j)) x_j", p, p @ x,
                       ps @ xs, where))
    q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
    p = soft(q, k, math.sqrt(dim))
    steps.append(_step("+ values, scaled (the layer)", "z_i = Σ_j softmax_j(q_iᵀk_j/√d) W_V x_j", p, p @ v,
                       soft(xs @ wq.T, xs @ wk.T, math.sqrt(dim)) @ (xs @ wv.T), where))
    loop = torch.stack([sum(torch.softmax(torch.stack([q[i] @ k[j] / math.sqrt(dim) for j in range(T)]), 0)[j]
                            * v[j] for j in range(T)) for i in range(T)])
    layer = MultiHeadAttention(dim, 1, bias=False, backend="reference").double()
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat([wq, wk, wv]))
        layer.out_proj.weight.copy_(torch.eye(dim, dtype=torch.float64))
        got = layer(x[None]).out[0]
    matrix = p @ v
    return DerivationResult(dim, SENTENCE.split(), steps, float((loop - matrix).abs().max()),
                            float((got - matrix).abs().max()))


def render_derivation(r: DerivationResult, console: Console) -> None:
    """Print the table of ``qkv explain derivation``."""
    from qkv.explain._render import add_row, say, table

    t = table(f"self-attention step by step on {' '.join(r.tokens)!r} (random word vectors, width {r.dim})",
              ["step", "formula", "mean weight on itself", "max ‖z_i − z_j‖", "'good': ‖z(A) − z(B)‖"])
    for s in r.steps:
        add_row(t, s.name, s.formula, f"{s.self_weight:.3f}", f"{s.spread:.3f}", f"{s.order_matters:.2e}")
    console.print(t)
    say(console, f"B = {SWAPPED!r}. Averaging gives every token the same output (spread 0): all context "
        "counts equally (CS189). Raw vectors make each token look mostly at itself (x_iᵀx_i = ‖x_i‖² wins). "
        "Learned W_Q, W_K choose what to look for; W_V what to pass on. Without positions no step can tell "
        "A from B (last column: 0): that is what positional encodings add (`qkv explain positions`).", "dim")
    say(console, "All queries at once, softmax(QKᵀ/√d)V, equals the row-by-row sums "
        f"({r.loop_vs_matrix:.0e}) "
        f"and qkv's MultiHeadAttention with the same W_Q, W_K, W_V ({r.layer_vs_matrix:.0e}) (CS231N Lec 8).",
        "dim")
