"""Where the native step's token goes, phase by phase and thread by thread: SmolLM2 q4, one row,
qkv's native step (``qkv::Decoder``) timed at each phase's end, against the bytes each phase
reads and the bandwidth this CPU gives a buffer of the weights' size.

- phases: a layer's norm, q|k|v product (with RoPE and the cache's writes), attention over the
  cache, the heads merged, out product, second norm, gate|up product (with SwiGLU), SwiGLU's
  outputs quantized, down product; each product's barrier, the time a thread waited there for
  the others; a token's final norm, int8 head (its top-k and argmax in "serial", with the
  embedding and the threads' start and join). See ``qkv.generation.native_step.profile_steps``;
- bytes: each product's 4- or 8-bit weights and scales (``native_step.product_bytes``), attention's
  float32 keys and values at the positions decoded (their mean);
- bandwidth: the best of ``--reads`` reads of a buffer as large as the weights, read between the
  rounds too (the best counts: the host's other work only slows a read);
- limit: bandwidth / bytes a token, weights alone (as decode_limit.py and from_memory.py count
  it) and with the cache's reads; the step's rate as a fraction of each.

``--repeats R``: SmolLM2's GGUF with its 30 blocks repeated R times (from_memory.py's model), a
model read from DRAM where the last-level cache holds SmolLM2 (a Xeon's 300-480 MB L3); its
products then prefetch far (``prefetch_far``). ``--head-too``: its vocabulary repeated as often
(``from_memory.py --head-too``: the head keeps SmolLM2's share of the bytes).

    python benchmarks/step_profile.py                 # ~30 s on 2 cores
    python benchmarks/step_profile.py --repeats 10    # from DRAM here: ~2 minutes
    python benchmarks/step_profile.py --repeats 10 --head-too
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import _common as C

if TYPE_CHECKING:
    from qkv.models.gpt import GPT

NAME = "step_profile"


def cache_bytes(model: GPT, positions: range) -> float:
    """Mean bytes of float32 keys and values a step reads at ``positions`` (every layer, every
    kv head, positions 0..p)."""
    c = model.cfg
    kv, d = c.resolved_kv_heads, c.resolved_head_dim
    return sum(c.n_layers * kv * (p + 1) * d * 4 * 2 for p in positions) / len(positions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="decodes timed (their phases summed)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens a decode, after a 32-token prompt")
    ap.add_argument("--repeats", type=int, default=None,
                    help="SmolLM2's blocks repeated this many times (a model from DRAM), as from_memory.py")
    ap.add_argument("--head-too", action="store_true",
                    help="with --repeats, the vocabulary (the head's rows) repeated as often too")
    ap.add_argument("--reads", type=int, default=10,
                    help="reads of the buffer between rounds; the best counts")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one round of 16 tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 16
    repeats = 1 if args.repeats is None else args.repeats
    if min(args.rounds, args.reads, repeats) < 1 or args.new_tokens < 2:
        ap.error("--rounds >= 1, --new-tokens >= 2, --reads >= 1 and --repeats >= 1")
    if not C.have_assets(NAME, ("smollm2",)):
        raise SystemExit(2)

    import torch
    from decode_limit import bandwidth

    import qkv
    from qkv.assets import asset_path
    from qkv.generation import generate
    from qkv.generation import native_step as ns

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    with tempfile.TemporaryDirectory(prefix="qkv-step-profile-") as tmp:
        if args.repeats:
            from from_memory import repeated_gguf

            path = Path(tmp) / f"smollm2-x{args.repeats}.gguf"
            repeated_gguf(asset_path("smollm2"), path, args.repeats, args.repeats if args.head_too else 1)
            lm = qkv.load(str(path), cache=False)
        else:
            lm = qkv.load("smollm2")
    m = lm.model
    why = ns.unsupported(m)
    if why is not None:
        raise SystemExit(f"step_profile: the native step does not run here: {why}")
    products = ns.product_bytes(m, greedy=True)  # (greedy decoding's steps: the head's 4-bit copy)
    weights = sum(products.values())
    x = torch.tensor([lm.tokenizer.encode(C.DECODE_TEXT)[:32]])
    prompt = x.shape[1]
    # the steps' positions (the prompt's pass gives the first token)
    positions = range(prompt, prompt + args.new_tokens - 1)
    kv = cache_bytes(m, positions)
    threads = torch.get_num_threads()
    print(f"{m.cfg.n_layers} layers, {C.fmt_bytes(weights)} of weights a token, keys and values "
          f"{C.fmt_bytes(kv)} a step (positions {positions.start}-{positions.stop - 1}); {threads} threads; "
          f"far prefetches {'on' if ns.prefetch_far(m) else 'off'}", flush=True)

    list(generate(m, x, 8, temperature=0.0))  # bound, warm
    gbs = bandwidth(weights, args.reads)
    ns.profile_steps(m, True)
    for r in range(args.rounds):
        t = time.perf_counter()
        list(generate(m, x, args.new_tokens, temperature=0.0))
        wall = time.perf_counter() - t
        gbs = max(gbs, bandwidth(weights, args.reads))
        print(f"round {r + 1}: {args.new_tokens} tokens in {wall:.2f} s", flush=True)
    prof = ns.profile_steps(m, False)
    expected = args.rounds * (args.new_tokens - 1)
    if prof.steps != expected:
        raise SystemExit(f"step_profile: {prof.steps} steps timed, not {expected}: generate did not take "
                         "the native step")

    per = prof.per_step()  # (threads, phases) seconds
    step = prof.total() / prof.steps
    mean = per.mean(0)
    rows, phases = [], []
    for i, name in enumerate(ns.PROFILE_PHASES):
        nbytes = products.get(name, kv if name == "attention" else None)
        rate = nbytes / float(mean[i]) / 1e9 if nbytes and float(mean[i]) > 0 else None
        share = float(mean[i]) / step if name != "serial" else float(per[0, i]) / step
        rows.append([name, *(f"{float(per[t, i]) * 1e3:.3f}" for t in range(prof.threads)), f"{share:.1%}",
                     C.fmt_bytes(nbytes) if nbytes else "", f"{rate:.1f}" if rate else ""])
        phases.append({"phase": name, "ms": [float(per[t, i]) * 1e3 for t in range(prof.threads)],
                       "count": [int(prof.counts[t, i]) for t in range(prof.threads)],
                       "share": share, "bytes": nbytes, "gb_s": rate})
    C.print_table(f"the native step, ms a token by phase and thread ({prof.steps} steps)",
                  ["phase", *(f"thread {t}" for t in range(prof.threads)), "share", "bytes", "GB/s"], rows)
    limit_w, limit_kv = gbs * 1e9 / weights, gbs * 1e9 / (weights + kv)
    rate = 1 / step
    waits = sum(float(mean[i]) for i, n in enumerate(ns.PROFILE_PHASES) if n.startswith("wait"))
    made = sum(float(mean[ns.PROFILE_PHASES.index(n)]) for n in ns.PRODUCT_PHASES)
    print(f"a step {step * 1e3:.3f} ms ({rate:.1f} tok/s in the step): products {made / step:.1%}, attention "
          f"{float(mean[ns.PROFILE_PHASES.index('attention')]) / step:.1%}, waits {waits / step:.1%}; "
          f"bandwidth {gbs:.1f} GB/s: limit {limit_w:.1f} tok/s for the weights (the step at "
          f"{rate / limit_w:.2f} of it), {limit_kv:.1f} with the cache's reads ({rate / limit_kv:.2f})")
    payload = {
        "machine": machine, "repeats": args.repeats, "head_too": args.head_too, "layers": m.cfg.n_layers,
        "threads": threads,
        "far": ns.prefetch_far(m), "rounds": args.rounds, "new_tokens": args.new_tokens,
        "steps": prof.steps, "step_ms": step * 1e3, "tokens_per_s": rate, "bandwidth_gb_s": gbs,
        "weight_bytes": weights, "product_bytes": products, "cache_bytes_per_step": kv,
        "limit_weights": limit_w, "limit_with_cache": limit_kv,
        "fraction_weights": rate / limit_w, "fraction_with_cache": rate / limit_kv, "phases": phases,
    }
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), payload, args.out)}")


if __name__ == "__main__":
    main()
