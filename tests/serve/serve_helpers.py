"""Helpers shared by the tests of `qkv serve` (imported by name: tests/serve is on sys.path);
the ones other folders share too (free_port, png_bytes, wait_until) are in tests/helpers.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def asset_installed(name: str) -> bool:
    """Whether asset ``name`` is installed (tests that need it skip, naming the fix, if not)."""
    from qkv.assets import AssetMissingError, asset_path

    try:
        asset_path(name)
    except AssetMissingError:
        return False
    return True


def detail(r, status: int) -> str:
    """The response's one-line message, after checking its status and shape."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"detail"} and isinstance(body["detail"], str) and "\n" not in body["detail"]
    return body["detail"]


@contextlib.contextmanager
def serving(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """``with serving(app) as url:`` the app on ``http://HOST:PORT`` (uvicorn in a thread, a free
    port) for the block."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def explorer_page(browser: Any, server: str, also_allowed: tuple[str, ...] = ()) -> Iterator[Any]:
    """A fresh 1400 x 1000 page on the explorer at ``server`` (for a fixture to ``yield from``);
    fails the test on a script error or on a request that leaves this server (its blob: URLs
    hold downloads made in the page; ``also_allowed``: other URL prefixes, e.g. "data:")."""
    p = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    local = (server, f"blob:{server}/", *also_allowed)
    p.on("request", lambda r: None if r.url.startswith(local) else errors.append(f"request to {r.url}"))
    p.goto(server + "/")
    p.wait_for_selector("body[data-state=ready]")
    yield p
    p.close()
    assert errors == []


def api(server: str, path: str, body: dict, timeout: float = 120) -> dict:
    """POST ``body`` as JSON to ``server + path``; the JSON answer (HTTPError on a 4xx/5xx)."""
    import json
    import urllib.request

    req = urllib.request.Request(server + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Gate:
    """Stands for the model's work: each call blocks until the test opens the gate."""

    def __init__(self, real) -> None:
        self.real, self.open, self.lock = real, threading.Event(), threading.Lock()
        self.calls = 0

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.calls += 1
        assert self.open.wait(30), "the gate was never opened"
        return self.real(*args, **kwargs)
