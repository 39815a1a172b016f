"""What a model name means, decided in one place: ``resolve(name_or_path) -> ModelRef``.

The precedence rule (the same for ``qkv.load``, every command, the server and the pictures):

1. **A bundled name** (``minilm``, ``smollm2``), given as a string, always means the bundled
   model from its installed asset, never a file or folder of that name. To open a folder that
   happens to be called ``smollm2`` (a run trained with ``--out_dir smollm2``), write it as a
   path: ``./smollm2``. When such a folder exists, the reference carries a note saying so.
2. **Anything else is a path**, read by what it holds:
   - a ``.gguf`` file: llama.cpp's format, built by its ``general.architecture``;
   - a folder whose ``config.json`` names a qkv ``family``: a run directory of ``qkv train``;
   - a folder whose ``config.json`` has a ``model_type``: a Hugging Face checkpoint folder.
   Anything else is one line saying which of these it fails to be.

Resolving reads at most one small config.json; nothing is loaded. A reference knows its
``kind`` (what it reads and shows) and the ``key`` of its weights' file (path, size,
modification time): caches of loaded models are keyed by the file, never by a name.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qkv.errors import UnknownModelError
from qkv.pipelines.kinds import Kind

Source = Literal["bundled", "run", "gguf", "hf"]
BUNDLED_KINDS: dict[str, Kind] = {"minilm": "encoder", "smollm2": "decoder"}


def bundled_names() -> tuple[str, ...]:
    from qkv.pretrained import PRETRAINED

    return tuple(PRETRAINED)


@dataclass(frozen=True)
class ModelRef:
    """A model, named and located, not loaded.

    name: as the user gave it (messages use it). source: where it comes from. path: the asset,
    file or folder holding it. family: a run's family (``gpt``, ``vit``, ...); None otherwise.
    note: what the user may not expect (a folder of a bundled model's name, not read).
    """

    name: str
    source: Source
    path: Path
    family: str | None = None
    note: str | None = None

    @property
    def kind(self) -> Kind:
        """What the model reads and shows; a GGUF's is read from its metadata (remembered per
        file version; PretrainedFormatError for an architecture qkv does not read)."""
        if self.source == "bundled":
            return BUNDLED_KINDS[self.name]
        if self.source == "run":
            from qkv.families import get_family

            return get_family(str(self.family)).kind
        if self.source == "gguf":
            from qkv.pretrained.gguf_models import GGUF_ENCODERS

            return "encoder" if gguf_architecture(self.path) in GGUF_ENCODERS else "decoder"
        from qkv.pretrained.hf import hf_model_type

        return "encoder" if hf_model_type(self.path) == "bert" else "decoder"

    @property
    def label(self) -> str:
        """The short name of what it is: the bundled model's name, the run's family, or
        ``gguf``/``gguf-encoder``/``hf-decoder``/``hf-encoder`` (the server lists these)."""
        if self.source == "bundled":
            return self.name
        if self.source == "run":
            return str(self.family)
        return f"{self.source}-encoder" if self.kind == "encoder" else \
            ("gguf" if self.source == "gguf" else "hf-decoder")

    @property
    def description(self) -> str:
        """One phrase for lists and messages: "a gpt run", "a Hugging Face checkpoint (llama)"..."""
        if self.source == "bundled":
            from qkv.pretrained import PRETRAINED

            return f"the bundled {PRETRAINED[self.name]}"
        if self.source == "run":
            return f"a {self.family} run of `qkv train`"
        what = "GGUF file" if self.source == "gguf" else "Hugging Face checkpoint folder"
        return f"a {what} ({'an encoder' if self.kind == 'encoder' else 'a decoder'})"

    @property
    def weights_file(self) -> Path:
        """The file whose change means the model changed (a run's best weights, a GGUF, a
        folder's config)."""
        if self.source == "run":
            return self.path / "model.safetensors"
        if self.source == "hf":
            return self.path / "config.json"
        return self.path

    @property
    def key(self) -> tuple[str, str, int, int]:
        """(source, resolved path, size, modification time in ns) of :attr:`weights_file`: what
        a cache of loaded models is keyed by. A file that vanished keys as size and time -1."""
        f = self.weights_file
        try:
            st = f.stat()
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:
            size = mtime = -1
        return self.source, str(f.resolve()), size, mtime


def resolve(name_or_path: str | os.PathLike[str]) -> ModelRef:
    """What ``name_or_path`` means, by the precedence rule of this module's docstring.

    Raises:
        UnknownModelError: neither a bundled name nor a path to a model.
        AssetMissingError: a bundled model that is not installed (names the command).
        CheckpointError / PretrainedFormatError: a folder whose config.json is missing,
            damaged, or names something qkv does not read.
    """
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and text in bundled_names():
        from qkv.assets import asset_path

        note = None
        if Path(text).exists():
            note = (f"{text} is the bundled model; the {'folder' if Path(text).is_dir() else 'file'} "
                    f"./{text} is not read (give ./{text} for it)")
        return ModelRef(text, "bundled", Path(asset_path(text)), note=note)
    path = Path(text)
    if path.is_file() and path.name.lower().endswith(".gguf"):
        return ModelRef(text, "gguf", path)
    if not path.is_dir():
        why = (f"{text} is a file without the .gguf suffix, not a directory" if path.is_file()
               else "nothing is at that path: it is not a folder or a file, so not a directory of a run")
        raise UnknownModelError(
            f"{text!r} is neither a pretrained model ({', '.join(bundled_names())}) nor a run directory "
            f"from `qkv train`, a Hugging Face checkpoint folder or a .gguf file ({why})")
    return _folder(text, path)


def _folder(text: str, path: Path) -> ModelRef:
    """A folder by its config.json: a qkv run (``family``) or a Hugging Face checkpoint
    (``model_type``); one line for anything else."""
    from qkv.families import family_names
    from qkv.pretrained import PretrainedFormatError
    from qkv.training import checkpoint as ckpt

    if not (path / "config.json").is_file():
        raise PretrainedFormatError(f"{path}/config.json is missing: with no config.json, {path} is neither "
                                    "a run directory of `qkv train` nor a Hugging Face checkpoint folder")
    config = ckpt.read_json(path / "config.json")  # names a damaged config.json
    if not isinstance(config, dict):
        raise PretrainedFormatError(f"{path}/config.json is not a JSON object")
    if "family" in config:
        if config["family"] not in family_names():
            raise PretrainedFormatError(f"{path} is a run of family {config['family']!r}, which this qkv "
                                        f"does not know (known: {', '.join(family_names())})")
        return ModelRef(text, "run", path, family=str(config["family"]))
    if isinstance(config.get("model_type"), str):
        return ModelRef(text, "hf", path)
    raise PretrainedFormatError(f"{path}/config.json names neither a qkv family nor a Hugging Face "
                                "model_type: give a run directory from `qkv train`, a Hugging Face "
                                "checkpoint folder or a .gguf file")


def gguf_architecture(path: Path) -> str:
    """A GGUF file's ``general.architecture``, checked to be one qkv reads (PretrainedFormatError
    naming the supported ones, or the damage, otherwise). Remembered per file version: reading a
    file's metadata takes seconds for a large vocabulary, and the server asks on every model list."""
    st = Path(path).stat()
    return _gguf_architecture(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _gguf_architecture(path: str, size: int, mtime_ns: int) -> str:
    from qkv.pretrained.gguf_file import read_gguf
    from qkv.pretrained.gguf_models import check_architecture

    return check_architecture(path, read_gguf(path).metadata.get("general.architecture"))
