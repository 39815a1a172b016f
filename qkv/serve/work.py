"""A bounded work queue per model: how many requests compute at once, and how many may wait.

FastAPI runs the (synchronous) handlers in a pool of 40 threads; without a bound, 40 requests
for SmolLM2 would each build ~70 MB of attention weights at once and share the cores 40 ways.
Here a request takes a *slot* before it loads or runs a model:

- at most ``per_model`` requests compute on one model at once, and ``total`` on all models;
- up to ``queued`` more requests per model wait for a slot (``queued x total`` in all), each
  at most ``max_wait_s`` seconds;
- anything beyond gets :class:`BusyError`, which the app answers with 503 and ``Retry-After``.

So the threads that hold or wait for model work stay bounded (``total + queued x total``,
24 by default) and the rest of the API (the model list, the page) keeps answering.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator


class BusyError(Exception):
    """Too many requests for a model (or for the server) right now; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Ticket:
    """A slot held by one request; :meth:`release` frees it (once, from any thread)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self.released = False

    def release(self) -> None:
        with self._lock:
            if self.released:
                return
            self.released = True
        self._release()


class WorkQueue:
    """Slots for model work: ``per_model`` at once per model, ``total`` in all, ``queued`` waiting
    per model (and ``queued x total`` in all), for at most ``max_wait_s`` seconds each."""

    def __init__(self, per_model: int = 2, total: int = 4, queued: int = 4, max_wait_s: float = 30.0) -> None:
        for name, value in (("per_model", per_model), ("total", total)):
            if value < 1:
                raise ValueError(f"the work queue's {name} must be >= 1, got {value}")
        if queued < 0 or max_wait_s < 0:
            raise ValueError(f"queued and max_wait_s must be >= 0, got {queued} and {max_wait_s}")
        self.per_model, self.total, self.queued, self.max_wait_s = per_model, total, queued, max_wait_s
        self._cond = threading.Condition()
        self._running: dict[Hashable, int] = {}
        self._waiting: dict[Hashable, int] = {}
        self._seconds = 1.0  # a running mean of how long a slot is held, for Retry-After

    # ----------------------------------------------------------------- state (for tests, /health)

    def running(self, key: Hashable | None = None) -> int:
        """Requests computing now (on model ``key``, or on all)."""
        with self._cond:
            return self._running.get(key, 0) if key is not None else sum(self._running.values())

    def waiting(self, key: Hashable | None = None) -> int:
        """Requests waiting for a slot now (for model ``key``, or for all)."""
        with self._cond:
            return self._waiting.get(key, 0) if key is not None else sum(self._waiting.values())

    # ----------------------------------------------------------------- slots

    def _free(self, key: Hashable) -> bool:
        return (self._running.get(key, 0) < self.per_model
                and sum(self._running.values()) < self.total)

    def _busy(self, key: Hashable, why: str) -> BusyError:
        after = max(1, min(60, math.ceil(self._seconds * (1 + self._waiting.get(key, 0)) / self.per_model)))
        return BusyError(f"{key} is busy ({why}); try again in {after} s", after)

    def acquire(self, key: Hashable) -> Ticket:
        """A slot for work on model ``key``, waiting for one if the queue has room; BusyError
        if it has none, or if no slot came free in ``max_wait_s`` seconds."""
        with self._cond:
            if not self._free(key):
                waiting = self._waiting.get(key, 0)
                if waiting >= self.queued or sum(self._waiting.values()) >= self.queued * self.total:
                    raise self._busy(key, f"{self._running.get(key, 0)} requests running and {waiting} "
                                     "waiting")
                self._waiting[key] = waiting + 1
                try:
                    ok = self._cond.wait_for(lambda: self._free(key), timeout=self.max_wait_s)
                finally:
                    self._waiting[key] -= 1
                    if not self._waiting[key]:
                        del self._waiting[key]
                if not ok:
                    raise self._busy(key, f"no slot came free in {self.max_wait_s:g} s")
            self._running[key] = self._running.get(key, 0) + 1
        t0 = time.monotonic()

        def release() -> None:
            with self._cond:
                self._running[key] -= 1
                if not self._running[key]:
                    del self._running[key]
                self._seconds = 0.8 * self._seconds + 0.2 * (time.monotonic() - t0)
                self._cond.notify_all()

        return Ticket(release)

    @contextlib.contextmanager
    def slot(self, key: Hashable) -> Iterator[None]:
        """``with queue.slot(model_id): ...``: hold a slot for the block (see :meth:`acquire`)."""
        ticket = self.acquire(key)
        try:
            yield
        finally:
            ticket.release()
