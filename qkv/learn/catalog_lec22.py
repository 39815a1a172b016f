"""CS189 Lecture 22 and Discussion 10 as exercises: self-attention with its three matrices (and
why W_Q ≠ W_K), its parameter-free first step softmax(XXᵀ)X, contextualisation as a mixing
weight, what attention costs (FLOPs of QKᵀ and AV, KV-cache bytes), the MLP and the Transformer
layer (pre-LN and post-LN), ALiBi's linear distance penalty, Discussion 10's unscaled weights
(0.9975) and the moments of qᵀk (why √d), and one decoding step through a KV cache.

Same rules as :mod:`qkv.learn.catalog`: each check compares with an independent reference
written here (PyTorch's own ops, float64 formulas, torch.utils.flop_counter, tensors' own byte counts,
exact enumeration), runs small inputs first, and names the likely cause of a recognised mistake.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable
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

# --------------------------------------------------------------------------- shared helpers


def _softmax64(s: Tensor, dim: int = -1) -> Tensor:
    return torch.softmax(s.double(), dim=dim)


def _whole(got: Any, what: str) -> int:
    """``got`` as an exact whole number, or CheckError (a count is an int, never a float)."""
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        raise CheckError(
            f"{what} returned {got!r} ({type(got).__name__}): return a Python int (a count is a whole "
            "number, and floats lose exactness past 2^53)"
        )
    return int(got)


# --------------------------------------------------------------------------- self-attention

S_SELF = "2.1 Self-attention: every token a query, a key and a value; why W_Q ≠ W_K"


def ref_self_attention(x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor) -> tuple[Tensor, Tensor]:
    x64 = x.double()
    q, k, v = x64 @ w_q.double(), x64 @ w_k.double(), x64 @ w_v.double()
    w = _softmax64(q @ k.transpose(-1, -2) / math.sqrt(w_q.shape[-1]))
    return (w @ v).to(x.dtype), w.to(x.dtype)


def _cycle_asymmetry(weights: Tensor) -> float:
    """How far ``weights`` (T, T) are from a row softmax of a SYMMETRIC score matrix: with
    s_ij = s_ji, log w_ij − log w_ji = lse_j − lse_i, so around every cycle i -> j -> k -> i the
    differences cancel. Returns the largest cycle sum A_ij + A_jk + A_ki (0 for symmetric scores)."""
    L = weights.detach().double().log()
    A = L - L.T
    T = A.shape[0]
    i, j, k = torch.meshgrid(torch.arange(T), torch.arange(T), torch.arange(T), indexing="ij")
    return float((A[i, j] + A[j, k] + A[k, i]).abs().max())


@check("out and weights against softmax(Q Kᵀ/√d) V with Q = x W_Q, K = x W_K, V = x W_V (float64)")
def _self_values(f) -> None:
    # the first case is square (D = d) so that unprojected keys/values can be recognised
    for shape, d, seed in (((3, 4), 4, 0), ((2, 5, 6), 4, 10), ((4, 3), 5, 20)):
        x = randn(*shape, seed=seed)
        D = shape[-1]
        w_q, w_k, w_v = randn(D, d, seed=seed + 1), randn(D, d, seed=seed + 2), randn(D, d, seed=seed + 3)
        out, w = _pair(f(x, w_q, w_k, w_v), "self_attention(x, w_q, w_k, w_v)")
        want_out, want_w = ref_self_attention(x, w_q, w_k, w_v)
        q, k = x @ w_q, x @ w_k
        causes = [
            (_softmax64(q @ k.transpose(-1, -2)), "the scores are not divided by √d (d = w_q.shape[1])"),
            (
                _softmax64(q @ k.transpose(-1, -2) / math.sqrt(d), -2),
                "the weights sum to 1 over the queries; softmax over the last dimension (the keys)",
            ),
            (
                _softmax64(q @ q.transpose(-1, -2) / math.sqrt(d)),
                "the keys are made with w_q: K = x @ w_k (with one matrix the scores would be symmetric, "
                "the lecture's reason for W_Q ≠ W_K)",
            ),
        ]
        if D == d:
            causes.append(
                (
                    _softmax64(q @ x.transpose(-1, -2) / math.sqrt(d)),
                    "the keys are x itself; project them: K = x @ w_k",
                )
            )
        if D != d:
            causes.append(
                (
                    _softmax64(q @ k.transpose(-1, -2) / math.sqrt(D)),
                    "scaled by √D (x's width); d = w_q.shape[1]",
                )
            )
        inputs = f"x of shape {shape}, w of shape ({D}, {d})"
        close(w, want_w, "weights", inputs, causes=causes)
        out_causes = []
        if D == d:
            out_causes.append((want_w @ x, "the values are x itself; project them: V = x @ w_v"))
        close(out, want_out, "out", inputs, causes=out_causes)


@check("w_q = w_k makes the scores symmetric (read through your weights); w_q ≠ w_k does not")
def _self_symmetric(f) -> None:
    x = randn(5, 4, seed=30) * 0.7
    w, w_k, w_v = randn(4, 3, seed=31), randn(4, 3, seed=32), randn(4, 3, seed=33)
    _, weights = _pair(f(x, w, w, w_v), "self_attention(x, w, w, w_v)")
    weights = as_tensor(weights, "weights")
    if tuple(weights.shape) != (5, 5):
        raise CheckError(f"weights have shape {tuple(weights.shape)}, expected (5, 5) for 5 tokens")
    gap = _cycle_asymmetry(weights)
    if not gap < 1e-8:
        raise CheckError(
            "with w_q = w_k = W the scores s_ij = (x_i W)·(x_j W) are symmetric, so log w_ij − log w_ji "
            "must cancel around every cycle i→j→k→i; yours are off by "
            f"{gap:.2e}: the scores are not q_i·k_j of the same projection"
        )
    close(weights, ref_self_attention(x, w, w, w_v)[1], "weights", "w_q = w_k")
    _, weights2 = _pair(f(x, w, w_k, w_v), "self_attention(x, w_q, w_k, w_v)")
    if _cycle_asymmetry(as_tensor(weights2, "weights")) < 1e-6:
        raise CheckError(
            "with w_q ≠ w_k your weights still come from symmetric scores: w_k is not used (the keys are "
            "x @ w_k); two matrices let token i attend to j more than j attends to i"
        )


@check("float32 in, float32 out; its gradient (gradcheck, float64)")
def _self_grad(f) -> None:
    x = randn(2, 3, 4, seed=40, dtype=torch.float32)
    ws = tuple(randn(4, 2, seed=41 + i, dtype=torch.float32) for i in range(3))
    out, _ = _pair(f(x, *ws), "self_attention")
    close(out, ref_self_attention(x, *ws)[0], "out", "float32 inputs", rtol=1e-5, atol=1e-6)
    gradcheck(
        lambda *a: f(*a)[0],
        (randn(3, 4, seed=44), randn(4, 2, seed=45), randn(4, 2, seed=46), randn(4, 3, seed=47)),
        "out",
    )


SELF_ATTENTION = Exercise(
    name="self_attention",
    section=S_SELF,
    difficulty=2,
    signature="(x, w_q, w_k, w_v)",
    stub="""
One head of self-attention: every token is a query, a key and a value.

    Q = x W_Q,  K = x W_K,  V = x W_V,   weights = softmax(Q Kᵀ / √d),   out = weights V

Args: x (T, D) or (B, T, D); w_q, w_k, w_v (D, d), each applied as ``x @ w``; d = w_q.shape[1]
(scale by √d, the projection's width, not √D). Returns (out (..., T, d), weights (..., T, T)),
each row of weights summing to 1 over the keys. Keep x's dtype.
Why two matrices: with W_Q = W_K the scores (xW)(xW)ᵀ are symmetric, token i would attend to j
exactly as much as j to i; W_Q ≠ W_K lets "it" look at "animal" without "animal" looking at "it".
Do not call F.scaled_dot_product_attention or nn.MultiheadAttention (torch.softmax is fine).

Example: x = [[1, 0], [0, 1]], all three w = identity -> weights row 0 = [0.670, 0.330]
(CS189 Lec 22 §2.1; Vaswani et al. 2017, eq. 1.)
""",
    checks=(
        _self_values,
        _self_symmetric,
        _self_grad,
        forbid("scaled_dot_product_attention", "MultiheadAttention"),
    ),
    hints=(
        "Three products first: q, k, v = x @ w_q, x @ w_k, x @ w_v, each (..., T, d).",
        "scores = q @ k.transpose(-1, -2) / math.sqrt(w_q.shape[-1]): transpose the last two dims, so "
        "a batch dimension stays in front.",
        "weights = torch.softmax(scores, dim=-1); out = weights @ v; return (out, weights).",
    ),
    see="qkv explain qk",
    forbidden=("scaled_dot_product_attention", "MultiheadAttention"),
    solution="""
def self_attention(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(w_q.shape[-1]), dim=-1)
    return weights @ v, weights
""",
)


# --------------------------------------------------------------------------- raw self-attention

S_RAW = "2.1 Building it up: average all values, raw vectors first, then W_Q, W_K, W_V"


def ref_raw(x: Tensor) -> Tensor:
    x64 = x.double()
    return (_softmax64(x64 @ x64.transpose(-1, -2)) @ x64).to(x.dtype)


@check("softmax(X Xᵀ) X row by row, no weights and no scaling (float64, (T, D) and (B, T, D))")
def _raw_values(f) -> None:
    for shape, seed in (((2, 2), 0), ((4, 3), 1), ((2, 5, 4), 2)):
        x = randn(*shape, seed=seed)
        D = shape[-1]
        x64 = x.double()
        s = x64 @ x64.transpose(-1, -2)
        close(
            f(x),
            ref_raw(x),
            "raw_self_attention(x)",
            f"x = {show(x)}",
            causes=[
                (
                    _softmax64(s / math.sqrt(D)) @ x64,
                    "the scores are divided by √D: this step of the derivation has no scaling, "
                    "softmax(X Xᵀ) X (√d arrives with W_Q and W_K)",
                ),
                (
                    x64.mean(-2, keepdim=True).expand_as(x64),
                    "every token gets the plain average of all tokens: that is the first step; this one "
                    "weights them by content, softmax_j(x_iᵀx_j)",
                ),
                (_softmax64(s, -2) @ x64, "the weights sum to 1 over the queries (dim -2); softmax over the "
                 "last dimension"),
            ],
        )


@check("permuting the tokens permutes the outputs (no position yet); the gradient (gradcheck)")
def _raw_equivariant(f) -> None:
    x = randn(5, 3, seed=3)
    perm = torch.tensor([3, 0, 4, 1, 2])
    a, b = as_tensor(f(x), "raw_self_attention(x)"), as_tensor(f(x[perm]), "raw_self_attention(x[perm])")
    same_shape = tuple(a.shape) == tuple(b.shape) == tuple(x.shape)
    if same_shape and not torch.allclose(a[perm], b):
        raise CheckError(
            "f(x[perm]) differs from f(x)[perm]: softmax(X Xᵀ) X is permutation equivariant (each row "
            "only compares its token with all the others)"
        )
    gradcheck(f, (randn(4, 3, seed=4),), "raw_self_attention")


RAW_SELF_ATTENTION = Exercise(
    name="raw_self_attention",
    section=S_RAW,
    difficulty=1,
    signature="(x)",
    stub="""
The second step of the lecture's derivation: content-based weights from the raw vectors, before
any learned matrix. Token i's output is the average of all tokens weighted by how well they
match it:

    p_ij = softmax_j(x_iᵀ x_j),   z_i = Σ_j p_ij x_j      i.e.   Z = softmax(X Xᵀ) X

(the first step, "average all values", is z_i = (1/n) Σ_j x_j; the next ones add W_Q, W_K, then
W_V and the 1/√d). No scaling here. Args: x (T, D) or (B, T, D). Returns x's shape and dtype.

Example: x = [[1, 0], [0, 1]] -> [[0.731, 0.269], [0.269, 0.731]]
(CS189 Lec 22 §2.1; `qkv explain derivation` shows each step.)
""",
    checks=(_raw_values, _raw_equivariant, forbid("scaled_dot_product_attention")),
    hints=(
        "Scores: x @ x.transpose(-1, -2), (..., T, T); entry (i, j) is x_iᵀx_j.",
        "torch.softmax(scores, dim=-1) @ x: each row a weighted average of the tokens.",
    ),
    see="qkv explain derivation",
    forbidden=("scaled_dot_product_attention",),
    solution="""
def raw_self_attention(x):
    return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x
""",
)


# --------------------------------------------------------------------------- contextualisation

S_CONTEXT = "2.3 Contextualisation: what 'it' refers to, 'bank' by a river or with money"


@check("exact mixtures v = w·a + (1 − w)·b give back w (0.9 'river bank' first; w outside [0, 1] too)")
def _mix_exact(f) -> None:
    a0, b0 = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)
    cases = [(a0, b0, torch.tensor(0.9, dtype=torch.float64))]
    a, b = randn(5, 6, seed=1), randn(5, 6, seed=2)
    cases.append((a, b, torch.tensor([0.9, 0.1, 0.5, -0.5, 1.7], dtype=torch.float64)))
    for a, b, w in cases:
        v = w[..., None] * a + (1 - w[..., None]) * b
        diff = a - b
        norm = diff.norm(dim=-1)
        close(
            f(v, a, b),
            w,
            "mixing_weight(v, a, b)",
            f"v = {show(w)}·a + (1 − w)·b, a = {show(a)}, b = {show(b)}",
            rtol=1e-9,
            atol=1e-12,
            causes=[
                (w.clamp(0, 1), "it is clipped to [0, 1]; the least-squares w is any real number"),
                (1 - w, "that is b's weight 1 − w: w multiplies a, w = (v − b)·(a − b) / |a − b|²"),
                (w * norm, "divided by |a − b|; divide by its square |a − b|²"),
            ],
        )


@check("random v (off the line through a and b), batched (2, 3, 5): against torch.linalg.lstsq (float64)")
def _mix_lstsq(f) -> None:
    v, a, b = randn(2, 3, 5, seed=3), randn(2, 3, 5, seed=4), randn(2, 3, 5, seed=5)
    # least squares: the column (a − b) times w ≈ v − b, one problem per leading index
    want = torch.linalg.lstsq((a - b)[..., None], (v - b)[..., None]).solution[..., 0, 0]
    diff = a - b
    close(
        f(v, a, b),
        want,
        "mixing_weight(v, a, b)",
        "v, a, b of shape (2, 3, 5)",
        rtol=1e-9,
        atol=1e-12,
        causes=[
            (
                (v * diff).sum(-1) / (diff * diff).sum(-1),
                "v is not centred on b: (v − b)·(a − b), not v·(a − b)",
            ),
            ((v - b).norm(dim=-1) / diff.norm(dim=-1), "a ratio of lengths ignores direction; project "
             "(v − b) onto (a − b): a dot product"),
        ],
    )


@check("float32 in, float32 out; the residual is orthogonal to a − b; the gradient (gradcheck)")
def _mix_props(f) -> None:
    v, a, b = (randn(4, 3, seed=s, dtype=torch.float32) for s in (6, 7, 8))
    got = as_tensor(f(v, a, b), "mixing_weight")
    diff = (a - b).double()
    want = (((v - b).double() * diff).sum(-1) / (diff * diff).sum(-1)).float()
    close(got, want, "mixing_weight", "float32 v, a, b of shape (4, 3)", rtol=1e-5, atol=1e-6)
    v, a, b = randn(4, 3, seed=9), randn(4, 3, seed=10), randn(4, 3, seed=11)
    w = as_tensor(f(v, a, b), "mixing_weight").double()
    resid = v - (w[:, None] * a + (1 - w[:, None]) * b)
    if (resid * (a - b)).sum(-1).abs().max() > 1e-9:
        raise CheckError("v − (w·a + (1 − w)·b) is not orthogonal to a − b: w is not the minimiser")
    gradcheck(f, (randn(3, 4, seed=12), randn(3, 4, seed=13), randn(3, 4, seed=14)), "mixing_weight")


MIXING_WEIGHT = Exercise(
    name="mixing_weight",
    section=S_CONTEXT,
    difficulty=1,
    signature="(v, a, b)",
    stub="""
Contextualisation measured: after attention, how much of "bank" is "river bank" (a) and how much
"money bank" (b)? The w that best writes v as a mix of the two,

    w* = argmin_w |v − (w·a + (1 − w)·b)|²  =  (v − b)·(a − b) / |a − b|²

(set the derivative to 0: v − b ≈ w·(a − b), a one-column least squares). No clipping: w may fall
outside [0, 1]. Assume a ≠ b.
Args: v, a, b (..., D), any leading dimensions. Returns w of shape (...), v's dtype.
Do not call torch.linalg.lstsq or pinv: the closed form is the exercise.

Example: a = [1, 0], b = [0, 1], v = [0.9, 0.1] -> 0.9 ("about 0.9 river bank + 0.1 bank")
(CS189 Lec 22 §2.3; `qkv explain context` measures it in MiniLM.)
""",
    checks=(_mix_exact, _mix_lstsq, _mix_props, forbid("lstsq", "pinv")),
    hints=(
        "d = a - b and r = v - b: the mix is b + w·d, so w·d should be as close to r as possible.",
        "w = (r * d).sum(-1) / (d * d).sum(-1): a dot product over the last dimension, divided by |d|².",
    ),
    see="qkv explain context",
    forbidden=("lstsq", "pinv"),
    solution="""
def mixing_weight(v, a, b):
    d = a - b
    return ((v - b) * d).sum(-1) / (d * d).sum(-1)
""",
)


# --------------------------------------------------------------------------- cost: FLOPs

S_COST = "Cost: parameters O(d²) whatever n, compute O(n²); a 16K model on 1M tokens"


def _counted_flops(n: int, d: int) -> int:
    """The FLOPs of a real QKᵀ and A V for n tokens of width d, each product counted by the rule
    FlopCounterMode applies to every matrix product it sees (torch.utils.flop_counter's registry:
    a multiply-add = 2 FLOPs). Entering FlopCounterMode itself would import torch._dynamo (3-6 s
    on 2 cores), too slow for a check; tests/learn/test_lec22.py shows the mode counts the same."""
    from torch.utils.flop_counter import flop_registry

    mm = torch.ops.aten.mm
    q, k, v = torch.zeros(n, d), torch.zeros(n, d), torch.zeros(n, d)
    a = q @ k.T  # (n, n); the softmax is not a matrix product, and is not counted
    out = a @ v  # (n, d)
    return int(flop_registry[mm](q, k.T, out_val=a) + flop_registry[mm](a, v, out_val=out))


@check("against torch.utils.flop_counter's count of real QKᵀ and AV products (FlopCounterMode's rule)")
def _flops_counted(f) -> None:
    for n, d in ((1, 1), (3, 2), (16, 8), (50, 12)):
        got = _whole(f(n, d), f"attention_flops({n}, {d})")
        want = _counted_flops(n, d)
        if got == want:
            continue
        causes = {
            2 * n * n * d: "half: QKᵀ and AV each take 2·n²·d FLOPs (n² dot products of length d, a "
            "multiply-add = 2 FLOPs), and there are two products",
            n * n * d: "a multiply-add counts as 2 FLOPs, and both QKᵀ and AV count",
            4 * n * d * d: "n and d are swapped: the products are (n x d)(d x n) and (n x n)(n x d)",
            4 * n * n * d + 8 * n * d * d: "the projections are included; count only QKᵀ and AV",
        }
        why = causes.get(got)
        raise CheckError(
            f"attention_flops({n}, {d}) = {got}, torch.utils.flop_counter counts {want}"
            + (f": {why}" if why else "")
        )


@check("compute O(n²): doubling n quadruples it, doubling d doubles it; the 16K model on 1M tokens, exact")
def _flops_scaling(f) -> None:
    base = _whole(f(100, 16), "attention_flops(100, 16)")
    twice_n = _whole(f(200, 16), "attention_flops(200, 16)")
    twice_d = _whole(f(100, 32), "attention_flops(100, 32)")
    if twice_n != 4 * base:
        raise CheckError(
            f"attention_flops(200, 16) = {twice_n} is {twice_n / max(base, 1):.3g}x attention_flops(100, 16) "
            f"= {base}; the n x n score matrix makes it 4x (O(n²))"
        )
    if twice_d != 2 * base:
        raise CheckError(
            f"attention_flops(100, 32) = {twice_d}, expected 2x attention_flops(100, 16) = {base}"
        )
    n, d = 1_000_001, 16_383  # 4·n²·d > 2^53: a float would round it
    got = _whole(f(n, d), f"attention_flops({n}, {d})")
    if got != 4 * n * n * d:
        raise CheckError(f"attention_flops({n}, {d}) = {got}, expected {4 * n * n * d} exactly")


ATTENTION_FLOPS = Exercise(
    name="attention_flops",
    section=S_COST,
    difficulty=1,
    signature="(n, d)",
    stub="""
The FLOPs of one single-head self-attention layer's two n²-sized products, for n tokens of width d:

    Q Kᵀ: (n x d)(d x n) -> n² dot products of length d      A V: (n x n)(n x d) -> n·d of length n

Convention (PyTorch's FlopCounterMode, and qkv explain cost): a multiply-add is 2 FLOPs, so each
product is 2·n²·d. The projections (x W_Q, x W_K, x W_V: O(n·d²)) and the softmax are NOT counted.
Args: n, d positive ints. Returns an int, exact (use integer arithmetic).
Do not run the products under FlopCounterMode: count them.

Example: attention_flops(3, 2) -> 72. The lecture's 16K-wide model on 1M tokens:
attention_flops(10**6, 16384) ≈ 6.6e16 per layer, while its parameters (3d²) do not depend on n.
(CS189 Lec 22, "compute O(n²)".)
""",
    checks=(_flops_counted, _flops_scaling, forbid("FlopCounterMode", "get_total_flops", "mm_flop")),
    hints=(
        "QKᵀ has n·n entries, each a dot product of length d: n·n·d multiply-adds.",
        "A V has n·d entries, each a dot product of length n: n·d·n multiply-adds. Then 2 FLOPs each.",
    ),
    see="qkv explain cost",
    forbidden=("FlopCounterMode", "get_total_flops", "mm_flop"),
    solution="""
def attention_flops(n, d):
    return 2 * n * n * d + 2 * n * n * d
""",
)


# --------------------------------------------------------------------------- cost: KV-cache bytes

_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _allocated_bytes(n_layers: int, n_kv_heads: int, head_dim: int, n_tokens: int, bpv: int) -> int:
    """The bytes of a real K and V cache of these sizes: allocated when small, on the meta device
    (shapes and dtypes, no memory) when large."""
    shape = (n_layers, 1, n_kv_heads, n_tokens, head_dim)  # (layers, B, K heads, T, head_dim)
    device = "cpu" if math.prod(shape) <= 1 << 16 else "meta"
    k = torch.empty(shape, dtype=_DTYPES[bpv], device=device)
    v = torch.empty(shape, dtype=_DTYPES[bpv], device=device)
    return int(k.nbytes + v.nbytes)


@check("against the bytes of real K and V tensors (tiny, GPT-2 small at 1024 tokens, SmolLM2 at 8192)")
def _kvb_values(f) -> None:
    # the second case tells every recognised mistake apart (3 layers, 4 bytes a value)
    cases = ((1, 1, 1, 1, 4), (3, 2, 4, 5, 4), (12, 12, 64, 1024, 4), (30, 3, 64, 8192, 2), (4, 2, 8, 7, 1))
    for args in cases:
        L, K, hd, T, bpv = args
        got = _whole(f(*args), f"kv_cache_bytes{args}")
        want = _allocated_bytes(*args)
        if got == want:
            continue
        causes = (
            (want // 2, "half: the cache holds K and V, two tensors per layer"),
            (want // L, "one layer only: every layer keeps its own K and V"),
            (want * 8, "that is bits; bytes_per_value is already in bytes"),
            (want // bpv, "bytes_per_value is not used (a bf16 value takes 2 bytes, fp32 4)"),
        )
        named = [why for value, why in causes if value == got]
        why = named[0] if len(named) == 1 else None
        raise CheckError(
            f"kv_cache_bytes(n_layers={L}, n_kv_heads={K}, head_dim={hd}, n_tokens={T}, "
            f"bytes_per_value={bpv}) = {got}; K and V tensors of those sizes take {want} bytes"
            + (f": {why}" if why else "")
        )


@check("GQA: 9 query heads sharing 3 key/value heads cache 3x fewer bytes than 9 (SmolLM2's layout)")
def _kvb_gqa(f) -> None:
    mha = _whole(f(30, 9, 64, 2048, 2), "kv_cache_bytes(30, 9, 64, 2048, 2)")
    gqa = _whole(f(30, 3, 64, 2048, 2), "kv_cache_bytes(30, 3, 64, 2048, 2)")
    if mha != 3 * gqa:
        raise CheckError(
            f"9 key/value heads give {mha} bytes, 3 give {gqa}: the cache is linear in n_kv_heads"
        )


KV_CACHE_BYTES = Exercise(
    name="kv_cache_bytes",
    section=S_COST,
    difficulty=1,
    signature="(n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value)",
    stub="""
The bytes a decoder's KV cache takes for one sequence: every layer keeps the keys AND the values
of every past token, for each of its key/value heads (n_kv_heads < n_heads with GQA/MQA):

    bytes = 2 (K and V) · n_layers · n_kv_heads · head_dim · n_tokens · bytes_per_value

Args: positive ints; bytes_per_value 4 for float32, 2 for bf16/fp16, 1 for int8. Returns an int.

Example: GPT-2 small (12 layers, 12 heads of 64) at 1024 tokens in float32 -> 75,497,472 bytes;
SmolLM2-135M (30 layers, 3 key/value heads of 64) at 8192 tokens in bf16 -> 188,743,680.
(CS189 Lec 22, the cost of attention; Discussion 11 counts what the cache saves.)
""",
    checks=(_kvb_values, _kvb_gqa),
    hints=(
        "One layer, one head: n_tokens vectors of head_dim numbers, for K and again for V.",
        "Multiply by the layers, the key/value heads and the bytes per number; keep it an int.",
    ),
    see="qkv explain cost --model smollm2",
    solution="""
def kv_cache_bytes(n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value):
    return 2 * n_layers * n_kv_heads * head_dim * n_tokens * bytes_per_value
""",
)


# --------------------------------------------------------------------------- the MLP

S_MLP = "3.2 The MLP is the only non-linearity besides softmax"


def _ffn_inputs(shape: tuple[int, ...], hidden: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple:
    D = shape[-1]
    return (
        randn(*shape, seed=seed, dtype=dtype) * 1.5,
        randn(D, hidden, seed=seed + 1, dtype=dtype),
        randn(hidden, seed=seed + 2, dtype=dtype),
        randn(hidden, D, seed=seed + 3, dtype=dtype),
        randn(D, seed=seed + 4, dtype=dtype),
    )


def _ffn(
    x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, act: Callable[[Tensor], Tensor]
) -> Tensor:
    h = x.double() @ w1.double() + b1.double()
    return (act(h) @ w2.double() + b2.double()).to(x.dtype)


@check("against GELU(x W1 + b1) W2 + b2 with F.gelu (exact, erf) in float64; (D,), (T, D), (B, T, D)")
def _ffn_values(f) -> None:
    for shape, hidden, seed in (((3,), 4, 0), ((4, 3), 8, 10), ((2, 3, 4), 16, 20)):
        args = _ffn_inputs(shape, hidden, seed)
        close(
            f(*args),
            _ffn(*args, act=F.gelu),
            "feed_forward",
            f"x of shape {shape}, hidden width {hidden}",
            causes=[
                (
                    _ffn(*args, act=lambda h: F.gelu(h, approximate="tanh")),
                    "that is GPT-2's tanh approximation; the exact GELU is x·Φ(x) = "
                    "0.5·x·(1 + erf(x/√2))",
                ),
                (_ffn(*args, act=torch.relu), "that is ReLU; GELU is x·Φ(x) = 0.5·x·(1 + erf(x/√2))"),
                (
                    _ffn(*args, act=lambda h: h * torch.sigmoid(1.702 * h)),
                    "that is the sigmoid approximation x·σ(1.702x); use erf",
                ),
                (_ffn(*args, act=lambda h: h), "there is no non-linearity between W1 and W2: without it two "
                 "linear maps collapse into one"),
            ],
        )


@check("float32 in, float32 out; large pre-activations (±30) stay finite; the gradient (gradcheck)")
def _ffn_edges(f) -> None:
    args = _ffn_inputs((3, 4), 8, 30, dtype=torch.float32)
    close(f(*args), _ffn(*args, act=F.gelu), "feed_forward", "float32 inputs", rtol=1e-5, atol=1e-5)
    x = torch.tensor([[30.0, -30.0]], dtype=torch.float64)
    w1, b1 = torch.eye(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    w2, b2 = torch.eye(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    close(
        f(x, w1, b1, w2, b2),
        _ffn(x, w1, b1, w2, b2, act=F.gelu),
        "feed_forward",
        "x = [[30, -30]], W1 = W2 = I, zero biases: GELU(30) = 30, GELU(-30) = -0",
    )
    gradcheck(f, _ffn_inputs((2, 3), 5, 40), "feed_forward")


FEED_FORWARD = Exercise(
    name="feed_forward",
    section=S_MLP,
    difficulty=1,
    signature="(x, w1, b1, w2, b2)",
    stub="""
The Transformer layer's MLP, applied to every token on its own:

    FFN(x) = GELU(x W1 + b1) W2 + b2,    GELU(h) = h·Φ(h) = 0.5·h·(1 + erf(h/√2))

with the exact GELU (Hendrycks & Gimpel 2016; the Gaussian CDF Φ written with erf), not GPT-2's
tanh approximation and not ReLU. Without it, attention's output would only ever be mixed
linearly: the MLP is the layer's only non-linearity besides the softmax.
Args: x (..., D); w1 (D, H), b1 (H,), w2 (H, D), b2 (D,). Returns x's shape and dtype.
Do not call F.gelu or nn.GELU: write GELU with torch.erf.

Example: GELU(1.0) = 0.8413, GELU(-1.0) = -0.1587
(CS189 Lec 22 §3.2.)
""",
    checks=(_ffn_values, _ffn_edges, forbid("gelu", "GELU")),
    hints=(
        "h = x @ w1 + b1: the hidden layer, (..., H).",
        "GELU: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))); then @ w2 + b2.",
    ),
    see="qkv train gpt --mlp none",
    forbidden=("gelu", "GELU"),
    solution="""
def feed_forward(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2.0))) @ w2 + b2
""",
)


# --------------------------------------------------------------------------- the Transformer layer

S_BLOCK = "3.2 The Transformer layer: residual + LayerNorm + MLP; pre-LN vs post-LN"


class _Recorder:
    """Callables for the block that each record their name when called (and compute something
    distinct and non-linear, so that every wrong wiring gives different numbers)."""

    def __init__(self, D: int, seed: int) -> None:
        self.calls: list[str] = []
        self.inputs: dict[str, Tensor] = {}
        self.a = randn(D, D, seed=seed) * 0.5
        self.m1, self.m2 = randn(D, 2 * D, seed=seed + 1) * 0.5, randn(2 * D, D, seed=seed + 2) * 0.5
        self.g1, self.b1 = 1 + randn(D, seed=seed + 3) * 0.3, randn(D, seed=seed + 4) * 0.3
        self.g2, self.b2 = 1 + randn(D, seed=seed + 5) * 0.3, randn(D, seed=seed + 6) * 0.3

    # pure versions, for the references
    def attn(self, h: Tensor) -> Tensor:
        w = torch.softmax(h @ h.transpose(-1, -2) / math.sqrt(h.shape[-1]), -1)
        return w @ h @ self.a

    def mlp_(self, h: Tensor) -> Tensor:
        return torch.tanh(h @ self.m1) @ self.m2

    def n1(self, h: Tensor) -> Tensor:
        return F.layer_norm(h, (h.shape[-1],), self.g1, self.b1)

    def n2(self, h: Tensor) -> Tensor:
        return F.layer_norm(h, (h.shape[-1],), self.g2, self.b2)

    def recording(self) -> tuple[Callable[[Tensor], Tensor], ...]:
        def wrap(name: str, fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
            def call(h: Tensor) -> Tensor:
                self.calls.append(name)
                self.inputs.setdefault(name, h.detach().clone())
                return fn(h)

            return call

        return (wrap("attention", self.attn), wrap("mlp", self.mlp_), wrap("norm1", self.n1),
                wrap("norm2", self.n2))


def _pre(r: _Recorder, x: Tensor) -> Tensor:
    h = x + r.attn(r.n1(x))
    return h + r.mlp_(r.n2(h))


def _post(r: _Recorder, x: Tensor) -> Tensor:
    h = r.n1(x + r.attn(x))
    return r.n2(h + r.mlp_(h))


@check("pre-LN: h = x + attention(norm1(x)), out = h + mlp(norm2(h))")
def _block_pre(f) -> None:
    r = _Recorder(4, seed=0)
    x = randn(1, 2, 4, seed=10)
    got = f(x, *r.recording(), pre_ln=True)
    h_no = r.attn(r.n1(x))
    h = x + r.attn(r.n1(x))
    hn = r.n1(x) + r.attn(r.n1(x))
    hs = x + r.attn(r.n2(x))
    close(
        got,
        _pre(r, x),
        "transformer_block(x, ..., pre_ln=True)",
        "x of shape (1, 2, 4)",
        causes=[
            (
                h_no + r.mlp_(r.n2(h_no)),
                "the first residual is missing: h = x + attention(norm1(x)), the input is added back",
            ),
            (r.mlp_(r.n2(h)), "the second residual is missing: out = h + mlp(norm2(h))"),
            (_post(r, x), "that is post-LN (the norm after the residual sum); pre_ln=True normalises each "
             "branch's input: x + attention(norm1(x))"),
            (hn + r.mlp_(r.n2(hn)), "a norm in the wrong place: the residual adds x itself, not norm1(x)"),
            (hs + r.mlp_(r.n1(hs)), "norm1 and norm2 are swapped: norm1 belongs to the attention sub-layer, "
             "norm2 to the MLP"),
        ],
    )


@check("post-LN (the 2017 paper): h = norm1(x + attention(x)), out = norm2(h + mlp(h))")
def _block_post(f) -> None:
    r = _Recorder(4, seed=20)
    x = randn(1, 2, 4, seed=30)
    got = f(x, *r.recording(), pre_ln=False)
    h_no = r.n1(r.attn(x))
    h = r.n1(x + r.attn(x))
    hs = r.n2(x + r.attn(x))
    close(
        got,
        _post(r, x),
        "transformer_block(x, ..., pre_ln=False)",
        "x of shape (1, 2, 4)",
        causes=[
            (_pre(r, x), "that is pre-LN; pre_ln=False is the paper's post-LN: h = norm1(x + attention(x)), "
             "then norm2(h + mlp(h))"),
            (r.n2(h_no + r.mlp_(h_no)), "the first residual is missing: norm1(x + attention(x)), not "
             "norm1(attention(x))"),
            (r.n2(r.mlp_(h)), "the second residual is missing: norm2(h + mlp(h))"),
            (r.n1(hs + r.mlp_(hs)), "norm1 and norm2 are swapped: norm1 follows attention, norm2 the MLP"),
            (h + r.mlp_(h), "a norm in the wrong place: post-LN normalises after the MLP's residual too, "
             "norm2(h + mlp(h))"),
        ],
    )


@check("each callable called once, in the order of its variant; pre_ln defaults to True")
def _block_order(f) -> None:
    for pre, want in ((True, ["norm1", "attention", "norm2", "mlp"]), (False, ["attention", "norm1", "mlp",
                                                                                  "norm2"])):
        r = _Recorder(4, seed=40)
        x = randn(1, 3, 4, seed=41)
        f(x, *r.recording(), pre_ln=pre)
        if r.calls != want:
            raise CheckError(
                f"with pre_ln={pre} your block called {', '.join(r.calls) or 'nothing'}; expected "
                f"{', '.join(want)}, each once"
            )
        first = "attention" if pre else "norm1"
        want_in = r.n1(x) if pre else x + r.attn(x)
        if not torch.allclose(r.inputs[first], want_in):
            raise CheckError(
                f"with pre_ln={pre}, {first} got the wrong input: expected "
                + ("norm1(x)" if pre else "x + attention(x)")
            )
    r = _Recorder(4, seed=50)
    x = randn(2, 2, 4, seed=51)
    attention, mlp, norm1, norm2 = r.recording()
    close(
        f(x, attention, mlp, norm1, norm2),
        _pre(r, x),
        "transformer_block(x, attention, mlp, norm1, norm2)",
        "no pre_ln argument",
        causes=[(_post(r, x), "pre_ln defaults to True (pre-LN, as in GPT-2 and qkv's GPT)")],
    )


TRANSFORMER_BLOCK = Exercise(
    name="transformer_block",
    section=S_BLOCK,
    difficulty=2,
    signature="(x, attention, mlp, norm1, norm2, pre_ln=True)",
    stub="""
One Transformer layer from its parts: a residual connection around attention and around the
MLP, with a LayerNorm per sub-layer. The parts are callables you are given (each maps a
(B, T, D) tensor to a (B, T, D) tensor); call each exactly once.

    pre-LN  (pre_ln=True, GPT-2, qkv's GPT):   h = x + attention(norm1(x));   out = h + mlp(norm2(h))
    post-LN (pre_ln=False, Vaswani 2017):      h = norm1(x + attention(x));   out = norm2(h + mlp(h))

Args: x (B, T, D); attention, mlp, norm1, norm2 callables; pre_ln a bool. Returns (B, T, D).
Pre-LN keeps an untouched path from input to output (the residual stream); post-LN normalises
the stream itself after every sub-layer.

Example: attention = lambda h: 2 * h, mlp = lambda h: h + 1, norm1 = norm2 = lambda h: h / 10,
x = [[[1.0]]]: pre-LN 1 + 2·0.1 = 1.2, then 1.2 + (0.12 + 1) = 2.32; post-LN (1 + 2) / 10 = 0.3, then
(0.3 + 1.3) / 10 = 0.16.

(CS189 Lec 22 §3.2; Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture".)
""",
    checks=(_block_pre, _block_post, _block_order),
    hints=(
        "Pre-LN: the norm goes on the way INTO each branch; the branch's output is added to what came in.",
        "Post-LN: add first (x + attention(x)), then normalise the sum; the same for the MLP with norm2.",
    ),
    see="qkv train gpt --norm_placement post",
    solution="""
def transformer_block(x, attention, mlp, norm1, norm2, pre_ln=True):
    if pre_ln:
        h = x + attention(norm1(x))
        return h + mlp(norm2(h))
    h = norm1(x + attention(x))
    return norm2(h + mlp(h))
""",
)


# --------------------------------------------------------------------------- ALiBi

S_ALIBI = "4 'Sinusoids extrapolate to longer sequences'"


def ref_alibi(T: int, n: int) -> Tensor:
    m = 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float64) / n)  # (n,)
    i = torch.arange(T, dtype=torch.float64)[:, None]
    j = torch.arange(T, dtype=torch.float64)[None]
    return (-m[:, None, None] * (i - j).clamp_min(0) + 0.0).float()  # 0 above the diagonal (+ 0.0: not -0)


@check("the slopes for 8 heads: bias[h, 1, 0] = −m_h = −1/2, −1/4, ..., −1/256")
def _alibi_slopes(f) -> None:
    got = as_tensor(f(2, 8), "alibi_bias(2, 8)")
    if tuple(got.shape) != (8, 2, 2):
        raise CheckError(
            f"alibi_bias(2, 8) has shape {tuple(got.shape)}, expected (n_heads, T, T) = (8, 2, 2)"
        )
    want = -(2.0 ** -torch.arange(1, 9, dtype=torch.float64)).float()
    close(
        got[:, 1, 0],
        want,
        "the slopes −m_h (bias[:, 1, 0], one token back)",
        "T = 2, 8 heads",
        causes=[
            (-(2.0 ** -torch.arange(0, 8, dtype=torch.float64)).float(), "h counts from 1: the first head's "
             "slope is 2^(−8·1/n) = 1/2, not 2^0 = 1"),
            (-want, "the bias is a penalty: −m_h·(i − j), negative for keys in the past"),
            (want.flip(0), "the slopes are reversed: head 0 gets the largest slope, 1/2"),
        ],
    )


@check("bias[h, i, j] = −m_h·(i − j) for j ≤ i, 0 above the diagonal (masked later); float32")
def _alibi_values(f) -> None:
    for T, n in ((1, 1), (3, 2), (5, 4), (6, 8), (4, 16)):
        want = ref_alibi(T, n)
        m = 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float64) / n)
        i = torch.arange(T, dtype=torch.float64)[:, None]
        j = torch.arange(T, dtype=torch.float64)[None]
        close(
            f(T, n),
            want,
            f"alibi_bias({T}, {n})",
            f"T = {T}, n_heads = {n}",
            causes=[
                (
                    (-m[:, None, None] * (i - j).abs()).float(),
                    "above the diagonal the bias is −m·|i − j|: this exercise's convention is 0 there "
                    "(the causal mask removes those keys later)",
                ),
                (want.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")),
                 "−inf above the diagonal folds the causal mask into the bias; keep it 0 there and the mask "
                 "(a boolean, True = may attend) separate"),
                ((-m[:, None, None] * (j - i).clamp_min(0)).float(), "it is transposed: rows are queries i, "
                 "columns keys j; the penalty grows with i − j for keys j ≤ i"),
            ],
        )


@check("the penalty is linear in the distance: each step back costs m_h, whatever the query")
def _alibi_linear(f) -> None:
    got = as_tensor(f(7, 4), "alibi_bias(7, 4)").double()
    if tuple(got.shape) != (4, 7, 7):
        raise CheckError(f"alibi_bias(7, 4) has shape {tuple(got.shape)}, expected (4, 7, 7)")
    m = 2.0 ** (-8.0 * torch.arange(1, 5, dtype=torch.float64) / 4)
    for h in range(4):
        for i in range(7):
            row = got[h, i, : i + 1]  # keys 0..i
            steps = row[1:] - row[:-1]  # moving one key closer to the query
            if i > 0 and not torch.allclose(steps, m[h].expand_as(steps), atol=1e-6):
                raise CheckError(
                    f"head {h}, query {i}: the bias of keys 0..{i} is {show(row)}; each key one step closer "
                    f"should gain m_{h + 1} = {m[h].item():.4g} (linear in the distance)"
                )
            if abs(float(got[h, i, i])) > 1e-7:
                raise CheckError(
                    f"head {h}: bias[{i}, {i}] = {float(got[h, i, i])}; distance 0 costs nothing"
                )


ALIBI_BIAS = Exercise(
    name="alibi_bias",
    section=S_ALIBI,
    difficulty=2,
    signature="(T, n_heads)",
    stub="""
ALiBi (Press et al. 2022, "Train Short, Test Long"): no position vectors at all; each head adds a
penalty linear in the distance to its scores, softmax(q·k / √d + bias), so it extrapolates to
sequences longer than it was trained on, a claim the lecture makes of sinusoids.

    bias[h, i, j] = −m_h · (i − j)   for keys j ≤ i (query i, key j; 0 on the diagonal)
    bias[h, i, j] = 0                for j > i: those keys are removed later by the causal mask
    m_h = 2^(−8h/n)                  for heads h = 1..n (n = n_heads, a power of two)

Args: T the sequence length, n_heads. Returns a float32 tensor (n_heads, T, T).
Do not call qkv's alibi_slopes or ALiBi.

Example: 8 heads have slopes 1/2, 1/4, ..., 1/256; alibi_bias(3, 1)[0] = [[0, 0, 0], [−0.0039, 0, 0],
[−0.0078, −0.0039, 0]] (one head: m = 2^−8)
(CS189 Lec 22 §四; `qkv train seq2seq --positions alibi` compares it with the others.)
""",
    checks=(_alibi_slopes, _alibi_values, _alibi_linear, forbid("alibi_slopes", "ALiBi")),
    hints=(
        "m = 2.0 ** (-8 * torch.arange(1, n_heads + 1) / n_heads): (n_heads,).",
        "dist = i - j with i = torch.arange(T)[:, None], j = torch.arange(T)[None]; clamp it at 0 (the "
        "future keys).",
        "bias = -m[:, None, None] * dist: broadcast to (n_heads, T, T); .float().",
    ),
    see="qkv train seq2seq --task copy --arch transformer --positions sinusoidal",
    forbidden=("alibi_slopes", "ALiBi"),
    solution="""
def alibi_bias(T, n_heads):
    m = 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)
    dist = (torch.arange(T)[:, None] - torch.arange(T)[None]).clamp_min(0)
    return (-m[:, None, None] * dist).float()
""",
)


# --------------------------------------------------------------------------- Discussion 10, Q1

S_DIS_Q1 = "Q1: q, k, v of three tokens by hand; x₃'s weights ≈ 0.9975"

# CS189 Discussion 10 (F25 Dis10 Q1): three 2-D tokens (rows) and the 2x3 query and key matrices;
# qkv/explain/worked_example.py works the same numbers (tests/learn/test_lec22.py compares them).
DIS10_X = ((2.0, 3.0), (-1.0, 0.0), (1.0, -2.0))
DIS10_W_Q = ((1.0, 0.0, 2.0), (0.0, 1.0, -3.0))
DIS10_W_K = ((0.0, 0.0, -1.0), (-2.0, 0.0, 1.0))
DIS10_ANSWER = 0.9975  # the notes' printed value: x₃'s weight on x₂ ("約 0.9975")


def ref_unscaled(x: Tensor, w_q: Tensor, w_k: Tensor) -> Tensor:
    q, k = x.double() @ w_q.double(), x.double() @ w_k.double()
    return _softmax64(q @ k.transpose(-1, -2)).to(x.dtype)


def dis10_weights() -> Tensor:
    """Discussion 10's unscaled weights, computed here in float64 from its numbers."""
    x, w_q, w_k = (torch.tensor(t, dtype=torch.float64) for t in (DIS10_X, DIS10_W_Q, DIS10_W_K))
    return ref_unscaled(x, w_q, w_k)


@check("Discussion 10's three tokens: x₃'s largest weight ≈ 0.9975 (float64, from the numbers)")
def _dis_q1(f) -> None:
    x, w_q, w_k = (torch.tensor(t, dtype=torch.float64) for t in (DIS10_X, DIS10_W_Q, DIS10_W_K))
    want = dis10_weights()
    q, k = x @ w_q, x @ w_k
    s = q @ k.T
    close(
        f(x, w_q, w_k),
        want,
        "unscaled_attention_weights(X, W_Q, W_K)",
        "Discussion 10's X = [[2, 3], [-1, 0], [1, -2]]",
        causes=[
            (
                _softmax64(s / math.sqrt(3)),
                "the scores are divided by √3: the Discussion leaves them unscaled (that is the point: "
                "a slightly larger inner product makes the softmax very peaked)",
            ),
            (
                _softmax64(s.T),
                "the scores are k_i·q_j; row i holds query i's scores s_ij = q_i·k_j (Q Kᵀ, not K Qᵀ)",
            ),
            (_softmax64(s, 0), "the weights sum to 1 over the queries (dim 0); softmax along each row"),
        ],
    )
    top = float(want[2].max())
    if abs(top - DIS10_ANSWER) > 5e-5:  # the numbers above must be the Discussion's own
        raise CheckError(
            f"the check's own numbers give {top:.5f}, not the notes' {DIS10_ANSWER}: report this"
        )


@check("random tokens, batched: against softmax(X W_Q (X W_K)ᵀ) in float64")
def _dis_values(f) -> None:
    for shape, d, seed in (((4, 3), 2, 0), ((2, 5, 4), 3, 10)):
        x = randn(*shape, seed=seed)
        w_q, w_k = randn(shape[-1], d, seed=seed + 1), randn(shape[-1], d, seed=seed + 2)
        s = (x @ w_q) @ (x @ w_k).transpose(-1, -2)
        close(
            f(x, w_q, w_k),
            ref_unscaled(x, w_q, w_k),
            "unscaled_attention_weights",
            f"x of shape {shape}, w of shape ({shape[-1]}, {d})",
            causes=[(_softmax64(s / math.sqrt(d)), "the scores are divided by √d: this exercise is the "
                     "Discussion's unscaled form")],
        )


@check("large scores (tokens times 10): no overflow; float32 in, float32 out")
def _dis_large(f) -> None:
    x = randn(4, 3, seed=20, dtype=torch.float32) * 10
    w_q, w_k = randn(3, 3, seed=21, dtype=torch.float32), randn(3, 3, seed=22, dtype=torch.float32)
    got = f(x, w_q, w_k)
    if isinstance(got, Tensor) and not torch.isfinite(got).all():
        raise CheckError(
            "scores in the hundreds give inf or NaN: exp overflows; subtract each row's maximum first "
            "(or use torch.softmax)"
        )
    close(got, ref_unscaled(x, w_q, w_k), "unscaled_attention_weights", "x times 10, float32", rtol=1e-4,
          atol=1e-6)


UNSCALED_WEIGHTS = Exercise(
    name="unscaled_attention_weights",
    section=S_DIS_Q1,
    difficulty=1,
    signature="(x, w_q, w_k)",
    stub="""
Discussion 10, problem 1: the attention weights of every token, WITHOUT the 1/√d:

    q_i = x_i W_Q,  k_j = x_j W_K,   s_ij = q_iᵀ k_j,   weights_i = softmax_j(s_ij)
    i.e.  weights = softmax(X W_Q (X W_K)ᵀ), row i for query x_i

Args: x (T, D) or (B, T, D), one token per row; w_q, w_k (D, d). Returns (..., T, T), x's dtype,
each row summing to 1 over the keys. Stable for large scores.

Example (the Discussion's): x₁ = [2, 3], x₂ = [-1, 0], x₃ = [1, -2], W_Q = [[1, 0, 2], [0, 1, -3]],
W_K = [[0, 0, -1], [-2, 0, 1]]: x₃'s scores are [2, 8, −20] and its weights [0.0025, 0.9975, 0.0000]
(CS189 Discussion 10 Q1: "a slightly larger inner product makes the softmax very peaked".)
""",
    checks=(_dis_q1, _dis_values, _dis_large),
    hints=(
        "Q = x @ w_q and K = x @ w_k, each (..., T, d); scores = Q @ K.transpose(-1, -2).",
        "torch.softmax(scores, dim=-1): no division by √d in this exercise.",
    ),
    see="qkv explain worked-example",
    solution="""
def unscaled_attention_weights(x, w_q, w_k):
    return torch.softmax((x @ w_q) @ (x @ w_k).transpose(-1, -2), dim=-1)
""",
)


# --------------------------------------------------------------------------- Discussion 10, Q2

S_DIS_Q2 = "Q2: E[qᵀk], Var(qᵀk) = d, the scale factor √d"


def _moments(f: Callable[..., Any], d: int, mu: float, var: float) -> tuple[float, float]:
    got = _pair(f(d, mu, var), f"dot_product_moments({d}, {mu}, {var})", "(mean, variance)")
    try:
        return float(got[0]), float(got[1])
    except (TypeError, ValueError):
        raise CheckError(
            f"dot_product_moments({d}, {mu}, {var}) should return two numbers, got {got!r}"
        ) from None


def _moment_error(
    f: Callable[..., Any], d: int, mu: float, var: float, want: tuple[float, float], source: str, rtol: float
) -> None:
    mean, variance = _moments(f, d, mu, var)
    ok_mean = abs(mean - want[0]) <= rtol * max(abs(want[0]), 1e-12) + 1e-12
    ok_var = abs(variance - want[1]) <= rtol * abs(want[1]) + 1e-12
    if ok_mean and ok_var:
        return
    why = ""
    if not ok_mean and math.isclose(mean, d * mu, rel_tol=1e-9):
        why = ": E[q_i k_i] = E[q_i]·E[k_i] = mu² (independent), so the mean is d·mu², not d·mu"
    elif not ok_mean and math.isclose(mean, mu * mu, rel_tol=1e-9):
        why = ": that is one term's mean; qᵀk sums d of them, d·mu²"
    elif math.isclose(variance, d * var * var, rel_tol=1e-9) and mu != 0:
        why = (": that is the mu = 0 variance; with a mean, Var(q_i k_i) = E[q_i²]E[k_i²] − mu⁴ = "
               "(var + mu²)² − mu⁴ = var² + 2·mu²·var")
    elif math.isclose(variance, d * (var * var + mu * mu * var), rel_tol=1e-9) and mu != 0:
        why = ": the cross term counts twice, (var + mu²)² − mu⁴ = var² + 2·mu²·var"
    elif math.isclose(variance, d * var, rel_tol=1e-9):
        why = ": Var(q_i k_i) at mu = 0 is E[q_i²]·E[k_i²] = var·var = var², not var"
    raise CheckError(
        f"dot_product_moments(d={d}, mu={mu}, var={var}) = ({mean:.6g}, {variance:.6g}), {source} "
        f"({want[0]:.6g}, {want[1]:.6g}){why}"
    )


def _enumerated(d: int, mu: float, var: float) -> tuple[float, float]:
    """Mean and variance of qᵀk, exactly, when every entry is mu ± √var with probability ½ each
    (mean mu, variance var): all 2^(2d) outcomes enumerated in float64."""
    vals = torch.tensor([mu - math.sqrt(var), mu + math.sqrt(var)], dtype=torch.float64)
    outcomes = torch.tensor(list(itertools.product((0, 1), repeat=2 * d)))
    qk = vals[outcomes]  # (2^(2d), 2d)
    s = (qk[:, :d] * qk[:, d:]).sum(-1)
    return float(s.mean()), float(((s - s.mean()) ** 2).mean())


@check("mu = 0: E[qᵀk] = 0 and Var(qᵀk) = d·var², = d at var = 1 (so qᵀk/√d has variance 1)")
def _mom_zero(f) -> None:
    for d, var in ((1, 1.0), (4, 1.0), (64, 1.0), (3, 2.0), (16, 0.5)):
        _moment_error(f, d, 0.0, var, (0.0, d * var * var), "expected", 1e-12)


@check("exact: every entry mu ± √var with probability ½, all 2^(2d) outcomes enumerated (float64)")
def _mom_exact(f) -> None:
    for d, mu, var in ((1, 0.5, 2.0), (2, -1.0, 0.25), (3, 2.0, 1.0), (4, 0.3, 3.0)):
        _moment_error(f, d, mu, var, _enumerated(d, mu, var), "the enumeration gives", 1e-9)


@check("a seeded Monte-Carlo sample: 40,000 Gaussian q, k of d = 16, mu = 0.5, var = 2 (loose tolerance)")
def _mom_sampled(f) -> None:
    d, mu, var, n = 16, 0.5, 2.0, 40_000
    g = gen(7)
    q = mu + math.sqrt(var) * torch.randn(n, d, generator=g, dtype=torch.float64)
    k = mu + math.sqrt(var) * torch.randn(n, d, generator=g, dtype=torch.float64)
    s = (q * k).sum(-1)
    sample = (float(s.mean()), float(s.var()))
    mean, variance = _moments(f, d, mu, var)
    # standard errors here: ~0.045 for the mean (of 4), ~0.9 for the variance (of 80)
    if abs(mean - sample[0]) > 0.2 or abs(variance - sample[1]) > 0.05 * sample[1]:
        _moment_error(f, d, mu, var, sample, "40,000 samples give about", 0.05)


DOT_PRODUCT_MOMENTS = Exercise(
    name="dot_product_moments",
    section=S_DIS_Q2,
    difficulty=2,
    signature="(d, mu, var)",
    stub="""
Discussion 10, problem 2: why attention divides by √d. Let q and k have d entries, all
independent, each with mean mu and variance var. Then qᵀk = Σ_i q_i k_i and

    E[qᵀk]   = d · mu²
    Var(qᵀk) = d · (var² + 2·mu²·var)        (each term: E[q_i²]E[k_i²] − mu⁴, E[q_i²] = var + mu²)

At mu = 0, var = 1 the variance is d: the scores grow like √d, the softmax saturates, so divide
by s = √d to keep mean 0 and variance 1.
Args: d an int, mu and var floats (var ≥ 0). Returns (mean, variance) as floats.

Example: dot_product_moments(64, 0.0, 1.0) -> (0.0, 64.0); dot_product_moments(16, 0.5, 2.0) -> (4.0, 80.0)
(CS189 Discussion 10 Q2, HW4 Q14; Vaswani et al. 2017 §3.2.1.)
""",
    checks=(_mom_zero, _mom_exact, _mom_sampled),
    hints=(
        "The d terms q_i k_i are independent: the mean and the variance of the sum are d times one term's.",
        "One term: E[q_i k_i] = mu·mu; E[(q_i k_i)²] = E[q_i²]·E[k_i²] = (var + mu²)².",
        "Var(q_i k_i) = (var + mu²)² − mu⁴ = var² + 2·mu²·var.",
    ),
    see="qkv explain scaling --mu 0.5",
    solution="""
def dot_product_moments(d, mu, var):
    return d * mu * mu, d * (var * var + 2 * mu * mu * var)
""",
)


# --------------------------------------------------------------------------- the KV cache

S_KV = "(Discussion 11, forward reference) the products a KV cache saves"


def ref_step(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    K, V = torch.cat([kc, k], dim=2), torch.cat([vc, v], dim=2)
    w = _softmax64(q.double() @ K.double().transpose(-1, -2) / math.sqrt(q.shape[-1]))
    return (w @ V.double()).to(q.dtype), K, V


def _kv_inputs(B: int, H: int, S: int, d: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple:
    return (
        randn(B, H, 1, d, seed=seed, dtype=dtype),
        randn(B, H, 1, d, seed=seed + 1, dtype=dtype),
        randn(B, H, 1, d, seed=seed + 2, dtype=dtype),
        randn(B, H, S, d, seed=seed + 3, dtype=dtype),
        randn(B, H, S, d, seed=seed + 4, dtype=dtype),
    )


def _call_step(f: Callable[..., Any], args: tuple, shapes: str) -> tuple[Any, Any, Any]:
    try:
        got = f(*args)
    except NotImplementedError:  # a RuntimeError too: the stub, not yet written (said by the runner)
        raise
    except RuntimeError as e:
        raise CheckError(
            f"kv_cache_step raised RuntimeError ({' '.join(str(e).split())[:140]}) for {shapes}: if it is a "
            "size mismatch, k and v are probably appended along the wrong dimension; the sequence is "
            "dim 2: (B, H, S, d) + (B, H, 1, d) -> (B, H, S + 1, d)"
        ) from None
    if not (isinstance(got, tuple | list) and len(got) == 3):
        raise CheckError(f"kv_cache_step should return (out, k_cache, v_cache), got {type(got).__name__}")
    return got[0], got[1], got[2]


def _cache_shape(got: Any, k: Tensor, kc: Tensor, what: str, shapes: str) -> None:
    got = as_tensor(got, what)
    want = (*kc.shape[:2], kc.shape[2] + 1, kc.shape[3])
    if tuple(got.shape) == want:
        return
    for dim in (0, 1, 3):
        try:
            wrong = torch.cat([kc, k], dim=dim).shape
        except RuntimeError:
            continue
        if tuple(got.shape) == tuple(wrong):
            raise CheckError(
                f"{what} has shape {tuple(got.shape)} for {shapes}: appended along dim {dim}; the sequence "
                f"is dim 2, expected {want}"
            )
    raise CheckError(f"{what} has shape {tuple(got.shape)} for {shapes}, expected {want}")


@check("one step: the new token attends to the S cached keys and itself; the caches grow to S + 1")
def _kv_step(f) -> None:
    for (B, H, S, d), seed in (((1, 1, 1, 2), 0), ((1, 1, 0, 3), 10), ((2, 3, 4, 4), 20)):
        q, k, v, kc, vc = _kv_inputs(B, H, S, d, seed)
        shapes = f"q, k, v of shape {(B, H, 1, d)}, caches of shape {(B, H, S, d)}"
        out, k_new, v_new = _call_step(f, (q, k, v, kc.clone(), vc.clone()), shapes)
        want_out, want_k, want_v = ref_step(q, k, v, kc, vc)
        _cache_shape(k_new, k, kc, "the returned k_cache", shapes)
        _cache_shape(v_new, v, vc, "the returned v_cache", shapes)
        if torch.allclose(as_tensor(k_new, "k_cache"), want_v) and not torch.allclose(want_k, want_v):
            raise CheckError(f"the returned caches are swapped for {shapes}: return (out, k_cache, v_cache)")
        close(
            k_new,
            want_k,
            "the returned k_cache",
            shapes,
            causes=[(torch.cat([k, kc], 2), "the new key goes at the END of the cache (the newest one)")],
        )
        close(v_new, want_v, "the returned v_cache", shapes)
        s_old = q @ kc.transpose(-1, -2) / math.sqrt(d)
        old_only = _softmax64(s_old) @ vc if S else torch.zeros_like(q)
        close(
            out,
            want_out,
            "out",
            shapes,
            causes=[
                (old_only, "the new token's key and value are appended AFTER attending; append first, then "
                 "attend: a token attends to itself too"),
                (ref_step(q * math.sqrt(d), k, v, kc, vc)[0], "the scores are not divided by √d"),
                (v, "the output is the new value alone: attend over every cached key, not just the new one"),
            ],
        )


def ref_causal(q: Tensor, k: Tensor, v: Tensor, strict: bool = False) -> Tensor:
    T = q.shape[-2]
    allowed = torch.ones(T, T, dtype=torch.bool).tril(-1 if strict else 0)
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    return (_softmax64(s).nan_to_num(0.0) @ v.double()).to(q.dtype)


@check("decoding 6 tokens one at a time from empty caches equals causal attention over all of them")
def _kv_decode(f) -> None:
    B, H, T, d = 2, 2, 6, 4
    q, k, v = randn(B, H, T, d, seed=30), randn(B, H, T, d, seed=31), randn(B, H, T, d, seed=32)
    kc, vc = torch.zeros(B, H, 0, d, dtype=q.dtype), torch.zeros(B, H, 0, d, dtype=q.dtype)
    outs = []
    for t in range(T):
        s = slice(t, t + 1)
        out, kc, vc = _call_step(f, (q[:, :, s], k[:, :, s], v[:, :, s], kc, vc), f"token {t}")
        outs.append(as_tensor(out, f"out at token {t}"))
        kc, vc = as_tensor(kc, "k_cache"), as_tensor(vc, "v_cache")
    if any(tuple(o.shape) != (B, H, 1, d) for o in outs):
        got_shapes = [tuple(o.shape) for o in outs]
        raise CheckError(f"each step's out should have shape {(B, H, 1, d)}, got {got_shapes}")
    close(
        torch.cat(outs, dim=2),
        ref_causal(q, k, v),
        "the outputs, token by token",
        f"{T} tokens, B = {B}, H = {H}, d = {d}",
        causes=[
            (ref_causal(q, k, v, strict=True), "each token attends to the earlier ones only: append before "
             "attending"),
            (ref_causal(q * math.sqrt(d), k, v), "the scores are not divided by √d"),
        ],
    )


@check("float32 in, float32 out; the gradient through a step (gradcheck, float64)")
def _kv_grad(f) -> None:
    args = _kv_inputs(1, 2, 3, 4, seed=40, dtype=torch.float32)
    out, _, _ = _call_step(f, args, "float32 inputs")
    close(out, ref_step(*args)[0], "out", "float32 inputs", rtol=1e-5, atol=1e-6)
    gradcheck(lambda *a: f(*a)[0], _kv_inputs(1, 2, 2, 3, seed=50), "out")


KV_CACHE_STEP = Exercise(
    name="kv_cache_step",
    section=S_KV,
    difficulty=2,
    signature="(q, k, v, k_cache, v_cache)",
    stub="""
One decoding step through a KV cache. When a decoder generates, the keys and values of past
tokens never change: keep them, and for each new token compute only its own q, k, v, append k
and v, and attend with its one query. Per step that is S + 1 scores instead of a whole
(S + 1) x (S + 1) matrix: the products the cache saves.

    K = [k_cache; k],  V = [v_cache; v]   (appended along the sequence, dim 2)
    out = softmax(q Kᵀ / √d) V            (no mask: every cached key is in the past)

Args: q, k, v (B, H, 1, d) for the newest token; k_cache, v_cache (B, H, S, d), S ≥ 0 (S = 0:
an empty cache, the first token). Returns (out (B, H, 1, d), k_cache (B, H, S + 1, d),
v_cache (B, H, S + 1, d)). Decoding a sequence token by token must equal causal attention over
the whole of it. (F.scaled_dot_product_attention is allowed; the cache is the exercise.)

Example: with empty caches the first token attends only to itself (out = v). Then, d = 2,
k1 = [0, 1], v1 = [1], and a new token with q = k2 = [1, 0], v2 = [3]: weights
softmax([0, 1/√2]) = [0.3302, 0.6698], out = 0.3302·1 + 0.6698·3 = 2.3395.

(CS189 Lec 22, Discussion 10 and 11's forward reference; qkv/attention/kv_cache.py preallocates.)
""",
    checks=(_kv_step, _kv_decode, _kv_grad),
    hints=(
        "k_cache = torch.cat([k_cache, k], dim=2), and the same for v, BEFORE attending: the new token "
        "attends to itself.",
        "scores = q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]): (B, H, 1, S + 1).",
        "out = torch.softmax(scores, dim=-1) @ v_cache; return out, k_cache, v_cache.",
    ),
    see="qkv explain cost --model smollm2",
    solution="""
def kv_cache_step(q, k, v, k_cache, v_cache):
    k_cache = torch.cat([k_cache, k], dim=2)
    v_cache = torch.cat([v_cache, v], dim=2)
    weights = torch.softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v_cache, k_cache, v_cache
""",
)


LEC22: tuple[Exercise, ...] = (
    SELF_ATTENTION,
    RAW_SELF_ATTENTION,
    MIXING_WEIGHT,
    ATTENTION_FLOPS,
    KV_CACHE_BYTES,
    FEED_FORWARD,
    TRANSFORMER_BLOCK,
    ALIBI_BIAS,
    UNSCALED_WEIGHTS,
    DOT_PRODUCT_MOMENTS,
    KV_CACHE_STEP,
)
