"""What a model name means, decided once (qkv.inference.resolve): the precedence rule, and every
entry point (qkv.load, qkv generate, qkv attend, qkv embed, the server's model list) picking the
same model for the same name and saying which, with a run folder named like a bundled model
next to it (a run trained with `--out_dir smollm2`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, call
from pretrained.asset_skip import require_asset

import qkv
from qkv.errors import UnknownModelError
from qkv.inference import ModelRef, resolve
from qkv.pipelines import CausalLM, SentenceEncoder


@pytest.fixture
def here(tiny_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ./minilm and ./smollm2: copies of a tiny GPT run."""
    for name in ("minilm", "smollm2"):
        shutil.copytree(tiny_run("gpt"), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_bundled_name_is_the_bundled_model_and_a_path_is_the_folder(here: Path) -> None:
    require_asset("minilm")
    ref = resolve("minilm")
    assert (ref.source, ref.kind, ref.label) == ("bundled", "encoder", "minilm")
    assert ref.note == "minilm is the bundled model; the folder ./minilm is not read (give ./minilm for it)"
    for spelled in ("./minilm", str(here / "minilm"), Path("minilm")):  # a path, or a Path object
        other = resolve(spelled)
        assert (other.source, other.family, other.kind, other.note) == ("run", "gpt", "decoder", None)
        assert other.path.resolve() == (here / "minilm").resolve()


def test_every_entry_point_picks_the_same_model_and_says_which(here: Path) -> None:
    """qkv.load, qkv attend, qkv embed, qkv generate and the server's list, for one name."""
    require_asset("minilm")
    enc = qkv.load("minilm")
    assert isinstance(enc, SentenceEncoder) and enc.name == "minilm" and enc.n_layers == 6
    run = qkv.load("./minilm")
    assert isinstance(run, CausalLM) and run.run_dir is not None and run.run_dir.resolve() == here / "minilm"

    note = "qkv: note: minilm is the bundled model; the folder ./minilm is not read (give ./minilm for it)"
    rc, out, err = call(["attend", "minilm", "The cat sat.", "-o", str(here / "a.png")])
    assert rc == 0 and note in err and "6 layers x 12 heads" in out  # MiniLM's, not the run's 2 x 4
    rc, out, err = call(["attend", "./minilm", "ROMEO", "-o", str(here / "b.png")])
    assert rc == 0 and "qkv: note" not in err and "2 layers x 4 heads" in out
    rc, out, err = call(["embed", "minilm", "a cat", "--json"])
    assert rc == 0 and note in err
    rc, _, err = call(["embed", "./minilm", "a cat"])
    assert "is a decoder (a language model), not a sentence encoder" in assert_one_line_error(rc, err)
    rc, _, err = call(["generate", "minilm", "--prompt", "hi"])  # the bundled encoder: no text out
    assert "minilm is the bundled all-MiniLM-L6-v2" in err and "not a language model" in err
    rc, out, err = call(["generate", "./minilm", "--prompt", "ROMEO", "--max-new-tokens", "3",
                         "--temperature", "0"])
    assert rc == 0 and out.startswith("ROMEO") and "[./minilm: loaded in" in err

    from qkv.serve.registry import Registry

    runs = here / "runs"
    runs.mkdir()
    shutil.copytree(here / "minilm", runs / "minilm")
    reg = Registry(runs)
    listed = {e.id: e for e in reg.entries()}
    assert (listed["minilm"].family, listed["minilm"].kind) == ("minilm", "encoder")
    assert (listed["runs/minilm"].family, listed["runs/minilm"].kind) == ("gpt", "decoder")
    assert listed["runs/minilm"].description == "gpt run minilm"
    assert reg.resolve("minilm").source == "bundled" and reg.resolve("minilm").note is None
    assert reg.resolve("runs/minilm").family == "gpt"


def test_smollm2_named_or_as_a_folder(here: Path) -> None:
    """`qkv generate smollm2` is SmolLM2 with a note, `qkv generate ./smollm2` the run."""
    require_asset("smollm2")
    rc, out, err = call(["generate", "smollm2", "--prompt", "Once upon a time", "--max-new-tokens", "2",
                         "--temperature", "0"])
    assert rc == 0 and "the folder ./smollm2 is not read" in err and "[smollm2: loaded in" in err
    assert out.startswith("Once upon a time")
    rc, out, err = call(["generate", "./smollm2", "--prompt", "ROMEO", "--max-new-tokens", "2",
                         "--temperature", "0"])
    assert rc == 0 and "not read" not in err and "weights fp32" in err  # a run decodes in fp32


def test_what_each_kind_of_path_resolves_to(tiny_run, tmp_path: Path) -> None:
    from qkv.pretrained import PretrainedFormatError

    gguf = tmp_path / "m.GGUF"
    gguf.write_bytes(b"GGUF")  # resolving reads nothing of it; its kind is in its (damaged) header
    assert resolve(gguf).source == "gguf"
    with pytest.raises(PretrainedFormatError, match=r"m\.GGUF"):
        _ = resolve(gguf).kind
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "bert"}')
    assert (resolve(hf).source, resolve(hf).kind, resolve(hf).label) == ("hf", "encoder", "hf-encoder")
    (hf / "config.json").write_text('{"model_type": "llama"}')
    assert (resolve(hf).kind, resolve(hf).label) == ("decoder", "hf-decoder")
    kinds = {"gpt": "decoder", "vit": "image", "seq2seq": "seq2seq", "captioner": "image"}
    for family, kind in kinds.items():
        ref = resolve(tiny_run(family))
        assert (ref.source, ref.family, ref.kind) == ("run", family, kind)
        assert ref.weights_file == tiny_run(family) / "model.safetensors"


def test_what_is_not_a_model_is_one_line(tmp_path: Path) -> None:
    from qkv.pretrained import PretrainedFormatError
    from qkv.training.checkpoint import CheckpointError

    with pytest.raises(UnknownModelError, match="'nowhere' is neither a pretrained model"):
        resolve("nowhere")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UnknownModelError, match=r"a file without the \.gguf suffix"):
        resolve(tmp_path / "notes.txt")
    with pytest.raises(PretrainedFormatError, match=r"config\.json is missing"):
        resolve(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        resolve(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(PretrainedFormatError, match="not a JSON object"):
        resolve(tmp_path)
    (tmp_path / "config.json").write_text('{"family": "nonsense"}')
    with pytest.raises(PretrainedFormatError, match="family 'nonsense', which this qkv does not know"):
        resolve(tmp_path)
    (tmp_path / "config.json").write_text('{"dim": 3}')
    with pytest.raises(PretrainedFormatError, match="neither a qkv family nor a Hugging Face model_type"):
        resolve(tmp_path)


def test_the_key_is_the_file_not_the_name(tiny_run, tmp_path: Path) -> None:
    """Two names of one run share a key; retraining (new weights) changes it; a copy elsewhere
    has its own."""
    run = tiny_run("gpt")
    a, b = resolve(run), resolve(Path(os.path.relpath(run)))
    assert a.name != b.name and a.key == b.key
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert resolve(copy).key != a.key
    st = (copy / "model.safetensors").stat()
    before = resolve(copy).key
    os.utime(copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert resolve(copy).key != before
    assert isinstance(a, ModelRef) and a.key[:2] == ("run", str((run / "model.safetensors").resolve()))
