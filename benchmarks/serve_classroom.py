"""A classroom on one `qkv serve`: students at once for a minute, each mixing the page's requests
on SmolLM2 (the lens with and without heads knocked out, activation patching, a q·k row, one
layer's attention, generation greedy and sampled), as issue 39's load test made them.

Before the compute loop, `/api/patch` put its hooks on the shared model while other requests ran
their forward passes through it: 386 of 2,822 requests answered 500 and 933 were refused (503).
Here the server is ``python -m qkv serve`` in a subprocess on a free port (``--server-path DIR``:
also the server of another checkout, e.g. a worktree of the commit before, under the same load).
First every request is asked once, alone, one at a time: its answer is the reference. Then
``--students`` clients at once, for ``--seconds``, each going round the list from its own place
(a student who gets a 503 reads it for a second, then goes on). Recorded: every status (a 5xx
fails the goal), the share of 503s (goal < 5%), latency p50/p95/max per kind, and for every 200
whether it equals the same request alone: lens, q·k, patching and attention exactly (they run
alone on the model), generation the same tokens and each attention row within 1e-4 (a row of a
running batch equals its request alone to float rounding).

    python benchmarks/serve_classroom.py                      # 8 students, 60 s (~2 minutes)
    python benchmarks/serve_classroom.py --students 30 --seconds 120 --think 5 15 --own 0.5
                                        # issue 52's class: think time, half on their own texts
    git worktree add /tmp/before 96c6774 && python benchmarks/serve_classroom.py --server-path /tmp/before
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common as C
from serve_batch import free_port, wait_ready

NAME = "serve_classroom"
TEXT = ("The history of the city begins with a small settlement on an island in the river. Over the "
        "centuries it grew into a centre of trade and learning.")
IOI = ("When Mary and John went to the store, John gave a drink to",
       "When Mary and John went to the store, Mary gave a drink to")
REQUESTS: list[tuple[str, str, dict]] = [
    ("lens", "/api/lens", {"model": "smollm2", "text": TEXT}),
    ("lens, heads knocked out", "/api/lens", {"model": "smollm2", "text": IOI[0],
                                             "ablate": [[3, 1], [10, 4]]}),
    # the exact sweep (a forward pass per head): the estimate, /api/patch's default since issue 54,
    # needs float weights and the server's SmolLM2 is q4 (it answers 422, saying so)
    ("patch", "/api/patch", {"model": "smollm2", "clean": IOI[0], "corrupt": IOI[1], "site": "head",
                             "answer": " Mary", "wrong": " John", "method": "exact"}),
    ("q·k", "/api/qk", {"model": "smollm2", "text": TEXT, "layer": 5, "head": 2, "query": 20}),
    ("attention", "/api/attention", {"model": "smollm2", "text": IOI[1], "layer": 4}),
    ("generate", "/api/generate", {"model": "smollm2", "prompt": "Once upon a time,", "max_new_tokens": 32,
                                   "layer": -1}),
    ("generate, sampled", "/api/generate", {"model": "smollm2", "prompt": "The best way to learn is",
                                            "max_new_tokens": 24, "temperature": 0.8, "seed": 3,
                                            "layer": 10}),
]


def own(body: dict, k: int) -> dict:
    """Student ``k``'s own version of a request: a sentence of the student's before each of its
    texts (before, so that a prompt's last token, which patching and generation read, stays)."""
    mine = f"Student {k} read this in {1700 + 7 * k}. "
    out = dict(body)
    for field in ("text", "prompt", "clean", "corrupt"):
        if field in out:
            out[field] = mine + out[field]
    return out


def ask(url: str, path: str, body: dict, client: str = "", times: list[float] | None = None
        ) -> tuple[int, object, float]:
    """(status, the answer without its timing, seconds); ``client``: the page's X-QKV-Client;
    ``times``: for a generation, filled with the seconds from the request to each token event
    (read as the stream delivers them: time to first token, the gaps between tokens)."""
    headers = {"Content-Type": "application/json", **({"X-QKV-Client": client} if client else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status = r.status
            if path == "/api/generate":
                lines = []
                for line in iter(r.readline, b""):
                    lines.append(line.decode())
                    if times is not None and b'"event":"token"' in line:
                        times.append(time.perf_counter() - t0)
                raw = "".join(lines)
            else:
                raw = r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode(errors="replace")
    except OSError as e:  # a reset connection: reported as such, never hidden
        return 599, f"connection: {e}", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    if status != 200:
        return status, raw[:300], seconds
    if path == "/api/generate":
        events = [json.loads(x) for x in raw.splitlines()]
        return status, [{k: v for k, v in e.items() if k != "seconds"} for e in events], seconds
    return status, {k: v for k, v in json.loads(raw).items() if k != "seconds"}, seconds


def difference(got: object, want: object) -> str:
    """Where an answer first differs from the same request alone, in a few words ("" when equal):
    lens, q·k, patching and attention exactly (they run alone on the model), a generation's events
    exactly but for each attention row, within 1e-4 (a row of a running batch equals its request
    alone to float rounding)."""
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return f"{len(got)} events, alone {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            for key in sorted(set(g) | set(w)):
                if g.get(key) != w.get(key):
                    a, b = g.get(key), w.get(key)
                    if key == "weights" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                        most = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
                        if most <= 1e-4:
                            continue  # float rounding of a running batch's row
                        return f"event {i}: weights differ by {most:.2e}"
                    return f"event {i}: {key} {str(a)[:40]!r}, alone {str(b)[:40]!r}"
        return ""
    if isinstance(got, dict) and isinstance(want, dict):
        keys = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
        return f"fields {keys[:5]}" if keys else ""
    return "" if got == want else "different types"


def classroom(url: str, students: int, seconds: float, think: tuple[float, float] = (0.0, 0.0),
              own_share: float = 0.0, checked: int = 3, during: Callable[[], Callable[[], None]] | None = None
              ) -> dict:
    """``students`` clients for ``seconds``, each waiting a uniform ``think`` seconds between
    requests; the first ``own_share`` of them ask about texts of their own (:func:`own`), the
    others the teacher's. Answers are compared with the same request alone: the teacher's asked
    before the class, the own texts of the first ``checked`` such students asked after it.
    ``during()`` is called as the class starts (busy programs, a replica to stop); what it returns,
    as it ends."""
    import random

    alone, alone_s = [], {}
    for kind, path, body in REQUESTS:
        status, answer, s = ask(url, path, body)
        if status != 200:
            raise RuntimeError(f"{kind} alone answered {status}: {answer}")
        alone.append(answer)
        alone_s[kind] = round(s, 3)
        print(f"  alone: {kind:24s} {s:6.2f} s", flush=True)
    n_own = round(own_share * students)
    records: list[tuple[str, int, float, bool | None, int, int]] = []
    first_token: list[float] = []  # seconds from a generation request to its first token
    gaps: list[float] = []  # seconds between two tokens of one stream
    examples: list[str] = []  # how the first answers unequal to alone differ
    own_answers: dict[tuple[int, int], object] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def student(k: int) -> None:
        rng = random.Random(k)
        i = k
        if think[1] > 0:
            time.sleep(rng.uniform(0, think[1]))  # students do not all start at once
        while time.monotonic() < deadline:
            j = i % len(REQUESTS)
            kind, path, body = REQUESTS[j]
            mine = k < n_own
            times: list[float] = []
            status, answer, s = ask(url, path, own(body, k) if mine else body, f"student-{k:04d}", times)
            ok = None if mine else status == 200 and not difference(answer, alone[j])
            with lock:
                if times:
                    first_token.append(times[0])
                    gaps.extend(b - a for a, b in itertools.pairwise(times))
                if ok is False and status == 200 and len(examples) < 5:
                    examples.append(f"{kind}: {difference(answer, alone[j])}")
                records.append((kind, status, s, ok, k, j))
                if mine and status == 200 and k < checked:
                    own_answers[(k, j)] = answer
            if status == 503:
                time.sleep(1.0)
            elif think[1] > 0:
                time.sleep(rng.uniform(*think))
            i += 1

    end = during() if during is not None else None
    try:
        with ThreadPoolExecutor(students) as pool:
            list(pool.map(student, range(students)))
    finally:
        if end is not None:
            end()
    own_equal, unequal = 0, Counter(f"{r[0]} (the teacher's text)" for r in records
                                    if r[1] == 200 and r[3] is False)
    for (k, j), answer in own_answers.items():  # the own texts' answers, against the same alone
        kind, path, body = REQUESTS[j]
        status, want, _ = ask(url, path, own(body, k))
        equal = status == 200 and not difference(answer, want)
        own_equal += equal
        if not equal:
            unequal[f"{kind} (a text of its own)"] += 1
            if status == 200 and len(examples) < 5:
                examples.append(f"{kind}, own text: {difference(answer, want)}")
    statuses = Counter(r[1] for r in records)
    served = [r for r in records if r[1] == 200]
    by_kind = {}
    for kind, *_ in REQUESTS:
        lat = sorted(r[2] for r in records if r[0] == kind and r[1] == 200)
        by_kind[kind] = {"n": sum(k == kind for k, *_ in records), "ok": len(lat),
                         "p50_s": round(statistics.median(lat), 3) if lat else None,
                         "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
                         "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
                         "max_s": round(lat[-1], 3) if lat else None}
    lat = sorted(r[2] for r in records if r[1] == 200)
    teachers = [r for r in served if r[3] is not None]
    return {"alone_s": alone_s, "requests": len(records),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "errors_5xx": sum(v for k, v in statuses.items() if k >= 500 and k != 503),
            "busy_503_share": round(statuses.get(503, 0) / max(len(records), 1), 4),
            "served_equal_to_alone": sum(bool(r[3]) for r in teachers) + own_equal,
            "served": len(teachers) + len(own_answers),
            "served_all": len(served), "unequal_to_alone": dict(unequal),
            "unequal_examples": examples,
            "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
            "first_token_s": _quantiles(first_token), "inter_token_s": _quantiles(gaps),
            "by_kind": by_kind}


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    at = lambda q: round(xs[int(q * (len(xs) - 1))], 4)  # noqa: E731
    return {"n": len(xs), "p50": at(0.5), "p95": at(0.95), "p99": at(0.99), "max": round(xs[-1], 4)}


NGINX = """worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream qkv {{
        least_conn;
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 12m;
        location / {{
            proxy_pass http://qkv;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""  # docs/serving.md shows the same configuration


def _server(path: Path, port: int, threads: int | None = None) -> subprocess.Popen:
    """``python -m qkv serve`` of the checkout at ``path``; ``threads``: its torch threads (replicas
    on one machine share its cores: more threads than cores in all and every one waits)."""
    # QKV_SAVED_STEP_BACKGROUND=off: a checkout from before issue 39 would otherwise start a
    # background build when idle, which outlives it (this checkout knows no such variable)
    env = {**os.environ, "PYTHONPATH": str(path), "QKV_SAVED_STEP_BACKGROUND": "off",
           **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--port", str(port), "--runs",
                             str(path / "runs-none")], cwd=path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_server(path: Path, students: int, seconds: float, think: tuple[float, float] = (0.0, 0.0),
               own_share: float = 0.0, replicas: int = 1, busy: int = 0, stop_one_at: float | None = None
               ) -> dict:
    """The class on ``replicas`` servers of the checkout at ``path`` (more than one: behind nginx,
    least connections), with ``busy`` CPU-bound programs running through the class, and replica 0
    stopped ``stop_one_at`` seconds into it."""
    import shutil
    import tempfile

    ports = [free_port() for _ in range(replicas)]
    threads = max(1, (os.cpu_count() or 1) // replicas) if replicas > 1 else None
    procs = [_server(path, p, threads) for p in ports]
    extra: list[subprocess.Popen] = []
    folder = tempfile.mkdtemp(prefix="qkv-classroom-")
    try:
        for p, proc in zip(ports, procs, strict=True):
            wait_ready(f"http://127.0.0.1:{p}/api/models", proc)
        url = f"http://127.0.0.1:{ports[0]}"
        if replicas > 1:
            nginx = shutil.which("nginx") or "/usr/sbin/nginx"
            port = free_port()
            conf = Path(folder) / "nginx.conf"
            conf.write_text(NGINX.format(dir=folder, port=port, servers="\n".join(
                f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=30s;" for p in ports)))
            extra.append(subprocess.Popen([nginx, "-c", str(conf), "-p", folder], stderr=subprocess.DEVNULL))
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/api/models", extra[-1])

        def during() -> Callable[[], None]:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            timer = threading.Timer(stop_one_at, _stop, (procs[0],)) if stop_one_at is not None else None
            if timer is not None:
                timer.start()

            def end() -> None:
                if timer is not None:
                    timer.cancel()
                for h in hogs:
                    _stop(h)
            return end

        got = classroom(url, students, seconds, think, own_share, during=during)
        if stop_one_at is not None:
            got["stopped_replica_at_s"] = stop_one_at
        return got
    finally:
        for proc in extra + procs:
            _stop(proc)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--students", type=int, nargs="+", default=[8],
                    help="class sizes, one class after the other (e.g. 10 30 60 100)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--think", type=float, nargs=2, default=(0.0, 0.0), metavar=("MIN", "MAX"),
                    help="seconds each student thinks between requests (uniform; default none: back to back)")
    ap.add_argument("--own", type=float, default=0.0,
                    help="the share of students asking about texts of their own (default 0: the teacher's)")
    ap.add_argument("--busy", type=int, default=0,
                    help="CPU-bound programs running beside the server through the class (default 0)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="servers behind nginx (least connections; needs nginx: apt-get install nginx-light)")
    ap.add_argument("--stop-one-at", type=float, default=None, metavar="S",
                    help="with --replicas: stop one replica S seconds into the class")
    ap.add_argument("--server-path", default=None,
                    help="also the server of this checkout (a worktree), at the first class size")
    ap.add_argument("--quick", action="store_true", help="20 seconds (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 20.0)
        args.out = args.out or str(Path(__file__).resolve().parent / "results" / f"{NAME}_quick.json")
    if not C.have_assets(NAME, ("smollm2",)):
        return 1
    machine = C.machine_info()
    print(C.machine_line(machine))
    here = Path(__file__).resolve().parents[1]
    plan = [("this checkout", here, n) for n in args.students]
    if args.server_path:  # the previous release under the same first class, measured in this run
        plan.insert(0, ("other checkout", Path(args.server_path).resolve(), args.students[0]))
    result: dict = {"machine": machine, "students": args.students, "seconds": args.seconds,
                    "think_s": list(args.think), "own_share": args.own, "busy_programs": args.busy,
                    "replicas": args.replicas, "requests": [k for k, _, _ in REQUESTS], "runs": []}
    rows = []
    for name, path, students in plan:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        print(f"{name} ({commit}): {students} students for {args.seconds:g} s", flush=True)
        got = run_server(path, students, args.seconds, tuple(args.think), args.own, args.replicas, args.busy,
                         args.stop_one_at)
        got.update(server=name, commit=commit, students=students)
        result["runs"].append(got)
        k = got["by_kind"]
        rows.append([f"{name} ({commit})", str(students), str(got["requests"]), json.dumps(got["statuses"]),
                     f"{got['served_equal_to_alone']}/{got['served']}",
                     *(str(k[kind]["p95_s"]) for kind in ("lens", "lens, heads knocked out", "q·k", "patch")),
                     str(got["first_token_s"].get("p95")), str(got["inter_token_s"].get("p99"))])
        for kind, v in k.items():
            print(f"  {kind:24s} {v['ok']}/{v['n']} served, p50 {v['p50_s']} s, p95 {v['p95_s']} s, "
                  f"p99 {v['p99_s']} s, max {v['max_s']} s")
        print(f"  first token {got['first_token_s']}, between tokens {got['inter_token_s']}", flush=True)
    title = (f"a class on {args.replicas} qkv serve for {args.seconds:g} s, SmolLM2, think {args.think[0]:g}-"
             f"{args.think[1]:g} s, {args.busy} busy programs (goals at 30: p95 <= 1 s for lens, knock-out, "
             "q·k; patching <= 3 s; first token p95 <= 1 s; between tokens p99 <= 0.1 s)")
    C.print_table(title, ["server", "students", "requests", "statuses", "equal to alone", "lens p95",
                          "knock-out p95", "q·k p95", "patch p95", "1st token p95", "gap p99"], rows)
    out = C.write_json(NAME, result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
