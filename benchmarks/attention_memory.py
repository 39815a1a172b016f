"""Peak memory of qkv's attention backends at long sequence lengths (CPU, honest RSS).

``chunked`` (online softmax over key tiles) against ``reference`` (the T×T matrix written
out) and ``sdpa`` (PyTorch's fused kernel, for context), causal, B=1, H=1, D=64, fp32, at
T = 4096, 16384, 32768; forward (under no_grad) and forward + backward.

Method: every cell runs in a fresh Python subprocess, which reports its peak resident set
size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after the call. A second fresh
subprocess does the same work *except* the call (same imports, same inputs, the same tiny
warm-up calls of every backend at T=128 so that library start-up buffers are counted in
both) and its peak is subtracted. What is left is the memory the attention call itself needed at its peak,
including everything it returned or saved for backward.

Run ``python benchmarks/attention_memory.py --help`` for the options; ``qkv bench`` runs it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time

import _common as C
import torch

NAME = "attention_memory"
B, H, D = 1, 1, 64
FULL_T = (4096, 16384, 32768)
QUICK_T = (1024, 4096)
ROWS = (
    ("chunked", "fwd"),
    ("reference", "fwd"),
    ("sdpa", "fwd"),
    ("chunked", "fwd+bwd"),
    ("reference", "fwd+bwd"),
    ("sdpa", "fwd+bwd"),
)
# Reference backend, bytes per score element at its peak (see attention_speed.py for how
# these were estimated from the code; the table below measures them: column "B/score").
REFERENCE_BYTES_PER_SCORE = {"fwd": 13, "fwd+bwd": 25}
BACKENDS = ("chunked", "reference", "sdpa")
WARM_T = 128


# --------------------------------------------------------------------------- child process


def child(spec: dict) -> None:
    """Allocate inputs, warm up, optionally run the call; print peak RSS as JSON."""
    from qkv.attention.functional import attention

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    backend, mode, T = spec["backend"], spec["mode"], spec["T"]
    grad = mode == "fwd+bwd"

    def inputs(n: int):
        g = torch.Generator().manual_seed(n)
        q, k, v, dout = (torch.randn(B, H, n, D, generator=g) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(grad)
        return q, k, v, dout

    def call(q, k, v, dout, name):
        if grad:
            attention(q, k, v, is_causal=True, backend=name).out.backward(dout)
        else:
            with torch.no_grad():
                attention(q, k, v, is_causal=True, backend=name)

    for name in BACKENDS:  # code paths, thread pool, BLAS buffers: counted in both runs
        call(*inputs(WARM_T), name)
    q, k, v, dout = inputs(T)
    t0 = time.perf_counter()
    if backend is not None:
        call(q, k, v, dout, backend)
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"peak_rss_bytes": peak, "seconds": elapsed}))


def run_child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        why = "killed (out of memory?)" if p.returncode < 0 else f"exit {p.returncode}"
        tail = p.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"{why} {tail[0]}".strip()}
    return json.loads(p.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- parent


def estimate_bytes(backend: str, mode: str, T: int) -> float | None:
    if backend != "reference":
        return None  # O(T): nothing to budget
    return B * H * T * T * REFERENCE_BYTES_PER_SCORE[mode]


def run_cell(backend: str, mode: str, T: int, args, baselines: dict) -> dict:
    cell: dict = {"backend": backend, "mode": mode, "T": T, "score_matrix_bytes": 4 * T * T}
    need = estimate_bytes(backend, mode, T)
    if need is not None:
        cell["estimate_bytes"] = need
        budget = args.budget_gb * 1e9
        avail = C.mem_available_gb()
        if avail is not None:
            budget = min(budget, 0.9 * avail * 2**30)
        if need > budget:
            cell["skipped"] = f"skipped (needs ~{need / 1e9:.0f} GB)"
            return cell
    spec = {"backend": backend, "mode": mode, "T": T, "threads": args.threads}
    if (mode, T) not in baselines:  # one input-only process per (mode, T), shared
        baselines[(mode, T)] = run_child({**spec, "backend": None}, args.timeout)
    base = baselines[(mode, T)]
    meas = run_child(spec, args.timeout)
    for name, r in (("baseline", base), ("measured", meas)):
        if "error" in r:
            cell["error"] = f"{name} run: {r['error']}"
            return cell
    cell["baseline_rss_bytes"] = base["peak_rss_bytes"]
    cell["measured_rss_bytes"] = meas["peak_rss_bytes"]
    cell["peak_bytes"] = max(meas["peak_rss_bytes"] - base["peak_rss_bytes"], 0)
    cell["seconds"] = meas["seconds"]
    return cell


def cell_text(c: dict) -> str:
    if "skipped" in c:
        return c["skipped"]
    if "error" in c:
        return f"failed: {c['error']}"
    return f"{C.fmt_bytes(c['peak_bytes'])} ({C.fmt_time(c['seconds'])})"


def growth(cells: list[dict], backend: str, mode: str, Ts: list[int]) -> list[dict]:
    peaks = {
        c["T"]: c["peak_bytes"]
        for c in cells
        if c["backend"] == backend and c["mode"] == mode and c.get("peak_bytes")
    }
    out = []
    for a, b in itertools.pairwise(Ts):
        if a in peaks and b in peaks:
            out.append({"from_T": a, "to_T": b, "ratio": peaks[b] / peaks[a],
                        "linear": b / a, "quadratic": (b / a) ** 2})
    return out


def print_results(cells: list[dict], Ts: list[int], machine: dict, load: dict) -> None:
    cols = ["backend", "mode", "", *[f"T={T}" for T in Ts]]
    rows = [["(T×T fp32 scores)", "", "", *[C.fmt_bytes(4 * T * T) for T in Ts]]]
    by = {(c["backend"], c["mode"], c["T"]): c for c in cells}
    for backend, mode in dict.fromkeys((c["backend"], c["mode"]) for c in cells):
        rows.append([backend, mode, "peak", *[cell_text(by[(backend, mode, T)]) for T in Ts]])
        per = []
        for T in Ts:
            c = by[(backend, mode, T)]
            per.append(f"{c['peak_bytes'] / (T * T):.2f}" if c.get("peak_bytes") else "-")
        rows.append(["", "", "B/score", *per])
    C.print_table(
        f"Peak memory of one attention call, B={B} H={H} D={D} fp32 causal (fresh process each)",
        cols, rows,
    )
    print(
        "peak = ru_maxrss of a process that made the call minus that of one that only "
        "allocated the inputs (and warmed up at T=128); in brackets the call's time. "
        "B/score = peak / T² (a T×T fp32 matrix is 4 B/score)."
    )
    for backend, mode in (("chunked", "fwd"), ("chunked", "fwd+bwd")):
        for g in growth(cells, backend, mode, Ts):
            print(
                f"{backend} {mode}: peak(T={g['to_T']}) / peak(T={g['from_T']}) = "
                f"{g['ratio']:.2f}  (linear would be {g['linear']:.0f}, "
                f"quadratic {g['quadratic']:.0f})"
            )
    print(f"machine: {C.machine_line(machine)}")
    print(f"run: {C.load_line(load)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Each cell is a fresh subprocess; its peak RSS minus that of a subprocess that "
        "only allocated the inputs is the call's peak memory. Shows chunked growing ~O(T) "
        f"while reference grows O(T²). Writes benchmarks/results/{NAME}.json.",
        epilog="A reference cell whose estimated need (~13 B per score forward, ~25 B with "
        "backward) exceeds --budget-gb, or 90% of MemAvailable, is skipped and printed as "
        "'skipped (needs ~X GB)'. The full run takes a few minutes on 2 cores.",
    )
    p.add_argument("--quick", action="store_true", help=f"T in {QUICK_T}: a smoke run")
    p.add_argument("--T", type=int, nargs="+", default=None,
                   help=f"sequence lengths (default {FULL_T})")
    p.add_argument("--budget-gb", type=float, default=16.0,
                   help="memory budget for the reference backend (default 16 GB)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads in the subprocesses (default: torch's choice)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds before a subprocess is abandoned (default 900)")
    p.add_argument("--json", default=None,
                   help=f"output path (default benchmarks/results/{NAME}.json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.T = sorted(args.T or (QUICK_T if args.quick else FULL_T))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    machine = C.machine_info()
    if args.threads:
        machine["torch_threads"] = args.threads
    print(f"machine: {C.machine_line(machine)}", flush=True)
    meter = C.LoadMeter()
    cells: list[dict] = []
    baselines: dict = {}
    for backend, mode in ROWS:
        for T in args.T:
            print(f"{backend} {mode} T={T} ... ", end="", flush=True)
            t0 = time.perf_counter()
            cells.append(run_cell(backend, mode, T, args, baselines))
            print(f"{cell_text(cells[-1])} [{time.perf_counter() - t0:.0f} s]", flush=True)
    load = meter.stop()
    payload = {
        "benchmark": NAME,
        "shape": {"B": B, "H": H, "D": D, "dtype": "fp32", "causal": True},
        "method": "peak ru_maxrss of a fresh subprocess minus that of one that only "
        "allocated the inputs (both warmed up with every backend at T=128)",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
        "machine": machine,
        "run": load,
        "cells": cells,
        "growth": {
            f"{b} {m}": growth(cells, b, m, args.T) for b, m in (("chunked", "fwd"),
                                                                 ("chunked", "fwd+bwd"))
        },
    }
    path = C.write_json(NAME + ("_quick" if args.quick else ""), payload, args.json)
    print_results(cells, args.T, machine, load)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
