"""Continuous batching (qkv.generation.batch): every row of a running batch decodes exactly as
its request decoded alone by qkv.generation.generate (the reference: the batch-1 loop with its
own KV cache), whatever the rows' lengths, whenever they join, whenever they leave."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_alone, random_decoder, token_ids

import qkv.generation.batch as batch_module
from qkv.attention import BatchKVCache
from qkv.generation.batch import Batch, Request, generate_batch
from qkv.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

V = 48


def model(positions: str = "rope", seed: int = 3, **kw) -> GPT:
    return random_decoder(positions, seed, **kw)


def ids(n: int, seed: int) -> list[int]:
    return token_ids(n, seed)


alone = decode_alone


def batched(m: GPT, reqs: list[Request], rows: int) -> list[list]:
    got: list[list] = [[] for _ in reqs]
    for i, tok in generate_batch(m, reqs, rows):
        got[i].append((tok.id, tok.weights) if reqs[i].weights else tok.id)
    return got


LENS, NEW = [5, 11, 2], torch.tensor([[7], [1], [30]])  # three rows' prompt lengths, each row's next token


def prefill_rows_and_alone(m: GPT, cache: BatchKVCache, backend: str) -> list:
    """Prefill row b of ``cache`` with a prompt of LENS[b] tokens, and the same prompt alone
    into its own batch-1 cache; returns each row's next step (NEW[b]) decoded alone (with
    weights on the reference backend): what a step of the batch must equal."""
    want = []
    for b, n in enumerate(LENS):
        p = torch.tensor([ids(n, b)])
        m(p, cache=cache.row(b))
        cache.set_length(b, n)
        solo = m.make_cache(1, 32)
        m(p, cache=solo)
        want.append(m(NEW[b : b + 1], cache=solo, backend=backend, return_weights=backend == "reference"))
    return want


@pytest.mark.parametrize("positions", ["rope", "learned", "sinusoidal", "alibi", "none"])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_one_step_of_rows_at_different_positions_equals_each_row_alone(positions, backend):
    """The step's logits per row against the same row's step with its own batch-1 cache; with the
    reference backend, the weights too (and zero past the row's own keys)."""
    m = model(positions)
    cache = BatchKVCache(2, 4, 2, 32, 8)  # a spare 4th row
    with torch.inference_mode():
        want = prefill_rows_and_alone(m, cache, backend)
        got = m(NEW, cache=cache.head(3), backend=backend, return_weights=backend == "reference")
    assert cache.pos.tolist() == [6, 12, 3, 0]  # the step advanced the three rows, in the parent
    for b, n in enumerate(LENS):
        torch.testing.assert_close(got.logits[b], want[b].logits[0], atol=1e-5, rtol=0)
        if backend == "reference":
            for layer in range(2):
                torch.testing.assert_close(got.weights[layer][b, ..., : n + 1], want[b].weights[layer][0],
                                           atol=1e-6, rtol=0)
                assert float(got.weights[layer][b, ..., n + 1 :].abs().sum()) == 0


def test_a_batch_step_takes_one_token_per_row():
    m = model()
    cache = BatchKVCache(2, 2, 2, 16, 8)
    with pytest.raises(ValueError, match="one token per row"), torch.inference_mode():
        m(torch.zeros(2, 3, dtype=torch.long), cache=cache)


def test_greedy_rows_joining_and_leaving_decode_as_alone():
    """Six requests of different lengths through 2 rows: rows leave at their own lengths (one
    asks for 1 token, one stops at a stop id) and the next request joins between two steps."""
    m = model()
    stop = alone(m, Request(ids(4, 9), 12))[5]  # a token the 5th request meets after 5 steps
    reqs = [Request(ids(6, 1), 9), Request(ids(13, 2), 1), Request(ids(3, 3), 15), Request(ids(9, 4), 7),
            Request(ids(4, 9), 12, stop_ids=(stop,)), Request(ids(20, 6), 10)]
    want = [alone(m, r) for r in reqs]
    assert len(want[4]) < 12 and len(want[1]) == 1  # the stop id did end that one early
    assert batched(m, reqs, rows=2) == want
    assert batched(m, reqs, rows=8) == want  # all at once


@pytest.mark.parametrize("positions", ["learned", "alibi"])
def test_other_positions_decode_as_alone(positions):
    m = model(positions, mlp="gelu", norm="layernorm", bias=True)
    reqs = [Request(ids(n, n), 8) for n in (3, 10, 6)]
    assert batched(m, reqs, rows=3) == [alone(m, r) for r in reqs]


def test_sampled_rows_draw_what_they_draw_alone_with_their_seeds():
    m = model()
    reqs = [Request(ids(5, 1), 10, temperature=0.9, seed=1),
            Request(ids(8, 2), 10, temperature=1.3, top_k=5, seed=2),
            Request(ids(3, 3), 10, temperature=0.7, top_p=0.8, seed=3), Request(ids(7, 4), 10)]
    want = [alone(m, r) for r in reqs]
    assert want[0] != alone(m, Request(ids(5, 1), 10, temperature=0.9, seed=4))  # the seed matters
    assert batched(m, reqs, rows=4) == want


def test_each_rows_attention_is_what_it_is_alone():
    m = model()
    reqs = [Request(ids(n, n), 6, weights=True) for n in (2, 9, 5)]
    got = batched(m, reqs, rows=2)
    for r, g in zip(reqs, got, strict=True):
        w = alone(m, r, weights=True)
        assert [t for t, _ in g] == [t for t, _ in w]
        for (_, gw), (_, ww) in zip(g, w, strict=True):
            for a, b in zip(gw, ww, strict=True):
                assert a.shape == b.shape  # (H, S): this row's keys only
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # fp32 products of 1 vs n rows


def test_rows_asking_for_one_layer_get_that_layers_attention_and_the_same_tokens():
    """qkv serve's rows ask for the one layer the page shows (negative indices count from the
    end): that layer's rows are the ones computed alone with every layer's weights, the other
    layers keep the fast backend and are not there to read."""
    m = model()
    reqs = [Request(ids(n, n), 6, weights=True, layers=(layer,)) for n, layer in ((2, 1), (9, -2), (5, 0))]
    got = batched(m, reqs, rows=3)
    for r, g in zip(reqs, got, strict=True):
        w = alone(m, r, weights=True)
        assert [t for t, _ in g] == [t for t, _ in w]
        layer = r.layers[0]
        for (_, gw), (_, ww) in zip(g, w, strict=True):
            torch.testing.assert_close(gw[layer], ww[layer], atol=1e-5, rtol=0)
    b = Batch(m, 1, 20)
    _, tok = b.join(Request(ids(4, 4), 3, weights=True, layers=(1,)))
    with pytest.raises(ValueError, match="layer 0's attention was not computed"):
        tok.weights[0]


@pytest.mark.parametrize("weights", ["q4", "int8", "bf16"])
def test_quantised_rows_decode_as_alone(weights):
    """The int4/int8 products are row by row, and each row attends on its own: the same tokens."""
    from qkv.layers.quant import int4_kernels_available
    from qkv.pipelines import CausalLM

    if weights == "q4" and not int4_kernels_available():
        pytest.skip("no int4 kernels in this torch")
    torch.manual_seed(11)
    m = GPT(GPTConfig(vocab_size=64, max_seq_len=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      mlp="swiglu", mlp_hidden=128, positions="rope", norm="rmsnorm", bias=False)).eval()
    lm = CausalLM("tiny", m, tokenizer=None, stored_as=("Q4_1",)).quantize(weights)
    reqs = [Request(ids(n, n), 10, temperature=t, seed=n) for n, t in ((4, 0.0), (11, 0.8), (7, 0.0))]
    assert batched(lm.model, reqs, rows=3) == [alone(lm.model, r) for r in reqs]


def test_rows_leave_and_are_replaced_by_the_last_row():
    m = model()
    batch = Batch(m, rows=3, cache_len=8)  # grows for the long request below
    rows = [batch.join(Request(ids(n, n), 20))[0] for n in (3, 5, 4)]
    batch.step()
    batch.leave(rows[0])  # the last row moves into row 0
    assert [r.slot for r in batch.live] == [0, 1] and batch.live[0] is rows[2]
    assert batch._cache.lengths[:3] == [5, 6, 0]
    assert batch.cache_len >= 24
    batch.leave(rows[0])  # twice: nothing
    with pytest.raises(ValueError, match="exceed the 64-token context"):
        batch.join(Request(ids(60, 1), 10))
    row, tok = batch.join(Request(ids(2, 1), 1))  # one token: it leaves at once
    assert row.done and tok is not None and len(batch) == 2
    batch.join(Request(ids(2, 2), 5))
    with pytest.raises(ValueError, match="full"):
        batch.join(Request(ids(2, 3), 5))


def test_a_long_request_grows_the_cache_without_disturbing_the_rows_in_it():
    m = model()
    short, long = Request(ids(3, 1), 12), Request(ids(5, 2), 30)
    batch = Batch(m, rows=2, cache_len=16)
    first, tok = batch.join(short)
    got = {id(first): [tok.id]}
    for _ in range(3):
        for row, t in batch.step():
            got[id(row)].append(t.id)
    second, tok = batch.join(long)  # 35 tokens > 16: the cache grows, the short row's keys kept
    assert batch.cache_len >= 35
    got[id(second)] = [tok.id]
    while len(batch):
        for row, t in batch.step():
            got[id(row)].append(t.id)
    assert got[id(first)] == alone(m, short) and got[id(second)] == alone(m, long)


def test_two_growths_before_a_step_keep_every_row():
    """The cache grows twice with rows in it and no step between (the second growth must know
    the lengths the first one copied)."""
    m = model()
    reqs = [Request(ids(9, 1), 4), Request(ids(3, 2), 20), Request(ids(4, 3), 40)]
    batch = Batch(m, rows=3, cache_len=14)
    got: dict[int, list[int]] = {}
    for r in reqs:  # 13 fits, 23 grows to 28, 44 grows again
        row, tok = batch.join(r)
        got[id(row)] = [tok.id]
    rows = list(batch.live)
    while len(batch):
        for row, t in batch.step():
            if t is not None:
                got[id(row)].append(t.id)
    assert batch.cache_len >= 44
    assert [got[id(r)] for r in rows] == [alone(m, r) for r in reqs]


@pytest.mark.parametrize("positions", ["rope", "learned", "alibi"])
def test_a_masked_view_of_the_batch_equals_each_row_alone(positions):
    """The view a saved step of several rows runs on (BatchKVCache.wrap(..., span=)): the first
    n of R rows, each attending over its own keys by a mask, not a call per row; logits against
    each row's own batch-1 step, keys written in place in the whole buffers; the attention rows
    recomputed from its kept queries (aot.attention_rows) against the reference backend's."""
    from qkv.generation.aot import attention_rows, keep_queries

    m = model(positions)
    cache = BatchKVCache(2, 4, 2, 32, 8)  # a spare 4th row, not run
    keep_queries(m, cache)
    with torch.inference_mode():
        want = prefill_rows_and_alone(m, cache, "reference")
        view = BatchKVCache.wrap(cache.k, cache.v, cache.pos[:3], span=11, queries=cache.queries)
        got = m(NEW, cache=view, last_only=True)
        assert cache.pos.tolist() == [5, 11, 2, 0]  # a masked view leaves advancing to its caller
        cache.pos[:3] += 1
        cache.sync()
        rows = attention_rows(m, cache, rows=3)
    for b, n in enumerate(LENS):
        torch.testing.assert_close(got.logits[b], want[b].logits[0, -1:], atol=1e-5, rtol=0)
        for layer in range(2):
            w = rows[layer][b, :, 0]
            torch.testing.assert_close(w[:, : n + 1], want[b].weights[layer][0, :, 0], atol=1e-6, rtol=1e-5)
            assert not w[:, n + 1 :].any()  # nothing past the row's own keys
    assert not cache.k[:, 3].any()  # the spare row was not written


def test_causal_lm_generate_over_a_list_equals_each_prompt_alone():
    """CausalLM.generate([...]): text in, text out, each continuation the one generate gives
    that prompt alone (greedy; and sampled with one seed per prompt), prompts of different
    lengths, more prompts than rows (the rest join as rows leave), eagerly and with
    mode="auto" (no saved step built in the tests' cache: the same path)."""
    from helpers import byte_lm

    lm = byte_lm(context=48, dim=32, n_layers=2, seed=5)
    prompts = ["ROMEO:", "a", "To be, or not", "xyz", "What light"]
    want = [lm.generate(p, 12) for p in prompts]
    assert all(want) and len(set(want)) > 1
    for mode in ("eager", "auto"):
        assert lm.generate(prompts, 12, rows=3, mode=mode) == want
    sampled = [lm.generate(p, 10, temperature=1.0, seed=s) for p, s in zip(prompts, range(5), strict=True)]
    assert lm.generate(prompts, 10, temperature=1.0, seed=list(range(5)), rows=2) == sampled
    with pytest.raises(ValueError, match="a running batch steps eagerly or through the native or saved"):
        lm.generate(prompts, 4, mode="jit")
    with pytest.raises(ValueError, match="mode must be one of 'auto', 'build', 'jit', 'eager', got 'fast'"):
        lm.generate(prompts, 4, mode="fast")


def _drain(batch: Batch, reqs: list[Request]) -> list[list[int]]:
    """Every request joins ``batch`` at once; their tokens, stepped until all have left."""
    got: dict[int, list[int]] = {}
    rows = {}
    for i, r in enumerate(reqs):
        row, tok = batch.join(r)
        rows[id(row)] = i
        got[i] = [] if tok is None else [tok.id]
    while len(batch):
        for row, tok in batch.step():
            if tok is not None:
                got[rows[id(row)]].append(tok.id)
    return [got[i] for i in range(len(reqs))]


def test_a_later_batch_reuses_an_emptied_batchs_cache_zeroed_and_decodes_as_alone():
    """take_cache hands an empty batch's buffers to the next batch of the same shape (what the
    server's engine does between busy periods): the same storage, emptied and zeroed, and its
    rows decode as their requests alone; a batch of another shape makes its own."""
    m = model()
    first = Batch(m, 3, 48, mode="eager")
    assert _drain(first, [Request(ids(n, 10 + n), 9) for n in (4, 7)]) == \
        [alone(m, Request(ids(n, 10 + n), 9)) for n in (4, 7)]
    cache = first.take_cache()
    assert bool(cache.k.abs().sum() > 0)  # the old rows' keys are still in the buffers
    second = Batch(m, 3, 48, mode="eager", cache=cache)
    assert second._cache is cache and float(cache.k.abs().sum()) == 0.0 and cache.lengths == [0, 0, 0]
    reqs = [Request(ids(n, 20 + n), 12, temperature=0.9, seed=n) for n in (6, 2, 9)]
    assert _drain(second, reqs) == [alone(m, r) for r in reqs]
    assert Batch(m, 2, 48, mode="eager", cache=second.take_cache())._cache is not cache  # 2 rows, not 3
    busy = Batch(m, 2, 48, mode="eager")
    busy.join(Request(ids(3, 1), 5))
    with pytest.raises(ValueError, match="still has 1 rows"):
        busy.take_cache()


def test_a_prompt_prefilled_a_chunk_at_a_time_joins_and_decodes_as_alone(monkeypatch):
    """start / prefill / join(prefilled=): a 30-token prompt in chunks of 8 (four pieces) into a
    cache of its own while another row decodes, then copied into its row: the last chunk's
    logits equal one forward pass over the whole prompt without a cache (float rounding), its
    attention row the one that pass gives, and both rows' tokens are their requests' alone."""
    monkeypatch.setattr(batch_module, "CHUNK", 8)
    m = model()
    short, long = Request(ids(5, 6), 12), Request(ids(30, 5), 7, weights=True, layers=(1,))
    b = Batch(m, 2, 48, mode="eager")
    got = {"short": [], "long": []}
    row, tok = b.join(short)
    names = {id(row): "short"}
    got["short"].append(tok.id)
    p = b.start(long)
    pieces = 0
    while not p.finished:
        b.prefill(p)
        pieces += 1
        for r, t in b.step():
            got[names[id(r)]].append(t.id)
    assert pieces == 4 and len(b) == 1
    with torch.inference_mode():
        whole = m(torch.tensor([list(long.ids)]), backend="reference", return_weights=True)
    torch.testing.assert_close(p.out.logits[0, -1], whole.logits[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.out.weights[1][0, :, -1], whole.weights[1][0, :, -1], rtol=1e-5, atol=1e-6)
    row, tok = b.join(long, p)
    names[id(row)] = "long"
    got["long"].append(tok.id)
    while len(b):
        for r, t in b.step():
            if t is not None:
                got[names[id(r)]].append(t.id)
    assert got["short"] == alone(m, short)
    assert got["long"] == [t for t, _ in alone(m, long, weights=True)]
    with pytest.raises(ValueError, match="finished prefill of this request"):
        b.join(short, b.start(short))
