"""The build-the-weights-by-hand exercises (qkv/learn/handmade.py) can fail: for every exercise a
construction written here (not the catalog's, laid out differently) passes every check, plausible
wrong constructions are rejected with the message that names the mistake, and the catalog's own
solution passes. The model the checks build (qkv/learn/handmade_model.py: a qkv GPT with the
student's weights) is compared with a forward pass written here in float64."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qkv.learn import EXERCISES, run
from qkv.learn.exercise import CheckError, other_inputs
from qkv.learn.handmade import HANDMADE
from qkv.learn.handmade_model import forward, qkv_gpt, read_weights

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = [e.name for e in HANDMADE]
BIG = 30.0  # a score gap, after / √d_head, that makes a softmax a hardmax at these lengths


def one_hot_stream(vocab, n_ctx, d_model, pos_first=False):
    """W_E, W_pos with one-hot rows; positions in the first columns when ``pos_first``."""
    tok0, pos0 = (n_ctx, 0) if pos_first else (0, vocab)
    W_E = torch.zeros(vocab, d_model, dtype=torch.float64)
    W_E[torch.arange(vocab), tok0 + torch.arange(vocab)] = 1.0
    W_pos = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    W_pos[torch.arange(n_ctx), pos0 + torch.arange(n_ctx)] = 1.0
    return W_E, W_pos, tok0, pos0


# --------------------------------------------------------------------------- correct, written independently


def previous_token_head(vocab, n_ctx, d_model, shift=1, gap=BIG):
    """Keys carry 'I am position j + shift', queries 'I am position i': a match when j = i − shift."""
    W_E, W_pos, _, pos0 = one_hot_stream(vocab, n_ctx, d_model, pos_first=True)
    dh = n_ctx + shift
    W_Q = torch.zeros(1, 1, d_model, dh, dtype=torch.float64)
    W_K = torch.zeros_like(W_Q)
    for p in range(n_ctx):
        W_Q[0, 0, pos0 + p, p] = gap * math.sqrt(dh)
        W_K[0, 0, pos0 + p, p + shift] = 1.0
    return SimpleNamespace(W_E=W_E, W_pos=W_pos, W_Q=W_Q, W_K=W_K)


def first_token_head(vocab, n_ctx, d_model, gap=BIG):
    """The query is read off the positions (every position says 'start?'), the key only at 0."""
    W_E, W_pos, _, pos0 = one_hot_stream(vocab, n_ctx, d_model)
    dh = 4
    W_Q = torch.zeros(d_model, dh, dtype=torch.float64)
    W_Q[pos0 : pos0 + n_ctx, 2] = 1.0
    W_K = torch.zeros(d_model, dh, dtype=torch.float64)
    W_K[pos0, 2] = gap * math.sqrt(dh)
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K}


def duplicate_token_head(vocab, n_ctx, d_model, self_penalty=True, gap=BIG):
    """W_Q·W_Kᵀ = s·diag(+1 on tokens, −1 on positions) over the whole stream."""
    W_E, W_pos, tok0, pos0 = one_hot_stream(vocab, n_ctx, d_model, pos_first=True)
    sign = torch.zeros(d_model, dtype=torch.float64)
    sign[tok0 : tok0 + vocab] = 1.0
    sign[pos0 : pos0 + n_ctx] = -1.0 if self_penalty else 0.0
    W_Q = torch.diag(sign) * gap * math.sqrt(d_model)
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": torch.eye(d_model, dtype=torch.float64)}


def average_head(vocab, n_ctx, d_model):
    """Random queries against zero keys (all scores 0); the tokens copied, tripled, to the last columns."""
    W_E, W_pos, tok0, _ = one_hot_stream(vocab, n_ctx, d_model)
    out = d_model - vocab
    dh = 3
    W_V = torch.zeros(d_model, dh * vocab, dtype=torch.float64)
    W_O = torch.zeros(dh * vocab, d_model, dtype=torch.float64)
    for t in range(vocab):
        W_V[tok0 + t, dh * t] = 1.0
        W_O[dh * t, out + t] = 3.0
    W_U = torch.zeros(d_model, vocab, dtype=torch.float64)
    W_U[out:, :] = torch.eye(vocab)
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": torch.randn(d_model, dh * vocab, dtype=torch.float64),
            "W_K": torch.zeros(d_model, dh * vocab), "W_V": W_V, "W_O": W_O, "W_U": W_U}


def induction_head(vocab, n_ctx, d_model, k_reads="previous", layer0=True, copy=True, prev_own=True):
    """Two heads per layer (head 1 of each does nothing); no special care for position 0.
    Columns: positions, tokens, the previous token, the answer."""
    W_E, W_pos, tok0, pos0 = one_hot_stream(vocab, n_ctx, d_model, pos_first=True)
    prev0, ans0 = n_ctx + vocab, n_ctx + 2 * vocab
    if not prev_own:  # the previous token written on top of the current one
        prev0 = tok0
    dh = max(n_ctx, vocab)
    W_Q, W_K, W_V = (torch.zeros(2, 2, d_model, dh, dtype=torch.float64) for _ in range(3))
    W_O = torch.zeros(2, 2, dh, d_model, dtype=torch.float64)
    s = BIG * math.sqrt(dh)
    if layer0:
        for p in range(1, n_ctx):
            W_Q[0, 0, pos0 + p, p] = s
            W_K[0, 0, pos0 + p - 1, p] = 1.0
        for t in range(vocab):
            W_V[0, 0, tok0 + t, t] = 1.0
            W_O[0, 0, t, prev0 + t] = 1.0
    key_cols = prev0 if k_reads == "previous" else tok0
    for t in range(vocab):
        W_Q[1, 0, tok0 + t, t] = s
        W_K[1, 0, key_cols + t, t] = 1.0
        W_V[1, 0, tok0 + t, t] = 1.0
        W_O[1, 0, t, ans0 + t] = 1.0 if copy else 0.0
    W_U = torch.zeros(d_model, vocab, dtype=torch.float64)
    W_U[ans0 : ans0 + vocab] = torch.eye(vocab)
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K, "W_V": W_V, "W_O": W_O, "W_U": W_U}


CORRECT = {f.__name__: f for f in (previous_token_head, first_token_head, duplicate_token_head, average_head,
                                     induction_head)}


def test_the_five_exercises_are_registered_with_their_lecture_sections():
    from qkv.explain.lectures import LECTURES

    titles = {s.title for lec in LECTURES for s in lec.sections}
    assert NAMES == ["previous_token_head", "first_token_head", "duplicate_token_head", "average_head",
                     "induction_head"]
    for e in HANDMADE:
        assert EXERCISES[e.name] is e
        assert e.section in titles
        assert len(e.hints) >= 2 and e.stub.strip() and e.signature == "(vocab, n_ctx, d_model)"


@pytest.mark.parametrize("name", NAMES)
def test_a_correct_construction_passes_every_check(name):
    report = run(name, CORRECT[name])
    assert report.passed, report.text()


@pytest.mark.parametrize("name", NAMES)
def test_on_a_graders_other_inputs_too(name):
    with other_inputs(1000):
        assert run(name, CORRECT[name]).passed


# --------------------------------------------------------------------------- wrong, each with its diagnosis


def prev_attends_to_itself(vocab, n_ctx, d_model):
    return previous_token_head(vocab, n_ctx, d_model, shift=0)


def prev_too_soft(vocab, n_ctx, d_model):
    return previous_token_head(vocab, n_ctx, d_model, gap=1.0)


def prev_two_back(vocab, n_ctx, d_model):
    return previous_token_head(vocab, n_ctx, d_model, shift=2)


def first_with_w_q_equal_w_k(vocab, n_ctx, d_model):
    W_E, W_pos, _, pos0 = one_hot_stream(vocab, n_ctx, d_model)
    W = torch.zeros(d_model, 1, dtype=torch.float64)
    W[pos0, 0] = 10.0  # both ask and answer 'position 0'
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W, "W_K": W}


def first_too_soft(vocab, n_ctx, d_model):
    return first_token_head(vocab, n_ctx, d_model, gap=2.0)


def duplicate_counting_itself(vocab, n_ctx, d_model):
    return duplicate_token_head(vocab, n_ctx, d_model, self_penalty=False)


def duplicate_too_soft(vocab, n_ctx, d_model):
    return duplicate_token_head(vocab, n_ctx, d_model, gap=1.5)


def duplicate_by_position(vocab, n_ctx, d_model):
    return previous_token_head(vocab, n_ctx, d_model)


def average_by_content(vocab, n_ctx, d_model):
    w = average_head(vocab, n_ctx, d_model)
    w["W_Q"] = w["W_K"] = 3.0 * torch.eye(d_model, dtype=torch.float64)[:, : w["W_V"].shape[1]]
    return w


def average_through_the_token_columns(vocab, n_ctx, d_model):
    w = average_head(vocab, n_ctx, d_model)
    W_O = torch.zeros_like(w["W_O"])
    W_O[:, :vocab] = w["W_O"][:, d_model - vocab :] / 3.0
    W_U = torch.zeros_like(w["W_U"])
    W_U[:vocab] = torch.eye(vocab)
    return {**w, "W_O": W_O, "W_U": W_U}


def average_without_unembedding(vocab, n_ctx, d_model):
    w = average_head(vocab, n_ctx, d_model)
    del w["W_U"]
    return w


def induction_without_k_composition(vocab, n_ctx, d_model):
    return induction_head(vocab, n_ctx, d_model, k_reads="token")


def induction_without_layer_0(vocab, n_ctx, d_model):
    return induction_head(vocab, n_ctx, d_model, layer0=False)


def induction_that_copies_nothing(vocab, n_ctx, d_model):
    return induction_head(vocab, n_ctx, d_model, copy=False)


def induction_previous_on_top_of_current(vocab, n_ctx, d_model):
    return induction_head(vocab, n_ctx, d_model, prev_own=False)


def induction_in_one_layer(vocab, n_ctx, d_model):
    return {k: (v[:1] if k.startswith("W_") and v.ndim == 4 else v)
            for k, v in induction_head(vocab, n_ctx, d_model).items()}


WRONG = [
    ("previous_token_head", prev_attends_to_itself, "each query's best key is its own position"),
    ("previous_token_head", prev_too_soft, "your W_Q·W_Kᵀ is not sharp enough — scale it up"),
    ("previous_token_head", prev_two_back, "that is two back"),
    ("previous_token_head", prev_attends_to_itself, "it names it 'no type'"),
    ("first_token_head", first_with_w_q_equal_w_k, "If W_Q = W_K"),
    ("first_token_head", first_too_soft, "not sharp enough"),
    ("first_token_head", previous_token_head, "it names it 'previous'"),
    ("duplicate_token_head", duplicate_counting_itself, "its own token matches itself too"),
    ("duplicate_token_head", duplicate_too_soft, "not sharp enough"),
    ("duplicate_token_head", duplicate_by_position, "the previous token: the scores read positions"),
    ("average_head", average_by_content, "they must not depend on the key"),
    ("average_head", average_through_the_token_columns, "it predicts the current token"),
    ("average_head", average_without_unembedding, "the logits are the same everywhere"),
    ("average_head", previous_token_head, "it names it 'previous'"),
    ("induction_head", induction_without_k_composition, "this is a duplicate-token head"),
    ("induction_head", induction_without_layer_0, "layer 0 has no previous-token head"),
    ("induction_head", induction_that_copies_nothing, "what it copies does not reach the logits"),
    ("induction_head", induction_in_one_layer, "expected (n_layers=2"),
    ("induction_head", induction_previous_on_top_of_current, "give the previous token columns of its own"),
]


@pytest.mark.parametrize(("name", "fn", "says"), WRONG, ids=[f"{n}-{f.__name__}" for n, f, _ in WRONG])
def test_a_plausible_wrong_construction_is_rejected_with_its_diagnosis(name, fn, says):
    report = run(name, fn)
    assert not report.passed
    messages = [c.message for c in report.checks if not c.ok]
    assert any(says in m for m in messages), messages


def test_every_exercise_has_two_wrong_constructions():
    from collections import Counter

    counts = Counter(n for n, _, _ in WRONG)
    assert min(counts[n] for n in NAMES) >= 2


def test_the_message_names_the_query_and_where_its_weight_went():
    msg = next(c.message for c in run("previous_token_head", prev_attends_to_itself).checks if not c.ok)
    # query 1 of any sequence: its own position gets nearly everything, key 0 (the previous) nearly nothing
    assert "query 1 puts 0.00 of its weight on the previous token (key 0; 0.9 needed)" in msg, msg
    assert "the rest goes to key 1 (1.00)" in msg, msg


# --------------------------------------------------------------------------- the model the checks build


def reference_logits(w, tokens):
    """The stubs' model, token by token, in float64 (loops, no einsum)."""
    B, T = tokens.shape
    L, H, _, dh = w.W_Q.shape
    x = w.W_E[tokens] + w.W_pos[:T]
    pats = []
    for layer in range(L):
        add = torch.zeros_like(x)
        pat = torch.zeros(B, H, T, T, dtype=torch.float64)
        for h in range(H):
            q, k, v = x @ w.W_Q[layer, h], x @ w.W_K[layer, h], x @ w.W_V[layer, h]
            for i in range(T):
                s = (k[:, : i + 1] @ q[:, i, :, None])[..., 0] / math.sqrt(dh)  # (B, i + 1)
                a = torch.exp(s - s.max(-1, keepdim=True).values)
                a = a / a.sum(-1, keepdim=True)
                pat[:, h, i, : i + 1] = a
                add[:, i] += (a[:, :, None] * v[:, : i + 1]).sum(1) @ w.W_O[layer, h]
        x = x + add
        pats.append(pat)
    return x @ w.W_U, pats


def test_the_qkv_gpt_holding_the_weights_computes_the_stubs_model():
    g = torch.Generator().manual_seed(0)
    V, N, D, L, H, dh = 7, 9, 12, 2, 3, 5
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = read_weights({"W_E": r(V, D), "W_pos": r(N, D), "W_Q": r(L, H, D, dh), "W_K": r(L, H, D, dh),
                      "W_V": r(L, H, D, dh), "W_O": r(L, H, dh, D), "W_U": r(D, V)}, V, N, D, n_layers=L)
    tokens = torch.randint(V, (3, N), generator=g)
    want, pats = reference_logits(w, tokens)
    out = qkv_gpt(w)(tokens, return_weights=True, backend="reference")
    torch.testing.assert_close(out.logits, want, rtol=1e-10, atol=1e-10)
    for got, p in zip(out.weights, pats, strict=True):
        torch.testing.assert_close(got, p, rtol=1e-10, atol=1e-10)
    mine = forward(w, tokens)
    torch.testing.assert_close(mine.logits, want, rtol=1e-10, atol=1e-10)


def test_the_weights_are_read_with_their_shapes_checked():
    V, N, D = 4, 6, 10
    w = previous_token_head(V, N, D)
    one = read_weights({"W_E": w.W_E.float(), "W_pos": w.W_pos, "W_Q": w.W_Q[0, 0], "W_K": w.W_K[0]},
                       V, N, D, n_layers=1)
    assert one.W_Q.shape == (1, 1, D, N + 1) and one.W_O.shape == (1, 1, N + 1, D)
    assert one.W_E.dtype == torch.float64 and float(one.W_U.abs().sum()) == 0.0
    for bad, says in ((None, "it returned None"),
                      ({"W_E": w.W_E, "W_pos": w.W_pos, "W_Q": w.W_Q}, "no W_K"),
                      ({"W_E": w.W_E.T, "W_pos": w.W_pos, "W_Q": w.W_Q, "W_K": w.W_K},
                       "W_E has shape (10, 4)"),
                      ({"W_E": w.W_E, "W_pos": w.W_pos, "W_Q": w.W_Q, "W_K": w.W_K[..., :3]},
                       "W_K has shape (1, 1, 10, 3)"),
                      ({"W_E": w.W_E, "W_pos": w.W_pos, "W_Q": w.W_Q * math.inf, "W_K": w.W_K},
                       "inf or NaN")):
        with pytest.raises(CheckError) as e:
            read_weights(bad, V, N, D, n_layers=1)
        assert says in str(e.value), str(e.value)
