"""The running batch of `qkv serve` (qkv.serve.batching): requests from many threads decode
together and each gets what it gets alone; a client that leaves frees its row; the bounds on
rows, waiting requests and the work queue's slots hold."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import decode_alone as alone
from helpers import random_decoder as model
from helpers import token_ids as ids
from helpers import wait_until

from qkv.generation.batch import Request
from qkv.serve.batching import BatchEngine
from qkv.serve.work import BusyError, WorkQueue

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def engine(m, rows=4, queued=4, wait=10.0, work=None) -> BatchEngine:
    work = work or WorkQueue()
    return BatchEngine(m, rows=rows, cache_len=48, queued=queued, max_wait_s=wait,
                       slot=lambda: work.acquire("m"), name="m")


def test_requests_from_many_threads_decode_together_as_alone():
    m = model()
    work = WorkQueue()
    e = engine(m, rows=4, work=work)
    reqs = [Request(ids(3 + 2 * i, i), 8 + i, temperature=0.8 * (i % 2), seed=i) for i in range(6)]
    start = threading.Barrier(6)

    def ask(r: Request) -> list[int]:
        start.wait()
        return [t.id for t in e.submit(r)]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, reqs))
    assert got == [alone(m, r) for r in reqs]
    assert e.peak_rows > 1  # they did share steps
    assert e.steps < sum(r.max_new_tokens for r in reqs)
    deadline = time.monotonic() + 5
    while (e.running() or work.running()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (e.running(), e.waiting(), work.running()) == (0, 0, 0)  # the batch gave its slot back


def test_a_cancelled_row_leaves_and_frees_its_place():
    m = model()
    e = engine(m, rows=1, queued=1)
    first = e.submit(Request(ids(4, 1), 40), lambda t: (time.sleep(0.02), t)[1])
    it = iter(first)
    next(it)
    first.cancel()
    assert len(list(it)) < 39  # it ended early
    second = [t.id for t in e.submit(Request(ids(5, 2), 6))]  # the row came free
    assert second == alone(m, Request(ids(5, 2), 6))


def test_full_rows_and_a_full_queue_are_busy():
    m = model()
    e = engine(m, rows=1, queued=0)
    stream = e.submit(Request(ids(4, 1), 40), lambda t: (time.sleep(0.05), t)[1])
    with pytest.raises(BusyError, match="busy"):
        e.submit(Request(ids(4, 2), 4))
    stream.cancel()
    list(stream)
    e2 = engine(m, rows=1, queued=1, wait=0.2)
    s2 = e2.submit(Request(ids(4, 1), 40), lambda t: (time.sleep(0.05), t)[1])  # a slow row
    with pytest.raises(BusyError, match="no row came free"):
        e2.submit(Request(ids(4, 2), 4))  # it waited 0.2 s in the queue
    s2.cancel()
    list(s2)


def test_a_server_with_no_free_slot_refuses_before_the_batch_starts():
    work = WorkQueue(per_model=1, total=1, queued=0)
    held = work.acquire("m")
    e = engine(model(), work=work)
    with pytest.raises(BusyError):
        e.submit(Request(ids(4, 1), 4))
    held.release()
    assert len(list(e.submit(Request(ids(4, 1), 4)))) == 4


def test_a_failing_prefill_reaches_its_request_only(monkeypatch):
    m = model()
    e = engine(m)
    from qkv.generation import batch as batch_mod

    real = batch_mod.Batch.join

    def join(self, request):
        if len(request.ids) == 7:
            raise RuntimeError("boom")
        return real(self, request)

    monkeypatch.setattr(batch_mod.Batch, "join", join)
    with pytest.raises(RuntimeError, match="boom"):
        list(e.submit(Request(ids(7, 1), 4)))
    assert [t.id for t in e.submit(Request(ids(5, 1), 4))] == alone(m, Request(ids(5, 1), 4))


def test_concurrent_http_generations_equal_the_same_requests_alone(runs_dir):
    """Four clients at once on the batched server, against the server that decodes each request
    alone (batch_rows 0): the same tokens and the same attention rows."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    bodies = [{"model": "runs/gpt-tiny", "prompt": p, "max_new_tokens": n, "layer": layer, "head": head,
               "temperature": t, "seed": 7}
              for p, n, layer, head, t in (("ROMEO", 12, 0, None, 0.0), ("JULIET: O", 5, 1, 2, 0.0),
                                           ("But soft, what light", 9, -1, 0, 1.0), ("It is", 14, 0, 1, 0.7))]

    def run(client, body):
        r = client.post("/api/generate", json=body)
        assert r.status_code == 200, r.text
        events = [json.loads(x) for x in r.text.splitlines()]
        assert events[-1]["event"] == "done", events[-1]
        return [(e["id"], e["weights"]) for e in events if e["event"] == "token"]

    alone_app = create_app(runs_dir=runs_dir, batch_rows=0)
    with TestClient(alone_app) as c:
        want = [run(c, b) for b in bodies]
    app = create_app(runs_dir=runs_dir, batch_rows=4)
    with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: run(c, b), bodies))
    for g, w in zip(got, want, strict=True):
        assert [i for i, _ in g] == [i for i, _ in w]
        for (_, a), (_, b) in zip(g, w, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)


def test_busy_and_idle_are_called_around_each_busy_period_never_inside_one():
    """on_busy when a batch starts, on_idle once its thread has emptied it and given its slot
    back (what qkv serve stops and starts its background builds with): two requests at once
    share one busy period; a later one opens another; no on_idle while a row is decoding."""
    m = model()
    work = WorkQueue()
    calls: list[tuple[str, int]] = []
    e = BatchEngine(m, rows=4, cache_len=48, queued=4, max_wait_s=10.0, slot=lambda: work.acquire("m"),
                    name="m", on_busy=lambda: calls.append(("busy", e.running())),
                    on_idle=lambda: calls.append(("idle", e.running() + work.running())))
    start = threading.Barrier(2)

    def ask(r: Request) -> list[int]:
        start.wait()
        return [t.id for t in e.submit(r)]

    def settled() -> None:  # the batch's thread has ended and its on_idle has run
        deadline = time.monotonic() + 5
        while (e._thread is not None or not calls or calls[-1][0] != "idle") and time.monotonic() < deadline:
            time.sleep(0.01)
        with e._hooks:
            pass

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ask, [Request(ids(3, 1), 12), Request(ids(4, 2), 12)]))
    settled()
    n = len(calls)
    assert [t.id for t in e.submit(Request(ids(5, 3), 6))] == alone(m, Request(ids(5, 3), 6))
    settled()
    assert [c for c, _ in calls[n:]] == ["busy", "idle"]
    kinds = [c for c, _ in calls]
    # every busy period opens with on_busy and the last closes with on_idle; an on_idle is never
    # followed by another without a busy between, and sees nothing decoding, the slot given back
    assert kinds[0] == "busy" and kinds[-1] == "idle" and "idle,idle" not in ",".join(kinds)
    assert all(k == 0 for c, k in calls if c == "idle")
    e.close()  # closing: the cancelled batch empties without an on_idle
    assert calls[-1][0] == "idle" and len(calls) == n + 2


def test_a_new_busy_period_reuses_the_last_batchs_cache(monkeypatch):
    """Requests one after another (each its own busy period: the batch empties, its thread ends)
    allocate the batch's cache once and still decode as alone; closing lets it go."""
    from qkv.generation import batch as batch_mod

    made = []
    real = batch_mod.Batch._make_cache
    monkeypatch.setattr(batch_mod.Batch, "_make_cache", lambda self, n: made.append(n) or real(self, n))
    m = model()
    e = engine(m, rows=2)
    for n in (3, 6, 4):
        r = Request(ids(n, 30 + n), 7)
        assert [t.id for t in e.submit(r)] == alone(m, r)
        wait_until(lambda: e._thread is None, "the batch to empty")
    assert made == [48]
    e.close()
    assert e._spare is None
