"""qkv.lens on Hugging Face folders, against transformers' own model with hooks written by hand.

Each tiny random checkpoint (tests/helpers.py: 2 layers, width 64, 4 query heads; llama_tied_gqa
has 2 key/value heads) is saved as a folder and opened by ``qkv.load``; the reference numbers
come from the transformers model that wrote it (its ``output_hidden_states``, its own final norm
and head, forward hooks on its modules), in float64 where a sum is formed by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import HF_VOCAB, hf_decoder_folder

import qkv
from qkv import lens
from qkv.errors import InputError
from qkv.lens.hooks import Edits, forward, hooked

transformers = pytest.importorskip("transformers", reason="reference package transformers not "
                                   "installed: pip install 'qkv[reference]'")

TEXT = "w3 w17 w42 w5 w88 w9 w1 w60 w17 w42"
IDS = [3, 17, 42, 5, 88, 9, 1, 60, 17, 42]
CORRUPT = "w3 w17 w42 w5 w88 w9 w1 w61 w17 w42"


_OPENED: dict = {}


def _open(kind: str, tmp_path_factory):
    """(kind, transformers model, qkv's CausalLM of the same folder), built once per session."""
    if kind not in _OPENED:
        folder = tmp_path_factory.mktemp(kind)
        ref = hf_decoder_folder(kind, folder)
        _OPENED[kind] = (kind, ref, qkv.load(str(folder)))
    return _OPENED[kind]


@pytest.fixture(params=["gpt2", "llama", "llama_tied_gqa", "gemma"])
def pair(request, tmp_path_factory):
    return _open(request.param, tmp_path_factory)


def _hidden(ref, ids=IDS):
    with torch.no_grad():
        return ref(torch.tensor([ids]), output_hidden_states=True)


def _final_norm(ref, kind):
    return ref.transformer.ln_f if kind == "gpt2" else ref.model.norm


def test_next_token_equals_softmax_of_the_reference_logits(pair):
    _kind, ref, lm = pair
    want_logits = _hidden(ref).logits[0, -1].double()
    for t in (0.5, 1.0, 2.0):
        nt = lens.next_token(lm, TEXT, temperature=t, k=5)
        want = torch.softmax(want_logits / t, dim=-1)
        assert (nt.probs().double() - want).abs().max() <= 1e-5
        top = want.topk(5)
        assert [p.id for p in nt.top] == top.indices.tolist()
        assert [p.prob for p in nt.top] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert (nt.probs(1.0).double() - torch.softmax(want_logits, -1)).abs().max() <= 1e-5


def test_logit_lens_rows_equal_the_reference_hidden_states_through_its_own_norm_and_head(pair):
    kind, ref, lm = pair
    out = _hidden(ref)
    ll = lens.logit_lens(lm, TEXT)
    L = len(out.hidden_states) - 1
    assert ll.logprobs.shape == (L + 1, len(IDS), HF_VOCAB)
    with torch.no_grad():
        for i in range(L):  # HF's hidden_states[i] enters layer i; its last one is already normed
            read = ref.lm_head(_final_norm(ref, kind)(out.hidden_states[i]))
            want = torch.log_softmax(read[0].double(), -1)
            assert (ll.logprobs[i].double() - want).abs().max() <= 1e-4, i
    model_lp = torch.log_softmax(out.logits[0].double(), -1)
    assert (ll.logprobs[L].double() - model_lp).abs().max() <= 1e-5  # the last row is the model's own


def test_logit_lens_reads_out_only_what_is_asked_the_same(pair):
    _kind, _ref, lm = pair
    full = lens.logit_lens(lm, TEXT).logprobs
    p, i = lens.logit_lens(lm, TEXT).top(3, positions=[2, 9])  # chunked, without the full tensor
    v, j = full[:, [2, 9]].topk(3, dim=-1)
    assert torch.equal(i, j) and torch.allclose(p, v.exp(), atol=1e-6)
    nxt = [*IDS[1:], 0]
    want = full.gather(-1, torch.tensor(nxt).view(1, -1, 1).expand(full.shape[0], -1, 1))[..., 0].exp()
    assert torch.allclose(lens.logit_lens(lm, TEXT).prob_of(nxt), want)


def test_logit_lens_renormalises_each_row(pair):
    """Reusing the last stream's norm scale for every row (TransformerLens #1076) gives other
    numbers for the early rows: row 0 is not what that mistake would give."""
    kind, _ref, lm = pair
    ll = lens.logit_lens(lm, TEXT)
    cache = lens.run_with_cache(lm, TEXT)
    norm = lm.model.stack.norm
    x0, last = cache.resid_pre[0], cache.resid_post[-1]
    with torch.no_grad():
        if kind == "gpt2":
            scale = torch.sqrt(last.var(-1, unbiased=False, keepdim=True) + norm.eps)
            stale = (x0 - x0.mean(-1, keepdim=True)) / scale * norm.weight + norm.bias
        else:
            stale = x0 / torch.sqrt(last.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
        stale_lp = torch.log_softmax(lm.model.lm_head(stale), -1)
    assert (ll.logprobs[0] - stale_lp).abs().max() > 1e-2


def test_the_cache_holds_the_reference_streams(pair):
    _kind, ref, lm = pair
    out = _hidden(ref)
    cache = lens.run_with_cache(lm, TEXT)
    for i in range(len(out.hidden_states) - 1):
        assert (cache[f"blocks.{i}.hook_resid_pre"] - out.hidden_states[i][0]).abs().max() <= 1e-5
    assert (cache["logits"] - out.logits[0]).abs().max() <= 1e-5
    H = lm.n_heads
    assert cache["blocks.1.attn.hook_z"].shape == (len(IDS), H, lm.model.cfg.resolved_head_dim)
    p = cache["blocks.0.attn.hook_pattern"]
    assert p.shape == (H, len(IDS), len(IDS))
    assert torch.allclose(p.sum(-1), torch.ones(H, len(IDS)), atol=1e-5)
    for i in range(len(out.hidden_states) - 1):  # pre-LN: each sublayer adds to the stream
        assert torch.allclose(cache.resid_mid[i], cache.resid_pre[i] + cache.attn_out[i], atol=1e-5)
        assert torch.allclose(cache.resid_post[i], cache.resid_mid[i] + cache.mlp_out[i], atol=1e-5)
    with pytest.raises(KeyError, match=r"cache\.names"):
        cache["blocks.9.attn.hook_z"]


def _hand_zeroed(lm, layer: int, head: int):
    """A copy of the model with W_O's input columns of one head set to zero, by hand."""
    model = copy.deepcopy(lm.model)
    Dh = model.cfg.resolved_head_dim
    with torch.no_grad():
        model.stack.blocks[layer].attn.out_proj.weight[:, head * Dh:(head + 1) * Dh] = 0
    return model


def test_zeroing_a_head_equals_zeroing_its_columns_of_w_o(pair):
    _kind, _ref, lm = pair
    for layer, head in ((0, 1), (1, 3)):
        got = lens.ablate(lm, TEXT, heads=[(layer, head)])
        with torch.no_grad():
            want = _hand_zeroed(lm, layer, head)(torch.tensor([IDS])).logits[0]
        assert (got - want).abs().max() <= 1e-6
        assert (got - lens.run_with_cache(lm, TEXT).logits).abs().max() > 1e-4  # it did something


def test_grouped_query_ablation_touches_one_query_head(tmp_path_factory):
    _kind, _ref, lm = _open("llama_tied_gqa", tmp_path_factory)
    assert lm.model.cfg.resolved_kv_heads == 2 and lm.n_heads == 4  # heads 0 and 1 share one
    one = lens.ablate(lm, TEXT, heads=[(1, 0)])
    with torch.no_grad():
        want = _hand_zeroed(lm, 1, 0)(torch.tensor([IDS])).logits[0]
    assert (one - want).abs().max() <= 1e-6  # only head 0's slice of W_O's input is gone
    group = lens.ablate(lm, TEXT, heads=[(1, 0), (1, 1)])
    assert (one - group).abs().max() > 1e-4  # head 1, on the same key/value head, still works


@pytest.mark.parametrize("kind", ["llama", "gemma"])  # GPT-2's W_O has a bias that zeroed heads still add
def test_all_heads_of_a_layer_zeroed_is_the_layer_without_attention(kind, tmp_path_factory):
    kind, _ref, lm = _open(kind, tmp_path_factory)
    got = lens.ablate(lm, TEXT, heads=[(0, h) for h in range(lm.n_heads)])
    model = lm.model
    with torch.no_grad():  # the forward pass written out, block 0 without its attention sublayer
        x = model.tok_emb(torch.tensor([IDS]))
        if model.cfg.embed_scale:
            x = x * model.cfg.dim ** 0.5
        b0 = model.stack.blocks[0]
        x = x + b0.mlp(b0.norm2(x))
        x = model.stack.blocks[1](x, rope=model.rope).x
        want = model.lm_head(model.stack.norm(x))[0]
    assert (got - want).abs().max() <= 1e-5


def test_mean_ablation_replaces_the_head_by_its_mean(pair):
    _kind, _ref, lm = pair
    clean = lens.run_with_cache(lm, TEXT)
    mean = clean.z[0][:, 2].mean(0)  # (Dh,)
    model = copy.deepcopy(lm.model)
    Dh = model.cfg.resolved_head_dim
    out_proj = model.stack.blocks[0].attn.out_proj
    with torch.no_grad():  # W_O(z with head 2 = its mean) = W_O(z with head 2 zeroed) + W_O[:, h] mean
        shift = out_proj.weight[:, 2 * Dh:3 * Dh] @ mean
        out_proj.weight[:, 2 * Dh:3 * Dh] = 0
        if out_proj.bias is None:
            out_proj.bias = torch.nn.Parameter(shift.clone())
        else:
            out_proj.bias += shift
        want = model(torch.tensor([IDS])).logits[0]
    got = lens.ablate(lm, TEXT, heads=[(0, 2)], mode="mean")
    assert (got - want).abs().max() <= 1e-5


def test_head_effects_equal_single_ablations(pair):
    _kind, ref, lm = pair
    eff = lens.head_effects(lm, TEXT)
    for layer, head in ((0, 0), (1, 2)):
        logits = lens.ablate(lm, TEXT, heads=[(layer, head)]).double()
        loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(IDS[1:]))
        assert float(eff.values[layer, head]) == pytest.approx(float(loss), abs=1e-5)
    base = torch.nn.functional.cross_entropy(_hidden(ref).logits[0, :-1].double(), torch.tensor(IDS[1:]))
    assert eff.base == pytest.approx(float(base), abs=1e-5)
    by_answer = lens.head_effects(lm, TEXT, answer="w7", wrong="w8")
    logits = lens.ablate(lm, TEXT, heads=[(1, 1)])
    assert float(by_answer.values[1, 1]) == pytest.approx(float(logits[-1, 7] - logits[-1, 8]), abs=1e-5)


def test_patching_against_hooks_on_the_reference(tmp_path_factory):
    _kind, ref, lm = _open("gpt2", tmp_path_factory)
    p = lens.patch(lm, TEXT, CORRUPT, site="resid", answer="w7", wrong="w8")
    clean_h = _hidden(ref).hidden_states
    corrupt_ids = [int(w[1:]) for w in CORRUPT.split()]

    def ld(logits):
        return float(logits[0, -1, 7] - logits[0, -1, 8])

    with torch.no_grad():
        assert p.clean_diff == pytest.approx(ld(ref(torch.tensor([IDS])).logits), abs=1e-5)
        assert p.corrupt_diff == pytest.approx(ld(ref(torch.tensor([corrupt_ids])).logits), abs=1e-5)
        for layer, t in ((0, 7), (1, 7), (1, 8), (0, 2)):
            def put(mod, args, kwargs, layer=layer, t=t):
                h = args[0].clone()
                h[:, t] = clean_h[layer][:, t]
                return (h, *args[1:]), kwargs
            handle = ref.transformer.h[layer].register_forward_pre_hook(put, with_kwargs=True)
            try:
                want = ld(ref(torch.tensor([corrupt_ids])).logits)
            finally:
                handle.remove()
            assert float(p.raw[layer, t]) == pytest.approx(want, abs=1e-4)
            assert float(p.values[layer, t]) == pytest.approx(
                (want - p.corrupt_diff) / (p.clean_diff - p.corrupt_diff), abs=1e-4)
    # the positions before the changed token carry nothing of it: patching them restores nothing
    assert p.values[:, :7].abs().max() <= 1e-4

    heads = lens.patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8")
    clean_z = {}
    hooks = [ref.transformer.h[i].attn.c_proj.register_forward_pre_hook(
        lambda mod, args, i=i: clean_z.__setitem__(i, args[0].clone())) for i in range(2)]
    with torch.no_grad():
        ref(torch.tensor([IDS]))
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for layer, head in ((0, 1), (1, 3)):
            def swap(mod, args, layer=layer, head=head):
                z = args[0].clone()
                z[..., head * 16:(head + 1) * 16] = clean_z[layer][..., head * 16:(head + 1) * 16]
                return (z,)
            handle = ref.transformer.h[layer].attn.c_proj.register_forward_pre_hook(swap)
            try:
                want = ld(ref(torch.tensor([corrupt_ids])).logits)
            finally:
                handle.remove()
            assert float(heads.raw[layer, head]) == pytest.approx(want, abs=1e-4)


def test_patching_clean_into_clean_and_the_whole_stream(pair):
    _kind, _ref, lm = pair
    same = lens.patch(lm, TEXT, TEXT, site="resid", answer="w7", wrong="w8")
    assert torch.allclose(same.raw, torch.full_like(same.raw, same.clean_diff), atol=1e-5)
    clean = lens.run_with_cache(lm, TEXT)
    whole = clean.resid_pre[0][None]
    with torch.no_grad(), hooked(lm.model, edits=Edits(resid_pre={0: lambda x: whole})):
        out, _ = forward(lm.model, torch.tensor([[int(w[1:]) for w in CORRUPT.split()]]))
    assert (out[0] - clean.logits).abs().max() <= 1e-5


def test_attribution_sums_to_the_logit_difference_and_each_head_is_z_times_w_o(pair):
    _kind, ref, lm = pair
    att = lens.attribute(lm, TEXT, "w7", "w8")
    logits = _hidden(ref).logits[0, -1].double()
    assert att.total == pytest.approx(float(logits[7] - logits[8]), abs=1e-5)
    assert float(att.values.double().sum()) == pytest.approx(att.total, abs=1e-4)
    assert len(att.names) == 1 + 2 * (lm.n_heads + 2) + 1


def test_attribution_of_each_head_is_its_z_times_w_o_by_hand(tmp_path_factory):
    _kind, ref, lm = _open("gpt2", tmp_path_factory)
    att = lens.attribute(lm, TEXT, "w7", "w8")
    # GPT-2 by hand from transformers: z from a hook on c_proj, W_O from c_proj (Conv1D: (in, out)),
    # the final LayerNorm's scale from its own input
    z, stream = {}, {}
    hooks = [ref.transformer.h[i].attn.c_proj.register_forward_pre_hook(
        lambda mod, args, i=i: z.__setitem__(i, args[0][0, -1].double())) for i in range(2)]
    hooks.append(ref.transformer.ln_f.register_forward_pre_hook(
        lambda mod, args: stream.__setitem__("r", args[0][0, -1].double())))
    with torch.no_grad():
        ref(torch.tensor([IDS]))
    for h in hooks:
        h.remove()
    torch.set_grad_enabled(False)  # the reference's weights below are plain numbers
    ln = ref.transformer.ln_f
    r = stream["r"]
    s = torch.sqrt(r.var(unbiased=False) + ln.eps)
    w_u = ref.lm_head.weight.double()
    d = (w_u[7] - w_u[8]) * ln.weight.double() / s
    for layer in range(2):
        w_o = ref.transformer.h[layer].attn.c_proj.weight.double()  # (H·Dh, dim)
        for head in range(4):
            c = z[layer][head * 16:(head + 1) * 16] @ w_o[head * 16:(head + 1) * 16]
            assert float(att.heads[layer, head]) == pytest.approx(float((c - c.mean()) @ d), abs=1e-5)
    torch.set_grad_enabled(True)


def test_bad_requests_are_one_line_input_errors(pair):
    _kind, _ref, lm = pair
    with pytest.raises(InputError, match=r"head 2\.7 is not in .* 2 layers \(0-1\) of 4 heads \(0-3\)"):
        lens.ablate(lm, TEXT, heads=[(2, 7)])
    with pytest.raises(InputError, match="same number of tokens"):
        lens.patch(lm, TEXT, "w1 w2", answer="w7", wrong="w8")
    with pytest.raises(InputError, match="one token"):
        lens.attribute(lm, TEXT, "w7 w8")
    with pytest.raises(InputError, match="temperature"):
        lens.next_token(lm, TEXT, temperature=0)
    with pytest.raises(InputError, match="mode"):
        lens.ablate(lm, TEXT, heads=[(0, 0)], mode="noise")
    with pytest.raises(InputError, match=r"LAYER\.HEAD"):
        lens.parse_heads("3")
    assert lens.parse_heads("0.1, 1.3") == [(0, 1), (1, 3)]


def test_query_key_rows_equal_transformers_attention(tmp_path_factory):
    _kind, ref, lm = _open("llama_tied_gqa", tmp_path_factory)  # RoPE, 4 query heads over 2 key heads
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        att = ref(torch.tensor([IDS]), output_attentions=True).attentions
    for layer, head, query in ((0, 3, 9), (1, 0, 4), (1, 2, -1)):
        qk = lens.query_key(lm, TEXT, layer, head, query)
        row = att[layer][0, head, query % len(IDS), : (query % len(IDS)) + 1]
        assert (qk.weights - row).abs().max() <= 1e-5
        assert torch.allclose(qk.scaled, qk.k.double().float() @ qk.q / 16 ** 0.5, atol=1e-5)
        assert len(qk.tokens) == (query % len(IDS)) + 1  # causal: keys up to the query
    with pytest.raises(InputError, match="query must be a token position"):
        lens.query_key(lm, TEXT, 0, 0, 50)


def test_a_cache_is_read_as_the_text_would_be(pair):
    _kind, _ref, lm = pair
    cache = lens.run_with_cache(lm, TEXT)
    assert torch.allclose(lens.next_token(lm, cache).logits, lens.next_token(lm, TEXT).logits, atol=1e-5)
    assert torch.allclose(lens.logit_lens(lm, cache).logprobs, lens.logit_lens(lm, TEXT).logprobs, atol=1e-5)
    a, b = lens.attribute(lm, cache, "w7", "w8"), lens.attribute(lm, TEXT, "w7", "w8")
    assert a.names == b.names and torch.allclose(a.values, b.values, atol=1e-5)


def test_text_rollout_multiplies_transformers_attention_with_the_residual(tmp_path_factory):
    _kind, ref, lm = _open("llama", tmp_path_factory)
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        att = ref(torch.tensor([IDS]), output_attentions=True).attentions
    T = len(IDS)
    want = torch.eye(T, dtype=torch.float64)
    for a in att:  # Abnar & Zuidema: (A + I) / 2 with the heads averaged, rows renormalised
        m = 0.5 * a[0].double().mean(0) + 0.5 * torch.eye(T, dtype=torch.float64)
        want = (m / m.sum(-1, keepdim=True)) @ want
    tokens, got = lens.text_rollout(lm, TEXT)
    assert tokens == TEXT.split() and torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(T), atol=1e-5)
