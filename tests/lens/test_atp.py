"""Attribution patching (qkv/lens/atp.py) against references written here: transformers' own
model with hooks written by hand, its gradient taken by torch.autograd in float64, and the
slope of each patch measured by finite differences on qkv's model in float64; the agreement
measures against scipy's Spearman correlation and a recall counted by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_decoder_folder, word_ids

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




def _out_projs(ref, kind: str) -> list:
    if kind == "gpt2":
        return [b.attn.c_proj for b in ref.transformer.h]
    return [b.self_attn.o_proj for b in ref.model.layers]


def _seeing_z(projs: list) -> tuple[dict[int, torch.Tensor], list]:
    """Hooks keeping each layer's z, the input of its W_O, in the graph: (seen, the handles)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [p.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
             for i, p in enumerate(projs)]
    return seen, hooks


def _metric(name: str, last: torch.Tensor) -> torch.Tensor:
    """The metric written out: the logit difference, p(w7), or -log p(w7), from (..., V) logits."""
    if name == "diff":
        return last[..., A] - last[..., B]
    p = torch.softmax(last, dim=-1)[..., A]
    return p if name == "prob" else -torch.log(p)


@pytest.mark.parametrize(("kind", "metric"), [("gpt2", "diff"), ("llama_tied_gqa", "diff"), ("gpt2", "prob"),
                                              ("llama_tied_gqa", "loss")])
def test_each_head_is_clean_minus_corrupt_output_times_the_references_gradient(kind, metric,
                                                                               tmp_path_factory):
    """delta[l, h] = Σ_t,d (z_clean - z_corrupt)[l, t, h, d] · ∂M/∂z[l, t, h, d] at the corrupt
    run, with z the input of W_O and M = logit(w7) - logit(w8) at the last position (or p(w7), or
    -log p(w7)): computed on transformers' model in float64 with hooks and torch.autograd written
    here."""
    ref, lm = _open(kind, tmp_path_factory)
    est = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8", metric=metric)
    assert est.metric == metric
    ref64 = copy.deepcopy(ref).double()
    projs = _out_projs(ref64, kind)
    L, H = len(projs), ref64.config.num_attention_heads
    seen, hooks = _seeing_z(projs)
    try:
        with torch.no_grad():
            ref64(word_ids(TEXT))
        clean = {i: t.clone() for i, t in seen.items()}
        logits = ref64(word_ids(CORRUPT)).logits
        ld = _metric(metric, logits[0, -1])
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
        clean_ld = ref64(word_ids(TEXT)).logits[0, -1]
    assert est.clean_diff == pytest.approx(float(_metric(metric, clean_ld)), abs=1e-4)
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
    seen, hooks = _seeing_z(_out_projs(ref64, "gpt2"))
    with torch.no_grad():
        ref64(word_ids(TEXT))
    clean = seen[0].clone()

    def zero_grad(mod, args, out):
        t = out[0] if isinstance(out, tuple) else out
        t.register_hook(torch.zeros_like)

    hooks += [block.attn.register_forward_hook(zero_grad), block.mlp.register_forward_hook(zero_grad)]
    try:
        logits = ref64(word_ids(CORRUPT)).logits
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
        out, _ = forward(lm.model, word_ids(CORRUPT))
    return float(out[0, -1, A] - out[0, -1, B])


def _record(lm, text: str) -> Recorded:
    rec = Recorded()
    with hooked(lm.model, record=rec), torch.no_grad():
        forward(lm.model, word_ids(text))
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


# --------------------------------------------------------------------------- a head's queries, keys, values


def _gpt2_slice(part: str, h: int, dim: int, Dh: int) -> slice:
    """GPT-2's c_attn output is [q | k | v], each H heads of Dh side by side."""
    base = {"query": 0, "key": dim, "value": 2 * dim}[part]
    return slice(base + h * Dh, base + (h + 1) * Dh)


def _part_module(ref64, kind: str, part: str, layer: int, h: int):
    """The projection whose output holds head h's ``part`` and the slice of it (Llama: queries
    only, a key/value head being shared by a group; RoPE comes after q_proj, per position)."""
    H = ref64.config.num_attention_heads
    Dh = ref64.config.hidden_size // H
    if kind == "gpt2":
        return ref64.transformer.h[layer].attn.c_attn, _gpt2_slice(part, h, ref64.config.hidden_size, Dh)
    return ref64.model.layers[layer].self_attn.q_proj, slice(h * Dh, (h + 1) * Dh)


def _part_seen(ref64, kind: str, part: str, layer: int, h: int, text: str) -> torch.Tensor:
    """Head h's ``part`` of ``layer`` as the reference computes it on ``text``."""
    mod, sl = _part_module(ref64, kind, part, layer, h)
    box: dict[str, torch.Tensor] = {}
    handle = mod.register_forward_hook(lambda m, args, out: box.__setitem__("seen", out[..., sl].clone()))
    try:
        with torch.no_grad():
            ref64(word_ids(text))
    finally:
        handle.remove()
    return box["seen"]


def _part_patched(ref64, kind: str, part: str, layer: int, h: int, put: torch.Tensor, metric: str = "diff"
                  ) -> float:
    """The reference's metric on CORRUPT with head h's ``part`` of ``layer`` replaced by ``put``."""
    mod, sl = _part_module(ref64, kind, part, layer, h)

    def hook(m, args, out):
        out = out.clone()
        out[..., sl] = put
        return out

    handle = mod.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = ref64(word_ids(CORRUPT)).logits
    finally:
        handle.remove()
    return float(_metric(metric, logits[0, -1]))


@pytest.mark.parametrize(("kind", "part"), [("gpt2", "key"), ("gpt2", "value"), ("llama_tied_gqa", "query")])
def test_patching_a_heads_query_key_or_value_against_transformers_hooks(kind, part, tmp_path_factory):
    """patch(site=query/key/value): head h's queries (keys, values) at every position taken from
    the clean run, the rest of the corrupt run as it was: transformers' model in float64 with
    that slice of its projection's output replaced by a hook written here (Llama: the queries
    before RoPE, which rotates each position alike in both runs)."""
    ref, lm = _open(kind, tmp_path_factory)
    got = lens.patch(lm, TEXT, CORRUPT, site=part, answer="w7", wrong="w8", metric="prob")
    ref64 = copy.deepcopy(ref).double()
    L, H = got.values.shape
    with torch.no_grad():
        lo = float(_metric("prob", ref64(word_ids(CORRUPT)).logits[0, -1]))
        hi = float(_metric("prob", ref64(word_ids(TEXT)).logits[0, -1]))
    assert got.corrupt_diff == pytest.approx(lo, abs=1e-5) and got.clean_diff == pytest.approx(hi, abs=1e-5)
    want = torch.empty(L, H, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            clean = _part_seen(ref64, kind, part, layer, h, TEXT)
            want[layer, h] = (_part_patched(ref64, kind, part, layer, h, clean, "prob") - lo) / (hi - lo)
    torch.testing.assert_close(got.values.double(), want, rtol=1e-3, atol=1e-4)
    assert want.abs().max() > 0.05  # the patches move the answer


@pytest.mark.parametrize("part", ["query", "key"])
def test_plain_query_and_key_estimates_are_the_slope_of_the_patch(part, tmp_path_factory):
    """Plain AtP of a head's queries (keys): the derivative of LD as they move part-way from the
    corrupt run's to the clean run's, by central differences (ε = 1e-5) on transformers' GPT-2 in
    float64 with the slice of c_attn's output moved by a hook written here."""
    ref, lm = _open("gpt2", tmp_path_factory)
    est = lens.attribution_patch(lm, TEXT, CORRUPT, site=part, answer="w7", wrong="w8")
    ref64 = copy.deepcopy(ref).double()
    L, H = est.delta.shape
    eps = 1e-5
    for layer in range(L):
        for h in range(H):
            c = _part_seen(ref64, "gpt2", part, layer, h, TEXT)
            k = _part_seen(ref64, "gpt2", part, layer, h, CORRUPT)
            up = _part_patched(ref64, "gpt2", part, layer, h, k + eps * (c - k))
            down = _part_patched(ref64, "gpt2", part, layer, h, k - eps * (c - k))
            assert float(est.delta[layer, h]) == pytest.approx((up - down) / (2 * eps), rel=1e-3, abs=1e-5)


def _moved_pair():
    """The planted induction circuit (distractors writing nothing) and a pair on which its induction
    head is saturated in *both* runs: clean [f X Y f ... X] -> Y; corrupt: the earlier X moved to
    position 4, followed by Z: the head attends to Z's position as hard (-> Z)."""
    from qkv.lens import planted

    p = planted.induction(vocab=8, n_ctx=12, heads=3, distractor=0.0, seed=0)
    X, Y, Z = 0, 1, 2
    clean = [3, X, Y, 4, 5, 6, 7, 3, 4, 5, 6, X]
    corrupt = [3, 4, Y, 5, X, Z, 7, 3, 4, 5, 6, X]
    return p, clean, corrupt, Y, Z


def test_the_qk_fix_recovers_what_a_saturated_softmax_hides():
    """AtP*'s failure mode and fix (Kramár et al. 2024, §3.1.1), on the planted circuit: in the
    corrupt run the induction head attends (weight ~1) to the wrong key, so its softmax's
    gradient is ~0 and plain AtP gives its keys ~0, while patching them restores the answer
    completely. The QK fix recomputes the head's attention exactly; the model is linear after
    layer 1's attention (no MLP, no final norm), so for layer 1 it must equal the exact patch."""
    p, clean, corrupt, Y, Z = _moved_pair()
    exact = lens.patch(p, clean, corrupt, site="key", answer=Y, wrong=Z)
    plain = lens.attribution_patch(p, clean, corrupt, site="key", answer=Y, wrong=Z)
    fixed = lens.attribution_patch(p, clean, corrupt, site="key", answer=Y, wrong=Z, qk_fix=True)
    assert float(exact.values[1, 0]) > 0.9  # the keys alone bring the answer back
    assert abs(float(plain.values[1, 0])) < 1e-3  # plain AtP: a false negative
    torch.testing.assert_close(fixed.values[1], exact.values[1], rtol=1e-6, atol=1e-6)
    assert (1, 0) in plain.saturated() and (0, 0) in plain.saturated()
    for h in (1, 2):  # the random distractors are not saturated
        assert (1, h) not in plain.saturated()
    with torch.no_grad():  # the flag reads the model's own attention weights
        w = p.model(torch.tensor([corrupt]), return_weights=True, backend="reference").weights
    torch.testing.assert_close(plain.peak[1, 0].double(), w[1][0, 0].amax(-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(InputError, match="QK fix"):
        lens.attribution_patch(p, clean, corrupt, site="head", answer=Y, wrong=Z, qk_fix=True)


def test_integrated_gradients_see_past_a_saturated_softmax():
    """The previous-token head 0.0 acts on the answer only through the induction head's keys,
    whose softmax is saturated in the corrupt run: plain AtP (and GradDrop) give it ~0, while
    the exact patch restores the answer. Averaging the gradient along the way from the corrupt
    to the clean input (integrated gradients) sees it; and summed over the first layer's stream,
    integrated gradients add up to the whole change of the metric (completeness, Sundararajan et
    al. 2017: the path integral of the gradient), the midpoint sum's error falling with the steps."""
    p, clean, corrupt, Y, Z = _moved_pair()
    exact = lens.patch(p, clean, corrupt, site="head", answer=Y, wrong=Z)
    plain = lens.attribution_patch(p, clean, corrupt, site="head", answer=Y, wrong=Z)
    ig = lens.attribution_patch(p, clean, corrupt, site="head", answer=Y, wrong=Z, ig_steps=32)
    assert float(exact.values[0, 0]) > 0.9 and abs(float(plain.values[0, 0])) < 0.05
    assert float(ig.values[0, 0]) > 0.5 and ig.ig_steps == 32
    top2 = {(int(i) // 3, int(i) % 3) for i in ig.values.abs().flatten().topk(2).indices}
    assert top2 == {(0, 0), (1, 0)}
    errors = []
    for steps in (8, 64):
        r = lens.attribution_patch(p, clean, corrupt, site="resid", answer=Y, wrong=Z, ig_steps=steps)
        errors.append(abs(float(r.values[0].sum()) - 1.0))
    assert errors[1] < 1e-3 and errors[1] < errors[0]
    with pytest.raises(InputError, match="ig_steps"):
        lens.attribution_patch(p, clean, corrupt, answer=Y, wrong=Z, ig_steps=-1)


def test_integrated_gradients_against_transformers_inputs_embeds(tmp_path_factory):
    """ig_steps = 3: Δz · the mean of ∂LD/∂z over the three midpoints e_k + (j - ½)/3 (e_c - e_k)
    of the input embeddings, by transformers' GPT-2 in float64 run on ``inputs_embeds`` (its
    position embeddings added inside, the same for both prompts) with hooks written here."""
    ref, lm = _open("gpt2", tmp_path_factory)
    est = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8", ig_steps=3)
    ref64 = copy.deepcopy(ref).double()
    projs = _out_projs(ref64, "gpt2")
    L, H = len(projs), ref64.config.num_attention_heads
    Dh = ref64.config.hidden_size // H
    seen, hooks = _seeing_z(projs)
    try:
        with torch.no_grad():
            ref64(word_ids(TEXT))
            zc = {i: t.clone() for i, t in seen.items()}
            ref64(word_ids(CORRUPT))
            zk = {i: t.clone() for i, t in seen.items()}
            ec, ek = ref64.transformer.wte(word_ids(TEXT)), ref64.transformer.wte(word_ids(CORRUPT))
        mean = [torch.zeros_like(zk[i]) for i in range(L)]
        for j in range(3):
            logits = ref64(inputs_embeds=ek + (j + 0.5) / 3 * (ec - ek)).logits
            grads = torch.autograd.grad(logits[0, -1, A] - logits[0, -1, B], [seen[i] for i in range(L)])
            mean = [m + g / 3 for m, g in zip(mean, grads, strict=True)]
    finally:
        for h in hooks:
            h.remove()
    want = torch.stack([((zc[i] - zk[i]) * mean[i])[0].view(-1, H, Dh).sum((0, 2)) for i in range(L)])
    torch.testing.assert_close(est.delta.double(), want, rtol=1e-4, atol=1e-5)
    plain = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8")
    assert not torch.allclose(plain.delta, est.delta, rtol=1e-3)  # the steps changed the gradient


def test_cancellation_is_flagged_where_grad_drop_dwarfs_the_plain_estimate():
    from qkv.lens.atp import PatchEstimate

    values = torch.tensor([[0.01, 0.5], [-0.02, 0.0]])
    gd = torch.tensor([[0.4, 0.6], [0.05, 0.0]])  # 0.4 >= 3 x 0.01 and >= 0.1: flagged; 0.05 < 0.1: not
    est = PatchEstimate("head", [], [], "a", "b", 1.0, 0.0, "diff", values, values, 0.0, gd)
    assert est.cancelling() == [(0, 0)]
    assert PatchEstimate("head", [], [], "a", "b", 1.0, 0.0, "diff", values, values, 0.0).cancelling() == []
