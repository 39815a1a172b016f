"""CLI of the pretrained models: argument handling that must fail fast, before any model loads."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.cli import main


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a command tries to load a model (every command opens models through
    qkv.inference.loading, whose readers are behind ``_read``)."""
    import qkv.inference.loading

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(qkv.inference.loading, "_read", boom)


@pytest.mark.parametrize("argv, message", [
    (["generate", "smollm2", "--prompt", "hi", "--top-p", "2"], "--top-p must be in (0, 1]"),
    (["generate", "smollm2", "--prompt", "hi", "--temperature", "-1"], "--temperature must be 0 (greedy) or"),
    (["generate", "smollm2", "--prompt", "hi", "--system", "x"], "--system is a chat message"),
    (["generate", "smollm2", "--prompt", "   "], "the prompt is empty"),
    (["generate", "smollm2", "--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
])
def test_generate_checks_arguments_before_loading(no_load, capsys, argv, message) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_a_missing_gpu_is_one_line(no_load, capsys) -> None:
    assert main(["generate", "smollm2", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_similarity_rejects_a_directory_or_a_missing_file(no_load, tmp_path, capsys) -> None:
    assert main(["similarity", "minilm", "query", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["similarity", "minilm", "query", str(tmp_path / "docs.txt")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_similarity_rejects_non_utf8_files(no_load, tmp_path, capsys) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes("café au lait\n".encode("latin-1"))
    assert main(["similarity", "minilm", "query", str(f)]) == 2
    assert "is not UTF-8" in capsys.readouterr().err


def test_embed_takes_texts_after_options(monkeypatch, capsys) -> None:
    """`qkv embed minilm --json "a b" c`: texts may follow the options."""
    import qkv.commands.pretrained as cmd

    seen = {}

    class FakeEncoder:
        def embed(self, texts, batch_size=32):
            seen["texts"], seen["batch_size"] = list(texts), batch_size
            return torch.eye(len(texts), 4)

    monkeypatch.setattr(cmd, "_encoder", lambda name: FakeEncoder())
    capsys.readouterr()
    assert main(["embed", "minilm", "--json", "--batch-size", "8", "a b", "c"]) == 0
    assert seen == {"texts": ["a b", "c"], "batch_size": 8}
    # The JSON holds each text with its own row of the encoder's output (rows of eye(2, 4)).
    assert json.loads(capsys.readouterr().out) == [{"text": "a b", "embedding": [1, 0, 0, 0]},
                                                   {"text": "c", "embedding": [0, 1, 0, 0]}]
    with pytest.raises(SystemExit) as e:
        main(["embed", "minilm", "--bogus", "x"])
    assert e.value.code == 2
