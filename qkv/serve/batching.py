"""One running batch per model for ``POST /api/generate``: concurrent requests decode together.

A generation request becomes a *row* of its model's running batch
(:class:`qkv.generation.batch.Batch`): the server's compute loop (:mod:`qkv.serve.loop`) steps
every model's batch once per turn, a request's row is filled by a prefill of its prompt between
two steps (a prompt longer than :data:`~qkv.generation.batch.CHUNK` tokens a chunk per turn, in a
cache of its own), and rows leave when done or when their client goes. Each row decodes exactly as it
would alone, its attention row included, through the model's saved steps where they were built
(``qkv prepare MODEL``; :func:`qkv.generation.builds.decide` decides).

Bounds: at most ``rows`` requests decode on one model at once and ``queued`` more wait for a
row, first come, first served; beyond, :class:`~qkv.serve.loop.BusyError` (503 with
Retry-After). Memory: one (L, rows, K, S, D) cache per model, S = the server's token limit, kept
between busy periods (zeroed, not allocated again: ~2 against ~20 ms for SmolLM2's 8 x 256).

Everything here that touches the model runs in the loop's thread (:meth:`ModelBatch.tick`);
request threads only queue rows, cancel them and read their tokens.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from qkv.attention import BatchKVCache
from qkv.generation.batch import CHUNK, Batch, Prefill, Request, Row, Token
from qkv.models.gpt import GPT
from qkv.serve.loop import BusyError

_END = object()  # a row's last item
# Prompt tokens prefilled per turn of the loop, at least one prompt or chunk: a class that asks to
# generate at once joins over a few turns, while the rows already decoding take a step in each; a
# prompt longer than qkv.generation.batch.CHUNK (32) tokens is prefilled a chunk per turn
PREFILL_TOKENS = 32


class RowStream:
    """The tokens of one request, as the loop produces them (iterate it); an error in the batch
    is raised here. :meth:`cancel` (the client left) frees the row at the next step. ``on_end``
    callbacks run in the loop's thread when the row is over, however it ends (give back what the
    request held: its model)."""

    def __init__(self, request: Request, transform: Callable[[Token], object] | None = None) -> None:
        self.request = request
        self.transform = transform  # applied in the loop's thread (e.g. keep one layer's row)
        self.started = 0.0  # when it joined the batch
        self.on_end: list[Callable[[], object]] = []
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.joined = threading.Event()  # the request has a row (its prefill may still run)
        self._ended = False

    def __iter__(self) -> Iterator[object]:
        while True:
            item = self._items.get()
            if item is _END:
                self._items.put(_END)  # a later iteration ends too
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, item: object) -> None:
        self._items.put(item)

    def _end(self, error: BaseException | None = None) -> None:
        """The row is over: its error (if any), the end, and what it held given back (once)."""
        if self._ended:
            return
        self._ended = True
        if error is not None:
            self._items.put(error)
        for release in self.on_end:
            with contextlib.suppress(Exception):  # giving back must never stop the loop
                release()
        self._items.put(_END)


class ModelBatch:
    """The running batch of one model, stepped by the compute loop.

    Args:
        model: the decoder. rows: the most requests decoding at once. cache_len: the longest
            prompt + reply a row holds (the server's token limit).
        queued: requests that may wait for a row beyond ``rows``.
        name: the model's id, for messages. wake: tells the loop a row is waiting.
    """

    def __init__(self, model: GPT, *, rows: int, cache_len: int, queued: int, name: str,
                 wake: Callable[[], None] = lambda: None) -> None:
        if rows < 1:
            raise ValueError(f"a batch needs >= 1 row, got {rows}")
        self.model, self.rows, self.cache_len = model, rows, cache_len
        self.queued, self.name, self.wake = queued, name, wake
        self._lock = threading.Lock()
        self._pending: collections.deque[RowStream] = collections.deque()
        self._live: dict[Row, RowStream] = {}
        self._joining: collections.deque[tuple[RowStream, Prefill]] = collections.deque()  # long prompts
        self._batch: Batch | None = None  # while it has rows (loop thread only)
        self._spare: BatchKVCache | None = None  # the last batch's cache, for the next one
        self._seconds = 1.0  # a running mean of how long a request holds a row, for Retry-After
        self.steps = 0  # batched steps run (tests, benchmarks)
        self.peak_rows = 0  # the most rows decoded by one step

    # ------------------------------------------------------------------ from any thread

    def running(self) -> int:
        """Requests decoding or prefilling their prompts a chunk at a time."""
        with self._lock:
            return len(self._live) + len(self._joining)

    def waiting(self) -> int:
        with self._lock:
            return len(self._pending)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._live or self._pending or self._joining)

    def submit(self, request: Request, transform: Callable[[Token], object] | None = None) -> RowStream:
        """Queue ``request`` for a row (first come, first served); its tokens come from the
        returned stream. BusyError when ``rows`` decode and ``queued`` wait already."""
        request.check(self.model.cfg.max_seq_len)
        stream = RowStream(request, transform)
        with self._lock:
            live = len(self._live) + len(self._joining)
            if live + len(self._pending) >= self.rows + self.queued:
                after = max(1, min(60, round(self._seconds * (1 + len(self._pending)) / self.rows)))
                raise BusyError(f"{self.name} is busy ({live} requests decoding and "
                                f"{len(self._pending)} waiting); try again in {after} s", after)
            self._pending.append(stream)
        self.wake()
        return stream

    def withdraw(self, stream: RowStream) -> bool:
        """Take a request that is still waiting out of the queue (True if it was waiting)."""
        with self._lock:
            if stream in self._pending:
                self._pending.remove(stream)
                return True
        return False

    def close(self) -> None:
        """End every row and waiting request (the server stops, or the model is unloaded)."""
        with self._lock:
            streams = [*self._live.values(), *self._pending, *(j[0] for j in self._joining)]
            self._pending.clear()
            self._joining.clear()
        for s in streams:
            s.cancel()
            s.joined.set()
            s._end()

    # ------------------------------------------------------------------ the loop's thread

    @torch.inference_mode()
    def tick(self) -> None:
        """Drop cancelled rows, prefill waiting requests into free rows (about
        :data:`PREFILL_TOKENS` prompt tokens per turn, at least one prompt or chunk; a prompt
        longer than a chunk a chunk per turn, then into its row), then one step of every live
        row; each row's tokens go to its stream. An error reaches the rows it concerns."""
        try:
            self._tick()
        except Exception as e:  # every request of this batch hears of it
            with self._lock:
                streams = [*self._live.values()]
                self._live.clear()
            self._batch = None
            for s in streams:
                s._end(e)

    def _tick(self) -> None:
        batch = self._batch
        if batch is None:
            spare, self._spare = self._spare, None
            batch = self._batch = Batch(self.model, self.rows, self.cache_len, cache=spare)
        for row, stream in list(self._live.items()):
            if stream.cancelled:
                batch.leave(row)
                self._finish(row, stream)
        prefilled = 0  # tokens first: the rows already decoding wait for about PREFILL_TOKENS of prompts
        while prefilled < PREFILL_TOKENS:
            if self._joining:  # a long prompt's next chunk (oldest first)
                prefilled += self._chunk(batch)
                continue
            with self._lock:
                if not self._pending or len(self._live) + len(self._joining) >= self.rows:
                    break
                stream = self._pending.popleft()
            stream.joined.set()
            if len(stream.request.ids) <= CHUNK:
                self._join(batch, stream)
                prefilled += len(stream.request.ids)
                continue
            try:  # a chunk a turn, in a cache of its own, then into a row
                prefill = batch.start(stream.request)
            except Exception as e:
                stream._end(e)
                continue
            with self._lock:
                self._joining.append((stream, prefill))
        if len(batch):
            events = batch.step()
            self.steps += 1
            self.peak_rows = max(self.peak_rows, len(events))
            for row, tok in events:
                stream = self._live.get(row)
                if stream is not None:
                    self._deliver(row, stream, tok)
        if not len(batch):  # emptied: its cache waits for the next busy period
            self._spare, self._batch = batch.take_cache(), None

    def _chunk(self, batch: Batch) -> int:
        """The next chunk of the oldest long prompt being prefilled; once it is all prefilled,
        its request joins the batch. Returns the tokens prefilled (0 when it was cancelled)."""
        stream, p = self._joining[0]
        if stream.cancelled:
            with self._lock:
                self._joining.popleft()
            stream._end()
            return 0
        before = p.done
        try:
            batch.prefill(p)
        except Exception as e:
            with self._lock:
                self._joining.popleft()
            stream._end(e)
            return 0
        if p.finished:
            with self._lock:
                self._joining.popleft()
            self._join(batch, stream, p)
        return p.done - before

    def _join(self, batch: Batch, stream: RowStream, prefilled: Prefill | None = None) -> None:
        """Prefill one request into the batch, or join it with its finished prefill (its errors
        go to it alone)."""
        if stream.cancelled:
            stream._end()
            return
        stream.started = time.monotonic()
        try:
            row, tok = batch.join(stream.request, prefilled)
        except Exception as e:
            stream._end(e)
            return
        with self._lock:
            self._live[row] = stream
        self._deliver(row, stream, tok)

    def _deliver(self, row: Row, stream: RowStream, tok: Token | None) -> None:
        if tok is not None:
            stream._put(tok if stream.transform is None else stream.transform(tok))
        if row.done:
            self._finish(row, stream)

    def _finish(self, row: Row, stream: RowStream) -> None:
        with self._lock:
            self._live.pop(row, None)
            self._seconds = 0.8 * self._seconds + 0.2 * (time.monotonic() - stream.started)
        stream._end()
