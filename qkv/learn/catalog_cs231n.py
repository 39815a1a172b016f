"""Exercises for Stanford CS231N Lecture 8 (attention and Transformers, Justin Johnson), one or
two per section of the lecture index: a GRU cell (the seq2seq RNN), scores for many queries at
once, cross-attention, a permutation matrix, padding masks, splitting and merging heads, the cost
table of Vaswani et al. (2017), the language model's loss and its sampler, and a ViT's embedding.

Same rules as :mod:`qkv.learn.catalog`: each check compares with an independent reference
(PyTorch's own modules and ops, float64 formulas, counts measured in the check), runs small inputs
first, and names a recognised mistake. Conventions are qkv's: a boolean mask is True where a query
may attend.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.learn.exercise import (
    CheckError,
    Exercise,
    as_tensor,
    check,
    close,
    forbid,
    gen,
    gradcheck,
    randn,
    show,
)
from qkv.learn.exercise import (
    pair as _pair,
)

# --------------------------------------------------------------------------- GRU cell

S_SEQ2SEQ = "Seq2seq RNNs and the fixed-length bottleneck"


def _gru_inputs(
    B: int, n_in: int, H: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, ...]:
    return (
        randn(B, n_in, seed=seed, dtype=dtype),
        randn(B, H, seed=seed + 1, dtype=dtype),
        randn(3 * H, n_in, seed=seed + 2, dtype=dtype) * 0.5,
        randn(3 * H, H, seed=seed + 3, dtype=dtype) * 0.5,
        randn(3 * H, seed=seed + 4, dtype=dtype) * 0.5,
        randn(3 * H, seed=seed + 5, dtype=dtype) * 0.5,
    )


def ref_gru(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor) -> Tensor:
    """PyTorch's own nn.GRUCell with these weights (float64), cast back to x's dtype."""
    cell = torch.nn.GRUCell(x.shape[1], h.shape[1]).double()
    with torch.no_grad():
        for p, t in zip((cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh),
                        (w_ih, w_hh, b_ih, b_hh), strict=True):
            p.copy_(t.double())
        return cell(x.double(), h.double()).to(x.dtype)


def _gru_variants(
    x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor
) -> dict[str, Tensor]:
    """What the common mistakes give, in float64."""
    x, h = x.double(), h.double()
    gi = x @ w_ih.double().T + b_ih.double()
    gh = h @ w_hh.double().T + b_hh.double()
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    H = h.shape[1]
    w_hn, b_hn = w_hh.double()[2 * H:], b_hh.double()[2 * H:]
    return {
        "swapped": z * n + (1 - z) * h,
        "bias_outside": (1 - z) * torch.tanh(i_n + r * (h @ w_hn.T) + b_hn) + z * h,
        "reset_before": (1 - z) * torch.tanh(i_n + (r * h) @ w_hn.T + b_hn) + z * h,
        "z_r_order": (1 - r) * torch.tanh(i_n + z * h_n) + r * h,
    }


@check("h' against torch.nn.GRUCell with the same weights (float64 and float32, several sizes)")
def _gru_values(f) -> None:
    for (B, n_in, H), dtype, seed in (((1, 1, 2), torch.float64, 0), ((3, 4, 5), torch.float64, 10),
                                       ((2, 6, 3), torch.float32, 20)):
        ins = _gru_inputs(B, n_in, H, seed, dtype)
        v = _gru_variants(*ins)
        close(
            f(*ins),
            ref_gru(*ins),
            "gru_cell(x, h, w_ih, w_hh, b_ih, b_hh)",
            f"B, input size, hidden size = {(B, n_in, H)} ({dtype})",
            rtol=1e-5 if dtype == torch.float32 else 1e-7,
            atol=1e-6 if dtype == torch.float32 else 1e-9,
            causes=[
                (v["swapped"], "the update gate is swapped: h' = (1 − z)·n + z·h "
                 "(z = 1 keeps the old state)"),
                (v["bias_outside"], "b_hn is left outside the reset gate: n = tanh(W_in x + b_in + "
                 "r ⊙ (W_hn h + b_hn)), the reset gate multiplies the bias too (PyTorch's convention)"),
                (v["reset_before"], "the reset gate is applied to h before W_hn (Cho et al. 2014's form); "
                 "PyTorch's applies it after: r ⊙ (W_hn h + b_hn)"),
                (v["z_r_order"], "the gates are read in the order (z, r, n); PyTorch stacks them (r, z, n): "
                 "rows 0..H-1 of w_ih are the reset gate's"),
            ],
        )


@check("its gradient with respect to every input (torch.autograd.gradcheck, float64)")
def _gru_grad(f) -> None:
    gradcheck(f, _gru_inputs(2, 3, 2, seed=30), "gru_cell")


GRU_CELL = Exercise(
    name="gru_cell",
    section=S_SEQ2SEQ,
    difficulty=2,
    signature="(x, h, w_ih, w_hh, b_ih, b_hh)",
    stub="""
One step of a GRU (Cho et al. 2014), the recurrent cell of a seq2seq encoder and decoder, in
torch.nn.GRUCell's convention:

    r  = σ(W_ir x + b_ir + W_hr h + b_hr)            reset gate
    z  = σ(W_iz x + b_iz + W_hz h + b_hz)            update gate
    n  = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))   candidate (r multiplies the bias b_hn too)
    h' = (1 − z) ⊙ n + z ⊙ h                         z = 1 keeps the old state

Args: x (B, in), h (B, H); w_ih (3H, in) and w_hh (3H, H) stack the gates' weights in the order
r, z, n (rows 0..H-1 are r's); b_ih, b_hh (3H,) likewise. Returns h' (B, H), x's dtype.
Do not call nn.GRUCell, nn.GRU or torch's gru_cell.

Example: with all weights and biases 0, r = z = 0.5, n = 0, so h' = 0.5·h.
(CS231N Lec 8: the encoder squeezes the whole input into its last h, the fixed-length bottleneck.)
""",
    checks=(_gru_values, _gru_grad, forbid("GRUCell", "GRU", "gru_cell")),
    hints=(
        "gi = x @ w_ih.T + b_ih and gh = h @ w_hh.T + b_hh are (B, 3H); "
        ".chunk(3, dim=-1) gives their r, z, n parts.",
        "r = sigmoid(i_r + h_r), z = sigmoid(i_z + h_z), n = tanh(i_n + r * h_n): h_n already holds b_hn.",
        "h' = (1 - z) * n + z * h.",
    ),
    see="qkv explain bottleneck",
    forbidden=("GRUCell", "GRU", "gru_cell"),
    solution="""
def gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
    i_r, i_z, i_n = (x @ w_ih.T + b_ih).chunk(3, dim=-1)
    h_r, h_z, h_n = (h @ w_hh.T + b_hh).chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h
""",
)


# --------------------------------------------------------------------------- scores: three generalisations

S_THREE = "Three generalisations: scaled dot product, many queries at once, keys apart from values"


def ref_scores(q: Tensor, k: Tensor, scaled: bool = True) -> Tensor:
    s = q.double() @ k.double().transpose(-1, -2)
    return (s / math.sqrt(q.shape[-1]) if scaled else s).to(q.dtype)


def _scores_shape(got: Any, q: Tensor, k: Tensor) -> None:
    got = as_tensor(got, "attention_scores(q, k)")
    flipped = (*q.shape[:-2], k.shape[-2], q.shape[-2])
    if q.shape[-2] != k.shape[-2] and tuple(got.shape) == flipped:
        raise CheckError(
            f"attention_scores has shape {tuple(got.shape)} for q {tuple(q.shape)}, k {tuple(k.shape)}: "
            "rows are queries and columns keys, E = Q Kᵀ (Tq, Tk), not K Qᵀ"
        )


@check("E = Q Kᵀ / √d for many queries at once: (..., Tq, d) x (..., Tk, d) -> (..., Tq, Tk)")
def _scores_values(f) -> None:
    for qs, ks, dtype, seed in (((1, 2), (1, 2), torch.float64, 0), ((3, 4), (5, 4), torch.float64, 1),
                                ((2, 3, 4, 8), (2, 3, 6, 8), torch.float64, 2), ((2, 5, 16), (2, 7, 16),
                                                                                  torch.float32, 3)):
        q, k = randn(*qs, seed=seed, dtype=dtype), randn(*ks, seed=seed + 10, dtype=dtype)
        got = f(q, k)
        _scores_shape(got, q, k)
        raw = ref_scores(q, k, scaled=False)
        close(
            got,
            ref_scores(q, k),
            "attention_scores(q, k)",
            f"q {qs}, k {ks} ({dtype})",
            rtol=1e-5 if dtype == torch.float32 else 1e-7,
            atol=1e-6 if dtype == torch.float32 else 1e-9,
            causes=[
                (raw / qs[-1], "the scores are divided by d; the lecture divides by √d, the standard "
                 "deviation of q·k (its variance is d)"),
                (raw, "the scores are not divided by √d (d = q.shape[-1])"),
            ],
        )


@check("scaled=False gives the plain dot products q·k")
def _scores_unscaled(f) -> None:
    q, k = randn(2, 3, 4, seed=4), randn(2, 5, 4, seed=5)
    got = f(q, k, scaled=False)
    _scores_shape(got, q, k)
    close(got, ref_scores(q, k, scaled=False), "attention_scores(q, k, scaled=False)",
          "q (2, 3, 4), k (2, 5, 4)",
          causes=[(ref_scores(q, k), "scaled=False still divides by √d: divide only when scaled is True")])


@check("unit-variance q, k: scaled scores have variance ≈ 1 for d = 4 and d = 256; unscaled ≈ d")
def _scores_variance(f) -> None:
    for d, n, seed in ((4, 512, 6), (256, 256, 7)):
        q, k = randn(n, d, seed=seed), randn(n, d, seed=seed + 100)
        scaled = as_tensor(f(q, k), "attention_scores(q, k)").double()
        plain = as_tensor(f(q, k, scaled=False), "attention_scores(q, k, scaled=False)").double()
        want_s, want_p = ref_scores(q, k).var().item(), ref_scores(q, k, False).var().item()
        vs, vp = scaled.var().item(), plain.var().item()
        if abs(vs - 1) > 0.25 or abs(vs - want_s) > 1e-6 * want_s:
            why = (": divided by d, not √d" if abs(vs * d - want_s) < 1e-3 * want_s else
                   ": not divided at all" if abs(vs - want_p) < 1e-3 * want_p else "")
            raise CheckError(
                f"for d = {d}, {n}x{n} scores of unit-variance vectors have variance {vs:.4g}; dividing "
                f"by √d makes it ≈ 1 (this sample: {want_s:.4f}){why}"
            )
        if abs(vp / d - 1) > 0.25 or abs(vp - want_p) > 1e-6 * want_p:
            raise CheckError(
                f"for d = {d} the unscaled scores have variance {vp:.4g}; q·k of unit-variance vectors "
                f"has variance d = {d} (this sample: {want_p:.1f})"
            )


@check("its gradient (gradcheck, float64)")
def _scores_grad(f) -> None:
    gradcheck(f, (randn(2, 3, 4, seed=8), randn(2, 5, 4, seed=9)), "attention_scores")


SCORES = Exercise(
    name="attention_scores",
    section=S_THREE,
    difficulty=1,
    signature="(q, k, scaled=True)",
    stub="""
The scores of attention after the lecture's three generalisations of the RNN's alignment:
1. scaled dot product: similarity(q, k) = q·k / √d (q·k of unit-variance vectors has variance
   d; divided by √d its variance is 1, so the softmax does not saturate);
2. many queries at once: all Tq queries against all Tk keys in one matrix product, E = Q Kᵀ / √d;
3. keys apart from values: the scores use the keys K = X W_K only; the values V = X W_V are what
   softmax(E) then averages (out = softmax(E) V), so K and V may differ.

Args: q (..., Tq, d), k (..., Tk, d) with the same leading (batch, head) dimensions.
Returns E (..., Tq, Tk): row i is query i, column j key j; divided by √d when ``scaled``, the
plain dot products otherwise. Keep q's dtype.

Example: q = [[1, 2]], k = [[3, 4], [1, 0]] -> [[11/√2, 1/√2]] = [[7.778, 0.707]]
(CS231N Lec 8; Vaswani et al. 2017 §3.2.1.)
""",
    checks=(_scores_values, _scores_unscaled, _scores_variance, _scores_grad,
            forbid("scaled_dot_product_attention", "MultiheadAttention")),
    hints=(
        "q @ k.transpose(-1, -2) is every query against every key: (..., Tq, Tk).",
        "d = q.shape[-1]; divide by math.sqrt(d) only when scaled is True.",
    ),
    see="qkv explain scaling",
    forbidden=("scaled_dot_product_attention", "MultiheadAttention"),
    solution="""
def attention_scores(q, k, scaled=True):
    e = q @ k.transpose(-1, -2)
    return e / math.sqrt(q.shape[-1]) if scaled else e
""",
)


# --------------------------------------------------------------------------- cross-attention

S_CROSS = "Cross-attention and self-attention"


def ref_cross(x: Tensor, memory: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor) -> tuple[Tensor, Tensor]:
    q, k, v = x.double() @ w_q.double(), memory.double() @ w_k.double(), memory.double() @ w_v.double()
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return (w @ v).to(x.dtype), w.to(x.dtype)


def _cross_inputs(
    B: int, Tq: int, Tk: int, D: int, Dm: int, dk: int, dv: int, seed: int
) -> tuple[Tensor, ...]:
    return (randn(B, Tq, D, seed=seed), randn(B, Tk, Dm, seed=seed + 1), randn(D, dk, seed=seed + 2) * 0.6,
            randn(Dm, dk, seed=seed + 3) * 0.6, randn(Dm, dv, seed=seed + 4))


@check("out and weights against softmax((x W_q)(memory W_k)ᵀ/√d_k)(memory W_v); Tq ≠ Tk, D ≠ D_m")
def _cross_values(f) -> None:
    for dims, seed in (((1, 3, 3, 4, 4, 4, 2), 0), ((2, 2, 5, 4, 6, 3, 5), 10), ((2, 6, 3, 5, 3, 4, 2), 20)):
        x, mem, wq, wk, wv = _cross_inputs(*dims, seed=seed)
        want_out, want_w = ref_cross(x, mem, wq, wk, wv)
        out, w = _pair(f(x, mem, wq, wk, wv), "cross_attention")
        q, k = x @ wq, mem @ wk
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causes = [(torch.softmax(s, -2), "the weights are normalised over the queries (dim −2); each query's "
                   "weights sum to 1 over the memory's keys: softmax along the last dimension")]
        if x.shape == mem.shape:  # the mistakes that need keys of x's shape
            causes.append((torch.softmax(q @ (x @ wk).transpose(-1, -2) / math.sqrt(q.shape[-1]), -1),
                           "the keys are computed from x: that is self-attention; in cross-attention the "
                           "keys and values come from memory (the encoder), the queries from x"))
        inputs = "B, Tq, Tk, D, D_m, d_k, d_v = " + str(dims)
        close(w, want_w, "weights", inputs, causes=causes)
        close(out, want_out, "out", inputs, causes=[
            (want_w @ (x @ wv), "the values are computed from x; they come from memory, like the keys")
        ] if x.shape == mem.shape else [])


@check("one query at a time gives the same rows; permuting memory's tokens changes nothing")
def _cross_props(f) -> None:
    x, mem, wq, wk, wv = _cross_inputs(2, 4, 5, 3, 6, 4, 3, seed=40)
    out, _ = _pair(f(x, mem, wq, wk, wv), "cross_attention")
    out = as_tensor(out, "out")
    for i in range(4):
        one, _ = _pair(f(x[:, i:i + 1], mem, wq, wk, wv), "cross_attention")
        if not torch.allclose(as_tensor(one, "out").double(), out[:, i:i + 1].double(), atol=1e-10):
            raise CheckError(f"query {i} alone gives another output than with the others: each query's "
                             "output depends only on itself and on memory (softmax over the keys)")
    perm = torch.randperm(5, generator=gen(41))
    again, _ = _pair(f(x, mem[:, perm], wq, wk, wv), "cross_attention")
    if not torch.allclose(as_tensor(again, "out").double(), out.double(), atol=1e-10):
        raise CheckError("permuting the memory's tokens changed the output: attention reads memory as a set "
                         "(no positions), a weighted average over it")


@check("its gradient (gradcheck, float64)")
def _cross_grad(f) -> None:
    gradcheck(lambda *a: f(*a)[0], _cross_inputs(1, 2, 3, 3, 2, 2, 2, seed=50), "cross_attention's out")


CROSS = Exercise(
    name="cross_attention",
    section=S_CROSS,
    difficulty=2,
    signature="(x, memory, w_q, w_k, w_v)",
    stub="""
Cross-attention: the queries come from one set of vectors (x, e.g. the decoder's tokens), the
keys and values from another (memory, e.g. the encoder's outputs or an image's patches).

    Q = x W_q,  K = memory W_k,  V = memory W_v,  A = softmax(Q Kᵀ / √d_k),  out = A V

Args: x (B, Tq, D), memory (B, Tk, D_m), w_q (D, d_k), w_k (D_m, d_k), w_v (D_m, d_v), applied as
``x @ w``. Returns (out (B, Tq, d_v), weights (B, Tq, Tk)): each query's weights sum to 1 over
the Tk memory tokens. Tq and Tk may differ. Self-attention is the case memory = x.
Do not call F.scaled_dot_product_attention or nn.MultiheadAttention.

Example: with w_q = 0 every query weights memory uniformly (1/Tk each) and out is the mean of V.
(CS231N Lec 8: "cross-attention and self-attention"; the Transformer's decoder, Vaswani et al. 2017.)
""",
    checks=(_cross_values, _cross_props, _cross_grad,
            forbid("scaled_dot_product_attention", "MultiheadAttention")),
    hints=(
        "q = x @ w_q (B, Tq, d_k); k = memory @ w_k (B, Tk, d_k); v = memory @ w_v (B, Tk, d_v).",
        "scores = q @ k.transpose(-1, -2) / math.sqrt(d_k) is (B, Tq, Tk); softmax over dim=-1 (the keys).",
    ),
    see="qkv train seq2seq --arch transformer",
    forbidden=("scaled_dot_product_attention", "MultiheadAttention"),
    solution="""
def cross_attention(x, memory, w_q, w_k, w_v):
    q, k, v = x @ w_q, memory @ w_k, memory @ w_v
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights
""",
)


# --------------------------------------------------------------------------- permutation matrix

S_EQUIV = "Permutation equivariance"


def _perm_matrix(perm: Tensor) -> Tensor:
    return torch.eye(len(perm), dtype=torch.float64)[perm]


def _perm_of(f, perm: Tensor) -> Tensor:
    P = as_tensor(f(perm), f"permutation_matrix({perm.tolist()})")
    if not P.is_floating_point():
        raise CheckError(f"permutation_matrix({perm.tolist()}) has dtype {P.dtype}: return floats, "
                         "so that P @ X is a matrix product (e.g. torch.eye(T)[perm])")
    return P


def _self_attention(X: Tensor, wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """softmax((X W_q)(X W_k)ᵀ/√d)(X W_v), no positions: the reference written in the check."""
    q, k = X @ wq, X @ wk
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), -1) @ (X @ wv)


@check("(P X)[i] = X[perm[i]] for perm = [0], [2, 0, 1], and random permutations of 5 and 8")
def _perm_values(f) -> None:
    perms = [torch.tensor([0]), torch.tensor([2, 0, 1])]
    perms += [torch.randperm(T, generator=gen(T)) for T in (5, 8)]
    for perm in perms:
        T = len(perm)
        X = randn(T, 3, seed=T)
        P = _perm_of(f, perm)
        want = _perm_matrix(perm)
        close(P.double(), want, f"permutation_matrix({perm.tolist()})", f"perm = {perm.tolist()}",
              causes=[(want.T, "it is transposed: P X = X[argsort(perm)]; row i of P has its 1 in column "
                       "perm[i], so that (P X)[i] = X[perm[i]]")])
        close(P.double() @ X, X[perm], "P @ X", f"perm = {perm.tolist()}")


@check("P is orthogonal: P Pᵀ = I, and Pᵀ undoes it (Pᵀ P X = X)")
def _perm_orthogonal(f) -> None:
    perm = torch.randperm(6, generator=gen(3))
    P = _perm_of(f, perm).double()
    close(P @ P.T, torch.eye(6, dtype=torch.float64), "P @ P.T", f"perm = {perm.tolist()}")
    X = randn(6, 4, seed=4)
    close(P.T @ (P @ X), X, "P.T @ (P @ X)", f"perm = {perm.tolist()}")


@check("self-attention without positions: f(P X) = P f(X) with your P; with positions added it is not")
def _perm_equivariant(f) -> None:
    T, D = 6, 4
    perm = torch.randperm(T, generator=gen(5))
    while bool((perm == torch.arange(T)).all()):  # an identity permutation proves nothing
        perm = perm.roll(1)
    P = _perm_of(f, perm).double()
    X, wq, wk, wv = randn(T, D, seed=6), randn(D, D, seed=7), randn(D, D, seed=8), randn(D, D, seed=9)
    left, right = _self_attention(P @ X, wq, wk, wv), P @ _self_attention(X, wq, wk, wv)
    close(left, right, "f(P X) vs P f(X)", f"perm = {perm.tolist()}")
    close(right, _self_attention(X, wq, wk, wv)[perm], "P f(X)", f"perm = {perm.tolist()}",
          causes=[(_self_attention(X, wq, wk, wv)[torch.argsort(perm)], "your P moves row i to row perm[i] "
                   "(P X = X[argsort(perm)]): it is the transpose of the P with (P X)[i] = X[perm[i]]")])
    pos = randn(T, D, seed=10) * 3
    if torch.allclose(_self_attention(P @ X + pos, wq, wk, wv), P @ _self_attention(X + pos, wq, wk, wv)):
        raise CheckError(f"with positions added, f(P X + E) = P f(X + E) for perm = {perm.tolist()}: "
                         "your P leaves X in place; it should move row perm[i] to row i")


PERMUTATION = Exercise(
    name="permutation_matrix",
    section=S_EQUIV,
    difficulty=1,
    signature="(perm)",
    stub="""
The permutation matrix P of a permutation perm of 0..T-1: the (T, T) matrix with

    (P X)[i] = X[perm[i]]     that is, P[i, perm[i]] = 1 and 0 elsewhere.

Args: perm (T,) a long tensor holding each of 0..T-1 once. Returns P (T, T), floats (float32 or
float64), one 1 in each row and each column. P is orthogonal: P Pᵀ = I, so Pᵀ undoes it.
Self-attention without positions is permutation equivariant: f(P X) = P f(X) (CS231N Lec 8).

Example: perm = [2, 0, 1] -> [[0, 0, 1], [1, 0, 0], [0, 1, 0]]: (P X) = [X[2], X[0], X[1]].
""",
    checks=(_perm_values, _perm_orthogonal, _perm_equivariant),
    hints=(
        "Row i of P is the unit vector e_{perm[i]}: P X picks row perm[i] of X.",
        "The rows of the identity matrix, in the order perm: torch.eye(T)[perm].",
    ),
    see="qkv explain equivariance",
    solution="""
def permutation_matrix(perm):
    T = len(perm)
    P = torch.zeros(T, T)
    P[torch.arange(T), perm] = 1.0
    return P
""",
)


# --------------------------------------------------------------------------- padding mask

S_MASKED = "Masked self-attention: M_ij = 0 or −∞, rows renormalised"


def ref_padding_mask(lengths: Tensor, T: int, causal: bool = False) -> Tensor:
    j = torch.arange(T)
    m = (j[None, None, :] < lengths[:, None, None]).expand(len(lengths), T, T)
    if causal:
        m = m & (j[None, None, :] <= j[None, :, None])
    return m.clone()


def _mask_ref_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@check("mask[b, i, j] = j < lengths[b] (and j ≤ i when causal), bool (B, T, T)")
def _pad_values(f) -> None:
    cases = (([1], 1), ([2, 3], 3), ([3, 1, 4], 5), ([4, 0], 4))
    for causal in (False, True):
        for lens, T in cases:
            lengths = torch.tensor(lens)
            got = f(lengths, T, causal=causal)
            what = f"padding_mask({lens}, {T}, causal={causal})"
            if isinstance(got, Tensor) and got.dtype != torch.bool:
                raise CheckError(f"{what} has dtype {got.dtype}: return bool, True = may attend "
                                 "(the additive form 0 / −inf is derived from it)")
            want = ref_padding_mask(lengths, T, causal)
            i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
            causal_part = (j <= i) if causal else torch.ones(T, T, dtype=torch.bool)
            queries = (i < lengths[:, None, None]).expand(-1, T, T) & causal_part
            both = want & (i < lengths[:, None, None])
            off = (j <= lengths[:, None, None]) & causal_part
            strict = (j < lengths[:, None, None]) & ((j < i) if causal else causal_part)
            close(got, want, what, f"lengths = {lens}, T = {T}", causes=[
                (queries, "the queries are masked instead of the keys: position j is padding when "
                 "j ≥ lengths[b], and no query may attend it (the mask's last index is the key)"),
                (both, "the padded query rows are all False; in this exercise (as in qkv's padding_mask) a "
                 "padded query may attend the real keys: no row is empty, no NaN, and the loss ignores it"),
                (off, "off by one: a sequence of length L has keys 0..L-1, so j < lengths[b], not ≤"),
                (strict, "causal excludes the diagonal; a token may attend itself: j ≤ i"),
            ])


@check("padded query rows may attend every real key (and nothing else), causal or not")
def _pad_rows(f) -> None:
    lengths, T = torch.tensor([2, 5, 3]), 6
    for causal in (False, True):
        m = as_tensor(f(lengths, T, causal=causal), "padding_mask").bool()
        for b, L in enumerate(lengths.tolist()):
            for i in range(L, T):
                want = torch.arange(T) < L
                if m.shape != (3, T, T) or not torch.equal(m[b, i], want):
                    raise CheckError(
                        f"padding_mask([2, 5, 3], 6, causal={causal}): padded query {i} of sequence {b} "
                        f"(length {L}) should be {show(want)} (the real keys), got "
                        f"{show(m[b, i]) if m.shape == (3, T, T) else tuple(m.shape)}"
                    )


@check("with your mask, changing padded tokens never changes a real query's attention output")
def _pad_effect(f) -> None:
    lengths, T, d = torch.tensor([3, 5]), 5, 4
    for causal in (False, True):
        m = as_tensor(f(lengths, T, causal=causal), "padding_mask").bool()
        q, k, v = randn(2, T, d, seed=1), randn(2, T, d, seed=2), randn(2, T, 3, seed=3)
        k2, v2 = k.clone(), v.clone()
        k2[0, 3:], v2[0, 3:] = randn(2, d, seed=4) * 5, randn(2, 3, seed=5) * 5
        a, b = _mask_ref_attention(q, k, v, m), _mask_ref_attention(q, k2, v2, m)
        if not torch.allclose(a[0, :3], b[0, :3]):
            raise CheckError(f"with causal={causal}, changing the padded tokens 3, 4 of a length-3 sequence "
                             "changed the outputs of its real queries 0..2: the padding keys are not masked")
        if torch.isnan(a).any():
            raise CheckError(f"with causal={causal} some query has no key it may attend (NaN rows)")


PADDING_MASK = Exercise(
    name="padding_mask",
    section=S_MASKED,
    difficulty=2,
    signature="(lengths, T, causal=False)",
    stub="""
The mask of a batch of sequences padded to T tokens: sequence b is real at positions
0..lengths[b]-1 and padding after. A bool tensor (B, T, T), True = query i MAY attend key j:

    mask[b, i, j] = j < lengths[b]              (no query attends a padding key)
                    and j ≤ i, when causal      (nor a later token)

The additive form of the lecture is M = 0 where True and −∞ where False; softmax(E + M)
renormalises each row over the allowed keys. Padded query rows (i ≥ lengths[b]) follow the same
rule: they may attend the real keys (never an empty row, so no NaN; their outputs are ignored by
the loss). A sequence of length 0 has no key to attend: its rows are all False.

Args: lengths (B,) long, T ≥ max(lengths). Returns (B, T, T) bool.

Example: padding_mask(torch.tensor([2]), 3) -> [[[T, T, F], [T, T, F], [T, T, F]]];
with causal=True -> [[[T, F, F], [T, T, F], [T, T, F]]]  (CS231N Lec 8, masked self-attention).
""",
    checks=(_pad_values, _pad_rows, _pad_effect),
    hints=(
        "j = torch.arange(T); keys = j[None, None, :] < lengths[:, None, None] is (B, 1, T): it "
        "broadcasts over the queries.",
        "Causal: & (j[None, :, None] >= j[None, None, :]); then expand (or broadcast) to (B, T, T).",
    ),
    see="qkv explain masking",
    solution="""
def padding_mask(lengths, T, causal=False):
    pos = torch.arange(T)
    mask = (pos[None, None, :] < lengths[:, None, None]).expand(len(lengths), T, T)
    if causal:
        mask = mask & (pos[None, :, None] >= pos[None, None, :])
    return mask.clone()
""",
)


# --------------------------------------------------------------------------- split and merge heads

S_HEADS = "Multi-head attention, and its four matrix multiplications"


def ref_split(x: Tensor, h: int) -> Tensor:
    B, T, D = x.shape
    return x.reshape(B, T, h, D // h).transpose(1, 2)  # (B, h, T, D/h)


def ref_merge(x: Tensor) -> Tensor:
    B, h, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, h * d)  # (B, T, h·d)


@check("head j of token t is x[b, t, j·d:(j+1)·d], by values (arange and random inputs)")
def _split_values(f) -> None:
    cases = ((torch.arange(12.0).reshape(1, 2, 6), 2), (torch.arange(24.0).reshape(1, 4, 6), 3),
             (randn(2, 5, 8, seed=1), 4), (randn(2, 3, 6, seed=2), 1), (randn(1, 3, 4, seed=3), 4))
    for x, h in cases:
        B, T, D = x.shape
        want = ref_split(x, h)
        close(f(x, h), want, f"split_heads(x, {h})", f"x = {show(x)}", causes=[
            (x.reshape(B, h, T, D // h), "x.view(B, h, T, D/h) without the transpose has the right shape but "
             "mixes tokens into heads: view(B, T, h, D/h).transpose(1, 2)"),
            (x.reshape(B, T, D // h, h).permute(0, 3, 1, 2), "the heads take every h-th column; "
             "head j is the block of columns j·d..(j+1)·d-1 (view(B, T, h, d), not view(B, T, d, h))"),
        ])


@check("merge_heads(split_heads(x)) = x (the reference merge)")
def _split_roundtrip(f) -> None:
    x = randn(2, 4, 6, seed=4)
    close(ref_merge(as_tensor(f(x, 3), "split_heads(x, 3)")), x, "merge(split_heads(x, 3))", "x (2, 4, 6)")


SPLIT_HEADS = Exercise(
    name="split_heads",
    section=S_HEADS,
    difficulty=1,
    signature="(x, n_heads)",
    stub="""
Split the last dimension into h heads: (B, T, D) -> (B, h, T, D/h), head j holding columns
j·d..(j+1)·d-1 (d = D/h) of every token, in order. Multi-head attention then runs the h heads as
one batched matrix product (the lecture's second and third of four matrix multiplications).

Args: x (B, T, D), n_heads h dividing D. Returns (B, h, T, D/h) with out[b, j, t] = x[b, t, j·d:(j+1)·d].
Beware: x.view(B, h, T, D/h) has the right shape and the wrong values.

Example: x = arange(12).view(1, 2, 6), h = 2 -> head 0 = [[0, 1, 2], [6, 7, 8]],
head 1 = [[3, 4, 5], [9, 10, 11]]  (CS231N Lec 8; Vaswani et al. 2017 §3.2.2.)
""",
    checks=(_split_values, _split_roundtrip),
    hints=(
        "First cut the last dimension: x.view(B, T, h, d) is (B, T, h, d), head j at index j of dim 2.",
        "Then move the heads before the tokens: .transpose(1, 2) -> (B, h, T, d).",
    ),
    see="qkv explain heads",
    solution="""
def split_heads(x, n_heads):
    B, T, D = x.shape
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)
""",
)


def _merge(f, y: Tensor) -> Any:
    try:
        return f(y)
    except RuntimeError as e:
        if "view" not in str(e):
            raise
        raise CheckError("after a transpose the tensor is not contiguous and .view fails: use .reshape "
                         "(or .contiguous().view)") from None


@check("(B, h, T, d) -> (B, T, h·d), head j back in columns j·d..(j+1)·d-1, by values")
def _merge_values(f) -> None:
    cases = (torch.arange(12.0).reshape(1, 2, 2, 3), torch.arange(24.0).reshape(1, 3, 4, 2),
             randn(2, 4, 5, 2, seed=1), randn(2, 1, 3, 6, seed=2))
    for y in cases:
        B, h, T, d = y.shape
        close(_merge(f, y), ref_merge(y), "merge_heads(y)", f"y = {show(y)}", causes=[
            (y.reshape(B, T, h * d), "the heads are reshaped to (B, T, h·d) without moving them back next "
             "to each other first: y.transpose(1, 2).reshape(B, T, h·d)"),
            (y.permute(0, 2, 3, 1).reshape(B, T, h * d), "the heads are interleaved column by column; head j "
             "goes back to the block of columns j·d..(j+1)·d-1"),
        ])


@check("merge_heads(split_heads(x)) = x on the non-contiguous tensor a split returns (use reshape)")
def _merge_roundtrip(f) -> None:
    x = randn(2, 4, 6, seed=3)
    y = ref_split(x, 3)  # a transposed view: not contiguous
    close(_merge(f, y), x, "merge_heads(split(x))", "x (2, 4, 6), 3 heads")


MERGE_HEADS = Exercise(
    name="merge_heads",
    section=S_HEADS,
    difficulty=1,
    signature="(x)",
    stub="""
The inverse of split_heads: concatenate the heads, (B, h, T, d) -> (B, T, h·d), head j in columns
j·d..(j+1)·d-1 of every token. Multi-head attention then multiplies by W_O (the fourth matrix
multiplication of the lecture).

Args: x (B, h, T, d), possibly non-contiguous (a split is a transposed view).
Returns (B, T, h·d) with out[b, t, j·d:(j+1)·d] = x[b, j, t].

Example: x = arange(12).view(1, 2, 2, 3) (2 heads, 2 tokens) -> [[[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]]
(CS231N Lec 8: concatenate the heads, then W_O.)
""",
    checks=(_merge_values, _merge_roundtrip),
    hints=(
        "Move the tokens before the heads again: x.transpose(1, 2) is (B, T, h, d).",
        "Then flatten the last two: .reshape(B, T, h * d) (reshape: the transpose is not contiguous).",
    ),
    see="qkv explain heads",
    solution="""
def merge_heads(x):
    B, h, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, h * d)
""",
)


# --------------------------------------------------------------------------- RNN vs CNN vs self-attention

S_COMPARE = "RNN vs CNN vs self-attention (cost per layer, sequential steps, path length)"


def _layers_to_cover(n: int, k: int) -> int:
    """ceil(log_k n) in integers: the fewest L with k**L >= n."""
    L = 0
    while k**L < n:
        L += 1
    return L


def ref_costs(kind: str, n: int, d: int, k: int = 3) -> tuple[int, int, int]:
    return {"rnn": (n * d * d, n, n), "cnn": (k * n * d * d, 1, _layers_to_cover(n, k)),
            "self-attention": (n * n * d, 1, 1)}[kind]


def measured_dilated_layers(n: int, k: int) -> int:
    """Stack causal width-k convolutions with dilations 1, k, k², ... until the last output's
    gradient reaches all n inputs: the path length, measured."""
    for L in range(40):
        x = torch.zeros(1, 1, n, dtype=torch.float64, requires_grad=True)
        y = x
        for layer in range(L):
            dil = k**layer
            y = F.conv1d(F.pad(y, ((k - 1) * dil, 0)), torch.ones(1, 1, k, dtype=torch.float64), dilation=dil)
        if L == 0:
            y = y * 1.0
        (g,) = torch.autograd.grad(y[0, 0, -1], x)
        if bool((g != 0).all()):
            return L
    raise AssertionError("unreachable: 40 layers cover any n here")


def _costs_of(f, kind: str, n: int, d: int, k: int) -> tuple[int, ...]:
    got = f(kind, n, d, k)
    what = f"layer_costs({kind!r}, n={n}, d={d}, k={k})"
    if not (isinstance(got, tuple | list) and len(got) == 3):
        raise CheckError(f"{what} should return (ops_per_layer, sequential_steps, max_path_length), "
                         f"got {got!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in got):
        raise CheckError(f"{what} = {got!r}: return Python ints (counts), e.g. from math.ceil(...) "
                         "or integer loops")
    return tuple(got)


@check("Vaswani et al. 2017 Table 1: rnn (n·d², n, n), cnn (k·n·d², 1, ⌈log_k n⌉), "
       "self-attention (n²·d, 1, 1)")
def _costs_table(f) -> None:
    for n, d, k in ((4, 2, 3), (10, 8, 3), (100, 512, 3), (125, 64, 5), (9, 16, 3), (1000, 1024, 2)):
        for kind in ("rnn", "cnn", "self-attention"):
            got = _costs_of(f, kind, n, d, k)
            want = ref_costs(kind, n, d, k)
            if got == want:
                continue
            what = f"layer_costs({kind!r}, n={n}, d={d}, k={k}) = {got}, expected {want}"
            other = {"rnn": "self-attention", "self-attention": "rnn"}.get(kind)
            if other and got[0] == ref_costs(other, n, d, k)[0]:
                raise CheckError(f"{what}: the costs of rnn and self-attention are swapped: an RNN does n "
                                 "steps of a d x d matrix product (n·d²); self-attention scores n² pairs "
                                 "of d-vectors (n²·d)")
            if kind == "cnn" and got[2] == math.floor(math.log(n) / math.log(k) + 1e-9) != want[2]:
                raise CheckError(f"{what}: rounded down; {want[2] - 1} layer(s) of width {k} reach only "
                                 f"{k ** (want[2] - 1)} < {n} tokens, so it takes ⌈log_k n⌉ = {want[2]}")
            if kind == "cnn" and got[2] == math.ceil(math.log(n, k)) != want[2]:
                raise CheckError(f"{what}: the float logarithm rounds: math.log({n}, {k}) = "
                                 f"{math.log(n, k)!r} and its ceil is {got[2]}; count in integers: the "
                                 f"fewest L with {k}**L ≥ {n}")
            if kind == "cnn" and got[2] == math.ceil((n - 1) / (k - 1)):
                raise CheckError(f"{what}: that is the path of contiguous kernels (n/k); the table's "
                                 "log_k n is for dilated convolutions (dilation 1, k, k², ...)")
            raise CheckError(what)


@check("the CNN's path length = dilated width-k convolutions stacked until the receptive field "
       "covers n (measured)")
def _costs_measured(f) -> None:
    cases = ((1, 3), (2, 2), (3, 3), (4, 3), (9, 3), (10, 3), (27, 3), (28, 3), (17, 2), (25, 5), (26, 5))
    for n, k in cases:
        got = _costs_of(f, "cnn", n, 8, k)[2]
        want = measured_dilated_layers(n, k)
        if got != want:
            raise CheckError(
                f"layer_costs('cnn', n={n}, d=8, k={k}) says the path is {got} layer(s); stacking width-{k} "
                f"convolutions with dilations 1, {k}, {k * k}, ..., the last output's gradient reaches "
                f"all {n} inputs after {want} (measured): ⌈log_{k} {n}⌉ = {want}"
            )


@check("an unknown kind ('lstm') is a ValueError, not a silent None")
def _costs_unknown(f) -> None:
    try:
        got = f("lstm", 8, 4, 3)
    except ValueError:
        return
    except Exception as e:
        raise CheckError(f"layer_costs('lstm', 8, 4, 3) raised {type(e).__name__}; raise ValueError naming "
                         "the kinds ('rnn', 'cnn', 'self-attention')") from None
    raise CheckError(f"layer_costs('lstm', 8, 4, 3) returned {got!r}; raise ValueError naming the kinds "
                     "('rnn', 'cnn', 'self-attention')")


LAYER_COSTS = Exercise(
    name="layer_costs",
    section=S_COMPARE,
    difficulty=2,
    signature="(kind, n, d, k=3)",
    stub="""
Table 1 of Vaswani et al. (2017) for one layer over n tokens of width d:

    kind               ops per layer   sequential steps   max path length
    'rnn'              n·d²            n                  n
    'cnn'              k·n·d²          1                  ⌈log_k n⌉   (dilated kernels of width k)
    'self-attention'   n²·d            1                  1

The path length is the longest route a signal takes between two tokens (the table's orders
taken literally): an RNN passes information one step at a time (n); stacked convolutions with
dilations 1, k, k², ... see k^L tokens after L layers, so ⌈log_k n⌉ layers (rounded UP; count it
with integers, since math.log(125, 5) = 3.0000000000000004); self-attention connects every pair
in one layer.

Args: kind one of 'rnn', 'cnn', 'self-attention' (anything else: ValueError); n, d, k ints.
Returns (ops_per_layer, sequential_steps, max_path_length), three Python ints.

Example: layer_costs('cnn', 10, 4, 3) -> (480, 1, 3); layer_costs('self-attention', 10, 4) -> (400, 1, 1)
(CS231N Lec 8: RNN vs CNN vs self-attention.)
""",
    checks=(_costs_table, _costs_measured, _costs_unknown),
    hints=(
        "The table's orders taken literally: rnn (n*d*d, n, n), self-attention (n*n*d, 1, 1).",
        "For the CNN's path: L = 0; while k ** L < n: L += 1 (ceil without floats).",
    ),
    see="qkv explain architectures",
    solution="""
def layer_costs(kind, n, d, k=3):
    if kind == "rnn":
        return (n * d * d, n, n)
    if kind == "self-attention":
        return (n * n * d, 1, 1)
    if kind == "cnn":
        layers = 0
        while k ** layers < n:
            layers += 1
        return (k * n * d * d, 1, layers)
    raise ValueError(f"kind must be 'rnn', 'cnn' or 'self-attention', got {kind!r}")
""",
)


# --------------------------------------------------------------------------- language model: the loss

S_LM = "The Transformer: a language model; scale from 2017 to GPT-3"

_CE_FORBIDDEN = ("cross_entropy", "log_softmax", "logsumexp", "nll_loss", "CrossEntropyLoss", "NLLLoss",
                 "LogSoftmax")


def ref_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits.double().reshape(-1, V), targets.reshape(-1)).to(logits.dtype)


def _ce_inputs(
    B: int, T: int, V: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    return randn(B, T, V, seed=seed, dtype=dtype) * 2, torch.randint(0, V, (B, T), generator=gen(seed + 1))


def _ce_mistakes(logits: Tensor, targets: Tensor) -> list[tuple[Tensor, str]]:
    """What the sum and the softmax over the positions give (float64 references)."""
    B, T, _ = logits.shape
    want = ref_cross_entropy(logits, targets)
    lp = logits.double() - torch.logsumexp(logits.double(), 1, keepdim=True)  # normalised over T: wrong
    over_t = (-lp.gather(-1, targets[..., None]).mean()).to(logits.dtype)
    return [
        (want * B * T, "it is the sum over the B·T positions; the loss is their mean"),
        (over_t, "the softmax runs over the positions (dim 1); it is over the vocabulary (dim −1)"),
    ]


@check("the mean next-token loss −log softmax(logits)[target] against F.cross_entropy (float64)")
def _ce_values(f) -> None:
    z, t = torch.zeros(1, 2, 4, dtype=torch.float64), torch.tensor([[0, 3]])
    close(f(z, t), torch.tensor(math.log(4), dtype=torch.float64), "cross_entropy(zeros(1, 2, 4), [[0, 3]])",
          "uniform logits over V = 4 (the loss is log 4 = 1.3863)", causes=_ce_mistakes(z, t))
    for (B, T, V), seed in (((1, 1, 2), 0), ((2, 3, 5), 10), ((3, 4, 11), 20)):
        logits, targets = _ce_inputs(B, T, V, seed)
        close(f(logits, targets), ref_cross_entropy(logits, targets), "cross_entropy(logits, targets)",
              f"logits (B, T, V) = {(B, T, V)}", causes=_ce_mistakes(logits, targets))


@check("logits around 1000 (float32 and float64): finite, equal to F.cross_entropy")
def _ce_large(f) -> None:
    for dtype in (torch.float64, torch.float32):
        logits, targets = _ce_inputs(2, 3, 7, seed=30, dtype=dtype)
        logits = logits + 1000
        got = f(logits, targets)
        if isinstance(got, Tensor) and not torch.isfinite(got).all():
            raise CheckError(f"logits ≈ 1000 ({dtype}) give a loss of {show(got)}: exp(1000) overflows; "
                             "write log Σ exp(z) = m + log Σ exp(z − m), m the maximum over the vocabulary")
        close(got, ref_cross_entropy(logits, targets), "cross_entropy", f"logits ≈ 1000 ({dtype})",
              rtol=1e-5 if dtype == torch.float32 else 1e-9, atol=2e-4 if dtype == torch.float32 else 1e-9)


@check("its gradient with respect to the logits (gradcheck, float64)")
def _ce_grad(f) -> None:
    gradcheck(f, _ce_inputs(2, 3, 5, seed=40), "cross_entropy")


CROSS_ENTROPY = Exercise(
    name="cross_entropy",
    section=S_LM,
    difficulty=2,
    signature="(logits, targets)",
    stub="""
The loss of a Transformer language model: at every position the model's logits over the V
tokens of the vocabulary, scored against the token that comes next.

    loss = mean over b, t of  −log softmax(logits[b, t])[targets[b, t]]
         = mean of  logsumexp(logits[b, t]) − logits[b, t, targets[b, t]]

with logsumexp(z) = m + log Σ_v exp(z_v − m), m = max_v z_v (so logits of 1000 do not overflow).

Args: logits (B, T, V) float, targets (B, T) long in 0..V-1. Returns a 0-dim tensor of the
logits' dtype: the mean over the B·T positions. Do not call F.cross_entropy, log_softmax,
torch.logsumexp or nll_loss: write the log-sum-exp yourself.

Example: uniform logits (all 0) give log V whatever the targets: log 4 = 1.3863 for V = 4
(CS231N Lec 8: the Transformer as a language model, trained to predict the next token.)
""",
    checks=(_ce_values, _ce_large, _ce_grad, forbid(*_CE_FORBIDDEN)),
    hints=(
        "m = logits.amax(-1, keepdim=True); "
        "lse = m.squeeze(-1) + torch.log(torch.exp(logits - m).sum(-1)): (B, T).",
        "The target's logit: logits.gather(-1, targets[..., None]).squeeze(-1): (B, T).",
        "loss = (lse - target_logit).mean().",
    ),
    see="qkv train gpt",
    forbidden=_CE_FORBIDDEN,
    solution="""
def cross_entropy(logits, targets):
    m = logits.amax(dim=-1, keepdim=True)
    lse = m.squeeze(-1) + torch.log(torch.exp(logits - m).sum(dim=-1))
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (lse - picked).mean()
""",
)


# --------------------------------------------------------------------------- language model: sampling


def _draw(f, logits: Tensor, temperature: float, top_k: int | None, seed: int) -> Tensor:
    got = as_tensor(f(logits, temperature, top_k, generator=gen(seed)), "sample_next_token")
    what = f"sample_next_token(logits {tuple(logits.shape)}, temperature={temperature}, top_k={top_k})"
    if tuple(got.shape) != (logits.shape[0],) or got.dtype != torch.int64:
        raise CheckError(f"{what} has shape {tuple(got.shape)} and dtype {got.dtype}; "
                         f"expected token ids: shape ({logits.shape[0]},), torch.int64")
    return got


def _restricted(logits: Tensor, temperature: float, k: int) -> Tensor:
    """softmax(logits / T) over the k largest logits, 0 elsewhere (float64; logits (V,))."""
    z = logits.double() / temperature
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[z.topk(k).indices] = True
    return torch.softmax(z.masked_fill(~keep, float("-inf")), -1)


def _chi2(counts: Tensor, p: Tensor) -> float:
    n = counts.sum()
    expect = n * p
    live = expect > 0
    if bool((counts[~live] > 0).any()):
        return math.inf
    return float(((counts[live] - expect[live]) ** 2 / expect[live]).sum())


@check("temperature 0 is greedy: exactly the argmax of each row, with or without top_k")
def _sample_greedy(f) -> None:
    logits = randn(4, 7, seed=1) * 2
    for top_k in (None, 3):
        try:
            got = _draw(f, logits, 0.0, top_k, seed=2)
        except (RuntimeError, ZeroDivisionError) as e:
            raise CheckError(f"temperature 0 raised {type(e).__name__} ({str(e)[:80]}): it means greedy; "
                             "return logits.argmax(-1) before dividing by the temperature") from None
        close(got, logits.argmax(-1), f"sample_next_token(logits, temperature=0, top_k={top_k})",
              f"logits = {show(logits)}")


@check("top_k = 1 always draws the argmax, at temperature 1 and 2")
def _sample_top1(f) -> None:
    logits = randn(64, 9, seed=3)
    for t in (1.0, 2.0):
        close(_draw(f, logits, t, 1, seed=4), logits.argmax(-1), f"sample_next_token(logits, {t}, top_k=1)",
              "64 rows of 9 random logits", causes=[
                  (logits.argmin(-1), "top_k kept the smallest logit: top-k keeps the k LARGEST "
                   "(torch.topk's default largest=True, or sort descending)")
              ])


@check("no id outside the top k is ever drawn (4000 draws, V = 10, k = 3)")
def _sample_outside(f) -> None:
    row = randn(10, seed=5) * 1.5
    logits = row.expand(4000, 10).clone()
    got = _draw(f, logits, 1.0, 3, seed=6)
    top, bottom = set(row.topk(3).indices.tolist()), set(row.topk(3, largest=False).indices.tolist())
    drawn = set(got.unique().tolist())
    if drawn <= top:
        return
    why = ("top_k kept the k smallest logits; it keeps the k largest (torch.topk(logits, k) with "
           "largest=True, and −inf on the rest)") if drawn <= bottom else \
        "every logit below the k-th largest must become −inf before the softmax"
    raise CheckError(f"with top_k=3 it drew ids {sorted(drawn - top)} outside the top 3 {sorted(top)}: {why}")


@check("frequencies of 4000 seeded draws match softmax(logits / T) over the top k (chi-square)")
def _sample_frequencies(f) -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    row = row[torch.randperm(6, generator=gen(7))]
    n, limit = 4000, 30.0  # chi-square with at most 5 degrees of freedom: P(> 30) < 2e-5
    for t, k in ((0.5, 3), (1.0, None), (2.0, 4)):
        kk = k or 6
        got = _draw(f, row.expand(n, 6).clone(), t, k, seed=8 + kk)
        counts = torch.bincount(got, minlength=6).double()
        want = _restricted(row, t, kk)
        chi = _chi2(counts, want)
        if chi <= limit:
            continue
        what = (f"temperature={t}, top_k={k}: drew frequencies {show(counts / n, 3)}, expected "
                f"{show(want, 3)} (chi-square {chi:.1f} > {limit:.0f})")
        if _chi2(counts, _restricted(row, 1.0, kk)) <= limit:
            raise CheckError(f"{what}: the temperature has no effect; dividing the probabilities after the "
                             "softmax is undone by renormalising: divide the LOGITS by T, then softmax")
        if _chi2(counts, _restricted(row, 1.0 / t, kk)) <= limit:  # the logits multiplied by T
            raise CheckError(f"{what}: the logits are multiplied by the temperature; divide them "
                             "(T < 1 sharpens)")
        raise CheckError(what)


@check("it draws with the generator it is given: the same seed gives the same tokens")
def _sample_generator(f) -> None:
    logits = randn(300, 8, seed=9)
    a, b = _draw(f, logits, 1.0, None, seed=10), _draw(f, logits, 1.0, None, seed=10)
    if not torch.equal(a, b):
        raise CheckError("two calls with generators of the same seed drew different tokens: pass "
                         "generator=generator to torch.multinomial (a run must be reproducible)")


SAMPLE = Exercise(
    name="sample_next_token",
    section=S_LM,
    difficulty=2,
    signature="(logits, temperature=1.0, top_k=None, generator=None)",
    stub="""
Choose the next token of a language model from the logits of its last position.

    temperature T = 0:  greedy, the argmax of each row (no randomness)
    otherwise:          p = softmax(logits / T) (T < 1 sharpens, T > 1 flattens), then draw one id
    top_k = k:          before the softmax keep only the k largest logits (the others −inf), so no
                        token outside the top k is ever drawn (Fan et al. 2018); None: keep all

Args: logits (B, V) float; temperature ≥ 0; top_k None or an int ≥ 1; generator a torch.Generator
(pass it to torch.multinomial, so that a seed reproduces the draws). Returns (B,) torch.int64.

Example: logits [[2.0, 1.0, 0.1]]: temperature 0 -> [0]; top_k=1 -> [0] at any temperature;
top_k=2, T=1 draws 0 with probability e²/(e² + e) = 0.731 and never 2.
(CS231N Lec 8: a Transformer language model generates text one token at a time.)
""",
    checks=(_sample_greedy, _sample_top1, _sample_outside, _sample_frequencies, _sample_generator),
    hints=(
        "if temperature == 0: return logits.argmax(dim=-1) — before any division.",
        "top-k: kth = logits.topk(k, dim=-1).values[:, -1:]; "
        "logits.masked_fill(logits < kth, float('-inf')).",
        "probs = torch.softmax(logits / temperature, -1); "
        "torch.multinomial(probs, 1, generator=generator).squeeze(-1).",
    ),
    see='qkv generate smollm2 --prompt "Once upon a time" --max-new-tokens 8',
    solution="""
def sample_next_token(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits / temperature
    if top_k is not None:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
""",
)


# --------------------------------------------------------------------------- ViT embedding

S_VIT = "Vision Transformer: patches, positions, blocks, pooling"


def ref_vit_embed(patches: Tensor, w: Tensor, cls: Tensor, pos: Tensor) -> Tensor:
    B = patches.shape[0]
    tokens = patches.double() @ w.double()  # (B, N, D)
    c = cls.double().expand(B, 1, -1)
    return (torch.cat([c, tokens], 1) + pos.double()).to(patches.dtype)  # (B, N + 1, D)


def _vit_inputs(
    B: int, N: int, P: int, D: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, ...]:
    return (randn(B, N, P, seed=seed, dtype=dtype), randn(P, D, seed=seed + 1, dtype=dtype),
            randn(D, seed=seed + 2, dtype=dtype), randn(N + 1, D, seed=seed + 3, dtype=dtype))


@check("[cls; patches W] + pos, (B, N + 1, D), against the reference (float64 and float32)")
def _vit_values(f) -> None:
    for (B, N, P, D), dtype, seed in (((1, 2, 3, 3), torch.float64, 0), ((2, 4, 6, 5), torch.float64, 10),
                                      ((3, 9, 12, 8), torch.float32, 20)):
        patches, w, cls, pos = _vit_inputs(B, N, P, D, seed, dtype)
        want = ref_vit_embed(patches, w, cls, pos)
        tokens = patches @ w
        c = cls.expand(B, 1, D)
        causes = [
            (torch.cat([tokens, c], 1) + pos, "the class token is appended at the end; it is prepended: "
             "token 0 is the class token, the one the classifier reads"),
            (torch.cat([c, tokens + pos[:N]], 1), "the positions are added before prepending the class "
             "token: patch i got pos[i] and the class token none; prepend, then add the N + 1 positions"),
            (torch.cat([c, tokens + pos[1:]], 1), "the class token got no position; pos[0] is its"),
        ]
        if P == D:
            causes.append((torch.cat([c, patches], 1) + pos, "the patches are not projected: multiply them "
                           "by w, the linear patch embedding (P -> D)"))
        close(f(patches, w, cls, pos), want, "vit_embed(patches, w, cls, pos)",
              f"B, N, P, D = {(B, N, P, D)} ({dtype})", rtol=1e-5 if dtype == torch.float32 else 1e-7,
              atol=1e-6 if dtype == torch.float32 else 1e-9, causes=causes)


@check("token 0 of every image is cls + pos[0], whatever the image")
def _vit_cls(f) -> None:
    patches, w, cls, pos = _vit_inputs(3, 4, 5, 6, seed=30)
    out = as_tensor(f(patches, w, cls, pos), "vit_embed")
    if out.ndim != 3 or out.shape[1] != 5:
        raise CheckError(f"vit_embed has shape {tuple(out.shape)} for B, N, P, D = (3, 4, 5, 6); "
                         "expected (3, 5, 6)")
    close(out[:, 0], (cls + pos[0]).expand(3, 6), "vit_embed(...)[:, 0]", "3 images, N = 4 patches")


@check("its gradient with respect to patches, w, cls and pos (gradcheck, float64)")
def _vit_grad(f) -> None:
    gradcheck(f, _vit_inputs(2, 3, 4, 3, seed=40), "vit_embed")


VIT_EMBED = Exercise(
    name="vit_embed",
    section=S_VIT,
    difficulty=1,
    signature="(patches, w, cls, pos)",
    stub="""
The input of a Vision Transformer (Dosovitskiy et al. 2021): project each flattened patch to
width D, prepend a learned class token, add learned positions.

    z = [cls; x_1 W; x_2 W; ...; x_N W] + pos      (N + 1 tokens, the class token first)

Args: patches (B, N, P) (a patchify's output, P = C·p·p), w (P, D) the linear patch embedding,
cls (D,) the class token (the same for every image), pos (N + 1, D), row 0 the class token's.
Returns (B, N + 1, D), the patches' dtype. The classifier later reads token 0.

Example: N = 196 patches of 16x16x3 = 768 values, D = 768 -> (B, 197, 768) for ViT-Base
(CS231N Lec 8: patches, a linear projection, positions, Transformer blocks, pooling.)
""",
    checks=(_vit_values, _vit_cls, _vit_grad),
    hints=(
        "tokens = patches @ w is (B, N, D); cls.expand(B, 1, D) is the class token for each image.",
        "torch.cat([cls_tokens, tokens], dim=1) is (B, N + 1, D); then add pos (it broadcasts over B).",
    ),
    see="qkv train vit",
    solution="""
def vit_embed(patches, w, cls, pos):
    B = patches.shape[0]
    tokens = patches @ w
    cls_tokens = cls.reshape(1, 1, -1).expand(B, 1, -1)
    return torch.cat([cls_tokens, tokens], dim=1) + pos
""",
)


CS231N: tuple[Exercise, ...] = (
    GRU_CELL,
    SCORES,
    CROSS,
    PERMUTATION,
    PADDING_MASK,
    SPLIT_HEADS,
    MERGE_HEADS,
    LAYER_COSTS,
    CROSS_ENTROPY,
    SAMPLE,
    VIT_EMBED,
)
