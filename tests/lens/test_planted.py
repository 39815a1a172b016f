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


# --------------------------------------------------------------------------- trained planted models
# Each trains once per session (a few seconds on one thread) into the session's temporary cache.

from qkv.lens import planted  # noqa: E402


@pytest.fixture(scope="module")
def copy_model():
    return planted.copying(seed=0)


@pytest.fixture(scope="module")
def previous_model():
    return planted.previous_token(seed=0)


def test_the_copy_task_repeats_a_span_and_scores_only_the_repeats():
    r = planted.Recipe("copy", ((0, 1), (1, 2)), batch=16)
    ids, targets = planted.task_batch(r, torch.Generator().manual_seed(0))
    for row, tg in zip(ids.tolist(), targets.tolist(), strict=True):
        R = next(i for i in range(1, len(row)) if row[i] == row[0])  # the span's length
        assert len(set(row[:R])) == R and row == [row[i % R] for i in range(len(row))]
        scored = [i for i, t in enumerate(tg) if t != -100]
        assert scored == list(range(R - 1, len(row) - 1))  # the positions whose next token repeats
        assert all(tg[i] == row[i + 1] == row[i + 1 - R] for i in scored)


def test_the_previous_token_task_names_the_permuted_token_before():
    r = planted.Recipe("previous", ((1, 1),), batch=8, seed=3)
    ids, targets = planted.task_batch(r, torch.Generator().manual_seed(0))
    pi = planted.permutation(r.vocab, 3)
    assert sorted(pi) == list(range(r.vocab)) and pi != list(range(r.vocab))
    assert (targets[:, 0] == -100).all()
    assert targets[:, 1:].tolist() == [[pi[t] for t in row[:-1]] for row in ids.tolist()]


def test_training_is_the_same_under_a_seed_and_moves_no_caller_rng():
    r = planted.Recipe("previous", ((1, 1),), steps=5, batch=8)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = planted.train(r)
    assert torch.equal(torch.rand(1), before)
    b, _ = planted.train(r)
    c, _ = planted.train(planted.Recipe("previous", ((1, 1),), steps=5, batch=8, seed=1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_a_trained_model_is_cached_as_safetensors_keyed_by_its_recipe(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    r = planted.Recipe("copy", ((0, 1), (1, 2)), steps=3, batch=4)
    first, seconds = planted.trained(r)
    files = list((tmp_path / "planted").iterdir())
    assert [f.name for f in files] == [f"copy-{r.key()}.safetensors"]  # no temporary file left
    stored = load_file(str(files[0]))
    assert all(torch.equal(stored[k].double(), v) for k, v in first.state_dict().items())

    def no_training(recipe):
        raise AssertionError("a cached recipe was trained again")

    monkeypatch.setattr(planted, "train", no_training)
    again, recorded = planted.trained(r)
    assert recorded == pytest.approx(seconds, abs=1e-3)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in first.state_dict().items())
    assert planted.Recipe("copy", ((0, 1), (1, 2)), steps=3, batch=4, seed=1).key() != r.key()
    files[0].write_bytes(b"damaged")  # a damaged entry is trained again, not trusted
    monkeypatch.undo()
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    rebuilt, _ = planted.trained(r)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in first.state_dict().items())


def test_the_copying_model_predicts_the_repeat_through_its_planted_heads(copy_model):
    """The clean prompt repeats a span; the corrupt one has no earlier occurrence of the last
    token. Exact patching finds the two planted heads and nothing else; the layer-1 head is an
    induction head by its pattern (head_scores), its layer-0 partner attends to the token before
    where the induction head's keys sit, though its score on the repeated-token probe stays
    below the 0.5 that names a head."""
    p = copy_model
    span = p.clean[:8]
    assert p.clean == span + span[:5] and p.answer == span[5] and span[4] not in p.corrupt[:-1]
    assert planted._top(p.model, p.clean) == p.answer and planted._top(p.model, p.corrupt) == p.wrong
    c = planted.check(p)
    assert c.ok, (c.patch, c.kept)
    assert abs(c.kept - 1) < 0.05
    scores = lens.head_scores(p, repeat=9)
    assert float(scores.induction[1, 2]) >= 0.5
    assert float(scores.induction.flatten().topk(2).values[1]) < 0.2  # the only induction head
    with torch.no_grad():
        _, weights = lens.hooks.forward(p.model, torch.tensor([p.clean]), weights=True)
    key = p.clean.index(p.answer)  # the induction head's key: the answer after the earlier X
    assert float(weights[0][0, 1, key, key - 1]) > 0.4  # the layer-0 head reads X there
    assert float(weights[1][0, 2, -1, key]) > 0.5


def test_the_previous_token_model_names_the_token_before_through_one_head(previous_model):
    p = previous_model
    pi = planted.permutation(p.model.cfg.vocab_size, 0)
    assert p.answer == pi[p.clean[-2]] and p.wrong == pi[p.corrupt[-2]] and p.answer != p.wrong
    assert p.clean[:-2] == p.corrupt[:-2] and p.clean[-1] == p.corrupt[-1]
    assert planted._top(p.model, p.clean) == p.answer and planted._top(p.model, p.corrupt) == p.wrong
    c = planted.check(p)
    assert c.ok and c.circuit == [(1, 1)], (c.patch, c.kept)
    scores = lens.head_scores(p, repeat=9)
    assert float(scores.previous[1, 1]) > 0.9
    others = scores.previous.clone()
    others[1, 1] = 0
    assert float(others.max()) < 0.5


@pytest.mark.parametrize("seed", [0, 1])
def test_the_hand_set_circuit_passes_its_check(seed):
    c = planted.check(induction(seed=seed))
    assert c.ok and c.strongest_other < 0.1 and abs(c.kept - 1) < 0.05


def test_a_wrong_circuit_fails_the_check():
    p = induction(seed=0)
    p.circuit = [(0, 0)]  # the induction head left out: it restores alone, and the rest cannot keep it
    c = planted.check(p)
    assert not c.ok and c.strongest_other > 0.9
