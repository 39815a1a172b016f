"""Faithfulness curves (qkv/lens/faithful.py) against references written here: every circuit's
metric against a run of the model with hooks written by hand in this file (the clean prompt, each
head outside the circuit given the corrupt run's output), the areas against numpy's trapezoid
rule, and the planted induction model against the arithmetic of its construction (a hardmax
induction head writing one answer column, distractors that write nothing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_decoder, token_ids

from qkv.errors import InputError
from qkv.lens.faithful import area, circuit_faithfulness, circuit_metric, faithfulness, ranking
from qkv.lens.planted import Planted, induction

TRAPEZOID = getattr(np, "trapezoid", None) or np.trapz  # numpy >= 2.0 names it trapezoid
CLEAN = token_ids(9, seed=1)
CORRUPT = [*CLEAN[:3], (CLEAN[3] + 5) % 48, *CLEAN[4:]]
A, B = 7, 11  # answer and wrong answer of the random decoder


def _random_lm() -> Planted:
    """A random 2-layer decoder (RMSNorm, SwiGLU MLPs, RoPE, 4 query heads over 2 key/value
    heads), float64, as a text model over ids."""
    return Planted(random_decoder(seed=3).double(), [], CLEAN, CORRUPT, A, B, name="random decoder")


def _by_hand(model, clean: list[int], corrupt: list[int], kept: set[tuple[int, int]]) -> torch.Tensor:
    """The last position's logits of the clean prompt with every head not in ``kept`` given its
    output on the corrupt prompt: a pre-hook on each out_proj records the corrupt run's head
    outputs (B, T, H·Dh), a second one writes them into the clean run's slices."""
    blocks = model.stack.blocks
    H, Dh = blocks[0].attn.n_heads, blocks[0].attn.head_dim
    seen: dict[int, torch.Tensor] = {}
    handles = [b.attn.out_proj.register_forward_pre_hook(
        lambda m, args, i=i: seen.__setitem__(i, args[0].clone())) for i, b in enumerate(blocks)]
    with torch.no_grad():
        model(torch.tensor([corrupt]))
    for h in handles:
        h.remove()

    def put(m, args, i):
        x = args[0].clone()
        for h in range(H):
            if (i, h) not in kept:
                x[..., h * Dh:(h + 1) * Dh] = seen[i][..., h * Dh:(h + 1) * Dh]
        return (x,)

    handles = [b.attn.out_proj.register_forward_pre_hook(lambda m, args, i=i: put(m, args, i))
               for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            return model(torch.tensor([clean])).logits[0, -1]
    finally:
        for h in handles:
            h.remove()


def test_each_circuit_is_the_clean_run_with_the_other_heads_from_the_corrupt_run():
    lm = _random_lm()
    scores = torch.tensor([[0.3, -2.0, 0.0, 0.7], [0.1, 0.7, -0.05, 1.5]])
    f = faithfulness(lm, CLEAN, CORRUPT, scores, answer=A, wrong=B)
    assert f.order[:4] == [(0, 1), (1, 3), (0, 3), (1, 1)]  # by |score|, a tie in (layer, head) order
    assert f.sizes == list(range(9))
    for k in f.sizes:
        logits = _by_hand(lm.model, CLEAN, CORRUPT, set(f.order[:k]))
        assert float(f.diffs[k]) == pytest.approx(float(logits[A] - logits[B]), rel=1e-9, abs=1e-9)
    with torch.no_grad():
        plain = lm.model(torch.tensor([CLEAN])).logits[0, -1]
    assert f.full == pytest.approx(float(plain[A] - plain[B]), rel=1e-9)  # every head kept: the clean run
    empty = _by_hand(lm.model, CLEAN, CORRUPT, set())
    assert f.empty == pytest.approx(float(empty[A] - empty[B]), rel=1e-9)
    # f(0) = 0 and f(all) = 1 by construction; in between, the normalised metric
    assert float(f.f[0]) == 0.0 and float(f.f[-1]) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(f.f, (f.diffs - f.empty) / (f.full - f.empty))
    assert f.cpr == pytest.approx(TRAPEZOID(f.f.numpy(), f.fractions.numpy()), abs=1e-12)
    assert f.cmd == pytest.approx(TRAPEZOID(np.abs(1 - f.f.numpy()), np.arange(9) / 8), abs=1e-12)


def test_sizes_measure_those_circuits_only_and_the_areas_run_over_them():
    lm = _random_lm()
    scores = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    every = faithfulness(lm, CLEAN, CORRUPT, scores, answer=A, wrong=B)
    some = faithfulness(lm, CLEAN, CORRUPT, scores, answer=A, wrong=B, sizes=[6, 0, 3])
    assert some.sizes == [0, 3, 6]
    torch.testing.assert_close(some.f, every.f[[0, 3, 6]])
    assert some.cpr == pytest.approx(TRAPEZOID(some.f.numpy(), [0, 3 / 8, 6 / 8]), abs=1e-12)
    assert some.empty == pytest.approx(every.empty) and some.full == pytest.approx(every.full)


def test_the_probability_metric_normalises_the_answers_probability():
    lm = _random_lm()
    scores = torch.arange(8.0).view(2, 4)
    f = faithfulness(lm, CLEAN, CORRUPT, scores, answer=A, wrong=B, metric="prob")
    with torch.no_grad():
        p = torch.softmax(lm.model(torch.tensor([CLEAN])).logits[0, -1], -1)
    assert f.metric == "prob" and f.full == pytest.approx(float(p[A]), rel=1e-9)
    k = 5
    p_k = torch.softmax(_by_hand(lm.model, CLEAN, CORRUPT, set(f.order[:k])), -1)
    assert float(f.diffs[k]) == pytest.approx(float(p_k[A]), rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_planted_circuit_is_all_of_the_answer_where_the_distractors_write_nothing(seed):
    """distractor=0: the distractors write nothing at all, and the unembedding reads only the
    answer columns, which only the induction head writes. So keeping {0.0, 1.0} is the clean run
    (f = 1), keeping either alone is the corrupt run's answer (f = 0: the induction head either
    finds no "previous token was X" or is itself patched), and by hand: M(full) = 8 (the head's
    hardmax copies Y into its answer column, read with weight 8); M(∅) = the corrupt run's logit
    difference, 8 · (count of answer - count of wrong) / T (no key matches X: the induction head's
    scores are all 0, its attention uniform over the T tokens, each copying its own token)."""
    p = induction(seed=seed, distractor=0.0)
    T = len(p.clean)
    L, H = 2, 3
    kept = torch.zeros(4, L, H, dtype=torch.bool)
    kept[1, 0, 0] = kept[2, 1, 0] = True
    kept[3, 0, 0] = kept[3, 1, 0] = True
    m, metric = circuit_metric(p, p.clean, p.corrupt, kept, answer=p.answer, wrong=p.wrong)
    empty = 8.0 * (p.corrupt.count(p.answer) - p.corrupt.count(p.wrong)) / T
    assert metric.answer == p.answer and metric.wrong == p.wrong
    torch.testing.assert_close(m, torch.tensor([empty, empty, empty, 8.0], dtype=torch.float64),
                               rtol=0, atol=1e-9)
    assert circuit_faithfulness(p, p.clean, p.corrupt, p.circuit, p.answer, p.wrong) == pytest.approx(1.0,
                                                                                                    abs=1e-9)
    # a table that ranks the circuit first: f jumps from 0 to 1 at k = 2 and stays there
    scores = torch.tensor([[2.0, 0.1, 0.1], [-3.0, 0.1, 0.1]])
    f = faithfulness(p, p.clean, p.corrupt, scores, answer=p.answer, wrong=p.wrong)
    step = torch.tensor([0, 0, 1, 1, 1, 1, 1], dtype=torch.float64)
    torch.testing.assert_close(f.f, step, rtol=0, atol=1e-9)
    assert f.cpr == pytest.approx(TRAPEZOID([0, 0, 1, 1, 1, 1, 1], np.arange(7) / 6))  # 0.75
    assert f.cmd == pytest.approx(0.25)


def test_area_is_the_trapezoid_rule():
    x = np.array([0.0, 0.1, 0.25, 0.5, 1.0])
    y = np.sin(3 * x) + x**2
    assert area(torch.tensor(x), torch.tensor(y)) == pytest.approx(TRAPEZOID(y, x), rel=1e-12)
    assert area([0.0, 1.0], [1.0, 1.0]) == 1.0
    assert area([0.0], [5.0]) == 0.0
    with pytest.raises(InputError, match="1-d"):
        area([0.0, 1.0], [1.0])


def test_ranking_orders_by_magnitude_and_keeps_ties_in_place():
    assert ranking(torch.tensor([[0.5, -1.0], [0.5, float("nan")]])) == [(0, 1), (0, 0), (1, 0), (1, 1)]


def test_bad_tables_and_sizes_are_refused_by_name():
    lm = _random_lm()
    with pytest.raises(InputError, match=r"scores must be \(2, 4\)"):
        faithfulness(lm, CLEAN, CORRUPT, torch.zeros(4, 2), answer=A, wrong=B)
    with pytest.raises(InputError, match=r"circuit sizes must lie in 0\.\.8"):
        faithfulness(lm, CLEAN, CORRUPT, torch.zeros(2, 4), answer=A, wrong=B, sizes=[0, 9])
    with pytest.raises(InputError, match="same number of tokens"):
        faithfulness(lm, CLEAN, CORRUPT[:-1], torch.zeros(2, 4), answer=A, wrong=B)
    with pytest.raises(InputError, match="kept must be"):
        circuit_metric(lm, CLEAN, CORRUPT, torch.ones(2, 3, 4, dtype=torch.bool), answer=A, wrong=B)
