"""Reading a GGUF file (llama.cpp's format) with the ``gguf`` package: metadata and tensors.

GGUF stores a header of typed key/value metadata (architecture sizes, the tokenizer's
vocabulary and merges, the chat template) followed by tensors, most of them block-quantised
(Q4_1: 32 weights share an fp16 scale and minimum; Q8_0: 32 int8 weights share a scale).
``gguf.quants.dequantize`` turns each block back into float32 exactly as llama.cpp does.

Every parsing failure (truncated file, wrong magic, bad offsets) becomes one
:class:`PretrainedFormatError` naming the file and the fix, never a numpy traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class PretrainedFormatError(ValueError):
    """A weights or tokenizer file is missing, truncated or not in the expected format."""


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


@dataclass
class GGUFFile:
    """Metadata (plain Python values) and the reader that holds the tensors (memory-mapped)."""

    path: Path
    metadata: dict[str, Any]
    reader: Any

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def require(self, key: str, fix: str) -> Any:
        """The value of metadata ``key``; PretrainedFormatError naming it and ``fix`` if missing."""
        if key not in self.metadata:
            raise PretrainedFormatError(f"{self.path}: metadata key {key!r} missing; {fix}")
        return self.metadata[key]

    def tensors(self) -> dict[str, np.ndarray]:
        """Every tensor dequantised to float32, in PyTorch's (out, in) row layout."""
        gguf = _gguf()
        out = {}
        for t in self.reader.tensors:
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise PretrainedFormatError(
                    f"{self.path}: tensor {t.name} is stored as {t.tensor_type.name}, a type the gguf "
                    "package cannot dequantise (pip install -U gguf, or convert the file to Q8_0/F16)"
                ) from None
            except Exception as e:
                raise PretrainedFormatError(
                    f"{self.path}: tensor {t.name} cannot be dequantised ({e}); the file is "
                    "corrupt: reinstall it"
                ) from None
            # GGUF lists dimensions innermost first; numpy wants them outermost first.
            shape = tuple(int(n) for n in reversed(t.shape))
            arr = np.asarray(arr, dtype=np.float32).reshape(shape)
            # F32 tensors come straight from the read-only memory map: copy those.
            out[t.name] = arr if arr.flags.writeable else arr.copy()
        return out


def _field_value(field: Any) -> Any:
    """A reader field as a Python value; string arrays decoded fast (100k entries)."""
    gguf = _gguf()
    types = field.types
    if types and types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types and types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


def read_gguf(path: str | os.PathLike[str], fix: str = "reinstall the file") -> GGUFFile:
    """Open a GGUF file (tensors stay memory-mapped until :meth:`GGUFFile.tensors`).

    Raises:
        PretrainedFormatError: missing, truncated or not a GGUF file; ``fix`` is appended
            to the message (e.g. the ``qkv assets install`` command).
    """
    path = Path(path)
    if not path.is_file():
        raise PretrainedFormatError(f"GGUF file not found: {path}; {fix}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise PretrainedFormatError(f"{path} is not a GGUF file (magic {magic!r}); {fix}")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(path))
        metadata = {k: _field_value(v) for k, v in reader.fields.items()}
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
        raise PretrainedFormatError(
            f"{path} is a damaged GGUF file ({type(e).__name__}: {e}); {fix}"
        ) from None
    if end > path.stat().st_size:
        raise PretrainedFormatError(
            f"{path} is truncated ({path.stat().st_size} bytes, tensors need {end}); {fix}"
        )
    return GGUFFile(path, metadata, reader)
