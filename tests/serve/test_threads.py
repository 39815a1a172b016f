"""Where `qkv serve` computes (qkv.serve.threads): every model computation a request asks for
runs in a thread that has ended by the time its response is over, never in the server's
long-lived request threads, whose OpenMP worker pools would otherwise make every later decoding
step sleep between parallel regions (the running batch decoded at 50 instead of 108 tok/s after
one attention request, measured; the speed is not asserted here, where it runs: it is)."""

from __future__ import annotations

import json
import threading

import pytest
from helpers import png_bytes, wait_until

from qkv.serve.threads import OwnThread, in_passing_thread

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

TEXT = "ROMEO: But soft"


def test_a_call_runs_in_a_thread_that_ends_with_it():
    seen: list[threading.Thread] = []
    assert in_passing_thread(lambda a, b: seen.append(threading.current_thread()) or a + b, 2, 3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fail():
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        in_passing_thread(fail)


def test_a_stream_is_computed_in_one_thread_that_ends_with_it():
    threads: list[threading.Thread] = []

    def steps():
        for i in range(5):
            threads.append(threading.current_thread())
            yield i * i

    own = OwnThread(steps())
    assert list(own) == [0, 1, 4, 9, 16]
    assert list(own) == []  # ended stays ended
    assert len(set(threads)) == 1 and threads[0] is not threading.current_thread()
    wait_until(lambda: not own.alive(), "the stream's thread to end")


def test_an_error_reaches_the_reader_and_release_stops_the_stream_before_its_next_item():
    def failing():
        yield 1
        raise RuntimeError("step failed")

    own = OwnThread(failing())
    assert next(own) == 1
    with pytest.raises(RuntimeError, match="step failed"):
        next(own)

    go, closed = threading.Event(), threading.Event()
    made: list[int] = []

    def endless():
        try:
            i = 0
            while True:
                go.wait()
                made.append(i)
                yield i
                i += 1
        finally:
            closed.set()  # the generator is closed in its own thread

    own = OwnThread(endless())
    own.release()  # before the first item is made
    go.set()
    wait_until(lambda: not own.alive(), "the released stream's thread to end")
    assert closed.is_set() and made == [0] and list(own) == []


def test_what_the_stream_held_is_given_back_in_its_thread_before_the_reader_sees_the_end():
    """on_end runs after the generator is closed, in the stream's thread, before the end is
    read; a generator whose closing fails still ends, with that error."""
    order: list[str] = []

    def steps():
        try:
            yield 1
            yield 2
        finally:
            order.append("closed")

    own = OwnThread(steps(), on_end=lambda: order.append(f"on_end in {threading.current_thread().name}"))
    assert list(own) == [1, 2]
    assert order == ["closed", "on_end in qkv-steps"]

    class BadClose:
        def __iter__(self):
            return self

        def __next__(self):
            raise StopIteration

        def close(self):
            raise OSError("cannot close")

    ended = threading.Event()
    own = OwnThread(BadClose(), on_end=ended.set)
    with pytest.raises(OSError, match="cannot close"):
        next(own)
    assert ended.is_set() and list(own) == []


@pytest.fixture
def forwards(monkeypatch):
    """The threads every module's forward pass ran in, from now on (a global forward pre-hook)."""
    import torch

    seen: set[threading.Thread] = set()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.add(threading.current_thread()))
    yield seen
    handle.remove()


@pytest.mark.parametrize("batch_rows", [4, 0])
def test_no_request_computes_in_a_thread_that_outlives_it(runs_dir, forwards, batch_rows):
    """Attention, lens, q·k, patching, an image, and generation (the running batch, or each
    request alone): every forward pass ran in a thread that is gone once the responses are
    over (the running batch's: once the batch has emptied)."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    app = create_app(runs_dir=runs_dir, batch_rows=batch_rows)
    png = png_bytes()
    with TestClient(app) as c:
        gpt = {"model": "runs/gpt-tiny"}
        for path, body in (("/api/attention", {**gpt, "text": TEXT}), ("/api/lens", {**gpt, "text": TEXT}),
                           ("/api/qk", {**gpt, "text": TEXT, "layer": 1, "head": 2, "query": 3}),
                           ("/api/patch", {**gpt, "clean": TEXT, "corrupt": "ROMEO: But sift", "site": "head",
                                           "answer": "e", "wrong": "o"}),
                           ("/api/attention", {"model": "runs/seq2seq-tiny", "text": "abc"})):
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
        r = c.post("/api/image-attention", data={"model": "runs/vit-tiny"},
                   files={"image": ("a.png", png, "image/png")})
        assert r.status_code == 200, r.text
        r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 6})
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["event"] == "done", r.text
        assert forwards, "no forward pass was seen"
        assert threading.current_thread() not in forwards
        # a synchronisation point, well under the 10 s after which AnyIO retires an idle request
        # thread: a forward pass in one would still be alive here
        wait_until(lambda: not any(t.is_alive() for t in forwards), "the computing threads to end", timeout=5)
