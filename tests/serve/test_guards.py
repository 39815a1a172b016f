"""qkv.serve.guards: the Host check (every loopback form accepted, any other name refused on a
loopback address: DNS rebinding), the Origin / Sec-Fetch-Site check on state-changing requests
(cross-site uploads refused before anything is read), through the app and over real sockets."""

from __future__ import annotations

import pytest
from helpers import png_bytes
from serve_helpers import detail, serving

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
for _module, _why in (("fastapi", "qkv serve needs FastAPI"), ("multipart", "uploads need python-multipart"),
                      ("httpx", "FastAPI's TestClient needs httpx")):
    pytest.importorskip(_module, reason=f"{_why}: pip install 'qkv[dev]'")

LOOPBACK_HOSTS = ["127.0.0.1", "127.0.0.1:8000", "localhost", "localhost:8000", "LocalHost:8000",
                  "localhost.", "[::1]", "[::1]:8000", "::1", "127.1.2.3:9", "[::ffff:127.0.0.1]:8000"]
FOREIGN_HOSTS = ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
                 "evil.localhost.example:80", "[::2]:8000", "10.0.0.1", "localhost:abc", "[::1]x",
                 "[evil]:80", "local host", "localhost:99999", ""]


@pytest.fixture(scope="module")
def make_client(runs_dir):
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    def make(base_url: str = "http://testserver", **config) -> TestClient:
        return TestClient(create_app(runs_dir=runs_dir, **config), base_url=base_url)

    return make


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("header, want", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("[::1]:8000", ("::1", 8000)), ("[::1]", ("::1", None)),
    ("::1", ("::1", None)), ("LocalHost.", ("localhost", None)), ("example.com:443", ("example.com", 443)),
    ("[::1", None), ("[::1]8000", None), ("host:", None), ("host:-1", None), ("host:65536", None),
    ("a/b", None), ("user@host", None), ("", None), ("[example.com]:80", None), ("::zz", None),
])
def test_split_host(header, want) -> None:
    from qkv.serve.guards import split_host

    assert split_host(header) == want


@pytest.mark.parametrize("host, want", [
    ("localhost", True), ("127.0.0.1", True), ("127.255.0.9", True), ("::1", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("10.0.0.1", False),
    ("evil.localhost", False), ("localhost.evil", False),
])
def test_is_loopback(host, want) -> None:
    from qkv.serve.guards import is_loopback

    assert is_loopback(host) is want


# --------------------------------------------------------------------------- Host


@pytest.mark.parametrize("bound", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_on_loopback_every_loopback_name_is_served_and_no_other(make_client, bound) -> None:
    c = make_client(host=bound)
    for host in LOOPBACK_HOSTS:
        assert c.get("/api/models", headers={"host": host}).status_code == 200, host
    for host in FOREIGN_HOSTS:
        message = detail(c.get("/api/models", headers={"host": host}), 400)
        assert message.startswith("invalid Host header") and "DNS rebinding" in message, host
    assert c.get("/", headers={"host": "evil.example"}).status_code == 400  # the page too


def test_the_bound_name_itself_is_served(make_client) -> None:
    c = make_client(host="myhost.local")  # not loopback: any name
    assert c.get("/api/models", headers={"host": "evil.example"}).status_code == 200
    c = make_client(host="0.0.0.0")
    assert c.get("/api/models", headers={"host": "evil.example"}).status_code == 200


def test_without_a_configured_host_the_connections_address_decides(make_client) -> None:
    """What `qkv serve --host ::1` gets from today's command (it passes no host list for IPv6)."""
    for base in ("http://[::1]:8000", "http://127.0.0.1:8000"):
        c = make_client(base_url=base)
        assert c.get("/api/models").status_code == 200  # its own Host header
        assert c.get("/api/models", headers={"host": "localhost:8000"}).status_code == 200
        assert "DNS rebinding" in detail(c.get("/api/models", headers={"host": "evil.example:8000"}), 400)
    c = make_client()  # TestClient's "testserver": not a loopback address, so any name
    assert c.get("/api/models", headers={"host": "evil.example"}).status_code == 200


def test_an_explicit_host_list_is_exact(make_client) -> None:
    c = make_client(allowed_hosts=["[::1]", "qkv.example", "*.lab.example"])
    for host in ("[::1]:8000", "QKV.example:80", "a.lab.example"):
        assert c.get("/api/models", headers={"host": host}).status_code == 200, host
    for host in ("127.0.0.1", "lab.example", "evil.example"):
        assert "answers only to [::1], qkv.example" in detail(
            c.get("/api/models", headers={"host": host}), 400), host


def test_ipv6_loopback_over_real_sockets(runs_dir) -> None:
    """uvicorn on [::1], the app made as `qkv serve --host ::1` makes it today: a rebinding
    Host is refused, [::1] and localhost are served."""
    import socket

    import httpx

    from qkv.serve import create_app

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with serving(create_app(runs_dir=runs_dir), host="::1") as url:
        port = url.rsplit(":", 1)[1]
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/api/models").status_code == 200
            assert c.get("/api/models", headers={"host": f"localhost:{port}"}).status_code == 200
            r = c.get("/api/models", headers={"host": f"rebind.evil.example:{port}"})
        assert f"open http://[::1]:{port}/" in detail(r, 400)


# --------------------------------------------------------------------------- Origin / Sec-Fetch-Site


CROSS_SITE = [{"origin": "http://evil.example"}, {"origin": "null"}, {"origin": "https://testserver"},
              {"origin": "http://testserver:8080"}, {"origin": "http://testserver.evil.example"},
              {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"},
              {"origin": "http://testserver", "sec-fetch-site": "cross-site"}, {"origin": "garbage"}]


@pytest.mark.parametrize("headers", CROSS_SITE)
def test_cross_site_posts_are_refused_before_any_work(make_client, headers) -> None:
    c = make_client()
    reg = c.app.state.registry
    r = c.post("/api/attention", json={"model": "runs/gpt-tiny", "text": "ROMEO"}, headers=headers)
    assert "was refused: this server accepts POST requests only from its own page" in detail(r, 403)
    r = c.post("/api/image-attention", data={"model": "runs/vit-tiny"}, headers=headers,
               files={"image": ("d.png", png_bytes((8, 8)), "image/png")})
    assert "refused" in detail(r, 403)
    r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "R"}, headers=headers)
    assert "refused" in detail(r, 403)
    r = c.post("/api/image-attention", content=b"x" * 3_000_000, headers={
        **headers, "content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 403  # refused on its headers, before the body is counted
    assert reg.in_memory() == 0  # nothing was loaded


@pytest.mark.parametrize("headers", [{}, {"origin": "http://testserver"}, {"origin": "HTTP://TestServer:80"},
                                     {"sec-fetch-site": "same-origin", "origin": "http://testserver"},
                                     {"sec-fetch-site": "none"}])
def test_same_origin_and_scripts_are_served(make_client, headers) -> None:
    c = make_client()
    r = c.post("/api/attention", json={"model": "runs/gpt-tiny", "text": "ROMEO"}, headers=headers)
    assert r.status_code == 200 and r.json()["query_tokens"] == list("ROMEO")
    r = c.post("/api/image-attention", data={"model": "runs/vit-tiny"}, headers=headers,
               files={"image": ("d.png", png_bytes((8, 8)), "image/png")})
    assert r.status_code == 200 and r.json()["family"] == "vit"


def test_the_origin_is_compared_with_the_host_the_request_named(make_client) -> None:
    c = make_client(base_url="http://[::1]:8000")
    ok = {"model": "runs/gpt-tiny", "text": "ROMEO"}
    assert c.post("/api/attention", json=ok, headers={"origin": "http://[::1]:8000"}).status_code == 200
    assert c.post("/api/attention", json=ok, headers={"host": "localhost:8000",
                                                      "origin": "http://localhost:8000"}).status_code == 200
    r = c.post("/api/attention", json=ok, headers={"host": "localhost:8000", "origin": "http://[::1]:8000"})
    assert r.status_code == 403  # a page of another origin, though both are this machine


def test_reads_from_other_sites_are_not_refused(make_client) -> None:
    """GET changes nothing (and the browser keeps the answer from the other page: no CORS)."""
    r = make_client().get("/api/models", headers={"origin": "http://evil.example",
                                                  "sec-fetch-site": "cross-site"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
