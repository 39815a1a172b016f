"""Atomic file writes, shared by checkpoints, tokenizers, plots and the token cache.

A file is written under a temporary name in the same directory, flushed to disk, then renamed
over the target (``os.replace`` is atomic on POSIX), and the directory is flushed so that the
rename itself survives a power cut: a crash or Ctrl-C mid-write never leaves a truncated file
where a good one was. Files get the permissions any new file would (0666 less the umask), not
the 0600 of a temporary file.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask (reading it means setting it: a lock keeps threads from racing)."""
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk; a no-op where the
    platform cannot open directories (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)``, fsync the result, give it the umask's permissions, rename it
    over ``path`` and fsync the directory. On any error the temporary file is removed and the
    previous ``path`` (if any) is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def save_figure(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """``fig.savefig`` atomically (the format from ``path``'s suffix, default PNG)."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs))
