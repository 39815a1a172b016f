"""qkv's own CPU kernels, compiled on first use for the CPU they run on.

``qmatmul.cpp``: the quantised matrix products of decoding, with activations rounded to int8
twice per group of 32 (a code and its residual) and integer dot products (AVX512-VNNI, else
AVX2, else plain C++; on an AMX Xeon, 4-bit products of 12 rows and more on AMX tiles, the same
integers): ``qkv::int4_mm`` (4-bit groups, GGUF's Q4_0/Q4_1) and ``qkv::q8_mm``
(8-bit groups, GGUF's Q8_0). PyTorch's own kernels widen each weight to a float and are bound
by that arithmetic on one token; these read the same bytes faster (BENCHMARKS.md). The same
library holds ``torch.classes.qkv.Decoder``: a Llama-shaped decoder's whole one-token step on
those products, bound to a model by :mod:`qkv.generation.native_step`, and the choice of the next
token from a row of logits: ``qkv::argmax_rows`` (greedy) and ``qkv::sample_rows`` (temperature,
top-k, top-p and the draw in one call; :func:`argmax_op`, :func:`sample_op`).
:func:`int4_op` builds the library once per machine (``g++ -O3 -march=native``, 10-14 s on 2
cores) into ``<cache>/kernels``, keyed by the CPU, the compiler, torch's version and the source, and loads
it into the process (``torch.ops.load_library``); :class:`~qkv.layers.quant.Int4Linear` and
:class:`~qkv.layers.quant.Q8Linear` (a decoder's output head) use it where it loaded.

``QKV_INT4_KERNEL=off`` (or ``QKV_CACHE_DIR=off``, or no compiler) keeps PyTorch's kernel;
:func:`int4_status` says which is in use and why.

Shapes: :func:`pack_int4` turns codes q (N, K) in 0..15 and per-group d, m (N, K/32) —
``w = d·q + m`` — into the kernel's layout, w (N/16, K/32, 4, 64) uint8 and dm
(N/16, K/32, 2, 16) float16; ``torch.ops.qkv.int4_mm(x (M, K), w, dm) -> (M, N)`` float32.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.native import NativeError, build_once, compiler, cpu_identity, cxx, private_folder, run_owned, sha256

SOURCE = Path(__file__).with_name("qmatmul.cpp")
LIBRARY = "qmatmul.so"
META = "qmatmul.json"
GROUP, ROWS = 32, 16

_state: dict[str, Any] = {"op": None, "status": None}
_lock = threading.Lock()


def enabled() -> bool:
    """The kernel is wanted unless ``QKV_INT4_KERNEL=off``."""
    return os.environ.get("QKV_INT4_KERNEL", "").lower() not in ("off", "0", "false")


def _key(flags: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    info = {"source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(), "cpu": cpu_identity(),
            "compiler": compiler(), "torch": torch.__version__, "torch_git": torch.version.git_version,
            "flags": list(flags)}
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:32], info


def compile_library(out: Path, flags: tuple[str, ...] = ("-march=native",), namespace: str = "qkv",
                    source: Path | None = None) -> None:
    """Compile ``qmatmul.cpp`` (or another version of it, ``source``) into the shared library
    ``out`` (NativeError with the compiler's last lines if it fails). ``namespace``: the ops'
    namespace (``torch.ops.<namespace>``)."""
    path = cxx()
    if path is None or compiler() is None:
        raise NativeError("no C++ compiler found (c++ or g++)")
    from torch.utils import cpp_extension

    cmd = [path, "-O3", *flags, "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-DQKV_NAMESPACE={namespace}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], str(source or SOURCE), "-o", str(out),
           *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu"]
    try:
        # never outlives this process; its temporary files in the build's own folder, which the
        # next build removes if this one is killed
        r = run_owned(cmd, timeout=300, scratch=out.parent)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeError(f"the compiler did not run: {e}") from None
    if r.returncode != 0:
        tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[:300]
        raise NativeError(f"the compiler failed ({r.returncode}): {tail}")


def build() -> Path:
    """The kernel's library for this machine, compiled unless a valid one is saved (its SHA-256
    checked); returns its path. Two processes at once: one compiles, the other waits for it."""
    flags = ("-march=native",)
    key, info = _key(flags)

    def valid(folder: Path) -> bool:
        try:
            meta = json.loads((folder / META).read_text())
            same = meta.get("info") == json.loads(json.dumps(info))
            return same and sha256(folder / LIBRARY) == meta.get("sha256")
        except (OSError, ValueError):
            return False

    def make(tmp: Path) -> dict[str, Any]:
        compile_library(tmp / LIBRARY, flags)
        return {"key": key, "info": info, "sha256": sha256(tmp / LIBRARY)}

    return build_once(private_folder("kernels"), key, META, valid, make) / LIBRARY


def int4_op() -> Any | None:
    """``torch.ops.qkv.int4_mm``, built and loaded on first call (a few seconds once per
    machine, milliseconds after), or None where it cannot be (see :func:`int4_status`)."""
    with _lock:
        if _state["status"] is None:
            _state["op"], _state["status"] = _load()
        return _state["op"]


_started = threading.Event()


def prepare() -> None:
    """Start :func:`int4_op` in a background thread and return at once: on a machine that has
    not built the library yet, the compiler then runs on another core while the model loads
    (a first ``qkv generate``: 12.4 s waiting for it, 7.1 s without it); the first product
    waits for what is left. Later calls do nothing."""
    if _started.is_set() or _state["status"] is not None:
        return
    _started.set()
    threading.Thread(target=int4_op, name="qkv-kernels", daemon=True).start()


def q8_op() -> Any | None:
    """``torch.ops.qkv.q8_mm`` (the same library as :func:`int4_op`), or None."""
    return None if int4_op() is None else torch.ops.qkv.q8_mm


def argmax_op() -> Any | None:
    """``torch.ops.qkv.argmax_rows`` where this process has loaded the library already (it never
    starts a build: greedy decoding asks every token), else None."""
    return torch.ops.qkv.argmax_rows if _state["op"] is not None else None


def sample_op() -> Any | None:
    """``torch.ops.qkv.sample_rows`` (sampling's draw from float32 logits: temperature, top-k,
    top-p and the inverse-CDF draw in one call) where this process has loaded the library already,
    else None."""
    return torch.ops.qkv.sample_rows if _state["op"] is not None else None


def int4_status() -> str:
    """Which 4-bit kernel decodes here, and why: "qkv's (avx512-vnni)" or "PyTorch's (...)"."""
    int4_op()
    return _state["status"]


def _load() -> tuple[Any | None, str]:
    if not enabled():
        return None, "PyTorch's (QKV_INT4_KERNEL=off)"
    if _loaded():
        return torch.ops.qkv.int4_mm, f"qkv's ({torch.ops.qkv.int4_path()})"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"PyTorch's (qkv's kernels are written for x86-64, this is {platform.machine()})"
    try:
        path = build()
    except (NativeError, OSError, RuntimeError) as e:
        return None, f"PyTorch's (qkv's could not be built: {' '.join(str(e).split())[:200]})"
    try:
        torch.ops.load_library(str(path))
        register_fake("qkv")
    except (OSError, RuntimeError) as e:
        return None, f"PyTorch's (qkv's were built but could not be loaded: {' '.join(str(e).split())[:200]})"
    return torch.ops.qkv.int4_mm, f"qkv's ({torch.ops.qkv.int4_path()})"


def _loaded() -> bool:
    """This process has loaded the library already (it cannot be loaded twice)."""
    return hasattr(torch.ops.qkv, "int4_mm")


def register_fake(namespace: str) -> None:
    """Tell torch.export what ``<namespace>::int4_mm`` returns without running it."""
    import torch.library

    def _fake(x: Tensor, w: Tensor, dm: Tensor) -> Tensor:
        return x.new_empty(x.shape[0], w.shape[0] * ROWS, dtype=torch.float32)

    def _fake8(x: Tensor, w: Tensor, ds: Tensor) -> Tensor:
        return x.new_empty(x.shape[0], w.shape[0] * ROWS, dtype=torch.float32)

    torch.library.register_fake(f"{namespace}::int4_mm", _fake)
    torch.library.register_fake(f"{namespace}::q8_mm", _fake8)


def pack_int4(q: Tensor, d: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """Codes q (N, K) in 0..15 and per-group d, m (N, K/32) (``w = d·q + m``) -> the kernel's
    w (N/16, K/32, 4, 64) uint8 and dm (N/16, K/32, 2, 16) float16 (see qmatmul.cpp)."""
    N, K = q.shape
    if N % ROWS or K % GROUP or d.shape != (N, K // GROUP) or m.shape != d.shape:
        raise ValueError(f"pack_int4: q {tuple(q.shape)} needs N % 16 == 0, K % 32 == 0 and d, m of shape "
                         f"({N}, {K // GROUP})")
    G = K // GROUP
    nib = q.to(torch.uint8).view(N // ROWS, ROWS, G, 4, 2, 4)  # (block, row j, group, chunk c, half, b)
    byte = nib[..., 0, :] | (nib[..., 1, :] << 4)  # low nibble: input 8c + b; high: 8c + 4 + b
    w = byte.permute(0, 2, 3, 1, 4).contiguous().view(N // ROWS, G, 4, 64)
    dm = torch.stack([d, m]).view(2, N // ROWS, ROWS, G).permute(1, 3, 0, 2).to(torch.float16).contiguous()
    return w, dm


def pack_q8(q: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """Codes q (N, K) in -127..127 and per-group d (N, K/32) (``w = d·q``, GGUF's Q8_0) -> the
    kernel's w (N/16, K/32, 8, 64) uint8 (q + 128) and ds (N/16, K/32, 16) float16."""
    N, K = q.shape
    if N % ROWS or K % GROUP or d.shape != (N, K // GROUP):
        raise ValueError(f"pack_q8: q {tuple(q.shape)} needs N % 16 == 0, K % 32 == 0 and d of shape "
                         f"({N}, {K // GROUP})")
    G = K // GROUP
    u = (q.to(torch.int16) + 128).to(torch.uint8).view(N // ROWS, ROWS, G, 8, 4)  # (block, j, group, c, b)
    w = u.permute(0, 2, 3, 1, 4).contiguous().view(N // ROWS, G, 8, 64)
    ds = d.view(N // ROWS, ROWS, G).permute(0, 2, 1).to(torch.float16).contiguous()
    return w, ds
