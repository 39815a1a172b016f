"""Attribution patching (qkv/lens/atp.py) against references written here: transformers' own
model with hooks written by hand, its gradient taken by torch.autograd in float64, and the
slope of each patch measured by finite differences on qkv's model in float64; the agreement
measures against scipy's Spearman correlation and a recall counted by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_decoder_folder

import qkv
from qkv import lens
from qkv.errors import InputError
from qkv.lens.hooks import Edits, Recorded, forward, hooked

transformers = pytest.importorskip("transformers", reason="reference package transformers not "
                                   "installed: pip install 'qkv[reference]'")

TEXT = "w3 w17 w42 w5 w88 w9 w1 w60 w17 w42"
CORRUPT = "w3 w17 w42 w5 w88 w9 w1 w61 w17 w42"
A, B = 7, 8  # the answer w7 and the wrong answer w8

_OPENED: dict = {}


def _open(kind: str, tmp_path_factory):
    if kind not in _OPENED:
        folder = tmp_path_factory.mktemp(kind)
        ref = hf_decoder_folder(kind, folder)
        _OPENED[kind] = (ref, qkv.load(str(folder)))
    return _OPENED[kind]


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([[int(w[1:]) for w in text.split()]])


def _out_projs(ref, kind: str) -> list:
    if kind == "gpt2":
        return [b.attn.c_proj for b in ref.transformer.h]
    return [b.self_attn.o_proj for b in ref.model.layers]


@pytest.mark.parametrize("kind", ["gpt2", "llama_tied_gqa"])
def test_each_head_is_clean_minus_corrupt_output_times_the_references_gradient(kind, tmp_path_factory):
    """delta[l, h] = Σ_t,d (z_clean - z_corrupt)[l, t, h, d] · ∂LD/∂z[l, t, h, d] at the corrupt
    run, with z the input of W_O and LD = logit(w7) - logit(w8) at the last position: computed
    on transformers' model in float64 with hooks and torch.autograd written here."""
    ref, lm = _open(kind, tmp_path_factory)
    est = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8")
    ref64 = copy.deepcopy(ref).double()
    projs = _out_projs(ref64, kind)
    L, H = len(projs), ref64.config.num_attention_heads
    seen: dict[int, torch.Tensor] = {}
    hooks = [p.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
             for i, p in enumerate(projs)]
    try:
        with torch.no_grad():
            ref64(_ids(TEXT))
        clean = {i: t.clone() for i, t in seen.items()}
        logits = ref64(_ids(CORRUPT)).logits
        ld = logits[0, -1, A] - logits[0, -1, B]
        grads = torch.autograd.grad(ld, [seen[i] for i in range(L)])
    finally:
        for h in hooks:
            h.remove()
    Dh = ref64.config.hidden_size // H
    want = torch.stack([((clean[i] - seen[i].detach()) * grads[i])[0].view(-1, H, Dh).sum((0, 2))
                        for i in range(L)])
    assert est.delta.shape == (L, H)
    torch.testing.assert_close(est.delta.double(), want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        clean_ld = ref64(_ids(TEXT)).logits[0, -1]
    assert est.clean_diff == pytest.approx(float(clean_ld[A] - clean_ld[B]), abs=1e-4)
    assert est.corrupt_diff == pytest.approx(float(ld.detach()), abs=1e-4)
    torch.testing.assert_close(est.values, est.delta / (est.clean_diff - est.corrupt_diff))


def test_grad_drop_is_the_mean_magnitude_with_each_layers_gradient_dropped(tmp_path_factory):
    """AtP*'s GradDrop on the 2-layer GPT-2: a head of layer 1 keeps |AtP| (dropping layer 0 does not
    touch it; dropping layer 1 gives it no gradient and is left out); a head of layer 0 gets
    |(z_clean - z_corrupt) · ∂LD/∂z| with layer 1's attention and MLP outputs passing no gradient
    back, by hooks on transformers' model in float64 written here."""
    ref, lm = _open("gpt2", tmp_path_factory)
    est = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8", grad_drop=True)
    plain = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8")
    assert est.grad_drop is not None and plain.grad_drop is None
    torch.testing.assert_close(est.values, plain.values)  # the signed estimate is unchanged
    span = abs(est.clean_diff - est.corrupt_diff)
    torch.testing.assert_close(est.grad_drop[1], plain.delta[1].abs() / span, rtol=1e-4, atol=1e-6)
    ref64 = copy.deepcopy(ref).double()
    block = ref64.transformer.h[1]
    seen: dict[int, torch.Tensor] = {}
    hooks = [p.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
             for i, p in enumerate(_out_projs(ref64, "gpt2"))]
    with torch.no_grad():
        ref64(_ids(TEXT))
    clean = seen[0].clone()

    def zero_grad(mod, args, out):
        t = out[0] if isinstance(out, tuple) else out
        t.register_hook(torch.zeros_like)

    hooks += [block.attn.register_forward_hook(zero_grad), block.mlp.register_forward_hook(zero_grad)]
    try:
        logits = ref64(_ids(CORRUPT)).logits
        (g,) = torch.autograd.grad(logits[0, -1, A] - logits[0, -1, B], [seen[0]])
    finally:
        for h in hooks:
            h.remove()
    H = ref64.config.num_attention_heads
    want = ((clean - seen[0].detach()) * g)[0].view(-1, H, ref64.config.hidden_size // H).sum((0, 2)).abs()
    torch.testing.assert_close(est.grad_drop[0].double(), want / span, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(want, plain.delta[0].abs().double(), rtol=1e-2)  # dropping changed something


def _ld_with(lm, edits: Edits) -> float:
    with hooked(lm.model, edits=edits), torch.no_grad():
        out, _ = forward(lm.model, _ids(CORRUPT))
    return float(out[0, -1, A] - out[0, -1, B])


def _record(lm, text: str) -> Recorded:
    rec = Recorded()
    with hooked(lm.model, record=rec), torch.no_grad():
        forward(lm.model, _ids(text))
    return rec


@pytest.mark.parametrize("site", ["head", "resid"])
def test_each_estimate_is_the_slope_of_its_patch(site, tmp_path_factory):
    """Patching a cell part-way, a_corrupt + ε (a_clean - a_corrupt), changes LD at the rate the
    estimate gives: central differences on qkv's model in float64 (ε = 1e-4), every cell."""
    _ref, lm = _open("llama", tmp_path_factory)
    lm64 = copy.copy(lm)
    lm64.model = copy.deepcopy(lm.model).double().requires_grad_(False)  # weights without gradients too
    est = lens.attribution_patch(lm64, TEXT, CORRUPT, site=site, answer="w7", wrong="w8")
    clean, corrupt = _record(lm64, TEXT), _record(lm64, CORRUPT)
    eps = 1e-4
    for layer in range(est.delta.shape[0]):
        for col in range(est.delta.shape[1]):
            def edits(sign: float, layer: int = layer, col: int = col) -> Edits:
                if site == "head":
                    zc, zk = clean.z[layer][0, :, col], corrupt.z[layer][0, :, col]

                    def edit(z):
                        z = z.clone()
                        z[0, :, col] = zk + sign * eps * (zc - zk)
                        return z
                    return Edits(z={layer: edit})
                rc, rk = clean.resid_pre[layer][0, col], corrupt.resid_pre[layer][0, col]

                def edit_r(x):
                    x = x.clone()
                    x[0, col] = rk + sign * eps * (rc - rk)
                    return x
                return Edits(resid_pre={layer: edit_r})
            slope = (_ld_with(lm64, edits(1.0)) - _ld_with(lm64, edits(-1.0))) / (2 * eps)
            assert float(est.delta[layer, col]) == pytest.approx(slope, rel=1e-4, abs=1e-6), (layer, col)


def test_agreement_is_spearman_and_top_k_recall():
    from scipy.stats import spearmanr

    g = torch.Generator().manual_seed(0)
    exact = torch.randn(4, 6, generator=g)
    noisy = exact + 0.3 * torch.randn(4, 6, generator=g)
    a = lens.agreement(noisy, exact, k=5)
    assert a.spearman == pytest.approx(spearmanr(noisy.flatten(), exact.flatten()).statistic, abs=1e-9)
    top = set(exact.flatten().abs().topk(5).indices.tolist())
    assert a.recall == len(top & set(noisy.flatten().abs().topk(5).indices.tolist())) / 5 and a.k == 5
    assert lens.agreement(-exact, exact).spearman == pytest.approx(-1.0)
    assert lens.agreement(exact * 3, exact).recall == 1.0
    with pytest.raises(InputError, match="cannot be compared"):
        lens.agreement(exact, exact[:2])


def test_what_it_cannot_estimate_is_one_line(tmp_path_factory):
    _ref, lm = _open("gpt2", tmp_path_factory)
    with pytest.raises(InputError, match="same number of tokens"):
        lens.attribution_patch(lm, TEXT, "w1 w2", answer="w7", wrong="w8")
    with pytest.raises(InputError, match="site must be"):
        lens.attribution_patch(lm, TEXT, CORRUPT, site="mlp")
    with pytest.raises(InputError, match="both predict"):
        lens.attribution_patch(lm, TEXT, CORRUPT, answer="w7", wrong="w7")
    q8 = copy.deepcopy(lm).quantize("int8")
    with pytest.raises(InputError, match="float weights"):
        lens.attribution_patch(q8, TEXT, CORRUPT, answer="w7", wrong="w8")
