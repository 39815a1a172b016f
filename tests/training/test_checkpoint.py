"""Run-directory files: atomic writes, exact safetensors round trips (tied weights too),
damaged files as CheckpointError, and no unpickling of arbitrary objects."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import snapshot
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


# --------------------------------------------------------------------------- the resume set


def _state(step: int) -> dict:
    return {"step": step, "best_val": 1.0 / (step + 1), "torch_rng": torch.get_rng_state()}


def test_the_resume_set_is_published_whole(tmp_path: Path) -> None:
    """Two saves: checkpoint/ holds the second's weights and state, tagged with one save id,
    no temporary folder stays, and loading gives back the second model's tensors exactly."""
    a, b = gpt(0), gpt(1)
    ckpt.save_resume(tmp_path, a, _state(2))
    ckpt.save_resume(tmp_path, b, _state(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["last.safetensors", "optimizer.pt"]
    c = gpt(2)
    state = ckpt.load_resume(tmp_path, c)
    assert state["step"] == 4 and state["best_val"] == 1.0 / 5
    for (name, x), y in zip(b.state_dict().items(), c.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    meta = ckpt.weights_metadata(tmp_path / "checkpoint" / "last.safetensors")
    assert meta["step"] == "4" and meta["save_id"] == state["save_id"] and len(meta["save_id"]) == 32


@pytest.mark.parametrize("crash", ["writing the new set", "after the old set moved aside",
                                   "before the old set was deleted"])
def test_a_crash_at_any_instant_of_the_swap_leaves_one_complete_set(tmp_path: Path, crash: str) -> None:
    """The folders a crash can leave, rebuilt by hand (the renames save_resume does, stopped
    part-way); resume_dir finds a complete set every time: the new one once it was complete,
    else the old one, never a mix."""
    ckpt.save_resume(tmp_path, gpt(0), _state(2))
    old = snapshot(tmp_path / "checkpoint")
    side = tmp_path / "side"
    ckpt.save_resume(side, gpt(1), _state(4))
    new = snapshot(side / "checkpoint")
    if crash == "writing the new set":  # half of .checkpoint.new written
        (tmp_path / ".checkpoint.new").mkdir()
        (tmp_path / ".checkpoint.new" / "last.safetensors").write_bytes(new["last.safetensors"][:100])
        want = old
    elif crash == "after the old set moved aside":  # checkpoint -> .old done, .ready -> checkpoint not
        os.rename(tmp_path / "checkpoint", tmp_path / ".checkpoint.old")
        os.rename(side / "checkpoint", tmp_path / ".checkpoint.ready")
        want = new
    else:  # the swap done, the old set still there
        os.rename(tmp_path / "checkpoint", tmp_path / ".checkpoint.old")
        os.rename(side / "checkpoint", tmp_path / "checkpoint")
        want = new
    folder = ckpt.resume_dir(tmp_path)
    assert folder == tmp_path / "checkpoint" and snapshot(folder) == want
    model = gpt(3)
    assert ckpt.load_resume(tmp_path, model)["step"] == (2 if want is old else 4)
    ckpt.save_resume(tmp_path, gpt(5), _state(6))  # the next save cleans up after the crash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "side"]


def test_a_run_that_never_saved_cannot_resume(tmp_path: Path) -> None:
    (tmp_path / ".checkpoint.new").mkdir()  # the first save was cut short
    with pytest.raises(CheckpointError, match="stopped before its first save") as e:
        ckpt.load_resume(tmp_path, gpt(0))
    assert "\n" not in str(e.value)


def test_a_set_mixed_from_two_saves_is_refused(tmp_path: Path) -> None:
    ckpt.save_resume(tmp_path, gpt(0), _state(2))
    first = (tmp_path / "checkpoint" / "optimizer.pt").read_bytes()
    ckpt.save_resume(tmp_path, gpt(1), _state(4))
    (tmp_path / "checkpoint" / "optimizer.pt").write_bytes(first)  # step 2's state beside step 4's weights
    with pytest.raises(CheckpointError, match=r"\(step 4\) and optimizer.pt \(step 2\) are not from"):
        ckpt.load_resume(tmp_path, gpt(0))


def test_runs_written_before_the_transaction_still_resume(tmp_path: Path) -> None:
    """The old layout (last.safetensors + optimizer.pt on top, no save id) loads; the next
    save moves it into checkpoint/."""
    model = gpt(0)
    ckpt.save_weights(model, tmp_path / "last.safetensors")
    ckpt.save_state(tmp_path / "optimizer.pt", _state(3))
    assert ckpt.load_resume(tmp_path, gpt(1))["step"] == 3
    ckpt.save_resume(tmp_path, model, _state(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_files_honour_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        path = tmp_path / "m.safetensors"
        ckpt.save_weights(gpt(0), path)
        ckpt.write_json(tmp_path / "c.json", {"a": 1})
    finally:
        os.umask(old)
    for p in (path, tmp_path / "c.json"):
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p


def test_append_jsonl_writes_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    ckpt.append_jsonl(path, {"step": 1, "train_loss": float("nan"), "val_loss": float("inf"), "lr": 0.5})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c)) == {
        "step": 1, "train_loss": None, "val_loss": None, "lr": 0.5}


@pytest.mark.parametrize("evaluates_first", [True, False])
def test_rewind_metrics_drops_what_the_resumed_run_writes_again(tmp_path: Path,
                                                                evaluates_first: bool) -> None:
    rows = [{"step": 0, "val_loss": 3.0}, {"step": 1, "train_loss": 2.9}, {"step": 2, "train_loss": 2.8},
            {"step": 2, "val_loss": 2.7}, {"step": 3, "train_loss": 2.6}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "tra', encoding="utf-8")
    ckpt.rewind_metrics(path, 2, evaluates_first)
    back = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert back == rows[:3] + ([] if evaluates_first else [rows[3]])
