"""Tests for MultiHeadAttention: parity with torch.nn.MultiheadAttention, GQA/MQA, backends.

PyTorch's module is the reference for MHA (weights copied across); GQA and MQA, which it
lacks, are checked against projections written by hand around ``reference_attention``
(tests/conftest.py).
"""

import re

import pytest
import torch
from torch import nn

from qkv.attention import BACKENDS, MultiHeadAttention

DIM, HEADS = 12, 3
F64 = torch.float64


def _mha(*args, seed=0, **kwargs):
    """A float64 MultiHeadAttention with random weights and biases (biases start at zero)."""
    torch.manual_seed(seed)
    m = MultiHeadAttention(*args, **kwargs).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def _torch_mha(seed=0, **kwargs):
    """A float64 torch.nn.MultiheadAttention (batch_first) with random biases too."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(DIM, HEADS, batch_first=True, **kwargs).double().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    return ref


def _copy_self(ref, backend):
    ours = MultiHeadAttention(DIM, HEADS, backend=backend).double()
    with torch.no_grad():
        ours.qkv.weight.copy_(ref.in_proj_weight)
        ours.qkv.bias.copy_(ref.in_proj_bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)
    return ours


def _padded_inputs(rng, B=2, T=5, S=None):
    x = torch.randn(B, T, DIM, generator=rng, dtype=F64)
    lengths = torch.tensor([T if S is None else S, 2])[:B]  # sequence 1 is padded
    kpm = torch.arange(T if S is None else S).unsqueeze(0) >= lengths.unsqueeze(1)  # True=ignore
    return x, kpm


def _manual(m, x, context=None, mask=None, is_causal=False, reference_attention=None):
    """MultiHeadAttention's math with its own weights, written out: project, attend, mix."""
    H, K, Dh = m.n_heads, m.n_kv_heads, m.head_dim
    if m.cross:
        q = x @ m.q_proj.weight.T + m.q_proj.bias
        kv = context @ m.kv_proj.weight.T + m.kv_proj.bias
        k, v = kv[..., : K * Dh], kv[..., K * Dh :]
    else:
        y = x @ m.qkv.weight.T + m.qkv.bias
        q, k, v = y[..., : H * Dh], y[..., H * Dh : (H + K) * Dh], y[..., (H + K) * Dh :]

    def heads(t, n):  # (B, L, n·Dh) -> (B, n, L, Dh)
        return t.reshape(t.shape[0], t.shape[1], n, Dh).permute(0, 2, 1, 3)

    out, _ = reference_attention(heads(q, H), heads(k, K), heads(v, K), mask=mask,
                                 is_causal=is_causal)
    out = out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], H * Dh)
    return out @ m.out_proj.weight.T + m.out_proj.bias


# --------------------------------------------------------------------------- torch parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_self_attention_matches_torch(backend, padding, is_causal, rng):
    ref = _torch_mha()
    ours = _copy_self(ref, backend)
    x, kpm = _padded_inputs(rng)
    T = x.shape[1]
    attn_mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1) if is_causal else None
    expected, _ = ref(x, x, x, key_padding_mask=kpm if padding else None, attn_mask=attn_mask,
                      need_weights=False)
    mask = (~kpm)[:, None, None, :] if padding else None
    got = ours(x, mask=mask, is_causal=is_causal).out
    assert got.shape == expected.shape == (2, T, DIM)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_weights_match_torch(padding, is_causal, rng):
    ref = _torch_mha(seed=1)
    ours = _copy_self(ref, "sdpa")  # the module default, overridden per call below
    x, kpm = _padded_inputs(rng, T=6)
    T = x.shape[1]
    attn_mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1) if is_causal else None
    kw = dict(key_padding_mask=kpm if padding else None, attn_mask=attn_mask)
    out_avg, w_avg = ref(x, x, x, **kw)
    _, w_heads = ref(x, x, x, **kw, average_attn_weights=False)
    mask = (~kpm)[:, None, None, :] if padding else None
    out, w = ours(x, mask=mask, is_causal=is_causal, return_weights=True, backend="reference")
    assert w.shape == w_heads.shape == (2, HEADS, T, T)
    torch.testing.assert_close(out, out_avg, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(w, w_heads, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w.mean(dim=1), w_avg, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding", [False, True])
def test_cross_attention_matches_torch(backend, padding, rng):
    ref = _torch_mha(seed=2, kdim=DIM, vdim=DIM)
    ours = MultiHeadAttention(DIM, HEADS, cross=True, backend=backend).double()
    with torch.no_grad():
        ours.q_proj.weight.copy_(ref.in_proj_weight[:DIM])
        ours.q_proj.bias.copy_(ref.in_proj_bias[:DIM])
        ours.kv_proj.weight.copy_(ref.in_proj_weight[DIM:])
        ours.kv_proj.bias.copy_(ref.in_proj_bias[DIM:])
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())
    x, _ = _padded_inputs(rng, T=4)
    context, kpm = _padded_inputs(rng, T=7)
    kpm = kpm if padding else None
    expected, _ = ref(x, context, context, key_padding_mask=kpm, need_weights=False)
    mask = None if kpm is None else (~kpm)[:, None, None, :]
    got = ours(x, context, mask=mask).out
    assert got.shape == (2, 4, DIM)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_cross_attention_with_other_context_width_matches_torch(rng):
    """kv_dim != dim: torch keeps separate k/v weights; qkv fuses them into kv_proj."""
    ref = _torch_mha(seed=3, kdim=5, vdim=5)
    ours = MultiHeadAttention(DIM, HEADS, cross=True, kv_dim=5).double()
    with torch.no_grad():
        ours.q_proj.weight.copy_(ref.q_proj_weight)
        ours.q_proj.bias.copy_(ref.in_proj_bias[:DIM])
        ours.kv_proj.weight.copy_(torch.cat([ref.k_proj_weight, ref.v_proj_weight]))
        ours.kv_proj.bias.copy_(ref.in_proj_bias[DIM:])
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())
    x = torch.randn(2, 4, DIM, generator=rng, dtype=F64)
    context = torch.randn(2, 6, 5, generator=rng, dtype=F64)
    expected, w = ref(x, context, context)
    got, got_w = ours(x, context, return_weights=True, backend="reference")
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got_w.mean(1), w, atol=1e-12, rtol=1e-10)


# --------------------------------------------------------------------------- GQA / MQA / backends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("cross", [False, True])
def test_matches_hand_written_projections(backend, n_heads, n_kv_heads, cross, rng,
                                          reference_attention):
    m = _mha(DIM, n_heads, n_kv_heads, cross=cross, backend=backend)
    x = torch.randn(2, 5, DIM, generator=rng, dtype=F64)
    context = torch.randn(2, 7, DIM, generator=rng, dtype=F64) if cross else None
    S = 7 if cross else 5
    mask = torch.rand(2, 1, 5, S, generator=rng) > 0.3
    for kw in (dict(), dict(mask=mask), dict(is_causal=True), dict(mask=mask, is_causal=True)):
        got = m(x, context, **kw).out
        expected = _manual(m, x, context, reference_attention=reference_attention, **kw)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backends_agree_forward_and_backward(n_heads, n_kv_heads, dtype, rng):
    """Output and every gradient (input and all parameters) agree across the backends."""
    torch.manual_seed(0)
    m = MultiHeadAttention(DIM, n_heads, n_kv_heads, head_dim=4).to(dtype)
    x = torch.randn(2, 9, DIM, generator=rng, dtype=dtype)
    g = torch.randn(2, 9, DIM, generator=rng, dtype=dtype)
    mask = torch.rand(2, 1, 9, 9, generator=rng) > 0.3
    tol = 1e-10 if dtype == F64 else 1e-5
    for kw in (dict(), dict(is_causal=True), dict(mask=mask, is_causal=True)):
        results = []
        for backend in BACKENDS:
            xg = x.clone().requires_grad_()
            out = m(xg, backend=backend, **kw).out
            leaves = [xg, *m.parameters()]
            results.append((out.detach(), torch.autograd.grad(out, leaves, g)))
        (ref_out, ref_grads), *others = results
        for out, grads in others:
            torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
            for a, e in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(a, e, atol=tol, rtol=tol)


def test_kv_heads_shrink_the_projection():
    """GQA/MQA project H query heads but only K key/value heads (a smaller KV cache)."""
    assert MultiHeadAttention(DIM, 4).qkv.weight.shape == (3 * DIM, DIM)
    assert MultiHeadAttention(DIM, 4, 2).qkv.weight.shape == (DIM + 2 * 6, DIM)
    assert MultiHeadAttention(DIM, 4, 1).qkv.weight.shape == (DIM + 2 * 3, DIM)
    m = MultiHeadAttention(10, 3, head_dim=4)
    assert m.qkv.weight.shape == (36, 10) and m.out_proj.weight.shape == (10, 12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 1)])
def test_self_attention_is_permutation_equivariant(backend, n_heads, n_kv_heads, rng):
    """Without positions or masks, permuting the tokens permutes the outputs the same way."""
    m = _mha(DIM, n_heads, n_kv_heads, backend=backend)
    x = torch.randn(2, 8, DIM, generator=rng, dtype=F64)
    perm = torch.randperm(8, generator=rng)
    out = m(x).out
    assert not torch.allclose(out[:, perm], out)  # outputs differ per token: a real test
    torch.testing.assert_close(m(x[:, perm]).out, out[:, perm], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_only_in_training(backend, rng):
    m = _mha(DIM, 4, dropout=0.5, backend=backend)
    plain = _mha(DIM, 4, backend=backend)  # same seed: same weights, no dropout
    x = torch.randn(2, 6, DIM, generator=rng, dtype=F64)
    m.eval()
    torch.testing.assert_close(m(x).out, plain(x).out, atol=0, rtol=0)
    m.train()
    assert not torch.allclose(m(x).out, plain(x).out)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((12, 4, 3), {}, "n_heads (4) must be a multiple of n_kv_heads (3)"),
        ((10, 4), {}, "dim (10) must be divisible by n_heads (4)"),
        ((12, 0), {}, "n_heads (0) and n_kv_heads (0) must be >= 1"),
        ((12, 4), {"backend": "flash"}, f"backend must be one of {BACKENDS}, got 'flash'"),
        ((12, 4), {"dropout": 1.0}, "dropout must be in [0, 1), got 1.0"),
        ((12, 4), {"kv_dim": 6}, "kv_dim is only meaningful with cross=True"),
    ],
)
def test_bad_construction(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MultiHeadAttention(*args, **kwargs)


def test_bad_calls():
    x = torch.zeros(2, 3, DIM)
    with pytest.raises(ValueError, match=re.escape("cross-attention needs context=")):
        MultiHeadAttention(DIM, 4, cross=True)(x)
    with pytest.raises(ValueError, match="self-attention takes no context"):
        MultiHeadAttention(DIM, 4)(x, x)
    with pytest.raises(ValueError, match=re.escape("x must be (B, T, dim), got shape (3, 12)")):
        MultiHeadAttention(DIM, 4)(x[0])
    with pytest.raises(ValueError, match="backend='sdpa' never materialises"):
        MultiHeadAttention(DIM, 4)(x, return_weights=True)
    with pytest.raises(ValueError, match=re.escape("mask of shape (3, 4) does not broadcast to "
                                                   "(B, H, T, S) = (2, 4, 3, 3)")):
        MultiHeadAttention(DIM, 4)(x, mask=torch.ones(3, 4, dtype=torch.bool))
