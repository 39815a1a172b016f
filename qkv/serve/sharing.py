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
from typing import Any

from qkv.serve.loop import Job


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
        self._running: dict[Hashable, Job] = {}
        self.computed = 0  # answers computed
        self.joined = 0  # requests that waited for an identical one in flight
        self.hits = 0  # requests answered from the cache

    def job(self, key: Hashable, submit: Callable[[], Job]) -> Job:
        """The computation that answers ``key``: an answered :class:`Job` from the cache, the
        identical one in flight (one more waiter on it), or a new one from ``submit()`` (which
        queues it; its BusyError goes to the caller)."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                self.hits += 1
                return Job.answered(self._done[key])
            running = self._running.get(key)
            if running is not None and not running.cancelled:
                running.waiters += 1
                self.joined += 1
                return running
            job = submit()
            self._running[key] = job
        job.future.add_done_callback(lambda f: self._finished(key, job))
        return job

    def get(self, key: Hashable, submit: Callable[[], Job]) -> Any:
        """:meth:`job`'s answer, waited for here (its exception raised)."""
        return self.job(key, submit).future.result()

    def _finished(self, key: Hashable, job: Job) -> None:
        with self._lock:
            if self._running.get(key) is job:
                del self._running[key]
            if job.future.exception() is not None:
                return
            self.computed += 1
            if self.max_entries:
                self._done[key] = job.future.result()
                while len(self._done) > self.max_entries:
                    self._done.popitem(last=False)

    def forget(self) -> None:
        """Drop every cached answer (those in flight still reach their waiters)."""
        with self._lock:
            self._done.clear()
