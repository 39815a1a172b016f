"""The native one-token step (qkv/generation/native_step.py, ``qkv::Decoder`` in qmatmul.cpp)
against the eager model it stands for, on tiny Llama-shaped models in the formats it runs (4-bit
blocks on qkv's kernel, an 8-bit head, its top logits exact): the logits and the cache it writes
at every position, MHA/GQA/MQA, biases (Qwen2), Gemma's embedding scale; the same numbers on any
thread count; generate's choice of it and its tokens; attention rows from its kept queries; what
it refuses and why."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import alone_then_joined, kernel_builds, run_folder, single_thread

from qkv.attention import BatchKVCache
from qkv.generation import builds, generate
from qkv.generation import native_step as ns
from qkv.layers.quant import TopKRefinedLinear
from qkv.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

V = 64
LLAMA = dict(positions="rope", norm="rmsnorm", bias=False, mlp="swiglu")


def quantised(seed: int = 11, **over) -> GPT:
    """A tiny Llama-shaped model in SmolLM2's decoding format (``CausalLM.quantize("q4")``)."""
    from qkv.pipelines import CausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, max_seq_len=48, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=128,
               **LLAMA)
    cfg.update(over)
    m = GPT(GPTConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:  # large weights: greedy decoding sees varied contexts
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return CausalLM("tiny", m, tokenizer=None, stored_as=("Q4_1",)).quantize("q4").model


if ns.unsupported(quantised()) is not None:
    pytest.skip(f"no native step here: {ns.unsupported(quantised())}", allow_module_level=True)


def feed(m: GPT, step: ns.NativeStep, prompt: list[int], tokens: list[int]):
    """The prompt eagerly into two caches, then each token through the native step and the eager
    model: per token (native logits, eager logits), and the two caches."""
    c_native, c_eager = step.make_cache(1), m.make_cache(1, step.cache_len)
    out = []
    with torch.inference_mode():
        x = torch.tensor([prompt])
        m(x, cache=c_native)
        m(x, cache=c_eager)
        for t in tokens:
            tok = torch.tensor([[t]])
            out.append((step.step(tok, c_native), m(tok, cache=c_eager, last_only=True).logits))
    return out, c_native, c_eager


# attention's vector paths: 16 keys a vector's scores (positions 5..44: two blocks and a tail), up to
# 8 query heads' values held at once (18 heads on one kv head: runs of 9 and 18, past 8), and a
# head width that is not a multiple of 16 (24: plain dot products on AVX-512, vectors on AVX2)
SHAPES = {"gqa": {}, "mha": dict(n_kv_heads=4), "mqa": dict(n_kv_heads=1),
          "mqa, 18 heads": dict(dim=288, n_heads=18, n_kv_heads=1), "head width 24": dict(dim=96),
          "qwen2 biases": dict(qkv_bias=True), "gemma scale": dict(embed_scale=True),
          "untied head": dict(tie_embeddings=False)}
# the wider model's logits move further when an activation's int8 code moves by one step: measured
# up to 1.07e-3 of the largest logit with the decoder before the vector paths, 1.02e-3 after
TOLERANCE = {"mqa, 18 heads": 2e-3}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_native_step_equals_eager_at_every_position(shape):
    over = SHAPES[shape]
    m = quantised(**over)
    assert isinstance(m.lm_head, TopKRefinedLinear)
    step = ns.NativeStep(m, 48)
    tokens = [(5 * t + 3) % V for t in range(40)]
    pairs, c_native, c_eager = feed(m, step, [1, 2, 3, 4, 5], tokens)  # positions 5..44
    for got, want in pairs:
        assert got.shape == want.shape == (1, 1, V) and got.dtype == torch.float32
        # the products' integers are the same; the float work between them (norms, RoPE,
        # softmax) sums in another order, which can move an activation's int8 code by one step
        assert (got - want).abs().max() <= TOLERANCE.get(shape, 1e-3) * want.abs().max()
        assert int(got.argmax()) == int(want.argmax())
    assert c_native.pos == c_eager.pos == 45
    n = c_native.pos
    # the first layer's keys and values: only its own norm's rounding (an int8 code moved by one)
    torch.testing.assert_close(c_native.k[0, :, :, :n], c_eager.k[0, :, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c_native.v[0, :, :, :n], c_eager.v[0, :, :, :n], rtol=1e-4, atol=1e-4)
    for a, b in ((c_native.k, c_eager.k), (c_native.v, c_eager.v)):  # every layer: 1e-3 of its scale
        assert (a[:, :, :, :n] - b[:, :, :, :n]).abs().max() <= 1e-3 * b[:, :, :, :n].abs().max()


def test_the_top_logits_are_the_exact_products_and_the_rest_the_8bit_ones():
    """The head as TopKRefinedLinear defines it, computed by hand from the eager model's last
    hidden state: the k largest 8-bit logits replaced by fp32 products with the float matrix."""
    m = quantised()
    head = m.lm_head
    head.k = 8  # fewer than V: both kinds of logit present
    step = ns.NativeStep(m, 48)
    pairs, _, _ = feed(m, step, [7, 8, 9], [10, 11, 12])
    got = pairs[-1][0][0, 0]
    with torch.inference_mode():  # the hidden state before the head, by the eager model
        c = m.make_cache(1, 48)
        h = m.stack(m.embed(torch.tensor([[7, 8, 9, 10, 11, 12]])), rope=m.rope, cache=c).x[0, -1]
        approx = head.approx(h[None])[0].float()
    top = approx.topk(8).indices
    exact = head.weight.double()[top] @ h.double()
    # within the two paths' rounding of h (1e-3 of the largest logit, as above); the 8-bit
    # logits there are ~20x further off (measured 0.018), so an unrefined head fails this
    scale = exact.abs().max().item()
    assert (got[top].double() - exact).abs().max() <= 2e-4 * scale
    assert (approx[top].double() - exact).abs().max() > 1e-3 * scale
    rest = torch.ones(V, dtype=torch.bool)
    rest[top] = False
    torch.testing.assert_close(got[rest], approx[rest], rtol=1e-3, atol=1e-3 * approx.abs().max().item())


@pytest.mark.parametrize("vocab", [64, 10240])  # one block of 128 logits; 80 blocks (> top-k 64)
def test_its_argmax_is_torch_argmax_of_its_logits(vocab: int) -> None:
    """greedy(): the index torch.argmax gives on the logits the step returned, at every position;
    with a NaN logit (the first NaN) and a tie between two refined logits (the first of them),
    planted in the head's float matrix where the step refines them."""
    m = quantised(vocab_size=vocab)
    step = ns.NativeStep(m, 48)
    tokens = [(11 * t + 3) % vocab for t in range(24)]
    c = step.make_cache(1)
    with torch.inference_mode():
        m(torch.tensor([[1, 2, 3]]), cache=c)
        for t in tokens:
            got = step.step(torch.tensor([[t]]), c)
            assert int(step.greedy()) == int(got.argmax())
        assert step.greedy().shape == (1,) and step.greedy().dtype == torch.int64
    tensors, ints, floats = ns._tensors(m)
    with torch.inference_mode():
        c = m.make_cache(1, 48)
        m(torch.tensor([[1, 2, 3]]), cache=c)
        k, v = c.k.clone(), c.v.clone()
        dec = torch.classes.qkv.Decoder(tensors, ints, floats)
        logits = dec.step(5, 3, k.clone(), v.clone(), torch.empty(0))[0, 0]
        first, second = logits.topk(2).indices.tolist()
        for plant, want in (("nan", min(first, second)), ("tie", min(first, second))):
            exact = tensors[7].clone()
            if plant == "nan":
                exact[first] = exact[second] = float("nan")
            else:
                exact[second] = exact[first]
            dec = torch.classes.qkv.Decoder([*tensors[:7], exact, *tensors[8:]], ints, floats)
            got = dec.step(5, 3, k.clone(), v.clone(), torch.empty(0))[0, 0]
            assert int(got.argmax()) == want, plant  # the planted case is what it says
            assert dec.argmax() == want, plant
        if vocab == 10240:  # a final norm 5e37 times larger: some 8-bit products overflow to +inf,
            # some to -inf, none NaN (their sum is NaN: torch.argmax's order, entry by entry)
            dec = torch.classes.qkv.Decoder([*tensors[:3], tensors[3] * 5e37, *tensors[4:]], ints, floats)
            got = dec.step(5, 3, k.clone(), v.clone(), torch.empty(0))[0, 0]
            assert got.isposinf().any() and got.isneginf().any() and not got.isnan().any()
            assert dec.argmax() == int(got.argmax())


def unpacked(four: ns.GreedyHead) -> torch.Tensor:
    """The (V, D) float64 matrix a 4-bit copy holds, from the kernel's own bytes (the inverse of
    qkv.kernels.pack_int4's layout, written here: within a group of 32, input 8c + 4h + b is the
    low (h = 0) or high nibble of byte (c, row j, b)); w = d·q + m."""
    nb, G = four.w4.shape[:2]
    byte = four.w4.view(nb, G, 4, 16, 4).permute(0, 3, 1, 2, 4).to(torch.int64)  # (block, j, group, c, b)
    q = torch.stack([byte & 0xF, byte >> 4], dim=-2).reshape(nb * 16, G, 32).double()  # (V, G, 32)
    d, m = (four.dm[:, :, i].permute(0, 2, 1).reshape(nb * 16, G, 1).double() for i in (0, 1))
    return (q * d + m).reshape(nb * 16, G * 32)


def test_a_greedy_step_ranks_with_a_4bit_copy_of_the_head_and_gives_the_exact_top() -> None:
    """greedy_step: the body's numbers are step's (the caches bit for bit), the 64 largest of a
    first pass with the head's 4-bit copy (Q4_1's grid of the float matrix, by hand from its
    dequantised weights in float64) are the exact fp32 products, the others that copy's products
    (not the 8-bit head's), and its argmax is step's at every position."""
    vocab = 10240  # 80 blocks of 128 logits, top-k 64: most logits unrefined
    m = quantised(vocab_size=vocab)
    four = ns.greedy_head(m)
    assert four is not None and ns.greedy_head(m) is four  # made once
    step = ns.NativeStep(m, 48)
    assert step._bound.decoder.greedy_head()
    prompt, tokens = [1, 2, 3], [(11 * t + 3) % vocab for t in range(24)]
    c_greedy, c_step = step.make_cache(1), step.make_cache(1)
    with torch.inference_mode():
        for c in (c_greedy, c_step):
            m(torch.tensor([prompt]), cache=c)
        for t in tokens:
            tok = torch.tensor([[t]])
            step.step(tok, c_step)
            want_arg = int(step.greedy())
            got = step.step(tok, c_greedy, greedy=True)[0, 0]
            assert int(step.greedy()) == want_arg == int(got.argmax())
    assert torch.equal(c_greedy.k, c_step.k) and torch.equal(c_greedy.v, c_step.v)
    with torch.inference_mode():  # the last token's hidden state before the head, by the eager model
        c = m.make_cache(1, 48)
        h = m.stack(m.embed(torch.tensor([prompt + tokens])), rope=m.rope, cache=c).x[0, -1].double()
    # the copy's weights within half a 4-bit step (1/30 of a group's range) of the matrix's, plus
    # float16's rounding of d and m (2^-11 of each, d times up to 15 codes)
    w, exact_w = unpacked(four), m.lm_head.weight.double()
    groups = exact_w.view(vocab, -1, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, -1)  # (V, D)
    largest = groups.abs().amax(-1).repeat_interleave(32, -1)
    assert ((w - exact_w).abs() <= step * (0.5 + 16 * 2**-11) + largest * 2 * 2**-11).all()
    assert (w - exact_w).abs().max() > 0.3 * step.min()  # (a copy of 4 bits, not of 8)
    approx4 = w @ h
    approx8 = m.lm_head.approx.dequantize().double() @ h
    top = approx4.topk(64).indices
    exact = m.lm_head.weight.double()[top] @ h
    scale = approx4.abs().max().item()
    assert (got[top].double() - exact).abs().max() <= 2e-4 * scale
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[top] = False
    assert (got[rest].double() - approx4[rest]).abs().max() <= 1e-3 * scale
    assert (got[rest].double() - approx8[rest]).abs().max() > 1e-2 * scale  # the 8-bit head was not read


def test_the_greedy_heads_bytes_and_its_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """product_bytes(greedy=True) counts the 4-bit copy (0.625 bytes a weight: 16 bytes of codes
    and two float16 a group of 32) against the 8-bit head's 34 bytes a group;
    QKV_NATIVE_GREEDY_HEAD=q8 keeps greedy steps on the 8-bit head, the same logits as step's."""
    vocab, dim = 10240, 64
    m = quantised(vocab_size=vocab)
    assert ns.product_bytes(m)["head"] == vocab * dim // 32 * 34
    assert ns.product_bytes(m, greedy=True)["head"] == vocab * dim // 32 * 20
    assert ns.weight_bytes(m) - ns.weight_bytes(m, greedy=True) == vocab * dim // 32 * 14
    monkeypatch.setenv("QKV_NATIVE_GREEDY_HEAD", "q8")
    assert ns.greedy_head(m) is None and ns.product_bytes(m, greedy=True)["head"] == vocab * dim // 32 * 34
    step = ns.NativeStep(m, 48)
    assert not step._bound.decoder.greedy_head()
    a, b = step.make_cache(1), step.make_cache(1)
    with torch.inference_mode():
        for c in (a, b):
            m(torch.tensor([[1, 2, 3]]), cache=c)
        for t in (7, 8, 9):
            tok = torch.tensor([[t]])
            assert torch.equal(step.step(tok, a, greedy=True), step.step(tok, b))


def test_the_greedy_heads_copy_follows_the_matrix_changed_in_place() -> None:
    """The 4-bit copy is made again after the float matrix changes in place (load_state_dict
    copies into the same storage): greedy generate then gives the eager model's tokens, which a
    copy left as it was (ranking by the old matrix) does not."""
    vocab = 10240
    m, other = quantised(vocab_size=vocab), quantised(seed=12, vocab_size=vocab)
    x = torch.tensor([[1, 2, 3, 4]])
    first = ns.greedy_head(m)
    want = [int(t[0]) for t in generate(m, x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m, x, 12, temperature=0.0)] == want
    m.load_state_dict(other.state_dict())
    again = ns.greedy_head(m)
    assert again is not None and again is not first
    torch.testing.assert_close(unpacked(again), unpacked(ns.greedy_head(other)))
    want = [int(t[0]) for t in generate(other, x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m, x, 12, temperature=0.0)] == want


def test_generate_takes_the_steps_argmax_when_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generate asks the native step for its argmax (counted), not sample_next, after the
    prompt; sampling asks sample_next; the tokens are eager's (the test above: the same index)."""
    import qkv.generation.decode as decode

    m = quantised()
    calls = {"greedy": 0, "sample": 0}

    def counted(name, real):
        def call(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return call

    real_step = ns.NativeStep.step

    def step(self, tok, cache, greedy=False):
        calls["greedy steps" if greedy else "steps"] += 1
        return real_step(self, tok, cache, greedy)

    monkeypatch.setattr(ns.NativeStep, "greedy", counted("greedy", ns.NativeStep.greedy))
    monkeypatch.setattr(ns.NativeStep, "step", step)
    monkeypatch.setattr(decode, "sample_next", counted("sample", decode.sample_next))
    x = torch.tensor([[1, 2, 3]])
    calls.update({"greedy steps": 0, "steps": 0})
    got = [int(t[0]) for t in generate(m, x, 12, temperature=0.0)]
    assert calls == {"greedy": 11, "sample": 1, "greedy steps": 11, "steps": 0}
    want = [int(t[0]) for t in generate(m, x, 12, temperature=0.0, mode="eager")]
    assert got == want
    calls.update({"greedy": 0, "sample": 0, "greedy steps": 0, "steps": 0})
    list(generate(m, x, 5, temperature=0.8, seed=1))  # sampling: the 8-bit head's whole distribution
    assert calls == {"greedy": 0, "sample": 5, "greedy steps": 0, "steps": 4}


def test_any_thread_count_gives_the_same_numbers():
    m = quantised()
    step = ns.NativeStep(m, 48)
    tokens = [(3 * t + 1) % V for t in range(20)]
    with single_thread():
        one = [g for g, _ in feed(m, step, [1, 2], tokens)[0]]
    torch.set_num_threads(2)
    try:
        two = [g for g, _ in feed(m, step, [1, 2], tokens)[0]]
    finally:
        torch.set_num_threads(1)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)  # each block and head is one thread's work, in one order


@pytest.mark.parametrize("shape", ["gqa", "head width 24"])
def test_the_steps_profile_counts_every_phase_and_moves_no_number(shape):
    """``profile_steps``: after it is asked for, each of two threads ends each of a layer's phases
    once a layer a step (where a head is not whole blocks of 16, width 24, the heads are placed after
    a first barrier: q|k|v and its wait counted twice), the final norm and head once a step, and
    thread 0 alone the serial part once a step; thread 0's phases, serial included, are the steps'
    time (within the time of the step calls alone, each >= 0). Nothing is timed before it is asked
    for or after it is turned off, and the timed steps' logits are the untimed steps', bit for bit."""
    m = quantised(**SHAPES[shape])
    L, n = m.cfg.n_layers, 5
    step = ns.NativeStep(m, 48)
    tokens = [(5 * t + 2) % V for t in range(n)]

    def steps(count: int) -> tuple[list[torch.Tensor], float]:
        """The prompt eagerly, then ``count`` native steps: their logits and the steps' own time."""
        cache, spent, out = step.make_cache(1), 0.0, []
        with torch.inference_mode():
            m(torch.tensor([[1, 2]]), cache=cache)
            for t in tokens[:count]:
                began = time.perf_counter()
                out.append(step.step(torch.tensor([[t]]), cache))
                spent += time.perf_counter() - began
        return out, spent

    torch.set_num_threads(2)
    try:
        plain, _ = steps(n)
        assert ns.profile_steps(m, True).steps == 0  # (the untimed steps above)
        timed, spent = steps(n)
        prof = ns.profile_steps(m, False)
        steps(2)
        after = ns.profile_steps(m, False)
    finally:
        torch.set_num_threads(1)
    for a, b in zip(plain, timed, strict=True):
        assert torch.equal(a, b)
    assert prof.threads == 2 and prof.steps == n and after.steps == 0 and after.threads == 0
    names = ns.PROFILE_PHASES
    want = {name: L * n for name in ns.LAYER_PHASES} | {"final norm": n, "head": n, "serial": n}
    if m.cfg.resolved_head_dim % 16:
        want["q|k|v"] = want["wait q|k|v"] = 2 * L * n
    for thread in range(2):
        got = {name: int(prof.counts[thread, i]) for i, name in enumerate(names)}
        assert got == want | ({"serial": 0} if thread else {})
    assert bool((prof.seconds >= 0).all()) and 0 < prof.total() <= spent
    assert prof.per_step().shape == (2, len(names))


@pytest.mark.parametrize("shape", ["gqa", "head width 24", "qwen2 biases"])
@pytest.mark.parametrize(("threads", "first"), [(2, 1), (3, 1), (3, 2), (5, 1)])  # 5: shares of no unit
def test_units_claimed_across_threads_give_the_same_numbers(shape, threads, first):
    """A product's units go to whichever thread claims them (``claimed`` in qmatmul.cpp): with
    each thread starting on another's share (the decoder's 11th int), units are claimed across
    threads whatever the scheduling, and a thread takes what is left of the others'; with 5
    threads some shares hold no unit (4 blocks of 16 outputs). One row and five, three steps in a
    row (each step's products counted on from the last's), over a head of 16 blocks of 128 logits
    (their maxima and NaN check taken per piece): logits, keys, values and queries equal the
    one-thread step's, bit for bit."""
    m = quantised(vocab_size=2048, **SHAPES[shape])
    tensors, ints, floats = ns._tensors(m)
    assert len(ints) == 10
    own = torch.classes.qkv.Decoder(tensors, ints, floats)
    across = torch.classes.qkv.Decoder(tensors, [*ints, first], floats)
    cache, tokens = rows_case(m, ROW_LENGTHS[5], R=5)
    pos = torch.tensor(ROW_LENGTHS[5])
    want = [cache.k.clone(), cache.v.clone(), cache.queries.clone()]
    logits = own.step_rows(tokens, pos, *want)  # one thread (the module's fixture)
    torch.set_num_threads(threads)
    try:
        got = [cache.k.clone(), cache.v.clone(), cache.queries.clone()]
        rows = across.step_rows(tokens, pos, *got)
        one = [c[:, :1].clone() for c in (cache.k, cache.v, cache.queries)]
        alone = [across.step(int(tokens[0]), int(pos[0]), *one) for _ in range(3)][-1]
    finally:
        torch.set_num_threads(1)
    assert torch.equal(rows, logits)
    assert torch.equal(alone[0], logits[0])
    for a, b, c in zip(got, want, one, strict=True):
        assert torch.equal(a, b) and torch.equal(c[:, 0], b[:, 0])


def test_generate_takes_it_by_default_with_the_eager_tokens():
    m = quantised()
    x = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    said = []
    got = [int(t[0]) for t in generate(m, x, 30, temperature=0.0, on_decision=said.append)]
    want = [int(t[0]) for t in generate(m, x, 30, temperature=0.0, mode="eager")]
    assert said[0].kind == "native" and said[0].says() == "native step" and said[0].why is None
    assert got == want
    # weights changed in place are read where they lie; replaced ones are bound again
    with torch.no_grad():
        m.stack.norm.weight.mul_(0.5)
    want = [int(t[0]) for t in generate(m, x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m, x, 12, temperature=0.0)] == want
    other = quantised(seed=12)
    m.load_state_dict(other.state_dict())  # copied into the same storage
    want = [int(t[0]) for t in generate(other, x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m, x, 12, temperature=0.0)] == want


def test_attention_rows_from_its_kept_queries_equal_eager_weights():
    m = quantised()
    x = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(6))
    said = []
    got = list(generate(m, x, 6, temperature=0.0, return_weights=True, on_decision=said.append))
    want = list(generate(m, x, 6, temperature=0.0, return_weights=True, mode="eager"))
    assert said[0].kind == "native"
    for (ids_g, w_g), (ids_w, w_w) in zip(got, want, strict=True):
        assert torch.equal(ids_g, ids_w)
        for a, b in zip(w_g, w_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))


def test_what_it_does_not_run_decodes_as_before(monkeypatch):
    torch.manual_seed(0)
    float_model = GPT(GPTConfig(vocab_size=V, max_seq_len=16, dim=32, n_layers=1, n_heads=2, **LLAMA)).eval()
    assert "output layer is not 8-bit" in ns.unsupported(float_model)
    learned = quantised(positions="learned")
    assert ns.unsupported(learned) == "it takes RoPE models only"
    with pytest.raises(ValueError, match="cannot decode this model: it takes RoPE"):
        ns.NativeStep(learned, 16)
    x = torch.tensor([[1, 2, 3]])
    said = []
    list(generate(float_model, x, 2, temperature=0.0, on_decision=said.append))
    assert said[0].kind != "native"
    monkeypatch.setenv("QKV_NATIVE_STEP", "off")
    assert ns.unsupported(quantised()) == "QKV_NATIVE_STEP=off"
    said.clear()
    list(generate(quantised(), x, 2, temperature=0.0, on_decision=said.append))
    assert said[0].kind != "native"
    monkeypatch.delenv("QKV_NATIVE_STEP")
    said.clear()
    list(generate(quantised(), torch.tensor([[1, 2], [3, 4]]), 2, temperature=0.0, on_decision=said.append))
    assert said[0].kind == "eager" and said[0].why is builds.Why.ROWS  # two rows: not one row's step


def test_bad_steps_are_refused_with_the_reason():
    m = quantised()
    step = ns.NativeStep(m, 8)
    cache = step.make_cache(1)
    with pytest.raises(ValueError, match="one row at a time"):
        step.make_cache(2)
    with pytest.raises(ValueError, match=r"takes \(1, 1\) tokens"):
        step.step(torch.tensor([[1, 2]]), cache)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        step.step(torch.tensor([[V]]), cache)
    cache.pos = 8
    with pytest.raises(ValueError, match="KVCache overflow"):
        step.step(torch.tensor([[1]]), cache)


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The Decoder classes of the library's other code paths (helpers.kernel_builds)."""
    return {name: getattr(torch.classes, ns).Decoder
            for name, ns in kernel_builds(run_folder(tmp_path_factory, "kernel-builds")).items()}


@pytest.mark.parametrize("shape", ["gqa", "mqa, 18 heads", "head width 24"])
def test_every_code_path_decodes_as_eager(other_builds, shape):
    """The decoder of the AVX2 and plain C++ builds (what a CPU without AVX512-VNNI runs), on the
    same model, against the eager model at every position."""
    m = quantised(**SHAPES[shape])
    tensors, ints, floats = ns._tensors(m)
    tokens = [(7 * t + 2) % V for t in range(30)]
    for name, cls in other_builds.items():
        dec = cls(tensors, ints, floats)
        c_other, c_eager = m.make_cache(1, 40), m.make_cache(1, 40)
        with torch.inference_mode():
            x = torch.tensor([[1, 2, 3]])
            m(x, cache=c_other)
            m(x, cache=c_eager)
            for t in tokens:
                got = dec.step(t, c_other.pos, c_other.k, c_other.v, torch.empty(0))
                c_other.advance(1)
                want = m(torch.tensor([[t]]), cache=c_eager, last_only=True).logits
                assert (got - want).abs().max() <= TOLERANCE.get(shape, 1e-3) * want.abs().max(), name
                assert int(got.argmax()) == int(want.argmax()), name


def test_every_code_path_steps_greedily_with_the_4bit_copy(other_builds):
    """greedy_step on the AVX2 and plain C++ builds: the same argmax as their own steps and as this
    build's greedy steps, logits within the tolerance above of this build's greedy ones (whose
    4-bit copy the test above holds to the matrix), not of the 8-bit head's."""
    vocab = 10240
    m = quantised(vocab_size=vocab)
    tensors, ints, floats = ns._tensors(m)
    assert len(tensors) == 10 + 12 * m.cfg.n_layers  # the 4-bit copy bound
    here = torch.classes.qkv.Decoder(tensors, ints, floats)
    tokens = [(13 * t + 5) % vocab for t in range(12)]
    for name, cls in other_builds.items():
        dec = cls(tensors, ints, floats)
        caches = [m.make_cache(1, 40) for _ in range(3)]
        with torch.inference_mode():
            for c in caches:
                m(torch.tensor([[1, 2, 3]]), cache=c)
            for t in tokens:
                pos = caches[0].pos
                got = dec.greedy_step(t, pos, caches[0].k, caches[0].v, torch.empty(0))
                chose = dec.argmax()
                want = here.greedy_step(t, pos, caches[1].k, caches[1].v, torch.empty(0))
                eight = dec.step(t, pos, caches[2].k, caches[2].v, torch.empty(0))
                for c in caches:
                    c.advance(1)
                assert (got - want).abs().max() <= 1e-3 * want.abs().max(), name
                assert chose == int(got.argmax()) == int(want.argmax()) == int(eight.argmax()), name
                assert (got - eight).abs().max() > 1e-2 * eight.abs().max(), name  # the 4-bit copy read


def rows_case(m: GPT, lengths: list[int], R: int, seed: int = 3):
    """A running batch's cache of R rows, row b holding a random prompt of lengths[b] tokens (the
    eager model's keys and values), room for its queries; and one next token per row."""
    cfg = m.cfg
    g = torch.Generator().manual_seed(seed)
    L, K, D, H = cfg.n_layers, cfg.resolved_kv_heads, cfg.resolved_head_dim, cfg.n_heads
    cache = BatchKVCache(L, R, K, cfg.max_seq_len, D)
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            m(torch.randint(0, cfg.vocab_size, (1, n), generator=g), cache=cache.row(b))
            cache.set_length(b, n)
    cache.keep_queries(torch.zeros(L, R, H, 1, D))
    return cache, torch.randint(0, cfg.vocab_size, (len(lengths),), generator=g)


ROW_LENGTHS = {n: [(7 * b + 2 * n) % 41 + 1 for b in range(n)] for n in (2, 5, 13, 20)}


@pytest.mark.parametrize("shape", ["gqa", "mqa, 18 heads", "head width 24", "qwen2 biases"])
@pytest.mark.parametrize("n", [2, 5, 13, 20])  # 13 and 20 rows: AMX tiles where this CPU has them
@pytest.mark.parametrize("threads", [1, 2])    # (from 12; 20 rows: two chunks of 16, three of 8)
def test_a_running_batchs_rows_step_each_as_alone(shape, n, threads):
    """step_rows: n rows at their own positions, each row's logits, keys, values and kept queries
    those the one-row step gives it alone, bit for bit (the same integers and floats, rows or
    not, on any thread count), within the tolerance above of the eager model's logits, and
    nothing else of the cache written."""
    m = quantised(**SHAPES[shape])
    dec = ns.NativeStep(m, 48)._bound.decoder
    R = 24
    cache, tokens = rows_case(m, ROW_LENGTHS[n], R=R)
    k, v, q = cache.k.clone(), cache.v.clone(), cache.queries.clone()
    pos = torch.tensor(ROW_LENGTHS[n])
    torch.set_num_threads(threads)
    try:
        rows = dec.step_rows(tokens, pos, k, v, q)
    finally:
        torch.set_num_threads(1)
    assert rows.shape == (n, 1, V)
    for b in range(n):
        p = int(pos[b])
        k1, v1 = cache.k[:, b : b + 1].clone(), cache.v[:, b : b + 1].clone()
        q1 = torch.zeros_like(cache.queries[:, :1])
        alone = dec.step(int(tokens[b]), p, k1, v1, q1)
        assert torch.equal(rows[b], alone[0]), b
        assert torch.equal(k[:, b], k1[:, 0]) and torch.equal(v[:, b], v1[:, 0])
        assert torch.equal(q[:, b], q1[:, 0])
        other = torch.ones(48, dtype=torch.bool)
        other[p] = False  # every other position of the row: as it was
        assert torch.equal(k[:, b, :, other], cache.k[:, b, :, other])
        assert torch.equal(v[:, b, :, other], cache.v[:, b, :, other])
        with torch.inference_mode():
            c = m.make_cache(1, 48)
            c.k[:, :, :, :p] = cache.k[:, b : b + 1, :, :p]
            c.v[:, :, :, :p] = cache.v[:, b : b + 1, :, :p]
            c.pos = p
            want = m(tokens[b].view(1, 1), cache=c, last_only=True).logits[0]
        assert (rows[b] - want).abs().max() <= TOLERANCE.get(shape, 1e-3) * want.abs().max(), b
    untouched = torch.ones(R, dtype=torch.bool)
    untouched[:n] = False  # the rows past n: as they were
    assert torch.equal(k[:, untouched], cache.k[:, untouched])
    assert torch.equal(v[:, untouched], cache.v[:, untouched])
    assert torch.equal(q[:, untouched], cache.queries[:, untouched])


@pytest.mark.parametrize("n", [2, 13, 20])  # 13, 20 rows: the 4-bit copy on AMX tiles (20: two chunks of 16)
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_rows_step_each_as_a_greedy_step_alone(n, threads):
    """greedy_step_rows: each row's logits those greedy_step gives it alone, bit for bit (the
    head's 4-bit copy read for every row at once), not step_rows' (the 8-bit head), each row's
    argmax step_rows' own."""
    vocab = 10240
    m = quantised(vocab_size=vocab)
    dec = ns.NativeStep(m, 48)._bound.decoder
    cache, tokens = rows_case(m, ROW_LENGTHS[20][:n], R=n)
    pos = torch.tensor(ROW_LENGTHS[20][:n])
    k, v, q = cache.k.clone(), cache.v.clone(), cache.queries.clone()
    torch.set_num_threads(threads)
    try:
        greedy = dec.greedy_step_rows(tokens, pos, k, v, q)
        rows = dec.step_rows(tokens, pos, cache.k.clone(), cache.v.clone(), cache.queries.clone())
    finally:
        torch.set_num_threads(1)
    assert not torch.equal(greedy, rows)
    assert torch.equal(greedy.argmax(-1), rows.argmax(-1))
    for b in range(n):
        k1, v1 = cache.k[:, b : b + 1].clone(), cache.v[:, b : b + 1].clone()
        alone = dec.greedy_step(int(tokens[b]), int(pos[b]), k1, v1, torch.zeros_like(cache.queries[:, :1]))
        assert torch.equal(greedy[b], alone[0]), b
        assert torch.equal(k[:, b], k1[:, 0]) and torch.equal(v[:, b], v1[:, 0])


def test_a_running_batch_of_greedy_rows_ranks_with_the_4bit_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch: while every live row decodes greedily its steps are greedy ones (counted), and
    each request's tokens are those greedy generate gives it alone; a sampled row among them makes
    the batch's steps plain ones (its sampler reads every logit), as more rows than
    GREEDY_HEAD_ROWS do."""
    from qkv.generation.batch import GREEDY_HEAD_ROWS, Request, generate_batch

    vocab = 10240
    m = quantised(vocab_size=vocab)
    calls = {"greedy": 0, "plain": 0}
    real = ns.NativeStep.step_rows

    def step_rows(self, tok, cache, greedy=False):
        calls["greedy" if greedy else "plain"] += 1
        return real(self, tok, cache, greedy)

    monkeypatch.setattr(ns.NativeStep, "step_rows", step_rows)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 9, 5)]
    got: dict[int, list[int]] = {}
    for i, tok in generate_batch(m, [Request(p, 8) for p in prompts], rows=3):
        got.setdefault(i, []).append(tok.id)
    assert calls["greedy"] > 0 and calls["plain"] == 0
    for i, p in enumerate(prompts):
        alone = generate(m, torch.tensor([p]), 8, temperature=0.0)  # (this random model's eager tokens part
        assert got[i] == [int(t[0]) for t in alone], i              # from the native step's at a near-tie)
    calls.update(greedy=0, plain=0)
    mixed = [Request(prompts[0], 8), Request(prompts[1], 8, temperature=1.0, seed=1)]
    list(generate_batch(m, mixed, rows=2))
    assert calls["plain"] > 0
    calls.update(greedy=0, plain=0)  # more greedy rows than GREEDY_HEAD_ROWS: plain steps while they are
    many = [Request(prompts[i % 3], 4) for i in range(GREEDY_HEAD_ROWS + 1)]
    list(generate_batch(m, many, rows=GREEDY_HEAD_ROWS + 1))
    assert calls["plain"] > 0


def test_every_code_path_steps_rows_as_alone(other_builds):
    """The AVX2 build's rows take its wide 16-bit products (two rows and more), the plain C++
    build's its own loops: each row's logits still those of its one-row step, bit for bit."""
    m = quantised()
    tensors, ints, floats = ns._tensors(m)
    cache, tokens = rows_case(m, ROW_LENGTHS[5], R=5)
    pos = torch.tensor(ROW_LENGTHS[5])
    for name, cls in other_builds.items():
        dec = cls(tensors, ints, floats)
        rows = dec.step_rows(tokens, pos, cache.k.clone(), cache.v.clone(), torch.empty(0))
        for b in range(5):
            alone = dec.step(int(tokens[b]), int(pos[b]), cache.k[:, b : b + 1].clone(),
                             cache.v[:, b : b + 1].clone(), torch.empty(0))
            assert torch.equal(rows[b], alone[0]), (name, b)


def test_far_prefetches_follow_the_models_size_and_move_no_number(other_builds, monkeypatch):
    """prefetch_far: a model whose weights a step reads (its blocks' 4-bit matrices and its 8-bit
    head, counted here from the buffers' names) outgrow the last-level cache has its products ask
    for them further ahead; QKV_NATIVE_PREFETCH decides instead. A prefetch moves no number: a
    decoder bound either way gives the same logits, keys and values bit for bit, on one row and on
    13 (AMX tiles where this CPU has them), on every build."""
    monkeypatch.delenv("QKV_NATIVE_PREFETCH", raising=False)
    m = quantised()
    size = ns.weight_bytes(m)
    read = ("w4", "dm", "w8", "ds")
    assert size == sum(t.nbytes for n, t in m.named_buffers() if n.rsplit(".", 1)[-1] in read)
    for cache_bytes, far in ((size - 1, True), (size, False), (None, False)):
        monkeypatch.setattr(ns, "last_level_cache", lambda c=cache_bytes: c)
        assert ns.prefetch_far(m) is far and ns._tensors(m)[1][9] == int(far), cache_bytes
    monkeypatch.setenv("QKV_NATIVE_PREFETCH", "far")
    assert ns.prefetch_far(m)  # (the cache is unknown here)
    monkeypatch.setattr(ns, "last_level_cache", lambda: 1)
    monkeypatch.setenv("QKV_NATIVE_PREFETCH", "near")
    assert not ns.prefetch_far(m)
    tensors, ints, floats = ns._tensors(m)
    cache, tokens = rows_case(m, ROW_LENGTHS[13], R=13)
    pos = torch.tensor(ROW_LENGTHS[13])
    for name, cls in {"this CPU's": torch.classes.qkv.Decoder, **other_builds}.items():
        got = []
        for far in (0, 1):
            dec = cls(tensors, [*ints[:9], far], floats)
            k, v = cache.k.clone(), cache.v.clone()
            rows = dec.step_rows(tokens, pos, k, v, torch.empty(0))
            k1, v1 = cache.k[:, :1].clone(), cache.v[:, :1].clone()
            one = dec.step(int(tokens[0]), int(pos[0]), k1, v1, torch.empty(0))
            got.append((rows, k, v, one, k1, v1))
        assert all(torch.equal(a, b) for a, b in zip(*got, strict=True)), name
        assert not torch.equal(got[0][1], cache.k)  # (the step wrote its keys)


def test_bad_rows_are_refused_with_the_reason():
    m = quantised()
    step = ns.NativeStep(m, 48)
    dec = step._bound.decoder
    cache, tokens = rows_case(m, [4, 6, 8], R=3)
    k, v = cache.k, cache.v
    pos = torch.tensor([4, 6, 8])
    with pytest.raises(RuntimeError, match=r"tokens and positions must be \(n,\) int64"):
        dec.step_rows(tokens, pos[:2], k, v, torch.empty(0))
    with pytest.raises(RuntimeError, match="3 rows or more"):
        dec.step_rows(tokens, pos, k[:, :2].contiguous(), v[:, :2].contiguous(), torch.empty(0))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        dec.step_rows(torch.tensor([1, V, 2]), pos, k, v, torch.empty(0))
    with pytest.raises(RuntimeError, match="position 48 outside the cache"):
        dec.step_rows(tokens, torch.tensor([4, 48, 8]), k, v, torch.empty(0))
    with pytest.raises(RuntimeError, match="the queries must be float32"):
        dec.step_rows(tokens, pos, k, v, torch.zeros(2, 3, 4, 1, 8))
    with pytest.raises(RuntimeError, match="the queries must be float32"):  # the right count, wrong shape
        dec.step_rows(tokens, pos, k, v, torch.zeros(2, 3, 1, 4, 8))
    with pytest.raises(RuntimeError, match="int64 on the CPU"):
        dec.step_rows(tokens.to("meta"), pos, k, v, torch.empty(0))
    with pytest.raises(RuntimeError, match="step takes a one-row cache"):  # rows: step_rows
        dec.step(1, 4, k, v, torch.empty(0))
    with pytest.raises(ValueError, match=r"takes \(n, 1\) tokens for n <= 3 rows"):
        step.step_rows(torch.tensor([[1], [2], [3], [4]]), cache)
    cache.set_length(1, 48)
    with pytest.raises(ValueError, match="KVCache overflow: a row at position 48"):
        step.step_rows(torch.tensor([[1], [2]]), cache)


def test_attention_asked_of_a_batch_cache_without_queries_is_still_given(monkeypatch):
    """A one-row batch made while the native step was off keeps no queries; turned on before a
    request that asks for attention, its steps decode eagerly (the weights computed), not through
    the native step without them: the tokens and weights of the eager batch."""
    from qkv.generation.batch import Batch, Request

    m = quantised()
    req = Request([3, 9, 4], 6, weights=True, layers=(1,))

    def run(mode: str) -> tuple[list[int], list]:
        monkeypatch.setenv("QKV_NATIVE_STEP", "off")
        b = Batch(m, 1, 40, mode=mode)
        monkeypatch.delenv("QKV_NATIVE_STEP")
        row, tok = b.join(req)
        got = [tok]
        while not row.done:
            got += [t for _, t in b.step()]
        return row.new, [t.weights[1] for t in got], b

    ids, weights, b = run("auto")
    want_ids, want_weights, _ = run("eager")
    assert b._cache.queries is None and b.rows_steps == 0 and ids == want_ids
    for a, w in zip(weights, want_weights, strict=True):
        torch.testing.assert_close(a, w)


def test_a_running_batch_steps_every_row_through_it():
    """qkv serve's batch: a request alone, a second joining, the first alone again: every step
    through the native step in place (no copy into a one-row cache), each row's greedy tokens
    the eager ones alone."""
    run = alone_then_joined(quantised(), V)
    assert run.solo_after_alone == 0 and run.solo_kind is None and run.batch.solo_steps == 0
    assert run.batch.rows_steps == 23  # a step for each of the first row's 24 tokens but the prompt's
    assert run.rows == run.want


def test_sampled_rows_in_a_batch_draw_what_each_draws_alone():
    """Rows sampled with their own seeds in one running batch, joining as others leave: each
    request's tokens are those generate gives it alone with that seed (the native one-row step:
    the same logits bit for bit, the same uniforms)."""
    from qkv.generation.batch import Request, generate_batch

    m = quantised()
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 9, 5, 14, 2)]
    reqs = [Request(p, 10, temperature=1.0, top_k=20, seed=s) for s, p in enumerate(prompts)]
    got: dict[int, list[int]] = {}
    for i, tok in generate_batch(m, reqs, rows=3):
        got.setdefault(i, []).append(tok.id)
    for i, (p, r) in enumerate(zip(prompts, reqs, strict=True)):
        said = []
        alone = [int(t[0]) for t in generate(m, torch.tensor([p]), 10, temperature=1.0, top_k=20, seed=r.seed,
                                             on_decision=said.append)]
        assert said[0].kind == "native" and got[i] == alone, i
    assert len({tuple(t) for t in got.values()}) > 1


def test_prepare_builds_no_step_for_a_model_it_runs():
    """`qkv prepare` (and `qkv assets install smollm2`): nothing to build for a model the native
    step runs, neither one request's step nor a running batch's; said in a line; the command's
    status is ready."""
    from qkv.commands.prepare import prepare
    from qkv.generation import aot
    from qkv.pipelines import CausalLM

    lm = CausalLM("tiny", quantised(), tokenizer=None, stored_as=("Q4_1",))
    lm.weights = "q4"
    lines: list[str] = []
    done = prepare("tiny", lm, batch_rows=8, batch_tokens=32, out=lines.append)
    assert done == [] and lm.prepare(8, 32) == []
    assert lines == ["tiny: one request and a running batch's rows decode through the native step (qkv's "
                     "kernels, no saved step to build)", "tiny: ready: nothing to build"]
    assert aot.load(lm.model) is None and aot.load(lm.model, 32, 8) is None  # no saved step was built


def test_a_binding_the_kernel_refuses_decodes_as_before(monkeypatch):
    """Where the kernel refuses a model's tensors (its checks raise), generate and the lone row
    decode as they did before the native step, with the eager tokens."""
    m = quantised()
    x = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    want = [int(t[0]) for t in generate(m, x, 10, temperature=0.0, mode="eager")]

    asked = []

    def refuse(*a, **k):
        asked.append(a)
        raise RuntimeError("qkv::Decoder: unsupported shape")

    monkeypatch.setattr(ns, "NativeStep", refuse)
    said = []
    assert [int(t[0]) for t in generate(m, x, 10, temperature=0.0, on_decision=said.append)] == want
    assert said[0].kind != "native" and len(asked) == 1  # it was tried, and refused
    run = alone_then_joined(m, V)
    assert len(asked) > 1 and run.solo_kind is not refuse and run.rows == run.want
    assert builds.saved_steps_wanted(m)  # so qkv prepare builds the saved steps it then decodes with
