"""Pretrained models on a CPU: SmolLM2 decoding and MiniLM embeddings, qkv vs the references.

Decoding: SmolLM2-135M-Instruct from the same GGUF, greedy, batch 1, a 32-token prompt and
128 new tokens. Baseline: ``transformers`` ``model.generate(do_sample=False,
min_new_tokens=128)`` (its default dynamic KV cache), fp32 and bf16. qkv:
``qkv.generation.generate`` with its preallocated KV cache, in each weight format of
``qkv.load(..., weights=)``: fp32 (its one-row projections split the weight rows over both
cores, ``qkv/nn/linear.py``; also shown with plain ``F.linear``), bf16, int8 rows and
the GGUF's own 4-bit groups (q4); and each format again through the compiled decoding step
(``generate(mode="jit")``, ``qkv/generation/compiled.py``), whose compile is timed on a
fresh inductor cache (what a first ``--compile`` on a machine pays) and once more in a second
process that finds the cache warm. Decode tok/s counts the tokens after the first (the time of
prompt + first token is measured separately: that is the prefill rate). The generated tokens
are compared. llama.cpp (``llama-bench -t 2 -p 32 -n 128 -r 1``) on the same GGUF where it is
built (``--build-llama-cpp`` builds it once, ~10 minutes; see ``benchmarks/_llama_cpp.py``), run
once in the middle of every round, so each qkv rate is divided by llama.cpp's in the same round.

Memory bound: batch-1 decoding reads every weight once per token, so tokens/s × bytes of
weights per token is the memory traffic the decoder sustains; it is reported beside the
machine's streaming bandwidth, measured here by summing a 1 GiB fp32 tensor.

Embeddings: 1,000 sentences of varied length (from Python's own ``pydoc_data`` text), batch
32: qkv ``SentenceEncoder.embed`` vs ``sentence_transformers.SentenceTransformer.encode``.

Method: contenders run round-robin (order alternating per round) and the ratio reported is
the median over rounds of (reference time / qkv time) within the same round, so a burst of
load on the shared machine hits both sides of a round.

    python benchmarks/pretrained_speed.py           # ~6 minutes on 2 cores
    python benchmarks/pretrained_speed.py --quick   # 1 round, 32 new tokens, 200 sentences
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import _common as C
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

NAME = "pretrained_speed"


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read: sum over a tensor far larger than any cache."""
    x = torch.ones(int(gib * 2**30 / 4))
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def decode_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decoding step reads: every projection in its stored form (float
    matrix, int8 rows + scales, 8-bit groups + scales, or packed 4-bit groups + scales/zeros;
    the tied output matrix once) plus one embedding row and the norms."""
    from qkv.layers.quant import Int4Linear, Int8Linear, Q8Linear

    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (Int4Linear, Int8Linear, Q8Linear)):
            total += sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n != "codes")
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.ndim == 1)
    return total + norms


def _prompt_ids(tok, n: int) -> torch.Tensor:
    text = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
            "who told stories about the stars to anyone who would listen. Every evening the "
            "children of the village gathered on the pier to hear about the lighthouse keeper.")
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit("benchmark prompt too short")
    return torch.tensor([ids[:n]])


def bench_decoding(args: argparse.Namespace, bandwidth: float, llama=None) -> tuple[list[dict], dict]:
    """Every weight format of qkv beside transformers (fp32, bf16) and, where it is built,
    llama.cpp on the same GGUF: decode tok/s (tokens after the first), prefill tok/s (the
    32-token prompt) and the end-to-end rate, round-robin."""
    import copy

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import qkv
    from qkv.assets import asset_path
    from qkv.generation import generate
    from qkv.generation.compiled import compiled_decoder
    from qkv.nn.linear import Linear

    path = asset_path("smollm2")
    t = time.perf_counter()
    qkv.load("smollm2", cache=False)  # read + dequantise the GGUF
    qkv_convert = time.perf_counter() - t
    qkv.load("smollm2")  # make sure the conversion cache holds it
    t = time.perf_counter()
    lm = qkv.load("smollm2", weights="fp32")  # what every later load costs
    qkv_load = time.perf_counter() - t
    t = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ref_load = time.perf_counter() - t
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    print(f"load: qkv {qkv_convert:.1f} s from the GGUF, {qkv_load:.1f} s from its conversion "
          f"cache; transformers {ref_load:.1f} s", flush=True)
    x = _prompt_ids(lm.tokenizer, 32)
    n_new = args.new_tokens
    lms = {w: copy.deepcopy(lm).quantize(w) for w in args.formats}

    def hf(model):
        def run(n: int) -> list[int]:
            with torch.inference_mode():
                out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
            return out[0, x.shape[1]:].tolist()
        return run

    def ours(q):
        return lambda n: [int(t[0]) for t in generate(q.model, x, n, temperature=0.0)]

    def compiled(q):
        return lambda n: [int(t[0]) for t in generate(q.model, x, n, temperature=0.0, mode="jit")]

    def plain(n: int) -> list[int]:  # fp32 with every projection a plain F.linear
        fast = Linear.forward
        Linear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
        try:
            return ours(lms["fp32"])(n)
        finally:
            Linear.forward = fast

    contenders = {("fp32", "transformers"): hf(ref), ("bf16", "transformers"): hf(ref16)}
    for w, q in lms.items():
        contenders[(w, "qkv")] = ours(q)
    if "fp32" in lms:
        contenders[("fp32", "qkv (plain F.linear)")] = plain
    for w in args.compiled:
        contenders[(w, "qkv compiled")] = compiled(lms[w])
    tokens, compile_s = {}, {}
    for k, f in contenders.items():  # warm-up (compiled: the compile), and the tokens to compare
        t = time.perf_counter()
        tokens[k] = f(n_new)
        if k[1] == "qkv compiled":
            decoder = compiled_decoder(lms[k[0]].model)
            compile_s[k[0]] = round(decoder.compile_seconds, 1)
            print(f"{k[0]} compiled: first request {time.perf_counter() - t:.1f} s, of which "
                  f"{decoder.compile_seconds:.1f} s compiling", flush=True)
    names = list(contenders)
    full: dict = {k: [] for k in names}
    first: dict = {k: [] for k in names}
    llama_rounds: list[dict] = []  # llama.cpp's own run in each round, beside qkv's
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for i, k in enumerate(order):
            if llama is not None and i == len(order) // 2:  # mid-round: same conditions as qkv
                llama_rounds.append(llama())
            t = time.perf_counter()
            contenders[k](1)  # the prompt (prefill) and the first token
            first[k].append(time.perf_counter() - t)
            t = time.perf_counter()
            contenders[k](n_new)
            full[k].append(time.perf_counter() - t)
    base = ("fp32", "transformers")
    rows = []
    for k in names:
        w, who = k
        bytes_tok = decode_bytes_per_token(lms[w].model if w in lms else lm.model)
        decode = [(n_new - 1) / max(a - b, 1e-9) for a, b in zip(full[k], first[k], strict=True)]
        base_decode = [(n_new - 1) / max(a - b, 1e-9) for a, b in zip(full[base], first[base], strict=True)]
        ratios = [d / b for d, b in zip(decode, base_decode, strict=True)]
        dec = C.median(decode)
        limit = bandwidth / bytes_tok
        rows.append({
            "weights": w, "contender": who, "decode_tokens_per_s": round(dec, 1),
            "prefill_tokens_per_s": round(x.shape[1] / C.median(first[k]), 1),
            "end_to_end_tokens_per_s": round(n_new / C.median(full[k]), 1),
            "decode_vs_transformers_fp32": round(C.median(ratios), 3),
            "decode_vs_transformers_fp32_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
            "same_tokens_as_transformers_fp32": tokens[k] == tokens[base],
            "same_tokens_as_qkv_fp32": tokens[k] == tokens.get(("fp32", "qkv")),
            "weight_bytes_per_token": bytes_tok if who != "transformers" else None,
            "bandwidth_limit_tokens_per_s": round(limit, 1) if who != "transformers" else None,
            "fraction_of_bandwidth_limit": round(dec / limit, 3) if who != "transformers" else None,
            "decode_samples_tokens_per_s": [round(d, 1) for d in decode],
            "same_tokens_as_qkv_eager": tokens[k] == tokens.get((w, "qkv")),
        })
        if llama_rounds:
            per_round = [d / lr["decode"]["tokens_per_s"] for d, lr in zip(decode, llama_rounds, strict=True)]
            rows[-1]["decode_vs_llama_cpp_same_round"] = round(C.median(per_round), 3)
            rows[-1]["decode_vs_llama_cpp_min_max"] = [round(min(per_round), 3), round(max(per_round), 3)]
        if who == "qkv compiled":
            eager = next(r for r in rows if r["weights"] == w and r["contender"] == "qkv")
            saved = 1 / eager["decode_tokens_per_s"] - 1 / dec
            rows[-1].update(compile_s=compile_s[w], over_eager=round(dec / eager["decode_tokens_per_s"], 3),
                            pays_after_tokens=round(compile_s[w] / saved) if saved > 0 else None)
        print(f"{w} {who}: decode {dec:.1f} tok/s (x{C.median(ratios):.2f} vs transformers fp32), "
              f"prefill {rows[-1]['prefill_tokens_per_s']:.0f} tok/s, same tokens as transformers "
              f"fp32: {tokens[k] == tokens[base]}", flush=True)
    return rows, {"qkv_convert_s": round(qkv_convert, 2), "qkv_cached_load_s": round(qkv_load, 2),
                  "transformers_load_s": round(ref_load, 2), "llama_cpp_rounds": llama_rounds}


def compile_probe(weights: str) -> dict:
    """In a fresh process: load SmolLM2 in ``weights`` and time the compile of its decoding
    step (what a second `qkv generate --compile` pays once the compile cache is warm)."""
    import qkv
    from qkv.generation import generate
    from qkv.generation.compiled import compiled_decoder

    lm = qkv.load("smollm2", weights=weights)
    x = _prompt_ids(lm.tokenizer, 32)
    t = time.perf_counter()
    for _ in generate(lm.model, x, 8, temperature=0.0, mode="jit"):
        pass
    dec = compiled_decoder(lm.model)
    return {"weights": weights, "compile_s": round(dec.compile_seconds, 2),
            "first_request_s": round(time.perf_counter() - t, 2)}


def warm_compile(weights: str) -> dict:
    """:func:`compile_probe` in a child process sharing this run's compile cache."""
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--compile-probe", weights], capture_output=True,
                         text=True, env=os.environ.copy())
    if out.returncode:
        return {"weights": weights, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{weights} compiled, second process (warm compile cache): {res['compile_s']} s compiling",
          flush=True)
    return res


def llama_cpp_runner(args: argparse.Namespace):
    """(run one llama-bench round, description), or (None, why not) where it is not built."""
    from _llama_cpp import llama_bench, run_llama_bench

    from qkv.assets import asset_path

    binary, how = llama_bench(build=args.build_llama_cpp)
    if binary is None:
        print(f"llama.cpp: not available ({how})", flush=True)
        return None, how
    return (lambda: run_llama_bench(binary, asset_path("smollm2"), threads=torch.get_num_threads(),
                                    prompt=32, new=args.new_tokens, reps=1)), how


def llama_cpp_summary(rows: list[dict], rounds: list[dict], how: str) -> dict:
    """llama.cpp's rates over the rounds it ran beside qkv, and qkv's ratios to it."""
    dec = [r["decode"]["tokens_per_s"] for r in rounds]
    pre = [r["prefill"]["tokens_per_s"] for r in rounds]
    res: dict = {"available": True, "how": how, "command": rounds[0]["command"],
                 "decode": {"tokens_per_s": round(C.median(dec), 1), "samples_ts": dec},
                 "prefill": {"tokens_per_s": round(C.median(pre), 1), "samples_ts": pre}}
    for r in rows:
        if "decode_vs_llama_cpp_same_round" in r:
            tag = f"{r['contender'].replace(' ', '_')}_{r['weights']}"
            res[f"{tag}_decode_over_llama_cpp"] = r["decode_vs_llama_cpp_same_round"]
            res[f"{tag}_prefill_over_llama_cpp"] = round(r["prefill_tokens_per_s"] / C.median(pre), 3)
    print(f"llama.cpp ({how}): {json.dumps(res)}", flush=True)
    return res


def _sentences(n: int) -> list[str]:
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics.values())
    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split()))]
    sents = [s for s in sents if 3 <= len(s.split()) <= 120]
    return sents[:n]


def bench_embeddings(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    import qkv
    from qkv.assets import asset_path

    t = time.perf_counter()
    enc = qkv.load("minilm")
    qkv_load = time.perf_counter() - t
    t = time.perf_counter()
    st = SentenceTransformer(str(asset_path("minilm")), device="cpu")
    st_load = time.perf_counter() - t
    sents = _sentences(args.sentences)
    bs = 32

    def run_st():
        return st.encode(sents, batch_size=bs, convert_to_tensor=True, show_progress_bar=False)

    def run_qkv():
        return enc.embed(sents, batch_size=bs)

    a, b = run_qkv(), run_st()
    diff = float((a - b.float()).abs().max())
    times = {"sentence-transformers": [], "qkv": []}
    fns = {"sentence-transformers": run_st, "qkv": run_qkv}
    for r in range(args.rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    ratios = [s / q for q, s in zip(times["qkv"], times["sentence-transformers"], strict=True)]
    out = {
        "sentences": len(sents), "batch_size": bs,
        "qkv_sentences_per_s": round(len(sents) / C.median(times["qkv"]), 1),
        "st_sentences_per_s": round(len(sents) / C.median(times["sentence-transformers"]), 1),
        "speedup_vs_sentence_transformers": round(C.median(ratios), 3),
        "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "max_abs_diff": diff, "qkv_load_s": round(qkv_load, 2), "st_load_s": round(st_load, 2),
    }
    print(f"embeddings: qkv {out['qkv_sentences_per_s']}/s, sentence-transformers "
          f"{out['st_sentences_per_s']}/s, x{out['speedup_vs_sentence_transformers']:.2f}, "
          f"max |diff| {diff:.2e}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round, 32 new tokens, 200 sentences")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run")
    p.add_argument("--sentences", type=int, default=1000, help="sentences embedded per run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--skip", choices=("decoding", "embeddings", "llama-cpp"), action="append", default=[])
    p.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8", "q4"],
                   choices=("fp32", "bf16", "int8", "q4"), help="qkv weight formats to decode with")
    p.add_argument("--compiled", nargs="*", default=["fp32", "bf16", "int8", "q4"],
                   choices=("fp32", "bf16", "int8", "q4"),
                   help="formats also decoded through the compiled step (`--compiled` alone: none)")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="use the usual inductor cache instead of a fresh one (then the compile times "
                   "are not a first compile)")
    p.add_argument("--compile-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--build-llama-cpp", action="store_true",
                   help="build llama.cpp's llama-bench (~10 min, once, cached) if it is not built yet")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    if args.compile_probe:
        print(json.dumps(compile_probe(args.compile_probe)))
        return 0
    if args.quick:
        args.rounds, args.new_tokens, args.sentences = 1, 32, 200
    if args.threads:
        torch.set_num_threads(args.threads)
    if not C.have_reference(NAME):
        return 2
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    bw = memory_bandwidth()
    print(f"memory bandwidth (streaming read): {bw / 1e9:.1f} GB/s", flush=True)
    result: dict = {"machine": machine, "memory_bandwidth_gb_s": round(bw / 1e9, 2),
                    "prompt_tokens": 32, "new_tokens": args.new_tokens, "rounds": args.rounds}
    if args.compiled and not args.warm_compile_cache:  # compile times as on a new machine
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qkv-bench-inductor-")
    result["compile_cache"] = "warm (usual)" if args.warm_compile_cache else "fresh (first compile)"
    if "decoding" not in args.skip:
        llama, how = llama_cpp_runner(args) if "llama-cpp" not in args.skip else (None, "skipped")
        rows, loads = bench_decoding(args, bw, llama)
        result["decoding"], result["load"] = rows, loads
        result["llama_cpp"] = (llama_cpp_summary(rows, loads["llama_cpp_rounds"], how) if llama
                               else {"available": False, "reason": how})
        if args.compiled:
            result["warm_compile"] = [warm_compile(w) for w in args.compiled]
        C.print_table(
            f"SmolLM2-135M greedy decoding, batch 1, 32-token prompt + {args.new_tokens} new tokens",
            ["weights", "contender", "decode tok/s", "× transformers fp32 (min–max)", "prefill tok/s",
             "× llama.cpp (same rounds)", "same tokens (hf fp32 / qkv fp32)", "% of bandwidth limit",
             "compile s"],
            [[r["weights"], r["contender"], f"{r['decode_tokens_per_s']:.1f}",
              f"{r['decode_vs_transformers_fp32']:.2f} ({r['decode_vs_transformers_fp32_min_max'][0]:.2f}–"
              f"{r['decode_vs_transformers_fp32_min_max'][1]:.2f})", f"{r['prefill_tokens_per_s']:.0f}",
              f"{r['decode_vs_llama_cpp_same_round']:.2f}" if "decode_vs_llama_cpp_same_round" in r else "-",
              f"{'yes' if r['same_tokens_as_transformers_fp32'] else 'no'} / "
              f"{'yes' if r['same_tokens_as_qkv_fp32'] else 'no'}",
              "-" if r["fraction_of_bandwidth_limit"] is None else
              f"{100 * r['fraction_of_bandwidth_limit']:.0f}% of {r['bandwidth_limit_tokens_per_s']:.0f}",
              f"{r['compile_s']}" if "compile_s" in r else "-"]
             for r in rows],
        )
    if "embeddings" not in args.skip:
        result["embeddings"] = bench_embeddings(args)
    result["load_meter"] = meter.stop()
    print(C.load_line(result["load_meter"]))
    print(f"results: {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
