"""A forward pass in pieces (qkv.lens.hooks.forward_steps), for a server whose token streams must
not wait for a whole lens computation (issue 52): the same numbers as transformers' model and as
the model's own forward, and nothing of it on the model between two pieces."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_bert_config, hf_decoder_folder, save_hf_folder

import qkv
from qkv import lens
from qkv.lens import predict
from qkv.lens.hooks import Recorded, blocks, finish, forward, forward_steps, hooked


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("kind", ["gpt2", "llama_tied_gqa", "gemma"])
def test_a_forward_in_pieces_is_transformers_and_leaves_no_hook_between_pieces(kind, tmp_path):
    ref = hf_decoder_folder(kind, tmp_path / kind)
    lm = qkv.load(str(tmp_path / kind))
    ids = torch.tensor([[5, 9, 2, 7, 7, 11, 3]])
    ref.set_attn_implementation("eager")  # the one that returns its weights
    with torch.no_grad():
        want = ref(ids, output_attentions=True)
    assert len(want.attentions) == len(blocks(lm.model))
    before = _hooks(lm.model)
    rec = Recorded()
    steps = forward_steps(lm.model, ids, weights=True, record=rec)
    pieces = 0
    with torch.inference_mode():
        try:
            while True:
                next(steps)
                pieces += 1
                assert _hooks(lm.model) == before  # between pieces: the model as it was
        except StopIteration as done:
            logits, weights = done.value
    assert pieces == len(blocks(lm.model)) + 1
    torch.testing.assert_close(logits, want.logits, rtol=1e-4, atol=1e-5)
    for w, theirs in zip(weights, want.attentions, strict=True):
        torch.testing.assert_close(w, theirs, rtol=1e-4, atol=1e-6)
    with torch.inference_mode():  # and bit for bit the model's own forward with the same hooks
        whole = Recorded()
        with hooked(lm.model, record=whole):
            out, ws = forward(lm.model, ids, weights=True)
    assert torch.equal(out, logits) and all(torch.equal(a, b) for a, b in zip(ws, weights, strict=True))
    for name in ("resid_pre", "resid_mid", "resid_post", "z", "attn_out", "mlp_out"):
        got, exp = getattr(rec, name), getattr(whole, name)
        assert sorted(got) == sorted(exp) and all(torch.equal(got[i], exp[i]) for i in exp), name


def test_an_encoder_in_pieces_is_its_forward_and_a_knockout_in_pieces_is_the_edited_weights(tmp_path):
    import transformers

    torch.manual_seed(0)
    ref = transformers.BertModel(hf_bert_config()).eval()
    save_hf_folder(ref, tmp_path / "bert")
    enc = qkv.load(str(tmp_path / "bert"))
    ids = torch.tensor([enc.tokenizer.encode("w3 w4 w5 w6")])
    with torch.no_grad():
        want = ref(ids).last_hidden_state
    with torch.inference_mode():
        hidden, _ = finish(forward_steps(enc.model, ids))
    torch.testing.assert_close(hidden, want, rtol=1e-4, atol=1e-5)
    import copy

    edited = copy.deepcopy(enc.model)  # head 2 of layer 1 knocked out by hand: its W_O columns zero
    with torch.no_grad():
        edited.stack.blocks[1].attn.out_proj.weight[:, 32:48] = 0
        expected = edited(ids).hidden[0]
    got = finish(lens.causal.ablate_steps(enc, ids[0].tolist(), [(1, 2)]))
    assert (got - expected).abs().max() <= 1e-6


def test_the_logit_lens_in_pieces_is_float64_math(tmp_path):
    """top_steps reads the cells out a chunk at a time: the same top tokens and probabilities as
    the whole read-out, and as softmax(head(norm(stream))) in float64."""
    hf_decoder_folder("llama", tmp_path / "llama")
    lm = qkv.load(str(tmp_path / "llama"))
    text = [5, 9, 2, 7, 7, 11, 3, 4, 8, 6] * 6  # 60 tokens x (layers + 1) rows: more than one chunk
    cache = lens.run_with_cache(lm, text)
    ll = lens.logit_lens(lm, cache)
    probs, top = finish(ll.top_steps(2))
    whole_p, whole_top = ll.top(2)
    assert torch.equal(top, whole_top)
    torch.testing.assert_close(probs, whole_p, rtol=1e-5, atol=1e-7)
    w = lm.model.lm_head.weight.double()
    p64 = torch.softmax(ll.normed.double() @ w.T, -1)  # (L + 1, T, V)
    v, i = p64.topk(2, -1)
    assert torch.equal(i, top)
    torch.testing.assert_close(probs.double(), v, rtol=1e-4, atol=1e-6)
    # the vocabulary a few tokens at a time (an online softmax over 7-token slices): the same
    # tokens and probabilities
    V = w.shape[0]
    cells = ll.normed.shape[0] * ll.normed.shape[1]
    assert cells >= predict.EXACT_FROM  # every cell at once, the vocabulary in slices
    sliced = ll.top_steps(3, logits=cells * 7)
    n = 0
    while True:
        try:
            next(sliced)
            n += 1
        except StopIteration as done:
            sp, st = done.value
            break
    assert n == -(-V // 7)  # one piece per slice
    v3, i3 = p64.topk(3, -1)
    assert torch.equal(st, i3)
    torch.testing.assert_close(sp.double(), v3, rtol=1e-4, atol=1e-6)
