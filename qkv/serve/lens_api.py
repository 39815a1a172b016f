"""`POST /api/lens`: what the page's lens views draw, from :mod:`qkv.lens` (the command line's
`qkv lens` reads the same functions): the next-token logits (the page computes softmax(z / T)
itself, so its temperature slider needs no request), the logit lens, every head as a
thumbnail with its scores, and the same with heads knocked out."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from qkv import lens
from qkv.errors import InputError
from qkv.pipelines import CausalLM, SentenceEncoder
from qkv.pipelines import attention as text
from qkv.serve.schemas import LensRequest, LensResponse, LogitLensCells, TokenCandidate

THUMB = 16  # thumbnails are pooled to at most THUMB x THUMB
CANDIDATES = 20
LENS_POSITIONS = 16  # the logit lens of the last 16 positions (a table wider is not read)


def _thumbs(patterns: list[torch.Tensor]) -> list[list[list[float]]]:
    """L tensors (H, T, T) -> L·H lists of at most THUMB x THUMB (average-pooled), layer-major."""
    out = []
    for p in patterns:
        T = p.shape[-1]
        small = F.adaptive_avg_pool2d(p[None], min(T, THUMB))[0] if T > THUMB else p
        out += [[[round(float(v), 4) for v in row] for row in h] for h in small]
    return out


def _scores(lm: CausalLM | SentenceEncoder, cache: dict, key: object) -> lens.HeadScores:
    """Head scores of a model file's version, computed once (they do not depend on the text);
    the cache forgets everything past 32 models."""
    if key not in cache:
        if len(cache) >= 32:
            cache.clear()
        cache[key] = lens.head_scores(lm)
    return cache[key]


def lens_response(lm: CausalLM | SentenceEncoder, req: LensRequest, max_tokens: int,
                  score_cache: dict, key: object) -> LensResponse:
    """Everything the page's lens views need for one text (see :class:`LensResponse`)."""
    t0 = time.perf_counter()
    ids, notes = text.encode_text(lm, req.text, max_tokens, keep="last" if lm.kind == "decoder" else "first")
    heads = lens.causal.check_heads(lm, req.ablate)
    cache = lens.run_with_cache(lm, ids)
    scores = _scores(lm, score_cache, key)
    base = cache.out
    out = lens.ablate(lm, ids, heads, req.mode) if heads else base
    resp = dict(model=req.model, kind=lm.kind, tokens=cache.tokens, n_layers=lm.n_layers, n_heads=lm.n_heads,
                ablated=heads, scores={t: s.tolist() for t, s in scores.by_type().items()},
                labels=scores.labels, thumbs=_thumbs(cache.pattern) if req.thumbs else None, notes=notes,
                candidates=[])
    if lm.kind == "decoder":
        last = out[-1]
        dec = lm.tokenizer.decode
        resp["logits"] = [round(float(v), 5) for v in last]
        resp["base_logits"] = [round(float(v), 5) for v in base[-1]] if heads else None
        resp["candidates"] = [TokenCandidate(id=int(i), token=dec([int(i)]))
                              for i in last.topk(min(CANDIDATES, last.numel())).indices]
        ll = lens.logit_lens(lm, cache)  # the same forward pass
        positions = list(range(max(0, len(ids) - LENS_POSITIONS), len(ids)))
        probs, top = ll.top(1, positions)
        resp["lens"] = LogitLensCells(rows=ll.rows, positions=positions,
                                      top=[[dec([int(i)]) for i in row] for row in top[..., 0]],
                                      prob=[[round(float(p), 4) for p in row] for row in probs[..., 0]])
    elif heads:
        resp["embedding_change"] = 1 - float(F.cosine_similarity(out.mean(0), base.mean(0), dim=0))
    elif not isinstance(lm, SentenceEncoder):
        raise InputError(f"{req.model} is not a text model the lens reads")
    return LensResponse(**resp, seconds=time.perf_counter() - t0)
