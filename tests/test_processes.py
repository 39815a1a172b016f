"""qkv cleans up after itself, with real processes: after `qkv generate`, after `qkv serve` gets
SIGTERM or SIGINT (having served a generation and a lens request), after `qkv prepare`, and
after a Python process that decoded exits, no process that qkv started is left (each command
runs with a marker in its environment, which every process it starts inherits: /proc is
searched for it). And the Python API's first decoding process after the documented set-up
(`qkv prepare MODEL`) decodes through the saved step, with the eager tokens."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import child_env, free_port, seed_kernels

from qkv.native import compiler


def marked(marker: str) -> list[int]:
    """The processes whose environment holds ``QKV_TEST_MARKER=marker``."""
    want = f"QKV_TEST_MARKER={marker}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if want in (p / "environ").read_bytes().split(b"\0"):
                    out.append(int(p.name))
            except OSError:  # gone, or not ours to read
                pass
    return out


def none_left(marker: str, within: float = 10.0) -> list[int]:
    """The marked processes still there ``within`` seconds from now ([] as soon as none is)."""
    deadline = time.monotonic() + within
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def env(tmp_path: Path, seed: bool = True) -> tuple[dict[str, str], str]:
    """A child's environment with a cache of its own, the kernel library copied in (unless
    ``seed`` is False: a test of its compile), and a marker to find what it left running."""
    marker = uuid.uuid4().hex
    if seed:
        seed_kernels(tmp_path / "cache")
    return {**child_env(), "QKV_CACHE_DIR": str(tmp_path / "cache"), "QKV_TEST_MARKER": marker}, marker


pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")


def test_nothing_is_left_after_qkv_generate_and_a_python_process_that_decoded(tiny_run, tmp_path):
    e, marker = env(tmp_path)
    run = str(tiny_run("gpt"))
    r = subprocess.run([sys.executable, "-m", "qkv", "generate", run, "--prompt", "ROMEO", "--max-new-tokens",
                        "6"], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "`qkv prepare" in r.stderr  # eager, and how to make it fast: said, nothing started
    assert none_left(marker) == []
    code = f"import qkv; print(qkv.load({run!r}).generate('ROMEO', 6))"
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert none_left(marker) == []


@pytest.mark.skipif(compiler() is None, reason="qkv's kernels need a C++ compiler (apt-get install g++)")
def test_a_kernel_compile_in_the_background_ends_with_the_process(tmp_path):
    """A decoder starts compiling qkv's kernels in a background thread while it loads; a process
    that exits first (a server stopped at once, a script that loaded and quit) takes the compiler
    with it, instead of leaving g++ and cc1plus running."""
    e, marker = env(tmp_path, seed=False)
    (tmp_path / "tmp").mkdir()
    e["TMPDIR"] = str(tmp_path / "tmp")  # where a killed compiler leaves its cc*.s unless told otherwise
    code = ("import time; from qkv import kernels; kernels.prepare(); time.sleep(1.5); "
            "print(kernels._state['status'])")
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"  # it exited while the compiler was still running
    assert none_left(marker) == []
    assert list((tmp_path / "tmp").iterdir()) == []  # its temporary files were in the build's folder


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_nothing_is_left_after_qkv_serve_is_stopped(tiny_run, tmp_path, sig):
    pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
    import httpx

    e, marker = env(tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--runs", str(tiny_run("gpt").parent),
                             "--port", str(port)], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/api/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        name = f"runs/{tiny_run('gpt').name}"
        r = httpx.post(f"{url}/api/generate", json={"model": name, "prompt": "ROMEO", "max_new_tokens": 8},
                       timeout=120)
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["event"] == "done", r.text
        r = httpx.post(f"{url}/api/lens", json={"model": name, "text": "ROMEO"}, timeout=120)
        assert r.status_code == 200, r.text
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert none_left(marker) == []


@pytest.mark.skipif(compiler() is None, reason="saved steps need a C++ compiler (apt-get install g++)")
def test_after_qkv_prepare_the_first_python_process_decodes_through_the_saved_step(tiny_run, tmp_path):
    """The documented set-up for your own model, then a fresh process with the default API: its
    very first decoding goes through the saved step (its request count), with the tokens eager
    decoding gives; `qkv prepare` itself leaves nothing running, and loading the step leaves no
    folder behind (AOTInductor's loader extracts the package into TMPDIR and never removes it)."""
    e, marker = env(tmp_path)
    e["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    run = str(tiny_run("gpt"))
    r = subprocess.run([sys.executable, "-m", "qkv", "prepare", run, "--batch-rows", "0"], env=e,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "saved step for one request: built in" in r.stderr, r.stderr
    assert none_left(marker) == []
    code = f"""
import json, qkv
lm = qkv.load({run!r})
fast = lm.generate("ROMEO", 20)
d = lm.last_stats.decision
eager = lm.generate("ROMEO", 20, mode="eager")
print(json.dumps({{"kind": d.kind, "requests": d.step.requests if d.step else None, "same": fast == eager,
                  "text": fast}}), flush=True)
import os
os._exit(0)  # as a server stopped or killed ends: no destructor runs (AOTInductor's cleans up in one)
"""
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["kind"] == "saved" and got["requests"] == 1 and got["same"] and got["text"], got
    assert "decodes eagerly" not in r.stderr  # nothing to say: it was fast from the first token
    assert none_left(marker) == []
    left = sorted(p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(("aotinductor_", "qkv-")))
    assert left == [], left
