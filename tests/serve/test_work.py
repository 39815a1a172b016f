"""qkv.serve.work: at most N requests compute per model and M in all, a few wait, the rest get
BusyError (503 + Retry-After); checked with threads that hold their slot until told to let go."""

from __future__ import annotations

import threading

import pytest
from helpers import wait_until

from qkv.serve.work import BusyError, WorkQueue


class Holder:
    """A thread that takes a slot for ``key`` and keeps it until ``let_go`` is set."""

    def __init__(self, queue: WorkQueue, key: str) -> None:
        self.let_go = threading.Event()
        self.error: BaseException | None = None
        self.got = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(queue, key), daemon=True)
        self.thread.start()

    def _run(self, queue: WorkQueue, key: str) -> None:
        try:
            with queue.slot(key):
                self.got.set()
                self.let_go.wait(10)
        except BaseException as e:  # reported by finish()
            self.error = e

    def finish(self) -> None:
        self.let_go.set()
        self.thread.join(10)
        assert not self.thread.is_alive() and self.error is None, self.error


def test_per_model_slots_then_a_queue_then_busy() -> None:
    q = WorkQueue(per_model=1, total=4, queued=2, max_wait_s=10)
    first = Holder(q, "a")
    wait_until(first.got.is_set, "the first slot")
    waiting = [Holder(q, "a"), Holder(q, "a")]
    wait_until(lambda: q.waiting("a") == 2, "two waiting requests")
    assert (q.running("a"), q.running(), q.waiting()) == (1, 1, 2)
    busy = r"^a is busy \(1 requests running and 2 waiting\); try again in \d+ s$"
    with pytest.raises(BusyError, match=busy) as e:
        q.acquire("a")
    assert 1 <= e.value.retry_after <= 60
    with q.slot("b"):  # another model is not held up by a's queue
        assert q.running() == 2
    first.finish()
    wait_until(lambda: sum(h.got.is_set() for h in waiting) == 1, "one waiting request served")
    assert (q.running("a"), q.waiting("a")) == (1, 1)  # still one at a time
    for h in sorted(waiting, key=lambda h: not h.got.is_set()):  # the served one first
        h.finish()
    assert (q.running(), q.waiting()) == (0, 0)


def test_the_global_cap_holds_across_models() -> None:
    q = WorkQueue(per_model=2, total=2, queued=1, max_wait_s=10)
    holders = [Holder(q, "a"), Holder(q, "b")]
    wait_until(lambda: all(h.got.is_set() for h in holders), "two slots")
    late = Holder(q, "c")  # c's own count is 0, but the server is full: it waits
    wait_until(lambda: q.waiting("c") == 1, "c waiting")
    assert not late.got.is_set() and q.running() == 2
    with pytest.raises(BusyError):  # c's queue (1) is full
        q.acquire("c")
    holders[0].finish()
    wait_until(late.got.is_set, "c served")
    for h in [*holders[1:], late]:
        h.finish()


def test_the_waiting_room_in_all_is_bounded() -> None:
    q = WorkQueue(per_model=1, total=1, queued=1, max_wait_s=10)  # 1 x 1 waiting in all
    first = Holder(q, "a")
    wait_until(first.got.is_set, "the slot")
    second = Holder(q, "b")
    wait_until(lambda: q.waiting() == 1, "one waiting")
    with pytest.raises(BusyError, match="c is busy"):  # c's own queue is empty, the server's is full
        q.acquire("c")
    first.finish()
    second.finish()


def test_a_request_that_waits_too_long_gets_busy() -> None:
    q = WorkQueue(per_model=1, total=1, queued=4, max_wait_s=0.05)
    first = Holder(q, "a")
    wait_until(first.got.is_set, "the slot")
    with pytest.raises(BusyError, match=r"no slot came free in 0.05 s"):
        q.acquire("a")
    assert q.waiting() == 0  # it left the queue
    first.finish()


def test_a_ticket_releases_once() -> None:
    q = WorkQueue(per_model=1, total=1, queued=0)
    t = q.acquire("a")
    t.release()
    t.release()  # from a second path (stream end and stream dropped): no double count
    assert q.running() == 0
    with q.slot("a"):
        with pytest.raises(BusyError):
            q.acquire("a")  # no queue at all: busy at once
    with pytest.raises(ValueError, match="per_model must be >= 1"):
        WorkQueue(per_model=0)
