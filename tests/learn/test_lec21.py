"""CS189 Lecture 21's exercises (qkv/learn/catalog_lec21.py) can tell right from wrong: a correct
solution written here, independently of the catalog's, passes every check (also on a grader's
other inputs); plausible wrong ones are each rejected with the message that names the mistake;
the catalog's own solutions pass; every check is quick."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.learn import EXERCISES, run
from qkv.learn.catalog_lec21 import LEC21
from qkv.learn.exercise import other_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = [e.name for e in LEC21]


# --------------------------------------------------------------------------- correct, written independently


def conv1d(x, w, b=None):
    k = w.shape[-1]
    cols = [(x[:, None, :, t : t + k] * w[None]).sum(dim=(2, 3)) for t in range(x.shape[-1] - k + 1)]
    y = torch.stack(cols, dim=-1)  # (B, C_out, L - k + 1)
    return y if b is None else y + b.view(1, -1, 1)


def receptive_field(n_layers, kernel_size):
    seen = 1
    for _ in range(n_layers):
        seen += kernel_size - 1
    return seen


def tf_idf(counts):
    n_docs = counts.shape[0]
    df = (counts != 0).to(counts.dtype).sum(0)
    idf = torch.log(torch.where(df == 0, torch.full_like(df, n_docs), n_docs / df))  # df = 0: ln 1 = 0
    return torch.nan_to_num(counts / counts.sum(1, keepdim=True), nan=0.0) * idf


def rnn_step(x, h, w_xh, w_hh, b):
    return torch.tanh(torch.cat([x, h], dim=1) @ torch.cat([w_xh, w_hh], dim=0) + b)


def doubly_stochastic_penalty(alphas, valid=None):
    if valid is None:
        valid = torch.ones(alphas.shape[:2], dtype=torch.bool)
    coverage = torch.einsum("btl,bt->bl", alphas, valid.to(alphas.dtype))
    return (coverage - 1).pow(2).sum(1).mean()


def reinforce_gradient(logits, sampled, reward, baseline=0.0):
    e = (logits - logits.max(-1, keepdim=True).values).exp()
    p = e / e.sum(-1, keepdim=True)
    onehot = torch.zeros_like(logits).scatter(1, sampled[:, None], 1.0)
    advantage = reward - torch.as_tensor(baseline, dtype=logits.dtype)
    return advantage.unsqueeze(-1) * (onehot - p)


def location_attention(h, w, features):
    scores = torch.einsum("bh,lh->bl", h, w)
    e = (scores - scores.max(-1, keepdim=True).values).exp()
    weights = e / e.sum(-1, keepdim=True)
    return torch.einsum("bl,bld->bd", weights, features), weights


CORRECT = {
    f.__name__: f
    for f in (
        conv1d,
        receptive_field,
        tf_idf,
        rnn_step,
        doubly_stochastic_penalty,
        reinforce_gradient,
        location_attention,
    )
}


@pytest.mark.parametrize("name", NAMES)
def test_a_correct_solution_passes_every_check(name):
    report = run(name, CORRECT[name])
    assert report.passed, report.text()


@pytest.mark.parametrize("name", NAMES)
def test_a_correct_solution_passes_on_a_graders_other_inputs(name):
    for offset in (1000, 7777):
        with other_inputs(offset):
            report = run(name, CORRECT[name])
        assert report.passed, (offset, report.text())


# --------------------------------------------------------------------------- wrong, each with its diagnosis


def conv_flipped(x, w, b=None):
    return conv1d(x, w.flip(-1), b)


def conv_no_bias(x, w, b=None):
    return conv1d(x, w, None)


def conv_same_padding(x, w, b=None):
    k = w.shape[-1]
    return conv1d(F.pad(x, ((k - 1) // 2, k // 2)), w, b)


def conv_by_torch(x, w, b=None):
    return F.conv1d(x, w, b)


def rf_times_k(n_layers, kernel_size):
    return n_layers * kernel_size


def rf_exponential(n_layers, kernel_size):
    return kernel_size**n_layers


def rf_width_three_only(n_layers, kernel_size):
    return 2 * n_layers + 1


def rf_off_by_one(n_layers, kernel_size):
    return n_layers * (kernel_size - 1)


def tfidf_log10(counts):
    df = (counts > 0).sum(0).to(counts.dtype)
    return counts / counts.sum(1, keepdim=True) * torch.log10(counts.shape[0] / df)


def tfidf_raw_counts(counts):
    df = (counts > 0).sum(0).to(counts.dtype)
    return counts * torch.log(counts.shape[0] / df)


def tfidf_df_occurrences(counts):
    return counts / counts.sum(1, keepdim=True) * torch.log(counts.shape[0] / counts.sum(0))


def tfidf_nan_for_unused_words(counts):
    df = (counts > 0).sum(0).to(counts.dtype)
    length = counts.sum(1, keepdim=True)
    return counts / torch.where(length > 0, length, 1.0) * torch.log(counts.shape[0] / df)


def tfidf_smoothed(counts):
    df = (counts > 0).sum(0).to(counts.dtype)
    length = counts.sum(1, keepdim=True).clamp_min(1)
    return counts / length * (torch.log((1 + counts.shape[0]) / (1 + df)) + 1)


def rnn_no_tanh(x, h, w_xh, w_hh, b):
    return x @ w_xh + h @ w_hh + b


def rnn_swapped(x, h, w_xh, w_hh, b):
    return torch.tanh(x @ w_hh + h @ w_xh + b)


def rnn_transposed(x, h, w_xh, w_hh, b):
    return torch.tanh(x @ w_xh.T + h @ w_hh.T + b)


def rnn_by_torch(x, h, w_xh, w_hh, b):
    cell = nn.RNNCell(*w_xh.shape).to(x.dtype)
    cell.weight_ih.data, cell.weight_hh.data = w_xh.T.detach().clone(), w_hh.T.detach().clone()
    cell.bias_ih.data, cell.bias_hh.data = b.detach().clone(), torch.zeros_like(b)
    return cell(x, h)


def penalty_cells_first(alphas, valid=None):
    return ((1 - alphas.sum(-1)) ** 2).sum(-1).mean()


def penalty_mean_over_cells(alphas, valid=None):
    a = alphas if valid is None else alphas * valid[..., None]
    return ((1 - a.sum(1)) ** 2).mean()


def penalty_summed_over_batch(alphas, valid=None):
    a = alphas if valid is None else alphas * valid[..., None]
    return ((1 - a.sum(1)) ** 2).sum()


def penalty_ignores_valid(alphas, valid=None):
    return ((1 - alphas.sum(1)) ** 2).sum(-1).mean()


def penalty_no_square(alphas, valid=None):
    a = alphas if valid is None else alphas * valid[..., None]
    return (1 - a.sum(1)).sum(-1).mean()


def reinforce_sign_flipped(logits, sampled, reward, baseline=0.0):
    return -reinforce_gradient(logits, sampled, reward, baseline)


def reinforce_onehot_only(logits, sampled, reward, baseline=0.0):
    onehot = F.one_hot(sampled, logits.shape[-1]).to(logits.dtype)
    return (reward - baseline)[:, None] * onehot


def reinforce_ignores_baseline(logits, sampled, reward, baseline=0.0):
    return reinforce_gradient(logits, sampled, reward, 0.0)


def reinforce_by_autograd(logits, sampled, reward, baseline=0.0):
    lg = logits.detach().clone().requires_grad_()
    log_p = torch.log_softmax(lg, -1).gather(1, sampled[:, None]).squeeze(1)
    ((reward - baseline) * log_p).sum().backward()
    return lg.grad


def location_over_batch(h, w, features):
    weights = torch.softmax(h @ w.T, 0)
    return (weights[..., None] * features).sum(1), weights


def location_untransposed(h, w, features):
    weights = torch.softmax(h @ w, -1)
    return (weights[..., None] * features).sum(1), weights


def location_by_content(h, w, features):
    weights = torch.softmax(torch.einsum("bld,bd->bl", features, h), -1)
    return (weights[..., None] * features).sum(1), weights


def location_peeks_at_content(h, w, features):
    weights = torch.softmax(h @ w.T + features.mean(-1), -1)
    return (weights[..., None] * features).sum(1), weights


WRONG = [
    ("conv1d", conv_flipped, "the kernel is flipped"),
    ("conv1d", conv_no_bias, "the bias is missing"),
    ("conv1d", conv_same_padding, "that is zero padding"),
    ("conv1d", conv_by_torch, "it calls conv1d"),
    ("receptive_field", rf_times_k, "each layer adds k − 1 new positions, not k"),
    ("receptive_field", rf_exponential, "it grows linearly with the layers"),
    ("receptive_field", rf_width_three_only, "holds for the lecture's width 3 only"),
    ("receptive_field", rf_off_by_one, "off by one: zero layers see 1 position"),
    ("tf_idf", tfidf_log10, "the idf uses log10"),
    ("tf_idf", tfidf_raw_counts, "tf is the raw count"),
    ("tf_idf", tfidf_df_occurrences, "df counts occurrences of the word"),
    ("tf_idf", tfidf_nan_for_unused_words, "word 1 is in no document"),
    ("tf_idf", tfidf_smoothed, "the idf is smoothed"),
    ("rnn_step", rnn_no_tanh, "the tanh is missing"),
    ("rnn_step", rnn_swapped, "the weights are swapped"),
    ("rnn_step", rnn_transposed, "the weights are transposed"),
    ("rnn_step", rnn_by_torch, "it calls RNNCell"),
    ("doubly_stochastic_penalty", penalty_cells_first, "it sums α over the cells for each word"),
    ("doubly_stochastic_penalty", penalty_mean_over_cells, "it averages over the cells"),
    ("doubly_stochastic_penalty", penalty_summed_over_batch, "it sums over the batch"),
    ("doubly_stochastic_penalty", penalty_ignores_valid, "valid is ignored"),
    ("doubly_stochastic_penalty", penalty_no_square, "the square is missing"),
    ("reinforce_gradient", reinforce_sign_flipped, "the sign is flipped"),
    ("reinforce_gradient", reinforce_sign_flipped, "the estimate must be unbiased"),
    ("reinforce_gradient", reinforce_onehot_only, "only the sampled logit moves"),
    ("reinforce_gradient", reinforce_ignores_baseline, "the baseline is not subtracted"),
    ("reinforce_gradient", reinforce_ignores_baseline, "it should shrink"),
    ("reinforce_gradient", reinforce_by_autograd, "it calls backward"),
    ("location_attention", location_over_batch, "the softmax runs over the batch"),
    ("location_attention", location_untransposed, "w is not transposed"),
    ("location_attention", location_by_content, "these are content-based weights"),
    (
        "location_attention",
        location_peeks_at_content,
        "location-based ones are softmax(W h) over fixed positions",
    ),
]


@pytest.mark.parametrize(
    ("name", "fn", "says"), WRONG, ids=[f"{f.__name__}-{i}" for i, (_, f, _) in enumerate(WRONG)]
)
def test_a_plausible_wrong_solution_is_rejected_with_its_diagnosis(name, fn, says):
    report = run(name, fn)
    assert not report.passed
    messages = [c.message for c in report.checks if not c.ok]
    assert any(says in m for m in messages), messages


def test_the_lecture_numbers_in_the_stubs_are_right():
    """The stubs' worked examples, recomputed here by hand and by PyTorch."""
    x, w = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]), torch.tensor([[[1.0, 0.0, -1.0]]])
    assert F.conv1d(x, w).flatten().tolist() == [-2.0, -2.0]
    assert [receptive_field(n, 3) for n in (1, 2, 13, 14)] == [3, 5, 27, 29]
    assert round(2 / 100 * math.log(1000 / 300), 5) == 0.02408
    assert round(math.tanh(1), 4) == 0.7616
    a = torch.tensor([[[0.9, 0.1], [0.8, 0.2]]], dtype=torch.float64)
    assert float(doubly_stochastic_penalty(a)) == pytest.approx(0.98)
    g = reinforce_gradient(
        torch.log(torch.tensor([[0.1, 0.2, 0.7]] * 2, dtype=torch.float64)),
        torch.tensor([2, 0]),
        torch.tensor([1.0, 1.0], dtype=torch.float64),
    )
    assert torch.allclose(g, torch.tensor([[-0.1, -0.2, 0.3], [0.9, -0.2, -0.7]], dtype=torch.float64))
    _, weights = location_attention(
        torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]), torch.zeros(1, 3, 1)
    )
    assert [round(v, 4) for v in weights[0].tolist()] == [0.787, 0.1065, 0.1065]
    for stub, says in (
        (EXERCISES["conv1d"].stub, "[[[-2, -2]]]"),
        (EXERCISES["tf_idf"].stub, "0.02408"),
        (EXERCISES["rnn_step"].stub, "0.7616"),
        (EXERCISES["doubly_stochastic_penalty"].stub, "0.98"),
        (EXERCISES["reinforce_gradient"].stub, "[0.9, -0.2, -0.7]"),
        (EXERCISES["location_attention"].stub, "[0.7870, 0.1065, 0.1065]"),
    ):
        assert says in stub


# --------------------------------------------------------------------------- the catalog's own parts


def test_seven_exercises_one_or_more_per_section_of_lecture_21_each_with_its_demo():
    from qkv.explain.lectures import LECTURES

    lec21 = next(lec for lec in LECTURES if lec.name.startswith("CS189 Lecture 21"))
    sections = {s.title: s for s in lec21.sections}
    assert len(LEC21) == 7 and all(EXERCISES[e.name] is e for e in LEC21)
    assert {e.section for e in LEC21} == {title for title, s in sections.items() if s.demos}
    for e in LEC21:
        assert e.see in [d.command for d in sections[e.section].demos], e.name
        assert 1 <= e.difficulty <= 3 and len(e.hints) >= 2 and e.stub.strip()
    assert min(Counter(n for n, _, _ in WRONG)[n] for n in NAMES) >= 2


@pytest.mark.parametrize("name", NAMES)
def test_the_stub_file_runs_and_says_it_is_not_written(name):
    ns: dict = {}
    exec(compile(EXERCISES[name].stub_file(), f"{name}.py", "exec"), ns)
    report = run(name, ns[name])
    assert not report.passed
    assert "not written yet" in report.checks[0].message  # (gradcheck words it otherwise: see exercise.py)
