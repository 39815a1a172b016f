"""Run-directory files: atomic writes, exact safetensors round trips (tied weights too),
damaged files as CheckpointError, and no unpickling of arbitrary objects."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qkv.models.gpt import GPT, GPTConfig
from qkv.training import checkpoint as ckpt
from qkv.training.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def gpt(seed: int, **kw) -> GPT:
    torch.manual_seed(seed)
    base = dict(vocab_size=30, max_seq_len=12, dim=16, n_layers=2, n_heads=2)
    return GPT(GPTConfig(**{**base, **kw}))


class Payload:
    """An arbitrary class: pickle can rebuild it, ``weights_only`` loading must not."""

    def __init__(self) -> None:
        self.value = 3


class Exploit:
    """A pickle that would run a command when loaded by an unrestricted unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --------------------------------------------------------------------------- atomic_write


def test_atomic_write_replaces(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.txt"  # parent created on demand
    ckpt.atomic_write(path, lambda p: p.write_text("one"))
    ckpt.atomic_write(path, lambda p: p.write_text("two"))
    assert path.read_text() == "two"
    assert sorted(os.listdir(path.parent)) == ["f.txt"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path: Path, error) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"good old bytes")
    seen = []

    def half_write(p: Path) -> None:
        seen.append(p)
        assert p.parent == path.parent and p != path  # a temporary name beside it
        p.write_bytes(b"half")
        raise error("disk full")

    with pytest.raises(error):
        ckpt.atomic_write(path, half_write)
    assert path.read_bytes() == b"good old bytes"
    assert os.listdir(tmp_path) == ["model.safetensors"]  # the temporary file is gone
    assert not seen[0].exists()


def test_write_json_and_read_json(tmp_path: Path) -> None:
    obj = {"a": [1, 2.5, None], "b": {"c": "é"}}
    ckpt.write_json(tmp_path / "config.json", obj)
    assert ckpt.read_json(tmp_path / "config.json") == obj
    assert json.loads((tmp_path / "config.json").read_text(encoding="utf-8")) == obj


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe\x00garbage", b'{"a": 1'])
def test_read_json_garbage(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        ckpt.read_json(path)


def test_read_json_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.read_json(tmp_path / "config.json")


def test_append_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    ckpt.append_jsonl(path, {"step": 1, "loss": 2.5})
    ckpt.append_jsonl(path, {"step": 2, "loss": None})
    lines = path.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": None}]


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("tie", [True, False])
def test_weights_round_trip_exactly(tmp_path: Path, tie: bool) -> None:
    src, dst = gpt(0, tie_embeddings=tie), gpt(1, tie_embeddings=tie)
    assert not torch.equal(src.tok_emb.weight, dst.tok_emb.weight)
    ckpt.save_weights(src, tmp_path / "model.safetensors")
    ckpt.load_weights(dst, tmp_path / "model.safetensors")
    a, b = src.state_dict(), dst.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (dst.lm_head.weight is dst.tok_emb.weight) == tie  # loading keeps the tie as it was
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    stored = {"tok_emb.weight", "lm_head.weight"} & keys
    assert len(stored) == (1 if tie else 2)  # a tied matrix is stored once
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_loaded_tied_model_stays_tied_in_training(tmp_path: Path) -> None:
    src, dst = gpt(0), gpt(1)
    ckpt.save_weights(src, tmp_path / "m.safetensors")
    ckpt.load_weights(dst, tmp_path / "m.safetensors")
    with torch.no_grad():
        dst.tok_emb.weight[0, 0] += 1.0
    assert dst.lm_head.weight[0, 0] == dst.tok_emb.weight[0, 0]


@pytest.mark.parametrize("keep", [0, 7, 100, -10])
def test_truncated_weights_are_a_checkpoint_error(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "model.safetensors"
    ckpt.save_weights(gpt(0), path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])  # the first bytes, or all but the last 10
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as info:
        ckpt.load_weights(gpt(1), path)
    assert "\n" not in str(info.value)


def test_weights_of_another_config_are_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    ckpt.save_weights(gpt(0, dim=16), path)
    with pytest.raises(CheckpointError, match="different model config"):
        ckpt.load_weights(gpt(0, dim=32, n_heads=4), path)
    with pytest.raises(CheckpointError):
        ckpt.load_weights(gpt(0, n_layers=3), path)  # missing keys (strict)


def test_missing_weights(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.load_weights(gpt(0), tmp_path / "model.safetensors")


# --------------------------------------------------------------------------- resume state


def test_state_round_trip(tmp_path: Path) -> None:
    m = gpt(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    gen = torch.Generator().manual_seed(5)
    state = {"optimizer": opt.state_dict(), "step": 7, "best_val": 1.25,
             "torch_rng": torch.get_rng_state(), "data_rng": gen.get_state()}
    ckpt.save_state(tmp_path / "optimizer.pt", state)
    back = ckpt.load_state(tmp_path / "optimizer.pt")
    assert back["step"] == 7 and back["best_val"] == 1.25
    assert torch.equal(back["data_rng"], gen.get_state())
    opt2 = torch.optim.AdamW(gpt(1).parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        assert all(torch.equal(torch.as_tensor(s1[k][n]), torch.as_tensor(s2[k][n])) for n in s1[k])


def test_load_state_refuses_arbitrary_objects(tmp_path: Path) -> None:
    path = tmp_path / "optimizer.pt"
    torch.save({"step": 1, "thing": Payload()}, path)
    assert torch.load(path, weights_only=False)["thing"].value == 3  # a plain load would accept
    with pytest.raises(CheckpointError, match=r"optimizer\.pt"):
        ckpt.load_state(path)


def test_load_state_never_runs_pickled_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "optimizer.pt"
    torch.save({"step": Exploit(marker)}, path)
    with pytest.raises(CheckpointError):
        ckpt.load_state(path)
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"garbage bytes", b"PK\x03\x04truncated zip"])
def test_load_state_damaged_or_missing(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "optimizer.pt"
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.load_state(path)
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="damaged"):
        ckpt.load_state(path)
