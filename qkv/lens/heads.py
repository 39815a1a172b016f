"""Naming heads by what their attention does, and attention rollout for text.

Each score is the mean weight a head puts where its type would look, over the query rows
where that place exists (a pattern whose rows sum to 1 scores 1 when it puts all its weight
there). They are read on R random tokens repeated twice, [r₁ … r_R r₁ … r_R] (Olsson et al.
2022, "In-context learning and induction heads"; TransformerLens's ``detect_head``, whose "mul"
measure divides by every row instead of the rows that have such a place):

    previous token   row i (i ≥ 1) at i − 1
    first token      row i (i ≥ 1) at 0           (the "attention sink", Xiao et al. 2023)
    duplicate token  row i in the second copy at i − R, the same token earlier
    induction        row i in the second copy at i − R + 1, the token that followed it last time

The in-context learning score is the loss on the second copy minus the loss on the first: an
induction head lets the model predict the repeat, so it falls below zero as one forms.

Where a head looks is not what it does: a model can copy with heads none of which scores as
induction (its copying spread over heads, or done by a pattern of its own). ``copying`` says what
each head does: the rise of the loss on the repeat when that head's output is zeroed (one forward
pass from its layer on per head, batched), and :meth:`HeadScores.copiers` names the heads whose
knock-out undoes at least :data:`COPY_AT` of what the repeat saves.

Shapes: L layers, H heads, T tokens (queries), S keys, R repeated tokens.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.rollout import attention_rollout
from qkv.errors import InputError
from qkv.lens.cache import encode, labels, run_with_cache_steps
from qkv.lens.causal import check_heads, knockout_sweep
from qkv.lens.hooks import Recorded, TextModel, blocks, device_of, finish, forward, hooked, is_decoder, shape

HEAD_TYPES: tuple[str, ...] = ("previous", "first", "duplicate", "induction")
# A head is named after its highest score when that score reaches NAMED_AT: the one threshold
# for naming or counting heads (qkv lens --heads, a run's "formed" lines and heads.png).
NAMED_AT = 0.5
THRESHOLD = NAMED_AT  # the name before issue 41
# A head "copies" when knocking it out undoes at least this share of what the repeat saves
# (loss_first - loss_second): one head that carries a quarter of the copying is part of its circuit.
COPY_AT = 0.25


def previous_token_score(pattern: Tensor) -> Tensor:
    """(..., T, T) -> (...): mean weight of rows 1.. on the key just before the query."""
    return pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)


def first_token_score(pattern: Tensor) -> Tensor:
    """(..., T, T) -> (...): mean weight of rows 1.. on key 0."""
    return pattern[..., 1:, 0].mean(-1)


def duplicate_token_score(pattern: Tensor, repeat: int) -> Tensor:
    """(..., 2R, 2R) -> (...): mean weight of the second copy's rows on the same token R back."""
    return pattern.diagonal(offset=-repeat, dim1=-2, dim2=-1).mean(-1)


def induction_score(pattern: Tensor, repeat: int) -> Tensor:
    """(..., 2R, 2R) -> (...): mean weight of the second copy's rows on the token after the same
    token's earlier occurrence (R − 1 back)."""
    return pattern.diagonal(offset=-(repeat - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)


@dataclass
class HeadScores:
    """Scores (L, H) per head type, each in [0, 1], and the in-context learning score.

    previous, first, duplicate, induction: see the module docstring. icl: loss on the second
    copy minus the first (nats; negative = the model uses the repeat). loss_first / loss_second:
    the two losses. labels: (L × H) names by threshold ("" for none).
    """

    previous: Tensor
    first: Tensor
    duplicate: Tensor
    induction: Tensor
    loss_first: float
    loss_second: float
    threshold: float = NAMED_AT
    copying: Tensor | None = None  # (L, H) nats the repeat's loss rises by with the head knocked out

    @property
    def icl(self) -> float:
        return self.loss_second - self.loss_first

    def by_type(self) -> dict[str, Tensor]:
        return {t: getattr(self, t) for t in HEAD_TYPES}

    @property
    def labels(self) -> list[list[str]]:
        """Each head's type: the one with its highest score, when that reaches ``threshold``."""
        stacked = torch.stack([getattr(self, t) for t in HEAD_TYPES])  # (4, L, H)
        best, which = stacked.max(0)
        return [[HEAD_TYPES[int(w)] if float(s) >= self.threshold else ""
                 for s, w in zip(rs, rw, strict=True)] for rs, rw in zip(best, which, strict=True)]

    @property
    def saved(self) -> float:
        """Nats a token the repeat saves: loss on the first copy minus loss on the second."""
        return self.loss_first - self.loss_second

    def copiers(self, share: float = COPY_AT) -> list[tuple[int, int, float]]:
        """(layer, head, rise) of the heads whose knock-out raises the repeat's loss by at least
        ``share`` of :attr:`saved`, largest first; [] when ``copying`` was not measured or the
        model does not copy (saves nothing)."""
        if self.copying is None or not self.saved > 0:
            return []
        H = self.copying.shape[1]
        out = [(i // H, i % H, float(v)) for i, v in enumerate(self.copying.flatten())
               if float(v) >= share * self.saved]
        return sorted(out, key=lambda r: -r[2])

    def named(self) -> list[tuple[int, int, str, float]]:
        """(layer, head, type, score) of every named head, strongest first."""
        out = []
        for layer, row in enumerate(self.labels):
            for head, t in enumerate(row):
                if t:
                    out.append((layer, head, t, float(getattr(self, t)[layer, head])))
        return sorted(out, key=lambda r: -r[3])


def repeated_tokens(vocab_size: int, repeat: int = 24, batch: int = 8, seed: int = 0,
                    avoid: tuple[int, ...] = ()) -> Tensor:
    """(batch, 2·repeat) random token ids, each row a random sequence twice; ids in ``avoid``
    (end-of-text, padding) are never drawn. The same ids for the same arguments.

    Where the vocabulary allows it, no token occurs twice in a half (drawn without
    replacement), so every token of the second half has exactly one earlier occurrence and a
    perfect induction head scores 1. (With replacement, a 27-letter vocabulary repeats about
    every fifth token of 24: the induction target is ambiguous and even a perfect copying
    mechanism spreads its attention over the look-alikes.) A vocabulary smaller than
    ``repeat`` is drawn with replacement."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in avoid if 0 <= i < vocab_size]] = False
    pool = allowed.nonzero()[:, 0]
    if len(pool) >= repeat:
        half = torch.stack([pool[torch.randperm(len(pool), generator=g)[:repeat]] for _ in range(batch)])
    else:
        half = pool[torch.randint(len(pool), (batch, repeat), generator=g)]
    return torch.cat([half, half], dim=1)


@torch.inference_mode()
def score_model(model: nn.Module, tokens: Tensor) -> HeadScores:
    """Head scores of a decoder (GPT) on repeated random tokens (B, 2R), from
    :func:`repeated_tokens`; weights from the reference attention, averaged over the batch."""
    repeat = tokens.shape[1] // 2
    was_training = model.training
    model.eval()
    try:
        out, weights = forward(model, tokens.to(device_of(model)), weights=True)
    finally:
        model.train(was_training)
    assert weights is not None
    pattern = torch.stack([w.float().mean(0) for w in weights]).cpu()  # (L, H, T, T)
    loss_first = loss_second = float("nan")
    if is_decoder(model):
        ce = F.cross_entropy(out[:, :-1].float().transpose(1, 2), tokens[:, 1:].to(out.device),
                             reduction="none").mean(0).cpu()  # (T - 1,): position i predicts i + 1
        loss_first, loss_second = float(ce[: repeat - 1].mean()), float(ce[repeat:].mean())
    return HeadScores(previous_token_score(pattern), first_token_score(pattern),
                      duplicate_token_score(pattern, repeat), induction_score(pattern, repeat),
                      loss_first, loss_second)


def _repeat_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Logits (B, R - 1, V) of the repeat's predictions (positions R..2R-2 of (B, 2R) tokens,
    predicting R + 1..) -> (B,) their mean cross-entropy, as :func:`score_model`'s loss_second."""
    repeat = tokens.shape[1] // 2
    return F.cross_entropy(logits.float().transpose(1, 2), tokens[:, repeat + 1:], reduction="none").mean(-1)


@torch.inference_mode()
def copy_effects(model: nn.Module, tokens: Tensor) -> Tensor:
    """(L, H): how much the loss on the repeat of ``tokens`` (B, 2R, from :func:`repeated_tokens`)
    rises, in nats a token, when each head's output is zeroed (its slice of W_O's input; one pass
    from its layer on, several heads' copies of the batch at once)."""
    tokens = tokens.to(device_of(model))
    rec = Recorded()
    with hooked(model, record=rec):
        out, _ = forward(model, tokens)
    R = tokens.shape[1] // 2
    repeat = slice(R, 2 * R - 1)  # the positions that predict the repeat: the only logits needed
    base = float(_repeat_loss(out[:, repeat], tokens).mean())

    def measure(logits: Tensor) -> Tensor:  # (n·B, R - 1, V) -> (n·B,)
        return _repeat_loss(logits, tokens.repeat(logits.shape[0] // tokens.shape[0], 1))

    return knockout_sweep(model, rec, measure, "zero", repeat) - base


def probe_avoid(tokenizer: Any, stop: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The ids a probe of random tokens must not draw: ``stop`` (end of text) and every token
    holding a line break. qkv's corpora and chat formats separate documents with line breaks,
    so one drawn at random starts a new document in the middle of the probe and the model
    rightly stops copying across it (the induction preset's model copies a repeated half at
    0.18 nats a letter, and not at all when the probe holds a line break)."""
    n = tokenizer.vocab_size
    inner = getattr(tokenizer, "tokenizer", None)
    if hasattr(inner, "decode_batch"):  # a Hugging Face tokenizer: decoded in one call
        texts = inner.decode_batch([[i] for i in range(n)])
    else:
        texts = [tokenizer.decode([i]) for i in range(n)]
    return tuple(sorted({*stop, *(i for i, t in enumerate(texts) if "\n" in t)}))


def head_scores(lm: TextModel, repeat: int = 24, batch: int = 8, seed: int = 0,
                effects: bool = False) -> HeadScores:
    """Every head's scores (see the module docstring) on ``batch`` random sequences of ``repeat``
    tokens, each repeated twice (fewer when the context is shorter), drawn from the tokenizer's
    ids (a model's vocabulary may be padded beyond them) less :func:`probe_avoid`'s. ``effects``
    (decoders): also each head's :func:`copy_effects` on the same tokens (``copying``)."""
    model = lm.model
    repeat = max(2, min(repeat, model.cfg.max_seq_len // 2))
    avoid = probe_avoid(lm.tokenizer, tuple(getattr(lm, "stop_ids", ()) or ()))
    vocab = min(model.cfg.vocab_size, lm.tokenizer.vocab_size)
    tokens = repeated_tokens(vocab, repeat, batch, seed, avoid)
    scores = score_model(model, tokens)
    if effects and is_decoder(model):
        scores.copying = copy_effects(model, tokens)
    return scores


@torch.inference_mode()
def text_rollout(lm: TextModel, text: str | list[int], residual: float = 0.5) -> tuple[list[str], Tensor]:
    """Attention rollout over a text (Abnar & Zuidema 2020, as for ViT): (tokens, (T, T)), row i:
    how much of output token i comes from each input token through every layer."""
    ids = encode(lm, text)
    _, weights = forward(lm.model, torch.tensor([ids], device=device_of(lm.model)), weights=True)
    assert weights is not None
    return labels(lm, ids), attention_rollout(weights, residual)[0].cpu()


@dataclass
class QueryKey:
    """One head's scores for one query token, term by term (CS189 Discussion 10 on a real model):
    ``dots`` (S,) q·k for each key up to the query (after RoPE where the model uses it),
    ``scaled`` = dots / √Dh (+ ALiBi's bias where the model has one), ``weights`` = softmax(scaled):
    the head's attention row. ``q`` (Dh,), ``k`` (S, Dh) the vectors themselves."""

    tokens: list[str]
    layer: int
    head: int
    query: int
    query_token: str
    q: Tensor
    k: Tensor
    dots: Tensor
    scaled: Tensor
    weights: Tensor


@torch.inference_mode()
def query_key(lm: TextModel, text: str | list[int], layer: int, head: int, query: int = -1) -> QueryKey:
    """The q·k computation behind one attention row: query token ``query`` (negative counts from
    the end) of ``head`` in ``layer``; a grouped-query head reads its group's key head."""
    return finish(query_key_steps(lm, text, layer, head, query))


@torch.inference_mode()  # on a generator: around each of its pieces
def query_key_steps(lm: TextModel, text: str | list[int], layer: int, head: int, query: int = -1
                    ) -> Generator[None, None, QueryKey]:
    """:func:`query_key` in pieces, one block per ``next``."""
    layer, head = check_heads(lm, [(layer, head)])[0]
    Dh = shape(lm.model)[2]
    cache = yield from run_with_cache_steps(lm, text)
    T = len(cache.ids)
    if not -T <= query < T:
        raise InputError(f"query must be a token position in [{-T}, {T - 1}], got {query}")
    query %= T
    block = blocks(lm.model)[layer]
    attn = block.attn
    x = cache.resid_pre[layer][None].to(next(lm.model.parameters()).dtype)
    h = block.norm1(x) if block.cfg.norm_position == "pre" else x
    q, k, _ = attn._project(h, None, getattr(lm.model, "rope", None), 0)  # (1, H, T, Dh), (1, K, T, Dh)
    kv = head // (attn.n_heads // attn.n_kv_heads)
    causal = block.cfg.causal
    S = query + 1 if causal else T
    qv, kv_ = q[0, head, query].double(), k[0, kv, :S].double()
    dots = kv_ @ qv
    scaled = dots / Dh ** 0.5
    alibi = getattr(lm.model, "alibi", None)
    if alibi is not None:
        scaled = scaled + alibi(T, T)[0, head, query, :S].double()
    return QueryKey(cache.tokens[:S] if causal else cache.tokens, layer, head, query, cache.tokens[query],
                    qv.float(), kv_.float(), dots.float(), scaled.float(), torch.softmax(scaled, -1).float())
