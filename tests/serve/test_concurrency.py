"""`qkv serve` under concurrent requests: each model loaded once and shared, every computation
queued for the one compute loop with a bounded waiting room and 503 + Retry-After beyond, the
model held for a whole generation stream and given back when it ends or the client leaves; and
a small load test over real sockets (statuses only: no timing is asserted)."""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import png_bytes, wait_until
from serve_helpers import Gate, asset_installed, detail, serving

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
for _module, _why in (("fastapi", "qkv serve needs FastAPI"), ("multipart", "uploads need python-multipart"),
                      ("httpx", "FastAPI's TestClient needs httpx")):
    pytest.importorskip(_module, reason=f"{_why}: pip install 'qkv[dev]'")


def busy_detail(r) -> str:
    """The one-line message of a 503 (a full queue), which also says when to retry."""
    message = detail(r, 503)
    assert 1 <= int(r.headers["retry-after"]) <= 60
    return message


def test_twenty_concurrent_requests_succeed_and_load_each_model_once(runs_dir, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    import qkv.serve.registry as registry
    from qkv.serve import create_app

    loads: list[str] = []
    real_open = registry.open_model

    def counting_open(ref, **kwargs):
        loads.append(ref.name)
        time.sleep(0.2)  # widen the window in which a second load could start
        return real_open(ref, **kwargs)

    monkeypatch.setattr(registry, "open_model", counting_open)
    model = "minilm" if asset_installed("minilm") else "runs/gpt-tiny"
    app = create_app(runs_dir=runs_dir, max_queued=20)  # room for all 20 to wait
    client = TestClient(app)
    words = "But soft what light through yonder window".split()
    texts = [f"ROMEO: {' '.join(words[: 1 + i % 7])}{'?' * (i // 7)}" for i in range(20)]  # 20 texts

    def ask(i: int):
        m = model if i % 2 == 0 else "runs/gpt-tiny"
        return m, client.post("/api/attention", json={"model": m, "text": texts[i], "head": i % 4})

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(ask, range(20)))
    assert [r.status_code for _, r in results] == [200] * 20
    assert sorted(loads) == sorted({model, "runs/gpt-tiny"})  # each model loaded once
    for i, (m, r) in enumerate(results):
        if m == "runs/gpt-tiny":
            assert r.json()["query_tokens"] == list(texts[i][:32])  # the context: 32 characters
    assert app.state.loop.waiting() == 0


def test_a_full_queue_answers_503_with_retry_after(runs_dir, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from qkv.pipelines import attention as sources
    from qkv.serve import create_app

    gate = Gate(sources.text_attention_steps)  # the server computes attention in pieces
    monkeypatch.setattr(sources, "text_attention_steps", gate)
    app = create_app(runs_dir=runs_dir, max_queued=1)
    loop, client = app.state.loop, TestClient(app)

    def ask(text: str):
        return client.post("/api/attention", json={"model": "runs/gpt-tiny", "text": text})

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(ask, "ROMEO")
        wait_until(lambda: gate.calls == 1, "the first request at work")
        second = pool.submit(ask, "JULIET")
        wait_until(lambda: loop.waiting() == 1, "the second request waiting")
        message = busy_detail(ask("ROMEO: But"))
        assert message.startswith("the server is busy (1 requests are waiting; yours would be the 2nd); try "
                                  "again in")
        r = client.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "R"})
        assert "the server is busy" in busy_detail(r)  # generation waits in the same queue
        assert client.get("/api/models").status_code == 200  # the rest of the API is not held up
        assert client.post("/api/attention", json={"model": "runs/nope", "text": "R"}).status_code == 404
        gate.open.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
    assert gate.calls == 2  # the refused ones never reached the model
    # a result already computed needs no turn of the loop: switching head while it is busy
    monkeypatch.setattr(sources, "text_attention_steps", Gate(sources.text_attention_steps))  # closed again
    with ThreadPoolExecutor(max_workers=1) as pool:
        blocked = pool.submit(ask, "ROMEO: But soft")
        wait_until(lambda: sources.text_attention_steps.calls == 1, "a request at work")
        r = client.post("/api/attention", json={"model": "runs/gpt-tiny", "text": "ROMEO", "head": 2})
        assert r.status_code == 200 and r.json()["head"] == 2
        sources.text_attention_steps.open.set()
        assert blocked.result().status_code == 200


@pytest.mark.parametrize("batch_rows", [8, 1])
def test_a_generation_holds_its_model_until_the_stream_ends(runs_dir, batch_rows) -> None:
    """The model is held (never evicted) while a row decodes, and let go once its stream has
    ended; a request refused before its stream holds nothing."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    app = create_app(runs_dir=runs_dir, batch_rows=batch_rows)
    client = TestClient(app)
    for _ in range(3):  # one at a time, each after the last one's stream ended
        r = client.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO",
                                               "max_new_tokens": 3})
        events = [json.loads(x)["event"] for x in r.text.splitlines()]
        assert events == ["start", "token", "token", "token", "done"]
        wait_until(lambda: app.state.registry._models["runs/gpt-tiny"].users == 0, "the model let go")
    r = client.post("/api/generate", json={"model": "runs/vit-tiny", "prompt": "R"})
    assert r.status_code == 422 and app.state.registry._models["runs/vit-tiny"].users == 0


def test_a_client_that_leaves_mid_stream_frees_its_row_and_model(runs_dir, monkeypatch) -> None:
    """A batch of one row: a second request waits for it while the first decodes; the first
    client leaves, its row and model are given back, and the second one decodes. The decoding
    is slowed (each step 50 ms), so the first is still decoding when its client leaves."""
    import httpx

    from qkv.generation.batch import Batch
    from qkv.serve import create_app

    real_step = Batch.step

    def slow_step(self):
        time.sleep(0.05)
        return real_step(self)

    monkeypatch.setattr(Batch, "step", slow_step)
    app = create_app(runs_dir=runs_dir, batch_rows=1, max_queued=1)
    body = {"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 20}
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as c, ThreadPoolExecutor(1) as pool:
        with c.stream("POST", "/api/generate", json=body) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines))["event"] == "start"
            batch = next(iter(app.state.loop._batches.values()))
            wait_until(lambda: batch.running() == 1, "the first row decoding")
            second = pool.submit(lambda: httpx.post(f"{url}/api/generate", json={**body, "max_new_tokens": 3},
                                                    timeout=30))
            wait_until(lambda: batch.waiting() == 1, "the second request waiting for the row")
        # the connection is closed with the stream unfinished: the row comes free
        events = [json.loads(x)["event"] for x in second.result().text.splitlines()]
        assert events == ["start", "token", "token", "token", "done"]
        wait_until(lambda: batch.running() == 0, "the row given back")
        wait_until(lambda: app.state.registry._models["runs/gpt-tiny"].users == 0, "the model let go")
        assert c.post("/api/attention", json={"model": "runs/gpt-tiny", "text": "R"}).status_code == 200


def test_a_small_load_over_http_gets_only_2xx_4xx_and_503(server, capsys) -> None:
    """20 clients at once, 100 mixed requests through uvicorn and real sockets; with the default
    queue (32 may wait) every request is served, none fails."""
    import httpx

    png = png_bytes()
    model = "minilm" if asset_installed("minilm") else "runs/gpt-tiny"

    def ask(i: int) -> tuple[str, int, str]:
        with httpx.Client(base_url=server, timeout=120) as c:
            kind = ("models", "attention", "attention", "generate", "image", "bad")[i % 6]
            if kind == "models":
                r = c.get("/api/models")
            elif kind == "attention":
                r = c.post("/api/attention", json={"model": model, "text": f"ROMEO: But soft{'!' * i}"})
            elif kind == "generate":
                r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO",
                                                  "max_new_tokens": 4})
            elif kind == "image":
                r = c.post("/api/image-attention", data={"model": "runs/vit-tiny"},
                           files={"image": ("d.png", png, "image/png")})
            else:
                r = c.post("/api/attention", json={"model": "runs/../../etc", "text": "R"})
            return kind, r.status_code, r.headers.get("retry-after", "")

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(ask, range(100)))
    statuses = Counter(code for _, code, _ in results)
    with capsys.disabled():
        print(f"\n100 mixed requests, 20 at once, over HTTP: {dict(sorted(statuses.items()))}")
    assert set(statuses) <= {200, 400, 503}
    assert all(code == 400 for kind, code, _ in results if kind == "bad")
    assert all(code == 200 for kind, code, _ in results if kind == "models")
    assert all(after.isdigit() for _, code, after in results if code == 503)
    served = sum(code == 200 for kind, code, _ in results if kind in ("attention", "generate", "image"))
    assert served == sum(kind in ("attention", "generate", "image") for kind, _, _ in results)
