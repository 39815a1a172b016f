"""Native code qkv builds on this machine (the saved decoding step, the 4-bit kernel): what keys
it to the machine, where it lives, and how it is written and checked.

A built artefact is native code, so it is kept in a folder private to the user (mode 0700,
owned by them), written under a lock into a temporary folder and renamed into place, and its
SHA-256 is recorded beside it and checked before it is loaded: a damaged or foreign file is
refused and rebuilt. What it may run on is decided by its key (:func:`cpu_identity`, the
compiler, torch's version), never by the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qkv import owned
from qkv.paths import cache_root


class NativeError(RuntimeError):
    """Why native code could not be built or loaded here (the caller goes on without it)."""


def run_owned(cmd: list[str], timeout: float, scratch: Path | None = None) -> subprocess.CompletedProcess:
    """``cmd`` (a compiler) run to completion, never outliving this process (:func:`qkv.owned.run`);
    NativeError if this process is exiting. ``scratch``: the compiler's TMPDIR (a compiler that
    is killed leaves its temporary ``cc*.s`` there, not in /tmp)."""
    env = None if scratch is None else {**os.environ, "TMPDIR": str(scratch)}
    try:
        return owned.run(cmd, timeout, env)
    except owned.ExitingError as e:
        raise NativeError(str(e)) from None


def cpu_identity() -> dict[str, str]:
    """Vendor, family, model, model name and a digest of the flag set of this CPU (code built
    with ``-march=native`` runs only where these match)."""
    info: dict[str, str] = {"machine": platform.machine()}
    with contextlib.suppress(OSError):
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        for name in ("vendor_id", "cpu family", "model", "model name"):
            info[name] = fields.get(name, "")
        info["flags"] = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()
    return info


def cxx() -> str | None:
    """The C++ compiler's path: ``$CXX``, else ``c++``, else ``g++`` (None: none found)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@functools.cache
def compiler() -> str | None:
    """The C++ compiler, as its ``--version`` first line (None: none found)."""
    path = cxx()
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def private_folder(name: str) -> Path:
    """``<cache>/<name>``, made if missing, mode 0700 and owned by this user; NativeError if
    qkv's cache is off, it cannot be made, or someone else could write to it."""
    root = cache_root()
    if root is None:
        raise NativeError("qkv's cache is off (QKV_CACHE_DIR=off)")
    path = root / name
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError as e:
        raise NativeError(f"cannot use {path}: {e.strerror or e}") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise NativeError(f"{path} is not private to this user (mode {st.st_mode & 0o777:o}); it holds "
                          "native code: chmod 700 it or remove it")
    return path


def sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (made if missing) while the block runs."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(root: Path, key: str, meta_name: str, valid: Callable[[Path], bool],
               make: Callable[[Path], dict[str, Any]]) -> Path:
    """``root/key``, made by ``make`` unless ``valid`` finds it good; returns it.

    Under the key's lock (two processes at once: one builds, the other waits and finds it),
    ``make(tmp)`` writes into a fresh temporary folder beside it and returns the record to keep
    as ``meta_name`` (the time it was built is added); the folder is then renamed into place,
    replacing a damaged or foreign one. What a killed build left is removed first.
    """
    final = root / key
    with lock(root / f"{key}.lock"):
        if valid(final):
            return final
        for left in root.glob(f".{key}-*"):  # a build of this key that was killed (we hold its lock)
            shutil.rmtree(left, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
        try:
            meta = {**make(tmp), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (tmp / meta_name).write_text(json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final)  # damaged or foreign: replaced
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
