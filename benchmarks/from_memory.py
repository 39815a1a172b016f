"""Decoding a model that no cache level holds: SmolLM2-135M's 30 blocks repeated until its GGUF is
larger than this CPU's last-level cache, decoded by qkv's builds and llama.cpp's from the same
file, each against the bandwidth this CPU reads such a buffer at.

Why: an AMX Xeon's 300-480 MB L3 holds SmolLM2's 95 MB, so every decoding ratio measured there is
a ratio of reads from L3. An AMD EPYC's 32 MB of L3 per CCD holds none of it: a Zen 3, 4 or 5
decodes from DRAM. This script puts the same code in that regime here, so that the native step's
streaming (its reads ahead, its barriers, the int8 head) is timed where memory and not the cores
sets the pace. It is a proxy, and says so: the cores, the memory and its controller are this
CPU's, not an AMD one's; the weights are SmolLM2's, repeated (the text it decodes means nothing,
its speed is what a model of that size decodes at).

- qkv, in a child process each: its kernel library built for this CPU (what a Zen 4 or Zen 5 runs
  where it has AVX-512 VNNI), the same with the native step's prefetches as they are for a model
  the cache holds (``QKV_NATIVE_PREFETCH=near``: what the far ones buy, see
  ``qkv.generation.native_step.prefetch_far``), and built with ``-march=haswell`` (AVX2, FMA,
  F16C: a Zen 3's paths); greedy through the default decoder, tokens/s after the first; their
  first greedy tokens compared.
- llama.cpp: ``llama-bench -p 0 -n <new tokens>``, every build found: AVX2 (AVX-512 off),
  portable, ``GGML_NATIVE=ON`` (``--build-llama-cpp`` builds what is missing, ~10 minutes each).
- The limit: the best of ``--reads`` reads of a float32 buffer as large as the weights a token
  reads, before the rounds and three more in each round (a host busy for a moment at the start
  once read 14 GB/s where the rounds read 27); each decoder's fraction of it is tokens/s × bytes a
  token ÷ that bandwidth.

``--head-too`` repeats the vocabulary as often as the blocks (the token embedding, SmolLM2's tied
output matrix, with as many copies of its rows; the copies' tokens unused): the output head keeps
its share of a token's bytes (a third of llama.cpp's, a fifth of qkv's greedy steps', which rank
with a 4-bit copy of it), as an AMD EPYC reading SmolLM2 itself from DRAM would read them; without
it the head is a twentieth of the bytes.

Rounds alternated; ratios within rounds, medians reported.

    python benchmarks/from_memory.py --rounds 5
    python benchmarks/from_memory.py --rounds 5 --head-too
    python benchmarks/from_memory.py --quick       # one round of 16 tokens, two copies of the blocks
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

NAME = "from_memory"

# One qkv build in a process of its own (one process loads one library under qkv's namespace):
# argv: the GGUF, "cpu" or "avx2", the prompt's text. Prints what it runs, then for each line "N"
# on stdin decodes N tokens greedily and prints the rate after the first.
CHILD = """
import json, sys, tempfile
from pathlib import Path
import torch
gguf, build, text = sys.argv[1], sys.argv[2], sys.argv[3]
if build == "avx2":
    from qkv.kernels import compile_library
    with tempfile.TemporaryDirectory(prefix="qkv-avx2-") as tmp:
        compile_library(Path(tmp) / "qmatmul_avx2.so", ("-march=haswell",), namespace="qkv")
        torch.ops.load_library(str(Path(tmp) / "qmatmul_avx2.so"))  # before qkv loads its own
import qkv
import qkv.kernels as K
from qkv.generation import generate
from qkv.generation.native_step import prefetch_far
sys.path.insert(0, sys.argv[4])
import _common as C
from decode_limit import weight_bytes
lm = qkv.load(gguf, cache=False)  # (which hands the conversion's freed heap back: three fit in RAM)
x = torch.tensor([lm.tokenizer.encode(text)[:32]])
said = []
tokens = [int(t[0]) for t in generate(lm.model, x, 32, temperature=0.0, on_decision=said.append)]
print(json.dumps({"path": K.int4_status(), "decoder": said[0].kind, "tokens": tokens,
                  "bytes": sum(weight_bytes(lm.model, greedy=said[0].kind == "native").values()),
                  "far": prefetch_far(lm.model)}), flush=True)
for line in sys.stdin:
    print(json.dumps({"rate": C.decode_rate(lm.model, x, int(line), temperature=0.0)}), flush=True)
"""


def repeated_gguf(src: Path, dst: Path, repeats: int, vocab: int = 1) -> int:
    """Write ``src`` (a llama GGUF) with its blocks repeated ``repeats`` times into ``dst``: the
    same metadata but the block count, every block's tensors copied (the weights are SmolLM2's, so
    its tokenizer and shapes hold). ``vocab`` > 1: the vocabulary too, its token embedding (the
    tied output matrix) that many times as many rows, the copies' tokens unused ones
    (``<|qkv-unused-N|>``, type 5), so the head keeps its share of a token's bytes. Returns the
    bytes of tensor data."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "llama")
    blocks = 0
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        kind = f.types[0]
        if f.name == "llama.block_count":
            blocks = int(f.parts[f.data[0]][0])
            w.add_uint32(f.name, blocks * repeats)
        elif f.name == "llama.vocab_size":
            w.add_uint32(f.name, int(f.parts[f.data[0]][0]) * vocab)
        elif kind == GGUFValueType.ARRAY:
            strings = f.types[1] == GGUFValueType.STRING
            items = [bytes(f.parts[i]).decode("utf-8") if strings else f.parts[i].tolist()[0] for i in f.data]
            n = len(items)
            if f.name == "tokenizer.ggml.tokens":
                items += [f"<|qkv-unused-{i}|>" for i in range(n, n * vocab)]
            elif f.name == "tokenizer.ggml.token_type":
                items += [5] * (n * (vocab - 1))  # llama.cpp's UNUSED
            elif f.name == "tokenizer.ggml.scores":
                items += [-1e9] * (n * (vocab - 1))  # (a SentencePiece vocabulary's: never chosen)
            w.add_array(f.name, items)
        elif kind == GGUFValueType.STRING:
            w.add_string(f.name, bytes(f.parts[f.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], kind)
    if blocks == 0:
        raise SystemExit(f"{src} names no llama.block_count: not a llama GGUF")
    if vocab > 1 and any(t.name == "output.weight" for t in r.tensors):
        raise SystemExit(f"{src} has an output matrix of its own: --head-too repeats a tied embedding only")
    order = [(t.name, t) for t in r.tensors if not t.name.startswith("blk.")]
    for copy in range(repeats):
        for i in range(blocks):
            order += [(t.name.replace(f"blk.{i}.", f"blk.{copy * blocks + i}.", 1), t)
                      for t in r.tensors if t.name.startswith(f"blk.{i}.")]
    for name, t in order:
        data = np.concatenate([t.data] * vocab) if name == "token_embd.weight" and vocab > 1 else t.data
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sum(int(t.n_bytes) * (vocab if name == "token_embd.weight" else 1) for name, t in order)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None,
                    help="copies of SmolLM2's 30 blocks (default: enough for twice the last-level cache)")
    ap.add_argument("--reads", type=int, default=10,
                    help="reads of the bandwidth's buffer before the rounds (three more each round; the best "
                         "of them all is the limit)")
    ap.add_argument("--build-llama-cpp", action="store_true",
                    help="build llama.cpp's llama-bench where it is not built (~10 minutes each)")
    ap.add_argument("--head-too", action="store_true",
                    help="repeat the vocabulary (the output head's rows) as often as the blocks: SmolLM2's "
                         "proportions from DRAM")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one round of 16 tokens, two copies")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens, args.repeats = 1, 16, args.repeats or 2

    import torch
    from _llama_cpp import llama_bench_builds, run_llama_bench
    from decode_limit import bandwidth

    from qkv.assets import asset_path
    from qkv.generation.native_step import last_level_cache

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    threads = torch.get_num_threads()
    llc = last_level_cache()
    src = asset_path("smollm2")
    block_bytes = 66_355_200  # SmolLM2's 30 blocks in Q4_1 (the head and norms are read once more)
    repeats = args.repeats or max(2, -(-2 * (llc or 2**28) // block_bytes))
    peers = llama_bench_builds(build=args.build_llama_cpp, log=lambda line: print(line, flush=True))
    if not {"avx2", "fma", "f16c"} <= C.cpu_flags():
        raise SystemExit("this CPU has no AVX2 (with FMA and F16C): llama.cpp's builds here need it")

    with tempfile.TemporaryDirectory(prefix="qkv-from-memory-") as tmp:
        vocab = repeats if args.head_too else 1
        gguf = Path(tmp) / f"smollm2-x{repeats}{'-vocab' if vocab > 1 else ''}.gguf"
        t = time.perf_counter()
        nbytes = repeated_gguf(src, gguf, repeats, vocab)
        print(f"{gguf.name}: {30 * repeats} blocks, the vocabulary x{vocab}, {C.fmt_bytes(nbytes)} of "
              "weights a token "
              f"(last-level cache {C.fmt_bytes(llc)}), written in {time.perf_counter() - t:.1f} s",
              flush=True)
        reads = [bandwidth(nbytes, args.reads)]
        gbs = reads[0]
        print(f"read bandwidth {gbs:.1f} GB/s ({threads} threads, a {C.fmt_bytes(nbytes)} buffer): "
              f"the limit is {gbs * 1e9 / nbytes:.1f} tok/s", flush=True)

        # (label, build, QKV_NATIVE_PREFETCH): the default decides by the model's size; "near" is
        # the step's prefetches as they are for a model the cache holds
        builds = {"qkv (build for this CPU)": ("cpu", ""), "qkv, near prefetches only": ("cpu", "near"),
                  "qkv AVX2 build": ("avx2", "")}
        children: dict[str, subprocess.Popen] = {}
        heads: dict[str, dict] = {}
        try:
            for label, (build, prefetch) in builds.items():
                t = time.perf_counter()
                children[label] = subprocess.Popen(
                    [sys.executable, "-c", CHILD, str(gguf), build, C.DECODE_TEXT, str(HERE.parent)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": str(threads), "QKV_NATIVE_PREFETCH": prefetch})
                line = children[label].stdout.readline()
                if not line:
                    raise SystemExit(f"{label}'s process ended before it decoded (see above)")
                heads[label] = json.loads(line)
                print(f"{label}: {heads[label]['path']}, {heads[label]['decoder']} decoder, "
                      f"{C.fmt_bytes(heads[label]['bytes'])} a token, prefetches "
                      f"{'far' if heads[label]['far'] else 'near'}; loaded and warmed in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
            same = len({json.dumps(v["tokens"]) for v in heads.values()}) == 1
            if heads["qkv (build for this CPU)"]["far"] == heads["qkv, near prefetches only"]["far"]:
                print("the default took the near prefetches too (the model fits the cache, or none is "
                      "reported): no far-against-near ratio", flush=True)
            print(f"qkv's first 32 greedy tokens equal in every process: {same}", flush=True)

            def ours(label: str) -> float:
                children[label].stdin.write(f"{args.new_tokens}\n")
                children[label].stdin.flush()
                return json.loads(children[label].stdout.readline())["rate"]

            rates: dict[str, list[float]] = {k: [] for k in (*children, *peers)}
            for r in range(args.rounds):
                for label in (list(children) if r % 2 == 0 else list(children)[::-1]):
                    rates[label].append(ours(label))
                for label, binary in (peers.items() if r % 2 == 0 else list(peers.items())[::-1]):
                    got = run_llama_bench(binary, gguf, threads=threads, prompt=0, new=args.new_tokens,
                                          reps=1)
                    rates[label].append(got["decode"]["tokens_per_s"])
                reads.append(bandwidth(nbytes, 3))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
                      + f" tok/s; read {reads[-1]:.1f} GB/s", flush=True)
        finally:
            for child in children.values():
                C.end_child(child)

    def ratio(a: str, b: str) -> list[float] | None:
        return [x / y for x, y in zip(rates[a], rates[b], strict=True)] if a in rates and b in rates else None

    faster = [k for k in ("llama.cpp portable", "llama.cpp native") if k in rates]
    if faster:
        rates["(the faster llama.cpp for this CPU)"] = [max(rates[k][r] for k in faster)
                                                        for r in range(args.rounds)]
    ratios = {"qkv for this CPU ÷ the faster llama.cpp for this CPU":
                  ratio("qkv (build for this CPU)", "(the faster llama.cpp for this CPU)"),
              "qkv AVX2 ÷ llama.cpp AVX2": ratio("qkv AVX2 build", "llama.cpp AVX2"),
              "qkv ÷ qkv with near prefetches only":
                  ratio("qkv (build for this CPU)", "qkv, near prefetches only"),
              "qkv AVX2 ÷ qkv for this CPU": ratio("qkv AVX2 build", "qkv (build for this CPU)")}
    if heads["qkv (build for this CPU)"]["far"] == heads["qkv, near prefetches only"]["far"]:
        ratios.pop("qkv ÷ qkv with near prefetches only")
    ratios = {k: v for k, v in ratios.items() if v is not None}
    gbs = max(reads)  # the best read of the run
    limit = gbs * 1e9 / nbytes

    def own_limit(k: str) -> float:  # a decoder's own bytes a token (qkv's greedy steps read a 4-bit head)
        return gbs * 1e9 / heads[k]["bytes"] if k in heads else limit

    what = f"SmolLM2's blocks{' and vocabulary' if vocab > 1 else ''} x{repeats}"
    C.print_table(f"{what} ({C.fmt_bytes(nbytes)}), greedy, {args.new_tokens} tokens, "
                  f"{threads} threads; the limit {limit:.1f} tok/s at {gbs:.1f} GB/s (qkv's own bytes: "
                  f"{', '.join(sorted({C.fmt_bytes(h['bytes']) for h in heads.values()}))})",
                  ["decoder", "tok/s (median)", "rounds", "fraction of its limit"],
                  [[k, f"{C.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}",
                    f"{C.median(v) / own_limit(k):.2f}"] for k, v in rates.items()])
    C.print_table("ratios within rounds", ["ratio", "median", "rounds"],
                  [[k, f"{C.median(v):.2f}", f"{min(v):.2f}-{max(v):.2f}"] for k, v in ratios.items()])
    out = C.write_json(NAME + ("_quick" if args.quick else ""), {
        "machine": machine, "threads": threads, "repeats": repeats, "blocks": 30 * repeats,
        "vocab_repeats": vocab,
        "bytes_per_token": nbytes, "qkv_bytes_per_token": {k: v["bytes"] for k, v in heads.items()},
        "last_level_cache_bytes": llc, "bandwidth_gb_s": round(gbs, 2),
        "bandwidth_reads_gb_s": [round(v, 2) for v in reads], "limit_tokens_per_s": round(limit, 2),
        "new_tokens": args.new_tokens,
        "qkv": {k: {"path": v["path"], "decoder": v["decoder"], "far": v["far"]} for k, v in heads.items()},
        "same_greedy_tokens": same,
        "tokens_per_s": {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
        "fraction_of_limit": {k: round(C.median(v) / own_limit(k), 3) for k, v in rates.items()},
        "ratios": {k: [round(v, 3) for v in vs] for k, vs in ratios.items()},
        "ratio_medians": {k: round(C.median(v), 3) for k, v in ratios.items()}}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
