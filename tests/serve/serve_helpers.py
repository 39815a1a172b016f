"""Helpers shared by the tests of `qkv serve` (imported by name: tests/serve is on sys.path)."""

from __future__ import annotations

import socket


def asset_installed(name: str) -> bool:
    """Whether asset ``name`` is installed (tests that need it skip, naming the fix, if not)."""
    from qkv.assets import AssetMissingError, asset_path

    try:
        asset_path(name)
    except AssetMissingError:
        return False
    return True


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
