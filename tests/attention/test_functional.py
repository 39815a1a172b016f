"""Tests for qkv.attention.functional: softmax, masks, the reference and sdpa backends.

Every backend is checked against ``reference_attention`` (tests/conftest.py), float64 math
written from the formula without calling qkv. The chunked backend's tiling has its own file.
"""

import math
import re

import pytest
import torch
from attention_cases import draw_case, forward_backward
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import (
    BACKENDS,
    attention,
    causal_mask,
    chunked_attention,
    hardmax,
    padding_mask,
    scaled_dot_product_attention,
    sdpa_attention,
    sliding_window_mask,
    softmax,
)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


@st.composite
def cases(draw):
    """One attention configuration: shapes, mask kind, causality, scale, bias, seed."""
    return draw_case(draw)


def _inputs(make, case, dtype):
    c = dict(case)
    flags = {name: c.pop(name) for name in ("mask", "bias", "seed")}
    del c["is_causal"], c["scale"]
    return make(**c, **flags, dtype=dtype)


def _allowed(mask, is_causal, B, H, T, S):
    """(B, H, T, S) bool: which (query, key) pairs may attend, built by hand."""
    allowed = torch.ones(B, H, T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:
        for i in range(T):
            allowed[:, :, i, S - T + i + 1 :] = False
            if S - T + i < 0:
                allowed[:, :, i] = False
    return allowed


# --------------------------------------------------------------------------- softmax / hardmax


def _softmax64(x, dim=-1):
    """exp(x) / Σ exp(x) in float64, no shift (fine for the moderate inputs it gets)."""
    e = torch.exp(x.double())
    return e / e.sum(dim=dim, keepdim=True)


def test_softmax_lecture_example():
    got = softmax(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    den = math.e + math.e**2 + math.e**3
    expected = torch.tensor([math.e / den, math.e**2 / den, math.e**3 / den], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-15, rtol=0)
    torch.testing.assert_close(got, torch.tensor([0.090, 0.245, 0.665]).double(), atol=1e-3,
                               rtol=0)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_equals_float64_formula(rng, dim):
    x = torch.randn(5, 7, 3, generator=rng, dtype=torch.float64) * 3
    got = softmax(x, dim=dim)
    torch.testing.assert_close(got, _softmax64(x, dim), atol=1e-14, rtol=0)
    torch.testing.assert_close(got.sum(dim), torch.ones_like(got.sum(dim)), atol=1e-14, rtol=0)


def test_hardmax_lecture_example_and_argmax(rng):
    assert hardmax(torch.tensor([1.0, 2.0, 3.0])).tolist() == [0.0, 0.0, 1.0]
    x = torch.randn(6, 9, generator=rng)
    expected = torch.nn.functional.one_hot(x.argmax(-1), 9).float()
    assert torch.equal(hardmax(x), expected)
    assert torch.equal(hardmax(x, dim=0), torch.nn.functional.one_hot(x.argmax(0), 6).float().T)


def test_hardmax_ties_share_and_empty_row_is_zero():
    x = torch.tensor([[1.0, 3.0, 3.0], [-math.inf, -math.inf, -math.inf]])
    assert hardmax(x).tolist() == [[0.0, 0.5, 0.5], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_stable_for_huge_inputs(dtype):
    x = torch.tensor([[1000.0, 1001.0], [-1000.0, -1001.0], [3e38, 3e38]], dtype=dtype)
    got = softmax(x)
    a = 1.0 / (1.0 + math.e)  # softmax([0, 1]) = [1/(1+e), e/(1+e)]
    expected = torch.tensor([[a, 1 - a], [1 - a, a], [0.5, 0.5]], dtype=dtype)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected)


def test_softmax_all_masked_row_is_zero_and_gradients_finite(rng):
    x = torch.tensor(
        [[1000.0, 1001.0, 999.0], [-math.inf] * 3, [1.0, -math.inf, 2.0]], dtype=torch.float64,
        requires_grad=True,
    )
    p = softmax(x)
    assert p[1].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(p[0], _softmax64(torch.tensor([1.0, 2.0, 0.0])), atol=1e-15, rtol=0)
    torch.testing.assert_close(p[2], torch.tensor([1 / (1 + math.e), 0, math.e / (1 + math.e)],
                                                  dtype=torch.float64), atol=1e-15, rtol=0)
    g = torch.randn(3, 3, generator=rng, dtype=torch.float64)
    (dx,) = torch.autograd.grad(p, x, g)
    assert torch.isfinite(dx).all()
    # Softmax backward, written out: dx = p ∘ (g - Σ g p); zero where p is zero.
    expected = p.detach() * (g - (g * p.detach()).sum(-1, keepdim=True))
    torch.testing.assert_close(dx, expected, atol=1e-15, rtol=0)
    assert dx[1].tolist() == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- masks


def _bools(rows):
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize(
    ("T", "S", "expected"),
    [
        (3, None, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        (2, 4, [[1, 1, 1, 0], [1, 1, 1, 1]]),  # queries at absolute positions 2 and 3
        (1, 5, [[1, 1, 1, 1, 1]]),  # one decoding step sees everything cached
        (3, 2, [[0, 0], [1, 0], [1, 1]]),  # T > S: query 0 sits at position -1, sees nothing
    ],
)
def test_causal_mask(T, S, expected):
    got = causal_mask(T, S)
    assert got.dtype == torch.bool
    assert torch.equal(got, _bools(expected))


def test_padding_mask():
    got = padding_mask(torch.tensor([2, 0, 3]))
    assert got.shape == (3, 1, 1, 3) and got.dtype == torch.bool
    assert torch.equal(got[:, 0, 0], _bools([[1, 1, 0], [0, 0, 0], [1, 1, 1]]))
    got = padding_mask(torch.tensor([1, 4]), S=5)
    assert torch.equal(got[:, 0, 0], _bools([[1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]))


@pytest.mark.parametrize(
    ("T", "window", "S", "causal", "expected"),
    [
        (5, 2, None, True, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                            [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]),
        (5, 2, None, False, [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0],
                             [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]),
        (2, 3, 5, True, [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]),  # queries at positions 3, 4
        (2, 2, 5, False, [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]),
        (3, 1, None, True, [[1, 0, 0], [0, 1, 0], [0, 0, 1]]),
    ],
)
def test_sliding_window_mask(T, window, S, causal, expected):
    got = sliding_window_mask(T, window, S, causal=causal)
    assert got.dtype == torch.bool
    assert torch.equal(got, _bools(expected))


def test_sliding_window_wider_than_sequence_is_causal_mask():
    assert torch.equal(sliding_window_mask(4, 10, 6), causal_mask(4, 6))


# --------------------------------------------------------------------------- reference path


@SETTINGS
@given(case=cases())
def test_reference_equals_float64_math(case, attention_inputs, reference_attention):
    q, k, v, mask, bias = _inputs(attention_inputs, case, torch.float64)
    kw = dict(mask=mask, is_causal=case["is_causal"], scale=case["scale"], bias=bias)
    out, weights = scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    ref_out, ref_w = reference_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(weights, ref_w, atol=1e-12, rtol=1e-12)
    B, H, T, S = case["B"], case["H"], case["T"], case["S"]
    rows = _allowed(mask, case["is_causal"], B, H, T, S).any(-1).double()
    torch.testing.assert_close(weights.sum(-1), rows, atol=1e-12, rtol=0)
    assert (out[rows == 0] == 0).all()

    # Gradients too, in q, k, v (and bias, which the reference path does learn).
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.clone().requires_grad_()
    ours = scaled_dot_product_attention(*leaves, **{**kw, "bias": b}).out
    theirs = reference_attention(*leaves, **{**kw, "bias": b})[0]
    wrt = leaves + ([] if b is None else [b])
    for a, e in zip(torch.autograd.grad(ours, wrt, g), torch.autograd.grad(theirs, wrt, g),
                    strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_reference_loop_example():
    """One tiny case by hand: a query equal to one key, scale 1, one value per key."""
    q = torch.tensor([[[[10.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float64)
    out, w = scaled_dot_product_attention(q, k, v, scale=1.0, return_weights=True)
    p = math.exp(10) / (math.exp(10) + 1)
    assert w.flatten().tolist() == pytest.approx([p, 1 - p], abs=1e-15)
    assert out.item() == pytest.approx(p * 1 + (1 - p) * 2, abs=1e-15)


def test_default_scale_is_inverse_sqrt_head_dim(rng, reference_attention):
    q, k, v = (torch.randn(1, 2, 3, 16, generator=rng, dtype=torch.float64) for _ in range(3))
    got = scaled_dot_product_attention(q, k, v).out
    torch.testing.assert_close(got, scaled_dot_product_attention(q, k, v, scale=0.25).out)
    assert not torch.allclose(got, scaled_dot_product_attention(q, k, v, scale=1.0).out)


def test_minus_inf_bias_equals_false_mask(rng):
    q, k, v = (torch.randn(2, 2, 5, 4, generator=rng, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=rng) > 0.4
    mask[0, 0, 2] = False  # a row of -inf biases: zeros, like an empty mask row
    bias = torch.zeros(2, 1, 5, 5, dtype=torch.float64).masked_fill(~mask, -math.inf)
    for backend in BACKENDS:
        a = attention(q, k, v, mask=mask, backend=backend).out
        b = attention(q, k, v, bias=bias, backend=backend).out
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        assert (b[0, :, 2] == 0).all()


# --------------------------------------------------------------------------- sdpa backend


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@SETTINGS
@given(case=cases())
def test_sdpa_equals_reference_forward_and_backward(dtype, atol, case, attention_inputs):
    q, k, v, mask, bias = _inputs(attention_inputs, case, dtype)
    kw = dict(mask=mask, is_causal=case["is_causal"], scale=case["scale"], bias=bias)
    g = torch.randn(case["B"], case["H"], case["T"], case["Dv"],
                    generator=torch.Generator().manual_seed(2), dtype=dtype)
    ref_out, ref_grads = forward_backward(lambda *a: scaled_dot_product_attention(*a, **kw).out, q, k, v, g)
    for fn in (sdpa_attention, lambda *a, **b: attention(*a, **b, backend="sdpa")):
        out, grads = forward_backward(lambda *a, fn=fn: fn(*a, **kw).out, q, k, v, g)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref_out, atol=atol, rtol=atol)
        for a, e in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, e, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    ("H", "K", "T", "S", "mask", "is_causal", "bias"),
    [
        (4, 4, 13, 13, None, True, False),  # the fused kernel's own causal path
        (4, 2, 7, 33, "both", False, True),
        (4, 1, 33, 7, "random", True, False),
        (2, 2, 1, 13, "padding", True, True),
    ],
)
def test_sdpa_bf16_forward_close_to_float64(H, K, T, S, mask, is_causal, bias,
                                            attention_inputs, reference_attention):
    q, k, v, m, b = attention_inputs(2, H, K, T, S, 8, mask=mask, bias=bias,
                                     dtype=torch.bfloat16, seed=3)
    got = attention(q, k, v, mask=m, is_causal=is_causal, bias=b, backend="sdpa").out
    assert got.dtype == torch.bfloat16
    expected, _ = reference_attention(q, k, v, mask=m, is_causal=is_causal, bias=b)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- every backend

BACKEND_FNS = {
    "reference": lambda *a, **kw: attention(*a, **kw, backend="reference").out,
    "sdpa": lambda *a, **kw: attention(*a, **kw, backend="sdpa").out,
    "chunked": lambda *a, **kw: attention(*a, **kw, backend="chunked").out,
    "chunked-3x4": lambda *a, **kw: chunked_attention(*a, **kw, q_chunk=3, k_chunk=4).out,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", list(BACKEND_FNS))
def test_rows_with_nothing_to_attend_give_zeros_and_zero_grads(backend, dtype, rng):
    """Three ways to empty a row: an all-False mask row, a zero-length sequence, T > S causal."""
    fn = BACKEND_FNS[backend]
    B, H, K, T, S, D = 2, 4, 2, 6, 4, 5
    q = torch.randn(B, H, T, D, generator=rng, dtype=dtype)
    k, v = (torch.randn(B, K, S, D, generator=rng, dtype=dtype) for _ in range(2))
    mask = torch.rand(B, H, T, S, generator=rng) > 0.3
    mask[..., 0] = True  # every row sees key 0 ...
    mask[0, :, 3] = False  # ... except row 3 of sequence 0
    mask[1] = False  # and sequence 1 has no keys at all
    bias = torch.randn(1, H, T, S, generator=rng, dtype=dtype)
    cases = [
        (dict(mask=mask), mask),
        (dict(mask=mask, bias=bias), mask),
        (dict(is_causal=True), _allowed(None, True, B, H, T, S)),  # rows 0, 1 sit before key 0
        (dict(mask=mask, is_causal=True), _allowed(mask, True, B, H, T, S)),
    ]
    for kw, allowed in cases:
        empty = ~allowed.any(-1)  # (B, H, T)
        assert empty.any() and not empty.all()
        g = torch.randn(B, H, T, D, generator=rng, dtype=dtype)
        out, (dq, dk, dv) = forward_backward(lambda *a, kw=kw: fn(*a, **kw), q, k, v, g)
        assert torch.isfinite(out).all()
        assert (out[empty] == 0).all()
        assert (out[~empty].abs().sum(-1) > 0).all()
        for grad in (dq, dk, dv):
            assert torch.isfinite(grad).all()
        assert (dq[empty] == 0).all()  # an empty row's query influences nothing
        ref_out, ref_grads = forward_backward(
            lambda *a, kw=kw: scaled_dot_product_attention(*a, **kw).out, q, k, v, g
        )
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
        for a, e in zip((dq, dk, dv), ref_grads, strict=True):
            torch.testing.assert_close(a, e, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", list(BACKEND_FNS))
@pytest.mark.parametrize(("T", "S"), [(9, 9), (4, 9)])
def test_causal_outputs_ignore_the_future(backend, T, S, rng):
    """Changing q, k, v at positions after t never changes the outputs at positions <= t."""
    fn = BACKEND_FNS[backend]
    q = torch.randn(2, 4, T, 6, generator=rng, dtype=torch.float64)
    k, v = (torch.randn(2, 2, S, 6, generator=rng, dtype=torch.float64) for _ in range(2))
    out = fn(q, k, v, is_causal=True)
    for t in range(T):
        pos = S - T + t  # absolute position of query t
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t + 1 :] = torch.randn(q2[:, :, t + 1 :].shape, generator=rng).double() * 5
        k2[:, :, pos + 1 :] = torch.randn(k2[:, :, pos + 1 :].shape, generator=rng).double() * 5
        v2[:, :, pos + 1 :] = torch.randn(v2[:, :, pos + 1 :].shape, generator=rng).double() * 5
        out2 = fn(q2, k2, v2, is_causal=True)
        torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], atol=1e-12, rtol=0)
        if t + 1 < T:  # the perturbation is real: later positions do see it
            assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize(
    ("H", "K", "T", "S", "mask", "is_causal", "bias"),
    [
        (2, 2, 4, 4, None, True, False),
        (2, 1, 3, 5, "random", True, True),  # GQA-as-MQA, cross lengths, bottom-right causal
        (4, 2, 5, 3, "padding", False, True),
        (2, 1, 6, 4, "both", True, False),  # T > S causal: the first rows are empty
    ],
)
def test_gradcheck(backend, H, K, T, S, mask, is_causal, bias, attention_inputs):
    q, k, v, m, b = attention_inputs(1, H, K, T, S, 3, mask=mask, bias=bias, seed=4)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    if b is not None and backend == "reference":
        inputs.append(b.requires_grad_())  # the reference path also learns the bias

    def f(q, k, v, b=b):
        return attention(q, k, v, mask=m, is_causal=is_causal, bias=b, scale=0.7,
                         backend=backend).out

    # sdpa: one random projection of the Jacobian (fast_mode) keeps the fused kernel quick.
    assert torch.autograd.gradcheck(f, inputs, fast_mode=backend == "sdpa")


# --------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("backend", list(BACKEND_FNS))
def test_dropout_is_unbiased(backend, rng):
    """E[dropout output] = no-dropout output: the mean over 20k independent draws matches."""
    fn = BACKEND_FNS[backend]
    N, p = 20_000, 0.5
    q = torch.randn(1, 2, 3, 4, generator=rng)
    k, v = (torch.randn(1, 2, 6, 4, generator=rng) for _ in range(2))
    expected = fn(q, k, v, is_causal=True)
    torch.manual_seed(0)  # every batch row draws its own dropout mask
    draws = fn(*(t.expand(N, -1, -1, -1) for t in (q, k, v)), is_causal=True, dropout_p=p)
    spread = draws.std(dim=0)
    mask_varies = spread > 0.05
    assert mask_varies[:, 1:].all()  # row 0 attends to one key only: deterministic
    z = (draws.mean(dim=0) - expected[0]) / (spread / math.sqrt(N)).clamp_min(1e-12)
    assert z.abs().max() < 5, f"dropout mean off by {z.abs().max():.1f} standard errors"


def test_reference_dropout_returns_undropped_weights(rng, reference_attention):
    q, k, v = (torch.randn(2, 2, 5, 4, generator=rng, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(0)
    out, w = scaled_dot_product_attention(q, k, v, dropout_p=0.5, return_weights=True)
    ref_out, ref_w = reference_attention(q, k, v)
    torch.testing.assert_close(w, ref_w, atol=1e-12, rtol=0)
    assert not torch.allclose(out, ref_out)


# --------------------------------------------------------------------------- why 1/√d


@pytest.mark.parametrize("d", [16, 64, 256, 1024])
def test_dot_product_variance_grows_with_d_and_scaling_fixes_it(d):
    """Discussion 10 problem 2: iid unit-variance q, k give var(qᵀk) = d, var(qᵀk/√d) = 1."""
    g = torch.Generator().manual_seed(d)
    n = 20_000
    q = torch.randn(n, d, generator=g)
    k = torch.randn(n, d, generator=g)
    dots = (q * k).sum(-1, dtype=torch.float64)
    assert dots.var().item() == pytest.approx(d, rel=0.1)
    assert (dots / math.sqrt(d)).var().item() == pytest.approx(1.0, rel=0.1)
    assert dots.mean().item() == pytest.approx(0.0, abs=0.1 * math.sqrt(d))


# --------------------------------------------------------------------------- bad input


def _qkv(B=1, H=4, K=2, T=3, S=5, D=8, Dv=None):
    Dv = D if Dv is None else Dv
    return torch.zeros(B, H, T, D), torch.zeros(B, K, S, D), torch.zeros(B, K, S, Dv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("args", "kw", "message"),
    [
        ((torch.zeros(4, 3, 8), *_qkv()[1:]), {},
         "q must be 4-D (B, heads, length, head_dim), got shape (4, 3, 8)"),
        ((*_qkv()[:1], torch.zeros(1, 2, 5, 6), torch.zeros(1, 2, 5, 8)), {},
         "q and k head dims differ: q has 8, k has 6"),
        (_qkv(H=4, K=3), {}, "query heads (4) must be a multiple of key/value heads (3)"),
        (_qkv(), {"mask": torch.ones(3, 4, dtype=torch.bool)},
         "mask of shape (3, 4) does not broadcast to (B, H, T, S) = (1, 4, 3, 5)"),
        (_qkv(), {"mask": torch.ones(1, 1, 1, 1, 3, 5, dtype=torch.bool)},
         "mask of shape (1, 1, 1, 1, 3, 5) does not broadcast"),
        (_qkv(), {"mask": torch.ones(3, 5)}, "mask must be a bool tensor (True = may attend), "
         "got dtype torch.float32"),
        (_qkv(), {"bias": torch.ones(3, 5, dtype=torch.long)},
         "bias must be a floating-point tensor, got dtype torch.int64"),
        (_qkv(), {"bias": torch.ones(2, 3, 5)},
         "bias of shape (2, 3, 5) does not broadcast to (B, H, T, S) = (1, 4, 3, 5)"),
        ((torch.zeros(2, 4, 3, 8), *_qkv()[1:]), {}, "batch sizes differ: q 2, k 1, v 1"),
        ((*_qkv()[:2], torch.zeros(1, 2, 4, 8)), {},
         "k (1, 2, 5, 8) and v (1, 2, 4, 8) must agree on (B, K, S)"),
        ((*_qkv()[:2], torch.zeros(1, 2, 5, 8, dtype=torch.float64)), {},
         "q, k, v dtypes differ: torch.float32, torch.float32, torch.float64"),
    ],
)
def test_bad_input_names_argument_and_values(backend, args, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        attention(*args, **kw, backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match=re.escape(f"backend must be one of {BACKENDS}, "
                                                   "got 'flash'")):
        attention(*_qkv(), backend="flash")


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_return_weights_needs_reference_backend(backend):
    with pytest.raises(ValueError, match=f"backend='{backend}' never materialises"):
        attention(*_qkv(), return_weights=True, backend=backend)


def test_mask_builder_errors():
    with pytest.raises(ValueError, match=re.escape("window must be >= 1, got 0")):
        sliding_window_mask(4, 0)
    with pytest.raises(ValueError, match=re.escape("lengths must be 1-D (B,), got shape (2, 1)")):
        padding_mask(torch.tensor([[1], [2]]))
