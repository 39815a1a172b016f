"""The one way a test skips for a missing asset: a reason that starts with ``asset missing:``
and names the asset and the command that installs it, so that a skipped parity test is
never silent and CI (``.ci/run``, which installs every asset) can refuse such skips by their
prefix.

Importable from any test: tests/pretrained/ through its conftest, other folders as
``from pretrained.asset_skip import require_asset`` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

PREFIX = "asset missing:"


def skip_reason(name: str) -> str:
    """The reason every asset skip gives, e.g. 'asset missing: minilm (qkv assets install minilm)'."""
    return f"{PREFIX} {name} (qkv assets install {name})"


def require_asset(name: str) -> Path:
    """The installed asset's path, or skip the test with :func:`skip_reason`."""
    from qkv.assets import AssetMissingError, asset_path

    try:
        return asset_path(name)
    except AssetMissingError:
        pytest.skip(skip_reason(name))
