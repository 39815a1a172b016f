"""Build the weights by hand: the student sets the matrices of a tiny attention-only Transformer
so that a head does one job (look at the previous token, at the first token, at earlier copies of
the same token, average everything, complete a repeat), and the checks read what it does.

The model is the one of Elhage et al. 2021 ("A Mathematical Framework for Transformer Circuits"),
written out with its float64 forward pass and qkv's lens on it in :mod:`qkv.learn.handmade_model`
(CS189 Lec 22: attention is the only cross-token mixing, the MLP the only non-linearity besides
softmax, and here there is none). The checks judge behaviour only: the attention pattern on
random token sequences, measured with that float64 forward pass; the predictions where the
behaviour reaches the output (on [r₁ … r_R r₁ … r_R], the induction head of Olsson et al. 2022);
and qkv's own lens, :func:`qkv.lens.heads.score_model`, run on a real qkv GPT (``--mlp none``)
with the student's weights loaded, which must name the intended head after its job. Inputs come
from :func:`~qkv.learn.exercise.gen`, so a grader moves them with ``other_inputs()``.

Shapes: B sequences, T tokens, V vocabulary, N context (n_ctx), D d_model, L layers, H heads,
Dh d_head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.learn.exercise import CheckError, Exercise, check, gen
from qkv.learn.handmade_model import (
    NEED,
    Forward,
    Hand,
    forward,
    lens_says,
    lens_scores,
    need_lens,
    read_weights,
)
from qkv.lens import NAMED_AT


def random_tokens(vocab: int, n_ctx: int, seed: int, batch: int = 8) -> Tensor:
    return torch.randint(vocab, (batch, n_ctx), generator=gen(seed))


def repeated(vocab: int, R: int, seed: int, batch: int = 8) -> Tensor:
    """(batch, 2R): R distinct random tokens, then the same R again."""
    g = gen(seed)
    half = torch.stack([torch.randperm(vocab, generator=g)[:R] for _ in range(batch)])
    return torch.cat([half, half], dim=1)


# --------------------------------------------------------------------------- reading a pattern


Diagnose = Callable[[Tensor, Tensor, int, Tensor], str]  # (row weights, row scores, i, targets) -> why
Spread = Literal["uniform", "diffuse", "self", "elsewhere"]


def spread(row: Tensor, scores: Tensor, i: int, target: Tensor) -> tuple[Spread, str]:
    """Where query i's weight went instead, as (kind, words): kind "uniform" (every key alike),
    "diffuse" (the right key leads, not by enough), "self" (the query's own position) or
    "elsewhere"."""
    allowed, wanted = row[: i + 1], target[: i + 1]
    if float(allowed.max() - allowed.min()) < 0.01:
        return "uniform", (f"all {i + 1} keys get the same weight 1/{i + 1}: the scores do not depend on "
                           "the key. W_Q·W_Kᵀ must give the wanted key a higher score than the others")
    others = allowed.masked_fill(wanted, -1.0)
    j = int(others.argmax())
    if float(allowed[wanted].max()) >= float(others.max()):
        s = scores[: i + 1]
        gap = float(s[wanted].max() - s[~wanted].max())
        return "diffuse", (f"the right key has the highest score, only {gap:.2f} above the next (after / "
                           f"√d_head); 0.9 of the weight over {i + 1} keys needs a gap of about ln(9·{i}) ≈ "
                           f"{math.log(9 * i):.1f}: your W_Q·W_Kᵀ is not sharp enough — scale it up "
                           "(e.g. 20·√d_head)")
    if j == i:
        return "self", "most of it goes to the query's own position (the current token)"
    return "elsewhere", f"most of it goes to key {j}"


def first_failure(patterns: Tensor, scores: Tensor, target: Tensor, rows: Tensor, tokens: Tensor,
                  what: str, diagnose: Diagnose) -> None:
    """CheckError naming the smallest query (over the batch) whose weight on ``target`` (B, T, T)
    is below NEED, where the rest goes and why; ``rows`` (B, T): the queries judged."""
    on = (patterns * target).sum(-1)  # (B, T)
    bad = rows & (on < NEED)
    if not bad.any():
        return
    b, i = min(bad.nonzero().tolist(), key=lambda bi: (bi[1], bi[0]))
    row, tgt = patterns[b, i], target[b, i]
    rest = [(j, float(row[j])) for j in row[: i + 1].argsort(descending=True).tolist() if not tgt[j]]
    where = ", ".join(f"key {j} ({v:.2f})" for j, v in rest[:3] if v >= 0.01) or "no key above 0.01"
    keys = tgt.nonzero()[:, 0].tolist()
    seq = tokens[b, : i + 1].tolist()
    named = f"key{'s' if len(keys) > 1 else ''} {', '.join(map(str, keys))}"
    raise CheckError(f"on the tokens {seq}, query {i} puts {float(on[b, i]):.2f} of its weight on "
                     f"{what} ({named}; {NEED} needed); "
                     f"the rest goes to {where}: {diagnose(row, scores[b, i], i, tgt)}")


# --------------------------------------------------------------------------- the shared stub text

MODEL = """
The model: attention only (no MLP, no LayerNorm, no biases; Elhage et al. 2021), causal.

    x_i = W_E[t_i] + W_pos[i]                       the residual stream at position i, (d_model,)
    for each layer, every head h reading the same x:
        q_i = x_i W_Q[h],  k_j = x_j W_K[h],  v_j = x_j W_V[h]                            (d_head,)
        A[i, j] = softmax over j ≤ i of (q_i · k_j) / √d_head                   (causal mask)
        x_i ← x_i + Σ_h Σ_j A[i, j] v_j W_O[h]
    logits_i = x_i W_U                               (vocab,): the prediction of token i + 1

Return a dict (or any object with these attributes) of torch tensors:
    W_E (vocab, d_model), W_pos (n_ctx, d_model),
    W_Q, W_K, W_V (n_layers, n_heads, d_model, d_head), W_O (n_layers, n_heads, d_head, d_model),
    W_U (d_model, vocab).
d_head is yours to choose (W_Q's last dimension). A one-layer model may give (n_heads, d_model,
d_head), and a single head plain (d_model, d_head) / (d_head, d_model) matrices. W_V, W_O and
W_U may be left out where the output does not matter (they are zeros then).

One-hot embeddings are allowed and recommended: put token t at column t (W_E = [I | 0]) and
position i at column vocab + i, so that every direction of the stream means one thing, and
W_Q, W_K read exactly the part they need. Remember the 1/√d_head: a wanted key needs a score
ln(9·i) ≈ 5 above the others' (after the division) to get 0.9 of query i's weight.
"""

# --------------------------------------------------------------------------- previous token

S_POSITIONS = "Positional encodings: learned, RoPE, relative"


def _previous_why(pattern: Tensor) -> Diagnose:
    """The diagnosis of a failing row of ``pattern`` (B, T, T), knowing the whole pattern: a head
    that looks two back fails first at query 1 (no key two back), where the row alone is uniform."""
    two_back = float(pattern.diagonal(offset=-2, dim1=-2, dim2=-1).mean())

    def why(row: Tensor, scores: Tensor, i: int, target: Tensor) -> str:
        kind, words = spread(row, scores, i, target)
        if two_back > 0.5:
            return (words + f". Queries i ≥ 2 put {two_back:.2f} of their weight on key i − 2 on average: "
                    "that is two back — an off-by-one between W_Q's positions and W_K's")
        if kind == "self":
            return (words + ": each query's best key is its own position, one later than the previous "
                    "token; look again at which position's query you paired with which position's key")
        return words

    return why


def _previous_sizes() -> tuple[tuple[int, int, int], ...]:
    return ((10, 16, 26), (14, 24, 41))


def _one_layer_pattern(f: Callable[..., Any], seed: int, targets: Callable[[Tensor], tuple[Tensor, Tensor]],
                       what: str, diagnose: Callable[[Tensor], Diagnose]) -> None:
    """For each size of :func:`_previous_sizes`, on random tokens (seeds ``seed``, ``seed + 1``):
    CheckError unless every head of the student's one-layer model puts ≥ NEED of each judged
    query's weight on its targets. ``targets(tokens)``: (B, T, T) the wanted keys and (B, T) the
    queries judged; ``diagnose(pattern)``: the diagnosis of a failing row, knowing the head's
    whole pattern (B, T, T)."""
    for n, (V, N, D) in enumerate(_previous_sizes()):
        w = read_weights(f(V, N, D), V, N, D, n_layers=1)
        tokens = random_tokens(V, N, seed=seed + n)
        out = forward(w, tokens)
        target, rows = targets(tokens)
        for h in range(w.W_Q.shape[1]):
            pattern = out.patterns[0][:, h]
            first_failure(pattern, out.scores[0][:, h], target, rows, tokens, what, diagnose(pattern))


def _one_layer_lens(f: Callable[..., Any], kind: str, what: str, seed: int) -> None:
    """:func:`need_lens` on head 0.0 of the student's one-layer model (the larger size)."""
    V, N, D = _previous_sizes()[1]
    need_lens(read_weights(f(V, N, D), V, N, D, n_layers=1), 0, 0, kind, what, seed=seed)


def _after_first(tokens: Tensor) -> Tensor:
    """(B, T): the queries i ≥ 1 (query 0 can only see itself)."""
    B, N = tokens.shape
    return (torch.arange(N) >= 1).expand(B, N)


@check("query i puts ≥ 0.9 of its weight on key i − 1, for every i ≥ 1 (random tokens, two sizes)")
def _previous_pattern(f) -> None:
    def targets(tokens: Tensor) -> tuple[Tensor, Tensor]:
        B, N = tokens.shape
        return torch.ones(N, N, dtype=torch.bool).tril(-1).triu(-1).expand(B, N, N), _after_first(tokens)

    _one_layer_pattern(f, 10, targets, "the previous token", _previous_why)


@check("qkv's lens, on a qkv GPT holding your weights, names your head a previous-token head")
def _previous_lens(f) -> None:
    _one_layer_lens(f, "previous", "previous-token head", seed=12)


PREVIOUS_TOKEN_HEAD = Exercise(
    name="previous_token_head",
    section=S_POSITIONS,
    difficulty=2,
    signature="(vocab, n_ctx, d_model)",
    stub="""
Set the weights of a one-layer, one-head model whose head attends to the previous token: query i
puts (almost) all its weight on key i − 1, whatever the tokens (query 0 can only see itself).
Such heads form in every trained language model; they are half of an induction head. The head
reads positions only, so the learned position embedding W_pos is what makes it possible.
"""
    + MODEL
    + """
Here d_model ≥ vocab + n_ctx; n_layers = n_heads = 1.

Example of the goal: for n_ctx = 4 the pattern is [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0],
[0, 0, 1, 0]] (to within 0.1 per row), on any tokens.
""",
    checks=(_previous_pattern, _previous_lens),
    hints=(
        "Positions one-hot: W_pos[i, vocab + i] = 1. Take d_head = n_ctx; let W_K give position j the "
        "key direction e_j: W_K[vocab + j, j] = 1 (W_E's columns may map to nothing).",
        "W_Q maps position i to a large multiple of the key direction of position i − 1: "
        "W_Q[vocab + i, i − 1] = s. Then q_i·k_j = s exactly when j = i − 1, 0 otherwise.",
        "The scores are divided by √d_head: take s = 20·√d_head, so the wanted key leads by 20.",
    ),
    see="qkv lens smollm2 --heads",
    solution="""
def previous_token_head(vocab, n_ctx, d_model):
    W_E = torch.zeros(vocab, d_model)
    W_E[:, :vocab] = torch.eye(vocab)
    W_pos = torch.zeros(n_ctx, d_model)
    W_pos[:, vocab:vocab + n_ctx] = torch.eye(n_ctx)
    d_head = n_ctx
    s = 20.0 * math.sqrt(d_head)
    W_Q = torch.zeros(d_model, d_head)
    W_K = torch.zeros(d_model, d_head)
    for j in range(n_ctx):
        W_K[vocab + j, j] = 1.0  # position j answers with direction j
    for i in range(1, n_ctx):
        W_Q[vocab + i, i - 1] = s  # position i asks for position i - 1
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K}
""",
)


# --------------------------------------------------------------------------- first token

S_QK = "2.1 Self-attention: every token a query, a key and a value; why W_Q ≠ W_K"


def _first_why(row: Tensor, scores: Tensor, i: int, target: Tensor) -> str:
    kind, why = spread(row, scores, i, target)
    if kind == "uniform":
        return (why + ". If W_Q = W_K (both reading position 0), only query 0 asks for anything: every "
                "query must ask 'where is position 0?' — read a direction every position has (e.g. the "
                "token one-hots' sum) with W_Q, and position 0 with W_K: the two questions differ")
    if kind == "self":
        return why + ": the scores reward a query matching itself; only key 0 should score high"
    return why


@check("query i puts ≥ 0.9 of its weight on key 0, for every i ≥ 1 (random tokens, two sizes)")
def _first_pattern(f) -> None:
    def targets(tokens: Tensor) -> tuple[Tensor, Tensor]:
        B, N = tokens.shape
        target = torch.zeros(B, N, N, dtype=torch.bool)
        target[:, :, 0] = True
        return target, _after_first(tokens)

    _one_layer_pattern(f, 20, targets, "the first token", lambda _: _first_why)


@check("qkv's lens, on a qkv GPT holding your weights, names your head a first-token head")
def _first_lens(f) -> None:
    _one_layer_lens(f, "first", "first-token head", seed=22)


FIRST_TOKEN_HEAD = Exercise(
    name="first_token_head",
    section=S_QK,
    difficulty=1,
    signature="(vocab, n_ctx, d_model)",
    stub="""
Set the weights of a one-layer, one-head model whose head attends to the first token: every
query i ≥ 1 puts (almost) all its weight on key 0, whatever the tokens. Trained models are full
of such heads (the "attention sink", Xiao et al. 2023): a place to put attention when there is
nothing to look at. It is the lecture's "why W_Q ≠ W_K" in one head: the query asks one question
("where is the start?") of every position, the key answers another ("I am the start").
"""
    + MODEL
    + """
Here d_model ≥ vocab + n_ctx; n_layers = n_heads = 1.

Example of the goal: for n_ctx = 4 the pattern is [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0],
[1, 0, 0, 0]] (to within 0.1 per row), on any tokens.
""",
    checks=(_first_pattern, _first_lens),
    hints=(
        "One head dimension is enough: d_head = 1. The key: only position 0 has one, W_K[vocab + 0, 0] = 1.",
        "The query must be the same large number s at every position. There are no biases, but every "
        "stream holds exactly one token one-hot: W_Q[t, 0] = s for every token t gives q_i = s.",
        "Then q_i·k_0 = s and q_i·k_j = 0 for j > 0; s = 20·√d_head makes key 0 lead by 20.",
    ),
    see="qkv lens smollm2 --heads",
    solution="""
def first_token_head(vocab, n_ctx, d_model):
    W_E = torch.zeros(vocab, d_model)
    W_E[:, :vocab] = torch.eye(vocab)
    W_pos = torch.zeros(n_ctx, d_model)
    W_pos[:, vocab:vocab + n_ctx] = torch.eye(n_ctx)
    W_Q = torch.zeros(d_model, 1)
    W_Q[:vocab, 0] = 20.0  # every token asks the same question
    W_K = torch.zeros(d_model, 1)
    W_K[vocab, 0] = 1.0  # only position 0 answers
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K}
""",
)


# --------------------------------------------------------------------------- duplicate token

S_CONTENT = "1 Content-based attention: hardmax vs softmax, inner-product retrieval"


def _duplicate_why(row: Tensor, scores: Tensor, i: int, target: Tensor) -> str:
    kind, why = spread(row, scores, i, target)
    if kind == "self" or float(row[i]) > 0.3:
        return (f"the query itself gets {float(row[i]):.2f}: its own token matches itself too. Take that "
                "back with the positions: make W_Q·W_Kᵀ on the position columns −s·I, so that key i loses "
                "what the token match gave it and only earlier copies keep the score s")
    if kind == "elsewhere" and i >= 1 and float(row[i - 1]) > 0.5:
        return why + ", the previous token: the scores read positions; they should compare tokens"
    return why


@check("a query whose token occurred before puts ≥ 0.9 of its weight on those earlier occurrences")
def _duplicate_pattern(f) -> None:
    def targets(tokens: Tensor) -> tuple[Tensor, Tensor]:
        N = tokens.shape[1]
        same = tokens[:, :, None] == tokens[:, None, :]  # (B, T, T)
        target = same & torch.ones(N, N, dtype=torch.bool).tril(-1)
        return target, target.any(-1)  # judged: the queries whose token occurred before

    _one_layer_pattern(f, 30, targets, "earlier occurrences of the same token", lambda _: _duplicate_why)


@check("qkv's lens, on a qkv GPT holding your weights, names your head a duplicate-token head")
def _duplicate_lens(f) -> None:
    _one_layer_lens(f, "duplicate", "duplicate-token head", seed=32)


DUPLICATE_TOKEN_HEAD = Exercise(
    name="duplicate_token_head",
    section=S_CONTENT,
    difficulty=2,
    signature="(vocab, n_ctx, d_model)",
    stub="""
Set the weights of a one-layer, one-head model whose head attends to earlier occurrences of the
current token: when token t_i occurred before (at some j < i), query i puts (almost) all its
weight on those positions — not on itself. (Where t_i is new, the head may look anywhere.)
This is the lecture's inner-product retrieval: the query and the key match when the tokens are
equal (q_i · k_j large exactly when t_i = t_j), a hardmax made soft; and a lesson in the residual
stream: the same x_i holds the token and the position, and W_Q, W_K may read both.
"""
    + MODEL
    + """
Here d_model ≥ vocab + n_ctx; n_layers = n_heads = 1.

Example of the goal: on the tokens [3, 5, 3, 7, 5], query 2 (a 3) looks at key 0, query 4 (a 5)
at key 1; query 3 (the first 7) anywhere.
""",
    checks=(_duplicate_pattern, _duplicate_lens),
    hints=(
        "Token match: with one-hot tokens, W_Q = s·I and W_K = I on the token columns give q_i·k_j = s "
        "when t_i = t_j and 0 otherwise (d_head = vocab + n_ctx leaves room for the next step).",
        "That also matches the query with itself (its own token), and ties it with the earlier copies. "
        "Subtract a self-match on the positions: W_Q = −s·I, W_K = I on the position columns.",
        "Scores are then s·[t_i = t_j] − s·[i = j]: the earlier copies s, everything else 0. Take "
        "s = 20·√d_head.",
    ),
    see="qkv lens smollm2 --heads",
    solution="""
def duplicate_token_head(vocab, n_ctx, d_model):
    n = vocab + n_ctx
    W_E = torch.zeros(vocab, d_model)
    W_E[:, :vocab] = torch.eye(vocab)
    W_pos = torch.zeros(n_ctx, d_model)
    W_pos[:, vocab:n] = torch.eye(n_ctx)
    s = 20.0 * math.sqrt(n)
    W_Q = torch.zeros(d_model, n)
    W_K = torch.zeros(d_model, n)
    W_Q[:vocab, :vocab] = s * torch.eye(vocab)  # same token: +s
    W_K[:vocab, :vocab] = torch.eye(vocab)
    W_Q[vocab:n, vocab:n] = -s * torch.eye(n_ctx)  # same position (itself): -s
    W_K[vocab:n, vocab:n] = torch.eye(n_ctx)
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K}
""",
)


# --------------------------------------------------------------------------- the average of all tokens

S_AVERAGE = "2.1 Building it up: average all values, raw vectors first, then W_Q, W_K, W_V"


def _average_sizes() -> tuple[tuple[int, int, int], ...]:
    return ((6, 16, 28), (9, 24, 44))


def _mode(tokens: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(B, T) -> the most frequent token of each prefix 0..i, and whether it is the only one."""
    counts = torch.nn.functional.one_hot(tokens, vocab).cumsum(1)  # (B, T, V)
    top = counts.max(-1, keepdim=True).values
    return counts.argmax(-1), (counts == top).sum(-1) == 1


@check("query i gives each of its i + 1 keys the weight 1/(i + 1), within 0.02 (random tokens)")
def _average_pattern(f) -> None:
    for n, (V, N, D) in enumerate(_average_sizes()):
        w = read_weights(f(V, N, D), V, N, D, n_layers=1)
        tokens = random_tokens(V, N, seed=40 + n)
        out = forward(w, tokens)
        pattern = out.patterns[0][:, 0]  # (B, T, T)
        want = torch.ones(N, N, dtype=torch.float64).tril()
        want = want / want.sum(-1, keepdim=True)
        bad = (pattern - want).abs() > 0.02
        if bad.any():
            b, i, j = min(bad.nonzero().tolist(), key=lambda x: (x[1], x[0], x[2]))
            row = out.scores[0][b, 0, i, : i + 1]
            raise CheckError(
                f"on the tokens {tokens[b, : i + 1].tolist()}, query {i} gives key {j} the weight "
                f"{float(pattern[b, i, j]):.3f}; an average gives each of its {i + 1} keys 1/{i + 1} = "
                f"{1 / (i + 1):.3f}. Its scores (after / √d_head) range over {float(row.min()):.2f}.."
                f"{float(row.max()):.2f}: they must not depend on the key, as with W_Q·W_Kᵀ = 0")


@check("the model predicts the most frequent token so far (where it is unique), ≥ 0.9 of the time")
def _average_predicts(f) -> None:
    for n, (V, N, D) in enumerate(_average_sizes()):
        w = read_weights(f(V, N, D), V, N, D, n_layers=1)
        tokens = random_tokens(V, N, seed=45 + n, batch=16)
        logits = forward(w, tokens).logits
        pred = logits.argmax(-1)  # (B, T)
        mode, unique = _mode(tokens, V)
        unique[:, 0] = False  # one token seen: the mode is the current token, nothing to tell apart
        right = (pred == mode)[unique]
        if int(right.sum()) * 10 >= 9 * len(right):
            continue
        wrong = unique & (pred != mode)
        b, i = min(wrong.nonzero().tolist(), key=lambda x: (x[1], x[0]))
        current = (pred == tokens)[wrong & (mode != tokens)]
        if len(current) and float(current.double().mean()) > 0.5:
            why = ("it predicts the current token: the direct path x_i W_U (the current token's own "
                   "embedding read by W_U) outweighs the head's average. Write the average into a subspace "
                   "of its own (W_V W_O) and let W_U read only that")
        elif float(logits.std(1).max()) < 1e-9:
            why = ("the logits are the same everywhere: W_V W_O W_U carries nothing from the tokens to the "
                   "output")
        else:
            why = ("token t's share of the average should raise logit t and no other: W_E W_V W_O W_U should "
                   "be a positive multiple of the identity (vocab × vocab)")
        raise CheckError(f"the most frequent token so far is predicted at {int(right.sum())} of {len(right)} "
                         f"positions (0.9 needed). On the tokens {tokens[b, : i + 1].tolist()} the model "
                         f"predicts {int(pred[b, i])} where {int(mode[b, i])} is the most frequent: {why}")


@check("qkv's lens, on a qkv GPT holding your weights, names your head none of its types")
def _average_lens(f) -> None:
    V, N, D = _average_sizes()[1]
    scores, _ = lens_scores(read_weights(f(V, N, D), V, N, D, n_layers=1), seed=47)
    if scores.labels[0][0]:
        raise CheckError(f"{lens_says(scores, 0, 0)}: an average of every token so far looks at no one "
                         f"place (each of its scores should stay below the lens's threshold {NAMED_AT})")


AVERAGE_HEAD = Exercise(
    name="average_head",
    section=S_AVERAGE,
    difficulty=1,
    signature="(vocab, n_ctx, d_model)",
    stub="""
Set the weights of a one-layer, one-head model that predicts the most frequent token so far.
Its head takes the plain average of the tokens 0..i (the lecture's first step, "average all
values": every weight 1/(i + 1)), and its OV circuit W_V W_O carries each token's share to its
own logit, so that logit t at position i is proportional to how often t occurred in 0..i.
"""
    + MODEL
    + """
Here d_model ≥ 2·vocab + n_ctx (room for the tokens, the positions and the average); n_layers =
n_heads = 1.

Example of the goal: on the tokens [2, 0, 2, 1], position 3's logits rank token 2 first (2 of 4).
""",
    checks=(_average_pattern, _average_predicts, _average_lens),
    hints=(
        "An average is attention whose scores are all equal: W_Q = 0 (or W_K = 0) does it.",
        "W_V reads the token one-hots (d_head = vocab, W_V = [I; 0]); W_O writes them into free columns, "
        "e.g. vocab + n_ctx .. 2·vocab + n_ctx − 1.",
        "W_U reads only those columns (identity there, zeros on the token and position columns): the "
        "current token's own embedding then does not count twice.",
    ),
    see="qkv explain derivation",
    solution="""
def average_head(vocab, n_ctx, d_model):
    W_E = torch.zeros(vocab, d_model)
    W_E[:, :vocab] = torch.eye(vocab)
    W_pos = torch.zeros(n_ctx, d_model)
    W_pos[:, vocab:vocab + n_ctx] = torch.eye(n_ctx)
    out = vocab + n_ctx  # the columns where the average goes
    W_Q = torch.zeros(d_model, vocab)  # all scores 0: uniform weights
    W_K = torch.zeros(d_model, vocab)
    W_V = torch.zeros(d_model, vocab)
    W_V[:vocab] = torch.eye(vocab)
    W_O = torch.zeros(vocab, d_model)
    W_O[:, out:out + vocab] = torch.eye(vocab)
    W_U = torch.zeros(d_model, vocab)
    W_U[out:out + vocab] = torch.eye(vocab)
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K, "W_V": W_V, "W_O": W_O, "W_U": W_U}
""",
)


# --------------------------------------------------------------------------- induction

S_ATTENTION_ONLY = "3.2 The MLP is the only non-linearity besides softmax"


def _induction_sizes() -> tuple[tuple[int, int, int], ...]:
    return ((16, 32, 80), (20, 40, 104))


def _previous_share(pattern: Tensor) -> tuple[int, float]:
    """Layer 0's best previous-token head and its mean weight on key i − 1 (queries i ≥ 1)."""
    share = pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1))  # (H,)
    return int(share.argmax()), float(share.max())


def _induction_target(B: int, R: int) -> tuple[Tensor, Tensor]:
    """(B, 2R, 2R) the key after the earlier occurrence (i − R + 1) for second-half queries, and the
    queries judged: R + 1 .. 2R − 1 (query R's earlier occurrence is position 0, see hint 3)."""
    T = 2 * R
    target = torch.zeros(B, T, T, dtype=torch.bool)
    i = torch.arange(R, T)
    target[:, i, i - R + 1] = True
    rows = torch.zeros(B, T, dtype=torch.bool)
    rows[:, R + 1 :] = True
    return target, rows


def _moved_into_query(w: Hand, h0: int, h1: int) -> float:
    """How strongly layer-1 head ``h1``'s query reads what layer-0 head ``h0`` writes (the tokens it
    moves), relative to how it reads the current token: ‖W_E W_V W_O W_Q‖ / ‖W_E W_Q‖."""
    direct = torch.linalg.matrix_norm(w.W_E @ w.W_Q[1, h1])
    moved = torch.linalg.matrix_norm(w.W_E @ w.W_V[0, h0] @ w.W_O[0, h0] @ w.W_Q[1, h1])
    return float(moved / direct.clamp_min(1e-12))


def _induction_why(w: Hand, out: Forward, R: int) -> Diagnose:
    head, share = _previous_share(out.patterns[0])
    mixed, h1 = max((_moved_into_query(w, head, h), h) for h in range(w.W_Q.shape[1]))
    # each layer-1 head's mean weight, over the second copy, on the same token's earlier occurrence
    dup = out.patterns[1].diagonal(offset=-R, dim1=-2, dim2=-1).mean((0, -1))  # (H,)

    def why(row: Tensor, scores: Tensor, i: int, target: Tensor) -> str:
        if share < NEED:
            return (f"layer 0 has no previous-token head (its best, head 0.{head}, puts {share:.2f} of its "
                    "weight on the previous token on average). Layer 1 finds 'the token after the earlier "
                    "occurrence' as the key whose previous token is the query's token, so layer 0 must first "
                    "copy each position's previous token into a free subspace (a previous-token head whose "
                    "W_V W_O writes the token there)")
        if mixed > 0.5:
            return (f"layer 0 writes the previous token where layer 1's queries read the current one "
                    f"(head 1.{h1}'s query reads layer 0's output {mixed:.2f} times as strongly as the "
                    "token), "
                    "so each query asks for two tokens at once: give the previous token columns of its own "
                    "(layer 0's W_O writes there, layer 1's W_K reads there, its W_Q does not)")
        if float(dup.max()) > 0.3:
            return (f"layer 1's head {int(dup.argmax())} puts {float(dup.max()):.2f} of its weight on the "
                    "earlier occurrence of the same token itself (key i − R; most of the rest on the query "
                    "itself, the same token again): this is a "
                    "duplicate-token head. Its keys read the key's own token; they should read the previous "
                    "token that layer 0 wrote (K-composition: layer 1's W_K reads layer 0's output subspace)")
        return spread(row, scores, i, target)[1]

    return why


@check("a layer-1 head puts ≥ 0.9 of each repeated token's weight on the token after its earlier "
       "occurrence (random tokens written twice, two sizes)")
def _induction_pattern(f) -> None:
    for n, (V, N, D) in enumerate(_induction_sizes()):
        w = read_weights(f(V, N, D), V, N, D, n_layers=2)
        R = N // 2
        tokens = repeated(V, R, seed=50 + n)
        out = forward(w, tokens)
        target, rows = _induction_target(len(tokens), R)
        pattern = out.patterns[1]  # (B, H, T, T)
        on = (pattern * target[:, None]).sum(-1)[:, :, R + 1 :].mean((0, 2))  # (H,)
        # the head doing best, among those whose W_Q W_Kᵀ is not zero (an idle head averages everything)
        busy = torch.linalg.matrix_norm(w.W_Q[1] @ w.W_K[1].transpose(-1, -2)) > 0
        head = int(torch.where(busy, on, on - 2.0).argmax())
        first_failure(pattern[:, head], out.scores[1][:, head], target, rows, tokens,
                      f"the token after the earlier occurrence (layer 1, head {head})",
                      _induction_why(w, out, R))


@check("the model completes the repeat: top-1 ≥ 0.9 on the second copy (chance: 1/vocab)")
def _induction_predicts(f) -> None:
    for n, (V, N, D) in enumerate(_induction_sizes()):
        w = read_weights(f(V, N, D), V, N, D, n_layers=2)
        R = N // 2
        tokens = repeated(V, R, seed=55 + n)
        out = forward(w, tokens)
        pred = out.logits[:, R : 2 * R - 1].argmax(-1)  # positions R .. 2R-2 predict R+1 .. 2R-1
        truth = tokens[:, R + 1 :]
        right = int((pred == truth).sum())
        if right * 10 >= 9 * truth.numel():
            continue
        b, k = min((pred != truth).nonzero().tolist(), key=lambda x: (x[1], x[0]))
        i = R + k
        target, _ = _induction_target(len(tokens), R)
        on = (out.patterns[1] * target[:, None]).sum(-1)  # (B, H, T): each head's weight on the target
        attends = float(on[:, :, R + 1 :].mean((0, 2)).max())
        if float(pred.eq(tokens[:, R : 2 * R - 1]).double().mean()) > 0.5:
            why = ("it predicts the current token: the direct path x_i W_U outweighs what layer 1 copies. "
                   "Let layer 1's W_O write into a subspace of its own and W_U read only that")
        elif attends >= NEED:
            why = (f"layer 1 attends to the right key ({attends:.2f} of the weight on average) but what "
                   "it copies does not reach the logits: its OV circuit W_V W_O followed by W_U should map "
                   "token t to a large logit for t (W_E W_V W_O W_U a positive multiple of the identity)")
        else:
            why = ("layer 1 does not attend to the token after the earlier occurrence (see the check on the "
                   "pattern)")
        raise CheckError(
            f"the second copy is predicted right at {right} of {truth.numel()} positions (0.9 needed; chance "
            f"1/{V}). On the tokens {tokens[b, : i + 1].tolist()} the model predicts {int(pred[b, k])} at "
            f"position {i}, where the first copy says {int(tokens[b, i + 1])} comes next: {why}")


@check("qkv's lens, on a qkv GPT holding your weights, names a layer-0 head previous-token and a layer-1 "
       "head induction")
def _induction_lens(f) -> None:
    V, N, D = _induction_sizes()[0]
    w = read_weights(f(V, N, D), V, N, D, n_layers=2)
    scores, R = lens_scores(w, seed=57)
    for layer, kind, what in ((1, "induction", "an induction head"),
                              (0, "previous", "a previous-token head")):
        head = int(getattr(scores, kind)[layer].argmax())
        got = float(getattr(scores, kind)[layer, head])
        if scores.labels[layer][head] != kind or got < NEED:
            raise CheckError(f"{lens_says(scores, layer, head)} (its best {kind} score in layer {layer}, "
                             f"on 8 random sequences of {R} tokens written twice): layer {layer} needs "
                             f"{what}, scoring ≥ {NEED} as {kind!r}, and that its highest")


INDUCTION_HEAD = Exercise(
    name="induction_head",
    section=S_ATTENTION_ONLY,
    difficulty=3,
    signature="(vocab, n_ctx, d_model)",
    stub="""
Set the weights of a two-layer attention-only model that completes repeats: on [A B … A], predict
B. An induction head (Olsson et al. 2022) in layer 1 attends from the current token A to the
token that followed A's earlier occurrence, and copies it to the output. It cannot do that alone:
a key must know the token *before* it, which layer 0 provides (a previous-token head writing the
previous token into the stream: K-composition). With no MLP, attention is the only thing that
mixes tokens and softmax the only non-linearity (CS189 Lec 22): two heads composed are enough.
"""
    + MODEL
    + """
Here d_model ≥ 3·vocab + n_ctx (room for the token, the position, the previous token, the
answer); n_layers = 2; every head of both layers has the same d_head. The checks use random
tokens written twice, [r_1 … r_R r_1 … r_R] with R = n_ctx / 2 ≤ vocab (no token twice in a half).

Example of the goal: on [7, 2, 9, 4, 7, 2, 9], position 4 (the second 7) predicts 2, position 5
predicts 9, position 6 predicts 4.
""",
    checks=(_induction_pattern, _induction_predicts, _induction_lens),
    hints=(
        "Layer 0, head 0: your previous_token_head (positions only in W_Q, W_K), with W_V reading the token "
        "one-hots and W_O writing them into free columns P (the 'previous token' subspace).",
        "Layer 1, head 0: W_Q = s·(token one-hots), W_K reads subspace P: q_i·k_j = s when the token "
        "before j equals t_i. W_V reads the token one-hots, W_O writes them into an answer subspace, W_U "
        "reads only that.",
        "Position 0 has no previous token: layer 0 there attends to itself and writes t_0 into P, so query R "
        "(the first repeated token) ties key 0 with key 1. Optional fix: a query direction every token has "
        "(the token one-hots' sum) against −s on position 0's column in layer 1's W_K.",
    ),
    see="qkv train gpt --preset induction",
    solution="""
def induction_head(vocab, n_ctx, d_model):
    tok, pos, prev, ans = 0, vocab, vocab + n_ctx, 2 * vocab + n_ctx  # where each part lives
    d_head = max(n_ctx, vocab + 1)
    s = 20.0 * math.sqrt(d_head)
    eye = torch.eye(vocab)
    W_E = torch.zeros(vocab, d_model)
    W_E[:, tok:tok + vocab] = eye
    W_pos = torch.zeros(n_ctx, d_model)
    W_pos[:, pos:pos + n_ctx] = torch.eye(n_ctx)
    W_Q, W_K, W_V = (torch.zeros(2, 1, d_model, d_head) for _ in range(3))
    W_O = torch.zeros(2, 1, d_head, d_model)
    # layer 0: attend to the previous position, write its token into the prev columns
    for i in range(1, n_ctx):
        W_Q[0, 0, pos + i, i - 1] = s
    for j in range(n_ctx):
        W_K[0, 0, pos + j, j] = 1.0
    W_V[0, 0, tok:tok + vocab, :vocab] = eye
    W_O[0, 0, :vocab, prev:prev + vocab] = eye
    # layer 1: the current token looks for a key whose previous token is the same
    W_Q[1, 0, tok:tok + vocab, :vocab] = s * eye
    W_K[1, 0, prev:prev + vocab, :vocab] = eye
    W_Q[1, 0, tok:tok + vocab, vocab] = s  # every query, against position 0 (no previous token)
    W_K[1, 0, pos, vocab] = -1.0
    W_V[1, 0, tok:tok + vocab, :vocab] = eye
    W_O[1, 0, :vocab, ans:ans + vocab] = eye
    W_U = torch.zeros(d_model, vocab)
    W_U[ans:ans + vocab] = eye
    return {"W_E": W_E, "W_pos": W_pos, "W_Q": W_Q, "W_K": W_K, "W_V": W_V, "W_O": W_O, "W_U": W_U}
""",
)


HANDMADE: tuple[Exercise, ...] = (
    PREVIOUS_TOKEN_HEAD, FIRST_TOKEN_HEAD, DUPLICATE_TOKEN_HEAD, AVERAGE_HEAD, INDUCTION_HEAD,
)
