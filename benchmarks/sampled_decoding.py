"""Sampled decoding of SmolLM2-135M (the bundled Q4_1 GGUF), what ``qkv generate`` does by default
(temperature 0.8, top-k 200), against greedy decoding and against llama.cpp sampling the same way.

The other decoding benchmarks time greedy decoding, as ``llama-bench``'s decode test does (it
samples nothing). A user's generation samples: every token also pays for turning 49,152 logits
into a draw. This script times that, in one process, rounds alternated:

- qkv, its default decoder (the native step where it runs the model), a 32-token prompt and
  ``--new-tokens`` tokens, tokens/s after the first: greedy; sampled at T 0.8 / top-k 200 through
  the kernel library's ``sample_rows`` (sample_next's path wherever the library is loaded) and
  through PyTorch's ops (the same sample_next with the op switched off: what it ran before);
  sampled at T 1 with no top-k (``generate``'s own defaults), kernel and PyTorch;
- llama.cpp: ``llama-completion`` (``--build-llama-cpp`` builds what is missing, ~10 minutes each)
  from the same prompt, ``--ignore-eos``, sampling with ``--samplers "top_k;temperature" --top-k 200
  --temp 0.8`` and greedily (``--temp 0``); its rate is the generated tokens over the time its own
  report gives them (eval time plus sampling time: model load and prompt left out, as qkv's
  first token is); and ``llama-bench -n 128`` (greedy, the figure the other benchmarks use).
  Both builds where the CPU allows (portable; ``GGML_NATIVE=ON``): ratios are to the faster one
  of each kind.

    python benchmarks/sampled_decoding.py --rounds 5
    python benchmarks/sampled_decoding.py --quick          # one round of 16 tokens
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

NAME = "sampled_decoding"
TEXT = C.DECODE_TEXT
SAMPLED = {"temperature": 0.8, "top_k": 200}  # `qkv generate`'s defaults
PLAIN = {"temperature": 1.0, "top_k": None}  # generate()'s own defaults


def completion_rate(binary: Path, gguf: Path, prompt: str, n_new: int, threads: int, seed: int,
                    sampled: bool) -> float:
    """Tokens/s of llama.cpp's ``llama-completion`` over the generated tokens: its report's eval
    time a run (the forward passes after the prompt's) plus its sampling time a drawn token (the
    sampler chain and the candidates' array of the whole vocabulary it fills first)."""
    sampling = (["--samplers", "top_k;temperature", "--top-k", "200", "--temp", "0.8"] if sampled
                else ["--temp", "0"])
    # -b 1 -ub 1: the prompt a token at a time (its time is left out here, as qkv's is): on an AMX
    # Xeon the native build's prompt batch dies of SIGILL at its first AMX tile load, as
    # llama-bench's prefill test does (benchmarks/_llama_cpp.py); decoding is one row either way
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", prompt, "-n", str(n_new),
           "--ignore-eos", "-no-cnv", "--seed", str(seed), "-c", "512", "-b", "1", "-ub", "1", *sampling]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=600,
                       stdin=subprocess.DEVNULL)
    log = r.stderr + r.stdout
    log_evals = log.replace("prompt eval time", "prompt_eval")  # the generated tokens' line only
    evals = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log_evals)
    samp = re.search(r"\bsampling time =\s*([\d.]+) ms", log)  # the n_new draws, candidates' set-up included
    if r.returncode != 0 or evals is None or samp is None:
        tail = " | ".join(log.strip().splitlines()[-3:])
        raise SystemExit(f"llama-completion failed (exit {r.returncode}): {tail[-400:]}")
    eval_ms, runs = float(evals.group(1)), int(evals.group(2))
    per_token_ms = eval_ms / runs + float(samp.group(1)) / n_new
    return 1e3 / per_token_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--build-llama-cpp", action="store_true",
                    help="build llama.cpp's tools if they are not built (~10 minutes each)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one round of 16 tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 16

    import torch
    from _llama_cpp import llama_bench, llama_tool, run_llama_bench

    import qkv
    import qkv.generation.sampling as S
    from qkv.assets import asset_path
    from qkv.generation import generate

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    lm = qkv.load("smollm2")
    m = lm.model
    ids = lm.tokenizer.encode(TEXT)[:32]
    x = torch.tensor([ids])
    prompt = lm.tokenizer.decode(ids)
    n_new, threads = args.new_tokens, torch.get_num_threads()
    gguf = asset_path("smollm2")
    kernel_op = S.sample_op

    def rate(kw: dict, op, seed: int) -> float:
        S.sample_op = op
        try:
            return C.decode_rate(m, x, n_new, seed=seed, **kw)
        finally:
            S.sample_op = kernel_op

    ours = {"qkv greedy": ({"temperature": 0.0}, kernel_op),
            "qkv T 0.8 top-k 200, kernel": (SAMPLED, kernel_op),
            "qkv T 0.8 top-k 200, PyTorch": (SAMPLED, lambda: None),
            "qkv T 1, kernel": (PLAIN, kernel_op),
            "qkv T 1, PyTorch": (PLAIN, lambda: None)}
    said: list = []
    list(generate(m, x, 2, temperature=0.0, on_decision=said.append))
    decoder = said[0].kind if said else "?"
    assert kernel_op() is not None, "qkv's kernel library is not loaded: nothing to compare"

    peers: dict[str, tuple] = {}
    for build, native in (("portable", False), ("native", True)):
        binary, how = llama_tool("llama-completion", build=args.build_llama_cpp, native=native)
        print(f"llama-completion {build}: {how}", flush=True)
        if binary is not None:
            peers[f"llama-completion {build} T 0.8 top-k 200"] = ("completion", binary, True)
            peers[f"llama-completion {build} greedy"] = ("completion", binary, False)
        bench, how = llama_bench(build=args.build_llama_cpp, native=native)
        print(f"llama-bench {build}: {how}", flush=True)
        if bench is not None:
            peers[f"llama-bench {build}"] = ("bench", bench, False)
    for kw, op in ours.values():
        rate(kw, op, 0)  # warm
    rates: dict[str, list[float]] = {k: [] for k in (*ours, *peers)}
    for r in range(args.rounds):
        order = list(ours.items()) if r % 2 == 0 else list(ours.items())[::-1]
        for k, (kw, op) in order:
            rates[k].append(rate(kw, op, r))
        for k, (kind, binary, sampled) in peers.items():
            if kind == "bench":
                rates[k].append(run_llama_bench(binary, gguf, threads=threads, prompt=32, new=n_new,
                                                reps=1)["decode"]["tokens_per_s"])
            else:
                rates[k].append(completion_rate(binary, gguf, prompt, n_new, threads, r, sampled))
        line = ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items())
        print(f"round {r + 1}: {line} tok/s", flush=True)

    def best(peer: str, kind: str, r: int) -> float | None:  # the faster build's rate in round r
        vals = [v[r] for k, v in rates.items() if k.startswith(peer) and k.endswith(kind)]
        return max(vals) if vals else None

    ratios: dict[str, list[float]] = {}
    for k, peer, kind in (("qkv greedy", "llama-bench", ""), ("qkv greedy", "llama-completion", "greedy"),
                          ("qkv T 0.8 top-k 200, kernel", "llama-completion", "top-k 200"),
                          ("qkv T 0.8 top-k 200, PyTorch", "llama-completion", "top-k 200")):
        if best(peer, kind, 0) is not None:
            ratios[f"{k} / {peer} {kind}".rstrip()] = [rates[k][r] / best(peer, kind, r)
                                                       for r in range(args.rounds)]
    for k in ours:
        if k != "qkv greedy":
            ratios[f"{k} / qkv greedy"] = [rates[k][r] / rates["qkv greedy"][r] for r in range(args.rounds)]
    rows = [[k, f"{C.median(v):.1f}", f"{min(v):.0f}-{max(v):.0f}", f"{1e3 / C.median(v):.2f}"]
            for k, v in rates.items()]
    C.print_table(f"SmolLM2 q4, 32-token prompt + {n_new} tokens, {threads} threads (qkv: {decoder} decoder)",
                  ["decoder", "tok/s (median)", "rounds", "ms a token"], rows)
    C.print_table("ratios within rounds (llama.cpp: its faster build, the same tool and sampling)",
                  ["ratio", "median", "rounds"],
                  [[k, f"{C.median(v):.2f}", f"{min(v):.2f}-{max(v):.2f}"] for k, v in ratios.items()])
    out = C.write_json(NAME + ("_quick" if args.quick else ""), {
        "machine": machine, "threads": threads, "new_tokens": n_new, "qkv_decoder": decoder,
        "sampled": SAMPLED, "plain": PLAIN,
        "tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "ratios": {k: [round(v, 3) for v in vs] for k, vs in ratios.items()},
        "ratio_medians": {k: round(C.median(v), 3) for k, v in ratios.items()}}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
