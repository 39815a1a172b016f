"""The planted induction circuit (qkv/lens/planted.py) as ground truth: its weights are set by hand,
so which heads make the answer is known, and each of the lens's methods is checked against it;
the model itself is checked against the arithmetic of its construction (a hardmax previous-token
head, an induction head that copies the token after the earlier occurrence)."""

from __future__ import annotations

import pytest
import torch

from qkv import lens
from qkv.lens.planted import induction, recall


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_planted_model_copies_and_its_pair_turns_on_the_circuit(seed):
    p = induction(seed=seed)
    with torch.no_grad():
        out, weights = lens.hooks.forward(p.model, torch.tensor([p.clean]), weights=True)
    x = p.clean[-1]
    earlier = p.clean.index(x)  # the earlier occurrence; the answer is the token after it
    assert p.answer == p.clean[earlier + 1] and int(out[0, -1].argmax()) == p.answer
    prev = weights[0][0, 0]  # head 0.0: every position from 1 on attends to the one before it
    assert torch.allclose(prev.diagonal(-1), torch.ones(len(p.clean) - 1, dtype=prev.dtype), atol=1e-6)
    assert float(weights[1][0, 0, -1, earlier + 1]) > 0.99  # head 1.0 finds "my previous token was x"
    assert x not in p.corrupt[:-1] and p.wrong != p.answer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_method_is_scored_against_the_planted_heads(seed):
    """Exact patching restores the answer through the two planted heads and barely through any
    distractor; attribution patching is the patch itself for layer 1 (nothing but the unembedding
    after it: the metric is linear there) and ranks the planted heads first; GradDrop gives head 0.0
    nothing, since its one path runs through layer 1, the layer its one counted pass drops."""
    p = induction(seed=seed)
    kw = dict(site="head", answer=p.answer, wrong=p.wrong)
    exact = lens.patch(p, p.clean, p.corrupt, **kw)
    est = lens.attribution_patch(p, p.clean, p.corrupt, grad_drop=True, **kw)
    assert recall(exact.values, p.circuit) == 1.0
    assert all(float(exact.values[h]) > 0.9 for h in p.circuit)
    others = [float(exact.values[layer, h]) for layer in range(2) for h in range(3)
              if (layer, h) not in p.circuit]
    assert max(abs(v) for v in others) < 0.5
    torch.testing.assert_close(est.values[1], exact.values[1], rtol=1e-6, atol=1e-6)
    assert recall(est.values, p.circuit) == 1.0
    assert float(est.grad_drop[0, 0]) == pytest.approx(0.0, abs=1e-9)
    assert recall(est.grad_drop, p.circuit) == 0.5


def test_recall_counts_the_planted_heads_among_the_largest():
    scores = torch.tensor([[0.9, 0.1, -0.8], [0.05, 0.0, 0.2]])
    assert recall(scores, [(0, 0), (0, 2)]) == 1.0
    assert recall(scores, [(0, 0), (1, 2)]) == 0.5
    assert recall(-scores, [(0, 0), (0, 2)]) == 1.0  # by magnitude
