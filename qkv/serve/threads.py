"""Where the server's model computations run: in threads that end with them.

OpenMP (PyTorch's CPU kernels, and the saved decoding steps) keeps a pool of worker threads for
every thread that ever ran a parallel region, for as long as that thread lives. The server's
request threads (AnyIO's worker pool) live on between requests; once two pools are alive there
are more OpenMP threads than cores, and libgomp then makes every pool's workers sleep instead of
spinning between parallel regions, so each region of every later step pays a wake-up. Measured
on 2 cores (SmolLM2 q4): one ``/api/attention`` request computed in a request thread left the
running batch decoding at 50 instead of 108 tok/s for as long as that thread lived, and a model
loaded in one halved it too (18 against 34 tok/s, eager). A thread that ends takes its pool with
it, so every computation a request asks for runs in one: :func:`in_passing_thread` for a call,
:class:`OwnThread` for a stream of steps; the running batch has its own thread
(:mod:`qkv.serve.batching`), which ends when the batch empties.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread that ends with it (its exception raised here)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name="qkv-compute", daemon=True)  # Ctrl-C need not wait for it
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class OwnThread(Iterator[T], Generic[T]):
    """``items`` (a generator of decoding steps, say) computed in a thread of their own that
    ends with them; iterate this to get them, in order, with their exception raised here.

    The thread runs ahead of the reader (a token is small; a reply is at most a few hundred).
    :meth:`release` (the client left, or the response is over) makes it stop before its next
    item and returns at once: the step in progress, if any, finishes first (no wait on the
    caller's thread, which may be the event loop's). The generator is closed in its own thread,
    then ``on_end`` runs there (give back what the computation held: its work slot, its model),
    then the reader sees the end.
    """

    def __init__(self, items: Iterable[T], name: str = "qkv-steps",
                 on_end: Callable[[], object] | None = None) -> None:
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._on_end = on_end
        self._thread = threading.Thread(target=self._run, args=(iter(items),), name=name, daemon=True)
        self._thread.start()

    def _run(self, it: Iterator[T]) -> None:
        try:
            try:
                for item in it:
                    if self._stop.is_set():
                        break
                    self._items.put(item)
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        except BaseException as e:  # from a step or from closing
            self._items.put(_Failed(e))
        finally:
            try:
                if self._on_end is not None:
                    self._on_end()
            finally:
                self._items.put(_END)

    def __next__(self) -> T:
        item = self._items.get()
        if item is _END:
            self._items.put(_END)  # a later call ends too
            raise StopIteration
        if isinstance(item, _Failed):
            raise item.error
        return item  # type: ignore[return-value]

    def release(self) -> None:
        """Stop before the next item (idempotent; returns without waiting)."""
        self._stop.set()

    def alive(self) -> bool:
        """Whether its thread is still running (tests)."""
        return self._thread.is_alive()
