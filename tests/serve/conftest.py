"""Fixtures for `qkv serve`: a runs directory with one tiny run of each family (plus traps that
must never be listed or read), and the app served by uvicorn on a free loopback port."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import serving


@pytest.fixture(scope="session")
def runs_dir(tiny_run, tmp_path_factory) -> Path:
    """ROOT/runs with gpt-tiny, vit-tiny, seq2seq-tiny, captioner-tiny, a folder that is not a
    run, and ``escape``: a symlink to a gpt run outside the runs directory (refused)."""
    for family in ("gpt", "vit", "seq2seq", "captioner"):
        runs = tiny_run(family).parent
    outside = tmp_path_factory.mktemp("outside") / "secret-run"
    outside.mkdir()
    (outside / "config.json").write_text((tiny_run("gpt") / "config.json").read_text())
    if not (runs / "escape").exists():
        (runs / "escape").symlink_to(outside, target_is_directory=True)
    (runs / "notes").mkdir(exist_ok=True)
    (runs / "notes" / "readme.txt").write_text("not a run")
    return runs


@pytest.fixture(scope="session")
def server(runs_dir):
    """The app on http://127.0.0.1:PORT (uvicorn in a thread); yields the base URL."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
    from qkv.serve import create_app

    with serving(create_app(runs_dir=runs_dir, max_upload_bytes=200_000)) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_gpt_server(tiny_run):
    """The app over the session's runs folder holding only the tiny GPT (the page's views and
    the quiz); yields the base URL."""
    pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
    pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
    from qkv.serve import create_app

    with serving(create_app(runs_dir=tiny_run("gpt").parent)) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless, driven by Playwright (never a downloaded browser)."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need Playwright: "
                                   "pip install playwright (it drives the system Chromium)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("browser tests need Debian's Chromium: apt-get install -y chromium")
    pw = sync_api.sync_playwright().start()
    b = pw.chromium.launch(executable_path=chromium, headless=True)
    yield b
    b.close()
    pw.stop()
