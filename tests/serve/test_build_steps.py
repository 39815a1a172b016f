"""`qkv serve --build-steps MODEL`: the saved decoding steps a model lacks are built before the
server listens, under the keys the server's own requests look for, so the first request decodes
through them; bad names fail in one line before anything is built; a step that cannot be built
is said and serving goes on eagerly. Reference: the eager decoding of the same request."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.generation import aot
from qkv.inference.steps import build_now

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _app(runs_dir, **cfg):
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    from qkv.serve import ServeConfig, create_app

    config = ServeConfig(runs_dir=runs_dir, **cfg)
    return create_app(config), config


@pytest.mark.skipif(aot.compiler() is None, reason="saved steps need a C++ compiler (apt-get install g++)")
def test_the_built_step_is_the_one_the_first_request_decodes_through(runs_dir, private_cache, capsys):
    """One-request step (batch_rows 0: each request decodes alone): built before listening, then
    the first request goes through it (its request count) and gives the eager tokens; a second
    call builds nothing."""
    from fastapi.testclient import TestClient

    from qkv.commands.serve import build_steps

    app, cfg = _app(runs_dir, batch_rows=0)
    build_steps(app.state.registry, cfg, ["runs/gpt-tiny"])
    err = capsys.readouterr().err
    assert "runs/gpt-tiny: saved step for one request: built in" in err, err
    lm = app.state.registry.get("runs/gpt-tiny")
    step, _ = aot.saved_step(lm.model)
    assert step is not None and step.requests == 0
    body = {"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 10, "layer": 0, "temperature": 0.0}
    with TestClient(app) as c:
        r = c.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    got = [json.loads(x)["id"] for x in r.text.splitlines() if json.loads(x)["event"] == "token"]
    assert step.requests == 1  # the server's request took the step that was built
    prompt = torch.tensor([lm.tokenizer.encode("ROMEO")])
    from qkv.generation import generate

    assert got == [int(t[0]) for t in generate(lm.model, prompt, 10, temperature=0.0, compile=False)]
    build_steps(app.state.registry, cfg, ["runs/gpt-tiny"])
    again = capsys.readouterr().err.strip()
    assert again == "qkv serve: runs/gpt-tiny: saved step for one request: already built"


def test_the_batch_step_is_asked_for_with_the_servers_rows_and_cache_length(runs_dir, monkeypatch):
    """--batch-rows 8 and --max-tokens 24: the lone request's step (the model's default cache) and
    the running batch's step of 8 rows x 24 positions, the (rows, cache length) the server's own
    running batch is made with (and asks its step for)."""
    from fastapi.testclient import TestClient

    from qkv.serve import api
    from qkv.serve.batching import BatchEngine

    asked: list[tuple[int, int | None, bool]] = []

    def saved_step(model, build_missing=False, rows=1, cache_len=None):
        asked.append((rows, cache_len, build_missing))
        return None, "no saved step (SavedStepError: test)"

    monkeypatch.setattr(aot, "saved_step", saved_step)
    app, cfg = _app(runs_dir, batch_rows=8, max_tokens=24)
    lm = app.state.registry.get("runs/gpt-tiny")
    assert lm.context > 24
    done = build_now(lm, cfg.batch_rows, cfg.longest(lm.context))
    built = [(r, c) for r, c, b in asked if b]
    assert built == [(1, None), (8, 24)]
    assert [b.what for b in done] == ["one request", "a batch of up to 8 rows x 24 positions"]
    assert not any(b.ready for b in done) and done[1].note == "no saved step (SavedStepError: test)"
    engines = []
    monkeypatch.setattr(api, "BatchEngine", lambda *a, **k: engines.append(k) or BatchEngine(*a, **k))
    with TestClient(app) as c:  # the server's running batch for this model: made with the same two
        r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    assert [(k["rows"], k["cache_len"]) for k in engines] == [(8, 24)]


def test_every_name_is_checked_before_anything_is_loaded_or_built(runs_dir, private_cache):
    from qkv.commands.serve import build_steps

    app, cfg = _app(runs_dir)
    with pytest.raises(ValueError, match="--build-steps nosuch: unknown model 'nosuch'"):
        build_steps(app.state.registry, cfg, ["runs/gpt-tiny", "nosuch"])
    assert app.state.registry.in_memory() == 0
    assert not (private_cache / "steps").exists() or not any((private_cache / "steps").iterdir())
    with pytest.raises(ValueError, match="vit model has no decoding steps; name a decoder"):
        build_steps(app.state.registry, cfg, ["runs/gpt-tiny", "runs/vit-tiny"])
    assert app.state.registry.in_memory() == 0  # refused before the decoder was loaded or built


def test_no_compiler_is_one_line_and_serving_goes_on(runs_dir, private_cache, monkeypatch, capsys):
    from qkv.commands.serve import build_steps

    monkeypatch.setattr(aot, "compiler", lambda: None)
    app, cfg = _app(runs_dir, batch_rows=0)
    build_steps(app.state.registry, cfg, ["runs/gpt-tiny"])  # no exception
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("qkv serve: runs/gpt-tiny: saved step for one request: no saved step (")
    assert "no C++ compiler found" in lines[-1] and lines[-1].endswith("(its requests decode eagerly)")


def test_the_command_exits_2_in_one_line_before_listening(runs_dir, capsys):
    pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
    from helpers import free_port

    from qkv.cli import main

    argv = ["serve", "--runs", str(runs_dir), "--port", str(free_port()), "--build-steps", "nosuch"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error: --build-steps nosuch: unknown model 'nosuch'; the decoders here: ")
    assert "runs/gpt-tiny" in err and "runs/vit-tiny" not in err and "\n" not in err
