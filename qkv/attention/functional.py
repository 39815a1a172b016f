"""Attention math: softmax, masks, and scaled dot-product attention with three backends.

Shape legend (used in every attention file):
    B batch, H query heads, K key/value heads (K divides H: MHA K=H, GQA 1<K<H, MQA K=1),
    T query length, S key length, D head dim (Dv for values), G = H // K queries per KV head.

Mask convention, the only one in qkv: a **bool** tensor broadcastable to (B, H, T, S),
``True`` = "this query may attend to this key". Additive float biases (ALiBi, relative
positions) go in the separate ``bias`` argument.

Lectures: CS189 Lec 21-22 (soft dictionary, softmax vs hardmax, softmax(QKᵀ/√d)V),
CS231N Lec 8 (scaled dot-product attention, masked self-attention).
Paper: Vaswani et al. 2017, "Attention Is All You Need", eq. (1).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.chunked import chunked_attention_kernel

Backend = Literal["reference", "sdpa", "chunked"]
BACKENDS: tuple[str, ...] = ("reference", "sdpa", "chunked")


class AttentionOutput(NamedTuple):
    """What every attention function returns.

    out: (B, H, T, Dv) attended values. weights: (B, H, T, S) attention probabilities
    (before dropout) when they were asked for, else ``None``.
    """

    out: Tensor
    weights: Tensor | None = None


# --------------------------------------------------------------------------- softmax / hardmax


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax: exp(x - max) / Σ exp(x - max), along ``dim``.

    Subtracting the row maximum changes nothing mathematically (softmax is shift invariant)
    but keeps exp() from overflowing. A row that is entirely -inf (a query that may attend
    to nothing) gives all zeros instead of NaN.

    Lecture: CS189 Lec 21, "softmax replaces hardmax": softmax([1, 2, 3]) ≈ [0.09, 0.24, 0.67].
    """
    m = x.detach().amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf row: shift by 0
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s)


def hardmax(x: Tensor, dim: int = -1) -> Tensor:
    """One-hot of the maximum along ``dim``: the exact-match dictionary lookup.

    Ties share the weight evenly (so the result still sums to 1); an all -inf row gives zeros.
    Not differentiable in any useful way, which is why attention uses softmax.

    Lecture: CS189 Lec 21: hardmax([1, 2, 3]) = [0, 0, 1].
    """
    m = x.amax(dim=dim, keepdim=True)
    hit = (x == m) & torch.isfinite(m)
    hit = hit.to(x.dtype)
    n = hit.sum(dim=dim, keepdim=True)
    return hit / torch.where(n == 0, torch.ones_like(n), n)


# --------------------------------------------------------------------------- masks


def causal_mask(
    T: int, S: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """(T, S) bool mask, True where key j is not in the future of query i.

    When S > T the T queries are the *last* T positions of the S keys (decoding with a KV
    cache: query i sits at absolute position S - T + i). This "bottom-right" alignment is
    what incremental decoding needs; note that ``torch.nn.functional.scaled_dot_product_attention``
    with ``is_causal=True`` aligns top-left instead, so qkv never hands it T != S causally.
    """
    S = T if S is None else S
    i = torch.arange(T, device=device).unsqueeze(1) + (S - T)  # absolute query positions
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i


def padding_mask(lengths: Tensor, S: int | None = None) -> Tensor:
    """(B, 1, 1, S) bool mask from per-sequence lengths: key j is real iff j < lengths[b]."""
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    S = int(lengths.max()) if S is None else S
    j = torch.arange(S, device=lengths.device)
    return (j.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :]


def sliding_window_mask(
    T: int,
    window: int,
    S: int | None = None,
    *,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """(T, S) bool mask for local attention: each query sees keys at most ``window - 1`` back.

    With ``causal=True`` (Longformer/Mistral-style decoder) query i sees keys
    i - window < j <= i; with ``causal=False`` it sees |i - j| < window. Aligned like
    :func:`causal_mask` when S > T.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    S = T if S is None else S
    i = torch.arange(T, device=device).unsqueeze(1) + (S - T)
    j = torch.arange(S, device=device).unsqueeze(0)
    near = (i - j).abs() < window
    return near & (j <= i) if causal else near


# --------------------------------------------------------------------------- checks


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None
) -> None:
    """Raise ValueError naming the argument and the values, never a deep torch shape error."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D (B, heads, length, head_dim), got shape {tuple(t.shape)}"
            )
    B, H, T, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, K, S)")
    if k.shape[-1] != D:
        raise ValueError(f"q and k head dims differ: q has {D}, k has {k.shape[-1]}")
    K = k.shape[1]
    if H % K != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({K})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    S = k.shape[2]
    target = (B, H, T, S)
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        pairs = zip(t.shape[::-1], target[::-1], strict=False)  # align trailing dims
        if t.ndim > 4 or any(a not in (1, b) for a, b in pairs):
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} does not broadcast to (B, H, T, S) = {target}"
            )
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
            "use mask.bool(), or pass an additive float mask as bias="
        )
    if bias is not None and not bias.is_floating_point():
        raise ValueError(f"bias must be a floating-point tensor, got dtype {bias.dtype}")


def _allowed(
    mask: Tensor | None, is_causal: bool, T: int, S: int, device: torch.device
) -> Tensor | None:
    """Combine an explicit bool mask with causality into one bool mask (or None)."""
    if not is_causal:
        return mask
    c = causal_mask(T, S, device=device)
    return c if mask is None else mask & c


def repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """(B, K, S, D) -> (B, H, S, D): each key/value head serves G = H // K query heads (GQA)."""
    K = x.shape[1]
    if K == n_heads:
        return x
    return x.repeat_interleave(n_heads // K, dim=1)


# --------------------------------------------------------------------------- backends


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    bias: Tensor | None = None,
) -> AttentionOutput:
    """Reference attention, the matrix form written out: softmax(QKᵀ·scale + bias, masked)·V.

    Args:
        q: (B, H, T, D) queries. k: (B, K, S, D) keys. v: (B, K, S, Dv) values; K divides H.
        mask: bool, broadcastable to (B, H, T, S); True = may attend.
        is_causal: also forbid keys in the future (bottom-right aligned, see ``causal_mask``).
        scale: defaults to 1/√D (why: Discussion 10 problem 2, qᵀk has variance D).
        dropout_p: dropout on the attention weights; pass 0.0 in eval mode.
        return_weights: also return the (B, H, T, S) weights (before dropout).
        bias: additive float scores, broadcastable to (B, H, T, S) (ALiBi, relative bias).

    Returns:
        AttentionOutput(out (B, H, T, Dv), weights or None). Rows that may attend to
        nothing give zeros.
    """
    _check_inputs(q, k, v, mask, bias)
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # GQA: query head h reads key/value head h // G (G = H / K, as repeat_kv lays them out).
    # The G query heads of a group are stacked as rows of one product, rather than copying
    # each key/value head G times: the same dot products, no (B, H, S, D) copies.
    qg = q.reshape(B, K, (H // K) * T, D)  # (B, K, G·T, D)
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
    scores = (qg @ k.transpose(-2, -1)).view(B, H, T, S).to(acc) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias.to(acc)
    allowed = _allowed(mask, is_causal, T, S, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = softmax(scores, dim=-1).to(v.dtype)
    p = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = (p.reshape(B, K, (H // K) * T, S) @ v).view(B, H, T, v.shape[-1])  # (B, H, T, Dv)
    return AttentionOutput(out, weights if return_weights else None)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    bias: Tensor | None = None,
) -> AttentionOutput:
    """PyTorch's fused kernel (FlashAttention / memory-efficient / math, chosen by PyTorch).

    Same arguments and semantics as :func:`scaled_dot_product_attention`, without weights.
    """
    _check_inputs(q, k, v, mask, bias)
    T, S = q.shape[2], k.shape[2]
    if T == 1 and bias is None and dropout_p == 0.0 and torch.compiler.is_compiling():
        return AttentionOutput(_one_query_attention(q, k, v, mask, scale))
    gqa = q.shape[1] != k.shape[1]
    if mask is None and bias is None and (not is_causal or T == S):
        # Fast path: the kernel handles causality (top-left == bottom-right when T == S).
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
        return AttentionOutput(out)
    allowed = _allowed(mask, is_causal, T, S, q.device)
    attn_mask: Tensor | None = allowed
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if allowed is not None:
            attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    if allowed is not None:  # rows with nothing to attend to: zeros on every kernel
        out = out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return AttentionOutput(out)


def _one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                         scale: float | None) -> Tensor:
    """One query per head (a decoding step), written as multiply-and-sum for a compiler.

    q (B, H, 1, D), k (B, K, S, D), v (B, K, S, Dv), mask bool broadcastable to (B, H, 1, S)
    -> (B, H, 1, Dv).
    The same formula as :func:`scaled_dot_product_attention`, in fp32, the G = H / K query heads
    of a key/value head side by side (no copies of the keys). Inside ``torch.compile`` or
    ``torch.export`` + AOTInductor the products, the softmax and the weighted sum become a few
    fused loops of generated code, where PyTorch's fused kernel (or two batched matrix
    products) is a library call with a fixed cost of its own, paid 30 times a token for
    SmolLM2 (a quarter of a saved step's time outside the weight products; BENCHMARKS.md).
    Eagerly it would build (B, K, G, S, D) products in memory: compiled steps only.
    """
    B, H, _, D = q.shape
    K = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.float().view(B, K, H // K, 1, D)  # (B, K, G, 1, D)
    scores = (qg * k.float().unsqueeze(2)).sum(-1) * scale  # (B, K, G, S)
    if mask is not None:
        allowed = mask.expand(B, H, 1, k.shape[2]).reshape(B, K, H // K, k.shape[2])
        scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)  # (B, K, G, S)
    out = (p.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)  # (B, K, G, D)
    if mask is not None:  # rows with nothing to attend to: zeros, as on every other path
        out = out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return out.reshape(B, H, 1, v.shape[-1]).to(q.dtype)


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    bias: Tensor | None = None,
    q_chunk: int | None = None,
    k_chunk: int | None = None,
) -> AttentionOutput:
    """Online-softmax attention over tiles of keys: O(T) memory, never the (T, S) matrix.

    The FlashAttention recurrence (Dao et al. 2022; Milakov & Gimelshein 2018) in plain
    PyTorch, with a recomputing backward pass so training memory is O(T) too. Same
    semantics as :func:`scaled_dot_product_attention`; ``bias`` gets no gradient.

    ``q_chunk`` / ``k_chunk`` (tile sizes) default to square tiles of about 2M scores in all
    heads together: small enough to stay in cache, large enough that Python's loop is cheap.
    """
    _check_inputs(q, k, v, mask, bias)
    B, H = q.shape[:2]
    side = 2 ** round(math.log2(math.sqrt(2**21 / (B * H))))
    side = min(max(side, 64), 2048)
    q_chunk = side if q_chunk is None else q_chunk
    k_chunk = side if k_chunk is None else k_chunk
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"q_chunk and k_chunk must be >= 1, got {q_chunk}, {k_chunk}")
    if bias is not None and bias.requires_grad:
        raise ValueError(
            "chunked attention does not back-propagate into bias; "
            "detach it or use backend='reference'"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = repeat_kv(k, H), repeat_kv(v, H)  # linear in S; autograd sums the groups back
    out = chunked_attention_kernel(
        q, k, v, mask, bias, is_causal, scale, dropout_p, q_chunk, k_chunk
    )
    return AttentionOutput(out)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    bias: Tensor | None = None,
    backend: Backend = "sdpa",
) -> AttentionOutput:
    """One signature, three backends chosen by argument (never by a global).

    ``"reference"``: explicit math, can return weights. ``"sdpa"``: PyTorch's fused kernel,
    the fastest. ``"chunked"``: online softmax, O(T) memory. Tests prove they agree.
    """
    if is_causal and q.ndim == 4 and q.shape[2] == 1:
        is_causal = False  # one query at the end of the keys (a decoding step) sees them all
    if backend == "reference":
        return scaled_dot_product_attention(
            q, k, v, mask, is_causal, scale, dropout_p, return_weights, bias
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if return_weights:
        raise ValueError(
            f"backend={backend!r} never materialises the attention weights; "
            "use backend='reference' to get them"
        )
    fn = sdpa_attention if backend == "sdpa" else chunked_attention
    return fn(q, k, v, mask, is_causal, scale, dropout_p, bias)
