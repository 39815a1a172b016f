"""Continuous batching: many requests decoded as one running batch, joining and leaving it
between steps (Yu et al. 2022, "Orca"; what llama.cpp's server and vLLM do).

Decoding one token reads every weight of the model for very little arithmetic, so on a CPU a
step for 4 rows costs little more than a step for 1 (SmolLM2 q4 on 2 Zen 4 cores: 29 ms for
one row, 38 ms for four). Requests that arrive at different times, with prompts of different
lengths, share those steps:

- a request *joins* by a prefill of its prompt alone, straight into a free row of the batch's
  :class:`~qkv.attention.BatchKVCache` (no copy); its first token comes from that prefill. A
  long prompt may instead be prefilled a chunk at a time between steps (:meth:`Batch.start`,
  :meth:`Batch.prefill`: chunks of :data:`CHUNK` tokens, into a cache of its own, copied into
  its row when it joins), so that the rows already decoding wait for one chunk, not the whole
  prompt; the chunks are fixed, so the same request prefills the same way alone or in a class;
- each *step* feeds one token per live row, every row at its own position (per-row RoPE angles,
  position rows and ALiBi distances; each row attends over its own keys in its own call), and
  samples each row with the row's own settings and random generator;
- a row *leaves* when it has its tokens, produces a stop id, or is cancelled; the last live row
  moves into its place, so the live rows are always ``0 .. n - 1``.

So every row decodes exactly as it would alone (:func:`qkv.generation.generate` with
``mode="eager"``), up to float rounding of a batched product: the same greedy tokens, and with
the same seed the same samples. The attention of each new token is available per row.

Where the model's native step (:mod:`qkv.generation.native_step`) runs it, every step of the
live rows, one or several, goes through it in place in the batch's own cache
(:meth:`~qkv.generation.native_step.NativeStep.step_rows`: the products take the rows together,
and each row's numbers are those of the native step alone, bit for bit; while every live row is
greedy, up to :data:`GREEDY_HEAD_ROWS`, the head's first pass ranks with its 4-bit copy, as a
greedy ``generate`` alone does, and its rows' top logits and tokens are those of a greedy step
alone); nothing to build.
Else a row that is *alone* in the batch steps through the model's saved decoding step
(:mod:`qkv.generation.aot`) where one exists, as ``generate`` alone would: its keys and values
are copied into the step's own cache when it starts, and back into the batch when another
request joins (a copy of the row's tokens, milliseconds); two or more rows step through the
model's saved step for a running batch of up to R rows and this cache length, where one was
built (``qkv prepare``), in place in the batch's own cache: each row masked to its own keys, so
a row's numbers equal its eager ones to float rounding rather than bit for bit. A row that asks
for attention (``qkv serve``'s rows ask for the one layer the page shows) gets it from the
steps' kept queries and the cached keys (:func:`qkv.generation.decoders.attention_rows`), only
in the layers it asks for.

The threads around it (a request waiting for a row, a stream to a client) live in
:mod:`qkv.serve.batching`; this module is synchronous.

Shapes: R rows, S cache length, H heads, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, overload

import torch
from torch import Tensor

from qkv.attention import BatchKVCache, KVCache
from qkv.generation import aot, native_step
from qkv.generation.builds import decide, native_for, saved_steps_wanted
from qkv.generation.decoders import DecodeMode, StepDecoder, keep_queries
from qkv.generation.sampling import check_sampling, make_generator, sample_next
from qkv.models.gpt import GPT, GPTOutput

if TYPE_CHECKING:
    from qkv.generation.aot import SavedStep
    from qkv.generation.native_step import NativeStep


@dataclass(frozen=True)
class Request:
    """One prompt to continue: its ids, how many tokens at most, and how to choose them.

    ``weights``: also return, for each new token, the attention of the position that chose it
    (one (H, S) tensor per layer; the explicit ``reference`` backend computes every step then).
    ``layers``: with ``weights``, only these layers' attention (what a page showing one layer
    needs: the other layers keep the fast backend); None: every layer.
    ``seed``: the row's own random generator (None: fresh entropy), as
    :func:`qkv.generation.sampling.make_generator` makes it for a request decoded alone.
    """

    ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: Sequence[int] = ()
    weights: bool = False
    layers: tuple[int, ...] | None = None

    def check(self, context: int) -> None:
        """ValueError (one line) for a request no row can decode."""
        if not self.ids:
            raise ValueError("the prompt has no tokens")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if len(self.ids) + self.max_new_tokens > context:
            raise ValueError(f"{len(self.ids)} prompt tokens + {self.max_new_tokens} new ones exceed the "
                             f"{context}-token context; ask for fewer new tokens")
        check_sampling(self.temperature, self.top_k, self.top_p)


class RowWeights(Sequence[Tensor]):
    """One row's attention in every layer, cut from the step's (B, H, 1, S) tensors only when a
    layer is read (a server that shows one layer reads one): ``[layer]`` -> (H, n)."""

    def __init__(self, weights: Sequence[Tensor | None], b: int, n: int) -> None:
        self._weights, self._b, self._n = weights, b, n

    def __len__(self) -> int:
        return len(self._weights)

    @overload
    def __getitem__(self, i: int) -> Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[Tensor]: ...

    def __getitem__(self, i: int | slice) -> Tensor | list[Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        w = self._weights[i]
        if w is None:
            raise ValueError(f"layer {i}'s attention was not computed: ask for it in Request.layers")
        return w[self._b, :, -1, : self._n]


class Token(NamedTuple):
    """One new token of one row, and (asked for) the attention of the position that chose it:
    one (H, S) tensor per layer, S = the tokens the row had seen, this one's position included."""

    id: int
    weights: Sequence[Tensor] | None = None


@dataclass(eq=False)
class Row:
    """A request in the batch. ``slot``: its row of the cache (moves when rows leave);
    ``new``: the ids produced so far; ``done``: it has left the batch."""

    request: Request
    slot: int
    generator: torch.Generator
    new: list[int] = field(default_factory=list)
    last: int = 0  # the id the next step feeds
    done: bool = False


CHUNK = 32  # a prompt prefilled in pieces (Batch.start, Batch.prefill) runs this many tokens a piece
# (SmolLM2 on a Zen 3's 2 cores, the longest turn of a running batch while a 240-token prompt
# joins: 0.49 s whole, 0.16 s in chunks of 64, 0.10 s in chunks of 32; benchmarks/prefill_chunks.py)


@dataclass
class Prefill:
    """A prompt being prefilled a chunk at a time outside the batch (:meth:`Batch.start`):
    ``cache`` its own (L, 1, K, n, D) keys and values, ``done`` the tokens prefilled so far,
    ``out`` the last chunk's output (its logits choose the first token) once all are."""

    request: Request
    cache: KVCache
    done: int = 0
    out: GPTOutput | None = None

    @property
    def finished(self) -> bool:
        return self.done >= len(self.request.ids)


class Batch:
    """A running batch of up to ``rows`` requests over one model (synchronous: the caller drives
    :meth:`join`, :meth:`step` and :meth:`leave`).

    Args:
        model: a decoder (any positions qkv has; any weight format). Its steps run eagerly.
        rows: the most requests decoding at once (R).
        cache_len: the longest prompt + new tokens a row can hold (S); a longer request grows
            the cache (a copy), never past the model's context.
        mode: ``auto`` steps every row through the native step where it runs the model
            (:func:`qkv.generation.builds.native_for`); else lets a row that is alone step through
            the model's saved step, and two or more rows through its saved step for a running
            batch of ``rows`` rows and this cache length, where they were built
            (:func:`qkv.generation.builds.decide` decides); ``eager``: none of them. (``build`` is
            ``auto`` here: :func:`generate_batch` builds first.)
    """

    def __init__(self, model: GPT, rows: int, cache_len: int, mode: DecodeMode | str = DecodeMode.AUTO,
                 cache: BatchKVCache | None = None) -> None:
        """``cache``: an earlier batch's (:meth:`take_cache`), reused (emptied and zeroed) when it
        has this batch's shape: SmolLM2's 8 x 256 cache takes ~20 ms to allocate, ~2 to zero."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.model = model.eval()
        self.rows = rows
        self.context = model.cfg.max_seq_len
        self.live: list[Row] = []
        mode = DecodeMode.of(mode)
        if mode is DecodeMode.JIT:
            raise ValueError("a running batch steps eagerly or through the native or saved steps: mode "
                             "'auto' or 'eager'")
        self.mode = DecodeMode.AUTO if mode is DecodeMode.BUILD else mode
        length = min(max(cache_len, 2), self.context)
        if cache is not None and self._fits(cache, length):
            with torch.inference_mode():  # its buffers were made in it (_make_cache)
                cache.reset()  # as new: zeroing in place takes a tenth of allocating (page faults)
                for buf in (cache.k, cache.v, cache.queries):
                    if buf is not None:
                        buf.zero_()
            self._cache = cache
        else:
            self._cache = self._make_cache(length)
        self._solo: tuple[Row, StepDecoder, KVCache] | None = None  # the row, its one-row step, its cache
        self._not_solo: Row | None = None  # the last row no one-row step could take (not asked again)
        self.solo_steps = 0  # steps through the one-request saved step (a count for tests, benchmarks)
        self._rows_step: SavedStep | None = None  # the saved step for several rows, once found
        self._native: NativeStep | bool | None = None  # the native step (False: none runs the model)
        self.rows_steps = 0  # steps taken through step_rows, native or saved (a count for tests, benchmarks)

    def __len__(self) -> int:
        return len(self.live)

    @property
    def cache_len(self) -> int:
        return self._cache.max_seq_len

    @torch.inference_mode()
    def _cache_shape(self, length: int) -> tuple[int, ...]:
        """(L, R, K, S, D) of the batch's key (and value) buffers for ``length`` positions."""
        cfg = self.model.cfg
        return (cfg.n_layers, self.rows, cfg.resolved_kv_heads, length, cfg.resolved_head_dim)

    def _keeps_queries(self) -> bool:
        """Whether the cache keeps each layer's query: what the native step and a saved step of
        several rows write (the attention a row asks for is read back from them)."""
        if self.mode is DecodeMode.EAGER:
            return False
        return native_step.enabled() or (self.rows > 1 and aot.enabled())

    def _native_rows(self) -> NativeStep | None:
        """The native step, which takes every live row in place (one row or several; no set-up)
        where it runs the model (:func:`qkv.generation.builds.native_for`), decided at the first
        step after each join (a request's start, as ``generate`` decides it for a request)."""
        if self._native is None:
            self._native = native_for(self.model, self.mode, self.cache_len) or False
        return self._native or None

    def _make_cache(self, length: int) -> BatchKVCache:
        p = self.model.tok_emb.weight
        L, R, K, S, D = self._cache_shape(length)
        cache = BatchKVCache(L, R, K, S, D, dtype=p.dtype, device=p.device)
        if self._keeps_queries():
            keep_queries(self.model, cache)
        return cache

    def _fits(self, cache: BatchKVCache, length: int) -> bool:
        """Whether ``cache`` is what :meth:`_make_cache` would make for ``length`` positions."""
        p = self.model.tok_emb.weight
        return (tuple(cache.k.shape) == self._cache_shape(length) and cache.k.dtype == p.dtype
                and cache.k.device == p.device and (cache.queries is not None) == self._keeps_queries()
                and cache.lengths is not None)

    def take_cache(self) -> BatchKVCache:
        """The cache, for a later batch of the same shape (``Batch(..., cache=)``); this batch
        must be empty and is not used again."""
        if self.live:
            raise ValueError(f"the batch still has {len(self.live)} rows")
        return self._cache

    def _grow(self, length: int) -> None:
        """Room for ``length`` tokens per row (the live rows' tokens are copied over)."""
        old = self._cache
        new = self._make_cache(min(max(length, 2 * old.max_seq_len), self.context))
        n = old.span
        new.k[:, :, :, :n] = old.k[:, :, :, :n]
        new.v[:, :, :, :n] = old.v[:, :, :, :n]
        new.pos.copy_(old.pos)
        new.sync()
        self._cache = new

    def _layers(self, requests: Sequence[Request]) -> set[int] | bool | None:
        """The layers whose attention any of ``requests`` asks for: False (none asks), None
        (one asks for every layer) or their indices."""
        asked = [r for r in requests if r.weights]
        if not asked:
            return False
        if any(r.layers is None for r in asked):
            return None
        n = self.model.cfg.n_layers
        return {i % n for r in asked for i in r.layers or ()}

    def _extra(self, requests: Sequence[Request]) -> dict[str, object]:
        """The forward's options for a step of ``requests``: the weights of the layers any of
        them asks for, on the explicit reference backend (every layer if one asks for all)."""
        layers = self._layers(requests)
        if layers is False:
            return {}
        if layers is None:
            return {"backend": "reference", "return_weights": True}
        return {"return_weights": True, "weights_layers": layers}

    def _take(self, row: Row, logits: Tensor) -> int | None:
        """Sample row's next id from its (1, V) logits; None if it is a stop id (the row ends
        without showing it, as :func:`qkv.generation.generate` does)."""
        req = row.request
        nxt = int(sample_next(logits, req.temperature, req.top_k, req.top_p, row.generator)[0])
        if nxt in req.stop_ids:
            return None
        row.new.append(nxt)
        row.last = nxt
        return nxt

    def _solo_step(self, row: Row) -> tuple[Tensor, RowWeights | None] | None:
        """((1, V) logits of ``row``'s next token, its attention in the layers it asks for or
        None) from the saved step for one request, when the row may use it (alone, the step's
        cache long enough); else None. (Where the native step runs the model, every step takes it
        in place instead: :meth:`_several`.)"""
        if self.mode is DecodeMode.EAGER or row is self._not_solo:
            return None
        if self._solo is None:
            n = self._cache.lengths[row.slot]
            need = n + row.request.max_new_tokens - len(row.new) + 1
            step: StepDecoder | None = decide(self.model, self.mode, need=need).step
            if step is None:
                self._not_solo = row  # a decision per row, not per token
                return None
            cache = step.make_cache(1)
            cache.k[:, :, :, :n] = self._cache.k[:, row.slot : row.slot + 1, :, :n]
            cache.v[:, :, :, :n] = self._cache.v[:, row.slot : row.slot + 1, :, :n]
            cache.pos = n
            self._solo = (row, step, cache)
        _, step, cache = self._solo
        x = torch.tensor([[row.last]], device=self.model.tok_emb.weight.device)
        self.solo_steps += 1
        logits = step.step(x, cache)[:, -1]
        req = row.request
        return logits, RowWeights(step.attention(cache, req.layers), 0, cache.pos) if req.weights else None

    def _several(self, rows: list[Row]) -> tuple[Tensor, list[Tensor | None] | None] | None:
        """((n, 1, V) logits, the attention of the layers the rows ask for or None) of a step
        of ``rows`` (the batch's first n) through the native step where it runs the model (any
        n, in place), else, for two rows or more, the model's saved step for a running batch of
        up to ``self.rows`` rows with this cache length, when there is one; else None (while
        missing, :func:`qkv.generation.builds.status` answers from its own memory)."""
        if self.mode is DecodeMode.EAGER:
            return None
        step: NativeStep | SavedStep | None = self._native_rows()
        layers = self._layers([r.request for r in rows])
        if step is not None and self._cache.queries is None and layers is not False:
            return None  # attention asked of a cache made without kept queries (the native step on since)
        if step is None:
            if self._cache.queries is None or len(rows) < 2:
                return None
            if self._rows_step is None or self._rows_step.cache_len != self.cache_len:
                self._rows_step = decide(self.model, self.mode, rows=self.rows, cache_len=self.cache_len).step
                if self._rows_step is None:
                    return None
                self._rows_step.begin()
            step = self._rows_step
        x = torch.tensor([[r.last] for r in rows], device=self.model.tok_emb.weight.device)
        if (isinstance(step, native_step.NativeStep) and len(rows) <= GREEDY_HEAD_ROWS
                and all(r.request.temperature == 0 for r in rows)):
            # every row greedy: only each row's argmax is read (the head's 4-bit copy ranks them)
            logits = step.step_rows(x, self._cache, greedy=True)
        else:
            logits = step.step_rows(x, self._cache)
        self.rows_steps += 1
        if layers is False:
            return logits, None
        return logits, step.attention(self._cache, layers, rows=len(rows))

    def _flush(self) -> None:
        """Back from the saved step: its row's keys and values into the batch's cache."""
        if self._solo is None:
            return
        row, step, cache = self._solo
        self._solo = None
        if not row.done:
            n = cache.pos
            self._cache.k[:, row.slot, :, :n] = cache.k[:, 0, :, :n]
            self._cache.v[:, row.slot, :, :n] = cache.v[:, 0, :, :n]
            self._cache.set_length(row.slot, n)
        step.release(cache)

    def start(self, request: Request) -> Prefill:
        """Begin prefilling ``request``'s prompt outside the batch, a chunk at a time
        (:meth:`prefill`; then :meth:`join` with it): nothing of the batch is touched."""
        request.check(self.context)
        return Prefill(request, self.model.make_cache(1, max(len(request.ids), 1)))

    @torch.inference_mode()
    def prefill(self, p: Prefill) -> None:
        """The next :data:`CHUNK` tokens of ``p``'s prompt into its own cache (the last chunk
        with the attention its request asks for)."""
        ids = list(p.request.ids[p.done : p.done + CHUNK])
        if not ids:
            return
        last = p.done + len(ids) >= len(p.request.ids)
        x = torch.tensor([ids], device=self.model.tok_emb.weight.device)
        out = self.model(x, cache=p.cache, last_only=True, **(self._extra([p.request]) if last else {}))
        p.done += len(ids)
        if last:
            p.out = out

    @torch.inference_mode()
    def join(self, request: Request, prefilled: Prefill | None = None) -> tuple[Row, Token | None]:
        """Prefill ``request``'s prompt alone into a free row (or, ``prefilled``, copy the keys
        and values of a finished :meth:`prefill` into it); (the row, its first token or None
        when it has none: zero tokens asked for, or a stop id first). A row that is already
        done has left again."""
        if len(self.live) >= self.rows:
            raise ValueError(f"the batch is full ({self.rows} rows); wait for a row to leave")
        request.check(self.context)
        if prefilled is not None and (prefilled.request is not request or not prefilled.finished):
            raise ValueError("join(prefilled=) takes the finished prefill of this request")
        self._flush()
        self._native = None  # decided again at the next step (per request, as generate decides it)
        need = len(request.ids) + request.max_new_tokens
        if need > self.cache_len:
            self._grow(need)
        row = Row(request, len(self.live), make_generator(self.model.tok_emb.weight.device, request.seed))
        if request.max_new_tokens == 0:
            row.done = True
            return row, None
        n = len(request.ids)
        if prefilled is None:
            cache = self._cache.row(row.slot)
            ids = torch.tensor([list(request.ids)], device=self.model.tok_emb.weight.device)
            out = self.model(ids, cache=cache, last_only=True, **self._extra([request]))
        else:
            self._cache.k[:, row.slot, :, :n] = prefilled.cache.k[:, 0, :, :n]
            self._cache.v[:, row.slot, :, :n] = prefilled.cache.v[:, 0, :, :n]
            assert prefilled.out is not None
            out = prefilled.out
        self._cache.set_length(row.slot, n)
        self.live.append(row)
        nxt = self._take(row, out.logits[:, -1])
        if nxt is None:
            self.leave(row)
            return row, None
        tok = Token(nxt, RowWeights(out.weights, 0, len(request.ids)) if request.weights else None)
        if len(row.new) >= request.max_new_tokens:
            self.leave(row)
        return row, tok

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, Token | None]]:
        """One token for every live row: [(row, its token or None if it stopped)]. Rows that
        have all their tokens, or stopped, leave the batch (``row.done``)."""
        rows = list(self.live)
        if not rows:
            return []
        if len(rows) == 1 and self._native_rows() is None and (got := self._solo_step(rows[0])) is not None:
            row, (logits, weights) = rows[0], got
            nxt = self._take(row, logits)
            solo = None
            if nxt is not None:
                solo = Token(nxt, weights)
            if solo is None or len(row.new) >= row.request.max_new_tokens:
                self.leave(row)
            return [(row, solo)]
        self._flush()
        n = len(rows)
        lengths = self._cache.lengths[:n]  # before the step: row b's token at lengths[b]
        got = self._several(rows)
        if got is None:
            x = torch.tensor([[r.last] for r in rows], device=self.model.tok_emb.weight.device)  # (n, 1)
            out = self.model(x, cache=self._cache.head(n), last_only=True,
                             **self._extra([r.request for r in rows]))
            self._cache.sync()
            got = out.logits, out.weights
        logits, weights = got
        events: list[tuple[Row, Token | None]] = []
        for b, row in enumerate(rows):
            nxt = self._take(row, logits[b : b + 1, -1])
            tok = None
            if nxt is not None:
                tok = Token(nxt, RowWeights(weights, b, lengths[b] + 1) if row.request.weights else None)
            events.append((row, tok))
        for row, tok in events:
            if tok is None or len(row.new) >= row.request.max_new_tokens:
                self.leave(row)
        return events

    @torch.inference_mode()
    def leave(self, row: Row) -> None:
        """Take ``row`` out of the batch (done, or cancelled); the last live row moves into its
        cache row. Leaving twice is a no-op."""
        if row.done:
            return
        row.done = True
        if self._solo is not None and self._solo[0] is row:
            self._flush()  # the row is done: only its cache goes back to the step
        if row not in self.live:
            return
        i, last = row.slot, len(self.live) - 1
        moved = self.live[last]
        if moved is not row:
            self._cache.move_row(last, i)
            moved.slot = i
            self.live[i] = moved
        self.live.pop()
        self._cache.set_length(last, 0)


# A step of greedy rows reads the head's 4-bit copy up to this many rows: SmolLM2 on the Emerald
# Rapids Xeon (batch_rows.py, issue 53) 1.09x the tokens/s at 1 and 2 rows, 1.02x at 4, 0.99x at 8
# in one run (by hand 1.01-1.02x at 4, 8 and 12: within the noise; more rows make the 4-bit
# products' arithmetic, not their bytes, the cost). A greedy row's first pass over the vocabulary
# is thus the 4-bit copy's or the 8-bit head's as its batch is: its token is the same either way
# unless the largest exact logit falls outside that pass's top 64; its other logits, which no
# greedy row reads, are not those it gets alone
GREEDY_HEAD_ROWS = 4

CACHE_LENGTHS = (256, 512, 1024, 2048)  # a batch's cache length is rounded up to one of these


def batch_cache_len(model: GPT, need: int) -> int:
    """The cache length of a batch whose longest request needs ``need`` positions: the smallest
    of 256, 512, 1,024, 2,048 that holds it (or ``need``, or the model's context, past those),
    so that batches of different requests share one saved step (keyed by its cache length;
    ``qkv serve``'s is 256, its ``--max-tokens`` default)."""
    ctx = model.cfg.max_seq_len
    return min(ctx, next((n for n in CACHE_LENGTHS if n >= need), need))


def generate_batch(model: GPT, requests: Sequence[Request], rows: int = 8,
                   mode: DecodeMode | str = DecodeMode.AUTO) -> Iterator[tuple[int, Token]]:
    """Decode every request, ``rows`` at a time (the next waiting one joins as soon as a row
    leaves): yields (index of the request, its next token) in the order they are produced.

    ``mode``: ``auto`` steps through the native step where it runs the model (every row, no
    set-up), else through the model's saved steps where they were built (one row alone; two or
    more through the step of a running batch of ``rows`` rows and the cache length
    :func:`batch_cache_len` gives), ``build`` builds those first if missing (~40 s each on 2
    cores, once per model and machine), ``eager`` decodes eagerly."""
    mode = DecodeMode.of(mode)
    waiting = list(enumerate(requests))
    for _, r in waiting:
        r.check(model.cfg.max_seq_len)
    need = max((len(r.ids) + r.max_new_tokens for r in requests), default=2)
    cache_len = batch_cache_len(model, need)
    if mode is DecodeMode.BUILD and saved_steps_wanted(model):
        decide(model, mode)
        if rows > 1:
            decide(model, mode, rows=rows, cache_len=cache_len)
    batch = Batch(model, rows, cache_len, mode)
    index: dict[Row, int] = {}  # row -> its request's index
    waiting.reverse()
    while waiting or len(batch):
        while waiting and len(batch) < batch.rows:
            i, req = waiting.pop()
            row, tok = batch.join(req)
            index[row] = i
            if tok is not None:
                yield i, tok
        for row, tok in batch.step():
            if tok is not None:
                yield index[row], tok
