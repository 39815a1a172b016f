"""Pretrained models on a CPU: SmolLM2 decoding and MiniLM embeddings, qkv vs the references.

Decoding: SmolLM2-135M-Instruct from the same GGUF, greedy, batch 1, a 32-token prompt and
128 new tokens. Baseline: ``transformers`` ``model.generate(do_sample=False,
min_new_tokens=128)`` (its default dynamic KV cache). qkv: ``qkv.generation.generate`` with
its preallocated KV cache; in fp32 its one-row projections split the weight rows over both
cores (``qkv/attention/linear.py``), and to show what that buys, fp32 with plain
``F.linear`` too. fp32 and bf16. The generated tokens are compared too.

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
    """Bytes of weights one decoding step reads: every Linear (the tied output matrix
    included, once) plus one embedding row and the norms."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel() * m.weight.element_size()
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


def bench_decoding(args: argparse.Namespace) -> tuple[list[dict], dict]:
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import qkv
    from qkv.assets import asset_path
    from qkv.attention.linear import Linear
    from qkv.generation import generate

    path = asset_path("smollm2")
    t = time.perf_counter()
    qkv.load("smollm2", cache=False)  # read + dequantise the GGUF
    qkv_convert = time.perf_counter() - t
    qkv.load("smollm2")  # make sure the conversion cache holds it
    t = time.perf_counter()
    lm = qkv.load("smollm2")  # what every later load costs
    qkv_load = time.perf_counter() - t
    t = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ref_load = time.perf_counter() - t
    print(f"load: qkv {qkv_convert:.1f} s from the GGUF, {qkv_load:.1f} s from its conversion "
          f"cache; transformers {ref_load:.1f} s", flush=True)
    x = _prompt_ids(lm.tokenizer, 32)
    n_new = args.new_tokens

    def run_ref():
        with torch.inference_mode():
            out = ref.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                               pad_token_id=2)
        return out[0, x.shape[1]:].tolist()

    def run_qkv():
        return [int(t[0]) for t in generate(lm.model, x, n_new, temperature=0.0)]

    rows = []
    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        lm.to(dtype)
        ref.to(dt)
        contenders = {"transformers": run_ref, "qkv": run_qkv}
        if dtype == "float32":
            def run_qkv_plain():
                fast = Linear.forward
                Linear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
                try:
                    return run_qkv()
                finally:
                    Linear.forward = fast
            contenders["qkv (plain F.linear)"] = run_qkv_plain
        tokens = {k: f() for k, f in contenders.items()}  # warm-up, and the tokens to compare
        times: dict[str, list[float]] = {k: [] for k in contenders}
        names = list(contenders)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for k in order:
                t = time.perf_counter()
                contenders[k]()
                times[k].append(time.perf_counter() - t)
        bytes_tok = decode_bytes_per_token(lm.model)
        for k in names:
            ratios = [b / a for a, b in zip(times[k], times["transformers"], strict=True)]
            tok_s = n_new / C.median(times[k])
            rows.append({
                "dtype": dtype, "contender": k, "tokens_per_s": round(tok_s, 2),
                "speedup_vs_transformers": round(C.median(ratios), 3),
                "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
                "same_tokens_as_transformers": tokens[k] == tokens["transformers"],
                "weight_bytes_per_token": bytes_tok,
                "weight_traffic_gb_s": round(tok_s * bytes_tok / 1e9, 2),
            })
            print(f"{dtype} {k}: {tok_s:.1f} tok/s, x{C.median(ratios):.2f} vs transformers, "
                  f"same tokens: {tokens[k] == tokens['transformers']}", flush=True)
    return rows, {"qkv_convert_s": round(qkv_convert, 2), "qkv_cached_load_s": round(qkv_load, 2),
                  "transformers_load_s": round(ref_load, 2)}


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
    p.add_argument("--skip", choices=("decoding", "embeddings"), action="append", default=[])
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.new_tokens, args.sentences = 1, 32, 200
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import sentence_transformers  # noqa: F401
        import transformers  # noqa: F401

        from qkv.assets import asset_path

        asset_path("minilm"), asset_path("smollm2")
    except Exception as e:  # missing reference package or asset: say which, exit 2
        print(f"{NAME}: needs the reference packages and assets: pip install -e '.[reference]' "
              f"&& qkv assets install minilm smollm2 ({e})", file=sys.stderr)
        return 2
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    bw = memory_bandwidth()
    print(f"memory bandwidth (streaming read): {bw / 1e9:.1f} GB/s", flush=True)
    result: dict = {"machine": machine, "memory_bandwidth_gb_s": round(bw / 1e9, 2),
                    "prompt_tokens": 32, "new_tokens": args.new_tokens, "rounds": args.rounds}
    if "decoding" not in args.skip:
        rows, loads = bench_decoding(args)
        result["decoding"], result["load"] = rows, loads
        C.print_table(
            f"SmolLM2-135M greedy decoding, batch 1, 32-token prompt + {args.new_tokens} new tokens",
            ["dtype", "contender", "tok/s", "× transformers (min–max)", "same tokens",
             "weights GB/s", "% of bandwidth"],
            [[r["dtype"], r["contender"], f"{r['tokens_per_s']:.1f}",
              f"{r['speedup_vs_transformers']:.2f} ({r['speedup_min_max'][0]:.2f}–"
              f"{r['speedup_min_max'][1]:.2f})", "yes" if r["same_tokens_as_transformers"] else "NO",
              f"{r['weight_traffic_gb_s']:.1f}", f"{100 * r['weight_traffic_gb_s'] / (bw / 1e9):.0f}%"]
             for r in rows],
        )
    if "embeddings" not in args.skip:
        result["embeddings"] = bench_embeddings(args)
    result["load_meter"] = meter.stop()
    print(C.load_line(result["load_meter"]))
    print(f"results: {C.write_json(NAME, result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
