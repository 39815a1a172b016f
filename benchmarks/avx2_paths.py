"""qkv's AVX2 build and llama.cpp's AVX2 build decoding SmolLM2-135M (the bundled Q4_1 GGUF) side by
side on this CPU: the code an AVX2-only CPU (AMD Zen 3) runs, timed where no such CPU is at hand.

This is not a Zen 3 measurement, and says so: the cores, their caches and memory are this CPU's
(a 95 MB model fits an AMX Xeon's L3; a Zen 3's 32 MB L3 does not, and it reads the weights from
DRAM at about half the bandwidth). What it does measure: whether qkv's AVX2 code paths (the
4-bit and 8-bit products, the native step's attention and float work in 8-lane vectors) keep up
with llama.cpp's own AVX2 paths from the same memory, and what the AVX-512 paths gain over them.

- qkv: its kernel library compiled with ``-march=haswell`` (AVX2, FMA, F16C: the paths a Zen 3
  takes), loaded under qkv's own ops namespace before qkv loads its library, so the native step
  and every product run it (``int4_path()`` says "avx2"); in a child process, qkv's build for
  this CPU; and, where this CPU has AVX-VNNI, in another child the AVX2 build with
  ``-mavxvnni`` (``avx2-vnni``: what ``-march=native`` compiles on Intel's Alder Lake and later
  cores, which have AVX-VNNI and no AVX-512). Greedy, a 32-token prompt and ``--new-tokens``
  tokens, tokens/s after the first; the builds' first 32 greedy tokens compared.
- llama.cpp: ``llama-bench -t <threads> -p 0 -n <new tokens>``, built portable with AVX-512 off
  (``avx2/``: what a Zen 3 runs), and its builds for this CPU (portable with AVX-512;
  ``GGML_NATIVE=ON``) for reference; ``--build-llama-cpp`` builds what is missing (~10 minutes
  each).

Rounds alternated; ratios within rounds, medians reported.

    python benchmarks/avx2_paths.py --rounds 7
    python benchmarks/avx2_paths.py --quick          # one round of 16 tokens
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

NAME = "avx2_paths"
TEXT = C.DECODE_TEXT

# qkv's own build for this CPU, or the build argv[2]'s flags give, in a process of its own (one
# process loads one library under qkv's namespace): for each line "N" on stdin decodes 1 and N
# tokens greedily, prints the rate.
CHILD = """
import json, sys, tempfile, time
from pathlib import Path
import torch
if len(sys.argv) > 2:
    from qkv.kernels import compile_library
    with tempfile.TemporaryDirectory(prefix="qkv-avx2-") as tmp:
        compile_library(Path(tmp) / "qmatmul_child.so", tuple(sys.argv[2].split()), namespace="qkv")
        torch.ops.load_library(str(Path(tmp) / "qmatmul_child.so"))  # before qkv loads its own
import qkv
import qkv.kernels as K
from qkv.generation import generate
lm = qkv.load("smollm2")
x = torch.tensor([lm.tokenizer.encode(sys.argv[1])[:32]])
said = []
tokens = [int(t[0]) for t in generate(lm.model, x, 32, temperature=0.0, on_decision=said.append)]
print(json.dumps({"path": K.int4_status(), "decoder": said[0].kind, "tokens": tokens}), flush=True)
for line in sys.stdin:
    n = int(line)
    t = time.perf_counter(); list(generate(lm.model, x, 1, temperature=0.0)); first = time.perf_counter() - t
    t = time.perf_counter(); list(generate(lm.model, x, n, temperature=0.0)); full = time.perf_counter() - t
    print(json.dumps({"rate": (n - 1) / max(full - first, 1e-9)}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--build-llama-cpp", action="store_true",
                    help="build llama.cpp's llama-bench where it is not built (~10 minutes each)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one round of 16 tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 16

    import torch
    from _llama_cpp import llama_bench_builds, run_llama_bench

    from qkv.kernels import compile_library

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    if not {"avx2", "fma", "f16c"} <= C.cpu_flags():
        raise SystemExit("this CPU has no AVX2 (with FMA and F16C): nothing to time")
    with tempfile.TemporaryDirectory(prefix="qkv-avx2-") as tmp:
        t = time.perf_counter()
        compile_library(Path(tmp) / "qmatmul_avx2.so", ("-march=haswell",), namespace="qkv")
        torch.ops.load_library(str(Path(tmp) / "qmatmul_avx2.so"))  # before qkv loads its own
        print(f"qkv's AVX2 build compiled and loaded in {time.perf_counter() - t:.1f} s", flush=True)
    import qkv
    import qkv.kernels as K
    from qkv.assets import asset_path
    from qkv.generation import generate

    assert torch.ops.qkv.int4_path() == "avx2" and K.int4_status() == "qkv's (avx2)", K.int4_status()
    lm = qkv.load("smollm2")
    m = lm.model
    x = torch.tensor([lm.tokenizer.encode(TEXT)[:32]])
    n_new, threads = args.new_tokens, torch.get_num_threads()
    said: list = []
    tokens = [int(t[0]) for t in generate(m, x, 32, temperature=0.0, on_decision=said.append)]
    decoder = said[0].kind

    def ours() -> float:
        return C.decode_rate(m, x, n_new, temperature=0.0)

    # label -> extra argv of the child: qkv's build for this CPU; the AVX2 build with AVX-VNNI
    kids = {"qkv build for this CPU": []}
    if "avx_vnni" in C.cpu_flags():
        kids["qkv AVX2+AVX-VNNI build"] = ["-march=haswell -mavxvnni"]
    children = {k: subprocess.Popen([sys.executable, "-c", CHILD, TEXT, *a], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for k, a in kids.items()}
    try:
        heads = {}
        for k, child in children.items():
            line = child.stdout.readline()
            if not line:
                raise SystemExit(f"{k}'s process ended before it decoded (see above)")
            heads[k] = json.loads(line)
            print(f"{k} (child): {heads[k]['path']}, {heads[k]['decoder']} decoder; first 32 greedy tokens "
                  f"equal the AVX2 build's: {heads[k]['tokens'] == tokens}", flush=True)
        print(f"qkv AVX2 build: {K.int4_status()}, {decoder} decoder", flush=True)

        def rate_of(label: str):
            def theirs() -> float:
                children[label].stdin.write(f"{n_new}\n")
                children[label].stdin.flush()
                return json.loads(children[label].stdout.readline())["rate"]
            return theirs

        peers = llama_bench_builds(build=args.build_llama_cpp, log=lambda line: print(line, flush=True))
        if "llama.cpp AVX2" not in peers:
            print("llama.cpp's AVX2 build is missing (--build-llama-cpp builds it): qkv's builds alone",
                  flush=True)
        gguf = asset_path("smollm2")
        qkv_runs = {"qkv AVX2 build": ours, **{k: rate_of(k) for k in children}}
        for f in qkv_runs.values():  # warm
            f()
        rates: dict[str, list[float]] = {k: [] for k in (*qkv_runs, *peers)}
        for r in range(args.rounds):
            for k, f in (list(qkv_runs.items()) if r % 2 == 0 else list(qkv_runs.items())[::-1]):
                rates[k].append(f())
            for k, binary in peers.items():
                rates[k].append(run_llama_bench(binary, gguf, threads=threads, prompt=0, new=n_new,
                                                reps=1)["decode"]["tokens_per_s"])
            line = ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items())
            print(f"round {r + 1}: {line} tok/s", flush=True)
    finally:
        for child in children.values():
            C.end_child(child, timeout=30)

    def ratio(a: str, b: str) -> list[float] | None:
        return [x / y for x, y in zip(rates[a], rates[b], strict=True)] if a in rates and b in rates else None

    if len(peers) > 1:  # the faster of llama.cpp's builds for this CPU, round by round
        rates["(the faster llama.cpp for this CPU)"] = [
            max(v[r] for k, v in rates.items() if k in ("llama.cpp portable", "llama.cpp native"))
            for r in range(args.rounds)]
    ratios = {"qkv AVX2 ÷ llama.cpp AVX2": ratio("qkv AVX2 build", "llama.cpp AVX2"),
              "qkv AVX2+AVX-VNNI ÷ qkv AVX2": ratio("qkv AVX2+AVX-VNNI build", "qkv AVX2 build"),
              "qkv AVX2 ÷ qkv for this CPU": ratio("qkv AVX2 build", "qkv build for this CPU"),
              "llama.cpp AVX2 ÷ llama.cpp portable": ratio("llama.cpp AVX2", "llama.cpp portable"),
              "qkv for this CPU ÷ the faster llama.cpp for this CPU":
                  ratio("qkv build for this CPU", "(the faster llama.cpp for this CPU)")}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    C.print_table(f"SmolLM2 q4, greedy, {n_new} tokens, {threads} threads (qkv: {decoder} decoder)",
                  ["decoder", "tok/s (median)", "rounds", "ms a token"],
                  [[k, f"{C.median(v):.1f}", f"{min(v):.0f}-{max(v):.0f}", f"{1e3 / C.median(v):.2f}"]
                   for k, v in rates.items()])
    C.print_table("ratios within rounds", ["ratio", "median", "rounds"],
                  [[k, f"{C.median(v):.2f}", f"{min(v):.2f}-{max(v):.2f}"] for k, v in ratios.items()])
    out = C.write_json(NAME + ("_quick" if args.quick else ""), {
        "machine": machine, "threads": threads, "new_tokens": n_new, "qkv_decoder": decoder,
        # each child's first greedy tokens against the AVX2 build's
        "same_greedy_tokens": {k: h["tokens"] == tokens for k, h in heads.items()},
        "qkv_paths": {k: h["path"] for k, h in heads.items()},
        "tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "ratios": {k: [round(v, 3) for v in vs] for k, vs in ratios.items()},
        "ratio_medians": {k: round(C.median(v), 3) for k, v in ratios.items()}}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
