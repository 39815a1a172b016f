"""Load test of `qkv serve` over real HTTP on 127.0.0.1: mixed requests from many clients at once.

The server is `python -m qkv serve` in a subprocess on a free port, with tiny runs trained by
this script (`qkv train FAMILY --preset tiny` cut to 10 steps: gpt, vit, seq2seq) or the runs
found under ``--runs``. After one warm-up request per model, ``--requests`` requests are sent
by ``--concurrency`` clients at once, in a fixed random order: the model list, attention on a
text run (each text different, so no cached result), generation, an image upload to the ViT run,
a seq2seq alignment, and bad requests (a path out of the runs directory, an unknown model,
malformed JSON, a cross-site upload, an empty upload). Recorded: status counts (each must be
2xx, 4xx or 503; anything else fails the run), latency p50/p95/max per kind and overall, the
server's peak RSS (VmHWM) and peak thread count, the machine, and the CPU time other processes
took meanwhile.

Clients are impatient (a 503 is their answer) or, for each server that answered 503, also
patient in a second run: they wait the Retry-After seconds and ask again (at most 30 times), so
every request is served in the end; their latency includes the waits.

``--text-model smollm2`` sends the attention and generation requests to SmolLM2 instead (if its
asset is installed), with texts longer than the server's 256 tokens: each attention request
then builds 30 x 9 x 256 x 256 float32 weights (~70 MB), which is what the work queue bounds.
``--server-path DIR`` also runs every scenario with the server from another checkout of qkv
(run in that directory, so its qkv is the one imported), e.g. a worktree of the commit before
the queue: the two under the same load.

    python benchmarks/serve_load.py                        # 200 requests, 20 at once (~30 s)
    python benchmarks/serve_load.py --quick                # 40 requests, 10 at once
    git worktree add /tmp/before COMMIT && python benchmarks/serve_load.py \
        --text-model runs/gpt-tiny --text-model smollm2 --server-path /tmp/before   # ~4 minutes
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common as C

NAME = "serve_load"
TINY_TEXT = "\n".join(["ROMEO: But soft, what light through yonder window breaks?",
                       "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
                       "ROMEO: It is the east, and Juliet is the sun."] * 25) + "\n"
TINY_ARGS = {  # as tests/conftest.py trains them
    "gpt": ["--max_iters", "10", "--data", "{root}/text.txt", "--compile", "false"],
    "vit": ["--max_iters", "10", "--eval_iters", "1"],
    "seq2seq": ["--max_iters", "10", "--eval_iters", "1", "--n_train", "300", "--n_val", "50",
                "--n_test", "50", "--n_heldout", "50"],
}
# share of each kind of request (of 20)
MAX_TRIES = 30  # of a patient client, per request
MIX = {"models": 3, "attention": 6, "generate": 3, "image": 3, "seq2seq": 1, "bad": 4}
WORDS = "the cat sat on a mat and the dog ran to the park with a red ball".split()
ROMEO_WORDS = TINY_TEXT.split()


def train_tiny_runs(root: Path) -> Path:
    """ROOT/runs/{gpt,vit,seq2seq}-tiny, trained by `python -m qkv train` (a few seconds each)."""
    (root / "text.txt").write_text(TINY_TEXT, encoding="utf-8")
    env = {**os.environ, "QKV_CACHE_DIR": str(root / "cache")}
    for family, extra in TINY_ARGS.items():
        out = root / "runs" / f"{family}-tiny"
        argv = [sys.executable, "-m", "qkv", "train", family, "--preset", "tiny", "--out_dir", str(out),
                "--no-progress", *(a.format(root=root) for a in extra)]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"training the tiny {family} run failed:\n{done.stderr[-2000:]}")
    return root / "runs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and Threads of a process, from /proc (empty off Linux)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


class Watch(threading.Thread):
    """Samples the server's thread count (and RSS) every 20 ms; keeps the peaks."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop, self.peak_threads, self.peak_rss_kb = pid, threading.Event(), 0, 0

    def run(self) -> None:
        while not self.stop.wait(0.02):
            st = proc_status(self.pid)
            self.peak_threads = max(self.peak_threads, st.get("Threads", 0))
            self.peak_rss_kb = max(self.peak_rss_kb, st.get("VmRSS", 0))


def png(size: int, mode: str = "L") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (size, size), 180).save(buf, format="PNG")
    return buf.getvalue()


def plan(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` (kind, i) in a fixed random order, the kinds in the proportions of MIX; ``i`` counts
    the requests of each kind (so the bad ones cycle through their five variants)."""
    kinds = [k for k, w in MIX.items() for _ in range(w)]
    rng = random.Random(seed)
    seen: Counter = Counter()
    out = []
    for _ in range(n):
        kind = rng.choice(kinds)
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return out


def make_request(kind: str, i: int, text_model: str, image: bytes) -> dict:
    """The httpx arguments of request ``i`` of ``kind``."""
    rng = random.Random(i)
    if text_model.startswith("runs/"):  # a character model: only the characters it was trained on
        text = " ".join(rng.choice(ROMEO_WORDS) for _ in range(8 + i % 10))
    else:  # past the server's 256 tokens: each request builds the largest maps it allows
        text = " ".join(rng.choice(WORDS) for _ in range(300 + i % 60))
    if kind == "models":
        return {"method": "GET", "url": "/api/models"}
    if kind == "attention":
        return {"method": "POST", "url": "/api/attention",
                "json": {"model": text_model, "text": text, "layer": -1, "head": i % 4}}
    if kind == "generate":
        return {"method": "POST", "url": "/api/generate",
                "json": {"model": text_model, "prompt": "ROMEO: " if text_model.startswith("runs/")
                         else "Once upon a time", "max_new_tokens": 8, "temperature": 0.8, "seed": i}}
    if kind == "image":
        return {"method": "POST", "url": "/api/image-attention", "data": {"model": "runs/vit-tiny"},
                "files": {"image": ("digit.png", image, "image/png")}}
    if kind == "seq2seq":
        return {"method": "POST", "url": "/api/attention",
                "json": {"model": "runs/seq2seq-tiny", "text": f"{1 + i % 28} août {1950 + i % 70}"}}
    bad = i % 5
    if bad == 0:
        return {"method": "POST", "url": "/api/attention", "json": {"model": "runs/../../etc", "text": "x"}}
    if bad == 1:
        return {"method": "POST", "url": "/api/attention", "json": {"model": "nope", "text": "x"}}
    if bad == 2:
        return {"method": "POST", "url": "/api/attention", "content": b"{not json",
                "headers": {"content-type": "application/json"}}
    if bad == 3:
        return {"method": "POST", "url": "/api/image-attention", "data": {"model": "runs/vit-tiny"},
                "files": {"image": ("d.png", image, "image/png")}, "headers": {"origin": "http://evil.example"}}
    return {"method": "POST", "url": "/api/image-attention", "data": {"model": "runs/vit-tiny"},
            "files": {"image": ("empty.png", b"", "image/png")}}


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]  # the nearest rank
    return {"n": len(xs), "p50_ms": round(1e3 * statistics.median(xs), 1), "p95_ms": round(1e3 * p95, 1),
            "max_ms": round(1e3 * xs[-1], 1)}


def run_load(base: str, requests: list[tuple[str, int]], concurrency: int, text_model: str,
             patient: bool) -> list[dict]:
    """Send the requests from ``concurrency`` clients at once; a patient client answered 503
    waits the Retry-After seconds and asks again (at most MAX_TRIES times)."""
    import httpx

    image = png(20)
    local = threading.local()

    def one(item: tuple[str, int]) -> dict:
        kind, i = item
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=base, timeout=300)
        t0, statuses, error = time.perf_counter(), [], None
        while True:
            try:
                r = local.client.request(**make_request(kind, i, text_model, image))
                body = r.text  # a generation streams: the whole stream is read
                statuses.append(r.status_code)
                last = body.splitlines()[-1] if body else ""
                if r.status_code == 200 and kind == "generate" and json.loads(last)["event"] != "done":
                    error = last[:200]
            except httpx.HTTPError as e:
                statuses.append(0)
                error = f"{type(e).__name__}: {e}"
                break
            if r.status_code != 503 or not patient or len(statuses) == MAX_TRIES:
                break
            time.sleep(int(r.headers.get("retry-after", "1")))
        return {"kind": kind, "statuses": statuses, "seconds": time.perf_counter() - t0,
                "retry_after": r.headers.get("retry-after") if statuses[-1] == 503 else None, "error": error}

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, requests))


def summarise(results: list[dict]) -> dict:
    """Statuses of every response and of each request's last one; latency (including the waits
    of patient clients) of all requests and of those served (not left with a 503)."""

    def part(rs: list[dict]) -> dict:
        return {"statuses": dict(sorted(Counter(x for r in rs for x in r["statuses"]).items())),
                "final_statuses": dict(sorted(Counter(r["statuses"][-1] for r in rs).items())),
                "latency_all": percentiles([r["seconds"] for r in rs]),
                "latency_served": percentiles([r["seconds"] for r in rs if r["statuses"][-1] != 503])}

    every = [x for r in results for x in r["statuses"]]
    by_kind = {kind: part([r for r in results if r["kind"] == kind]) for kind in MIX}
    return {**part(results), "by_kind": by_kind,
            "retries": sum(len(r["statuses"]) - 1 for r in results),
            "retry_after_s": sorted({int(r["retry_after"]) for r in results if r["retry_after"]}),
            "bad_statuses": sum(1 for x in every if not (200 <= x < 500 or x == 503)),
            "stream_errors": [r["error"] for r in results if r["error"]][:5]}


def serve_and_drive(runs: Path, cache: Path, server_path: str | None, n: int, concurrency: int,
                    text_model: str, patient: bool) -> dict:
    """One scenario: start `python -m qkv serve` (from ``server_path`` if given), load it, stop it."""
    env = {**os.environ, "QKV_CACHE_DIR": os.environ.get("QKV_CACHE_DIR", str(cache))}
    if server_path:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(server_path).resolve()),
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = free_port()
    argv = [sys.executable, "-m", "qkv", "serve", "--port", str(port), "--runs", str(runs.resolve())]
    # `python -m` puts its working directory first on sys.path: run it in the checkout it serves
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=Path(server_path).resolve() if server_path else None)
    try:
        result = drive(f"http://127.0.0.1:{port}", server, n, concurrency, text_model, patient)
    finally:
        server.terminate()
        try:
            _, err = server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    here = Path(server_path) if server_path else C.REPO_DIR
    commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or None
    result.update({"text_model": text_model, "server_path": server_path, "server_commit": commit,
                   "clients": "patient (wait Retry-After, ask again)" if patient else "impatient (no retry)",
                   "server_stderr_tail": err[-1500:] if err else ""})
    return result


def report(r: dict, n: int, concurrency: int) -> None:
    s = r["summary"]
    where = f"from {r['server_path']}" if r["server_path"] else "this checkout"
    C.print_table(f"{n} requests, {concurrency} at once, over HTTP: {r['text_model']}, server {where} "
                  f"({r['server_commit']}), {r['clients']} clients",
                  ["kind", "every response", "last response", "p50", "p95", "max"],
                  [[k, json.dumps(v["statuses"]), json.dumps(v["final_statuses"]),
                    *(C.fmt_time(v["latency_all"].get(f"{q}_ms", 0) / 1e3) for q in ("p50", "p95", "max"))]
                   for k, v in [*s["by_kind"].items(), ("all", s)]])
    print(f"server peak RSS {r['server_peak_rss_mb']:.0f} MB (after warm-up "
          f"{r['server_rss_after_warmup_mb']:.0f} MB), peak threads {r['server_peak_threads']}; "
          f"{r['wall_s']:.1f} s, {r['requests_per_s']:.1f} requests/s, {s['retries']} retries", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 requests, 10 at once")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--runs", default=None, help="a runs directory with gpt-tiny, vit-tiny and seq2seq-tiny "
                   "(default: train them in a temporary folder)")
    p.add_argument("--text-model", action="append", default=None, help="model of the attention and "
                   "generation requests, e.g. smollm2 (repeatable: one scenario each; default runs/gpt-tiny)")
    p.add_argument("--server-path", default=None, help="also run each scenario with the server from this "
                   "qkv checkout (e.g. a worktree of an older commit)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    n, concurrency = (40, 10) if args.quick else (args.requests, args.concurrency)
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    scenarios = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        runs = Path(args.runs) if args.runs else train_tiny_runs(Path(tmp))
        train_s = time.perf_counter() - t0
        meter = C.LoadMeter()
        for text_model in args.text_model or ["runs/gpt-tiny"]:
            for server_path in [None] + ([args.server_path] if args.server_path else []):
                for patient in (False, True):
                    if patient and 503 not in scenarios[-1]["summary"]["statuses"]:
                        continue  # nothing to retry: the patient clients would repeat the run
                    scenarios.append(serve_and_drive(runs, Path(tmp) / "cache", server_path, n, concurrency,
                                                     text_model, patient))
                    report(scenarios[-1], n, concurrency)
    result = {"machine": machine, "quick": args.quick, "requests": n, "concurrency": concurrency, "mix": MIX,
              "train_tiny_runs_s": round(train_s, 1), "scenarios": scenarios, "load": meter.stop()}
    print(C.load_line(result["load"]))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    failed = [(r["text_model"], r["server_path"], r["summary"]["bad_statuses"], r["summary"]["stream_errors"])
              for r in scenarios if r["summary"]["bad_statuses"] or r["summary"]["stream_errors"]]
    if failed:
        print(f"FAILED (responses that are not 2xx/4xx/503, or failed streams): {failed}", file=sys.stderr)
        return 1
    return 0


def drive(base: str, server: subprocess.Popen, n: int, concurrency: int, text_model: str,
          patient: bool) -> dict:
    """Wait for the server, warm each model up, run the load; the numbers."""
    import httpx

    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            httpx.get(base + "/api/models", timeout=2)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not answer within 60 s") from None
            time.sleep(0.1)
    t0 = time.perf_counter()
    image = png(20)
    with httpx.Client(base_url=base, timeout=300) as c:
        for kind in ("attention", "generate", "image", "seq2seq"):
            r = c.request(**make_request(kind, 0, text_model, image))
            if r.status_code != 200:
                raise SystemExit(f"warm-up {kind} failed: {r.status_code} {r.text[:300]}")
    warmup_s = time.perf_counter() - t0
    idle = proc_status(server.pid)
    watch = Watch(server.pid)
    watch.start()
    t0 = time.perf_counter()
    results = run_load(base, plan(n), concurrency, text_model, patient)
    wall = time.perf_counter() - t0
    watch.stop.set()
    watch.join()
    end = proc_status(server.pid)
    version = httpx.get(base + "/openapi.json", timeout=10).json()["info"]["version"]
    return {"server": f"qkv {version} (python -m qkv serve)", "warmup_s": round(warmup_s, 1),
            "wall_s": round(wall, 2), "requests_per_s": round(n / wall, 1), "summary": summarise(results),
            "server_rss_after_warmup_mb": round(idle.get("VmRSS", 0) / 1024, 1),
            "server_peak_rss_mb": round(max(end.get("VmHWM", 0), watch.peak_rss_kb) / 1024, 1),
            "server_peak_threads": watch.peak_threads, "server_threads_at_end": end.get("Threads")}


if __name__ == "__main__":
    sys.exit(main())
