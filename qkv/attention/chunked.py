"""The chunked (online-softmax) attention kernel: forward and a recomputing backward.

Shapes (see functional.py for the legend): q (B, H, T, D); k (B, H, S, D) and v (B, H, S, Dv)
already expanded to H heads; mask bool and bias float, both broadcastable to (B, H, T, S).

Forward, per tile of queries, walking over tiles of keys (FlashAttention, Dao et al. 2022):
    m_new = max(m, rowmax(s))            running maximum of the scores
    l     = l·exp(m - m_new) + Σ exp(s - m_new)      running normaliser
    acc   = acc·exp(m - m_new) + exp(s - m_new)·V     running weighted sum
    out   = acc / l
Only a (Tq, Sk) tile of scores exists at any time, so memory is O(T) for fixed tiles.
The backward pass recomputes each tile's probabilities from the saved log-sum-exp
(FlashAttention-2), so training does not store the (T, S) matrix either.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _key_tiles(q0: int, q1: int, S: int, kc: int, is_causal: bool, offset: int):
    """Yield (k0, k1, diagonal) for the key tiles that queries q0..q1-1 may attend to.

    Tiles entirely in the future of their queries are skipped (half the work when causal);
    ``diagonal`` says whether the tile straddles the causal boundary and needs a mask.
    Query i sits at absolute position offset + i (offset = S - T, bottom-right alignment).
    """
    for k0 in range(0, S, kc):
        k1 = min(k0 + kc, S)
        if is_causal and k0 > offset + q1 - 1:
            return  # every later key tile is in the future of every query here
        yield k0, k1, is_causal and k1 - 1 > offset + q0


def _tile_scores(qs, k, mask, bias, q0, q1, k0, k1, diagonal, offset):
    """Scores of one tile, (B, H, tq, tk) in the accumulation dtype, -inf where forbidden.

    ``qs`` is q already multiplied by the scale (one O(T) pass instead of one per tile);
    every later step works in place, since each elementwise pass over a tile costs as
    much memory traffic as the matrix product that made it.
    """
    s = qs[:, :, q0:q1] @ k[:, :, k0:k1].transpose(-2, -1)
    s = s.to(_acc_dtype(qs))  # no copy in fp32/fp64; fp16/bf16 tiles accumulate in fp32
    if bias is not None:
        s.add_(bias[..., q0:q1, k0:k1])
    allowed = None
    if mask is not None:
        allowed = mask[..., q0:q1, k0:k1]
    if diagonal:
        i = torch.arange(q0, q1, device=qs.device).unsqueeze(1) + offset
        j = torch.arange(k0, k1, device=qs.device).unsqueeze(0)
        c = j <= i
        allowed = c if allowed is None else allowed & c
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


def _keep_mask(seed: int, tile: int, shape, p: float, device) -> Tensor:
    """The same dropout keep-mask for a tile in forward and backward (seeded per tile)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed + tile)
    return torch.rand(shape, generator=g, device=device) >= p


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, is_causal, scale, dropout_p, qc, kc, seed):
        B, H, T, _ = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        dt = _acc_dtype(q)
        offset = S - T
        out = torch.empty(B, H, T, Dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, T, dtype=dt, device=q.device)  # log Σ exp(s), per row
        qs = q * scale
        for q0 in range(0, T, qc):
            q1 = min(q0 + qc, T)
            m = torch.full((B, H, q1 - q0, 1), float("-inf"), dtype=dt, device=q.device)
            l = torch.zeros((B, H, q1 - q0, 1), dtype=dt, device=q.device)
            acc = torch.zeros((B, H, q1 - q0, Dv), dtype=dt, device=q.device)
            for k0, k1, diag in _key_tiles(q0, q1, S, kc, is_causal, offset):
                s = _tile_scores(qs, k, mask, bias, q0, q1, k0, k1, diag, offset)
                m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                p = s.sub_(m_safe).exp_()  # (B, H, tq, tk); forbidden keys: exp(-inf) = 0
                alpha = torch.exp(m - m_safe)  # rescales what was accumulated so far
                l = l * alpha + p.sum(dim=-1, keepdim=True)
                if dropout_p > 0:
                    keep = _keep_mask(seed, q0 * S + k0, p.shape, dropout_p, q.device)
                    p = p * keep / (1.0 - dropout_p)
                acc.mul_(alpha).add_(p.to(v.dtype) @ v[:, :, k0:k1])
                m = m_new
            # A row that may attend to nothing has l == 0: output zeros, lse 0 (any finite value).
            empty = l == 0
            out[:, :, q0:q1] = (acc / torch.where(empty, torch.ones_like(l), l)).to(q.dtype)
            m_fin = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            lse[:, :, q0:q1] = torch.where(empty, 0.0, m_fin + torch.log(l)).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.cfg = (is_causal, scale, dropout_p, qc, kc, seed)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        is_causal, scale, dropout_p, qc, kc, seed = ctx.cfg
        T, S = q.shape[2], k.shape[2]
        offset = S - T
        dt = _acc_dtype(q)
        dout = dout.to(dt)
        delta = (dout * out.to(dt)).sum(dim=-1, keepdim=True)  # (B, H, T, 1) = rowsum(dO ∘ O)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(k.shape, dtype=dt, device=q.device)
        dv = torch.zeros(v.shape, dtype=dt, device=q.device)
        qs = q * scale
        for q0 in range(0, T, qc):
            q1 = min(q0 + qc, T)
            do = dout[:, :, q0:q1]
            lse_t = lse[:, :, q0:q1].unsqueeze(-1)
            for k0, k1, diag in _key_tiles(q0, q1, S, kc, is_causal, offset):
                s = _tile_scores(qs, k, mask, bias, q0, q1, k0, k1, diag, offset)
                p = s.sub_(lse_t).exp_()  # the forward's probabilities, recomputed
                dp = do @ v[:, :, k0:k1].to(dt).transpose(-2, -1)  # (B, H, tq, tk)
                p_drop = p
                if dropout_p > 0:
                    keep = _keep_mask(seed, q0 * S + k0, p.shape, dropout_p, q.device)
                    p_drop = p * keep / (1.0 - dropout_p)
                    dp = dp * keep / (1.0 - dropout_p)
                dv[:, :, k0:k1] += p_drop.transpose(-2, -1) @ do
                ds = dp.sub_(delta[:, :, q0:q1]).mul_(p)  # softmax backward: dL/ds
                dq[:, :, q0:q1] += (ds @ k[:, :, k0:k1].to(dt)) * scale  # s = scale·q kᵀ
                dk[:, :, k0:k1] += ds.transpose(-2, -1) @ qs[:, :, q0:q1].to(dt)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
        return (*grads, None, None, None, None, None, None, None, None)


def chunked_attention_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    q_chunk: int,
    k_chunk: int,
) -> Tensor:
    """Run the tiled kernel; inputs must already be validated and expanded to H heads.

    Returns (B, H, T, Dv). Dropout masks are drawn from a seed taken from the global RNG,
    so runs are reproducible under ``torch.manual_seed`` and backward sees the same masks.
    """
    B, H, T, _ = q.shape
    S = k.shape[2]
    # Broadcast views (no copies) so that tiles can be sliced on every axis.
    mask = None if mask is None else mask.expand(B, H, T, S)
    bias = None if bias is None else bias.expand(B, H, T, S)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    return _ChunkedAttention.apply(
        q, k, v, mask, bias, is_causal, scale, dropout_p, q_chunk, k_chunk, seed
    )

