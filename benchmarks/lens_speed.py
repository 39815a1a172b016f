"""How fast `qkv.lens` answers on a real model: SmolLM2-135M (30 layers x 9 query heads over 3
key/value heads, fp32, exact to transformers) reading a 64-token text on this machine.

Timed, each the median of ``--repeat`` runs after one warm-up:
- ``cache``: run_with_cache (every activation and attention pattern of every layer);
- ``next_token``: the next-token distribution;
- ``logit_lens``: every layer's top prediction at every position (31 x 64 cells of 49,152
  log-probabilities, read out in chunks);
- ``attribute``: direct logit attribution of the top token against the runner-up;
- ``inspect``: one cache read four ways: the cache, the next token, the logit lens at the last 16
  positions (as the page shows it) and the attribution (the issue's "≤ 1 s" budget);
- ``effects``: every head (270) knocked out in turn, effect on the loss over the text (batched:
  one pass per layer from that layer on); ``effects_answer``: the same on the top token's logit
  minus the runner-up's (the output head at the last position only);
- ``lens_page``: the logit lens's top token at the last 16 positions (what the page shows);
- ``patch_head``: activation patching of every head's output, clean into corrupt (270 cells);
- ``head_scores``: previous-token / first-token / duplicate / induction scores of every head.

    python benchmarks/lens_speed.py                 # SmolLM2 (qkv assets install smollm2)
    python benchmarks/lens_speed.py --quick         # fewer repeats
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

TEXT = ("The quick brown fox jumps over the lazy dog. When Mary and John went to the store, John gave a "
        "drink to Mary because she was thirsty after the long walk home from the old market square and")
CORRUPT_SWAP = ("Mary", "Alice")


def timed(fn, repeat: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], out


def main() -> None:
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="length of the text in tokens")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (median)")
    p.add_argument("--quick", action="store_true", help="2 repeats")
    p.add_argument("--weights", default="fp32", choices=("fp32", "bf16"),
                   help="how SmolLM2's weights are held (bf16: ~2x faster products where the CPU has "
                   "bf16 instructions, not exact)")
    p.add_argument("--only", default=None, help="comma-separated measurements to run (default: all)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/lens_speed.json, "
                   "lens_speed_bf16.json with --weights bf16, <that>_quick.json with --quick)")
    args = p.parse_args()
    repeat = 2 if args.quick else args.repeat

    import torch

    import qkv
    from qkv import lens

    machine = C.machine_info()
    print(C.machine_line(machine))
    lm = qkv.load("smollm2", weights=args.weights)
    ids = lm.tokenizer.encode(TEXT)
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = ids[: args.tokens]
    corrupt = lm.tokenizer.encode(lm.tokenizer.decode(ids).replace(*CORRUPT_SWAP))[: args.tokens]
    if len(corrupt) != len(ids):
        corrupt = [*ids[:-2], ids[-1], ids[-2]]  # the same length whatever the tokenizer does
    top2 = lens.next_token(lm, ids, k=2).top
    answer, wrong = top2[0].id, top2[1].id
    meter = C.LoadMeter()
    rows, results = [], {}

    last16 = list(range(len(ids) - 16, len(ids)))

    def inspect():  # one forward pass, read four ways
        cache = lens.run_with_cache(lm, ids)
        lens.next_token(lm, cache)
        lens.logit_lens(lm, cache).top(1, last16)
        lens.attribute(lm, cache, answer, wrong)

    with torch.inference_mode():
        for name, fn, rep in [
            ("cache", lambda: lens.run_with_cache(lm, ids), repeat),
            ("next_token", lambda: lens.next_token(lm, ids), repeat),
            ("logit_lens", lambda: lens.logit_lens(lm, ids).top(1), repeat),
            ("attribute", lambda: lens.attribute(lm, ids, answer, wrong), repeat),
            ("inspect", inspect, repeat),
            ("effects", lambda: lens.head_effects(lm, ids), max(1, repeat // 2)),
            ("effects_answer", lambda: lens.head_effects(lm, ids, answer=answer, wrong=wrong),
             max(1, repeat // 2)),
            ("lens_page", lambda: lens.logit_lens(lm, ids).top(1, last16), repeat),
            ("patch_head", lambda: lens.patch(lm, ids, corrupt, site="head", answer=answer, wrong=wrong),
             max(1, repeat // 2)),
            ("head_scores", lambda: lens.head_scores(lm), repeat),
        ]:
            if args.only and name not in args.only.split(","):
                continue
            seconds, _ = timed(fn, rep)
            results[name] = round(seconds, 4)
            rows.append([name, f"{seconds:.3f}"])
            print(f"{name}: {seconds:.3f} s", flush=True)
    load = meter.stop()
    C.print_table(f"qkv.lens on SmolLM2-135M {args.weights}, {len(ids)} tokens ({C.load_line(load)})",
                  ["what", "seconds (median)"], rows)
    name = "lens_speed" if args.weights == "fp32" else f"lens_speed_{args.weights}"
    name += "_quick" if args.quick else ""  # a smoke run leaves the committed results alone
    out = C.write_json(name, {"machine": machine, "load": load, "tokens": len(ids), "repeat": repeat,
                              "model": f"smollm2 {args.weights} (30 layers x 9 heads)", "seconds": results},
                       args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
