"""Attention rows from kept queries (KVCache.keep_queries + qkv.generation.aot.attention_rows),
the way a saved decoding step shows attention without returning weights. Reference: the eager
model's own weights on the explicit reference backend (return_weights=True), which
tests/attention checks against float64 math; and one row by hand (softmax(q·kᵀ/√D))."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.generation.aot import attention_rows
from qkv.models.gpt import GPT, GPTConfig

V = 40
BASE = dict(vocab_size=V, max_seq_len=32, dim=32, n_layers=3, n_heads=4, mlp_hidden=48)


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(**{**BASE, **kw})).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:  # large weights: peaked, varied attention
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return m


def _kept_cache(m: GPT):
    cfg = m.cfg
    cache = m.make_cache(1, cfg.max_seq_len)
    cache.keep_queries(torch.zeros(cfg.n_layers, 1, cfg.n_heads, 1, cfg.resolved_head_dim))
    return cache


@pytest.mark.parametrize("kw", [
    dict(positions="rope", norm="rmsnorm", bias=False, mlp="swiglu", n_kv_heads=2),  # Llama-like, GQA
    dict(positions="learned"),  # GPT-2-like
    dict(positions="alibi", n_kv_heads=1),  # a bias on the scores, MQA
    dict(positions="rope", tie_qk=True),  # the keys are the queries
])
def test_kept_queries_give_the_reference_weights_at_every_step(kw):
    m = _model(**kw)
    x = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref, kept = m.make_cache(1, 32), _kept_cache(m)
        m(x[:, :6], cache=ref)
        m(x[:, :6], cache=kept)
        for t in range(6, 20):
            want = m(x[:, t : t + 1], cache=ref, backend="reference", return_weights=True).weights
            m(x[:, t : t + 1], cache=kept, last_only=True)  # the fast backend: no weights formed
            got = attention_rows(m, kept)
            assert len(got) == len(want) == 3
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape == (1, 4, 1, t + 1)
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        # only the layers asked for (negative indices count from the end)
        only = attention_rows(m, kept, [-1])
        assert only[0] is None and only[1] is None
        torch.testing.assert_close(only[2], want[2], rtol=1e-5, atol=1e-6)


def test_one_row_by_hand():
    """Layer 0, head 0 of a one-layer model: softmax over q·k/√D of the kept query and the
    stored keys, written out in float64."""
    m = _model(positions="learned", n_layers=1)
    x = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        c = _kept_cache(m)
        m(x, cache=c)
        got = attention_rows(m, c)[0][0, 0, 0]
        q = c.queries[0, 0, 0, 0].double()
        ks = c.k[0, 0, 0, :7].double()
    s = [float(q @ k) / math.sqrt(q.numel()) for k in ks]
    e = [math.exp(v - max(s)) for v in s]
    torch.testing.assert_close(got.double(), torch.tensor([v / sum(e) for v in e], dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)


def test_a_cache_without_kept_queries_says_so():
    m = _model(positions="learned")
    c = m.make_cache(1, 8)
    with pytest.raises(ValueError, match="keeps no queries"):
        attention_rows(m, c)
    with pytest.raises(ValueError, match=r"queries must be \(3, 1, H, 1, D\)"):
        c.keep_queries(torch.zeros(3, 2, 4, 1, 8))
