"""`qkv serve --build-steps MODEL` (what `qkv prepare MODEL --batch-rows R --max-tokens T` builds):
the saved decoding steps a model lacks are built before the server listens, in its compute loop,
under the keys the server's own requests look for, so the first request decodes through them;
bad names fail in one line before anything is built; a step that cannot be built is said and
serving goes on eagerly. Reference: the eager decoding of the same request."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.generation import aot, builds

pytestmark = pytest.mark.usefixtures("one_thread", "compile_once")  # see tests/conftest.py


def _app(runs_dir, **cfg):
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    from qkv.serve import ServeConfig, create_app

    config = ServeConfig(runs_dir=runs_dir, **cfg)
    return create_app(config), config


@pytest.mark.skipif(aot.compiler() is None, reason="saved steps need a C++ compiler (apt-get install g++)")
def test_the_built_step_is_the_one_the_first_request_decodes_through(runs_dir, private_cache, capsys):
    """One-request step (batch_rows 1: one request at a time, a lone row): built before
    listening, in the compute loop, then the first request goes through it (its request count)
    and gives the eager tokens; a second call builds nothing."""
    from fastapi.testclient import TestClient

    from qkv.commands.serve import build_steps

    app, _ = _app(runs_dir, batch_rows=1)
    build_steps(app, ["runs/gpt-tiny"])
    err = capsys.readouterr().err
    assert "runs/gpt-tiny: saved step for one request: built in" in err, err
    lm = app.state.registry.get("runs/gpt-tiny")
    step = builds.status(lm.model).step
    assert step is not None and step.requests == 0
    body = {"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 10, "layer": 0, "temperature": 0.0}
    with TestClient(app) as c:
        r = c.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    got = [json.loads(x)["id"] for x in r.text.splitlines() if json.loads(x)["event"] == "token"]
    assert step.requests == 1  # the server's request took the step that was built
    prompt = torch.tensor([lm.tokenizer.encode("ROMEO")])
    from qkv.generation import generate

    assert got == [int(t[0]) for t in generate(lm.model, prompt, 10, temperature=0.0, mode="eager")]
    build_steps(app, ["runs/gpt-tiny"])
    again = capsys.readouterr().err.strip().splitlines()
    assert again[0] == "qkv serve: runs/gpt-tiny: saved step for one request: already built", again


def test_the_batch_step_is_asked_for_with_the_servers_rows_and_cache_length(runs_dir, monkeypatch):
    """--batch-rows 8 and --max-tokens 24: the lone request's step (the model's default cache) and
    the running batch's step of 8 rows x 24 positions, the (rows, cache length) the server's own
    running batch is made with (and asks its step for)."""
    from fastapi.testclient import TestClient

    from qkv.commands.serve import build_steps
    from qkv.serve import api
    from qkv.serve.batching import ModelBatch

    asked: list[tuple[int, int | None]] = []
    real = builds.ensure

    def ensure(model, rows=1, cache_len=None, on_stage=None):
        asked.append((rows, cache_len))
        st = real(model, rows, cache_len)  # QKV_SAVED_STEP=off: nothing is built
        assert st.why is builds.Why.OFF
        return st

    monkeypatch.setenv("QKV_SAVED_STEP", "off")
    import qkv.pipelines.text as text_module

    monkeypatch.setattr(text_module, "ensure", ensure)  # what CausalLM.prepare calls
    app, _ = _app(runs_dir, batch_rows=8, max_tokens=24)
    build_steps(app, ["runs/gpt-tiny"])
    assert asked == [(1, None), (8, 24)]
    lm = app.state.registry.get("runs/gpt-tiny")
    assert lm.context > 24
    made = []
    monkeypatch.setattr(api, "ModelBatch", lambda *a, **k: made.append(k) or ModelBatch(*a, **k))
    with TestClient(app) as c:  # the server's running batch for this model: made with the same two
        r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    assert [(k["rows"], k["cache_len"]) for k in made] == [(8, 24)]


def test_every_name_is_checked_before_anything_is_loaded_or_built(runs_dir, private_cache):
    from qkv.commands.serve import build_steps

    app, _ = _app(runs_dir)
    with pytest.raises(ValueError, match="--build-steps nosuch: no such model here; the decoders here: "):
        build_steps(app, ["runs/gpt-tiny", "nosuch"])
    assert app.state.registry.in_memory() == 0
    assert not (private_cache / "steps").exists() or not any((private_cache / "steps").iterdir())
    with pytest.raises(ValueError, match="vit model has no decoding steps; name a decoder"):
        build_steps(app, ["runs/gpt-tiny", "runs/vit-tiny"])
    assert app.state.registry.in_memory() == 0  # refused before the decoder was loaded or built


def test_no_compiler_is_one_line_and_serving_goes_on(runs_dir, private_cache, monkeypatch, capsys):
    from qkv.commands.serve import build_steps

    monkeypatch.setattr(builds, "compiler", lambda: None)
    app, _ = _app(runs_dir, batch_rows=1)
    build_steps(app, ["runs/gpt-tiny"])  # no exception
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == ("qkv serve: runs/gpt-tiny: saved step for one request: no saved step: no C++ "
                         "compiler here (apt-get install g++)"), lines


def test_the_command_exits_2_in_one_line_before_listening(runs_dir, capsys):
    pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
    from helpers import free_port

    from qkv.cli import main

    argv = ["serve", "--runs", str(runs_dir), "--port", str(free_port()), "--build-steps", "nosuch"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error: --build-steps nosuch: no such model here; the decoders here: ")
    assert "runs/gpt-tiny" in err and "runs/vit-tiny" not in err and "\n" not in err
