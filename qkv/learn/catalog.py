"""The exercises, by lecture section (CS189 Lec 21-22 and Discussion 10; CS231N Lec 8).

Each check compares with an independent reference written here (PyTorch's own ops, float64
formulas), runs small inputs first so that a failure shows the smallest one, and names the likely
cause of a recognisable mistake. Conventions are qkv's: a boolean mask is True where a query may
attend; a query with no allowed key gets all-zero weights (and a zero output), never NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.learn.exercise import Check, CheckError, Exercise, check, close, forbid, gradcheck, pair, randn, show

# --------------------------------------------------------------------------- references


def ref_softmax(x: Tensor, dim: int = -1) -> Tensor:
    return torch.softmax(x.double(), dim=dim).to(x.dtype)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no allowed key: zeros
    return (w @ v.double()).to(q.dtype), w.to(q.dtype)


def ref_mha(
    x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, w_o: Tensor, h: int, causal: bool = False
) -> Tensor:
    B, T, D = x.shape
    d = D // h

    def split(t: Tensor) -> Tensor:
        return t.view(B, T, h, d).transpose(1, 2)

    x64 = x.double()
    q, k, v = split(x64 @ w_q.double()), split(x64 @ w_k.double()), split(x64 @ w_v.double())
    mask = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    out, _ = ref_attention(q, k, v, mask)
    return (out.transpose(1, 2).reshape(B, T, D) @ w_o.double()).to(x.dtype)


def ref_sinusoidal(T: int, d: int) -> Tensor:
    p = torch.arange(T, dtype=torch.float64)[:, None]
    i = torch.arange(0, d, 2, dtype=torch.float64)[None]
    pe = torch.zeros(T, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(p / 10000 ** (i / d))
    pe[:, 1::2] = torch.cos(p / 10000 ** (i / d))[:, : d // 2]
    return pe.float()


def ref_rope(x: Tensor, positions: Tensor, theta: float = 10000.0) -> Tensor:
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = positions.double()[:, None] * inv[None]  # (T, d/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def ref_additive(query: Tensor, keys: Tensor, w_q: Tensor, w_k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    q, k = query.double(), keys.double()
    scores = torch.tanh((q @ w_q.double())[:, None] + k @ w_k.double()) @ v.double()  # (B, T)
    w = torch.softmax(scores, dim=-1)
    return (w[:, :, None] * k).sum(1).to(query.dtype), w.to(query.dtype)


# --------------------------------------------------------------------------- softmax

S_SOFTMAX = "1 Content-based attention: hardmax vs softmax, inner-product retrieval"


@check("the values of softmax along the last dimension (float64, random)")
def _softmax_values(f) -> None:
    for shape in ((3,), (2, 4), (2, 3, 5)):
        x = randn(*shape, seed=len(shape))
        close(
            f(x),
            ref_softmax(x),
            "softmax(x)",
            f"x = {show(x)}",
            causes=[
                (
                    torch.softmax(x, 0) if x.ndim > 1 else x,
                    "it is normalised along dim 0, not along the last dimension (dim=-1)",
                )
            ],
        )


@check("the dim argument: dim=0 and dim=1 of a (3, 4, 2) tensor")
def _softmax_dim(f) -> None:
    x = randn(3, 4, 2, seed=5)
    for dim in (0, 1):
        close(
            f(x, dim=dim),
            ref_softmax(x, dim),
            f"softmax(x, dim={dim})",
            "x of shape (3, 4, 2)",
            causes=[
                (ref_softmax(x, -1), "it always normalises the last dimension: use the dim you are given")
            ],
        )


@check("large logits [1000, 1000, 999] (stable: subtract the max first)")
def _softmax_large(f) -> None:
    x = torch.tensor([1000.0, 1000.0, 999.0])
    got = f(x)
    if isinstance(got, Tensor) and not torch.isfinite(got).all():
        raise CheckError(
            f"softmax([1000, 1000, 999]) gave {show(got)}: exp(1000) overflows; subtract the "
            "maximum before exp (softmax(x) = softmax(x - max x))"
        )
    close(got, ref_softmax(x), "softmax(x)", "x = [1000, 1000, 999] (float32)", rtol=1e-5)


@check("Discussion 10: x₃'s unscaled scores [-10, 8, 2] give x₂ ≈ 0.9975")
def _softmax_discussion(f) -> None:
    # scores of x₃ = [1, -2] against x₁, x₂, x₃ in the Discussion's table (q₃·k_j): the answer key 0.9975
    s = torch.tensor([-10.0, 8.0, 2.0], dtype=torch.float64)
    got = torch.as_tensor(f(s)).double()
    if abs(float(got[1]) - 0.99752) > 5e-5:
        raise CheckError(f"softmax([-10, 8, 2])[1] = {float(got[1]):.5f}, the Discussion's answer is 0.9975")


@check("a masked entry (-inf) gets weight 0; float32 in, float32 out")
def _softmax_masked(f) -> None:
    x = torch.tensor([[0.5, float("-inf"), 1.0], [float("-inf"), 2.0, 2.0]])
    close(f(x), ref_softmax(x), "softmax(x)", f"x = {show(x)}", rtol=1e-6)


@check("its gradient (torch.autograd.gradcheck, float64)")
def _softmax_grad(f) -> None:
    gradcheck(f, (randn(2, 5, seed=9),), "softmax")


SOFTMAX = Exercise(
    name="softmax",
    section=S_SOFTMAX,
    difficulty=1,
    signature="(x, dim=-1)",
    stub="""
The softmax of x along dimension ``dim``: softmax(x)_i = exp(x_i) / Σ_j exp(x_j).

Numerically stable: exp(1000) overflows float32 and float64, but softmax(x) = softmax(x - c)
for any c, so subtract the maximum along ``dim`` first. Entries of -inf (masked) get weight 0.

Args: x: a tensor of any shape (float32 or float64; return the same dtype), dim: the axis to
normalise (every slice along it sums to 1).
Do not call torch.softmax, F.softmax, log_softmax or nn.Softmax: write it.

Example: softmax(torch.tensor([1.0, 2.0, 3.0])) -> [0.0900, 0.2447, 0.6652]
(CS189 Lec 21, "hardmax vs softmax"; Discussion 10's x₃: softmax([-10, 8, 2])[1] = 0.9975.)
""",
    checks=(
        _softmax_values,
        _softmax_dim,
        _softmax_large,
        _softmax_discussion,
        _softmax_masked,
        _softmax_grad,
        forbid("softmax", "log_softmax", "Softmax"),
    ),
    hints=(
        "exp, then divide by the sum along dim (sum(..., dim=dim, keepdim=True) keeps the shape "
        "broadcastable).",
        "Subtract x.amax(dim=dim, keepdim=True) before exp: the result is the same, and nothing overflows.",
        "A row of -inf and finite values: exp(-inf) = 0, so the masked entry's weight is 0 as it should be.",
    ),
    see="qkv explain softmax",
    forbidden=("softmax", "log_softmax", "Softmax"),
    solution="""
def softmax(x, dim=-1):
    z = x - x.amax(dim=dim, keepdim=True)
    e = torch.exp(z)
    return e / e.sum(dim=dim, keepdim=True)
""",
)


# --------------------------------------------------------------------------- scaled dot-product attention

S_ATTENTION = "2.2 Matrix form softmax(QKᵀ/√d)V and its implementation"


@check("out and weights against softmax(QKᵀ/√d)V (float64, random, batch and heads)")
def _attn_values(f) -> None:
    for (T, S, d, dv), seed in (((1, 2, 3, 3), 0), ((3, 5, 4, 2), 1), ((4, 7, 8, 6), 2)):
        q, k, v = (
            randn(2, 3, T, d, seed=seed),
            randn(2, 3, S, d, seed=seed + 10),
            randn(2, 3, S, dv, seed=seed + 20),
        )
        out, w = pair(f(q, k, v), "scaled_dot_product_attention(q, k, v)")
        want_out, want_w = ref_attention(q, k, v)
        unscaled = torch.softmax(q @ k.transpose(-1, -2), -1)
        over_queries = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -2)
        inputs = f"q, k, v of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        close(
            w,
            want_w,
            "weights",
            inputs,
            causes=[
                (unscaled, "the scores are not divided by √d (d = q.shape[-1])"),
                (
                    over_queries,
                    "your weights sum to 1 over the queries, not the keys: softmax along the last dimension",
                ),
            ],
        )
        close(out, want_out, "out", inputs)


@check("Discussion 10's tokens: x₃ puts ≈ 0.9975 of its weight on x₂")
def _attn_discussion(f) -> None:
    X = torch.tensor([[2.0, 3.0], [-1.0, 0.0], [1.0, -2.0]], dtype=torch.float64)
    W_Q = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -3.0]], dtype=torch.float64)
    W_K = torch.tensor([[0.0, 0.0, -1.0], [-2.0, 0.0, 1.0]], dtype=torch.float64)
    W_V = torch.tensor([[8.0, 0.0], [0.0, 9.0]], dtype=torch.float64)
    q = X @ W_Q * math.sqrt(3)  # times √d: the Discussion leaves its scores unscaled
    _, w = pair(f(q, X @ W_K, X @ W_V), "scaled_dot_product_attention(q, k, v)")
    got = float(torch.as_tensor(w)[2, 1])
    if abs(got - 0.99752) > 5e-5:
        raise CheckError(
            f"weights[2, 1] = {got:.5f} for the Discussion's tokens (q scaled by √3 so that your "
            "√d cancels); its answer key is 0.9975"
        )


@check("a boolean mask: True = may attend (a causal mask over 4 tokens)")
def _attn_mask(f) -> None:
    q, k, v = randn(1, 4, 3, seed=3), randn(1, 4, 3, seed=4), randn(1, 4, 2, seed=5)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    out, w = pair(f(q, k, v, mask), "scaled_dot_product_attention(q, k, v, mask)")
    want_out, want_w = ref_attention(q, k, v, mask)
    close(
        w,
        want_w,
        "weights",
        "a causal mask (True on and below the diagonal)",
        causes=[
            (
                ref_attention(q, k, v, ~mask)[1],
                "the mask is inverted: True means the query MAY attend that key",
            )
        ],
    )
    close(out, want_out, "out", "a causal mask")


@check("a query whose keys are all masked: zero weights and a zero output, no NaN (qkv's convention)")
def _attn_all_masked(f) -> None:
    q, k, v = randn(3, 2, seed=6), randn(3, 2, seed=7), randn(3, 2, seed=8)
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    out, w = pair(f(q, k, v, mask), "scaled_dot_product_attention(q, k, v, mask)")
    want_out, want_w = ref_attention(q, k, v, mask)
    if isinstance(w, Tensor) and torch.isnan(w).any():
        raise CheckError(
            "row 1 has no key it may attend: softmax of all -inf is NaN; qkv's convention is "
            "all-zero weights there (e.g. weights.nan_to_num(0.0), or mask the exp)"
        )
    close(w, want_w, "weights", f"mask = {show(mask)}")
    close(out, want_out, "out", f"mask = {show(mask)}")


@check("float32 in, float32 out; its gradient (gradcheck, float64)")
def _attn_grad(f) -> None:
    q, k, v = (randn(2, 3, 4, seed=s, dtype=torch.float32) for s in (11, 12, 13))
    out, _ = pair(f(q, k, v), "scaled_dot_product_attention")
    close(out, ref_attention(q, k, v)[0], "out", "float32 inputs", rtol=1e-5, atol=1e-6)
    gradcheck(
        lambda a, b, c: f(a, b, c)[0],
        (randn(2, 3, 4, seed=14), randn(2, 5, 4, seed=15), randn(2, 5, 3, seed=16)),
        "out",
    )


ATTENTION = Exercise(
    name="scaled_dot_product_attention",
    section=S_ATTENTION,
    difficulty=2,
    signature="(q, k, v, mask=None)",
    stub="""
Scaled dot-product attention: weights = softmax(q kᵀ / √d), out = weights v.

Args: q (..., Tq, d), k (..., Tk, d), v (..., Tk, dv); any leading (batch, head) dimensions.
mask: optional bool, broadcastable to (..., Tq, Tk); True = the query MAY attend that key.
Returns (out (..., Tq, dv), weights (..., Tq, Tk)); each row of weights sums to 1 over the keys.
A query with no key it may attend gets all-zero weights and a zero output (qkv's convention),
never NaN. Keep the input's dtype.
Do not call F.scaled_dot_product_attention or nn.MultiheadAttention (softmax is yours to use:
torch.softmax is fine here).

Example: q = k = [[1, 0], [0, 1]], v = [[1, 2], [3, 4]] -> weights row 0 = [0.670, 0.330]
(CS189 Lec 22, "matrix form"; Vaswani et al. 2017, eq. 1.)
""",
    checks=(
        _attn_values,
        _attn_discussion,
        _attn_mask,
        _attn_all_masked,
        _attn_grad,
        forbid("scaled_dot_product_attention", "MultiheadAttention"),
    ),
    hints=(
        "scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]): (..., Tq, Tk).",
        "Masked scores become -inf before the softmax: scores.masked_fill(~mask, float('-inf')).",
        "softmax over the LAST dimension (the keys); then out = weights @ v.",
        "A row of all -inf gives NaN: weights = weights.nan_to_num(0.0) (or torch.where on mask.any(-1)).",
    ),
    see="qkv explain worked-example",
    forbidden=("scaled_dot_product_attention", "MultiheadAttention"),
    solution="""
def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v, weights
""",
)


# --------------------------------------------------------------------------- causal mask

S_MASK = "Masked self-attention: M_ij = 0 or −∞, rows renormalised"


@check("a bool (T, T) tensor, True where key j ≤ query i, for T = 1, 2, 5")
def _mask_values(f) -> None:
    for T in (1, 2, 5):
        got = f(T)
        want = torch.ones(T, T, dtype=torch.bool).tril()
        if isinstance(got, Tensor) and got.dtype != torch.bool:
            raise CheckError(
                f"causal_mask({T}) has dtype {got.dtype}: return bool, True = may attend "
                "(not 0 / -inf: that is the additive form)"
            )
        close(
            got,
            want,
            f"causal_mask({T})",
            f"T = {T}",
            causes=[
                (
                    torch.ones(T, T, dtype=torch.bool).tril(-1),
                    "the diagonal is False: a token may attend to itself (key j ≤ query i)",
                ),
                (
                    torch.ones(T, T, dtype=torch.bool).triu(),
                    "it is transposed: rows are queries, so row i allows columns 0..i",
                ),
            ],
        )


@check("it makes attention causal: changing a later token never changes an earlier output")
def _mask_causal(f) -> None:
    T = 6
    q, k, v = randn(T, 4, seed=1), randn(T, 4, seed=2), randn(T, 3, seed=3)
    m = torch.as_tensor(f(T)).bool()
    out1, _ = ref_attention(q, k, v, m)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = randn(2, 4, seed=9), randn(2, 3, seed=10)
    out2, _ = ref_attention(q, k2, v2, m)
    if not torch.allclose(out1[:4], out2[:4]):
        raise CheckError(
            "with your mask, changing tokens 4 and 5 changed the outputs of tokens 0..3: the "
            "mask lets a query see the future"
        )


CAUSAL_MASK = Exercise(
    name="causal_mask",
    section=S_MASK,
    difficulty=1,
    signature="(T)",
    stub="""
The causal (decoder) mask for T tokens: a bool tensor (T, T), True where key j ≤ query i.

Row i is query i: it may attend to keys 0..i (itself included) and not to later ones. qkv's one
mask convention: True = may attend (the additive form M_ij = 0 / −∞ is derived from it).

Example: causal_mask(3) -> [[True, False, False], [True, True, False], [True, True, True]]
(CS231N Lec 8, masked self-attention; CS189 Lec 22.)
""",
    checks=(_mask_values, _mask_causal),
    hints=(
        "torch.ones(T, T, dtype=torch.bool) and keep the lower triangle.",
        "torch.tril keeps the diagonal (offset 0): a token attends to itself.",
    ),
    see="qkv explain masking",
    solution="""
def causal_mask(T):
    i = torch.arange(T)
    return i[None, :] <= i[:, None]
""",
)


# --------------------------------------------------------------------------- multi-head attention

S_MHA = "3.1 Multi-head attention: h heads, concatenated, 3hd² vs 3d² parameters"


def _mha_inputs(B: int, T: int, D: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[Tensor, ...]:
    return tuple(
        randn(*s, seed=seed + i, dtype=dtype) * (0.5 if i else 1.0)
        for i, s in enumerate(((B, T, D), (D, D), (D, D), (D, D), (D, D)))
    )


@check("against the reference (B=2, T=5, D=8, 2 heads; and 1 head, 4 heads)")
def _mha_values(f) -> None:
    for h in (2, 1, 4):
        x, wq, wk, wv, wo = _mha_inputs(2, 5, 8, seed=h)
        want = ref_mha(x, wq, wk, wv, wo, h)
        B, T, D = x.shape
        d = D // h
        wrong_scale = (
            torch.softmax(
                (x @ wq).view(B, T, h, d).transpose(1, 2)
                @ (x @ wk).view(B, T, h, d).transpose(1, 2).transpose(-1, -2)
                / math.sqrt(D),
                -1,
            )
            @ (x @ wv).view(B, T, h, d).transpose(1, 2)
        ).transpose(1, 2).reshape(B, T, D) @ wo
        no_wo = ref_mha(x, wq, wk, wv, torch.eye(D, dtype=x.dtype), h)
        close(
            f(x, wq, wk, wv, wo, h),
            want,
            f"multi_head_attention(..., n_heads={h})",
            f"x (2, 5, 8), {h} heads",
            causes=[
                (
                    wrong_scale,
                    "the scores are divided by √D; each head's are divided by √(D / n_heads), its own width",
                )
                if h > 1
                else (want, ""),
                (no_wo, "the heads' concatenation is not multiplied by w_o"),
            ],
        )


@check("heads are split from the last dimension in order: view(B, T, h, d), not view(B, h, T, d)")
def _mha_split(f) -> None:
    x, wq, wk, wv, wo = _mha_inputs(1, 4, 6, seed=7)
    want = ref_mha(x, wq, wk, wv, wo, 3)
    B, T, D, h = 1, 4, 6, 3
    d = D // h
    bad = (
        torch.softmax(
            (x @ wq).reshape(B, h, T, d) @ (x @ wk).reshape(B, h, T, d).transpose(-1, -2) / math.sqrt(d), -1
        )
        @ (x @ wv).reshape(B, h, T, d)
    ).reshape(B, T, D) @ wo
    close(
        f(x, wq, wk, wv, wo, 3),
        want,
        "multi_head_attention(..., n_heads=3)",
        "x (1, 4, 6)",
        causes=[
            (
                bad,
                "the heads are reshaped to (B, h, T, d) directly, which mixes tokens into heads: "
                "view(B, T, h, d).transpose(1, 2)",
            )
        ],
    )


@check("causal=True: changing a later token never changes an earlier output")
def _mha_causal(f) -> None:
    x, wq, wk, wv, wo = _mha_inputs(1, 6, 8, seed=3)
    close(
        f(x, wq, wk, wv, wo, 2, causal=True),
        ref_mha(x, wq, wk, wv, wo, 2, causal=True),
        "multi_head_attention(..., causal=True)",
        "x (1, 6, 8)",
    )
    x2 = x.clone()
    x2[:, 4:] = randn(1, 2, 8, seed=99)
    a, b = f(x, wq, wk, wv, wo, 2, causal=True), f(x2, wq, wk, wv, wo, 2, causal=True)
    if not torch.allclose(torch.as_tensor(a)[:, :4], torch.as_tensor(b)[:, :4]):
        raise CheckError("with causal=True, changing tokens 4 and 5 changed the outputs of tokens 0..3")


@check("permutation equivariance without positions: f(PX) = P f(X)")
def _mha_equivariant(f) -> None:
    x, wq, wk, wv, wo = _mha_inputs(1, 5, 8, seed=5)
    perm = torch.tensor([3, 0, 4, 1, 2])
    a, b = torch.as_tensor(f(x[:, perm], wq, wk, wv, wo, 2)), torch.as_tensor(f(x, wq, wk, wv, wo, 2))
    if not torch.allclose(a, b[:, perm], atol=1e-8):
        raise CheckError(
            "permuting the tokens did not just permute the outputs: attention without positions "
            "has no notion of order (CS231N Lec 8)"
        )


MULTI_HEAD = Exercise(
    name="multi_head_attention",
    section=S_MHA,
    difficulty=2,
    signature="(x, w_q, w_k, w_v, w_o, n_heads, causal=False)",
    stub="""
Multi-head self-attention of x, written with your own attention.

Args: x (B, T, D); w_q, w_k, w_v, w_o (D, D), each applied as ``x @ w``; n_heads h divides D.
Q = x @ w_q, K = x @ w_k, V = x @ w_v; split each into h heads of width d = D / h from the last
dimension in order (head 0 = columns 0..d-1): (B, T, D) -> (B, h, T, d); per head
softmax(Q Kᵀ / √d) V, with a causal mask when ``causal``; concatenate the heads back to (B, T, D)
and multiply by w_o. Returns (B, T, D).
Do not call F.scaled_dot_product_attention or nn.MultiheadAttention.

Example: x = [[[1, 0], [0, 1]]], every w the 2×2 identity, n_heads = 1, causal=True ->
[[[1, 0], [0.3302, 0.6698]]] (token 2 weighs itself e^(1/√2) against token 1's e^0).

(CS189 Lec 22 §3.1; CS231N Lec 8: "multi-head attention, and its four matrix multiplications".)
""",
    checks=(
        _mha_values,
        _mha_split,
        _mha_causal,
        _mha_equivariant,
        forbid("scaled_dot_product_attention", "MultiheadAttention", "multi_head_attention_forward"),
    ),
    hints=(
        "Four products: x @ w_q, x @ w_k, x @ w_v, and (the heads, concatenated) @ w_o.",
        "Split: t.view(B, T, h, d).transpose(1, 2) -> (B, h, T, d); "
        "merge: .transpose(1, 2).reshape(B, T, D).",
        "Scale by √d with d = D // n_heads, each head's own width, not √D.",
    ),
    see="qkv explain heads",
    forbidden=("scaled_dot_product_attention", "MultiheadAttention"),
    solution="""
def multi_head_attention(x, w_q, w_k, w_v, w_o, n_heads, causal=False):
    B, T, D = x.shape
    d = D // n_heads
    split = lambda t: t.view(B, T, n_heads, d).transpose(1, 2)
    q, k, v = split(x @ w_q), split(x @ w_k), split(x @ w_v)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    return out.transpose(1, 2).reshape(B, T, D) @ w_o
""",
)


# --------------------------------------------------------------------------- sinusoidal positions

S_POS = "4 Positional encodings: order must be added; requirements; learned vs sinusoidal"


@check("PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same), for (T, d) = (1, 2), (4, 6), (50, 16)")
def _pos_values(f) -> None:
    for T, d in ((1, 2), (4, 6), (50, 16)):
        want = ref_sinusoidal(T, d)
        p = torch.arange(T, dtype=torch.float64)[:, None]
        i = torch.arange(0, d, 2, dtype=torch.float64)[None]
        halves = torch.cat([torch.sin(p / 10000 ** (i / d)), torch.cos(p / 10000 ** (i / d))], 1).float()
        wrong_exp = ref_sinusoidal_exp(T, d)
        close(
            f(T, d),
            want,
            f"sinusoidal_positions({T}, {d})",
            f"T = {T}, d = {d}",
            rtol=1e-5,
            atol=1e-6,
            causes=[
                (halves, "sin and cos are in two halves; they interleave: even columns sin, odd columns cos"),
                (
                    wrong_exp,
                    "the exponent is i/d with i the column; it is 2i/d with i the pair's index (column 2i)",
                ),
            ],
        )


def ref_sinusoidal_exp(T: int, d: int) -> Tensor:
    p = torch.arange(T, dtype=torch.float64)[:, None]
    cols = torch.arange(d, dtype=torch.float64)[None]
    ang = p / 10000 ** (cols / d)
    pe = torch.where(torch.arange(d)[None] % 2 == 0, torch.sin(ang), torch.cos(ang))
    return pe.float()


SINUSOIDAL = Exercise(
    name="sinusoidal_positions",
    section=S_POS,
    difficulty=1,
    signature="(T, d)",
    stub="""
The sinusoidal positional encodings of Vaswani et al. (2017): a (T, d) float32 tensor with

    PE[p, 2i]   = sin(p / 10000^(2i/d))
    PE[p, 2i+1] = cos(p / 10000^(2i/d))

for positions p = 0..T-1 and pairs i = 0..d/2-1 (d even). Row 0 is [0, 1, 0, 1, ...].

Example: sinusoidal_positions(2, 4) -> [[0, 1, 0, 1], [0.8415, 0.5403, 0.0100, 0.9999]].

(CS189 Lec 22 §四: order must be added; each pair is a rotation at its own frequency.)
""",
    checks=(_pos_values,),
    hints=(
        "p = torch.arange(T)[:, None]; the frequencies 10000 ** (-torch.arange(0, d, 2) / d).",
        "Fill pe[:, 0::2] with sin and pe[:, 1::2] with cos of the same angles.",
    ),
    see="qkv explain positions",
    solution="""
def sinusoidal_positions(T, d):
    p = torch.arange(T, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pe = torch.zeros(T, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(p * freq)
    pe[:, 1::2] = torch.cos(p * freq)
    return pe.float()
""",
)


# --------------------------------------------------------------------------- RoPE

S_ROPE = "Positional encodings: learned, RoPE, relative"


@check("against the reference: rotate-half pairs (i, i + d/2), angle p·θ^(−2i/d)")
def _rope_values(f) -> None:
    for shape, seed in (((1, 4), 0), ((3, 8), 1), ((2, 2, 5, 16), 2)):
        x = randn(*shape, seed=seed)
        pos = torch.arange(shape[-2]) + seed
        want = ref_rope(x, pos)
        d = shape[-1]
        inv = 10000.0 ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
        ang = pos.double()[:, None] * inv
        x1, x2 = x[..., 0::2], x[..., 1::2]  # the interleaved pairing (GPT-J, the RoFormer paper)
        inter = torch.stack([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1).flatten(
            -2
        )
        close(
            f(x, pos),
            want,
            "rope(x, positions)",
            f"x of shape {shape}, positions {pos.tolist()}",
            causes=[
                (
                    inter,
                    "the pairs are (2i, 2i+1), interleaved; Llama and SmolLM2 checkpoints pair (i, i + d/2) "
                    "(rotate half)",
                ),
                (ref_rope(x, -pos), "the rotation goes the other way: x1·cos − x2·sin, x2·cos + x1·sin"),
            ],
        )


@check("scores q_m·k_n depend only on m − n (the point of RoPE)")
def _rope_relative(f) -> None:
    q, k = randn(1, 8, seed=3), randn(1, 8, seed=4)
    s = []
    for m, n in ((5, 2), (13, 10), (3, 0)):
        a = torch.as_tensor(f(q, torch.tensor([m])))
        b = torch.as_tensor(f(k, torch.tensor([n])))
        s.append(float((a * b).sum()))
    if max(s) - min(s) > 1e-8:
        raise CheckError(
            f"q at 5 · k at 2, q at 13 · k at 10, q at 3 · k at 0 gave {[round(x, 6) for x in s]}: "
            "they should be equal (the same distance 3)"
        )


@check("position 0 is the identity, and the norm of each vector is kept")
def _rope_norm(f) -> None:
    x = randn(4, 6, seed=5)
    got = torch.as_tensor(f(x, torch.tensor([0, 1, 7, 100])))
    close(got[:1], x[:1], "rope at position 0", "position 0")
    if not torch.allclose(got.norm(dim=-1), x.norm(dim=-1)):
        raise CheckError("the norms changed: each pair is rotated, never scaled")


ROPE = Exercise(
    name="rope",
    section=S_ROPE,
    difficulty=2,
    signature="(x, positions, theta=10000.0)",
    stub="""
Rotary position embedding (Su et al. 2021), in the convention of Llama and SmolLM2 checkpoints.

Args: x (..., T, d) with d even; positions (T,) integers; theta the base.
Pair dimension i with i + d/2 ("rotate half") and rotate each pair (x1, x2) by the angle
p·θ^(−2i/d) of its position p:  x1' = x1·cos − x2·sin,  x2' = x2·cos + x1·sin.
Returns a tensor of x's shape and dtype. Then q_m · k_n depends only on m − n.

Example: rope(torch.tensor([[1., 0, 0, 0]]), torch.tensor([1])) -> [[0.5403, 0, 0.8415, 0]]
(the pair (0, 2) turned by 1 radian, the pair (1, 3) by 0.01 radian, but it is zero).

(CS231N Lec 8, positional encodings; qkv/attention/positional.py does the same for SmolLM2.)
""",
    checks=(_rope_values, _rope_relative, _rope_norm),
    hints=(
        "inv = theta ** (-torch.arange(0, d // 2) * 2 / d); angles = positions[:, None] * inv: (T, d/2).",
        "x1, x2 = x[..., :d//2], x[..., d//2:]; torch.cat([x1*cos - x2*sin, x2*cos + x1*sin], -1).",
    ),
    see="qkv explain positions",
    solution="""
def rope(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = positions.to(torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
""",
)


# --------------------------------------------------------------------------- layer norm

S_LN = "3.2 The Transformer layer: residual + LayerNorm + MLP; pre-LN vs post-LN"


@check("against F.layer_norm over the last dimension (float64 and float32)")
def _ln_values(f) -> None:
    for shape, dtype in (((5,), torch.float64), ((2, 3, 8), torch.float64), ((4, 16), torch.float32)):
        x = randn(*shape, seed=len(shape), dtype=dtype) * 3 + 1
        w, b = randn(shape[-1], seed=7, dtype=dtype), randn(shape[-1], seed=8, dtype=dtype)
        want = F.layer_norm(x, (shape[-1],), w, b, 1e-5)
        var_u = x.var(-1, keepdim=True, unbiased=True)
        unbiased = (x - x.mean(-1, keepdim=True)) / torch.sqrt(var_u + 1e-5) * w + b
        close(
            f(x, w, b),
            want,
            "layer_norm(x, weight, bias)",
            f"x of shape {shape} ({dtype})",
            rtol=1e-5 if dtype == torch.float32 else 1e-7,
            atol=1e-6,
            causes=[
                (
                    unbiased,
                    "the variance is the unbiased one (divided by n − 1); LayerNorm uses the biased one "
                    "(mean of squares, divided by n): var(unbiased=False)",
                )
            ],
        )


@check("a constant row (zero variance): the output is the bias, no NaN; eps inside the square root")
def _ln_tiny(f) -> None:
    x = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 1e-4, 0.0, -1e-4]], dtype=torch.float64)
    w, b = (
        torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64),
        torch.tensor([0.5, -1.0, 0.0, 1.0], dtype=torch.float64),
    )
    want = F.layer_norm(x, (4,), w, b, 1e-5)
    xc = x - x.mean(-1, keepdim=True)
    outside = xc / (xc.pow(2).mean(-1, keepdim=True).sqrt() + 1e-5) * w + b
    unbiased = xc / torch.sqrt(x.var(-1, keepdim=True, unbiased=True) + 1e-5) * w + b
    close(
        f(x, w, b),
        want,
        "layer_norm",
        f"x = {show(x)}",
        causes=[(outside, "eps is added outside the square root; it goes inside: (x − μ) / √(σ² + eps)"),
                (unbiased, "the variance is the unbiased one (divided by n − 1); LayerNorm uses the biased "
                           "one (mean of squares, divided by n): var(unbiased=False)")],
    )


@check("its gradient (gradcheck, float64)")
def _ln_grad(f) -> None:
    gradcheck(f, (randn(3, 6, seed=1), randn(6, seed=2), randn(6, seed=3)), "layer_norm")


LAYER_NORM = Exercise(
    name="layer_norm",
    section=S_LN,
    difficulty=1,
    signature="(x, weight, bias, eps=1e-5)",
    stub="""
Layer normalisation over the last dimension (Ba et al. 2016):

    y = (x − μ) / √(σ² + eps) · weight + bias

with μ and σ² the mean and the biased variance (divided by n) of x's last dimension.
Args: x (..., n); weight, bias (n,). Returns x's shape and dtype.
Do not call F.layer_norm or nn.LayerNorm.

Example: layer_norm(torch.tensor([1., 2, 3]), torch.ones(3), torch.zeros(3)) -> [-1.2247, 0, 1.2247].

(CS189 Lec 22 §3.2, the Transformer layer: residual + LayerNorm + MLP.)
""",
    checks=(_ln_values, _ln_tiny, _ln_grad, forbid("layer_norm", "LayerNorm")),
    hints=(
        "mu = x.mean(-1, keepdim=True); var = ((x - mu) ** 2).mean(-1, keepdim=True).",
        "eps goes inside the root: (x - mu) / torch.sqrt(var + eps).",
    ),
    see="qkv train gpt --help (--norm_placement pre/post)",
    forbidden=("layer_norm", "LayerNorm"),
    solution="""
def layer_norm(x, weight, bias, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * weight + bias
""",
)


# --------------------------------------------------------------------------- additive attention

S_ADDITIVE = "Attention in four steps (Bahdanau): scores, softmax, weighted sum, output; alignments"


def _add_inputs(B: int, T: int, dq: int, dk: int, A: int, seed: int) -> tuple[Tensor, ...]:
    return (
        randn(B, dq, seed=seed),
        randn(B, T, dk, seed=seed + 1),
        randn(dq, A, seed=seed + 2) * 0.5,
        randn(dk, A, seed=seed + 3) * 0.5,
        randn(A, seed=seed + 4),
    )


@check("context and weights against vᵀ tanh(q W_q + k_j W_k), softmax over T (float64)")
def _add_values(f) -> None:
    for dims, seed in (((1, 1, 2, 3, 4), 0), ((2, 5, 3, 4, 6), 10), ((3, 7, 5, 5, 8), 20)):
        q, k, wq, wk, v = _add_inputs(*dims, seed=seed)
        ctx, w = pair(f(q, k, wq, wk, v), "additive_attention")
        want_ctx, want_w = ref_additive(q, k, wq, wk, v)
        no_tanh = torch.softmax(((q @ wq)[:, None] + k @ wk) @ v, -1)
        over_batch = torch.softmax(torch.tanh((q @ wq)[:, None] + k @ wk) @ v, 0)
        inputs = f"B, T, dq, dk, A = {dims}"
        close(
            w,
            want_w,
            "weights",
            inputs,
            causes=[
                (no_tanh, "the scores miss the tanh: vᵀ tanh(q W_q + k W_k)"),
                (over_batch, "the softmax runs over the batch; it is over the T source positions (dim 1)"),
            ],
        )
        close(ctx, want_ctx, "context", inputs)


@check("its gradient (gradcheck, float64)")
def _add_grad(f) -> None:
    gradcheck(lambda *a: f(*a)[0], _add_inputs(2, 4, 3, 3, 5, seed=30), "context")


ADDITIVE = Exercise(
    name="additive_attention",
    section=S_ADDITIVE,
    difficulty=2,
    signature="(query, keys, w_q, w_k, v)",
    stub="""
Additive (Bahdanau) attention, one query per row of the batch:

    score_j = vᵀ tanh(query W_q + key_j W_k),   weights = softmax over j,   context = Σ_j weights_j key_j

Args: query (B, dq) (the decoder's state), keys (B, T, dk) (the encoder's states), w_q (dq, A),
w_k (dk, A), v (A,). Returns (context (B, dk), weights (B, T)), each row of weights summing to 1.

Example: query [[1, 0]], keys [[[1, 0], [0, 1]]], w_q = w_k = the identity, v = [1, 1]: the scores
are tanh(2) + tanh(0) = 0.964 and tanh(1) + tanh(1) = 1.523, so weights [[0.3637, 0.6363]] and
context [[0.3637, 0.6363]].

(Bahdanau et al. 2015; CS231N Lec 8, "attention in four steps"; qkv's RNN translator uses it.)
""",
    checks=(_add_values, _add_grad),
    hints=(
        "(query @ w_q)[:, None, :] + keys @ w_k is (B, T, A): broadcast the query over the T keys.",
        "torch.tanh(...) @ v gives (B, T) scores; softmax over dim 1; "
        "context = (weights[..., None] * keys).sum(1).",
    ),
    see="qkv explain bottleneck",
    solution="""
def additive_attention(query, keys, w_q, w_k, v):
    scores = torch.tanh((query @ w_q)[:, None, :] + keys @ w_k) @ v
    weights = torch.softmax(scores, dim=1)
    return (weights[:, :, None] * keys).sum(1), weights
""",
)


def _all() -> dict[str, Exercise]:
    from qkv.learn.catalog_cs231n import CS231N
    from qkv.learn.catalog_lec21 import LEC21
    from qkv.learn.catalog_lec22 import LEC22
    from qkv.learn.catalog_more import MORE
    from qkv.learn.handmade import HANDMADE

    first = (SOFTMAX, ATTENTION, CAUSAL_MASK, MULTI_HEAD, SINUSOIDAL, ROPE, LAYER_NORM, ADDITIVE)
    out: dict[str, Exercise] = {}
    for e in (*first, *MORE, *LEC21, *LEC22, *CS231N, *HANDMADE):
        if e.name in out:
            raise ValueError(f"two exercises are called {e.name}")
        out[e.name] = e
    return out


EXERCISES: dict[str, Exercise] = _all()


def get(name: str) -> Exercise:
    """The exercise called ``name`` (InputError naming the exercises otherwise)."""
    if name not in EXERCISES:
        import difflib

        from qkv.errors import InputError

        close = difflib.get_close_matches(name, list(EXERCISES), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise InputError(f"no exercise {name!r}; {hint}`qkv learn list` shows the {len(EXERCISES)} exercises")
    return EXERCISES[name]


__all__ = ["EXERCISES", "Check", "Exercise", "get"]
