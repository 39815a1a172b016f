"""One running batch per model for ``POST /api/generate``: concurrent requests decode together.

Before, each generation decoded alone in its own thread (batch 1), at most ``per_model`` at
once: every thread read every weight for every token, so four students on one server each got
a quarter of the machine. Here a request *joins* the model's running batch
(:class:`qkv.generation.batch.Batch`): one thread per model steps all its rows at once, a
request's row is filled by a prefill of its prompt, rows leave when done or when their client
goes, and a new request joins between two steps. Each row decodes exactly as it would alone,
its attention row included.

Bounds, as the work queue's (:mod:`qkv.serve.work`): at most ``rows`` requests decode on one
model at once and ``queued`` more wait for a row (first come, first served), each at most
``max_wait_s`` seconds; beyond, :class:`~qkv.serve.work.BusyError` (503 with Retry-After). The
batch's thread holds one slot of the work queue while it runs (taken by the request that starts
it, so a full server still answers 503 before any stream begins), so the cores stay shared
with the other endpoints as before. Memory: one (L, rows, K, S, D) cache per model with a
running batch, S = the server's token limit, freed when the batch empties.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from qkv.attention import BatchKVCache
from qkv.generation.batch import Batch, Request, Row, Token
from qkv.models.gpt import GPT
from qkv.serve.work import BusyError, Ticket

_END = object()  # a row's last item


_ENGINES: weakref.WeakSet[BatchEngine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for engine in list(_ENGINES):
        engine.close()


class RowStream:
    """The tokens of one request, as the batch's thread produces them (iterate it); an error in
    the batch is raised here. :meth:`cancel` (the client left) frees the row at the next step."""

    def __init__(self, request: Request, transform: Callable[[Token], object] | None = None) -> None:
        self.request = request
        self.transform = transform  # applied in the batch's thread (e.g. keep one layer's row)
        self.started = 0.0  # when it joined the batch
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.joined = threading.Event()  # the request has a row (its prefill may still run)

    def __iter__(self) -> Iterator[object]:
        while True:
            item = self._items.get()
            if item is _END:
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


class BatchEngine:
    """The running batch of one model, and the thread that steps it while it has rows.

    Args:
        model: the decoder. rows: the most requests decoding at once. cache_len: the longest
            prompt + reply a row holds (the server's token limit).
        queued: requests that may wait for a row; max_wait_s: how long each may wait.
        slot: takes a slot of the work queue for the batch's thread (may raise BusyError).
        name: the model's id, for messages.
        on_busy: called when the batch starts (a first request after a pause); on_idle: called
            by the batch's thread when the batch has emptied, after it gave its slot back
            (``qkv serve`` stops its background builds on one and starts them on the other).
    """

    def __init__(self, model: GPT, *, rows: int, cache_len: int, queued: int, max_wait_s: float,
                 slot: Callable[[], Ticket], name: str, on_busy: Callable[[], object] | None = None,
                 on_idle: Callable[[], object] | None = None) -> None:
        if rows < 1:
            raise ValueError(f"a batch needs >= 1 row, got {rows}")
        self.model, self.rows, self.cache_len = model, rows, cache_len
        self.queued, self.max_wait_s, self.slot, self.name = queued, max_wait_s, slot, name
        self.on_busy, self.on_idle = on_busy, on_idle
        self._hooks = threading.Lock()  # on_busy / on_idle, one at a time, never under self._lock
        self._closing = False
        self._lock = threading.Lock()
        self._pending: collections.deque[RowStream] = collections.deque()
        self._live: dict[Row, RowStream] = {}
        self._joining: list[RowStream] = []  # taken from _pending, being prefilled
        self._thread: threading.Thread | None = None
        self._ticket: Ticket | None = None  # the running batch's work slot
        self._seconds = 1.0  # a running mean of how long a request holds a row, for Retry-After
        self._batch: Batch | None = None  # the running batch (under _lock)
        self._spare: BatchKVCache | None = None  # the last batch's cache, for the next one (under _lock)
        self.steps = 0  # batched steps run (for tests and /health)
        self.peak_rows = 0  # the most rows decoded by one step
        _ENGINES.add(self)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every request and wait (at most ``timeout`` s) for the batch's thread to end
        (at exit: a thread still inside a kernel when the interpreter goes aborts the process)."""
        with self._lock:
            self._closing = True  # no on_idle (no build started) as the cancelled batch empties
            self._spare = None
            for stream in [*self._live.values(), *self._joining, *self._pending]:
                stream.cancel()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def running(self) -> int:
        """Requests decoding now (rows of the batch, and those joining it)."""
        with self._lock:
            return len(self._live) + len(self._joining)

    def waiting(self) -> int:
        """Requests waiting for a row."""
        with self._lock:
            return len(self._pending)

    def _busy(self, why: str) -> BusyError:
        after = max(1, min(60, round(self._seconds * (1 + len(self._pending)) / self.rows)))
        return BusyError(f"{self.name} is busy ({why}); try again in {after} s", after)

    def submit(self, request: Request, transform: Callable[[Token], object] | None = None) -> RowStream:
        """Queue ``request`` for a row and wait (at most ``max_wait_s``) until it has one; its
        tokens (each passed through ``transform``, in the batch's thread, if given) then come
        from the returned stream. BusyError when too many wait already, when no row came free
        in time, or when the work queue has no slot for a new batch."""
        request.check(self.model.cfg.max_seq_len)
        stream = RowStream(request, transform)
        with self._lock:
            if len(self._live) + len(self._joining) + len(self._pending) >= self.rows + self.queued:
                raise self._busy(f"{len(self._live)} requests decoding and {len(self._pending)} waiting")
            started = self._thread is None
            if started:  # start the batch: it holds a work slot while it runs
                self._ticket = self.slot()
                self._thread = threading.Thread(target=self._run, daemon=True, name=f"qkv-batch-{self.name}")
                self._thread.start()
            self._pending.append(stream)
        if started and self.on_busy is not None:
            with self._hooks, contextlib.suppress(Exception):  # after the start is recorded: an
                self.on_busy()  # on_idle before it saw none; its failure costs speed, not the request
        if not stream.joined.wait(self.max_wait_s):
            with self._lock:
                if stream in self._pending:
                    self._pending.remove(stream)
                    raise self._busy(f"no row came free in {self.max_wait_s:g} s")
        return stream

    # ----------------------------------------------------------------- the batch's thread
    # State shared with submit() is changed under self._lock only. A thread runs while the
    # batch has rows (live, joining or pending); it gives its work slot back the moment the
    # last one ends, so a finished stream finds the slot free. A later request starts a new one.

    def _stop(self) -> None:
        """Under the lock: the batch is empty; keep its cache for the next one and give its work
        slot back now."""
        if self._batch is not None:
            self._keep(self._batch)
            self._batch = None
        self._thread = None
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            ticket.release()

    def _idle(self) -> bool:
        return not self._live and not self._pending and not self._joining

    def _admit(self, batch: Batch) -> None:
        """Under the lock: drop cancelled rows, move waiting requests into free rows."""
        for row, stream in list(self._live.items()):
            if stream.cancelled:
                batch.leave(row)
                self._live.pop(row)
                stream._put(_END)
        while self._pending and len(self._live) + len(self._joining) < self.rows:
            stream = self._pending.popleft()
            stream.joined.set()
            self._joining.append(stream)

    def _deliver(self, row: Row, stream: RowStream, tok: Token | None) -> None:
        if tok is not None:
            stream._put(tok if stream.transform is None else stream.transform(tok))
        if row.done:
            with self._lock:
                self._live.pop(row, None)
                self._seconds = 0.8 * self._seconds + 0.2 * (time.monotonic() - stream.started)
                if self._idle():
                    self._stop()
            stream._put(_END)

    def _join(self, batch: Batch, stream: RowStream) -> None:
        """Prefill one admitted request into the batch (its errors go to it alone)."""
        row, tok = None, None
        if not stream.cancelled:
            stream.started = time.monotonic()
            try:
                row, tok = batch.join(stream.request)
            except Exception as e:
                stream._put(e)
        with self._lock:
            self._joining.remove(stream)
            if row is not None:
                self._live[row] = stream
            elif self._idle():
                self._stop()
        if row is None:
            stream._put(_END)
        else:
            self._deliver(row, stream, tok)

    def _keep(self, batch: Batch) -> None:
        """Under the lock: an emptied batch's cache waits for the next batch (zeroed and reused,
        not allocated again: ~20 ms of page faults per busy period on SmolLM2's 8 x 256)."""
        if not len(batch) and not self._closing:
            self._spare = batch.take_cache()

    def _run(self) -> None:
        try:
            self._steps()
        finally:
            if self.on_idle is not None:
                with self._hooks:  # serialised with on_busy; a batch started since is seen here
                    with self._lock:
                        idle = self._thread is None and not self._closing
                    if idle:
                        with contextlib.suppress(Exception):  # a failed build start costs speed only
                            self.on_idle()

    def _steps(self) -> None:
        me = threading.current_thread()
        try:
            with torch.inference_mode():
                with self._lock:
                    spare, self._spare = self._spare, None
                batch = Batch(self.model, self.rows, self.cache_len, cache=spare)
                with self._lock:
                    self._batch = batch
                while True:
                    with self._lock:
                        if self._thread is not me:  # stopped: the slot is given back
                            return
                        self._admit(batch)
                        joining = list(self._joining)
                        if self._idle():
                            self._stop()
                            return
                    for stream in joining:
                        self._join(batch, stream)
                    if len(batch):
                        events = batch.step()
                        self.steps += 1
                        self.peak_rows = max(self.peak_rows, len(events))
                        for row, tok in events:
                            stream = self._live.get(row)
                            if stream is not None:
                                self._deliver(row, stream, tok)
        except BaseException as e:  # every request of this batch hears of it
            with self._lock:
                streams: list[RowStream] = []
                if self._thread is me:
                    streams = [*self._live.values(), *self._joining, *self._pending]
                    self._live.clear()
                    self._joining.clear()
                    self._pending.clear()
                    self._stop()
            for stream in streams:
                stream.joined.set()
                stream._put(e)
