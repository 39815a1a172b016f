"""A lecture hall on one server (issue 52): identical requests computed once and answered to
all (qkv.serve.sharing), and the compute loop's queue fair per client, interactive requests
before sweeps (qkv.serve.loop)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import wait_until

from qkv.serve.loop import CLIENT, ComputeLoop
from qkv.serve.sharing import Shared


def test_identical_requests_in_flight_are_computed_once_and_errors_reach_every_waiter():
    shared, gate, calls = Shared(max_entries=2), threading.Event(), []

    def compute(v: int):
        def run() -> int:
            calls.append(v)
            gate.wait(10)
            if v < 0:
                raise ValueError(f"bad {v}")
            return v * 10
        return run

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
        first = pool.submit(_as, "x", loop, lambda: gate.wait(10))
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


def test_a_sweep_in_pieces_lets_the_others_run_between_its_pieces():
    """A patching sweep runs one forward pass per turn of the loop: a lens view asked while its
    first piece runs is answered after that piece, not after the whole sweep; the sweep's answer
    is its generator's return value, and a model it holds stays held until its last piece."""
    loop, order, gate = ComputeLoop(), [], threading.Event()
    held = []

    def sweep():
        held.append("acquired")
        try:
            for i in range(3):
                order.append(f"piece {i}")
                if i == 0:
                    gate.wait(10)
                yield i, 3
            return "swept"
        finally:
            held.append("released")

    def in_pieces(client: str):
        CLIENT.set(client)
        return loop.call_in_pieces(sweep, label="patch")

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
