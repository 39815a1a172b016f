"""The same request computed once: a lecture hall asks the teacher's example thirty times.

:class:`Shared` answers a request that is already being computed with that computation's answer
(the later students wait for the first one's, they do not queue a computation of their own), and a
request answered recently from a small cache, keyed by the model's file version (a run retrained in
place has another key), the kind of computation and the request itself (its JSON, every field).
Only deterministic answers are shared: the lens, knock-out, q·k and patching (no sampling, no
clock). Serving systems call the first *request coalescing* (or *single flight*); a result cache
keyed by the full request is what an HTTP cache does for a GET.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class Shared:
    """Answers shared between identical requests.

    Args:
        max_entries: answers kept after they are computed (least recently asked dropped first);
            0 keeps none (identical requests in flight are still computed once).
    """

    def __init__(self, max_entries: int = 64) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._done: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._running: dict[Hashable, Future[Any]] = {}
        self.computed = 0  # answers computed
        self.joined = 0  # requests that waited for an identical one in flight
        self.hits = 0  # requests answered from the cache

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``'s answer for ``key``: from the cache, from an identical computation in
        flight (its exception too), or computed here (in the caller's thread)."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                self.hits += 1
                return self._done[key]
            running = self._running.get(key)
            if running is None:
                mine: Future[Any] = Future()
                self._running[key] = mine
            else:
                self.joined += 1
        if running is not None:
            return running.result()
        try:
            value = compute()
        except BaseException as e:
            with self._lock:
                del self._running[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._running[key]
            self.computed += 1
            if self.max_entries:
                self._done[key] = value
                while len(self._done) > self.max_entries:
                    self._done.popitem(last=False)
        mine.set_result(value)
        return value

    def forget(self) -> None:
        """Drop every cached answer (those in flight still reach their waiters)."""
        with self._lock:
            self._done.clear()
