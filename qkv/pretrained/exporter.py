"""``qkv export``: a GPT and its tokenizer to a Hugging Face folder (:mod:`qkv.pretrained.export`)
or a GGUF file (:mod:`qkv.pretrained.export_gguf`), written atomically and never over anything.

Where the output goes, as llama.cpp's converter's ``--outfile`` does: ``-o model.gguf`` is the
GGUF file itself; ``-o FOLDER`` (a name without ``.gguf``, or an existing empty folder) holds
``FOLDER/model.gguf``. A Hugging Face export is always a folder.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.fileio import atomic_write
from qkv.models.gpt import GPT
from qkv.pretrained import export as hf_export
from qkv.pretrained.export import hf_architecture, new_output_dir, publish
from qkv.pretrained.export_gguf import check_gguf, write_gguf


def gguf_target(out: str | os.PathLike[str]) -> Path | None:
    """The file ``-o`` names when it is one (``*.gguf`` and not an existing folder), else None."""
    p = Path(out)
    return p if p.name.lower().endswith(".gguf") and not p.is_dir() else None


def export_model(model: GPT, tok: Any, out: str | os.PathLike[str], fmt: str = "hf",
                 dtype: str = "f32") -> tuple[Path, str]:
    """Export a GPT and its qkv tokenizer (a run's, as ``qkv export`` opens it) to ``out``.

    Args:
        fmt: ``"hf"`` (a checkpoint folder) or ``"gguf"`` (the file ``out`` when it ends in
            ``.gguf``, else ``out``/model.gguf).
        dtype: GGUF tensor type (f32, f16, bf16, q8_0); HF folders are always float32.

    Returns:
        (what was written: the folder or the GGUF file, the architecture: gpt2 or llama; a GGUF
        also qwen2).

    Raises:
        ValueError: one line (an option with no counterpart, ``out`` already there), raised
            before anything is written.
    """
    if fmt not in ("hf", "gguf"):
        raise ValueError(f"--format must be hf or gguf, got {fmt!r}")
    model = model.float().eval()
    hf_architecture(model.cfg)  # refuse before anything is written
    if fmt == "hf" and dtype != "f32":
        raise ValueError(f"--dtype {dtype} is for --format gguf; a Hugging Face export is float32")
    if fmt == "hf" and gguf_target(out) is not None:
        raise ValueError(f"{out} names a GGUF file; a Hugging Face export is a folder: add --format gguf "
                         "or give a folder name")
    if fmt == "gguf":
        check_gguf(model, tok)
        file = gguf_target(out)
        if file is not None:
            return _write_file(file, lambda path: write_gguf(model, tok, path, dtype))
    final, tmp = new_output_dir(out)
    try:
        if fmt == "hf":
            arch = hf_export.write_hf_folder(model, tok, tmp)
        else:
            arch = write_gguf(model, tok, tmp / "model.gguf", dtype)
        return publish(tmp, final), arch
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_file(file: Path, write: Callable[[Path], str]) -> tuple[Path, str]:
    """``write(temporary path) -> architecture``, published as ``file`` atomically when complete
    (:func:`qkv.fileio.atomic_write`); never over an existing file."""
    if file.exists():
        raise ValueError(f"{file} already exists; an export does not overwrite: remove it or "
                         "choose another -o")
    arch: list[str] = []
    atomic_write(file, lambda tmp: arch.append(write(tmp)))
    return file, arch[0]
