"""Tests for the chunked (online-softmax) backend: tiles of every size give the same answer.

Small tiles (1-5) make many full and partial tiles, causal tiles that straddle the diagonal
and tiles skipped as entirely in the future; the forward and the recomputing backward are
both compared with the reference path (itself checked against float64 math in
test_functional.py) and with ``reference_attention`` from tests/conftest.py.
"""

import re

import pytest
import torch
from attention_cases import draw_case, forward_backward
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import attention, chunked_attention, scaled_dot_product_attention

TILES = [(3, 4), (4, 3), (5, 5), (3, 64), (64, 3), (None, None)]  # None: the default


@st.composite
def tiled_cases(draw):
    """One attention configuration plus the tile sizes to run it with."""
    return {**draw_case(draw), "tiles": draw(st.sampled_from(TILES))}


def _assert_same(fn, q, k, v, kw, atol):
    """``fn`` equals the reference path in forward and in all three gradients."""
    g = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(5),
                    dtype=q.dtype)
    out, grads = forward_backward(lambda *a: fn(*a, **kw), q, k, v, g)
    ref_out, ref_grads = forward_backward(lambda *a: scaled_dot_product_attention(*a, **kw).out, q, k, v, g)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=atol)
    for name, a, e in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, atol=atol, rtol=atol, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(case=tiled_cases())
def test_chunked_equals_reference(dtype, atol, case, attention_inputs):
    c = dict(case)
    qc, kc = c.pop("tiles")
    kw = dict(is_causal=c.pop("is_causal"), scale=c.pop("scale"))
    q, k, v, mask, bias = attention_inputs(**c, dtype=dtype)
    kw.update(mask=mask, bias=bias)

    def tiled(*a, **b):
        return chunked_attention(*a, **b, q_chunk=qc, k_chunk=kc).out

    _assert_same(tiled, q, k, v, kw, atol)
    # The default tiles, through the one public entry point.
    _assert_same(lambda *a, **b: attention(*a, **b, backend="chunked").out, q, k, v, kw, atol)


@pytest.mark.parametrize("tiles", [(1, 2), (3, 4), (5, 3), (7, 13), (64, 64)])
@pytest.mark.parametrize(("T", "S"), [(1, 7), (7, 7), (7, 13), (13, 7), (13, 33), (33, 33)])
def test_causal_tiles_every_alignment(tiles, T, S, attention_inputs):
    """Bottom-right causal with tiles that skip, straddle or miss the diagonal."""
    q, k, v, _, _ = attention_inputs(1, 2, 1, T, S, 4, seed=T * 100 + S)
    kw = dict(is_causal=True)
    _assert_same(lambda *a, **b: chunked_attention(*a, **b, q_chunk=tiles[0],
                                                   k_chunk=tiles[1]).out, q, k, v, kw, 1e-10)


def test_default_tiles_split_a_long_sequence(attention_inputs):
    """B·H = 32 gives 256-wide default tiles: 300 positions need a full and a partial tile."""
    q, k, v, mask, _ = attention_inputs(1, 32, 8, 300, 300, 2, mask="padding", seed=6)
    _assert_same(lambda *a, **b: chunked_attention(*a, **b).out, q, k, v,
                 dict(mask=mask, is_causal=True), 1e-10)


@pytest.mark.parametrize("tiles", [(3, 4), (2, 5), (None, None)])
def test_bf16_forward_close_to_float64(tiles, attention_inputs, reference_attention):
    q, k, v, m, b = attention_inputs(2, 4, 2, 13, 33, 8, mask="both", bias=True,
                                     dtype=torch.bfloat16, seed=7)
    for kw in (dict(mask=m, bias=b), dict(is_causal=True), dict(mask=m, is_causal=True)):
        got = chunked_attention(q, k, v, **kw, q_chunk=tiles[0], k_chunk=tiles[1]).out
        assert got.dtype == torch.bfloat16
        expected, _ = reference_attention(q, k, v, **kw)
        torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("H", "K", "T", "S", "mask", "is_causal", "bias", "dropout_p"),
    [
        (2, 2, 4, 4, None, True, False, 0.0),
        (2, 1, 3, 5, "random", True, True, 0.0),  # GQA, T != S, bottom-right causal, bias
        (2, 1, 5, 3, "padding", False, False, 0.0),
        (2, 1, 5, 3, "both", True, False, 0.0),  # T > S causal: the first rows are empty
        (2, 1, 4, 5, None, False, False, 0.3),
        (2, 1, 5, 5, "random", True, True, 0.5),
    ],
)
def test_gradcheck(H, K, T, S, mask, is_causal, bias, dropout_p, attention_inputs):
    """The hand-written backward is the derivative of the forward, dropout included."""
    q, k, v, m, b = attention_inputs(1, H, K, T, S, 2, mask=mask, bias=bias, seed=8)

    def f(q, k, v):
        torch.manual_seed(0)  # each call draws the same dropout masks
        return chunked_attention(q, k, v, mask=m, is_causal=is_causal, scale=0.7, bias=b,
                                 dropout_p=dropout_p, q_chunk=2, k_chunk=3).out

    assert torch.autograd.gradcheck(f, [t.requires_grad_() for t in (q, k, v)])


def test_dropout_reproducible_under_manual_seed(attention_inputs):
    q, k, v, _, _ = attention_inputs(2, 2, 2, 9, 9, 4, seed=9)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(chunked_attention(q, k, v, dropout_p=0.4, q_chunk=4, k_chunk=4).out)
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], runs[2])
    no_dropout = chunked_attention(q, k, v).out
    assert not torch.allclose(runs[0], no_dropout)


def test_dropout_forward_matches_reference_with_same_keep_mask(attention_inputs,
                                                               reference_attention):
    """Drop keys by hand in the reference (zero weight, rescale) where the kernel dropped them.

    With one key tile per query tile and Dv = 1 per value column, output/expected recovers
    which weights were kept; a kept key contributes w_j v_j / (1 - p), a dropped one nothing.
    """
    p = 0.5
    q, k, _, _, _ = attention_inputs(1, 1, 1, 4, 6, 4, seed=10)
    v = torch.eye(6, dtype=torch.float64)[None, None]  # value j = one-hot j: out = kept weights
    torch.manual_seed(3)
    out = chunked_attention(q, k, v, dropout_p=p, q_chunk=2, k_chunk=6).out
    _, w = reference_attention(q, k, v)
    kept = out != 0
    assert kept.any() and not kept.all()
    torch.testing.assert_close(out, torch.where(kept, w / (1 - p), 0.0), atol=1e-12, rtol=0)


def test_bad_tiles_and_bias_with_grad():
    q, k, v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match=re.escape("q_chunk and k_chunk must be >= 1, got 0, 4")):
        chunked_attention(q, k, v, q_chunk=0, k_chunk=4)
    with pytest.raises(ValueError, match=re.escape("q_chunk and k_chunk must be >= 1, got 4, -1")):
        chunked_attention(q, k, v, q_chunk=4, k_chunk=-1)
    bias = torch.zeros(3, 5, requires_grad=True)
    with pytest.raises(ValueError, match="does not back-propagate into bias"):
        chunked_attention(q, k, v, bias=bias)
