"""The server's one compute loop (qkv.serve.loop): every computation runs in its thread, one
client's in the order asked (fair between clients: tests/serve/test_sharing.py), a bounded queue
(503 + Retry-After beyond, and for one that waited too long), running batches stepped between
computations; over HTTP, every forward pass of every endpoint runs in the loop, and concurrent
patch + lens + q·k + generate requests on one model give exactly the answers each gives alone (a
patch's hooks are never seen by another request's pass)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import HELD_S, png_bytes, wait_until

from qkv.serve.loop import BusyError, ComputeLoop

TEXT = "ROMEO: But soft"


class FakeBatch:
    """A running batch that records its steps (a Stepper)."""

    def __init__(self, steps: int, log: list[str]) -> None:
        self.left, self.log = steps, log

    def busy(self) -> bool:
        return self.left > 0

    def tick(self) -> None:
        self.left -= 1
        self.log.append("step")
        time.sleep(0.01)

    def close(self) -> None:
        self.left = 0


def test_calls_run_in_the_loop_thread_in_order_with_their_answers_and_errors():
    loop = ComputeLoop()
    seen = []
    assert loop.call(lambda a, b: seen.append(threading.current_thread()) or a + b, 2, 3) == 5
    assert seen == [loop.thread] and loop.thread is not threading.current_thread()
    with pytest.raises(ValueError, match="bad input"):
        loop.call(lambda: (_ for _ in ()).throw(ValueError("bad input")))
    assert loop.call(lambda: loop.call(lambda: "nested")) == "nested"  # from inside: at once
    order: list[int] = []
    gate = threading.Event()
    with ThreadPoolExecutor(5) as pool:
        # the first call holds the loop until the gate opens: below, or in `finally` if an
        # assertion fails first (HELD_S: never by a timeout a slow machine could reach)
        first = pool.submit(loop.call, lambda: gate.wait(HELD_S))
        try:
            wait_until(lambda: loop.jobs_run == 3 and loop.waiting() == 0, "the first call running")
            later = []
            for i in range(4):  # queued while the first runs: served first come, first served
                later.append(pool.submit(loop.call, order.append, i))
                wait_until(lambda n=i + 1: loop.waiting() == n, "the call queued")
        finally:
            gate.set()
        assert first.result() is True and [f.result() for f in later] == [None] * 4
    assert order == [0, 1, 2, 3]
    loop.close()
    assert not loop.thread.is_alive()


def test_a_full_queue_and_a_call_that_waited_too_long_are_busy():
    loop = ComputeLoop(max_queued=2, max_wait_s=0.3)
    gate, ran = threading.Event(), []
    with ThreadPoolExecutor(4) as pool:
        blocking = pool.submit(loop.call, lambda: gate.wait(HELD_S))
        wait_until(lambda: loop.jobs_run == 0 and loop.waiting() == 0 and loop.thread, "running")
        queued = [pool.submit(loop.call, ran.append, i) for i in range(2)]
        wait_until(lambda: loop.waiting() == 2, "two waiting")
        with pytest.raises(BusyError, match=r"the server is busy \(2 requests are waiting; yours would be "
                                            r"the 3rd\); try again in"):
            loop.call(ran.append, 9)
        time.sleep(0.4)  # the two waited past max_wait_s
        gate.set()
        assert blocking.result() is True
        for f in queued:
            with pytest.raises(BusyError, match="waited") as e:
                f.result()
            assert 1 <= e.value.retry_after <= 60
    assert ran == []  # answered busy, never run late
    loop.close()


def test_running_batches_step_between_computations_and_close_ends_everything():
    loop, log = ComputeLoop(), []
    hold = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        held = pool.submit(loop.call, lambda: hold.wait(HELD_S))  # the loop busy while work arrives
        wait_until(lambda: loop.thread is not None and loop.waiting() == 0, "the loop held")
        jobs = []
        for i in range(3):
            jobs.append(pool.submit(loop.call, log.append, f"job{i}"))
            wait_until(lambda n=i + 1: loop.waiting() == n, "queued")
        loop.add_batch("a", lambda: FakeBatch(5, log))
        loop.wake()
        hold.set()
        assert held.result() is True and [j.result() for j in jobs] == [None] * 3
    wait_until(lambda: log.count("step") == 5, "the batch's steps")
    # each turn: one step of every running batch, then one computation
    assert log == ["step", "job0", "step", "job1", "step", "job2", "step", "step"]
    gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(loop.call, lambda: gate.wait(HELD_S))
        wait_until(lambda: loop.waiting() == 0 and not running.done(), "a call running")
        waiting = pool.submit(loop.call, log.append, "never")
        wait_until(lambda: loop.waiting() == 1, "a call waiting")
        closer = threading.Thread(target=loop.close)
        closer.start()
        with pytest.raises(BusyError, match="stopping"):
            waiting.result()
        gate.set()
        closer.join(10)
    assert "never" not in log and not loop.thread.is_alive()
    with pytest.raises(BusyError, match="stopping"):
        loop.call(log.append, "after")


@pytest.fixture
def forwards(monkeypatch):
    """The threads every module's forward pass ran in, from now on (a global forward pre-hook)."""
    import torch

    seen: set[threading.Thread] = set()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.add(threading.current_thread()))
    yield seen
    handle.remove()


@pytest.mark.usefixtures("one_thread")
def test_every_forward_pass_of_every_endpoint_runs_in_the_loop(runs_dir, forwards, monkeypatch):
    """Attention, lens, q·k, patching (estimated, and exact beside the estimate), an image, a
    seq2seq alignment and generation: no forward pass (nor the estimate's backward pass) ran
    anywhere but the server's compute loop (one thread, one OpenMP pool)."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    import torch

    backwards: list[threading.Thread] = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: backwards.append(threading.current_thread())
                        or grad(*a, **k))
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    app = create_app(runs_dir=runs_dir)
    png = png_bytes()
    with TestClient(app) as c:
        gpt = {"model": "runs/gpt-tiny"}
        for path, body in (("/api/attention", {**gpt, "text": TEXT}), ("/api/lens", {**gpt, "text": TEXT}),
                           ("/api/qk", {**gpt, "text": TEXT, "layer": 1, "head": 2, "query": 3}),
                           ("/api/patch", {**gpt, "clean": TEXT, "corrupt": "ROMEO: But sift", "site": "head",
                                           "answer": "e", "wrong": "o"}),
                           ("/api/patch", {**gpt, "clean": TEXT, "corrupt": "ROMEO: But sift",
                                           "site": "resid", "answer": "e", "wrong": "o", "method": "exact",
                                           "compare": True}),
                           ("/api/attention", {"model": "runs/seq2seq-tiny", "text": "abc"})):
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
        r = c.post("/api/image-attention", data={"model": "runs/vit-tiny"},
                   files={"image": ("a.png", png, "image/png")})
        assert r.status_code == 200, r.text
        r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 6})
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["event"] == "done", r.text
    assert forwards == {app.state.loop.thread}
    assert backwards == [app.state.loop.thread] * 2  # the estimate's backward pass: in the loop too


def _answer(r) -> object:
    """A response's content without its timing."""
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("application/x-ndjson"):
        events = [json.loads(x) for x in r.text.splitlines()]
        return [{k: v for k, v in e.items() if k != "seconds"} for e in events]
    return {k: v for k, v in r.json().items() if not k.endswith("seconds")}  # estimate_seconds too


@pytest.mark.usefixtures("one_thread")
def test_concurrent_patch_lens_qk_and_generate_give_what_each_gives_alone(runs_dir):
    """Eight clients at once over real HTTP, mixing patching (hooks on the shared model), the
    lens with and without heads knocked out, q·k rows and generation on one model: no 5xx, and
    every answer equals the same request's answer alone (the same server, one at a time).
    Before the compute loop, a patch's hooks ran inside other requests' passes (IndexError: 500s,
    or silently changed probabilities)."""
    import httpx
    from serve_helpers import serving

    from qkv.serve import create_app

    gpt = {"model": "runs/gpt-tiny"}
    clean, corrupt = "ROMEO: But soft, what light", "ROMEO: But sift, what night"
    requests = [("/api/patch", {**gpt, "clean": clean, "corrupt": corrupt, "site": "head", "answer": "e",
                                "wrong": "o"}),
                ("/api/patch", {**gpt, "clean": "ROMEO: It is", "corrupt": "JULIE: It is",
                                "site": "resid", "answer": " ", "wrong": "e", "method": "exact",
                                "compare": True}),
                ("/api/lens", {**gpt, "text": clean}),
                ("/api/lens", {**gpt, "text": "JULIET: O Romeo", "ablate": [[0, 1], [1, 2]]}),
                ("/api/qk", {**gpt, "text": clean, "layer": 1, "head": 2, "query": 7}),
                ("/api/qk", {**gpt, "text": "It is the east", "layer": 0, "head": 0, "query": 3}),
                ("/api/generate", {**gpt, "prompt": "ROMEO", "max_new_tokens": 8, "layer": 1}),
                ("/api/generate", {**gpt, "prompt": "JULIET: O", "max_new_tokens": 6, "temperature": 0.8,
                                   "seed": 3})]
    # shared_answers=0: each answer computed again under load, not taken from the cache
    with serving(create_app(runs_dir=runs_dir, shared_answers=0)) as url, \
            httpx.Client(base_url=url, timeout=120) as c:
        alone = [_answer(c.post(path, json=body)) for path, body in requests]

        def client(k: int) -> list[tuple[int, int, object]]:
            out = []
            with httpx.Client(base_url=url, timeout=120) as own:
                for j in range(len(requests)):
                    i = (k + j) % len(requests)
                    r = own.post(requests[i][0], json=requests[i][1])
                    out.append((i, r.status_code, _answer(r) if r.status_code == 200 else r.text))
            return out

        with ThreadPoolExecutor(8) as pool:
            got = [x for xs in pool.map(client, range(8)) for x in xs]
    assert [code for _, code, _ in got] == [200] * len(got), [t for _, code, t in got if code != 200][:3]
    for i, _, answer in got:
        if requests[i][0] != "/api/generate":
            assert answer == alone[i], requests[i][0]  # alone on the model: exactly the same
            continue
        # a row of a running batch equals its request alone to float rounding: the same tokens,
        # each attention row within 1e-4 (rounded to 6 decimals in the JSON)
        assert [{k: v for k, v in e.items() if k != "weights"} for e in answer] == \
            [{k: v for k, v in e.items() if k != "weights"} for e in alone[i]]
        for g, w in zip(answer, alone[i], strict=True):
            if "weights" in w:
                assert max(abs(a - b) for a, b in zip(g["weights"], w["weights"], strict=True)) <= 1e-4
