"""The exercises' checkers can fail: for every exercise, a correct solution written here (not
qkv's code, not the catalog's own solution) passes every check, and at least two plausible wrong
solutions are rejected with the specific message that names the mistake. References inside the
checks are PyTorch's own ops and float64 formulas (qkv/learn/catalog.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.learn import EXERCISES, run

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- correct, written independently


def softmax(x, dim=-1):
    m = torch.max(x, dim=dim, keepdim=True).values
    e = (x - m).exp()
    return e / torch.sum(e, dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, mask=None):
    s = torch.einsum("...td,...sd->...ts", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        s = torch.where(mask, s, torch.full_like(s, -math.inf))
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    e = (s - m).exp()
    w = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("...ts,...sd->...td", w, v), w


def causal_mask(T):
    return torch.tril(torch.ones(T, T)).bool()


def multi_head_attention(x, w_q, w_k, w_v, w_o, n_heads, causal=False):
    _, T, D = x.shape
    d = D // n_heads
    outs = []
    for h in range(n_heads):
        cols = slice(h * d, (h + 1) * d)
        q, k, v = (x @ w_q)[..., cols], (x @ w_k)[..., cols], (x @ w_v)[..., cols]
        mask = torch.tril(torch.ones(T, T)).bool() if causal else None
        outs.append(scaled_dot_product_attention(q, k, v, mask)[0])
    return torch.cat(outs, -1) @ w_o


def sinusoidal_positions(T, d):
    pe = torch.empty(T, d, dtype=torch.float64)
    for p in range(T):
        for i in range(d // 2):
            a = p / 10000 ** (2 * i / d)
            pe[p, 2 * i], pe[p, 2 * i + 1] = math.sin(a), math.cos(a)
    return pe.float()


def rope(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) / half)
    ang = torch.outer(positions.double(), freq)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * torch.cat([ang.cos()] * 2, -1) + rotated * torch.cat([ang.sin()] * 2, -1)).to(x.dtype)


def layer_norm(x, weight, bias, eps=1e-5):
    n = x.shape[-1]
    mu = x.sum(-1, keepdim=True) / n
    var = (x * x).sum(-1, keepdim=True) / n - mu * mu
    return (x - mu) * torch.rsqrt(var + eps) * weight + bias


def additive_attention(query, keys, w_q, w_k, v):
    e = torch.einsum("bta,a->bt", torch.tanh(query.unsqueeze(1) @ w_q + keys @ w_k), v)
    w = softmax(e, dim=1)
    return torch.einsum("bt,btd->bd", w, keys), w


def hardmax(x, dim=-1):
    hits = torch.isclose(x, x.max(dim=dim, keepdim=True).values, rtol=0, atol=0).double()
    return (hits / hits.sum(dim, keepdim=True)).to(x.dtype)


def soft_lookup(query, keys, values, sharpness=1.0):
    w = softmax(sharpness * torch.einsum("nd,d->n", keys, query), 0)
    return torch.einsum("n,n...->...", w, values)


def grouped_query_attention(q, k, v):
    H, K = q.shape[1], k.shape[1]
    outs = [scaled_dot_product_attention(q[:, h], k[:, h * K // H], v[:, h * K // H])[0] for h in range(H)]
    return torch.stack(outs, 1)


def online_softmax_attention(q, k, v, tile=64):
    d = q.shape[-1]
    best = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    total = torch.zeros_like(best)
    acc = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    for start in range(0, k.shape[-2], tile):
        scores = torch.einsum("...td,...sd->...ts", q, k[..., start:start + tile, :]) / math.sqrt(d)
        new_best = torch.maximum(best, scores.max(-1, keepdim=True).values)
        weights = (scores - new_best).exp()
        shrink = (best - new_best).exp()
        total = total * shrink + weights.sum(-1, keepdim=True)
        acc = acc * shrink + weights @ v[..., start:start + tile, :]
        best = new_best
    return acc / total


def patchify(images, p):
    B, _C, H, W = images.shape
    rows = []
    for i in range(0, H, p):
        for j in range(0, W, p):
            rows.append(images[:, :, i:i + p, j:j + p].reshape(B, -1))
    return torch.stack(rows, 1)


def attribution_patch_heads(z_clean, z_corrupt, grad):
    """Each head's change of the metric to first order, written out as loops."""
    T, H, D = z_clean.shape
    out = torch.zeros(H, dtype=z_clean.dtype)
    for h in range(H):
        for t in range(T):
            for d in range(D):
                out[h] += (z_clean[t, h, d] - z_corrupt[t, h, d]) * grad[t, h, d]
    return out


def _by_hand(weights, tokens):
    """The planted model run by hand, head by head: per layer a list of (z (T, Dh), pattern (T, T))."""
    T = len(tokens)
    x = weights["W_E"][tokens] + weights["W_pos"][:T]
    future = torch.ones(T, T).triu(1).bool()
    layers = []
    for layer in range(weights["W_Q"].shape[0]):
        heads, write = [], torch.zeros_like(x)
        for h in range(weights["W_Q"].shape[1]):
            q, k, v = (x @ weights[m][layer, h] for m in ("W_Q", "W_K", "W_V"))
            a = softmax((q @ k.T / q.shape[-1] ** 0.5).masked_fill(future, -math.inf))
            heads.append((a @ v, a))
            write = write + (a @ v) @ weights["W_O"][layer, h]
        x = x + write
        layers.append(heads)
    return layers


def predict_attribution_heads(weights, clean, corrupt, answer, wrong):
    """The last layer's head that moves LD itself; then the layer-0 head whose change that head's
    keys read (K-composition: the induction head keys on the previous token)."""
    run_c, run_k = _by_hand(weights, clean), _by_hand(weights, corrupt)
    u = weights["W_U"][:, answer] - weights["W_U"][:, wrong]
    last = len(run_c) - 1
    moved = [float(((zc[-1] - zk[-1]) @ weights["W_O"][last, h] @ u).abs())
             for h, ((zc, _), (zk, _)) in enumerate(zip(run_c[last], run_k[last], strict=True))]
    top = moved.index(max(moved))
    keys = [float(((zc - zk) @ weights["W_O"][0, h] @ weights["W_K"][last, top]).norm())
            for h, ((zc, _), (zk, _)) in enumerate(zip(run_c[0], run_k[0], strict=True))]
    return [(last, top), (0, keys.index(max(keys)))]


CORRECT = {f.__name__: f for f in (softmax, scaled_dot_product_attention, causal_mask, multi_head_attention,
                                     sinusoidal_positions, rope, layer_norm, additive_attention, hardmax,
                                     soft_lookup, grouped_query_attention, online_softmax_attention,
                                     patchify, attribution_patch_heads, predict_attribution_heads)}


@pytest.mark.parametrize("name", sorted(CORRECT))  # the other catalogs: tests/learn/test_<lecture>.py
def test_a_correct_solution_passes_every_check(name):
    report = run(name, CORRECT[name])
    assert report.passed, report.text()


# --------------------------------------------------------------------------- wrong, each with its diagnosis


def naive_softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


def softmax_dim0(x, dim=-1):
    return softmax(x, 0)


def softmax_by_torch(x, dim=-1):
    return torch.softmax(x, dim)


def unscaled_attention(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v, w


def attention_over_queries(q, k, v, mask=None):
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -2)
    return w @ v, w


def attention_inverted_mask(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask, -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v, w


def attention_nan_rows(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    w = torch.softmax(s, -1)
    return w @ v, w


def mask_strict(T):
    return torch.ones(T, T, dtype=torch.bool).tril(-1)


def mask_upper(T):
    return torch.ones(T, T, dtype=torch.bool).triu()


def mask_additive(T):
    return torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)


def mha_scaled_by_full_width(x, w_q, w_k, w_v, w_o, n_heads, causal=False):
    B, T, D = x.shape
    d = D // n_heads
    sp = lambda t: t.view(B, T, n_heads, d).transpose(1, 2)  # noqa: E731
    q, k, v = sp(x @ w_q), sp(x @ w_k), sp(x @ w_v)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, D) @ w_o


def mha_bad_split(x, w_q, w_k, w_v, w_o, n_heads, causal=False):
    B, T, D = x.shape
    d = D // n_heads
    q, k, v = ((x @ w).reshape(B, n_heads, T, d) for w in (w_q, w_k, w_v))
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return (torch.softmax(s, -1) @ v).reshape(B, T, D) @ w_o


def pos_halves(T, d):
    p = torch.arange(T, dtype=torch.float64)[:, None]
    a = p / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.cat([a.sin(), a.cos()], 1).float()


def pos_exponent_per_column(T, d):
    p = torch.arange(T, dtype=torch.float64)[:, None]
    c = torch.arange(d, dtype=torch.float64)
    a = p / 10000 ** (c / d)
    return torch.where(torch.arange(d) % 2 == 0, a.sin(), a.cos()).float()


def rope_interleaved(x, positions, theta=10000.0):
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * freq
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    return out.flatten(-2).to(x.dtype)


def rope_backwards(x, positions, theta=10000.0):
    return rope(x, -positions, theta)


def ln_unbiased(x, weight, bias, eps=1e-5):
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps) * weight + bias


def ln_eps_outside(x, weight, bias, eps=1e-5):
    xc = x - x.mean(-1, keepdim=True)
    return xc / (xc.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight + bias


def ln_by_torch(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def additive_no_tanh(query, keys, w_q, w_k, v):
    w = torch.softmax(((query @ w_q)[:, None] + keys @ w_k) @ v, 1)
    return (w[..., None] * keys).sum(1), w


def additive_over_batch(query, keys, w_q, w_k, v):
    w = torch.softmax(torch.tanh((query @ w_q)[:, None] + keys @ w_k) @ v, 0)
    return (w[..., None] * keys).sum(1), w


def hardmax_argmax(x, dim=-1):
    return F.one_hot(x.argmax(dim), x.shape[dim]).to(x.dtype) if dim in (-1, x.ndim - 1) else hardmax(x, dim)


def hardmax_last_dim(x, dim=-1):
    return hardmax(x, -1)


def lookup_no_softmax(query, keys, values, sharpness=1.0):
    return (keys @ query) @ values


def lookup_ignores_sharpness(query, keys, values, sharpness=1.0):
    return torch.softmax(keys @ query, 0) @ values


def gqa_round_robin(q, k, v):
    H, K = q.shape[1], k.shape[1]
    k, v = k.repeat(1, H // K, 1, 1), v.repeat(1, H // K, 1, 1)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def gqa_by_torch(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def online_no_max(q, k, v, tile=64):
    l_sum = q.new_zeros((*q.shape[:-1], 1))
    o = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    for j in range(0, k.shape[-2], tile):
        p = torch.exp(q @ k[..., j:j + tile, :].transpose(-1, -2) / math.sqrt(q.shape[-1]))
        l_sum, o = l_sum + p.sum(-1, keepdim=True), o + p @ v[..., j:j + tile, :]
    return o / l_sum


def online_whole_softmax(q, k, v, tile=64):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def patchify_reshape(images, p):
    B, C, _H, _W = images.shape
    return images.reshape(B, -1, C * p * p)


def patchify_columns(images, p):
    return patchify(images.transpose(-1, -2), p)


def atp_turned(z_clean, z_corrupt, grad):
    return ((z_corrupt - z_clean) * grad).sum((0, 2))


def atp_activation(z_clean, z_corrupt, grad):
    return (z_clean * grad).sum((0, 2))


def atp_over_heads(z_clean, z_corrupt, grad):
    return ((z_clean - z_corrupt) * grad).sum((0, 1))


def predict_by_pattern(weights, clean, corrupt, answer, wrong):
    """Layer 0: the head that attends most to the previous token; the last layer: the head whose
    attention at the last position changes most between the prompts. Patterns only."""
    run_c, run_k = _by_hand(weights, clean), _by_hand(weights, corrupt)
    T = len(clean)
    prev = [float(a[torch.arange(1, T), torch.arange(T - 1)].mean()) for _, a in run_c[0]]
    moved = [float((ac[-1] - ak[-1]).abs().sum())
             for (_, ac), (_, ak) in zip(run_c[-1], run_k[-1], strict=True)]
    return [(0, prev.index(max(prev))), (len(run_c) - 1, moved.index(max(moved)))]


def predict_last_layer(weights, clean, corrupt, answer, wrong):
    """The two heads of the last layer whose change moves LD most: the direct effect only."""
    run_c, run_k = _by_hand(weights, clean), _by_hand(weights, corrupt)
    u = weights["W_U"][:, answer] - weights["W_U"][:, wrong]
    last = len(run_c) - 1
    moved = torch.tensor([float((zc[-1] - zk[-1]) @ weights["W_O"][last, h] @ u)
                          for h, ((zc, _), (zk, _)) in enumerate(zip(run_c[last], run_k[last], strict=True))])
    return [(last, int(h)) for h in moved.abs().topk(2).indices]


def predict_by_logit_attribution(weights, clean, corrupt, answer, wrong):
    """The two heads that write most toward the answer on the clean prompt (direct logit
    attribution), whether or not the corruption changes what they write."""
    u = weights["W_U"][:, answer] - weights["W_U"][:, wrong]
    run_c = _by_hand(weights, clean)
    dla = torch.tensor([[float(z[-1] @ weights["W_O"][layer, h] @ u) for h, (z, _) in enumerate(heads)]
                        for layer, heads in enumerate(run_c)])
    H = dla.shape[1]
    return [(int(i) // H, int(i) % H) for i in dla.flatten().abs().topk(2).indices]


def predict_planted_layout(weights, clean, corrupt, answer, wrong):
    return [(0, 0), (1, 0)]


def predict_swapped(weights, clean, corrupt, answer, wrong):
    return [(h, layer) for layer, h in predict_attribution_heads(weights, clean, corrupt, answer, wrong)]


def predict_by_gradient(weights, clean, corrupt, answer, wrong):
    """Attribution patching itself, by autograd: the right heads, by the forbidden route."""
    run_c = _by_hand(weights, clean)
    zs = []
    T = len(corrupt)
    x = weights["W_E"][corrupt] + weights["W_pos"][:T]
    future = torch.ones(T, T).triu(1).bool()
    for layer in range(weights["W_Q"].shape[0]):
        write = torch.zeros_like(x)
        for h in range(weights["W_Q"].shape[1]):
            q, k, v = (x @ weights[m][layer, h] for m in ("W_Q", "W_K", "W_V"))
            z = (softmax((q @ k.T / q.shape[-1] ** 0.5).masked_fill(future, -math.inf)) @ v).requires_grad_()
            zs.append(z)
            write = write + z @ weights["W_O"][layer, h]
        x = x + write
    logits = x[-1] @ weights["W_U"]
    grads = torch.autograd.grad(logits[answer] - logits[wrong], zs)
    H = weights["W_Q"].shape[1]
    est = torch.tensor([float(((run_c[i // H][i % H][0] - z.detach()) * g).sum()) for i, (z, g) in
                        enumerate(zip(zs, grads, strict=True))])
    return [(int(i) // H, int(i) % H) for i in est.abs().topk(2).indices]


WRONG = [
    ("predict_attribution_heads", predict_by_pattern, "an attention pattern says where a head reads"),
    ("predict_attribution_heads", predict_last_layer, "the gradient carries that indirect effect back"),
    ("predict_attribution_heads", predict_by_logit_attribution, "z_clean − z_corrupt = 0"),
    ("predict_attribution_heads", predict_planted_layout, "each layer's heads are shuffled"),
    ("predict_attribution_heads", predict_swapped, "yours are (head, layer)"),
    ("predict_attribution_heads", predict_by_gradient, "it calls grad"),
    ("attribution_patch_heads", atp_turned, "the sign is turned"),
    ("attribution_patch_heads", atp_activation, "not the clean activation itself"),
    ("attribution_patch_heads", atp_over_heads, "it sums over the heads"),
    ("hardmax", hardmax_argmax, "argmax picks one of the tied entries"),
    ("hardmax", hardmax_last_dim, "it always works on the last dimension"),
    ("soft_lookup", lookup_no_softmax, "not passed through a softmax"),
    ("soft_lookup", lookup_ignores_sharpness, "the sharpness is not used"),
    ("grouped_query_attention", gqa_round_robin, "consecutive heads forming a group"),
    ("grouped_query_attention", gqa_by_torch, "it calls scaled_dot_product_attention"),
    ("online_softmax_attention", online_no_max, "keep a running maximum m per query"),
    ("online_softmax_attention", online_whole_softmax, "it calls softmax"),
    ("patchify", patchify_reshape, "not p x p squares"),
    ("patchify", patchify_columns, "the patches are in column order"),
    ("softmax", naive_softmax, "exp(1000) overflows; subtract the maximum"),
    ("softmax", softmax_dim0, "normalised along dim 0, not along the last dimension"),
    ("softmax", softmax_by_torch, "it calls softmax: the exercise is to write that yourself"),
    ("scaled_dot_product_attention", unscaled_attention, "the scores are not divided by √d"),
    ("scaled_dot_product_attention", attention_over_queries,
     "your weights sum to 1 over the queries, not the keys"),
    ("scaled_dot_product_attention", attention_inverted_mask, "the mask is inverted"),
    ("scaled_dot_product_attention", attention_nan_rows, "qkv's convention is all-zero weights there"),
    ("causal_mask", mask_strict, "the diagonal is False: a token may attend to itself"),
    ("causal_mask", mask_upper, "it is transposed: rows are queries"),
    ("causal_mask", mask_additive, "return bool, True = may attend"),
    ("multi_head_attention", mha_scaled_by_full_width, "each head's are divided by √(D / n_heads)"),
    ("multi_head_attention", mha_bad_split, "mixes tokens into heads"),
    ("sinusoidal_positions", pos_halves, "they interleave: even columns sin, odd columns cos"),
    ("sinusoidal_positions", pos_exponent_per_column, "it is 2i/d with i the pair's index"),
    ("rope", rope_interleaved, "pair (i, i + d/2) (rotate half)"),
    ("rope", rope_backwards, "the rotation goes the other way"),
    ("layer_norm", ln_unbiased, "the variance is the unbiased one"),
    ("layer_norm", ln_eps_outside, "eps is added outside the square root"),
    ("layer_norm", ln_by_torch, "it calls layer_norm"),
    ("additive_attention", additive_no_tanh, "the scores miss the tanh"),
    ("additive_attention", additive_over_batch, "the softmax runs over the batch"),
]


@pytest.mark.parametrize(("name", "fn", "says"), WRONG, ids=[f.__name__ for _, f, _ in WRONG])
def test_a_plausible_wrong_solution_is_rejected_with_its_diagnosis(name, fn, says):
    report = run(name, fn)
    assert not report.passed
    messages = [c.message for c in report.checks if not c.ok]
    assert any(says in m for m in messages), messages


def test_every_exercise_has_two_wrong_solutions_and_a_section_of_the_lecture_index():
    from collections import Counter

    from qkv.explain.lectures import LECTURES

    titles = {s.title for lec in LECTURES for s in lec.sections}
    assert all(EXERCISES[n].section in titles for n in EXERCISES)
    assert min(Counter(n for n, _, _ in WRONG)[n] for n in CORRECT) >= 2
    assert all(len(e.hints) >= 2 and e.stub.strip() for e in EXERCISES.values())


def test_the_catalogs_own_solutions_pass():
    for name, e in EXERCISES.items():
        ns = {"torch": torch, "math": math}
        exec(e.solution, ns)
        assert run(name, ns[name]).passed, name


def test_a_wrong_prediction_reveals_both_tables():
    report = run("predict_attribution_heads", predict_planted_layout)
    message = next(c.message for c in report.checks if not c.ok)
    assert "attribution_patch, site='head') estimates layer 0: [" in message
    assert "qkv.lens.patch) measures layer 0: [" in message


def test_a_right_prediction_passes_and_still_reveals_the_tables():
    """Predict, then reveal: a passing prediction is shown the tables it was about (the report's
    note beside the pass), with the lens's own numbers for the first model."""
    from qkv import lens
    from qkv.learn.catalog_more import _instances
    from qkv.lens.planted import Planted

    report = run("predict_attribution_heads", predict_attribution_heads)
    assert report.passed
    (c,) = [c for c in report.checks if c.note]
    assert c.ok and c.message == "" and report.as_dict()["checks"][0]["note"] == c.note
    assert "attribution_patch, site='head') estimates layer 0: [" in c.note and c.note in report.text()
    r = _instances()[0]  # the note's numbers are the lens's, recomputed here on the same weights
    from qkv.learn.handmade_model import qkv_gpt

    lm = Planted(qkv_gpt(r.weights), sorted(r.top), r.clean, r.corrupt, r.answer, r.wrong)
    est = lens.attribution_patch(lm, r.clean, r.corrupt, site="head", answer=r.answer, wrong=r.wrong)
    first_row = [round(v, 3) + 0.0 for v in est.values[0].tolist()]
    assert f"estimates layer 0: {first_row}" in c.note


def test_predict_attribution_heads_asks_a_grader_about_other_models():
    """A grader's seeds give other prompts and other head orders; the circuit is still attribution
    patching's top 2 there (the check raises otherwise), and a correct prediction still passes."""
    from qkv.learn.catalog_more import _instances
    from qkv.learn.exercise import other_inputs

    public = [(r.clean, sorted(r.top)) for r in _instances()]
    for offset in (1000, 2000):
        with other_inputs(offset):
            assert [(r.clean, sorted(r.top)) for r in _instances()] != public
            assert run("predict_attribution_heads", predict_attribution_heads).passed
            assert not run("predict_attribution_heads", predict_by_pattern).passed
