"""The decoding loop: feed the context, pick a token, append, repeat.

With a KV cache (the default) each step feeds only the newest token and attends over the
stored keys/values: O(T) work per token instead of re-running the whole context, O(T²).

Context policy, shared by both paths so that they produce identical tokens: the model sees
``tokens[start:]`` with at most ``max_seq_len`` tokens. When the sequence outgrows the
context, ``start`` jumps forward so that the newest ``max_seq_len // 2`` tokens remain; the
cached path then rebuilds its cache from that window (one prefill), instead of paying a full
forward pass on every later token as a sliding window would.

Shapes: B batch, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from qkv.generation.sampling import sample_next
from qkv.models.gpt import GPT


def crop_prompt(ids: Tensor, max_seq_len: int) -> tuple[Tensor, bool]:
    """Keep the last ``max_seq_len - 1`` tokens of (B, T) ids (room for one new token)."""
    limit = max(1, max_seq_len - 1)
    if ids.shape[1] <= limit:
        return ids, False
    return ids[:, -limit:], True


def text_pieces(decode: Callable[[Sequence[int]], str], ids: Iterable[int]) -> Iterator[str]:
    """Turn a stream of token ids into a stream of text, whole characters only.

    A byte-level BPE token can end in the middle of a UTF-8 character; text that decodes to a
    trailing U+FFFD is held back until a later token completes it (and flushed as it is at the
    end of the stream).
    """
    out: list[int] = []
    shown = ""
    for i in ids:
        out.append(i)
        text = decode(out)
        if not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text
    rest = decode(out)[len(shown):]
    if rest:
        yield rest


@torch.inference_mode()
def generate(
    model: GPT,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """Yield (B,) new token ids one step at a time (so callers can stream them).

    Args:
        prompt: (B, T0) token ids, T0 >= 1. Longer than the context: cropped (see
            :func:`crop_prompt`; the caller may warn).
        temperature / top_k / top_p: see :func:`qkv.generation.sampling.sample_next`.
        use_cache: decode with a preallocated KV cache (False = full forward each step).
        generator: RNG for sampling, for reproducible output.
    """
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (B, T) with T >= 1, got shape {tuple(prompt.shape)}")
    model.eval()
    W = model.cfg.max_seq_len
    tokens, _ = crop_prompt(prompt, W)
    # The cache never holds more than the context, nor more than this call can produce:
    # sizing it to the need avoids zeroing a (L, B, K, 8192, D) buffer for a short reply.
    cache_len = min(W, tokens.shape[1] + max(max_new_tokens, 1))
    cache = model.make_cache(tokens.shape[0], cache_len) if use_cache else None
    start, fed = 0, 0  # context = tokens[:, start:]; the cache holds tokens[:, start:fed]
    for _ in range(max_new_tokens):
        if tokens.shape[1] - start > W:  # outgrew the context: keep the newest half
            start = tokens.shape[1] - max(1, W // 2)
            fed = start
            if cache is not None:
                cache.reset()
        if cache is None:
            logits = model(tokens[:, start:], last_only=True).logits
        else:
            logits = model(tokens[:, fed:], cache=cache, last_only=True).logits
            fed = tokens.shape[1]
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
        yield nxt


# --------------------------------------------------------------------------- encoder-decoder
#
# An encoder-decoder model decodes through two methods (RNNSeq2Seq, TransformerSeq2Seq):
#     state = model.start(src)                      encode the source once
#     logits, weights = model.step(state, prev)     one target token per row, (N,) -> (N, V)
# and ``state.reorder(index)`` keeps rows ``index`` (beam search). Token 1 is BOS, 2 EOS.

_BOS, _EOS = 1, 2


class Decoded(NamedTuple):
    """Per source sentence: token ids (EOS excluded), total log-probability, and the
    attention over the source of each emitted token (len(tokens), S), if the model has it."""

    tokens: list[list[int]]
    scores: list[float]
    weights: list[Tensor | None]


@torch.no_grad()
def greedy_decode(model, src: Tensor, max_len: int) -> Decoded:
    """The most likely token at every step, for a batch of sources (B, S), PAD-padded."""
    B = src.shape[0]
    state = model.start(src)
    prev = torch.full((B,), _BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    score = torch.zeros(B, device=src.device)
    out, ws = [], []
    for _ in range(max_len):
        logits, w = model.step(state, prev)
        logp = logits.float().log_softmax(-1)
        nxt = logp.argmax(-1)
        score += torch.where(done, 0.0, logp.gather(1, nxt[:, None])[:, 0])
        out.append(torch.where(done, _EOS, nxt))
        ws.append(w)
        done |= nxt == _EOS
        prev = nxt
        if bool(done.all()):
            break
    toks = torch.stack(out, 1).tolist()
    weights = torch.stack(ws, 1) if ws and ws[0] is not None else None  # (B, T, S)
    return _finish(toks, score.tolist(), weights)


def _finish(toks: list[list[int]], scores: list[float], weights: Tensor | None) -> Decoded:
    cut = [row.index(_EOS) if _EOS in row else len(row) for row in toks]
    return Decoded([row[:n] for row, n in zip(toks, cut, strict=True)], scores,
                   [None if weights is None else weights[b, :n].cpu() for b, n in enumerate(cut)])


@torch.no_grad()
def beam_search(model, src: Tensor, max_len: int, beam: int = 4, length_penalty: float = 1.0) -> Decoded:
    """Keep the ``beam`` best partial outputs per source; finished ones (ended by EOS) stay.

    The winner maximises log p(y) / len(y)^length_penalty (len counts EOS): 0 = pure
    probability, which favours short outputs; 1 = mean log-probability per token. Batched:
    B sources × ``beam`` rows run as one batch. ``beam=1`` is greedy decoding.
    """
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    B, K = src.shape[0], beam
    state = model.start(src.repeat_interleave(K, dim=0))  # rows b*K .. b*K+K-1 belong to b
    dev = src.device
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # one live hypothesis at the start (the others would be duplicates)
    done = torch.zeros(B, K, dtype=torch.bool, device=dev)
    lengths = torch.zeros(B, K, device=dev)
    seqs = torch.empty(B, K, 0, dtype=torch.long, device=dev)
    hist: Tensor | None = None  # (B, K, t, S)
    prev = torch.full((B * K,), _BOS, dtype=torch.long, device=dev)
    for _ in range(max_len):
        logits, w = model.step(state, prev)
        logp = logits.float().log_softmax(-1).view(B, K, -1)
        V = logp.shape[-1]
        # A finished hypothesis continues only with EOS, at no cost: its score is final.
        frozen = torch.full_like(logp, float("-inf"))
        frozen[..., _EOS] = 0.0
        logp = torch.where(done[..., None], frozen, logp)
        top, idx = (scores[..., None] + logp).view(B, K * V).topk(K, dim=-1)  # (B, K)
        src_beam, tok = idx // V, idx % V
        rows = (src_beam + torch.arange(B, device=dev)[:, None] * K).flatten()
        state.reorder(rows)
        was_done = done.gather(1, src_beam)
        lengths = lengths.gather(1, src_beam) + (~was_done).float()
        done = was_done | (tok == _EOS)
        seqs = torch.cat([seqs.gather(1, src_beam[..., None].expand(-1, -1, seqs.shape[-1])),
                          tok[..., None]], dim=-1)
        if w is not None:
            w = w.view(B, K, 1, -1)
            hist = w if hist is None else torch.cat(
                [hist.gather(1, src_beam[..., None, None].expand(-1, -1, *hist.shape[2:])),
                 w.gather(1, src_beam[..., None, None].expand(-1, -1, 1, w.shape[-1]))], dim=2)
        scores, prev = top, tok.flatten()
        if bool(done.all()):
            break
    norm = scores / lengths.clamp_min(1) ** length_penalty
    best = norm.argmax(-1)  # (B,)
    ar = torch.arange(B, device=dev)
    toks = seqs[ar, best].tolist()
    weights = None if hist is None else hist[ar, best]
    return _finish(toks, scores[ar, best].tolist(), weights)
