"""Decoding beside other work: SmolLM2-135M q4 decoded by qkv and by llama.cpp while another
process takes part of one core (a student's laptop with a browser open, a shared server, a
cloud host's neighbours), each against itself on an idle machine.

Why: a step of two threads that meet at a barrier five times a layer is as fast as its slower
thread. With each product's units split into fixed shares, a thread whose core is taken for a
while holds the other at every barrier; qkv's native step now lets each thread claim what is left
of the other's share (``claimed`` in ``qkv/kernels/qmatmul.cpp``). This script measures what that
buys and where qkv then stands against llama.cpp (whose matrix products also hand out chunks as
threads come for them).

- qkv, each in a process of its own, greedy through the default decoder, tokens/s after the
  first: this checkout's kernel, and ``--against``'s (a git revision: by default the last one
  with fixed shares) compiled under qkv's namespace; their first greedy tokens compared.
- llama.cpp: ``llama-bench -p 0 -n <new tokens>``, its portable and native builds where found
  (``--build-llama-cpp`` builds what is missing, ~10 minutes each).
- The other work: a process of this script's, pinned to the last CPU this process may use,
  spinning ``--busy`` of every 4 ms and sleeping the rest (``--busy 0``: none); started before a
  condition's decoders and ended after them, every round: the idle condition and the busy one
  alternate, as do the decoders within each.

Ratios are taken within a round and condition; medians reported.

    python benchmarks/busy_core.py --rounds 6
    python benchmarks/busy_core.py --busy 0.75 --against 42a655a
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

NAME = "busy_core"
ROOT = HERE.parents[1]
SOURCE = "qkv/kernels/qmatmul.cpp"
# the last revision whose native step split every product into fixed shares
FIXED_SHARES = "42a655a"

# One qkv kernel in a process of its own: argv: a qmatmul.cpp to build first (or "" for this
# checkout's), the prompt's text, the benchmarks' folder. Prints what it runs, then for each
# line "N" on stdin decodes N tokens greedily and prints the rate after the first.
CHILD = """
import json, sys, tempfile
from pathlib import Path
import torch
source, text = sys.argv[1], sys.argv[2]
if source:
    from qkv.kernels import compile_library
    with tempfile.TemporaryDirectory(prefix="qkv-busy-") as tmp:
        compile_library(Path(tmp) / "qmatmul_other.so", namespace="qkv", source=Path(source))
        torch.ops.load_library(str(Path(tmp) / "qmatmul_other.so"))  # before qkv loads its own
import qkv
from qkv.generation import generate
sys.path.insert(0, sys.argv[3])
import _common as C
lm = qkv.load("smollm2")
x = torch.tensor([lm.tokenizer.encode(text)[:32]])
said = []
tokens = [int(t[0]) for t in generate(lm.model, x, 32, temperature=0.0, on_decision=said.append)]
print(json.dumps({"decoder": said[0].kind, "tokens": tokens}), flush=True)
for line in sys.stdin:
    print(json.dumps({"rate": C.decode_rate(lm.model, x, int(line), temperature=0.0)}), flush=True)
"""

# The other work: argv: the CPU, the busy fraction of each 4 ms, this script's pid. Runs until it is
# ended, or until this script is gone (killed before its cleanup ran: the hog is then another
# process's child and stops by itself).
HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
busy, parent = 0.004 * float(sys.argv[2]), int(sys.argv[3])
while os.getppid() == parent:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(0.004 - busy)
"""


def fixed_shares_source(rev: str, folder: Path) -> Path:
    """``rev``'s qmatmul.cpp as a file in ``folder`` (SystemExit naming the problem if git has none)."""
    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"no {SOURCE} at {rev!r}: {r.stderr.strip()} (give --against a revision of this "
                         "repository; a shallow clone may lack it)")
    out = folder / "qmatmul_fixed_shares.cpp"
    out.write_text(r.stdout)
    return out


def end_hog(hog: subprocess.Popen) -> None:
    """End the other work (this script's own process: it runs until it is killed)."""
    hog.kill()
    hog.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each idle and busy (default 5)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="tokens each decoder decodes a round (default 128)")
    ap.add_argument("--busy", type=float, default=0.5,
                    help="the fraction of every 4 ms the other work spins on the last CPU (default 0.5)")
    ap.add_argument("--against", default=FIXED_SHARES,
                    help="the revision whose kernel is timed beside this checkout's "
                         f"(default {FIXED_SHARES}, the last with fixed shares)")
    ap.add_argument("--build-llama-cpp", action="store_true",
                    help="build llama.cpp's llama-bench where it is not built (~10 minutes each)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/busy_core.json)")
    args = ap.parse_args()
    if args.rounds < 1 or args.new_tokens < 2:
        ap.error("--rounds must be at least 1 and --new-tokens at least 2")
    if not 0 <= args.busy < 1:
        ap.error(f"--busy is a fraction of each 4 ms in [0, 1), got {args.busy}")

    import torch
    from _llama_cpp import llama_bench_builds, run_llama_bench

    from qkv.assets import asset_path

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    threads = torch.get_num_threads()
    cpu = max(os.sched_getaffinity(0))
    gguf = asset_path("smollm2")
    found = llama_bench_builds(build=args.build_llama_cpp, log=lambda line: print(line, flush=True))
    peers = {k: v for k, v in found.items() if k in ("llama.cpp portable", "llama.cpp native")}
    conditions = ("idle", f"busy {args.busy:g}")

    with tempfile.TemporaryDirectory(prefix="qkv-busy-core-") as tmp:
        fixed = f"qkv at {args.against}" + (" (fixed shares)" if args.against == FIXED_SHARES else "")
        ours = {"qkv": "", fixed: str(fixed_shares_source(args.against, Path(tmp)))}
        children: dict[str, subprocess.Popen] = {}
        heads: dict[str, dict] = {}
        hog: subprocess.Popen | None = None
        rates: dict[str, dict[str, list[float]]] = {c: {k: [] for k in (*ours, *peers)} for c in conditions}
        try:
            for label, source in ours.items():
                t = time.perf_counter()
                children[label] = subprocess.Popen(
                    [sys.executable, "-c", CHILD, source, C.DECODE_TEXT, str(HERE.parent)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": str(threads)})
                line = children[label].stdout.readline()
                if not line:
                    raise SystemExit(f"{label}'s process ended before it decoded (see above)")
                heads[label] = json.loads(line)
                print(f"{label}: {heads[label]['decoder']} decoder; loaded and warmed in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
            same = len({json.dumps(v["tokens"]) for v in heads.values()}) == 1
            print(f"qkv's first 32 greedy tokens equal in both processes: {same}", flush=True)

            def decode(label: str) -> float:
                if label in children:
                    children[label].stdin.write(f"{args.new_tokens}\n")
                    children[label].stdin.flush()
                    line = children[label].stdout.readline()
                    if not line:
                        raise SystemExit(f"{label}'s process ended while decoding (see above)")
                    return json.loads(line)["rate"]
                got = run_llama_bench(peers[label], gguf, threads=threads, prompt=0, new=args.new_tokens,
                                      reps=1)
                return got["decode"]["tokens_per_s"]

            for r in range(args.rounds):
                for cond in (conditions if r % 2 == 0 else conditions[::-1]):
                    if cond != "idle" and args.busy > 0:
                        hog = subprocess.Popen([sys.executable, "-c", HOG, str(cpu), str(args.busy),
                                                str(os.getpid())])
                        time.sleep(0.2)
                        if hog.poll() is not None:
                            raise SystemExit(f"the other work ended at once (exit {hog.returncode}; "
                                             "see above)")
                    labels = [*ours, *peers]
                    for label in (labels if r % 2 == 0 else labels[::-1]):
                        rates[cond][label].append(decode(label))
                    if hog is not None:
                        end_hog(hog)
                        hog = None
                    said = ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates[cond].items())
                    print(f"round {r + 1}, {cond}: {said} tok/s", flush=True)
        finally:
            if hog is not None:
                end_hog(hog)
            for child in children.values():
                C.end_child(child)

    ratios: dict[str, list[float]] = {}
    for cond in conditions:
        got = rates[cond]
        if peers:
            best = [max(got[k][r] for k in peers) for r in range(args.rounds)]
            ratios[f"{cond}: qkv ÷ the faster llama.cpp"] = [a / b for a, b in zip(got["qkv"], best,
                                                                                     strict=True)]
        ratios[f"{cond}: qkv ÷ {fixed}"] = [a / b for a, b in zip(got["qkv"], got[fixed], strict=True)]
    for label in (*ours, *peers):
        ratios[f"{label}: busy ÷ idle"] = [a / b for a, b in zip(rates[conditions[1]][label],
                                                                   rates["idle"][label], strict=True)]
    C.print_table(f"SmolLM2-135M q4, greedy, {args.new_tokens} tokens, {threads} threads; the other work "
                  f"spins {args.busy:g} of every 4 ms on CPU {cpu}",
                  ["condition", "decoder", "tok/s (median)", "rounds"],
                  [[cond, k, f"{C.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}"]
                   for cond in conditions for k, v in rates[cond].items()])
    C.print_table("ratios within rounds", ["ratio", "median", "rounds"],
                  [[k, f"{C.median(v):.2f}", f"{min(v):.2f}-{max(v):.2f}"] for k, v in ratios.items()])
    out = C.write_json(NAME, {
        "machine": machine, "threads": threads, "busy_fraction": args.busy, "busy_cpu": cpu,
        "against": args.against, "new_tokens": args.new_tokens, "same_greedy_tokens": same,
        "decoders": {k: v["decoder"] for k, v in heads.items()},
        "tokens_per_s": {c: {k: [round(x, 2) for x in v] for k, v in rates[c].items()} for c in conditions},
        "ratios": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
        "ratio_medians": {k: round(C.median(v), 3) for k, v in ratios.items()}}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
