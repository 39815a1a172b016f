"""Edge attribution (qkv/lens/edges.py) against references written here: each edge's estimate is
the slope of its patch, measured by central differences on transformers' GPT-2 in float64 with
the edge moved by hooks written here (the receiver alone reads the sender's change); the edges
out of a sender sum to the node estimate that test_atp.py checks against transformers; the
planted circuit's three edges are the strongest."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_decoder_folder, word_ids

import qkv
from qkv import lens
from qkv.errors import InputError

transformers = pytest.importorskip("transformers", reason="reference package transformers not "
                                   "installed: pip install 'qkv[reference]'")

TEXT = "w3 w17 w42 w5 w88 w9 w1 w60 w17 w42"
CORRUPT = "w3 w17 w42 w5 w88 w9 w1 w61 w17 w42"
A, B = 7, 8

_OPENED: dict = {}


def _open(kind: str, tmp_path_factory):
    if kind not in _OPENED:
        folder = tmp_path_factory.mktemp(kind)
        _OPENED[kind] = (hf_decoder_folder(kind, folder), qkv.load(str(folder)))
    return _OPENED[kind]




def _gpt2_writes(ref64, text: str) -> dict[str, torch.Tensor]:
    """What each sender writes into GPT-2's stream on ``text`` (T, dim): the embedding (the first
    block's input), each head's z_h · W_O rows of h (c_proj is a Conv1D: weight (in, out)), each MLP."""
    seen: dict[str, torch.Tensor] = {}
    H = ref64.config.num_attention_heads
    Dh = ref64.config.hidden_size // H
    hooks = [ref64.transformer.h[0].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("embed", a[0][0].clone()))]
    for layer, block in enumerate(ref64.transformer.h):
        def heads(m, a, layer=layer):
            W = m.weight  # (H·Dh, dim)
            for h in range(H):
                seen[f"a{layer}.{h}"] = a[0][0, :, h * Dh:(h + 1) * Dh] @ W[h * Dh:(h + 1) * Dh]
        hooks += [block.attn.c_proj.register_forward_pre_hook(heads),
                  block.mlp.register_forward_hook(lambda m, a, out, layer=layer: seen.__setitem__(
                      f"m{layer}", out[0].clone()))]
    try:
        with torch.no_grad():
            ref64(word_ids(text))
    finally:
        for h in hooks:
            h.remove()
    return seen


def _gpt2_metric_with(ref64, receiver: str, add: torch.Tensor) -> float:
    """LD on CORRUPT with ``add`` (T, dim) added to the input of ``receiver`` only."""
    H = ref64.config.num_attention_heads
    dim = ref64.config.hidden_size
    Dh = dim // H
    hooks = []
    if receiver == "logits":
        hooks.append(ref64.transformer.ln_f.register_forward_pre_hook(lambda m, a: (a[0] + add,)))
    elif receiver.startswith("m"):
        block = ref64.transformer.h[int(receiver[1:])]
        hooks.append(block.ln_2.register_forward_pre_hook(lambda m, a: (a[0] + add,)))  # the MLP's read only
    else:
        layer, h, part = receiver[1:].split(".")
        block = ref64.transformer.h[int(layer)]
        base = {"q": 0, "k": dim, "v": 2 * dim}[part] + int(h) * Dh
        box: dict[str, torch.Tensor] = {}
        hooks.append(block.ln_1.register_forward_pre_hook(lambda m, a: box.__setitem__("x", a[0])))

        def moved(m, a, out):
            ln = block.ln_1  # written out: calling the modules would re-enter these hooks
            h = torch.nn.functional.layer_norm(box["x"] + add, (dim,), ln.weight, ln.bias, ln.eps)
            alt = h @ m.weight + m.bias  # GPT-2's Conv1D: x W + b
            out = out.clone()
            out[..., base:base + Dh] = alt[..., base:base + Dh]
            return out
        hooks.append(block.attn.c_attn.register_forward_hook(moved))
    try:
        with torch.no_grad():
            logits = ref64(word_ids(CORRUPT)).logits
    finally:
        for h in hooks:
            h.remove()
    return float(logits[0, -1, A] - logits[0, -1, B])


def test_every_edge_is_the_slope_of_its_patch(tmp_path_factory):
    """edge(u -> r): the derivative of LD as r alone reads the corrupt stream plus ε times u's
    clean-minus-corrupt write, by central differences (ε = 1e-5) on transformers' GPT-2 in float64
    with hooks written here, for every edge of the model; edges that would run backwards are NaN."""
    ref, lm = _open("gpt2", tmp_path_factory)
    e = lens.edge_attribution(lm, TEXT, CORRUPT, answer="w7", wrong="w8")
    ref64 = copy.deepcopy(ref).double()
    clean, corrupt = _gpt2_writes(ref64, TEXT), _gpt2_writes(ref64, CORRUPT)
    assert set(e.senders) == set(clean)
    eps = 1e-5
    checked = 0
    for s, sender in enumerate(e.senders):
        d = clean[sender] - corrupt[sender]
        for r, receiver in enumerate(e.receivers):
            got = float(e.delta[s, r])
            if got != got:  # no such edge: the sender runs at or after the receiver
                s_layer = -1 if sender == "embed" else int(sender[1:].split(".")[0])
                r_layer = 99 if receiver == "logits" else int(receiver[1:].split(".")[0])
                assert s_layer >= r_layer and not (sender.startswith("a") and receiver.startswith("m")
                                                   and s_layer == r_layer)
                continue
            up, down = (_gpt2_metric_with(ref64, receiver, sign * eps * d) for sign in (1.0, -1.0))
            slope = up - down
            assert got == pytest.approx(slope / (2 * eps), rel=1e-3, abs=1e-5), (sender, receiver)
            checked += 1
    assert checked > 100 and e.ig_steps == 0


@pytest.mark.parametrize("kind", ["gpt2", "llama_tied_gqa"])
@pytest.mark.parametrize("steps", [0, 2])
def test_the_edges_out_of_a_sender_sum_to_its_node_estimate(kind, steps, tmp_path_factory):
    """The stream's gradient is the sum of its readers' (each head's query, key and value rows, the
    MLP, the output): so a head's edges sum to attribution patching's estimate of the head, and the
    embedding's to the first layer's stream estimate summed over positions (EAP-IG's to IG's)."""
    _ref, lm = _open(kind, tmp_path_factory)
    e = lens.edge_attribution(lm, TEXT, CORRUPT, answer="w7", wrong="w8", ig_steps=steps)
    heads = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8", ig_steps=steps)
    resid = lens.attribution_patch(lm, TEXT, CORRUPT, site="resid", answer="w7", wrong="w8", ig_steps=steps)
    L, H = heads.values.shape
    sent = e.sent()
    got = torch.stack([sent[[e.senders.index(f"a{layer}.{h}") for h in range(H)]] for layer in range(L)])
    torch.testing.assert_close(got, heads.values, rtol=1e-3, atol=1e-4)
    assert float(sent[0]) == pytest.approx(float(resid.values[0].sum()), rel=1e-3, abs=1e-4)
    assert e.clean_diff == pytest.approx(heads.clean_diff)
    assert e.corrupt_diff == pytest.approx(heads.corrupt_diff)


def test_the_planted_circuits_edges_are_the_strongest():
    """The hand-set induction circuit is three edges: the embedding into the previous-token head's
    values (it copies the token before), that head into the induction head's keys (K-composition,
    Elhage et al. 2021), the induction head into the output. EAP and EAP-IG rank them first."""
    from qkv.lens import planted

    p = planted.induction(seed=0)
    want = {("embed", "a0.0.v"), ("a0.0", "a1.0.k"), ("a1.0", "logits")}
    for steps in (0, 8):
        e = lens.edge_attribution(p, p.clean, p.corrupt, answer=p.answer, wrong=p.wrong, ig_steps=steps)
        top = e.top(3)
        assert {(t.sender, t.receiver) for t in top} == want
        assert all(t.value > 0.5 for t in top) and abs(e.top(4)[-1].value) < 0.05


def test_what_it_cannot_estimate_is_one_line(tmp_path_factory):
    _ref, lm = _open("gpt2", tmp_path_factory)
    with pytest.raises(InputError, match="same number of tokens"):
        lens.edge_attribution(lm, TEXT, "w1 w2", answer="w7", wrong="w8")
    with pytest.raises(InputError, match="ig_steps"):
        lens.edge_attribution(lm, TEXT, CORRUPT, answer="w7", wrong="w8", ig_steps=-2)
    q8 = copy.deepcopy(lm).quantize("int8")
    with pytest.raises(InputError, match="float weights"):
        lens.edge_attribution(q8, TEXT, CORRUPT, answer="w7", wrong="w8")
