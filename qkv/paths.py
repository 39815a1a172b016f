"""Where qkv keeps what it can rebuild: ``$QKV_CACHE_DIR`` (default ``$XDG_CACHE_HOME/qkv`` or
``~/.cache/qkv``); ``QKV_CACHE_DIR=off`` turns every cache off (converted checkpoints, the
trainer's speed probe)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path | None:
    """The cache folder, or None when ``QKV_CACHE_DIR=off``."""
    env = os.environ.get("QKV_CACHE_DIR")
    if env is not None:
        return None if env.lower() in ("off", "0", "none", "") else Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "qkv"
