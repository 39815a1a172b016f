"""Calling the ``qkv`` command line in-process from tests (tests/ is on sys.path through
tests/conftest.py, so any test file can ``from cli_helpers import call``)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch

from qkv import cli

PNG = b"\x89PNG\r\n\x1a\n"


def call(argv: list[str]) -> tuple[int, str, str]:
    """cli.main with stdout/stderr captured; argparse's own exits become return codes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def call_one_thread(argv: list[str], cache_dir: Path) -> tuple[int, str, str]:
    """:func:`call` on one thread with ``QKV_CACHE_DIR=cache_dir`` (both restored after): how
    the session's tiny runs are trained, so that they come out the same whoever trains them."""
    threads, cache = torch.get_num_threads(), os.environ.get("QKV_CACHE_DIR")
    torch.set_num_threads(1)
    os.environ["QKV_CACHE_DIR"] = str(cache_dir)
    try:
        return call(argv)
    finally:
        torch.set_num_threads(threads)
        if cache is None:
            os.environ.pop("QKV_CACHE_DIR", None)
        else:
            os.environ["QKV_CACHE_DIR"] = cache


def assert_one_line_error(rc: int, err: str) -> str:
    """The failure contract: exit code 2, one line on stderr starting 'qkv: error: ', no traceback."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Traceback" not in err
    return lines[0]
