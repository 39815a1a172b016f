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
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from qkv.generation.builds import Decision, decoder_for
from qkv.generation.decoders import DecodeMode
from qkv.generation.sampling import make_generator, sample_next
from qkv.models.gpt import GPT
from qkv.tokenizers.vocab import BOS, EOS, PAD, UNK


def crop_prompt(ids: Tensor, max_seq_len: int) -> tuple[Tensor, bool]:
    """Keep the last ``max_seq_len - 1`` tokens of (B, T) ids (room for one new token)."""
    limit = max(1, max_seq_len - 1)
    if ids.shape[1] <= limit:
        return ids, False
    return ids[:, -limit:], True


CONTEXT_IDS = 8  # ids decoded before new ones: more than any UTF-8 character's bytes (4)


def decode_after(decode: Callable[[Sequence[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``context``: ``decode(context + ids)`` less ``decode(context)``.

    Decoding new ids on their own is not enough: a SentencePiece decoder drops the space that
    begins a text ("▁the" alone is "the"), so the first word of a reply would stick to the
    prompt. The last :data:`CONTEXT_IDS` ids of ``context`` are decoded with them; where the
    context ends mid-character (its text is not a prefix of the joint text), ``ids`` alone.
    """
    ctx = list(context[-CONTEXT_IDS:])
    if not ctx:
        return decode(ids)
    base, text = decode(ctx), decode([*ctx, *ids])
    return text[len(base):] if text.startswith(base) else decode(ids)


def text_pieces(decode: Callable[[Sequence[int]], str], ids: Iterable[int],
                context: Sequence[int] = ()) -> Iterator[str]:
    """Turn a stream of token ids into a stream of text, whole characters only.

    A byte-level BPE token can end in the middle of a UTF-8 character; text that decodes to a
    trailing U+FFFD is held back until a later token completes it (and flushed as it is at the
    end of the stream). ``context``: the prompt's ids, so that the first piece reads as it does
    after the prompt (:func:`decode_after`). Each step decodes only the ids not yet shown, after
    the last few shown ones: constant work per token, however long the reply.
    """
    before = list(context[-CONTEXT_IDS:])  # what the pending ids are read after
    pending: list[int] = []  # ids whose text is not out yet (an unfinished character)
    for i in ids:
        pending.append(i)
        text = decode_after(decode, before, pending)
        if not text.endswith("\ufffd"):
            if text:
                yield text
            before = [*before, *pending][-CONTEXT_IDS:]
            pending = []
    if pending:
        rest = decode_after(decode, before, pending)
        if rest:
            yield rest


class _Stops:
    """Rows that produced a stop id: they repeat it until every row has stopped."""

    def __init__(self, stop_ids: Iterable[int], batch: int, device: torch.device) -> None:
        self.set = set(stop_ids)
        self.ids = torch.tensor(sorted(self.set), dtype=torch.long, device=device)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=device)

    def apply(self, nxt: Tensor) -> tuple[Tensor, bool]:
        """(the ids to append, whether every row has stopped: generation ends)."""
        if not len(self.ids):
            return nxt, False
        if nxt.shape[0] == 1:  # one row: it stops, and generation ends, at a stop id (~2 µs, not ~13)
            return nxt, int(nxt[0]) in self.set
        nxt = torch.where(self.stopped, self.tok, nxt)
        now = torch.isin(nxt, self.ids) & ~self.stopped
        self.tok, self.stopped = torch.where(now, nxt, self.tok), self.stopped | now
        return nxt, bool(self.stopped.all())


@torch.inference_mode()
def generate(model: GPT, prompt: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             generator: torch.Generator | None = None, seed: int | None = None, stop_ids: Iterable[int] = (),
             return_weights: bool = False, mode: DecodeMode | str = DecodeMode.AUTO,
             on_decision: Callable[[Decision], object] | None = None) -> Iterator[Any]:
    """Yield (B,) new ids one step at a time from ``prompt`` (B, T0), or with ``return_weights``
    (ids, one (B, H, S) attention row per layer: softmax(q·Kᵀ/√d) of the query that chose them).
    A prompt longer than the context is cropped (:func:`crop_prompt`); sampling: see
    :func:`~qkv.generation.sampling.sample_next` (``generator``, or a fresh one from ``seed``);
    ``stop_ids`` end a row (the others go on; generation ends, without yielding that step, once
    every row has stopped); ``use_cache`` False recomputes the whole context each step. ``mode``
    (:class:`~qkv.generation.decoders.DecodeMode`): how the 1-token steps run (the prompt always
    runs eagerly), decided by :func:`qkv.generation.builds.decoder_for` and told to ``on_decision``."""
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (B, T) with T >= 1, got shape {tuple(prompt.shape)}")
    model.eval()
    generator = generator if generator is not None or seed is None else make_generator(prompt.device, seed)
    W = model.cfg.max_seq_len
    tokens, _ = crop_prompt(prompt, W)
    stops = _Stops(stop_ids, tokens.shape[0], prompt.device)
    chosen = decoder_for(model, mode if use_cache else DecodeMode.EAGER, batch=tokens.shape[0],
                         need=tokens.shape[1] + max(max_new_tokens, 1), weights=return_weights)
    if on_decision is not None:
        on_decision(chosen)
    dec = chosen.decoder if use_cache else None
    if dec is not None:
        dec.begin()
    # greedy: a decoder that finds its step's argmax itself (the native step) gives it
    greedy = getattr(dec, "greedy", None) if temperature == 0 else None
    cache = dec.make_cache(tokens.shape[0]) if dec is not None else None
    start = fed = 0  # context = tokens[:, start:]; the cache holds tokens[:, start:fed]
    stepped = False  # this step's logits came from dec.step (not the prompt's forward)
    try:
        for _ in range(max_new_tokens):
            if tokens.shape[1] - start > W:  # outgrew the context: keep the newest half
                start = fed = tokens.shape[1] - max(1, W // 2)
                if cache is not None:
                    cache.reset()
            if dec is None or cache is None:  # no cache: the whole context every step
                extra = {"backend": "reference", "return_weights": True} if return_weights else {}
                out = model(tokens[:, start:], last_only=True, **extra)
                logits, weights = out.logits, out.weights
            else:
                new = tokens[:, fed:]  # one token: the decoder's step; more (the prompt): eagerly
                stepped = new.shape[1] == 1
                if not stepped:
                    logits = model(new, cache=cache, last_only=True).logits
                else:  # greedy: the step may rank with a cheaper head (its top-k still exact)
                    logits = dec.step(new, cache, greedy=True) if greedy is not None else dec.step(new, cache)
                fed = tokens.shape[1]
                weights = dec.attention(cache) if return_weights else None
            if greedy is not None and stepped:  # (the prompt's step went through sample_next: checked)
                nxt, done = stops.apply(greedy())
            else:
                nxt, done = stops.apply(sample_next(logits[:, -1], temperature, top_k, top_p, generator))
            if done:
                return
            tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
            yield (nxt, [w[:, :, -1] for w in weights]) if weights is not None else nxt
    finally:
        if dec is not None and cache is not None:
            dec.release(cache)  # the next request reuses it


# --------------------------------------------------------------------------- encoder-decoder


class DecodeState(Protocol):
    """What an encoder-decoder carries between steps (encoder memory, decoder state, caches)."""

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (N,), in that order (beam search)."""
        ...


class Seq2SeqDecoder(Protocol):
    """What :func:`greedy_decode` and :func:`beam_search` decode: RNNSeq2Seq, TransformerSeq2Seq,
    the captioner's adapter. Special ids: :mod:`qkv.tokenizers.vocab`."""

    def start(self, src: Tensor) -> DecodeState:
        """Encode the sources (N, ...) once."""
        ...

    def step(self, state: Any, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        """One target token per row: previous ids (N,) -> logits (N, V) and the attention over
        the source (N, S), or None for a model without attention."""
        ...


_NEVER = (PAD, BOS, UNK)  # never appear in an output


def _allowed(logits: Tensor) -> Tensor:
    """Logits with the tokens that never appear in an output set to -inf."""
    out = logits.clone()
    out[:, [t for t in _NEVER if t < out.shape[-1]]] = float("-inf")
    return out


class Decoded(NamedTuple):
    """Per source sentence: token ids (EOS excluded), total log-probability, and the
    attention over the source of each emitted token (len(tokens), S), if the model has it."""

    tokens: list[list[int]]
    scores: list[float]
    weights: list[Tensor | None]


@torch.no_grad()
def greedy_decode(model: Seq2SeqDecoder, src: Tensor, max_len: int) -> Decoded:
    """The most likely token at every step, for a batch of sources (B, S), PAD-padded."""
    B = src.shape[0]
    state = model.start(src)
    prev = torch.full((B,), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    score = torch.zeros(B, device=src.device)
    out, ws = [], []
    for _ in range(max_len):
        logits, w = model.step(state, prev)
        logp = _allowed(logits).float().log_softmax(-1)
        nxt = logp.argmax(-1)
        score += torch.where(done, 0.0, logp.gather(1, nxt[:, None])[:, 0])
        out.append(torch.where(done, EOS, nxt))
        ws.append(w)
        done |= nxt == EOS
        prev = nxt
        if bool(done.all()):
            break
    toks = torch.stack(out, 1).tolist()
    weights = torch.stack(ws, 1) if ws and ws[0] is not None else None  # (B, T, S)
    return _finish(toks, score.tolist(), weights)


def _keep_best(kept: list, hyp: tuple, k: int) -> None:
    """Add a finished hypothesis (normalised score first) to ``kept``, at most ``k`` of the best."""
    if len(kept) < k:
        kept.append(hyp)
        return
    worst = min(range(len(kept)), key=lambda i: kept[i][0])
    if hyp[0] > kept[worst][0]:
        kept[worst] = hyp


def _finish(toks: list[list[int]], scores: list[float], weights: Tensor | None) -> Decoded:
    cut = [row.index(EOS) if EOS in row else len(row) for row in toks]
    return Decoded([row[:n] for row, n in zip(toks, cut, strict=True)], scores,
                   [None if weights is None else weights[b, :n].cpu() for b, n in enumerate(cut)])


@torch.no_grad()
def beam_search(model: Seq2SeqDecoder, src: Tensor, max_len: int, beam: int = 4,
                length_penalty: float = 1.0) -> Decoded:
    """Keep the ``beam`` best unfinished outputs per source; outputs that end (EOS) move to a
    per-source list of the ``beam`` best finished ones, so later, longer candidates can never
    evict them (and a better finished output replaces the worst one kept).

    The winner maximises log p(y) / len(y)^length_penalty (len counts EOS): 0 = pure
    probability, which favours short outputs; 1 = mean log-probability per token. A source
    is done when it has ``beam`` finished outputs and its best live output, scored at its
    current length, cannot beat the worst of them (exact for length_penalty 0, where scores
    only fall; the usual heuristic otherwise), or at ``max_len``, when the live outputs join
    the finished ones. Batched: B sources × ``beam`` rows run as one batch. ``beam=1`` is
    greedy decoding.
    """
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    B, K = src.shape[0], beam
    state = model.start(src.repeat_interleave(K, dim=0))  # rows b*K .. b*K+K-1 belong to b
    dev = src.device
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # one live hypothesis at the start (the others would be duplicates)
    seqs = torch.empty(B, K, 0, dtype=torch.long, device=dev)
    hist: Tensor | None = None  # (B, K, t, S) attention of the live hypotheses
    finished: list[list[tuple[float, float, list[int], Tensor | None]]] = [[] for _ in range(B)]
    done = [False] * B
    prev = torch.full((B * K,), BOS, dtype=torch.long, device=dev)

    def norm(score: float, length: int) -> float:
        return score / max(length, 1) ** length_penalty

    for t in range(max_len):
        logits, w = model.step(state, prev)
        logp = _allowed(logits).float().log_softmax(-1).view(B, K, -1)
        V = logp.shape[-1]
        cand, idx = (scores[..., None] + logp).view(B, K * V).topk(min(2 * K, K * V), dim=-1)
        cand_l, idx_l = cand.tolist(), idx.tolist()
        keep_beam = torch.zeros(B, K, dtype=torch.long)
        keep_tok = torch.full((B, K), EOS, dtype=torch.long)
        keep_score = torch.full((B, K), float("-inf"))
        for b in range(B):
            if done[b]:
                continue  # its rows stay dead (score -inf)
            n = 0
            for c, i in zip(cand_l[b], idx_l[b], strict=True):
                k, tok = divmod(i, V)
                if c == float("-inf"):
                    break
                if tok == EOS:
                    ws = None if w is None else (  # attention of the tokens before EOS
                        hist[b, k].cpu() if hist is not None else w.new_zeros(0, w.shape[-1]).cpu())
                    _keep_best(finished[b], (norm(c, t + 1), c, seqs[b, k].tolist(), ws), K)
                elif n < K:
                    keep_beam[b, n], keep_tok[b, n], keep_score[b, n] = k, tok, c
                    n += 1
                if n == K:
                    break
            if len(finished[b]) >= K and (n == 0 or norm(float(keep_score[b, 0]), t + 1)
                                          <= min(h[0] for h in finished[b])):
                done[b] = True
                keep_score[b] = float("-inf")
        keep_beam, keep_tok = keep_beam.to(dev), keep_tok.to(dev)
        state.reorder((keep_beam + torch.arange(B, device=dev)[:, None] * K).flatten())
        seqs = torch.cat([seqs.gather(1, keep_beam[..., None].expand(-1, -1, seqs.shape[-1])),
                          keep_tok[..., None]], dim=-1)
        if w is not None:
            w_new = w.view(B, K, -1).gather(1, keep_beam[..., None].expand(-1, -1, w.shape[-1]))[:, :, None]
            hist = w_new if hist is None else torch.cat(
                [hist.gather(1, keep_beam[..., None, None].expand(-1, -1, *hist.shape[2:])), w_new], dim=2)
        scores, prev = keep_score.to(dev), keep_tok.flatten()
        if all(done):
            break
    else:  # max_len reached: the unfinished hypotheses compete too
        for b in range(B):
            for k in range(K if not done[b] else 0):
                c = float(scores[b, k])
                if c > float("-inf"):
                    ws = None if hist is None else hist[b, k].cpu()
                    finished[b].append((norm(c, seqs.shape[-1]), c, seqs[b, k].tolist(), ws))
    best = [max(f, key=lambda h: h[0]) for f in finished]
    toks = [h[2] for h in best]
    weights = [h[3] for h in best]
    return Decoded(toks, [h[1] for h in best],
                   [None if ws is None else ws[: len(tk)] for ws, tk in zip(weights, toks, strict=True)])
