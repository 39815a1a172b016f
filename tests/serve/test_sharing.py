"""A lecture hall on one server (issue 52): identical requests computed once and answered to
all (qkv.serve.sharing), and the compute loop's queue fair per client, interactive requests
before sweeps (qkv.serve.loop)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import HELD_S, wait_until

import qkv.serve.loop as loop_module
from qkv.serve.loop import CLIENT, CancelledError, ComputeLoop
from qkv.serve.sharing import Shared


def test_identical_requests_in_flight_are_computed_once_and_errors_reach_every_waiter():
    loop, shared, gate, calls = ComputeLoop(), Shared(max_entries=2), threading.Event(), []

    def compute(v: int):
        def run() -> int:
            calls.append(v)
            gate.wait(HELD_S)
            if v < 0:
                raise ValueError(f"bad {v}")
            return v * 10
        return lambda: loop.submit(run)

    with ThreadPoolExecutor(6) as pool:
        same = [pool.submit(shared.get, "k", compute(1)) for _ in range(4)]
        wait_until(lambda: shared.joined == 3, "three requests waiting for the first")
        bad = [pool.submit(shared.get, "bad", compute(-1)) for _ in range(2)]
        wait_until(lambda: shared.joined == 4, "the second bad request waiting for the first")
        gate.set()
        assert [f.result() for f in same] == [10] * 4
        for f in bad:
            with pytest.raises(ValueError, match="bad -1"):
                f.result()
    assert sorted(calls) == [-1, 1] and shared.computed == 1
    # answered from the cache afterwards; an error is not cached; least recently asked dropped
    assert shared.get("k", compute(99)) == 10 and shared.hits == 1
    assert shared.get("a", compute(2)) == 20 and shared.get("b", compute(3)) == 30  # "k" dropped
    assert shared.get("k", compute(4)) == 40 and calls[-1] == 4
    with pytest.raises(ValueError):
        shared.get("bad", compute(-1))
    assert calls.count(-1) == 2
    loop.close()


def _as(client: str, loop: ComputeLoop, fn, sweep: bool = False):
    CLIENT.set(client)
    return loop.call(fn, sweep=sweep)


def test_the_loop_takes_one_computation_per_client_in_turn_and_sweeps_last():
    """Student a queues four lens views, then b one, then c a patching sweep, then d one view:
    first come first served would run a, a, a, a, b, c, d; the fair queue runs a, then the sweep
    (x's running view and a's are two interactive computations in a row while it waits: the most
    it lets pass), then b, d, a, a, a."""
    loop, gate, order = ComputeLoop(), threading.Event(), []
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(_as, "x", loop, lambda: gate.wait(HELD_S))
        wait_until(lambda: loop.thread is not None and loop.waiting() == 0 and not first.done(), "running")
        futures = []
        for client, sweep in (("a", False),) * 4 + (("b", False), ("c", True), ("d", False)):
            n = loop.waiting() + 1
            futures.append(pool.submit(_as, client, loop, lambda c=client: order.append(c), sweep))
            wait_until(lambda n=n: loop.waiting() == n, "queued")
        gate.set()
        for f in futures:
            f.result()
    assert order == ["a", "c", "b", "d", "a", "a", "a"]
    loop.close()


def test_a_sweep_in_pieces_lets_the_others_run_between_its_pieces(monkeypatch):
    """A patching sweep runs one slice per turn of the loop (here one piece: the slice is 0 s):
    a lens view asked while its first piece runs is answered after that piece, not after the
    whole sweep; the sweep's answer is its generator's return value, and a model it holds stays
    held until its last piece."""
    monkeypatch.setattr(loop_module, "SLICE_S", 0.0)
    loop, order, gate = ComputeLoop(), [], threading.Event()
    held = []

    def sweep():
        held.append("acquired")
        try:
            for i in range(3):
                order.append(f"piece {i}")
                if i == 0:
                    gate.wait(HELD_S)
                yield i, 3
            return "swept"
        finally:
            held.append("released")

    def in_pieces(client: str):
        CLIENT.set(client)
        return loop.submit(sweep, label="patch", sweep=True, pieces=True).future.result()

    with ThreadPoolExecutor(4) as pool:
        swept = pool.submit(in_pieces, "a")
        wait_until(lambda: order == ["piece 0"], "the first piece running")
        view = pool.submit(_as, "b", loop, lambda: order.append("lens view"))
        wait_until(lambda: loop.waiting() == 1, "the lens view queued")
        assert held == ["acquired"]
        gate.set()
        assert swept.result() == "swept" and view.result() is None
    assert order == ["piece 0", "lens view", "piece 1", "piece 2"]
    assert held == ["acquired", "released"] and loop.jobs_run == 2
    loop.close()


@pytest.mark.usefixtures("one_thread")
def test_the_same_lens_request_from_a_class_is_computed_once_and_equals_it_alone(runs_dir):
    """Eight students ask the teacher's example at once: one forward pass in the loop for the
    lens and one for q·k, every answer equal to the same request on a server that shares nothing;
    asked again, it comes from the cache. Another text, or another head knocked out, is its own
    computation."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    import httpx
    from serve_helpers import serving

    from qkv.serve import create_app

    lens = {"model": "runs/gpt-tiny", "text": "ROMEO: But soft, what light"}
    qk = {**lens, "layer": 1, "head": 2, "query": 5}

    def answer(r) -> dict:
        assert r.status_code == 200, r.text
        return {k: v for k, v in r.json().items() if k != "seconds"}

    with serving(create_app(runs_dir=runs_dir, shared_answers=0)) as url, httpx.Client(base_url=url,
                                                                                      timeout=120) as c:
        alone = [answer(c.post("/api/lens", json=lens)), answer(c.post("/api/qk", json=qk))]
    app = create_app(runs_dir=runs_dir)
    with serving(app) as url:
        def student(k: int) -> list[dict]:
            with httpx.Client(base_url=url, timeout=120, headers={"X-QKV-Client": f"student-{k:04d}"}) as own:
                return [answer(own.post("/api/lens", json=lens)), answer(own.post("/api/qk", json=qk))]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(student, range(8)))
        loop, shared = app.state.loop, app.state.explorer.shared
        assert all(g == alone for g in got)
        assert shared.computed == 2 and shared.joined + shared.hits == 14
        runs = loop.jobs_run
        with httpx.Client(base_url=url, timeout=120) as c:
            assert answer(c.post("/api/lens", json=lens)) == alone[0] and loop.jobs_run == runs
            other = answer(c.post("/api/lens", json={**lens, "ablate": [[0, 1]]}))
            assert other != alone[0] and loop.jobs_run == runs + 1


class _Batch:
    """Stands for a model's running batch: it has rows while ``rows`` > 0; each tick is noted."""

    def __init__(self, order: list[str], rows: int) -> None:
        self.order, self.rows = order, rows

    def busy(self) -> bool:
        return self.rows > 0

    def tick(self) -> None:
        self.order.append("tick")
        self.rows -= 1

    def close(self) -> None:
        self.rows = 0


def test_tokens_first_an_interactive_computation_yields_only_to_the_running_batch(monkeypatch):
    """A lens view in pieces: the running batch steps between its slices (tokens first), and it
    goes on before a view another student asked meanwhile (it is not sent to the back)."""
    monkeypatch.setattr(loop_module, "SLICE_S", 0.0)
    loop, order, gate = ComputeLoop(), [], threading.Event()
    batch = loop.add_batch("m", lambda: _Batch(order, rows=10))

    def view():
        for i in range(3):
            order.append(f"piece {i}")
            if i == 0:
                gate.wait(HELD_S)
            yield
        return "viewed"

    with ThreadPoolExecutor(4) as pool:
        CLIENT.set("a")
        lens_view = loop.submit(view, label="lens", pieces=True)
        wait_until(lambda: "piece 0" in order, "the first piece running")
        CLIENT.set("b")
        other = loop.submit(lambda: order.append("b's view"))
        gate.set()
        assert lens_view.future.result(10) == "viewed" and other.future.result(10) is None
        pool.shutdown()
    first = order.index("piece 0")
    assert order[first:first + 6] == ["piece 0", "tick", "piece 1", "tick", "piece 2", "tick"]
    assert order.index("b's view") > order.index("piece 2")
    assert batch.rows >= 0
    loop.close()


def test_a_slice_starts_no_piece_that_would_overrun_it(monkeypatch):
    """A slice runs pieces while one more as long as its longest would still fit: after a piece
    of 0.12 s in a 0.2-s slice the running batch steps (a second piece would end past 0.2 s),
    and short pieces share a slice (several between two steps)."""
    import time

    monkeypatch.setattr(loop_module, "SLICE_S", 0.2)
    loop, order = ComputeLoop(), []
    loop.add_batch("m", lambda: _Batch(order, rows=10))

    def view():
        for i in range(8):
            order.append(f"piece {i}")
            time.sleep(0.12 if i == 0 else 0.01)
            yield
        return "viewed"

    assert loop.submit(view, label="lens", pieces=True).future.result(10) == "viewed"
    first = order.index("piece 0")
    assert order[first + 1] == "tick"
    after = order[first + 2:]
    assert after[:2] == ["piece 1", "piece 2"]  # more than one short piece in the next slice
    loop.close()


def test_a_waiting_client_knows_its_place_and_one_that_leaves_is_not_computed(monkeypatch):
    """Places follow the fair queue's order (interactive first, one per client in turn); a
    request whose client went away is taken off the queue (answered CancelledError, never run),
    and a sweep left while it runs is closed before its next piece (its finally runs)."""
    monkeypatch.setattr(loop_module, "SLICE_S", 0.0)
    loop, gate, hold, ran, closed = ComputeLoop(), threading.Event(), threading.Event(), [], []

    def as_(client: str, fn, **kw):
        CLIENT.set(client)
        return loop.submit(fn, **kw)

    blocking = as_("x", lambda: gate.wait(HELD_S))
    wait_until(lambda: loop.waiting() == 0 and loop.position(blocking) == 0, "the first at work")

    def sweep():
        try:
            for i in range(100):
                ran.append(f"sweep {i}")
                if i == 1:
                    hold.wait(HELD_S)
                yield i, 100
        finally:
            closed.append(True)

    s = as_("s", sweep, label="patch", sweep=True, pieces=True)
    a1 = as_("a", lambda: ran.append("a1"))
    a2 = as_("a", lambda: ran.append("a2"))
    b = as_("b", lambda: ran.append("b"))
    c = as_("c", lambda: ran.append("c"))
    # a1, then the sweep (x's running view and a1 are two interactive in a row while it waits),
    # then b, c, a2 (one per client in turn)
    assert [loop.position(j) for j in (a1, b, s, c, a2)] == [1, 3, 2, 4, 5]
    loop.leave(b)
    with pytest.raises(CancelledError, match="its client went away"):
        b.future.result(1)
    assert [loop.position(j) for j in (a1, s, c, a2)] == [1, 2, 3, 4]
    assert loop.position(blocking) == 0 and loop.cancelled == 1
    gate.set()
    wait_until(lambda: "sweep 1" in ran, "the sweep under way")
    loop.leave(s)  # while its second piece runs
    hold.set()
    with pytest.raises(CancelledError):
        s.future.result(10)
    assert closed == [True] and "b" not in ran and "sweep 2" not in ran
    for j in (a1, c, a2):
        j.future.result(10)
    assert loop.position(a1) is None
    loop.close()


@pytest.mark.usefixtures("one_thread")
def test_a_stream_says_its_place_then_answers_as_the_plain_request_and_closing_it_cancels(runs_dir,
                                                                                          monkeypatch):
    """``Accept: application/x-ndjson``: a lens request waiting behind another computation is
    told its place, then gets the plain request's answer; an error gets the plain request's
    status and message; a client that closes its stream while queued is never computed."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    import json

    import httpx
    from serve_helpers import Gate, serving

    from qkv.pipelines import attention as sources
    from qkv.serve import create_app

    lens = {"model": "runs/gpt-tiny", "text": "ROMEO: But soft, what light"}
    stream = {"Accept": "application/x-ndjson"}

    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "seconds"}

    app = create_app(runs_dir=runs_dir, shared_answers=0)
    loop = app.state.loop
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as c, ThreadPoolExecutor(2) as pool:
        alone = c.post("/api/lens", json=lens)
        assert alone.status_code == 200
        bad = {**lens, "layer": 1, "head": 99, "query": 0}
        plain_bad = c.post("/api/qk", json=bad)
        assert plain_bad.status_code == 422
        with c.stream("POST", "/api/qk", json=bad, headers=stream) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            last = [json.loads(line) for line in r.iter_lines()][-1]
        assert last == {"event": "error", "status": 422, "detail": plain_bad.json()["detail"]}

        for cancel in (False, True):
            gate = Gate(sources.text_attention_steps)  # the loop held by an attention request
            monkeypatch.setattr(sources, "text_attention_steps", gate)
            blocked = pool.submit(c.post, "/api/attention", json={"model": "runs/gpt-tiny",
                                                                    "text": "JULIET" if cancel else "ROMEO"})
            wait_until(lambda g=gate: g.calls == 1, "the loop at work")
            runs = loop.jobs_run
            with c.stream("POST", "/api/lens", json=lens, headers=stream) as r:
                lines = r.iter_lines()
                assert json.loads(next(lines)) == {"event": "queued", "position": 1}
                if not cancel:
                    gate.open.set()
                    events = [json.loads(line) for line in lines]
            if cancel:
                wait_until(lambda: loop.cancelled == 1, "the closed stream's computation cancelled")
                gate.open.set()
                assert blocked.result().status_code == 200
                wait_until(lambda r=runs: loop.jobs_run == r + 1, "the attention request done")
                assert loop.waiting() == 0 and loop.jobs_run == runs + 1  # the lens never ran
            else:
                assert blocked.result().status_code == 200
                assert events[-1]["event"] == "result" and strip(events[-1]["result"]) == strip(alone.json())
                assert all(e["event"] in ("queued", "running") for e in events[:-1])
                assert loop.cancelled == 0


@pytest.mark.usefixtures("one_thread")
def test_two_replicas_answer_as_one_server_and_one_stopping_loses_nothing_of_the_others(runs_dir):
    """Two servers over the same runs folder, as behind a load balancer: a quiz question asked of
    one is answered by the other (the client carries its state: model, kind, seed), the lens
    and q·k answers of both are equal, and with one stopped the other answers everything."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    import httpx
    from serve_helpers import serving

    from qkv.serve import create_app

    lens = {"model": "runs/gpt-tiny", "text": "ROMEO: But soft, what light"}
    qk = {**lens, "layer": 1, "head": 2, "query": 5}

    def answer(c: httpx.Client, path: str, body: dict) -> dict:
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        return {k: v for k, v in r.json().items() if k != "seconds"}

    with serving(create_app(runs_dir=runs_dir)) as b_url, httpx.Client(base_url=b_url, timeout=120) as b:
        with serving(create_app(runs_dir=runs_dir)) as a_url, httpx.Client(base_url=a_url, timeout=120) as a:
            ask = {"model": "runs/gpt-tiny", "kind": "next", "seed": 11}
            q = answer(a, "/api/quiz/question", ask)
            assert answer(b, "/api/quiz/question", ask) == q  # the same question, from the seed alone
            state = {k: q[k] for k in ("model", "kind", "seed")}  # what the page sends back
            reveal = {c: answer(b, "/api/quiz/answer", {**state, "choice": c})
                      for c in range(len(q["choices"]))}
            truth = {r["truth"] for r in reveal.values()}
            assert len(truth) == 1 and [r["correct"] for r in reveal.values()].count(True) == 1
            assert answer(a, "/api/quiz/answer", {**state, "choice": 0}) == reveal[0]
            both = [(answer(x, "/api/lens", lens), answer(x, "/api/qk", qk)) for x in (a, b)]
            assert both[0] == both[1]
        # replica a has stopped (its loop closed, its port shut): b answers on its own
        with pytest.raises(httpx.ConnectError):
            httpx.post(a_url + "/api/lens", json=lens, timeout=5)
        assert (answer(b, "/api/lens", {**lens, "ablate": [[0, 1]]})["base_logits"]
                == both[0][0]["logits"])
