"""The one small protocol every qkv tokenizer follows, and its JSON file format.

A tokenizer maps text to integer ids and back. Each one serializes to a plain dict with a
``"type"`` field (``"char"``, ``"bpe"``, ``"hf"``), saved as ``tokenizer.json`` in a run directory
(DESIGN.md, "Checkpoints"): loading reads JSON only, never a pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from qkv.fileio import atomic_write


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> ids. ``decode(encode(text)) == text`` for every text the tokenizer accepts."""

    def encode(self, text: str) -> list[int]:
        """Ids (each in ``[0, vocab_size)``) of ``text``."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids: the width of a model's embedding and output layers."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with a ``"type"`` field; ``load_tokenizer`` rebuilds from it."""
        ...


def _registry() -> dict[str, Callable[[dict[str, Any]], Tokenizer]]:
    # Imported here: char.py, bpe.py and hf.py import this module.
    from qkv.tokenizers.bpe import BPETokenizer
    from qkv.tokenizers.char import CharTokenizer
    from qkv.tokenizers.hf import HFTokenizer

    return {"char": CharTokenizer.from_dict, "bpe": BPETokenizer.from_dict,
            "hf": HFTokenizer.from_dict}


def tokenizer_json(tok: Tokenizer) -> str:
    """The canonical JSON text of a tokenizer (sorted keys): what is saved, and what cache
    keys hash, so equal tokenizers give byte-equal JSON."""
    return json.dumps(tok.to_dict(), sort_keys=True, ensure_ascii=False)


def tokenizer_from_dict(data: Any, source: str = "tokenizer dict") -> Tokenizer:
    """Rebuild a tokenizer from ``to_dict()`` output, dispatching on its ``"type"``.

    Raises:
        ValueError: not a dict, no/unknown ``"type"``, or fields the tokenizer rejects.
    """
    registry = _registry()
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(
            f"{source} is not a qkv tokenizer (expected a JSON object with a \"type\" field "
            f"among {sorted(registry)}); save one with qkv.tokenizers.save_tokenizer"
        )
    kind = data["type"]
    if kind not in registry:
        raise ValueError(
            f"{source} has unknown tokenizer type {kind!r}; known types: {sorted(registry)}"
        )
    try:
        return registry[kind](data)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source} is a corrupt {kind!r} tokenizer ({e!r})") from e


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike[str]) -> Path:
    """Write ``tok`` as JSON, atomically (temp file in the same folder, then ``os.replace``),
    so a crash never leaves a half-written file where a good one was. Returns the path."""
    path = Path(path)
    text = tokenizer_json(tok)
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Read a tokenizer saved by ``save_tokenizer``.

    Raises:
        ValueError: missing file, not UTF-8 JSON, or not a known tokenizer (message says which).
    """
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"tokenizer file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read tokenizer file {path}: {e}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"tokenizer file {path} is corrupt: not valid JSON ({e.msg} at line {e.lineno}, "
            f"column {e.colno}); re-save it from the tokenizer or retrain"
        ) from None
    return tokenizer_from_dict(data, source=f"tokenizer file {path}")
