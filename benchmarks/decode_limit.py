"""How close decoding comes to what this CPU allows: SmolLM2 q4, one row, qkv's native step, its
saved step and llama.cpp's builds on the same GGUF, against the limit set by reading the weights
once a token.

- bytes a token: what a one-row step must read: qkv's 4-bit layers (codes and scales), its int8
  output head and the norms; for llama.cpp, the GGUF's tensors (the tied embedding is its output
  matrix, read whole every token);
- bandwidth: the best of ``--reads`` reads of a buffer as large as qkv's weights, with the threads
  decoding uses (torch's sum: it streams the buffer once). Where the model lives decides which
  bandwidth this is: 95 MB is past a 32 MB L3 (memory) but inside a 480 MB one (L3);
- limit: bandwidth / bytes a token, in tokens/s, and each decoder's measured rate as a fraction
  of its own limit;
- where qkv's token goes: an eager step of one row under the torch profiler, by kernel (4-bit
  products, the int8 head, attention over the cache, norms), and the saved step's time a token
  beside it (what is not kernels there is the runtime between them); the final norm and output
  layer eagerly and through the saved step's head package, calls alternated;
- rates: ``--rounds`` rounds of qkv's native and saved steps (128 tokens after a 32-token prompt,
  as saved_step.py; the saved step with ``QKV_NATIVE_STEP=off``; the native step also with its
  greedy steps reading the 8-bit head, ``QKV_NATIVE_GREEDY_HEAD=q8``, as sampled steps do) with
  llama-bench's portable and native builds after them in each round, and each round's ratios.

    python benchmarks/decode_limit.py                 # ~2 minutes on 2 cores (llama.cpp built)
    python benchmarks/decode_limit.py --build-llama-cpp
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common as C

NAME = "decode_limit"
OPS = {"qkv::int4_mm": "4-bit products", "qkv::q8_mm": "int8 head",
       "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
       "aten::rms_norm": "norms", "aten::layer_norm": "norms"}


def weight_bytes(model, greedy: bool = False) -> dict[str, int]:
    """Bytes a one-row step reads, by kind (qkv's layers; buffers a one-row product does not
    read, such as the 4-bit layers' int8 copies for several rows, are left out). ``greedy``: the
    native step's greedy steps, whose head's first pass reads its 4-bit copy where made
    (``native_step.greedy_head``) instead of the int8 head."""
    from qkv.generation.native_step import greedy_head
    from qkv.layers.quant import Int4Linear, Q8Linear

    out = {"4-bit layers": 0, "int8 head": 0, "norms and the rest": 0}
    for m in model.modules():
        if isinstance(m, Int4Linear):
            read = ("w4", "dm", "packed", "scales_zeros")  # qkv's kernel's or PyTorch's
            out["4-bit layers"] += sum(t.nbytes for n, t in m.named_buffers(recurse=False) if n in read)
        elif isinstance(m, Q8Linear):
            out["int8 head"] += m.w8.nbytes + m.ds.nbytes
    norms = sum(p.nbytes for n, p in model.named_parameters() if "norm" in n)
    out["norms and the rest"] = norms
    four = greedy_head(model) if greedy else None
    if four is not None:
        del out["int8 head"]
        out["4-bit head (greedy steps)"] = four.w4.nbytes + four.dm.nbytes
    return out


def gguf_bytes(path: Path) -> int:
    """The tensor data of a GGUF file: what llama.cpp reads a token (all of it: the tied
    embedding is also the output matrix)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def bandwidth(nbytes: int, reads: int) -> float:
    """GB/s of the best of ``reads`` streaming reads of an ``nbytes`` float32 buffer."""
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reads):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def profile(model, steps: int = 20) -> dict[str, float]:
    """Milliseconds a token by kernel kind in an eager step of one row (torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cache = model.make_cache(1, 256)
    with torch.inference_mode():
        model(torch.arange(100, 132).view(1, -1), cache=cache)
        tok = torch.tensor([[7]])
        for _ in range(3):
            model(tok, cache=cache, last_only=True)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(steps):
                model(tok, cache=cache, last_only=True)
    got = dict.fromkeys(OPS.values(), 0.0)
    total = 0.0
    for e in p.key_averages():
        total += e.self_cpu_time_total
        if e.key in OPS:
            got[OPS[e.key]] += e.self_cpu_time_total
    got["other ops"] = total - sum(got.values())
    return {k: round(v / steps / 1e3, 3) for k, v in got.items()}


def head_ms(model, step, calls: int = 300) -> dict[str, float]:
    """Milliseconds a call (median) of the final norm and output layer on one row: eagerly and
    through the saved step's head package, alternated call by call."""
    import torch

    x = torch.randn(1, 1, model.cfg.dim, generator=torch.Generator().manual_seed(0))
    eager, package = [], []
    with torch.inference_mode():
        for _ in range(calls):
            t = time.perf_counter()
            model.lm_head(model.stack.norm(x))
            eager.append(time.perf_counter() - t)
            t = time.perf_counter()
            step._head(x)
            package.append(time.perf_counter() - t)
    return {"eager": round(C.median(eager) * 1e3, 3), "package": round(C.median(package) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=30, help="reads of the buffer; the best one counts")
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama-bench if it is not built")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from _llama_cpp import llama_bench, run_llama_bench

    import qkv
    from qkv.assets import asset_path
    from qkv.generation import aot, generate

    machine = C.machine_info()
    print(C.machine_line(machine))
    lm = qkv.load("smollm2")
    m = lm.model
    step = aot.load(m)
    if step is None:  # (`qkv prepare smollm2` builds none: the native step runs it)
        print("building SmolLM2's saved step for this machine, once (~40 s on 2 cores) ...", flush=True)
        aot.build(m)
        step = aot.load(m)
        if step is None:
            raise SystemExit("SmolLM2's saved step did not load after its build: try "
                             "`python benchmarks/saved_step.py --rebuild`")
    ours = weight_bytes(m)
    qkv_bytes = sum(ours.values())
    native_bytes = sum(weight_bytes(m, greedy=True).values())  # greedy decoding through the native step
    gguf = asset_path("smollm2")
    llama_bytes = gguf_bytes(gguf)
    gbs = bandwidth(qkv_bytes, args.reads)
    parts = ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in ours.items())
    print(f"bytes a token: qkv {C.fmt_bytes(qkv_bytes)} ({parts}; the native step's greedy steps "
          f"{C.fmt_bytes(native_bytes)}), "
          f"llama.cpp {C.fmt_bytes(llama_bytes)}; read bandwidth {gbs:.1f} GB/s "
          f"({torch.get_num_threads()} threads, a {C.fmt_bytes(qkv_bytes)} buffer)", flush=True)
    kernels = profile(m)
    print("eager step of one row, ms a token: " + ", ".join(f"{k} {v:.2f}" for k, v in kernels.items()),
          flush=True)
    head = head_ms(m, step)
    print(f"final norm + output layer, ms a call: eagerly {head['eager']:.3f}, through the head package "
          f"{head['package']:.3f}", flush=True)

    x = torch.tensor([lm.tokenizer.encode(C.DECODE_TEXT)[:32]])
    n_new, threads = 128, torch.get_num_threads()

    import os

    from qkv.generation.native_step import unsupported

    asked = os.environ.get("QKV_NATIVE_GREEDY_HEAD")  # the user's, for "qkv native step"

    def ours_rate(native: bool, head: str = "") -> float:
        os.environ["QKV_NATIVE_STEP"] = "on" if native else "off"
        if head:  # "q8": greedy steps read the 8-bit head
            os.environ["QKV_NATIVE_GREEDY_HEAD"] = head
        try:
            said: list = []
            t = time.perf_counter()
            list(generate(m, x, 1, temperature=0.0, on_decision=said.append))
            first = time.perf_counter() - t
            t = time.perf_counter()
            list(generate(m, x, n_new, temperature=0.0))
            rate = (n_new - 1) / max(time.perf_counter() - t - first, 1e-9)
        finally:
            os.environ.pop("QKV_NATIVE_STEP", None)
            if asked is None:
                os.environ.pop("QKV_NATIVE_GREEDY_HEAD", None)
            else:
                os.environ["QKV_NATIVE_GREEDY_HEAD"] = asked
        assert said[0].kind == ("native" if native else "saved"), said[0]
        return rate

    # (native, greedy steps' head): the native step as it runs, and reading the 8-bit head as sampled
    # steps do (QKV_NATIVE_GREEDY_HEAD=q8; its bytes those of the saved step)
    steps = {"qkv saved step": (False, ""),
             **({"qkv native step": (True, ""), "qkv native step, 8-bit head": (True, "q8")}
                if unsupported(m) is None else {})}

    peers = {}
    for name, native in (("llama.cpp portable", False), ("llama.cpp native", True)):
        binary, how = llama_bench(build=args.build_llama_cpp, native=native)
        print(f"{name}: {how}", flush=True)
        if binary is not None:
            peers[name] = binary
    for native, head in steps.values():
        ours_rate(native, head)  # warm
    rates: dict[str, list[float]] = {**{k: [] for k in steps}, **{k: [] for k in peers}}
    for r in range(args.rounds):
        for k, (native, head) in (steps.items() if r % 2 == 0 else list(steps.items())[::-1]):
            rates[k].append(ours_rate(native, head))
        for name, binary in peers.items():
            rates[name].append(run_llama_bench(binary, gguf, threads=threads, prompt=32, new=n_new,
                                               reps=1)["decode"]["tokens_per_s"])
        line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
        print(f"round {r + 1}: {line} tok/s", flush=True)
    limit = {**{k: gbs * 1e9 / (native_bytes if native and head != "q8" else qkv_bytes)
                for k, (native, head) in steps.items()},
             **{k: gbs * 1e9 / llama_bytes for k in peers}}
    rows = []
    for k, v in rates.items():
        rows.append([k, f"{C.median(v):.1f}", f"{limit[k]:.0f}", f"{C.median(v) / limit[k]:.2f}",
                     f"{1e3 / C.median(v):.2f}"])
    C.print_table(f"SmolLM2 q4, one row, {threads} threads: the bandwidth limit ({gbs:.1f} GB/s)",
                  ["decoder", "tok/s (median)", "limit tok/s", "fraction", "ms a token"], rows)
    def per_round(a: str, b: str) -> list[float] | None:
        return [round(x / y, 3) for x, y in zip(rates[a], rates[b], strict=True)] \
            if a in rates and b in rates else None

    faster = [max(rates[k][r] for k in peers) for r in range(args.rounds)] if peers else None
    if faster:
        rates["(the faster llama.cpp)"] = faster
    ratios = {"native step ÷ the faster llama.cpp": per_round("qkv native step", "(the faster llama.cpp)"),
              "saved step ÷ the faster llama.cpp": per_round("qkv saved step", "(the faster llama.cpp)"),
              "native step ÷ native step reading the 8-bit head":
                  per_round("qkv native step", "qkv native step, 8-bit head")}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    rates.pop("(the faster llama.cpp)", None)
    for k, v in ratios.items():
        print(f"{k}: median {C.median(v):.2f} (rounds {min(v):.2f}-{max(v):.2f})", flush=True)
    saved_ms = 1e3 / C.median(rates["qkv saved step"])
    kernel_ms = sum(v for k, v in kernels.items() if k != "other ops")
    print(f"qkv: {saved_ms:.2f} ms a token in the saved step; its kernels eagerly {kernel_ms:.2f} ms "
          f"(4-bit {kernels['4-bit products']:.2f}, head {kernels['int8 head']:.2f}, attention "
          f"{kernels['attention']:.2f}, norms {kernels['norms']:.2f})")
    out = C.write_json(NAME, {
        "machine": machine, "threads": threads, "bandwidth_gb_s": round(gbs, 2),
        "bytes_per_token": {"qkv": ours, "qkv_total": qkv_bytes, "llama_cpp_gguf": llama_bytes},
        "eager_profile_ms": kernels, "head_ms": head,
        "decode_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "limit_tokens_per_s": {k: round(v, 1) for k, v in limit.items()},
        "fraction_of_limit": {k: round(C.median(v) / limit[k], 3) for k, v in rates.items()},
        "ratios": ratios,
        "saved_step_ms": round(saved_ms, 3),
        "native_step_ms": round(1e3 / C.median(rates["qkv native step"]), 3) if "qkv native step" in rates
        else None}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
