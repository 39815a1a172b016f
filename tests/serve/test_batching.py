"""The running batch of `qkv serve` (qkv.serve.batching), stepped by the compute loop: requests
from many threads decode together and each gets what it gets alone (reference: the same request
decoded alone by `generate`, eagerly); a client that leaves frees its row; the bounds on rows
and waiting requests hold; the batch's cache is allocated once across busy periods."""

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

import qkv.generation.batch as batch_module
import qkv.serve.batching as batching_module
from qkv.generation.batch import Request
from qkv.serve.batching import ModelBatch
from qkv.serve.loop import BusyError, ComputeLoop

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def engine(m, rows=4, queued=4) -> tuple[ComputeLoop, ModelBatch]:
    """A loop and one model's running batch in it."""
    loop = ComputeLoop()
    b = loop.add_batch("m", lambda: ModelBatch(m, rows=rows, cache_len=48, queued=queued, name="m",
                                                wake=loop.wake))
    assert isinstance(b, ModelBatch)
    return loop, b


def test_requests_from_many_threads_decode_together_as_alone():
    m = model()
    loop, e = engine(m, rows=4)
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
    wait_until(lambda: not e.busy(), "the batch to empty")
    assert (e.running(), e.waiting()) == (0, 0)
    loop.close()


def test_a_cancelled_row_leaves_frees_its_place_and_gives_back_what_it_held():
    m = model()
    loop, e = engine(m, rows=1, queued=1)
    released = []
    first = e.submit(Request(ids(4, 1), 40), lambda t: (time.sleep(0.02), t)[1])
    first.on_end.append(lambda: released.append(threading.current_thread()))
    it = iter(first)
    next(it)
    first.cancel()
    assert len(list(it)) < 39  # it ended early
    assert released == [loop.thread]  # given back once, in the loop
    second = [t.id for t in e.submit(Request(ids(5, 2), 6))]  # the row came free
    assert second == alone(m, Request(ids(5, 2), 6))
    loop.close()


def test_full_rows_and_a_full_waiting_room_are_busy():
    m = model()
    loop, e = engine(m, rows=1, queued=1)
    slow = e.submit(Request(ids(4, 1), 40), lambda t: (time.sleep(0.05), t)[1])
    wait_until(lambda: e.running() == 1, "the first row decoding")
    waiting = e.submit(Request(ids(4, 2), 4))  # waits for the row
    busy = r"m is busy \(1 requests decoding and 1 waiting\); try again in"
    with pytest.raises(BusyError, match=busy) as err:
        e.submit(Request(ids(4, 3), 4))
    assert 1 <= err.value.retry_after <= 60
    assert e.withdraw(waiting) and not e.withdraw(waiting)  # a request that gives up waiting
    slow.cancel()
    list(slow)
    loop.close()


def test_a_failing_prefill_reaches_its_request_only(monkeypatch):
    m = model()
    loop, e = engine(m)
    from qkv.generation import batch as batch_mod

    real = batch_mod.Batch.join

    def join(self, request, prefilled=None):
        if len(request.ids) == 7:
            raise RuntimeError("boom")
        return real(self, request, prefilled)

    monkeypatch.setattr(batch_mod.Batch, "join", join)
    with pytest.raises(RuntimeError, match="boom"):
        list(e.submit(Request(ids(7, 1), 4)))
    assert [t.id for t in e.submit(Request(ids(5, 1), 4))] == alone(m, Request(ids(5, 1), 4))
    loop.close()


def test_concurrent_http_generations_equal_the_same_requests_alone(runs_dir):
    """Four clients at once on the batched server, against a server that decodes one request at
    a time (batch_rows 1): the same tokens and the same attention rows."""
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

    with TestClient(create_app(runs_dir=runs_dir, batch_rows=1)) as c:
        want = [run(c, b) for b in bodies]
    app = create_app(runs_dir=runs_dir, batch_rows=4)
    with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: run(c, b), bodies))
    for g, w in zip(got, want, strict=True):
        assert [i for i, _ in g] == [i for i, _ in w]
        for (_, a), (_, b) in zip(g, w, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)


def test_a_new_busy_period_reuses_the_last_batchs_cache(monkeypatch):
    """Requests one after another (each its own busy period: the batch empties) allocate the
    batch's cache once and still decode as alone."""
    from qkv.generation import batch as batch_mod

    made = []
    real = batch_mod.Batch._make_cache
    monkeypatch.setattr(batch_mod.Batch, "_make_cache", lambda self, n: made.append(n) or real(self, n))
    m = model()
    loop, e = engine(m, rows=2)
    for n in (3, 6, 4):
        r = Request(ids(n, 30 + n), 7)
        assert [t.id for t in e.submit(r)] == alone(m, r)
        wait_until(lambda: e._batch is None, "the batch to empty")
    assert made == [48]
    loop.close()


def test_a_long_prompt_joins_a_chunk_per_turn_while_the_decoding_rows_step(monkeypatch):
    """Tokens first for long prompts too: a prompt longer than a chunk (8 tokens here, 64 in a
    server) is prefilled one chunk per turn of the loop in a cache of its own while the row
    already decoding takes a step in each turn, then joins its row; both decode as they do
    alone (generate, whole prompt at once)."""
    monkeypatch.setattr(batch_module, "CHUNK", 8)
    monkeypatch.setattr(batching_module, "CHUNK", 8)
    monkeypatch.setattr(batching_module, "PREFILL_TOKENS", 8)
    m = model()
    e = ModelBatch(m, rows=2, cache_len=48, queued=2, name="m")
    short, long = Request(ids(4, 1), 12), Request(ids(30, 2), 6)
    s = e.submit(short)
    e.tick()
    assert (e.steps, e.peak_rows) == (1, 1)
    lo = e.submit(long)
    for turn in range(3):  # chunks of 8, 8 and 8 of its 30 tokens: the short row steps alone
        e.tick()
        assert (e.steps, e.peak_rows, e.running()) == (2 + turn, 1, 2)
    e.tick()  # the last 6 tokens, then it joins and steps beside the short row
    assert (e.steps, e.peak_rows) == (5, 2)
    while e.busy():
        e.tick()
    assert [t.id for t in s] == alone(m, short)
    assert [t.id for t in lo] == alone(m, long)
