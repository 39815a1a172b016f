"""Multi-head attention: self and cross, MHA / GQA / MQA, one module.

Each head is its own (W_Q, W_K, W_V) soft lookup; the heads' outputs are concatenated and
mixed by W_O (CS189 Lec 22 "multi-head attention"; Vaswani et al. 2017 §3.2.2). With fewer
key/value heads than query heads, each K/V head serves a group of query heads: GQA (Ainslie
et al. 2023); with a single K/V head, MQA (Shazeer 2019). Fewer K/V heads = a smaller KV cache.

Shapes: B batch, T query length, S key length, H query heads, K key/value heads,
Dh head dim, dim model width (query side), kv_dim width of the cross-attention context.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.attention.functional import BACKENDS, AttentionOutput, Backend, attention
from qkv.attention.kv_cache import LayerKVCache
from qkv.attention.positional import RotaryEmbedding
from qkv.nn.linear import Linear


class MultiHeadAttention(nn.Module):
    """Projections around :func:`qkv.attention.functional.attention`.

    Args:
        dim: model width of the queries (and of the output).
        n_heads: H, query heads. n_kv_heads: K (default H); must divide H. 1 = MQA.
        head_dim: Dh (default dim // n_heads).
        cross: cross-attention: queries from ``x``, keys/values from ``context``.
        kv_dim: width of ``context`` (default dim); only with ``cross``.
        bias: biases on the projections. qkv_bias: biases on the q/k/v projections only
            (default ``bias``; True with ``bias=False`` is Qwen2's layout, Bai et al. 2023).
        dropout: on the attention weights, in training.
        backend: default backend, overridable per call.
        tie_qk: one matrix for queries and keys, W_Q = W_K (self-attention with K = H only): the
            scores s_ij = (W x_i)·(W x_j) are then symmetric (CS189 Lec 21: why Q ≠ K). The fused
            projection then holds [q heads | v heads].

    Self-attention uses one fused projection ``qkv`` (one matmul instead of three); cross
    uses ``q_proj`` and a fused ``kv_proj``. The output projection is ``out_proj``.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        cross: bool = False,
        kv_dim: int | None = None,
        bias: bool = True,
        qkv_bias: bool | None = None,
        dropout: float = 0.0,
        backend: Backend = "sdpa",
        tie_qk: bool = False,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if tie_qk and (cross or n_kv_heads != n_heads):
            raise ValueError("tie_qk (W_Q = W_K) needs self-attention with as many key heads as query heads "
                             f"(got n_heads {n_heads}, n_kv_heads {n_kv_heads}{', cross' if cross else ''})")
        if n_heads < 1 or n_kv_heads < 1:
            raise ValueError(f"n_heads ({n_heads}) and n_kv_heads ({n_kv_heads}) must be >= 1")
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
            )
        if head_dim is None and dim % n_heads:
            raise ValueError(f"dim ({dim}) must be divisible by n_heads ({n_heads}), "
                             "or pass head_dim explicitly")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if kv_dim is not None and not cross:
            raise ValueError("kv_dim is only meaningful with cross=True")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.cross, self.dropout, self.backend, self.tie_qk = cross, dropout, backend, tie_qk
        q_width, kv_width = n_heads * self.head_dim, n_kv_heads * self.head_dim
        in_bias = bias if qkv_bias is None else qkv_bias
        if cross:
            self.q_proj = Linear(dim, q_width, bias=in_bias)
            self.kv_proj = Linear(dim if kv_dim is None else kv_dim, 2 * kv_width, bias=in_bias)
        else:
            self.qkv = Linear(dim, q_width + (1 if tie_qk else 2) * kv_width, bias=in_bias)
        self.out_proj = Linear(q_width, dim, bias=bias)

    def _project(
        self, x: Tensor, context: Tensor | None, rope: RotaryEmbedding | None, offset: int | Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, dim) [, (B, S, kv_dim)] -> q (B, H, T, Dh), k and v (B, K, S, Dh), with
        q and k rotated by RoPE from position ``offset`` when ``rope`` is given."""
        B, T, _ = x.shape
        H, K, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs context= (B, S, kv_dim)")
            if rope is not None:
                raise ValueError("RoPE is for self-attention; cross-attention takes rope=None")
            S = context.shape[1]
            q = self.q_proj(x).view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
            k, v = self.kv_proj(context).view(B, S, 2 * K, Dh).transpose(1, 2).split([K, K], dim=1)
            return q, k, v  # k, v: (B, K, S, Dh)
        if context is not None:
            raise ValueError("self-attention takes no context; build with cross=True")
        if self.tie_qk:  # [q heads | v heads]; the keys are the queries
            q, v = self.qkv(x).view(B, T, 2 * H, Dh).transpose(1, 2).split([H, H], dim=1)
            if rope is not None:
                q = rope(q, offset)
            return q, q, v
        # The fused projection lays out [q heads | k heads | v heads]: view it as H + 2K
        # heads, so that RoPE rotates q and k in one call.
        qkv = self.qkv(x).view(B, T, H + 2 * K, Dh).transpose(1, 2)  # (B, H+2K, T, Dh)
        qk, v = qkv.split([H + K, K], dim=1)
        if rope is not None:
            qk = rope(qk, offset)
        q, k = qk.split([H, K], dim=1)  # (B, H, T, Dh), (B, K, T, Dh)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        bias: Tensor | None = None,
        rope: RotaryEmbedding | None = None,
        cache: LayerKVCache | None = None,
        backend: Backend | None = None,
        return_weights: bool = False,
    ) -> AttentionOutput:
        """Attend from ``x`` to itself (or to ``context``).

        Args:
            x: (B, T, dim). context: (B, S, kv_dim) for cross-attention.
            mask: bool, broadcastable to (B, H, T, S), True = may attend. With a cache,
                S counts the cached tokens too.
            is_causal: forbid attending to later positions.
            bias: additive scores broadcastable to (B, H, T, S) (e.g. ALiBi).
            rope: rotate q and k by their absolute positions (cache.pos onwards).
            cache: this layer's KV cache; new keys/values are stored at ``cache.pos`` and
                attention runs over everything stored. The caller advances the cache.
            backend: override the module's backend for this call.
            return_weights: also return (B, H, T, S) weights (needs backend "reference").

        Returns:
            AttentionOutput(out (B, T, dim), weights or None).
        """
        if x.ndim != 3:
            raise ValueError(f"x must be (B, T, dim), got shape {tuple(x.shape)}")
        q, k, v = self._project(x, context, rope, 0 if cache is None else cache.pos)
        if cache is not None:
            cache.keep_query(q)  # kept only where the cache asks (a saved step's attention rows)
            k, v = cache.update(k, v)  # (B, K, pos + T, Dh)
        kw = dict(is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0, bias=bias,
                  return_weights=return_weights, backend=self.backend if backend is None else backend)
        lengths = None if cache is None else cache.row_lengths(q.shape[2])
        rows = None if cache is None or lengths is not None else cache.row_mask(q.shape[2])
        if rows is not None:  # a masked running batch: each row's own keys, causally
            mask, kw["is_causal"] = (rows if mask is None else mask & rows), False
        if lengths is None:
            out, weights = attention(q, k, v, mask=mask, **kw)  # type: ignore[arg-type]
        else:
            out, weights = attend_rows(q, k, v, lengths, mask=mask, **kw)  # type: ignore[arg-type]
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H·Dh)
        return AttentionOutput(self.out_proj(out), weights)


def attend_rows(q: Tensor, k: Tensor, v: Tensor, lengths: list[int], *, mask: Tensor | None = None,
                bias: Tensor | None = None, return_weights: bool = False, **kw: object) -> AttentionOutput:
    """Attention for a running batch whose rows hold different numbers of keys: row b's queries
    (1, H, T, Dh) attend over its first ``lengths[b]`` keys only, one call per row, so each row
    gets the very numbers it would get decoded alone (a masked batched call would sum the same
    terms in another order). ``k``, ``v``: (B, K, S, Dh), S >= max(lengths); ``mask``/``bias``
    broadcastable to (B, H, T, S). Weights, asked for: (B, H, T, S), zero past each row's keys.
    """
    outs, ws = [], []
    for b, n in enumerate(lengths):
        o, w = attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                         mask=None if mask is None else mask[b : b + 1, ..., :n],
                         bias=None if bias is None else bias[b : b + 1, ..., :n],
                         return_weights=return_weights, **kw)  # type: ignore[arg-type]
        outs.append(o)
        ws.append(w)
    weights = None
    if return_weights:
        B, H, T = q.shape[0], q.shape[1], q.shape[2]
        weights = q.new_zeros(B, H, T, k.shape[2], dtype=ws[0].dtype)
        for b, (n, w) in enumerate(zip(lengths, ws, strict=True)):
            weights[b, ..., :n] = w[0]
    return AttentionOutput(torch.cat(outs), weights)
