"""The checkers of CS189 Lecture 22's and Discussion 10's exercises (qkv/learn/catalog_lec22.py)
can fail: for every exercise a correct solution written here (not the catalog's solution, not
qkv's code) passes every check, also on other random inputs (a grader's), plausible wrong
solutions are each rejected with the message that names their mistake, and the catalog's own
solutions pass."""

from __future__ import annotations

import ast
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.learn import EXERCISES, run
from qkv.learn.catalog_lec22 import DIS10_ANSWER, DIS10_W_K, DIS10_W_Q, DIS10_X, LEC22, dis10_weights
from qkv.learn.exercise import other_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = [e.name for e in LEC22]


# --------------------------------------------------------------------------- correct, written independently


def _rows_softmax(s):
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def self_attention(x, w_q, w_k, w_v):
    q = torch.einsum("...td,de->...te", x, w_q)
    k = torch.einsum("...td,de->...te", x, w_k)
    v = torch.einsum("...td,de->...te", x, w_v)
    w = _rows_softmax(torch.einsum("...te,...se->...ts", q, k) * w_q.shape[1] ** -0.5)
    return torch.einsum("...ts,...se->...te", w, v), w


def raw_self_attention(x):
    return torch.einsum("...ts,...sd->...td", _rows_softmax(torch.einsum("...td,...sd->...ts", x, x)), x)


def mixing_weight(v, a, b):
    u = a - b
    return torch.einsum("...d,...d->...", v - b, u) / torch.einsum("...d,...d->...", u, u)


def attention_flops(n, d):
    multiply_adds = n * d * n + n * n * d  # QKᵀ: n·n outputs of length d; AV: n·d outputs of length n
    return 2 * multiply_adds


def kv_cache_bytes(n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value):
    return math.prod((2, n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value))


def feed_forward(x, w1, b1, w2, b2):
    h = torch.addmm(b1, x.reshape(-1, x.shape[-1]), w1)
    g = h * (torch.special.erf(h * 2**-0.5) + 1) / 2
    return torch.addmm(b2, g, w2).reshape(*x.shape[:-1], w2.shape[1])


def transformer_block(x, attention, mlp, norm1, norm2, pre_ln=True):
    if not pre_ln:
        y = norm1(attention(x) + x)
        return norm2(mlp(y) + y)
    y = attention(norm1(x)) + x
    return mlp(norm2(y)) + y


def alibi_bias(T, n_heads):
    out = torch.zeros(n_heads, T, T, dtype=torch.float64)
    for h in range(n_heads):
        m = 2.0 ** (-8.0 * (h + 1) / n_heads)
        for i in range(T):
            for j in range(i + 1):
                out[h, i, j] = -m * (i - j)
    return out.float()


def unscaled_attention_weights(x, w_q, w_k):
    return _rows_softmax(torch.einsum("...te,...se->...ts", x @ w_q, x @ w_k))


def dot_product_moments(d, mu, var):
    second = var + mu * mu  # E[q_i²] = E[k_i²]
    return d * mu * mu, d * (second * second - mu**4)


def kv_cache_step(q, k, v, k_cache, v_cache):
    B, H, S, d = k_cache.shape
    kc = torch.empty(B, H, S + 1, d, dtype=k.dtype)
    vc = torch.empty(B, H, S + 1, d, dtype=v.dtype)
    kc[:, :, :S], kc[:, :, S:] = k_cache, k
    vc[:, :, :S], vc[:, :, S:] = v_cache, v
    w = _rows_softmax(torch.einsum("bhqd,bhsd->bhqs", q, kc) / math.sqrt(d))
    return torch.einsum("bhqs,bhsd->bhqd", w, vc), kc, vc


CORRECT = {f.__name__: f for f in (self_attention, raw_self_attention, mixing_weight, attention_flops,
                                     kv_cache_bytes, feed_forward, transformer_block, alibi_bias,
                                     unscaled_attention_weights, dot_product_moments, kv_cache_step)}


def test_the_exercises_are_registered_with_lecture_sections():
    from qkv.explain.lectures import LECTURES

    titles = {s.title for lec in LECTURES for s in lec.sections}
    assert set(CORRECT) == set(NAMES)
    for e in LEC22:
        assert EXERCISES[e.name] is e
        assert e.section in titles, e.section
        assert 1 <= e.difficulty <= 3 and len(e.hints) >= 2 and e.see.startswith("qkv ")
        ast.parse(e.stub_file())  # the file `qkv learn start` writes is Python


@pytest.mark.parametrize("name", NAMES)
def test_a_correct_solution_passes_every_check(name):
    report = run(name, CORRECT[name])
    assert report.passed, report.text()


@pytest.mark.parametrize("name", NAMES)
def test_a_correct_solution_passes_on_a_graders_other_inputs(name):
    with other_inputs(1000):
        report = run(name, CORRECT[name])
    assert report.passed, report.text()


@pytest.mark.parametrize(("n", "d"), [(1, 1), (3, 2), (16, 8), (50, 12)])
def test_the_flops_check_counts_what_flop_counter_mode_counts(n, d):
    """The check counts each product with FlopCounterMode's registered rule (entering the mode
    imports torch._dynamo, seconds per student's check); here the mode itself counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    from qkv.learn.catalog_lec22 import _counted_flops

    q, k, v = torch.randn(n, d), torch.randn(n, d), torch.randn(n, d)
    with FlopCounterMode(display=False) as counter:
        torch.softmax(q @ k.T / math.sqrt(d), dim=-1) @ v
    assert _counted_flops(n, d) == counter.get_total_flops() == 4 * n * n * d


@pytest.mark.parametrize("name", NAMES)
def test_an_unwritten_stub_is_told_it_is_not_written_yet(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"write {name}")

    report = run(name, stub)
    assert not report.passed
    assert all("is not written yet" in c.message for c in report.checks if not c.ok), report.text()


def test_discussion_10s_numbers_are_the_notes_and_qkv_explains():
    from qkv.explain import worked_example

    assert (DIS10_X, DIS10_W_Q, DIS10_W_K) == (worked_example.X, worked_example.W_Q, worked_example.W_K)
    # by hand: q₃ = x₃W_Q = [1, -2, 8]; k = [-6, 0, 1], [0, 0, 1], [4, 0, -3]; scores [2, 8, -20]
    top = 1 / (1 + math.exp(2 - 8) + math.exp(-20 - 8))
    assert round(top, 4) == DIS10_ANSWER
    assert float(dis10_weights()[2].max()) == pytest.approx(top, abs=1e-12)


# --------------------------------------------------------------------------- wrong, each with its diagnosis


def sa_unscaled(x, w_q, w_k, w_v):
    w = torch.softmax((x @ w_q) @ (x @ w_k).transpose(-1, -2), -1)
    return w @ (x @ w_v), w


def sa_one_matrix(x, w_q, w_k, w_v):
    q = x @ w_q
    w = torch.softmax(q @ q.transpose(-1, -2) / math.sqrt(w_q.shape[1]), -1)
    return w @ (x @ w_v), w


def sa_raw_keys(x, w_q, w_k, w_v):
    w = torch.softmax((x @ w_q) @ x.transpose(-1, -2) / math.sqrt(w_q.shape[1]), -1)
    return w @ (x @ w_v), w


def sa_raw_values(x, w_q, w_k, w_v):
    w = torch.softmax((x @ w_q) @ (x @ w_k).transpose(-1, -2) / math.sqrt(w_q.shape[1]), -1)
    return w @ x, w


def sa_by_torch(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(w_q.shape[1]), -1)
    return F.scaled_dot_product_attention(q, k, v), w


def raw_scaled(x):
    return torch.softmax(x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1]), -1) @ x


def raw_uniform(x):
    return x.mean(-2, keepdim=True).expand_as(x)


def raw_over_queries(x):
    return torch.softmax(x @ x.transpose(-1, -2), -2) @ x


def mix_clipped(v, a, b):
    return mixing_weight(v, a, b).clamp(0, 1)


def mix_b_weight(v, a, b):
    return mixing_weight(v, b, a)


def mix_unsquared(v, a, b):
    return ((v - b) * (a - b)).sum(-1) / (a - b).norm(dim=-1)


def mix_lstsq(v, a, b):
    return torch.linalg.lstsq((a - b)[..., None], (v - b)[..., None]).solution[..., 0, 0]


def flops_half(n, d):
    return 2 * n * n * d


def flops_with_projections(n, d):
    return 4 * n * n * d + 8 * n * d * d


def flops_float(n, d):
    return 4.0 * n * n * d


def flops_swapped(n, d):
    return 4 * n * d * d


def kvb_keys_only(n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value):
    return n_layers * n_kv_heads * head_dim * n_tokens * bytes_per_value


def kvb_bits(n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value):
    return 16 * n_layers * n_kv_heads * head_dim * n_tokens * bytes_per_value


def kvb_one_layer(n_layers, n_kv_heads, head_dim, n_tokens, bytes_per_value):
    return 2 * n_kv_heads * head_dim * n_tokens * bytes_per_value


def ffn_tanh(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3))) @ w2 + b2


def ffn_relu(x, w1, b1, w2, b2):
    return torch.relu(x @ w1 + b1) @ w2 + b2


def ffn_by_torch(x, w1, b1, w2, b2):
    return F.gelu(x @ w1 + b1) @ w2 + b2


def block_no_first_residual(x, attention, mlp, norm1, norm2, pre_ln=True):
    if pre_ln:
        h = attention(norm1(x))
        return h + mlp(norm2(h))
    return transformer_block(x, attention, mlp, norm1, norm2, pre_ln)


def block_orders_swapped(x, attention, mlp, norm1, norm2, pre_ln=True):
    return transformer_block(x, attention, mlp, norm1, norm2, not pre_ln)


def block_norms_swapped(x, attention, mlp, norm1, norm2, pre_ln=True):
    return transformer_block(x, attention, mlp, norm2, norm1, pre_ln)


def block_normalised_residual(x, attention, mlp, norm1, norm2, pre_ln=True):
    if pre_ln:
        n = norm1(x)
        h = n + attention(n)
        return h + mlp(norm2(h))
    return transformer_block(x, attention, mlp, norm1, norm2, pre_ln)


def block_post_without_final_norm(x, attention, mlp, norm1, norm2, pre_ln=True):
    if pre_ln:
        return transformer_block(x, attention, mlp, norm1, norm2, pre_ln)
    h = norm1(x + attention(x))
    return h + mlp(h)


def block_default_post(x, attention, mlp, norm1, norm2, pre_ln=False):
    return transformer_block(x, attention, mlp, norm1, norm2, pre_ln)


def block_attention_twice(x, attention, mlp, norm1, norm2, pre_ln=True):
    if pre_ln:
        attention(norm1(x))  # a stray call: computed, thrown away
    return transformer_block(x, attention, mlp, norm1, norm2, pre_ln)


def alibi_symmetric(T, n_heads):
    m = 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)
    i = torch.arange(T)
    return (-m[:, None, None] * (i[:, None] - i[None]).abs()).float()


def alibi_masked(T, n_heads):
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return alibi_bias(T, n_heads).masked_fill(future, float("-inf"))


def alibi_from_zero(T, n_heads):
    m = 2.0 ** (-8.0 * torch.arange(0, n_heads, dtype=torch.float64) / n_heads)
    i = torch.arange(T)
    return (-m[:, None, None] * (i[:, None] - i[None]).clamp_min(0)).float()


def alibi_positive(T, n_heads):
    return -alibi_bias(T, n_heads)


def unscaled_but_scaled(x, w_q, w_k):
    return torch.softmax((x @ w_q) @ (x @ w_k).transpose(-1, -2) / math.sqrt(w_q.shape[1]), -1)


def unscaled_kq(x, w_q, w_k):
    return torch.softmax((x @ w_k) @ (x @ w_q).transpose(-1, -2), -1)


def unscaled_naive_exp(x, w_q, w_k):
    e = torch.exp((x @ w_q) @ (x @ w_k).transpose(-1, -2))
    return e / e.sum(-1, keepdim=True)


def moments_mean_d_mu(d, mu, var):
    return d * mu, d * (var * var + 2 * mu * mu * var)


def moments_zero_mean_variance(d, mu, var):
    return d * mu * mu, d * var * var


def moments_var_not_squared(d, mu, var):
    return d * mu * mu, d * (var + 2 * mu * mu * var)


def kv_attend_then_append(q, k, v, k_cache, v_cache):
    w = torch.softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    out = w @ v_cache
    return out, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)


def kv_features_dim(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k_cache, k], -1), torch.cat([v_cache, v], -1)
    w = torch.softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return w @ v_cache, k_cache, v_cache


def kv_heads_dim(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    w = torch.softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return w @ v_cache, k_cache, v_cache


def kv_unscaled(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
    return torch.softmax(q @ k_cache.transpose(-1, -2), -1) @ v_cache, k_cache, v_cache


def kv_prepended(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k, k_cache], 2), torch.cat([v, v_cache], 2)
    w = torch.softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return w @ v_cache, k_cache, v_cache


WRONG = [
    ("self_attention", sa_unscaled, "the scores are not divided by √d"),
    ("self_attention", sa_one_matrix, "the keys are made with w_q"),
    ("self_attention", sa_raw_keys, "the keys are x itself"),
    ("self_attention", sa_raw_values, "the values are x itself"),
    ("self_attention", sa_by_torch, "it calls scaled_dot_product_attention"),
    ("raw_self_attention", raw_scaled, "this step of the derivation has no scaling"),
    ("raw_self_attention", raw_uniform, "the plain average of all tokens"),
    ("raw_self_attention", raw_over_queries, "sum to 1 over the queries"),
    ("mixing_weight", mix_clipped, "it is clipped to [0, 1]"),
    ("mixing_weight", mix_b_weight, "that is b's weight 1 − w"),
    ("mixing_weight", mix_unsquared, "divided by |a − b|; divide by its square"),
    ("mixing_weight", mix_lstsq, "it calls lstsq"),
    ("attention_flops", flops_half, "half: QKᵀ and AV each take 2·n²·d"),
    ("attention_flops", flops_with_projections, "the projections are included"),
    ("attention_flops", flops_float, "return a Python int"),
    ("attention_flops", flops_swapped, "n and d are swapped"),
    ("kv_cache_bytes", kvb_keys_only, "the cache holds K and V"),
    ("kv_cache_bytes", kvb_bits, "that is bits"),
    ("kv_cache_bytes", kvb_one_layer, "one layer only"),
    ("feed_forward", ffn_tanh, "GPT-2's tanh approximation"),
    ("feed_forward", ffn_relu, "that is ReLU"),
    ("feed_forward", ffn_by_torch, "it calls gelu"),
    ("transformer_block", block_no_first_residual, "the first residual is missing"),
    ("transformer_block", block_orders_swapped, "that is post-LN"),
    ("transformer_block", block_orders_swapped, "that is pre-LN"),
    ("transformer_block", block_norms_swapped, "norm1 and norm2 are swapped"),
    ("transformer_block", block_normalised_residual, "a norm in the wrong place: the residual adds x itself"),
    ("transformer_block", block_post_without_final_norm, "post-LN normalises after the MLP's residual"),
    ("transformer_block", block_default_post, "pre_ln defaults to True"),
    ("transformer_block", block_attention_twice, "expected norm1, attention, norm2, mlp, each once"),
    ("alibi_bias", alibi_symmetric, "this exercise's convention is 0 there"),
    ("alibi_bias", alibi_masked, "folds the causal mask into the bias"),
    ("alibi_bias", alibi_from_zero, "h counts from 1"),
    ("alibi_bias", alibi_positive, "the bias is a penalty"),
    ("unscaled_attention_weights", unscaled_but_scaled, "the scores are divided by √3"),
    ("unscaled_attention_weights", unscaled_kq, "Q Kᵀ, not K Qᵀ"),
    ("unscaled_attention_weights", unscaled_naive_exp, "exp overflows"),
    ("dot_product_moments", moments_mean_d_mu, "not d·mu"),
    ("dot_product_moments", moments_zero_mean_variance, "that is the mu = 0 variance"),
    ("dot_product_moments", moments_var_not_squared, "var², not var"),
    ("kv_cache_step", kv_attend_then_append, "appended AFTER attending"),
    ("kv_cache_step", kv_features_dim, "appended along the wrong dimension"),
    ("kv_cache_step", kv_heads_dim, "appended along dim 1"),
    ("kv_cache_step", kv_unscaled, "the scores are not divided by √d"),
    ("kv_cache_step", kv_prepended, "the new key goes at the END of the cache"),
]


@pytest.mark.parametrize(("name", "fn", "says"), WRONG, ids=[f"{n}-{f.__name__}-{i}" for i, (n, f, _) in
                                                              enumerate(WRONG)])
def test_a_plausible_wrong_solution_is_rejected_with_its_diagnosis(name, fn, says):
    report = run(name, fn)
    assert not report.passed
    messages = [c.message for c in report.checks if not c.ok]
    assert any(says in m for m in messages), messages


def test_every_exercise_has_at_least_two_diagnosed_wrong_solutions():
    from collections import Counter

    counts = Counter(n for n, _, _ in WRONG)
    assert all(counts[n] >= 2 for n in NAMES), counts
