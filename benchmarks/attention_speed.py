"""Forward+backward and forward-only time of qkv's attention backends, relative to PyTorch.

Baseline: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)``
called directly. Contenders: ``qkv.attention.attention(..., backend=...)`` with each of
``sdpa``, ``chunked`` and ``reference``, on the same tensors, in the same run. Shapes:
B=8, H=8, D=64, causal self-attention, T in 256..4096, fp32 and bf16.

Method (why the numbers are ratios): absolute times on a shared machine drift, so every
cell times all contenders round-robin after one warm-up call each: each round runs the
baseline and qkv's ``sdpa`` back to back (their order alternating, over an even number of
rounds), then the other backends in a rotating order. The ratio reported is the
median over rounds of (contender time / baseline time in the same round), so a burst of
load from another process, which hits both calls of a round, cancels out; the min–max of
the per-round ratios is shown beside it, and the median times per call.

A second, small measurement isolates the per-call cost of going through
``qkv.attention.attention`` instead of calling PyTorch: many forward calls at T=8.

Goals checked at the end: qkv ``sdpa`` fwd+bwd ≤ 1.05× the direct PyTorch call, and
``chunked`` forward ≤ 3× ``sdpa`` at T=4096.

Run ``python benchmarks/attention_speed.py --help`` for the options; ``qkv bench`` runs it.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Callable

import _common as C
import torch
import torch.nn.functional as F

from qkv.attention.functional import attention

NAME = "attention_speed"
BASELINE = "torch"
CONTENDERS = ("torch", "sdpa", "chunked", "reference")
ALWAYS_TIMED = ("torch", "sdpa")  # the headline ratio: never skipped for time
MODES = ("fwd+bwd", "fwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
B, H, D = 8, 8, 64
FULL_T = (256, 512, 1024, 2048, 4096)
QUICK_T = (256, 512)
# Most rounds per cell (fewer at large T, where one call already averages a lot of work).
FULL_REPEATS = {256: 15, 512: 11, 1024: 7, 2048: 5, 4096: 3}
QUICK_REPEATS = 3
MIN_REPEATS_HEADLINE = 3  # torch and sdpa always get at least this many rounds
WARMUP_UNDER_S = 5.0  # calls predicted longer than this skip the warm-up (overhead < 1%)

# Reference backend memory, bytes per score element (fp32 softmax), estimated by reading
# scaled_dot_product_attention: forward keeps scores, the bool mask and its negation, x - max,
# exp and the normalised weights alive at its peak (~13 B); with autograd the saved exp and
# weights plus the backward's T×S temporaries come to ~25 B. attention_memory.py measures it.
REFERENCE_BYTES_PER_SCORE = {"fwd": 13, "fwd+bwd": 25}

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def contender_fns() -> dict[str, Fn]:
    return {
        "torch": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa": lambda q, k, v: attention(q, k, v, is_causal=True, backend="sdpa").out,
        "chunked": lambda q, k, v: attention(q, k, v, is_causal=True, backend="chunked").out,
        "reference": lambda q, k, v: attention(q, k, v, is_causal=True, backend="reference").out,
    }


def time_call(fn: Fn, mode: str, q, k, v, dout) -> float:
    """Seconds for one forward (no_grad) or one forward + backward."""
    if mode == "fwd":
        with torch.no_grad():
            t0 = time.perf_counter()
            fn(q, k, v)
            return time.perf_counter() - t0
    for x in (q, k, v):
        x.grad = None
    t0 = time.perf_counter()
    fn(q, k, v).backward(dout)
    return time.perf_counter() - t0


def predict(history: dict, key: tuple, T: int) -> float | None:
    """Predicted seconds per call at T from the last measured T (cost ∝ T², conservative)."""
    if key not in history:
        return None
    t_prev, T_prev = history[key]
    return t_prev * (T / T_prev) ** 2


def run_cell(dtype_name: str, T: int, mode: str, args, history: dict, fns: dict) -> dict:
    """Time every contender for one (dtype, T, mode); returns a JSON-able dict."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(T)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)

    cell: dict = {"dtype": dtype_name, "T": T, "mode": mode, "contenders": {}}
    active: dict[str, int] = {}  # contender -> rounds to run
    max_rounds = args.repeats or (QUICK_REPEATS if args.quick else FULL_REPEATS.get(T, 3))
    for name in args.backends:
        entry: dict = {"samples": []}
        cell["contenders"][name] = entry
        key = (dtype_name, mode, name)
        if name == "reference":
            need = B * H * T * T * REFERENCE_BYTES_PER_SCORE[mode]
            avail = C.mem_available_gb()
            budget = args.budget_gb * 1e9
            if avail is not None:
                budget = min(budget, 0.9 * avail * 2**30)
            if need > budget:
                entry["skipped"] = f"skipped (needs ~{need / 1e9:.0f} GB)"
                continue
        est = predict(history, key, T)
        if name not in ALWAYS_TIMED and est is not None and est > args.max_call_s:
            entry["skipped"] = f"skipped (~{est:.0f} s per call predicted)"
            continue
        if est is None or est < WARMUP_UNDER_S:
            est = time_call(fns[name], mode, q, k, v, dout)  # warm-up, also an estimate
            entry["warmup_s"] = est
        n = math.floor(args.cell_s / max(est, 1e-9))
        n = max(n, MIN_REPEATS_HEADLINE if name in ALWAYS_TIMED else 1)
        active[name] = min(n, max_rounds)

    if BASELINE in active:  # the baseline runs in every round, so every sample has a pair
        active[BASELINE] = max(active.values())
        if active[BASELINE] > 1:  # even, so that both orders of the headline pair count alike
            active[BASELINE] += active[BASELINE] % 2
        for name in ALWAYS_TIMED:
            if name in active:
                active[name] = active[BASELINE]
    rounds = max(active.values(), default=0)
    head = [n for n in ALWAYS_TIMED if n in active]
    rest = [n for n in args.backends if n in active and n not in head]
    for r in range(rounds):
        # torch and sdpa back to back, in alternating order (whatever ran just before, e.g.
        # the reference freeing gigabytes, affects the first of them); the others rotate.
        pair = head if r % 2 == 0 else head[::-1]
        shift = r % len(rest) if rest else 0
        for name in pair + rest[shift:] + rest[:shift]:
            if r < active[name]:
                gc.collect()
                t = time_call(fns[name], mode, q, k, v, dout)
                cell["contenders"][name]["samples"].append(t)
        print(".", end="", flush=True)

    base = cell["contenders"].get(BASELINE, {}).get("samples") or []
    for name, entry in cell["contenders"].items():
        s = entry["samples"]
        if not s:
            continue
        entry["median_s"] = C.median(s)
        history[(dtype_name, mode, name)] = (entry["median_s"], T)
        if base:
            # Headline: median over rounds of (contender / baseline in the same round). Both
            # saw the same load in a round, so a burst from another process cancels out;
            # the ratio of the two medians is kept too (it does not pair the rounds).
            paired = [a / b for a, b in zip(s, base, strict=False)]
            entry["ratio"] = C.median(paired)
            entry["ratio_of_medians"] = entry["median_s"] / C.median(base)
            entry["paired_ratio_min"] = min(paired)
            entry["paired_ratio_max"] = max(paired)
    return cell


def dispatch_overhead(blocks: int, calls: int) -> dict:
    """Per-call time of attention(backend="sdpa") vs the direct call at a tiny size.

    At B=8 H=8 T=8 D=64 the kernel itself takes microseconds, so the difference is qkv's
    Python work per call (argument checks, dispatch). Blocks of calls are interleaved.
    """
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 8, D, generator=g) for _ in range(3))
    fns = {
        "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa": lambda: attention(q, k, v, is_causal=True, backend="sdpa"),
    }
    per: dict[str, list[float]] = {n: [] for n in fns}
    with torch.no_grad():
        for r in range(blocks + 1):
            for name in fns if r % 2 else reversed(fns):
                fn = fns[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                if r:  # block 0 is the warm-up
                    per[name].append((time.perf_counter() - t0) / calls)
    t, sd = C.median(per["torch"]), C.median(per["sdpa"])
    return {"shape": {"B": B, "H": H, "T": 8, "D": D}, "calls_per_block": calls,
            "blocks": blocks, "torch_us": t * 1e6, "sdpa_us": sd * 1e6,
            "overhead_us": (sd - t) * 1e6}


def fmt_ratio(entry: dict, is_base: bool) -> str:
    if "skipped" in entry:
        return entry["skipped"]
    if "ratio" not in entry:
        return "-"
    if is_base:
        return "1.00 (baseline)"
    lo, hi = entry["paired_ratio_min"], entry["paired_ratio_max"]
    spread = f" ({lo:.2f}–{hi:.2f})" if len(entry["samples"]) > 1 else " (n=1)"
    return f"{entry['ratio']:.2f}{spread}"


def goals(cells: list[dict]) -> list[dict]:
    """The two project goals, evaluated on what was measured."""
    out = []
    by = {(c["dtype"], c["T"], c["mode"]): c["contenders"] for c in cells}
    for (dt, T, mode), cs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if mode == "fwd+bwd" and "ratio" in cs.get("sdpa", {}):
            r = cs["sdpa"]["ratio"]
            out.append(
                {"goal": "sdpa fwd+bwd ≤ 1.05× torch", "dtype": dt, "T": T,
                 "value": r, "met": r <= 1.05}
            )
    for (dt, T, mode), cs in by.items():
        if mode == "fwd" and T == 4096:
            ch, sd = cs.get("chunked", {}), cs.get("sdpa", {})
            if "median_s" in ch and "median_s" in sd:
                r = ch["median_s"] / sd["median_s"]
                out.append(
                    {"goal": "chunked fwd ≤ 3× sdpa at T=4096", "dtype": dt, "T": T,
                     "value": r, "met": r <= 3.0}
                )
            elif "skipped" in ch:
                out.append(
                    {"goal": "chunked fwd ≤ 3× sdpa at T=4096", "dtype": dt, "T": T,
                     "value": None, "met": None, "note": ch["skipped"]}
                )
    return out


def print_results(cells, overhead, machine: dict, load: dict, backends) -> None:
    cols = ["dtype", "T", "backend", "fwd+bwd", "fwd+bwd ×torch", "fwd", "fwd ×torch", "n"]
    by = {(c["dtype"], c["T"], c["mode"]): c["contenders"] for c in cells}
    rows = []
    for dt, T in dict.fromkeys((c["dtype"], c["T"]) for c in cells):
        for name in backends:
            fb = by.get((dt, T, "fwd+bwd"), {}).get(name, {})
            fw = by.get((dt, T, "fwd"), {}).get(name, {})
            n = f"{len(fb.get('samples', []))}/{len(fw.get('samples', []))}"
            rows.append([
                dt, str(T), name,
                C.fmt_time(fb.get("median_s")), fmt_ratio(fb, name == BASELINE),
                C.fmt_time(fw.get("median_s")), fmt_ratio(fw, name == BASELINE), n,
            ])
    title = f"Attention time, B={B} H={H} D={D}, causal (median per call)"
    C.print_table(title, cols, rows)
    print(
        "×torch = median over rounds of (time / time of calling "
        "F.scaled_dot_product_attention directly in the same round); lower is faster; in "
        "brackets the min–max of the per-round ratios; n = rounds timed, fwd+bwd/fwd."
    )
    o = overhead
    print(
        f"qkv dispatch overhead (forward at T=8, {o['blocks']}×{o['calls_per_block']} calls): "
        f"attention(backend='sdpa') {o['sdpa_us']:.1f} µs vs direct {o['torch_us']:.1f} µs "
        f"per call, {o['overhead_us']:+.1f} µs"
    )
    print(f"machine: {C.machine_line(machine)}")
    print(f"run: {C.load_line(load)}")
    for g in goals(cells):
        if g["met"] is None:
            print(f"goal {g['goal']} [{g['dtype']}]: not measured, {g['note']}")
        else:
            verdict = "met" if g["met"] else "MISSED"
            print(f"goal {g['goal']} [{g['dtype']} T={g['T']}]: {g['value']:.2f} -> {verdict}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Times every qkv backend against calling torch.nn.functional."
        "scaled_dot_product_attention directly, interleaved round by round in one run, and "
        "prints ratios (median over rounds of contender time / baseline time in the same "
        f"round). Writes benchmarks/results/{NAME}.json.",
        epilog="Cells are skipped, with the reason printed, when the reference backend's "
        "T×T matrices would not fit in --budget-gb, or when a chunked/reference call is "
        "predicted (from the previous T, scaling by T²) to take longer than --max-call-s. "
        "torch and sdpa are always timed. The full run takes ~20-25 min on 2 cores.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"T in {QUICK_T}, fp32 only, {QUICK_REPEATS} rounds: a smoke run")
    p.add_argument("--T", type=int, nargs="+", default=None,
                   help=f"sequence lengths (default {FULL_T})")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None,
                   help="dtypes (default: fp32 bf16; --quick: fp32)")
    p.add_argument("--backends", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
                   help="contenders; 'torch' is the baseline and is always included")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="fwd+bwd (autograd forward + backward) and/or fwd (under no_grad)")
    p.add_argument("--repeats", type=int, default=None,
                   help="most rounds per cell (default: 15 at T=256 down to 3 at T=4096; "
                   "torch and sdpa round it up to even)")
    p.add_argument("--cell-s", type=float, default=None,
                   help="time target per contender per cell: slow contenders get fewer "
                   "rounds, at least 1 (torch and sdpa at least 3); default 30 (quick: 5)")
    p.add_argument("--max-call-s", type=float, default=45.0,
                   help="skip a chunked/reference cell whose single call is predicted "
                   "to take longer than this (default 45 s)")
    p.add_argument("--budget-gb", type=float, default=10.0,
                   help="memory budget for the reference backend's T×T matrices "
                   "(default 10 GB; also capped at 90%% of MemAvailable)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", default=None,
                   help=f"output path (default benchmarks/results/{NAME}.json)")
    args = p.parse_args(argv)
    args.T = args.T or (QUICK_T if args.quick else FULL_T)
    args.dtypes = args.dtypes or (["fp32"] if args.quick else list(DTYPES))
    args.cell_s = args.cell_s or (5.0 if args.quick else 30.0)
    if BASELINE not in args.backends:
        args.backends.insert(0, BASELINE)
    args.backends = [b for b in CONTENDERS if b in args.backends]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = C.machine_info()
    print(f"machine: {C.machine_line(machine)}", flush=True)
    meter = C.LoadMeter()
    fns = contender_fns()
    history: dict = {}
    cells = []
    for dt in args.dtypes:
        for T in sorted(args.T):
            for mode in args.modes:
                print(f"{dt} T={T} {mode} ", end="", flush=True)
                t0 = time.perf_counter()
                cells.append(run_cell(dt, T, mode, args, history, fns))
                print(f" {time.perf_counter() - t0:.0f} s", flush=True)
    overhead = dispatch_overhead(blocks=5 if args.quick else 20, calls=200)
    load = meter.stop()
    payload = {
        "benchmark": NAME,
        "shape": {"B": B, "H": H, "D": D, "causal": True},
        "baseline": "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)",
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": machine,
        "run": load,
        "dispatch_overhead": overhead,
        "cells": cells,
        "goals": goals(cells),
    }
    path = C.write_json(NAME + ("_quick" if args.quick else ""), payload, args.json)
    print_results(cells, overhead, machine, load, args.backends)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
