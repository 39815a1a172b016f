"""`POST /api/lens`: what the page's lens views draw, from :mod:`qkv.lens` (the command line's
`qkv lens` reads the same functions): the next-token logits (the page computes softmax(z / T)
itself, so its temperature slider needs no request), the logit lens, every head as a
thumbnail with its scores, the attention rollout through every layer, and the same with heads
knocked out; one head's q·k row; and patching (`POST /api/patch`): the estimate first
(attribution patching, one piece), the exact sweep when asked (in pieces), both with their
agreement."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from fastapi import Request as HTTPRequest

from qkv import lens
from qkv.attention.rollout import attention_rollout
from qkv.errors import InputError
from qkv.lens.atp import quantised
from qkv.lens.cache import run_with_cache_steps
from qkv.lens.causal import PatchPair, ablate_steps, patch_steps
from qkv.lens.heads import query_key_steps
from qkv.pipelines import CausalLM, SentenceEncoder
from qkv.pipelines import attention as text
from qkv.serve.schemas import (
    HistoryRequest,
    HistoryResponse,
    LensRequest,
    LensResponse,
    LogitLensCells,
    PatchAgreement,
    PatchRequest,
    PatchResponse,
    QKRequest,
    QKResponse,
    RolloutCells,
    TokenCandidate,
)

if TYPE_CHECKING:
    from qkv.serve.registry import Lease


THUMB = 16  # thumbnails are pooled to at most THUMB x THUMB
CANDIDATES = 20
LENS_POSITIONS = 16  # the logit lens of the last 16 positions (a table wider is not read)
ROLLOUT_ROWS = 32  # the rollout's rows for the last 32 query positions, every key


def _round(t: torch.Tensor, digits: int) -> Any:
    """A tensor as nested lists of floats rounded to ``digits`` decimals (as ``round`` would, in
    float64), without a Python call per number."""
    return np.round(t.double().numpy(), digits).tolist()


def _thumbs(patterns: list[torch.Tensor]) -> list[list[list[float]]]:
    """L tensors (H, T, T) -> L·H lists of at most THUMB x THUMB (average-pooled), layer-major."""
    p = torch.stack(patterns)  # (L, H, T, T)
    L, H, T, _ = p.shape
    if T > THUMB:
        p = F.adaptive_avg_pool2d(p.reshape(L * H, T, T), THUMB)
    return _round(p.reshape(L * H, *p.shape[-2:]), 4)


def _scores(lm: CausalLM | SentenceEncoder, cache: dict, key: object) -> lens.HeadScores:
    """Head scores of a model file's version, computed once (they do not depend on the text);
    the cache forgets everything past 32 models."""
    if key not in cache:
        if len(cache) >= 32:
            cache.clear()
        cache[key] = lens.head_scores(lm)
    return cache[key]


def lens_response(lm: CausalLM | SentenceEncoder, req: LensRequest, max_tokens: int,
                  score_cache: dict, key: object) -> Generator[None, None, LensResponse]:
    """Everything the page's lens views need for one text (see :class:`LensResponse`), in
    pieces: a block of a forward pass or a chunk of the logit lens per ``next``."""
    t0 = time.perf_counter()
    ids, notes = text.encode_text(lm, req.text, max_tokens, keep="last" if lm.kind == "decoder" else "first")
    heads = lens.causal.check_heads(lm, req.ablate)
    cache = yield from run_with_cache_steps(lm, ids)
    scores = _scores(lm, score_cache, key)
    base = cache.out
    out = (yield from ablate_steps(lm, ids, heads, req.mode)) if heads else base
    roll = attention_rollout([p[None] for p in cache.pattern])[0]  # (T, T), the same forward pass
    rows = list(range(max(0, len(ids) - ROLLOUT_ROWS), len(ids)))
    rollout = RolloutCells(positions=rows, values=_round(roll[rows], 5))
    resp = dict(model=req.model, kind=lm.kind, tokens=cache.tokens, n_layers=lm.n_layers, n_heads=lm.n_heads,
                ablated=heads, scores={t: s.tolist() for t, s in scores.by_type().items()},
                labels=scores.labels, thumbs=_thumbs(cache.pattern) if req.thumbs else None, notes=notes,
                rollout=rollout,
                candidates=[])
    if lm.kind == "decoder":
        last = out[-1]
        dec = lm.tokenizer.decode
        resp["logits"] = _round(last, 5)
        resp["base_logits"] = _round(base[-1], 5) if heads else None
        resp["candidates"] = [TokenCandidate(id=int(i), token=dec([int(i)]))
                              for i in last.topk(min(CANDIDATES, last.numel())).indices]
        ll = lens.logit_lens(lm, cache)  # the same forward pass
        positions = list(range(max(0, len(ids) - LENS_POSITIONS), len(ids)))
        probs, top = yield from ll.top_steps(1, positions)
        resp["lens"] = LogitLensCells(rows=ll.rows, positions=positions,
                                      top=[[dec([i]) for i in row] for row in top[..., 0].tolist()],
                                      prob=_round(probs[..., 0], 4))
    elif heads:
        resp["embedding_change"] = 1 - float(F.cosine_similarity(out.mean(0), base.mean(0), dim=0))
    return LensResponse(**resp, threshold=lens.NAMED_AT, seconds=time.perf_counter() - t0)


def qk_response(lm: CausalLM | SentenceEncoder, req: QKRequest, max_tokens: int
                ) -> Generator[None, None, QKResponse]:
    """One head's attention row term by term (:func:`qkv.lens.query_key`), in pieces."""
    t0 = time.perf_counter()
    ids, _ = text.encode_text(lm, req.text, max_tokens, keep="last" if lm.kind == "decoder" else "first")
    qk = yield from query_key_steps(lm, ids, req.layer, req.head, req.query)
    return QKResponse(model=req.model, layer=qk.layer, head=qk.head, query=qk.query,
                      query_token=qk.query_token, keys=qk.tokens, dots=qk.dots.tolist(),
                      scaled=qk.scaled.tolist(), weights=qk.weights.tolist(), head_dim=qk.q.numel(),
                      seconds=time.perf_counter() - t0)


PATCH_TOKENS = 64  # the exact sweep runs a forward pass per cell: longer prompts are refused, not cut
AGREE_K = 10  # the agreement's top-k recall: of the sweep's 10 largest cells, how many the estimate finds


def _table(values: torch.Tensor) -> list[list[float | None]]:
    """(R, C) values as JSON rows, unrounded (float32 goes through JSON exactly); None where a
    value is not finite (patching's undefined normalisation: the clean and corrupt runs tie)."""
    return [[v if math.isfinite(v) else None for v in row] for row in values.double().tolist()]


def _agreement(estimate: torch.Tensor, exact: torch.Tensor) -> PatchAgreement | None:
    """:func:`qkv.lens.agreement` of the two tables; None when either is undefined (NaN)."""
    if not (estimate.isfinite().all() and exact.isfinite().all()):
        return None
    a = lens.agreement(estimate, exact, k=AGREE_K)
    return PatchAgreement(spearman=a.spearman if math.isfinite(a.spearman) else None, recall=a.recall, k=a.k)


def _estimate(lm: CausalLM, req: PatchRequest, ids: list[list[int]]) -> lens.PatchEstimate:
    """Attribution patching (:func:`qkv.lens.attribution_patch`), whole: two forward passes and
    one backward pass, with gradients, so no part of it can wait between two of the loop's
    slices (on SmolLM2 fp32 it holds the loop for ~0.3 s, once). A model the registry loaded
    quantised (:meth:`~qkv.pipelines.CausalLM.set_weights`) has no gradients: one line that
    says what works instead."""
    if quantised(lm.model):
        raise InputError(f"{req.model} is served with {lm.weights} weights, which have no gradients: the "
                         'estimate needs float weights; ask for the exact sweep (method "exact"), or start '
                         "the server with --weights fp32")
    return lens.attribution_patch(lm, ids[0], ids[1], site=req.site, answer=req.answer, wrong=req.wrong)


def patch_response(lm: CausalLM, req: PatchRequest
                   ) -> Generator[tuple[int, int] | None, None, PatchResponse]:
    """Patching of the clean prompt into the corrupt one, as ``req.method`` asks: the estimate
    (one piece), or the exact sweep (:func:`qkv.lens.patch_steps`: a block of a patched forward
    pass per ``next``); with ``req.compare``, the estimate first (its own piece) and the
    agreement of the two."""
    t0 = time.perf_counter()
    ids = [text.encode_text(lm, t, lm.context)[0] for t in (req.clean, req.corrupt)]
    if max(len(i) for i in ids) > PATCH_TOKENS:
        raise InputError(f"patching here takes prompts of at most {PATCH_TOKENS} tokens (the exact sweep "
                         f"runs a forward pass per cell); these have {len(ids[0])} and {len(ids[1])}")
    est = _estimate(lm, req, ids) if req.method == "estimate" or req.compare else None
    if est is not None and req.method == "estimate":
        return _patch_json(req, est, est.values, est, t0)
    if est is not None:
        yield None  # the estimate was this slice's piece: the running batches step before the sweep
    exact = yield from patch_steps(lm, ids[0], ids[1], site=req.site, answer=req.answer, wrong=req.wrong)
    return _patch_json(req, exact, exact.values, est, t0)


def _patch_json(req: PatchRequest, p: PatchPair, values: torch.Tensor, est: lens.PatchEstimate | None,
                t0: float) -> PatchResponse:
    """The response for ``p``, the estimate or the exact sweep (``values``: its table, (L, H) or
    (L, T)); ``est``: the estimate when one was computed (``p`` itself, or beside the sweep)."""
    beside = est if est is not None and est is not p else None
    rows = [f"layer {i}" for i in range(values.shape[0])]
    cols = p.clean_tokens if p.site == "resid" else [str(h) for h in range(values.shape[1])]
    return PatchResponse(
        model=req.model, method=req.method, site=p.site, rows=rows, columns=cols, values=_table(values),
        answer=p.answer, wrong=p.wrong, clean_diff=p.clean_diff, corrupt_diff=p.corrupt_diff,
        estimate=_table(beside.values) if beside is not None else None,
        estimate_seconds=est.seconds if est is not None else None,
        agreement=_agreement(beside.values, values) if beside is not None else None,
        saturated=[list(c) for c in est.saturated()] if est is not None else [],
        seconds=time.perf_counter() - t0)


class LensEndpoints:
    """The lens's handlers of :class:`qkv.serve.api.Explorer` (which provides ``cfg``,
    ``head_scores``, ``registry``, ``_errors`` (errors as 4xx), ``_check_text`` and ``_compute``:
    a function of the held model run in the server's compute loop, where its hooks and edits
    are seen by no other request's forward pass)."""

    cfg: Any
    head_scores: dict[Any, Any]
    registry: Any

    def _errors(self) -> AbstractContextManager[None]: ...

    def _check_text(self, text: str) -> None: ...

    def _compute(self, model_id: str, fn: Callable[[Lease], Any], label: str = "request",
                 request: Any = None, sweep: bool = False, pieces: bool = False,
                 http: HTTPRequest | None = None) -> Any: ...

    def lens(self, req: LensRequest, http: HTTPRequest) -> LensResponse:
        """What a text model does with ``text``: next-token logits (with ``ablate``'s heads
        knocked out), the logit lens, every head's thumbnail and scores (:mod:`qkv.lens`).
        ``Accept: application/x-ndjson``: where it stands, then the answer (ComputeEvent lines)."""
        self._check_text(req.text)
        return self._compute(req.model, lambda lease: lens_response(
            self._text_model(lease, req.model), req, self.cfg.max_tokens, self.head_scores, lease.ref.key),
            "lens", request=req, pieces=True, http=http)

    def history(self, req: HistoryRequest) -> HistoryResponse:
        """A GPT run's head scores at each evaluation (its history.jsonl): the page's step slider."""
        from pathlib import Path

        from qkv.lens.history import read_history
        from qkv.training.run import HISTORY

        with self._errors():
            ref = self.registry.resolve(req.model)
            h = read_history(Path(ref.path) / HISTORY) if ref.source == "run" and ref.path else None
            if h is None:
                raise InputError(f"{req.model} has no training history: runs of `qkv train gpt` record "
                                 "their heads' scores at each evaluation (history.jsonl)")
        scores = {t: s.tolist() for t, s in h.scores.items()}
        return HistoryResponse(model=req.model, steps=h.steps, scores=scores,
                               loss_first=h.loss_first, loss_second=h.loss_second, formed=h.formed(),
                               copying=h.copying_from())

    def qk(self, req: QKRequest, http: HTTPRequest) -> QKResponse:
        """One head's attention row for one query token, term by term (q·k, / √d, softmax)."""
        self._check_text(req.text)
        return self._compute(req.model, lambda lease: qk_response(
            self._text_model(lease, req.model), req, self.cfg.max_tokens), "q·k", request=req, pieces=True,
            http=http)

    def patch(self, req: PatchRequest, http: HTTPRequest) -> PatchResponse:
        """Patching from ``clean`` into ``corrupt`` (decoders): the estimate (an interactive
        computation, one piece) or the exact sweep (a sweep, in pieces; ``compare``: the estimate
        and the agreement too). Its hooks and its backward pass run on the shared model only in
        the compute loop, where nothing else runs meanwhile; identical requests (``method`` and
        ``compare`` included: the request's JSON is the key) share one answer."""
        self._check_text(req.clean)
        self._check_text(req.corrupt)

        def run(lease: Lease) -> Generator[tuple[int, int] | None, None, PatchResponse]:
            lm = self._text_model(lease, req.model)
            if not isinstance(lm, CausalLM):
                raise InputError(f"{req.model} is an encoder: patching measures a next-token answer, "
                                 "which it does not predict")
            return (yield from patch_response(lm, req))

        return self._compute(req.model, run, "patch", request=req, sweep=req.method == "exact", pieces=True,
                             http=http)

    @staticmethod
    def _text_model(lease: Lease, name: str) -> CausalLM | SentenceEncoder:
        lm = lease.src
        if not isinstance(lm, CausalLM | SentenceEncoder):
            raise InputError(f"{name} is a {lease.ref.label} model: the lens reads text models made of "
                             "attention heads (decoders and encoders)")
        return lm

