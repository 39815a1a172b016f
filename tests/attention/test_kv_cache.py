"""Tests for KVCache: cached decoding equals the full causal forward, at every step.

The decoding loop owns the cache: each layer writes its new keys/values at ``cache.pos``
and the loop calls ``advance`` once per step (kv_cache.py).
"""

import re

import pytest
import torch

from qkv.attention import BACKENDS, KVCache, MultiHeadAttention, RotaryEmbedding

DIM, T_MAX = 16, 12
STEPS = {
    "one-at-a-time": [1] * 10,
    "prefill-5": [5, 1, 1, 1, 1, 1],
    "mixed": [3, 1, 4, 2],
}


def _attention_layers(n_heads, n_kv_heads, n_layers=1):
    torch.manual_seed(0)
    layers = [MultiHeadAttention(DIM, n_heads, n_kv_heads).eval() for _ in range(n_layers)]
    rope = RotaryEmbedding(DIM // n_heads, max_seq_len=T_MAX)
    return layers, rope


def _full(layers, x, rope, backend):
    """The uncached forward: every layer over the whole sequence, causally."""
    h = x
    for m in layers:
        h = h + m(h, is_causal=True, rope=rope, backend=backend).out
    return h


def _decode(layers, x, rope, backend, steps, kv):
    """Feed ``x`` in pieces of ``steps`` tokens through the cache: one output per piece."""
    outs, t = [], 0
    for n in steps:
        h = x[:, t : t + n]
        for i, m in enumerate(layers):
            h = h + m(h, is_causal=True, rope=rope, cache=kv.layer(i), backend=backend).out
        kv.advance(n)  # once per step, after every layer has written its keys and values
        outs.append((t, h))
        t += n
    assert kv.pos == t
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("steps", list(STEPS))
def test_cached_decoding_equals_full_forward(backend, n_heads, n_kv_heads, use_rope, steps,
                                             rng):
    (m,), rope = _attention_layers(n_heads, n_kv_heads)
    rope = rope if use_rope else None
    x = torch.randn(2, 10, DIM, generator=rng)
    full = _full([m], x, rope, backend)
    kv = KVCache(1, 2, n_kv_heads, T_MAX, DIM // n_heads)
    with torch.no_grad():
        for t, out in _decode([m], x, rope, backend, STEPS[steps], kv):
            torch.testing.assert_close(out, full[:, t : t + out.shape[1]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_layers_share_one_cache(backend, rng):
    layers, rope = _attention_layers(4, 2, n_layers=2)
    x = torch.randn(1, 9, DIM, generator=rng)
    full = _full(layers, x, rope, backend)
    kv = KVCache(2, 1, 2, T_MAX, DIM // 4)
    with torch.no_grad():
        for t, out in _decode(layers, x, rope, backend, [4, 1, 1, 3], kv):
            torch.testing.assert_close(out, full[:, t : t + out.shape[1]], atol=1e-5, rtol=1e-5)
    assert not torch.equal(kv.k[0, :, :, :9], kv.k[1, :, :, :9])  # each layer its own slice


def test_rope_matters_and_uses_absolute_positions(rng):
    """Decoding with RoPE but without the cache offset would rotate by the wrong angle."""
    (m,), rope = _attention_layers(4, 4)
    x = torch.randn(1, 6, DIM, generator=rng)
    with_rope = _full([m], x, rope, "reference")
    without = _full([m], x, None, "reference")
    assert not torch.allclose(with_rope[:, 1:], without[:, 1:], atol=1e-3)


def test_reset_reuses_the_cache(rng):
    (m,), rope = _attention_layers(4, 2)
    x1, x2 = torch.randn(2, 1, 8, DIM, generator=rng)
    kv = KVCache(1, 1, 2, T_MAX, DIM // 4)
    with torch.no_grad():
        _decode([m], x1, rope, "sdpa", [8], kv)
        kv.reset()
        assert kv.pos == 0
        full = _full([m], x2, rope, "sdpa")
        for t, out in _decode([m], x2, rope, "sdpa", [2, 1, 1, 1, 1, 1, 1], kv):
            torch.testing.assert_close(out, full[:, t : t + out.shape[1]], atol=1e-5, rtol=1e-5)


def test_buffers_are_preallocated(rng):
    (m,), rope = _attention_layers(4, 2)
    kv = KVCache(1, 1, 2, T_MAX, DIM // 4)
    k_ptr, v_ptr = kv.k.data_ptr(), kv.v.data_ptr()
    shapes = (kv.k.shape, kv.v.shape)
    x = torch.randn(1, T_MAX, DIM, generator=rng)
    with torch.no_grad():
        _decode([m], x, rope, "sdpa", [1] * T_MAX, kv)
    assert (kv.k.data_ptr(), kv.v.data_ptr()) == (k_ptr, v_ptr)
    assert (kv.k.shape, kv.v.shape) == shapes
    assert kv.k.abs().sum() > 0 and kv.v.abs().sum() > 0  # the writes landed in the buffers


def test_update_stores_at_pos_and_returns_views(rng):
    kv = KVCache(2, 2, 3, 6, 4)
    layer = kv.layer(1)
    k1, k2 = torch.randn(2, 2, 3, 2, 4, generator=rng)
    v1, v2 = torch.randn(2, 2, 3, 2, 4, generator=rng)
    k, v = layer.update(k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    kv.advance(2)
    assert layer.pos == 2
    k, v = layer.update(k2, v2)
    assert torch.equal(k, torch.cat([k1, k2], dim=2)) and torch.equal(v, torch.cat([v1, v2], 2))
    assert k.data_ptr() == kv.k[1].data_ptr() and v.data_ptr() == kv.v[1].data_ptr()
    assert kv.k[0].abs().sum() == 0  # layer 0 untouched


# --------------------------------------------------------------------------- bad input


def test_overflow_past_max_seq_len():
    kv = KVCache(1, 1, 2, 4, 8)
    layer = kv.layer(0)
    with pytest.raises(ValueError, match=re.escape(
            "KVCache overflow: position 0 + 5 new tokens > max_seq_len 4")):
        layer.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
    with pytest.raises(ValueError, match=re.escape(
            "KVCache overflow: position 0 + 5 new tokens > max_seq_len 4")):
        kv.advance(5)
    kv.advance(3)
    with pytest.raises(ValueError, match=re.escape(
            "KVCache overflow: position 3 + 2 new tokens > max_seq_len 4")):
        layer.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match=re.escape(
            "KVCache overflow: position 3 + 2 new tokens > max_seq_len 4")):
        kv.advance(2)
    assert kv.pos == 3
    kv.advance(1)  # exactly full is fine
    assert kv.pos == 4


def test_decoding_past_max_seq_len_raises(rng):
    (m,), _ = _attention_layers(4, 4)
    kv = KVCache(1, 1, 4, 3, DIM // 4)
    x = torch.randn(1, 3, DIM, generator=rng)
    m(x, is_causal=True, cache=kv.layer(0))
    kv.advance(3)
    with pytest.raises(ValueError, match=re.escape("position 3 + 1 new tokens > max_seq_len 3")):
        m(x[:, :1], is_causal=True, cache=kv.layer(0))


KEYS = "expected (B=1, K=2, T, D=8)"  # the cache below: B=1, K=2, D=8


@pytest.mark.parametrize(
    ("k_shape", "v_shape", "message"),
    [
        ((1, 3, 1, 8), (1, 3, 1, 8), f"new keys have shape (1, 3, 1, 8), {KEYS}"),
        ((1, 2, 1, 6), (1, 2, 1, 8), f"new keys have shape (1, 2, 1, 6), {KEYS}"),
        ((2, 2, 1, 8), (2, 2, 1, 8), f"new keys have shape (2, 2, 1, 8), {KEYS}"),
        ((1, 2, 8), (1, 2, 8), f"new keys have shape (1, 2, 8), {KEYS}"),
        ((1, 2), (1, 2), f"new keys have shape (1, 2), {KEYS}"),
        ((1, 2, 1, 8), (1, 2, 1, 5), "new values have shape (1, 2, 1, 5), expected (1, 2, 1, 8)"),
        ((1, 2, 1, 8), (1, 2, 2, 8), "new values have shape (1, 2, 2, 8), expected (1, 2, 1, 8)"),
        ((1, 2, 1, 8), (1, 2, 1), "new values have shape (1, 2, 1), expected (1, 2, 1, 8)"),
    ],
)
def test_wrong_shaped_keys_or_values(k_shape, v_shape, message):
    layer = KVCache(1, 1, 2, 4, 8).layer(0)
    with pytest.raises(ValueError, match=re.escape("KVCache: " + message)):
        layer.update(torch.zeros(k_shape), torch.zeros(v_shape))


def test_bad_construction_and_layer_index():
    with pytest.raises(ValueError, match=re.escape("KVCache: max_seq_len must be >= 1, got 0")):
        KVCache(1, 1, 2, 0, 8)
    with pytest.raises(ValueError, match=re.escape("KVCache: n_kv_heads must be >= 1, got -1")):
        KVCache(1, 1, -1, 4, 8)
    with pytest.raises(ValueError, match=re.escape("layer index 2 out of range [0, 2)")):
        KVCache(2, 1, 2, 4, 8).layer(2)
