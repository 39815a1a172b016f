"""What crosses between the grader and the child that runs a student's function: values as data.

A message is ``len(header)`` (8 bytes, big-endian) + a JSON header + the raw bytes of its
tensors, one after another. The header holds the value's structure (lists, tuples, dicts with
string keys, numbers, strings, booleans, None; ``{"__t": i}`` for the i-th tensor) and each
tensor's dtype, shape and byte count. Reading one runs no code (no pickle, no ``eval``): it
checks every size against the bytes received and ``MAX_BYTES``, takes dtypes from a fixed table
and refuses anything else with :class:`WireError`.

This module imports only the standard library and torch: the child (:mod:`qkv.learn.child`),
which must not import qkv, runs it from its source text (``child.py`` carries a copy of this
file's functions by reading this file; see :func:`qkv.learn.child.program`).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

MAX_BYTES = 256 << 20  # one message, header and tensors
MAX_HEADER = 8 << 20
MAX_DEPTH = 32

DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "complex64": torch.complex64, "complex128": torch.complex128,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


class WireError(Exception):
    """A value that cannot cross (a type with no data form) or a message that is not one."""


def _pack(value: Any, tensors: list[torch.Tensor], depth: int = 0, functions: list | None = None) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested more than {MAX_DEPTH} deep")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__f": repr(value)}
    if isinstance(value, complex):
        return {"__c": [_pack(value.real, tensors), _pack(value.imag, tensors)]}
    if isinstance(value, torch.Generator):  # by its state; the grader takes the new state back
        return {"__gen": _pack(value.get_state(), tensors)}
    if isinstance(value, torch.Tensor):
        if value.dtype not in NAMES:
            raise WireError(f"a tensor of dtype {value.dtype}")
        if value.layout != torch.strided:
            raise WireError(f"a {value.layout} tensor (only dense tensors)")
        tensors.append(value.detach().to("cpu").contiguous())
        return {"__t": len(tensors) - 1}
    if isinstance(value, torch.dtype):
        if value not in NAMES:
            raise WireError(f"the dtype {value}")
        return {"__dtype": NAMES[value]}
    if isinstance(value, torch.Size):
        return {"__size": list(value)}
    if isinstance(value, tuple):
        return {"__tuple": [_pack(v, tensors, depth + 1, functions) for v in value]}
    if isinstance(value, list):
        return [_pack(v, tensors, depth + 1, functions) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise WireError("a dict whose keys are not all strings")
        return {"__dict": {k: _pack(v, tensors, depth + 1, functions) for k, v in value.items()}}
    if hasattr(value, "item") and hasattr(value, "dtype"):  # a NumPy scalar
        return _pack(value.item(), tensors, depth)
    if functions is not None and callable(value) and not isinstance(value, type):
        functions.append(value)  # called back: the function stays here, the child gets a stub
        return {"__fn": len(functions) - 1}
    raise WireError(f"a value of type {type(value).__name__}")


def encode(value: Any, functions: list | None = None) -> bytes:
    """``value`` (tensors, numbers, strings, None, generators (by their state), and lists /
    tuples / string-keyed dicts of them) as one message; with ``functions`` (a list), a callable
    is appended to it and sent as its index (the receiver calls back); WireError for anything else."""
    tensors: list[torch.Tensor] = []
    structure = _pack(value, tensors, 0, functions)
    blobs = [t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors]
    table = [{"dtype": NAMES[t.dtype], "shape": list(t.shape), "nbytes": len(b)}
             for t, b in zip(tensors, blobs, strict=True)]
    header = json.dumps({"v": structure, "t": table}, allow_nan=False).encode()
    total = 8 + len(header) + sum(len(b) for b in blobs)
    if total > MAX_BYTES:
        raise WireError(f"a value of {total:,} bytes (at most {MAX_BYTES:,})")
    return struct.pack(">Q", len(header)) + header + b"".join(blobs)


def _tensor(spec: Any, blob: memoryview) -> torch.Tensor:
    if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
        raise WireError("a tensor of an unknown dtype")
    shape = spec.get("shape")
    if not isinstance(shape, list) or len(shape) > 16 or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_BYTES for n in shape):
        raise WireError("a tensor with a bad shape")
    dtype = DTYPES[spec["dtype"]]
    numel = math.prod(shape)
    if numel * torch.empty((), dtype=dtype).element_size() != len(blob):
        raise WireError("a tensor whose bytes do not match its shape")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dtype).reshape(shape)


def _unpack(node: Any, tensors: list[torch.Tensor], depth: int = 0, stub: Any = None) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested more than {MAX_DEPTH} deep")
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, list):
        return [_unpack(v, tensors, depth + 1, stub) for v in node]
    if isinstance(node, dict) and len(node) == 1:
        (tag, inner), = node.items()
        if tag == "__t" and isinstance(inner, int) and 0 <= inner < len(tensors):
            return tensors[inner]
        if tag == "__f" and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if tag == "__c" and isinstance(inner, list) and len(inner) == 2:
            return complex(_unpack(inner[0], tensors), _unpack(inner[1], tensors))
        if tag == "__dtype" and inner in DTYPES:
            return DTYPES[inner]
        if tag == "__size" and isinstance(inner, list) and all(isinstance(n, int) for n in inner):
            return torch.Size(inner)
        if tag == "__tuple" and isinstance(inner, list):
            return tuple(_unpack(v, tensors, depth + 1, stub) for v in inner)
        if tag == "__gen" and isinstance(inner, dict):
            state = _unpack(inner, tensors)
            if isinstance(state, torch.Tensor) and state.dtype == torch.uint8:
                return torch.Generator().set_state(state)
        if tag == "__fn" and isinstance(inner, int) and stub is not None:
            return stub(inner)
        if tag == "__dict" and isinstance(inner, dict):
            return {str(k): _unpack(v, tensors, depth + 1, stub) for k, v in inner.items()}
    raise WireError("a value the wire format does not have")


def decode(data: bytes, stub: Any = None) -> Any:
    """The value of one message (see the module doc); ``stub(i)``: what stands for the sender's
    i-th function (none: a function is refused); WireError for anything malformed."""
    if len(data) < 8 or len(data) > MAX_BYTES:
        raise WireError("a message of a bad size")
    (n,) = struct.unpack(">Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise WireError("a message whose header does not fit")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise WireError("a message whose header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), list):
        raise WireError("a message without its tensor table")
    view, at, tensors = memoryview(data), 8 + n, []
    for spec in header["t"]:
        size = spec.get("nbytes") if isinstance(spec, dict) else None
        if not isinstance(size, int) or size < 0 or at + size > len(data):
            raise WireError("a tensor whose bytes are missing")
        tensors.append(_tensor(spec, view[at:at + size]))
        at += size
    if at != len(data):
        raise WireError("a message with bytes left over")
    return _unpack(header.get("v"), tensors, 0, stub)


def leaves(value: Any, kind: type) -> list:
    """The values of type ``kind`` (tensors, generators) nested in the lists, tuples and dicts
    of ``value``, in order: the order both sides of the wire list them in."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, list | tuple):
        return [x for v in value for x in leaves(v, kind)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaves(v, kind)]
    return []
