"""Concurrent generation on one server: aggregate tokens per second at 1, 2, 4 and 8 clients.

Three servers on the same SmolLM2 GGUF (Q4_1), each a subprocess on 127.0.0.1, measured in the
same rounds, one server at a time (the others idle):

- ``qkv serve`` as it is now: every computation on one compute loop, requests on one model
  decoding together in one running batch (``--batch-rows 8``, :mod:`qkv.serve.batching`) through
  the native step (every live row in one call a token; SmolLM2 q4 needs no set-up: the documented
  one, ``qkv prepare smollm2``, which ``qkv assets install smollm2`` runs, says so and builds
  nothing; a model the native step does not run decodes through the saved steps it builds); the
  attention row the page shows comes from the steps' kept queries;
- ``qkv serve --batch-rows 1`` with the native and saved steps off: one request at a time,
  eagerly, the rest waiting (what a server without its steps and without batching gives);
- llama.cpp's ``llama-server`` (``-np 8``: 8 slots, continuous batching; ``-t 2``), where it builds
  (``--build-llama-cpp`` builds it once, ~10 minutes).

Each client sends one request for 64 new tokens (greedy, a different prompt each; qkv's also
ask for one layer's attention row per token, as the page does: llama.cpp computes none), all
clients at once; aggregate tok/s = every token received / wall time from the first request to
the last response. Before the rounds each qkv server answers one attention and one lens request
on the model, as the page does. Each (server, clients) cell is the median over ``--rounds``
rounds, and the ratios are taken within each round.

    python benchmarks/serve_batch.py                    # ~6 minutes on 2 cores
    python benchmarks/serve_batch.py --build-llama-cpp  # also llama-server (built once)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common as C
import _llama_cpp as L

NAME = "serve_batch"
PROMPTS = ["Once upon a time, in a small village by the sea,", "The history of the Roman Empire begins",
           "Photosynthesis is the process by which plants", "def quicksort(items):",
           "The best way to learn a new language is", "In 1969, the first humans walked on",
           "A recipe for bread needs flour, water,", "The three laws of motion state that"]
NEW = 64
MAX_TOKENS = 256  # qkv serve's --max-tokens default: its batch's cache length


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")


class Server:
    """A server subprocess and how to ask it for one completion (returns the tokens received)."""

    def __init__(self, name: str, argv: list[str], health: str, port: int, env: dict | None = None,
                 stderr: Any = subprocess.PIPE) -> None:
        self.name, self.port = name, port
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env)
        wait_ready(f"http://127.0.0.1:{port}{health}", self.proc)

    def complete(self, prompt: str) -> int:
        raise NotImplementedError

    def warm(self) -> None:
        """Load the model and answer once before the timed rounds."""
        self.complete("Hello")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class QkvServer(Server):
    def __init__(self, name: str, runs: Path, batch_rows: int, steps: bool, clients: int = 8) -> None:
        port = free_port()
        on = "on" if steps else "off"  # the native and saved steps: off, "eager" is eager
        env = {**os.environ, "QKV_SAVED_STEP": on, "QKV_NATIVE_STEP": on}
        argv = [sys.executable, "-m", "qkv", "serve", "--port", str(port), "--runs", str(runs),
                "--batch-rows", str(batch_rows), "--max-queued", str(max(8, clients))]  # none is refused
        super().__init__(name, argv, "/api/models", port, env)

    def warm(self) -> None:
        """What the page does before it generates: one layer's attention over a text and the lens
        (in the server's one compute loop: a pool of OpenMP workers left in another thread had
        halved every later decoding step, see qkv/serve/loop.py)."""
        text = "The quick brown fox jumps over the lazy dog. " * 12
        post(f"http://127.0.0.1:{self.port}/api/attention", {"model": "smollm2", "text": text})
        post(f"http://127.0.0.1:{self.port}/api/lens", {"model": "smollm2", "text": text[:200]})
        super().warm()

    def complete(self, prompt: str) -> int:
        body = {"model": "smollm2", "prompt": prompt, "max_new_tokens": NEW, "layer": -1, "head": None}
        lines = post(f"http://127.0.0.1:{self.port}/api/generate", body).decode().splitlines()
        events = [json.loads(x) for x in lines]
        if events[-1]["event"] != "done":
            raise RuntimeError(f"{self.name}: {events[-1]}")
        return sum(e["event"] == "token" for e in events)


class LlamaServer(Server):
    def __init__(self, binary: Path, gguf: Path) -> None:
        port = free_port()
        super().__init__("llama-server -np 8", [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                                                str(port), "-t", "2", "-c", str(8 * 512), "-np", "8"],
                         "/health", port)

    def complete(self, prompt: str) -> int:
        body = {"prompt": prompt, "n_predict": NEW, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        out = json.loads(post(f"http://127.0.0.1:{self.port}/completion", body))
        return int(out["tokens_predicted"])


def measure(server: Server, clients: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = list(pool.map(server.complete, prompts))
    wall = time.perf_counter() - t0
    return {"tokens": sum(tokens), "seconds": round(wall, 3), "tok_s": round(sum(tokens) / wall, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama-server if it is not built")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not C.have_assets(NAME, ("smollm2",)):  # qkv and llama.cpp only: no reference packages
        return 1
    from qkv.assets import asset_path

    gguf = Path(asset_path("smollm2"))
    gguf = gguf if gguf.is_file() else next(gguf.rglob("*.gguf"))
    machine = C.machine_info()
    print(C.machine_line(machine))
    counts = [int(c) for c in args.clients.split(",")]
    runs = Path(tempfile.mkdtemp(prefix="qkv-serve-batch-"))
    binary, how = L.llama_tool("llama-server", build=args.build_llama_cpp)
    print(f"llama-server: {how}")
    t0 = time.perf_counter()  # the documented set-up: the steps the server decodes with, if any
    built = subprocess.run([sys.executable, "-m", "qkv", "prepare", "smollm2", "--batch-rows", "8",
                            "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True)
    lines = [x for x in built.stderr.splitlines() if "saved step for" in x or "native step" in x]
    step_note = " ".join(lines) or f"rc {built.returncode}"
    print(f"qkv prepare smollm2: {step_note} ({time.perf_counter() - t0:.0f} s)")
    most = max(counts)
    servers: list[Server] = [QkvServer("qkv serve (batched)", runs, 8, True, most),
                             QkvServer("qkv serve --batch-rows 1 (one at a time, eager)", runs, 1, False,
                                       most)]
    if binary is not None:
        servers.append(LlamaServer(binary, gguf))
    rounds: list[dict] = []
    try:
        for s in servers:  # load the model, warm up (qkv: as the page does, attention first)
            s.warm()
        for r in range(args.rounds):
            row: dict = {}
            for n in counts:
                for s in servers:
                    row.setdefault(s.name, {})[str(n)] = m = measure(s, n)
                    print(f"round {r + 1}: {s.name:40s} {n} clients: {m['tok_s']:7.1f} tok/s "
                          f"({m['tokens']} tokens in {m['seconds']:.1f} s)", flush=True)
            rounds.append(row)
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(runs, ignore_errors=True)
    names = [s.name for s in servers]
    base, alone = names[0], names[1]
    table, summary = [], {}
    for n in map(str, counts):
        cells = {name: C.median([rd[name][n]["tok_s"] for rd in rounds]) for name in names}
        vs_alone = [rd[base][n]["tok_s"] / rd[alone][n]["tok_s"] for rd in rounds]
        vs_llama = ([rd[base][n]["tok_s"] / rd[names[2]][n]["tok_s"] for rd in rounds]
                    if len(names) > 2 else [])
        summary[n] = {"median_tok_s": cells, "batched_vs_alone": [round(x, 2) for x in vs_alone],
                      "batched_vs_llama_server": [round(x, 2) for x in vs_llama]}
        table.append([n, *(f"{cells[name]:.1f}" for name in names), f"{C.median(vs_alone):.2f}x",
                      f"{C.median(vs_llama):.2f}x" if vs_llama else "-"])
    C.print_table(f"aggregate tok/s, SmolLM2 Q4_1, {NEW} new tokens per client (median of "
                  f"{args.rounds} rounds)",
                  ["clients", *names, "batched / alone", "batched / llama-server"], table)
    out = C.write_json(NAME, {"machine": machine, "new_tokens": NEW, "rounds": rounds, "summary": summary,
                              "llama_server": how, "saved_step": step_note}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
