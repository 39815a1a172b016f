"""``qkv explain worked-example``: self-attention by hand, then as one matrix product.

CS189 Discussion 10 problem 1 (F25 Dis10 Q1): three 2-D tokens x₁ = [2, 3], x₂ = [-1, 0],
x₃ = [1, -2] and small integer weights W_Q, W_K (2x3) and W_V (2x2). Each token's query,
key and value are q_i = W_Qᵀx_i, k_i = W_Kᵀx_i, v_i = W_Vᵀx_i; token i's scores are
s_ij = q_iᵀk_j (divided by √d_k = √3 in the Transformer's scaled form), its weights
p_i = softmax(s_i) and its output z_i = Σ_j p_ij v_j. The same numbers in matrix form:
Q = XW_Q, K = XW_K, V = XW_V and Z = softmax(QKᵀ/√d_k)V (CS189 Lec 22).

The Discussion itself leaves the scores unscaled: then x₃ puts 0.9975 of its weight on x₂,
"a slightly larger inner product makes the softmax very peaked".

The step-by-step numbers use plain vector sums and :func:`qkv.attention.softmax`; the matrix
form is :func:`qkv.attention.scaled_dot_product_attention`, qkv's reference backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import scaled_dot_product_attention, softmax

if TYPE_CHECKING:
    from rich.console import Console

X = ((2.0, 3.0), (-1.0, 0.0), (1.0, -2.0))  # tokens x₁, x₂, x₃ (rows)
W_Q = ((1.0, 0.0, 2.0), (0.0, 1.0, -3.0))
W_K = ((0.0, 0.0, -1.0), (-2.0, 0.0, 1.0))
W_V = ((8.0, 0.0), (0.0, 9.0))


@dataclass
class WorkedExample:
    """Every intermediate of the worked example (lists of floats, float64).

    q, k, v: one row per token. scores[i][j] = q_iᵀk_j (unscaled); scale: 1/√d_k or 1;
    weights: softmax(scale · scores) row by row; out[i] = Σ_j weights[i][j] v_j.
    matrix_weights/matrix_out: the same from softmax(QKᵀ·scale)V in one call;
    max_abs_diff: the largest difference between the two routes.
    """

    x: list[list[float]]
    w_q: list[list[float]]
    w_k: list[list[float]]
    w_v: list[list[float]]
    q: list[list[float]]
    k: list[list[float]]
    v: list[list[float]]
    scores: list[list[float]]
    scale: float
    weights: list[list[float]]
    out: list[list[float]]
    matrix_weights: list[list[float]]
    matrix_out: list[list[float]]
    max_abs_diff: float
    unscaled_weights: list[list[float]]  # softmax(scores) row by row: the Discussion's numbers
    unscaled_out: list[list[float]]  # Σ_j unscaled_weights[i][j] v_j: the Discussion's outputs


def _project(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Wᵀx written as a sum of columns: Σ_r x[r] · W[r, :] (one token)."""
    return sum(x[r] * w[r] for r in range(w.shape[0]))


def explain_worked_example(scaled: bool = True) -> WorkedExample:
    """Work Discussion 10 problem 1 token by token and check it against the matrix form.

    Args:
        scaled: divide the scores by √d_k (the Transformer); False: as the Discussion does.
    """
    x = torch.tensor(X, dtype=torch.float64)
    wq, wk, wv = (torch.tensor(w, dtype=torch.float64) for w in (W_Q, W_K, W_V))
    n, d_k = x.shape[0], wq.shape[1]
    scale = 1.0 / math.sqrt(d_k) if scaled else 1.0
    q = torch.stack([_project(wq, x[i]) for i in range(n)])  # (n, d_k)
    k = torch.stack([_project(wk, x[i]) for i in range(n)])  # (n, d_k)
    v = torch.stack([_project(wv, x[i]) for i in range(n)])  # (n, d_v)
    scores = torch.tensor([[float((q[i] * k[j]).sum()) for j in range(n)] for i in range(n)],
                          dtype=torch.float64)  # s_ij = q_iᵀ k_j
    weights = torch.stack([softmax(scale * scores[i]) for i in range(n)])
    out = torch.stack([sum(weights[i, j] * v[j] for j in range(n)) for i in range(n)])
    # Matrix form: Q = XW_Q, K = XW_K, V = XW_V as (B=1, H=1, T, D) tensors.
    Q, K, V = ((x @ w)[None, None] for w in (wq, wk, wv))
    mat = scaled_dot_product_attention(Q, K, V, scale=scale, return_weights=True)
    m_out, m_w = mat.out[0, 0], mat.weights[0, 0]
    diff = max(float((m_out - out).abs().max()), float((m_w - weights).abs().max()))
    return WorkedExample(
        x=x.tolist(), w_q=wq.tolist(), w_k=wk.tolist(), w_v=wv.tolist(), q=q.tolist(), k=k.tolist(),
        v=v.tolist(), scores=scores.tolist(), scale=scale, weights=weights.tolist(), out=out.tolist(),
        matrix_weights=m_w.tolist(), matrix_out=m_out.tolist(), max_abs_diff=diff,
        unscaled_weights=softmax(scores, dim=-1).tolist(),
        unscaled_out=(softmax(scores, dim=-1) @ v).tolist(),
    )


def render_worked_example(r: WorkedExample, console: Console) -> None:
    """Print the steps of ``qkv explain worked-example``."""
    from qkv.explain._render import add_row, say, table, vec

    def mat(m: list[list[float]]) -> str:
        return "[" + ", ".join(vec(row, 0) for row in m) + "]"

    say(console, "CS189 Discussion 10 problem 1: three 2-D tokens, integer weights; "
        "q_i = W_Qᵀx_i, k_i = W_Kᵀx_i, v_i = W_Vᵀx_i", "bold")
    say(console, f"  W_Q = {mat(r.w_q)}  W_K = {mat(r.w_k)}  W_V = {mat(r.w_v)}")
    t = table("step 1: project every token", ["token", "x_i", "q_i = W_Qᵀx_i", "k_i = W_Kᵀx_i",
                                               "v_i = W_Vᵀx_i"])
    for i in range(len(r.x)):
        add_row(t, f"x{i + 1}", vec(r.x[i], 0), vec(r.q[i], 0), vec(r.k[i], 0), vec(r.v[i], 0))
    console.print(t)
    d_k = len(r.q[0])
    heads = ["query", "scores s_i", "weights p_i", "output z_i"]
    # The notes' numbers first: Discussion 10 leaves the scores unscaled (its answer key: 0.9975)
    s = table("step 2-4, as Discussion 10 computes it: s_ij = q_iᵀk_j, p_i = softmax(s_i), "
              "z_i = Σ_j p_ij v_j", heads)
    for i in range(len(r.x)):
        add_row(s, f"x{i + 1}", vec(r.scores[i], 0), vec(r.unscaled_weights[i]), vec(r.unscaled_out[i]))
    console.print(s)
    say(console, f"The Discussion's answer: x3 puts {r.unscaled_weights[2][1]:.4f} of its weight on x2 "
        "(a slightly larger inner product makes the softmax very peaked).", "dim")
    root = f"/√{d_k}" if r.scale != 1 else ""
    if r.scale != 1:
        t2 = table(f"the same with the Transformer's scaling (qkv's attention): p_i = softmax(s_i/√{d_k})",
                   heads)
        for i in range(len(r.x)):
            add_row(t2, f"x{i + 1}", vec(r.scores[i], 0), vec(r.weights[i]), vec(r.out[i]))
        console.print(t2)
        say(console, f"Dividing by √d_k = √{d_k} ≈ {math.sqrt(d_k):.3f} softens x3's row from "
            f"{vec(r.unscaled_weights[2])} to {vec(r.weights[2])} (see `qkv explain scaling`).", "dim")
    say(console, f"matrix form softmax(QKᵀ{root})V gives the same weights and outputs as the token-by-token "
        f"sums: largest difference {r.max_abs_diff:.1e} "
        f"({'equal' if r.max_abs_diff < 1e-12 else 'NOT EQUAL'} in float64).")
