"""The JSON API of `qkv serve` through FastAPI's TestClient: valid requests checked against the
models' own forward passes, every kind of bad request answered with a 4xx JSON message,
limits, path traversal (no file outside the runs directory is ever read, no path is ever sent
back), and the `qkv serve` command itself. Concurrency: test_concurrency.py; the Host and Origin
checks: test_guards.py; the fuzz of the whole schema: test_schema_fuzz.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import free_port, image_bytes, png_bytes
from serve_helpers import asset_installed, detail

from qkv.generation import generate
from qkv.inference import open_model
from qkv.pipelines import attention as sources

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
for _module, _why in (("fastapi", "qkv serve needs FastAPI"), ("multipart", "uploads need python-multipart"),
                      ("httpx", "FastAPI's TestClient needs httpx")):
    pytest.importorskip(_module, reason=f"{_why}: pip install 'qkv[dev]'")


@pytest.fixture(scope="module")
def app(runs_dir):
    from qkv.serve import create_app

    return create_app(runs_dir=runs_dir, max_tokens=64, max_chars=2000, max_upload_bytes=20_000,
                      max_pixels=100_000)


@pytest.fixture(scope="module")
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        yield c


# --------------------------------------------------------------------------- listing, page, schema


def test_models_lists_runs_and_installed_models_only(client, runs_dir: Path) -> None:
    r = client.get("/api/models")
    assert r.status_code == 200
    body = r.json()
    ids = {m["id"]: m for m in body["models"]}
    runs = {i for i in ids if i.startswith("runs/")}
    assert runs == {"runs/gpt-tiny", "runs/vit-tiny", "runs/seq2seq-tiny", "runs/captioner-tiny"}
    assert (ids["runs/gpt-tiny"]["kind"], ids["runs/gpt-tiny"]["can_generate"]) == ("decoder", True)
    assert (ids["runs/vit-tiny"]["kind"], ids["runs/vit-tiny"]["input"]) == ("image", "image")
    assert ids["runs/seq2seq-tiny"]["kind"] == "seq2seq"
    assert ("minilm" in ids) == asset_installed("minilm")
    assert ("smollm2" in ids) == asset_installed("smollm2")
    assert body["runs_dir"] == "runs"  # the folder's name: no absolute path leaves the server
    assert body["limits"] == {"max_chars": 2000, "max_tokens": 64, "max_new_tokens": 128,
                              "max_upload_bytes": 20_000}


def test_page_schema_and_headers(client) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert '<script src="/static/app.js"' in r.text and "http" not in r.text.split("<body>")[0]
    for name in ("app.js", "lens.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/static/../app.py").status_code == 404
    schema = client.get("/openapi.json").json()
    assert set(schema["paths"]) == {"/api/models", "/api/attention", "/api/generate", "/api/image-attention",
                                    "/api/lens", "/api/qk", "/api/patch", "/api/history",
                                    "/api/quiz/question", "/api/quiz/answer"}
    for name in ("AttentionRequest", "AttentionResponse", "GenerateRequest", "ImageAttentionResponse",
                 "ErrorMessage"):
        assert name in schema["components"]["schemas"]
    assert "404" in schema["paths"]["/api/attention"]["post"]["responses"]
    assert client.get("/docs").status_code == 404  # Swagger UI would load scripts from a CDN


def test_host_header_is_checked_when_configured(runs_dir) -> None:
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    c = TestClient(create_app(runs_dir=runs_dir, allowed_hosts=["127.0.0.1", "localhost"]))
    assert c.get("/api/models", headers={"host": "evil.example"}).status_code == 400
    assert c.get("/api/models", headers={"host": "127.0.0.1:8000"}).status_code == 200


# --------------------------------------------------------------------------- attention


def test_attention_matches_the_models_own_forward_pass(client, tiny_run) -> None:
    text = "ROMEO: But soft"
    src = open_model(tiny_run("gpt"))
    with torch.no_grad():
        ids = torch.tensor([src.tokenizer.encode(text)])
        want = src.model(ids, backend="reference", return_weights=True).weights  # [(1, H, T, T)]
    for layer, head in [(0, 1), (1, None), (-1, -1)]:
        r = client.post("/api/attention", json={"model": "runs/gpt-tiny", "text": text,
                                                "layer": layer, "head": head})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["query_tokens"] == body["key_tokens"] == list(text)
        assert (body["n_layers"], body["n_heads"], body["causal"], body["notes"]) == (2, 4, True, [])
        assert (body["layer"], body["head"]) == (layer % 2, None if head is None else head % 4)
        w = torch.tensor(body["weights"], dtype=torch.float64)
        assert w.shape == (len(text), len(text))
        torch.testing.assert_close(w.sum(-1), torch.ones(len(text), dtype=torch.float64), atol=1e-5, rtol=0)
        ref = want[layer][0].double()
        ref = ref.mean(0) if head is None else ref[head]
        torch.testing.assert_close(w, ref, atol=2e-6, rtol=0)


@pytest.mark.skipif(not asset_installed("minilm"),
                    reason="asset minilm not installed: qkv assets install minilm")
def test_a_pretrained_name_never_reads_a_folder_of_that_name(tmp_path, monkeypatch) -> None:
    """A folder ./minilm in the server's working directory is not the pretrained minilm."""
    from qkv.serve.registry import Registry

    (tmp_path / "minilm").mkdir()
    (tmp_path / "minilm" / "config.json").write_text('{"family": "gpt"}')
    monkeypatch.chdir(tmp_path)
    src = Registry(tmp_path / "runs").get("minilm")
    assert src.name == "minilm" and src.n_layers == 6


@pytest.mark.skipif(not asset_installed("minilm"),
                    reason="asset minilm not installed: qkv assets install minilm")
def test_minilm_attention(client) -> None:
    r = client.post("/api/attention", json={"model": "minilm", "text": "The cat sat on the mat.",
                                            "layer": 0})
    body = r.json()
    assert r.status_code == 200, body
    assert body["query_tokens"] == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    assert (body["n_layers"], body["n_heads"], body["causal"]) == (6, 12, False)
    w = torch.tensor(body["weights"])
    assert w.shape == (9, 9) and float(w.triu(1).sum()) > 1  # bidirectional: later keys count
    # longer than the server's limit (64 here): truncated, [SEP] kept, with a note
    r = client.post("/api/attention", json={"model": "minilm", "text": "word " * 100})
    body = r.json()
    assert len(body["query_tokens"]) == 64 and body["query_tokens"][-1] == "[SEP]"
    assert body["notes"] == ["truncated to the first 64 of 102 tokens (the limit here is 64 tokens)"]


def test_text_beyond_the_context_is_truncated_with_a_note(client) -> None:
    text = "ROMEO: But soft, what light through yonder window breaks?"
    r = client.post("/api/attention", json={"model": "runs/gpt-tiny", "text": text})
    body = r.json()
    assert r.status_code == 200 and body["query_tokens"] == list(text[:32])
    assert body["notes"] == [f"truncated to the first 32 of {len(text)} tokens "
                             "(the model's context is 32 tokens)"]
    assert len(body["weights"]) == 32


def test_seq2seq_alignment(client) -> None:
    r = client.post("/api/attention", json={"model": "runs/seq2seq-tiny", "text": "8 août 1977"})
    body = r.json()
    assert r.status_code == 200, body
    assert body["key_tokens"] == list("8 août 1977") and body["query_tokens"] == list(body["output"])
    w = torch.tensor(body["weights"])
    assert w.shape == (len(body["output"]), 11)
    torch.testing.assert_close(w.sum(-1), torch.ones(len(body["output"])), atol=1e-5, rtol=0)


@pytest.mark.parametrize("body, status, message", [
    ({"model": "runs/gpt-tiny", "text": ""}, 422, "the text is empty"),
    ({"model": "runs/gpt-tiny", "text": " \n\t "}, 422, "the text is empty"),
    ({"model": "runs/gpt-tiny", "text": "ROMEO ✓"}, 422, "never saw"),
    ({"model": "runs/gpt-tiny", "text": "R" * 2001}, 422, "has 2,001 characters; the limit is 2,000"),
    ({"model": "runs/gpt-tiny", "text": "R" * 20_001}, 422, "text: String should have at most 20000"),
    ({"model": "runs/gpt-tiny", "text": "ROMEO", "layer": 2}, 422, "layer must be in [-2, 1]"),
    ({"model": "runs/gpt-tiny", "text": "ROMEO", "head": 4}, 422, "head must be in [-4, 3]"),
    ({"model": "runs/gpt-tiny", "text": "ROMEO", "layer": "top"}, 422, "layer: "),
    ({"model": "runs/gpt-tiny"}, 422, "text: Field required"),
    ({"model": "runs/vit-tiny", "text": "hello"}, 422, "it reads images; upload one"),
    ({"model": "gpt2", "text": "hi"}, 404, "unknown model 'gpt2'"),
    ({"model": "runs/nope", "text": "hi"}, 404, "no run 'nope'"),
    ({"model": "runs/notes", "text": "hi"}, 404, "is not a run of"),
    ({"model": "../../etc/passwd", "text": "hi"}, 400, "invalid model name"),
    ({"model": "/etc/passwd", "text": "hi"}, 400, "invalid model name"),
    ({"model": "runs/../../etc/passwd", "text": "hi"}, 400, "invalid run name"),
    ({"model": "runs/..", "text": "hi"}, 400, "invalid run name"),
    ({"model": "runs/gpt-tiny/../../../etc", "text": "hi"}, 400, "invalid run name"),
    ({"model": "runs/escape", "text": "hi"}, 400, "points outside the runs directory"),
    ({"model": "runs/.hidden", "text": "hi"}, 400, "invalid run name"),
])
def test_bad_attention_requests(client, body, status, message) -> None:
    assert message in detail(client.post("/api/attention", json=body), status)


# Every file a request opens is seen here: Python's audit events ("open" is raised by open(),
# io.open, os.open and the import system; "os.listdir"/"os.scandir" by directory listings; the
# process-spawning events by subprocess and os), plus safetensors' own reader, which opens files
# in Rust without an event. The hook is added once and costs nothing while no watch is on.
_WATCH: list[tuple[str, str]] | None = None
_HOOKED = False
_SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork")


def _audit(event: str, args: tuple) -> None:
    seen = _WATCH
    if seen is None:
        return
    path = args[0] if args else None
    if event in ("open", "os.listdir", "os.scandir") and isinstance(path, str | bytes | os.PathLike):
        seen.append((event, os.path.abspath(os.fsdecode(path))))
    elif event in ("os.listdir", "os.scandir") and path is None:
        seen.append((event, os.path.abspath(".")))
    elif event in _SPAWN_EVENTS:
        seen.append((event, repr(args)[:200]))


@contextlib.contextmanager
def watch_files(monkeypatch) -> Iterator[list[tuple[str, str]]]:
    """``with watch_files(monkeypatch) as seen:`` -> every (event, absolute path) of the block."""
    global _WATCH, _HOOKED
    import safetensors
    import safetensors.torch

    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    seen: list[tuple[str, str]] = []
    real = safetensors.safe_open

    def spy(filename, *args, **kwargs):
        seen.append(("safetensors", os.path.abspath(os.fspath(filename))))
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    monkeypatch.setattr(safetensors.torch, "safe_open", spy)  # load_file and load_model use this name
    _WATCH = seen
    try:
        yield seen
    finally:
        _WATCH = None


def _every_kind_of_request(c, names: list[str]) -> None:
    png = png_bytes((16, 16))
    for path in ["/", "/static/app.js", "/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapi.py",
                 "/static//etc/passwd", "/api/models"]:
        c.get(path)
    for name in names:
        c.post("/api/attention", json={"model": name, "text": "ROMEO 8 août 1977"})
        c.post("/api/generate", json={"model": name, "prompt": "ROMEO", "max_new_tokens": 2})
        c.post("/api/image-attention", data={"model": name}, files={"image": ("d.png", png, "image/png")})


def test_requests_never_read_outside_the_runs_directory(runs_dir, monkeypatch) -> None:
    """Whatever the name, a request reads files only inside the runs directory (and the page's
    own static folder, the installed files of a pretrained model it names, and qkv's folder of
    saved decoding steps with the CPU's description that keys them): no loader, no
    listing, no image reader, nothing else; and it starts no program."""
    from fastapi.testclient import TestClient

    import qkv.serve.registry as registry
    from qkv.generation import aot
    from qkv.serve import create_app
    from qkv.serve.app import STATIC

    handed: list[tuple[str, str]] = []
    for loader in ("open_model", "resolve"):
        real = getattr(registry, loader)

        def spy(target, *args, _real=real, _name=loader, **kwargs):
            handed.append((_name, str(getattr(target, "path", target))))  # a ModelRef's path
            return _real(target, *args, **kwargs)

        monkeypatch.setattr(registry, loader, spy)
    names = ["../../etc/passwd", "runs/../../etc/passwd", "runs/escape", "runs/%2e%2e", "runs/~root",
             "runs/gpt-tiny\x00", "runs/a/b", "/etc/passwd", "~/.ssh/id_rsa", "..", "runs/notes",
             "runs/notes/readme.txt", "gpt-tiny", "runs/gpt-tiny", "runs/vit-tiny", "runs/seq2seq-tiny",
             "runs/captioner-tiny"]
    allowed = [runs_dir.resolve(), STATIC, Path("/proc/cpuinfo")]
    if aot.enabled():  # a lone request looks for its model's saved step (keyed by the CPU)
        allowed.append(aot.folder().resolve())
    if asset_installed("minilm"):
        from qkv.assets import asset_path

        names.append("minilm")
        allowed.append(asset_path("minilm").resolve())
    _every_kind_of_request(TestClient(create_app(runs_dir=runs_dir)), names)  # imports happen here
    handed.clear()
    with watch_files(monkeypatch) as seen:  # a fresh app: nothing loaded, nothing cached
        _every_kind_of_request(TestClient(create_app(runs_dir=runs_dir)), names)
    root = runs_dir.resolve()
    # qkv.assets finds installed asset packages with importlib, which lists the sys.path folders
    search = {os.path.abspath(p or ".") for p in sys.path}
    outside = [(e, p) for e, p in seen if e in _SPAWN_EVENTS or not (
        any(Path(p).resolve().is_relative_to(a) for a in allowed) or (e == "os.listdir" and p in search))]
    assert outside == []
    read = {Path(p).resolve() for e, p in seen}
    for family in ("gpt", "vit", "seq2seq", "captioner"):  # the watch saw the real reads
        assert root / f"{family}-tiny" / "model.safetensors" in read, family
        assert root / f"{family}-tiny" / "config.json" in read, family
    assert any(p.is_relative_to(STATIC) for p in read)
    opened = {t for name, t in handed if name == "open_model"}
    loads = sorted(t for t in opened if Path(t).resolve().is_relative_to(root))
    assert loads == sorted(str(root / f"{f}-tiny") for f in ("captioner", "gpt", "seq2seq", "vit"))
    assert {Path(t).resolve() for t in opened if t not in loads} <= set(allowed[2:])  # minilm's files
    resolved = [t for name, t in handed if name == "resolve"]
    assert all(t in ("minilm", "smollm2") or Path(t).resolve().is_relative_to(root) for t in resolved)


@pytest.mark.skipif(not asset_installed("smollm2"),
                    reason="asset smollm2 not installed: qkv assets install smollm2")
def test_smollm2_attention_and_generation(client) -> None:
    """GQA (9 query heads over 3 key/value heads) and RoPE: every query head has its own map."""
    pytest.importorskip("gguf")
    r = client.post("/api/attention", json={"model": "smollm2", "text": "Once upon a time", "layer": 3})
    body = r.json()
    assert r.status_code == 200, body
    assert body["query_tokens"] == ["Once", " upon", " a", " time"]
    assert (body["n_layers"], body["n_heads"], body["causal"]) == (30, 9, True)
    w = torch.tensor(body["weights"])
    assert float(w.triu(1).abs().max()) == 0
    torch.testing.assert_close(w.sum(-1), torch.ones(4), atol=1e-5, rtol=0)
    events = _events(client.post("/api/generate", json={
        "model": "smollm2", "prompt": "The capital of France is", "max_new_tokens": 2}))
    assert "".join(e["token"] for e in events if e["event"] == "token") == " Paris."


def test_a_run_retrained_on_disk_is_loaded_again(app, client, runs_dir) -> None:
    reg = app.state.registry
    first = reg.get("runs/gpt-tiny")
    assert reg.get("runs/gpt-tiny") is first  # loaded once, shared
    weights = runs_dir / "gpt-tiny" / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    try:
        assert reg.get("runs/gpt-tiny") is not first
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_no_response_names_a_filesystem_path(tiny_run, tmp_path, monkeypatch) -> None:
    """Damaged runs, missing files, traversal, a bug deep in the model code, an error in the
    middle of a stream: every message names runs by their id (runs/NAME), never by where they
    are on the server's disk. Each response is scanned for the runs directory's path."""
    import shutil

    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    root = tmp_path / "srv" / "runs"
    root.mkdir(parents=True)
    for family in ("gpt", "vit"):
        shutil.copytree(tiny_run(family), root / f"{family}-ok")
        shutil.copytree(tiny_run(family), root / f"{family}-broken")
        (root / f"{family}-broken" / "model.safetensors").write_bytes(b"\x00" * 10)
    shutil.copytree(tiny_run("gpt"), root / "gpt-noweights")
    (root / "gpt-noweights" / "model.safetensors").unlink()
    (root / "gpt-badjson").mkdir()
    (root / "gpt-badjson" / "config.json").write_text("{not json")
    (root / "escape").symlink_to(tiny_run("gpt"), target_is_directory=True)
    c = TestClient(create_app(runs_dir=root), raise_server_exceptions=False)
    png = png_bytes((16, 16))
    got = {"models": c.get("/api/models"), "static": c.get("/static/nope.js"), "page": c.get("/nope"),
           "not an image": c.post("/api/image-attention", data={"model": "runs/vit-ok"},
                                  files={"image": (str(root / "d.png"), b"text", "image/png")})}
    for name in ["runs/gpt-ok", "runs/gpt-broken", "runs/vit-broken", "runs/gpt-noweights",
                 "runs/gpt-badjson", "runs/escape", "runs/../../x", "runs/nope", str(root / "gpt-ok"),
                 "../" + str(root)]:
        got["attention", name] = c.post("/api/attention", json={"model": name, "text": "ROMEO"})
        got["generate", name] = c.post("/api/generate", json={"model": name, "prompt": "ROMEO",
                                                              "max_new_tokens": 2})
        got["image", name] = c.post("/api/image-attention", data={"model": name},
                                    files={"image": (str(root / "d.png"), png, "image/png")})
    from qkv.pipelines import attention as sources

    def bug(*args, **kwargs):
        raise RuntimeError(f"an unexpected failure reading {root}/gpt-ok/model.safetensors")

    def failing_step(*args, **kwargs):
        raise ValueError(f"{root.resolve()}/gpt-ok/model.safetensors went away")

    from qkv.generation.batch import Batch

    monkeypatch.setattr(sources, "text_attention_steps", bug)
    monkeypatch.setattr(Batch, "step", failing_step)  # the running batch fails after the first token
    got["bug"] = c.post("/api/attention", json={"model": "runs/gpt-ok", "text": "JULIET"})
    got["stream"] = c.post("/api/generate", json={"model": "runs/gpt-ok", "prompt": "ROMEO"})
    for key, r in got.items():
        for path in {str(tmp_path), str(tmp_path.resolve()), "/tmp/", str(Path.home())}:
            assert path not in r.text, (key, r.status_code, r.text)
    assert got["models"].json()["runs_dir"] == "runs"
    assert "cannot load runs/gpt-broken/model.safetensors" in detail(got["attention", "runs/gpt-broken"], 422)
    assert "cannot load runs/vit-broken/model.safetensors" in detail(got["image", "runs/vit-broken"], 422)
    assert detail(got["generate", "runs/gpt-noweights"], 422).startswith(
        "runs/gpt-noweights/model.safetensors is missing: is runs/gpt-noweights a qkv run directory?")
    assert detail(got["not an image"], 415).startswith("d.png is not an image")  # the name, not the path
    assert detail(got["attention", "../" + str(root)], 400) == (
        "invalid model name (not shown: it has an absolute path in it): choose one from GET /api/models")
    assert detail(got["bug"], 500) == ("internal error (RuntimeError) on /api/attention; the server's log "
                                       "has the details")
    assert json.loads(got["stream"].text.splitlines()[-1]) == {
        "event": "error", "detail": "runs/gpt-ok/model.safetensors went away"}
    # no oracle: a name holding the right guess of the runs directory reads like any other guess
    for template in ("{}/gpt-ok", "..//{}", "runs/x {}", "a {}", "runs/{}"):
        answers = {c.post("/api/attention", json={"model": template.format(guess), "text": "R"}).text
                   for guess in (str(root), str(root.resolve()), "/nowhere/runs")}
        assert len(answers) == 1, answers


def test_a_model_whose_attention_is_nan_gets_a_422(runs_dir, monkeypatch) -> None:
    """A run trained into NaN: JSON cannot carry NaN (it would go out as null, which the schema
    does not allow and the page cannot draw), so the answer is a message."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    real = sources.text_attention_steps

    def nan(*args, **kwargs):  # the server computes attention in pieces
        att = yield from real(*args, **kwargs)
        att.weights = torch.full_like(att.weights, float("nan"))
        return att

    monkeypatch.setattr(sources, "text_attention_steps", nan)
    c = TestClient(create_app(runs_dir=runs_dir))
    r = c.post("/api/attention", json={"model": "runs/gpt-tiny", "text": "ROMEO"})
    assert detail(r, 422).startswith("the attention weights are not all finite (NaN or inf)")


@pytest.mark.parametrize("batch_rows", [8, 1])
def test_a_generation_whose_attention_turns_nan_ends_with_an_error_event(runs_dir, monkeypatch,
                                                                         batch_rows) -> None:
    """The stream's status line has gone out, so a NaN row becomes an error event, never a
    token event with nulls in its weights."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    real, calls = sources.head_row, []
    app = create_app(runs_dir=runs_dir, batch_rows=batch_rows)

    def nan_after_one(w, head):
        row = real(w, head)
        if threading.current_thread() is not app.state.loop.thread:  # another test's server
            return row
        calls.append(1)
        return row if len(calls) == 1 else torch.full_like(row, float("nan"))

    monkeypatch.setattr(sources, "head_row", nan_after_one)
    c = TestClient(app)
    events = _events(c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO",
                                                   "max_new_tokens": 4}))
    assert [e["event"] for e in events] == ["start", "token", "error"]
    assert events[-1]["detail"].startswith("the attention weights are not all finite")


def test_a_pretrained_model_that_is_not_installed(runs_dir, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    import qkv.assets
    from qkv.serve import create_app

    def missing(name):
        raise qkv.assets.AssetMissingError(f"asset {name!r} is not installed")

    monkeypatch.setattr(qkv.assets, "asset_path", missing)
    c = TestClient(create_app(runs_dir=runs_dir))
    assert not {"minilm", "smollm2"} & {m["id"] for m in c.get("/api/models").json()["models"]}
    r = c.post("/api/attention", json={"model": "minilm", "text": "hi"})
    assert detail(r, 404) == "minilm is not installed: qkv assets install minilm"


# --------------------------------------------------------------------------- generation


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines()]


def test_generate_streams_tokens_with_their_attention(client, tiny_run) -> None:
    r = client.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO: ",
                                           "max_new_tokens": 5, "layer": 1, "head": 0})
    events = _events(r)
    assert [e["event"] for e in events] == ["start"] + ["token"] * 5 + ["done"]
    assert events[0]["tokens"] == list("ROMEO: ") and (events[0]["layer"], events[0]["head"]) == (1, 0)
    src = open_model(tiny_run("gpt"))
    prompt = src.tokenizer.encode("ROMEO: ")
    greedy = [int(t[0]) for t in generate(src.model, torch.tensor([prompt]), 5, temperature=0.0)]
    assert [e["id"] for e in events[1:-1]] == greedy
    for i, e in enumerate(events[1:-1]):
        assert len(e["weights"]) == len(prompt) + i  # over every token before the new one
        assert sum(e["weights"]) == pytest.approx(1, abs=1e-5)
    assert events[-1]["text"] == src.tokenizer.decode(greedy)


def test_generate_stops_at_the_context_with_a_note(client) -> None:
    events = _events(client.post("/api/generate", json={
        "model": "runs/gpt-tiny", "prompt": "ROMEO: But soft, what light", "max_new_tokens": 50}))
    assert events[0]["notes"] == ["5 new tokens at most: the prompt has 27 tokens and the limit is 32"]
    assert [e["event"] for e in events].count("token") == 5


@pytest.mark.parametrize("body, status, message", [
    ({"model": "runs/vit-tiny", "prompt": "hi"}, 422, "only GPT models"),
    ({"model": "runs/seq2seq-tiny", "prompt": "hi"}, 422, "only GPT models"),
    ({"model": "runs/gpt-tiny", "prompt": "  "}, 422, "the text is empty"),
    ({"model": "runs/gpt-tiny", "prompt": "R", "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"model": "runs/gpt-tiny", "prompt": "R", "temperature": -1}, 422, "temperature"),
    ({"model": "runs/gpt-tiny", "prompt": "R", "temperature": 1e-300}, 422,
     "temperature must be 0 (greedy) or at least 1e-06, got 1e-300"),
    ({"model": "runs/gpt-tiny", "prompt": "R", "seed": 2**64}, 422, "seed: Input should be less than or"),
    ({"model": "runs/gpt-tiny", "prompt": "R", "seed": -2**63 - 1}, 422, "seed: Input should be greater"),
    ({"model": "runs/gpt-tiny", "prompt": "R", "layer": 7}, 422, "layer must be in"),
    ({"model": "nope", "prompt": "R"}, 404, "unknown model"),
    ({"model": "runs/../x", "prompt": "R"}, 400, "invalid run name"),
])
def test_bad_generate_requests(client, body, status, message) -> None:
    assert message in detail(client.post("/api/generate", json=body), status)


# --------------------------------------------------------------------------- images


def test_vit_image_attention(client, tiny_run) -> None:
    r = client.post("/api/image-attention", data={"model": "runs/vit-tiny", "layer": "0"},
                    files={"image": ("digit.png", png_bytes((20, 20)), "image/png")})
    body = r.json()
    assert r.status_code == 200, body
    assert body["image"] == {"width": 8, "height": 8, "channels": 1, "pixels": [200] * 64}
    assert body["notes"] == ["resized 20x20 to 8x8"]
    assert [m["label"] for m in body["maps"]] == [f"layer 0 head {h}" for h in range(4)] + ["rollout"]
    src = open_model(tiny_run("vit"))
    want = src.attention(src.read_image(png_bytes((20, 20)))[0], layer=0)
    for m, (_, w) in zip(body["maps"], want.maps, strict=True):
        torch.testing.assert_close(torch.tensor(m["weights"]), w.float(), atol=2e-6, rtol=0)
    assert body["details"]["prediction"] == want.details["prediction"]


def test_captioner_image_attention(client) -> None:
    r = client.post("/api/image-attention", data={"model": "runs/captioner-tiny"},
                    files={"image": ("scene.png", png_bytes((64, 64), "RGB", (200, 30, 30)), "image/png")})
    body = r.json()
    assert r.status_code == 200, body
    assert body["family"] == "captioner" and body["image"]["channels"] == 3
    assert [m["label"] for m in body["maps"]] == body["title"].split()
    for m in body["maps"]:  # each word's soft attention over the 8x8 grid sums to 1
        assert sum(map(sum, m["weights"])) == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize("model, upload, status, message", [
    ("runs/vit-tiny", ("notes.txt", b"just some text, not pixels", "text/plain"), 415, "is not an image"),
    ("runs/vit-tiny", ("fake.png", b"\x89PNG\r\n\x1a\n broken", "image/png"), 415, "is not an image"),
    ("runs/vit-tiny", ("x.eps", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n", "image/png"), 415,
     "x.eps is not an image this server can read (PNG, JPEG, GIF, BMP, WebP, TIFF)"),
    ("runs/vit-tiny", ("d.ppm", image_bytes("PPM"), "image/x-portable-pixmap"), 415, "is not an image"),
    ("runs/vit-tiny", ("../../secret  dir/a.png", b"not", "image/png"), 415, "a.png is not an image"),
    ("runs/vit-tiny", ("big.bin", os.urandom(20_001), "image/png"), 413, "larger than 20,000 bytes"),
    ("runs/vit-tiny", ("huge.png", png_bytes((400, 400)), "image/png"), 413, "400x400 pixels"),
    ("runs/vit-tiny", ("empty.png", b"", "image/png"), 422, "the upload is empty"),
    ("runs/gpt-tiny", ("d.png", png_bytes(), "image/png"), 422, "reads text, not images"),
    ("runs/../../etc", ("d.png", png_bytes(), "image/png"), 400, "invalid run name"),
    ("nope", ("d.png", png_bytes(), "image/png"), 404, "unknown model"),
])
def test_bad_uploads(client, model, upload, status, message) -> None:
    r = client.post("/api/image-attention", data={"model": model}, files={"image": upload})
    assert message in detail(r, status)


def test_bodies_over_the_limit_are_refused_before_parsing(client) -> None:
    big = os.urandom(400_000)  # past the upload limit plus the form's allowance
    r = client.post("/api/image-attention", data={"model": "runs/vit-tiny"},
                    files={"image": ("big.png", big, "image/png")})
    assert "larger than" in detail(r, 413)

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"x" * 50_000

    r = client.post("/api/attention", content=chunks(), headers={"content-type": "application/json"})
    assert "larger than" in detail(r, 413)
    r = client.post("/api/image-attention", data={"model": "runs/vit-tiny", "layer": "9"},
                    files={"image": ("d.png", png_bytes(), "image/png")})
    assert "layer must be in" in detail(r, 422)


# --------------------------------------------------------------------------- the command


def test_serve_command_errors(tmp_path: Path, capsys) -> None:
    from qkv import cli

    def error(argv: list[str]) -> str:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("qkv: error: "), err
        return err

    assert "--port must be in 1..65535, got 70000" in error(["serve", "--port", "70000"])
    assert "--max-upload-mb must be positive" in error(["serve", "--max-upload-mb", "0"])
    assert "max_tokens must be >= 2" in error(["serve", "--max-tokens", "1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{busy}" in error(["serve", "--port", str(busy), "--runs",
                                                              str(tmp_path)])


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_command_passes_its_options_to_the_app(tmp_path: Path, monkeypatch, host: str) -> None:
    """The bound host (IPv6 too) and the queue limits reach the app's config; the Host check
    then refuses another name and accepts the loopback ones."""
    import uvicorn
    from fastapi.testclient import TestClient

    from qkv import cli
    from qkv.commands import serve as serve_cmd

    seen = {}
    monkeypatch.setattr(serve_cmd, "_check_port_free", lambda h, p: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert cli.main(["serve", "--host", host, "--runs", str(tmp_path), "--batch-rows", "3",
                     "--max-queued", "2", "--max-wait", "5"]) == 0
    app = seen["app"]
    cfg, loop = app.state.config, app.state.loop
    got = (cfg.host, cfg.batch_rows, cfg.max_queued, cfg.max_wait_s, loop.max_queued, loop.max_wait_s)
    assert got == (host, 3, 2, 5.0, 2, 5.0)
    c = TestClient(seen["app"])
    assert c.get("/api/models", headers={"host": "evil.example"}).status_code == 400
    assert c.get("/api/models", headers={"host": "localhost:8000"}).status_code == 200


def test_serve_command_serves_the_page(runs_dir) -> None:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "qkv", "serve", "--port", str(port), "--runs", str(runs_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # the runs folder, then the address
        line += proc.stdout.readline()
        assert f"open http://127.0.0.1:{port}/" in line, line + proc.stderr.read()
        for _ in range(100):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/models", timeout=5)
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert r.status_code == 200 and "runs/gpt-tiny" in r.text
        assert "qkv · attention explorer" in httpx.get(f"http://127.0.0.1:{port}/").text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
