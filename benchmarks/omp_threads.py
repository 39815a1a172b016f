"""Decoding from a thread while another thread holds an OpenMP pool: why `qkv serve` runs every
model computation on one compute loop, one thread (``qkv/serve/loop.py``).

PyTorch's CPU kernels (and qkv's saved decoding steps) use OpenMP; libgomp keeps a pool of worker
threads for every thread that ever ran a parallel region, for as long as that thread lives, and
once there are more OpenMP threads than cores it lets every pool's workers sleep between
parallel regions. Measured here on SmolLM2 (the default q4 weights, through the saved step where
this machine has one, else eagerly), greedy, 64 new tokens after a 12-token prompt, tok/s:

- ``main``: loaded and decoded in the main thread (the usual script);
- ``other thread, a pool alive``: loaded in the main thread (its pool stays), decoded in another
  thread (a web handler after a load at start-up);
- ``other thread, no pool alive``: loaded in a thread that has ended, decoded in another (what
  ``qkv serve`` did before its compute loop: every computation in a thread that ends with it;
  the loop now loads and decodes in one thread, which the ``main`` case stands for).

Rounds alternate; the median of ``--rounds`` is reported, with every sample.

    python benchmarks/omp_threads.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import _common as C

NAME = "omp_threads"
PROMPT = "Once upon a time, in a small village by the sea,"

CHILD = r"""
import json, sys, threading, time
import torch
import qkv
from qkv.generation import generate

case, n, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def load():
    lm = qkv.load("smollm2")
    return lm, torch.tensor([lm.tokenizer.encode(prompt)])

def rate(lm, ids):
    list(generate(lm.model, ids, 8, temperature=0.0))  # warm
    t = time.perf_counter()
    list(generate(lm.model, ids, n, temperature=0.0))
    return n / (time.perf_counter() - t)

def in_thread(f, *a):
    out = []
    t = threading.Thread(target=lambda: out.append(f(*a)))
    t.start(); t.join()
    return out[0]

if case == "main":
    lm, ids = load(); r = rate(lm, ids)
elif case == "pool":
    lm, ids = load(); r = in_thread(rate, lm, ids)
else:
    lm, ids = in_thread(load); r = in_thread(rate, lm, ids)
print(json.dumps({"tok_s": r}))
"""

CASES = {"main": "main thread", "pool": "other thread, a pool alive", "none": "other thread, no pool alive"}


def run(case: str, n: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, case, str(n), PROMPT], capture_output=True, text=True,
                         check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not C.have_assets(NAME, ("smollm2",)):  # qkv and llama.cpp only: no reference packages
        return 1
    machine = C.machine_info()
    print(C.machine_line(machine))
    samples: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        for case in (CASES if r % 2 == 0 else list(CASES)[::-1]):
            samples[case].append(round(run(case, args.new_tokens), 1))
            print(f"round {r + 1}: {CASES[case]:30s} {samples[case][-1]:6.1f} tok/s", flush=True)
    med = {c: C.median(v) for c, v in samples.items()}
    C.print_table(f"SmolLM2 decode tok/s by thread ({args.new_tokens} new tokens, median of {args.rounds})",
                  ["case", "tok/s", "samples", "x main thread"],
                  [[CASES[c], f"{med[c]:.1f}", ", ".join(map(str, samples[c])),
                    f"{med[c] / med['main']:.2f}x"] for c in CASES])
    out = C.write_json(NAME, {"machine": machine, "new_tokens": args.new_tokens,
                              "samples_tok_s": {CASES[c]: v for c, v in samples.items()},
                              "median_tok_s": {CASES[c]: m for c, m in med.items()}}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
