"""Where a lens answer's time goes on SmolLM2, and what batching several students' forward
passes into one would save (issue 52's "batch and share", measured before building it).

- ``parts``: one lens answer (``qkv.serve.lens_api.lens_response``: what ``POST /api/lens``
  computes) against its two big parts, the forward pass that keeps every activation
  (``run_with_cache_steps``) and the logit lens's read-out of 31 rows x 16 positions through
  the 49,152-token head (``LogitLens.top_steps``); the rest is the rollout, thumbnails and
  rounding.
- ``batching``: the forward passes of B students' texts (B = 2, 4, 8; 13-21 tokens each), each
  alone against one right-padded batch of B (a decoder's causal mask keeps the padding out of
  every real position), alternated rounds; and how far the batch's logits are from each text
  alone (the issue asks for <= 1e-4).
- ``padding``: how far one text's logits move when it is only padded (alone, to 21 tokens), in
  the server's weights (q4: activations rounded to int8 codes per group of 32, so a float
  difference far below 1e-4 upstream can flip a code) and in float32.

The saving per text, as a share of a lens answer, is what batching the lens's forward passes
across students would buy: the read-out (per text, its own positions) is not shared.

    python benchmarks/lens_batching.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import time

import _common as C

NAME = "lens_batching"
TEXTS = ["When Mary and John went to the store, John gave a drink to",
         "The capital of France is Paris, and the capital of Germany is",
         "In the beginning God created the heaven and the earth. And the earth was",
         "To be, or not to be, that is the question: whether 'tis nobler in the mind",
         "The cat sat on the mat because it was",
         "Photosynthesis turns light, water and carbon dioxide into",
         "After the war ended in 1945, the United Nations was",
         "She opened the door, looked at the empty room and said"]


def parts(lm, rounds: int) -> dict:
    from qkv import lens
    from qkv.lens.cache import run_with_cache_steps
    from qkv.lens.hooks import finish
    from qkv.serve.lens_api import LENS_POSITIONS, lens_response
    from qkv.serve.schemas import LensRequest

    req = LensRequest(model="smollm2", text=TEXTS[0])
    scores: dict = {}
    cache = finish(run_with_cache_steps(lm, TEXTS[0]))
    n = len(cache.ids)
    positions = list(range(max(0, n - LENS_POSITIONS), n))
    ll = lens.logit_lens(lm, cache)
    steps = {"lens answer": lambda: finish(lens_response(lm, req, 256, scores, "key")),
             "forward with every activation": lambda: finish(run_with_cache_steps(lm, TEXTS[0])),
             "logit lens read-out": lambda: finish(ll.top_steps(1, positions))}
    samples: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for f in steps.values():
        f()  # warm
    for r in range(rounds):  # round robin, a different order each round
        for k in names[r % 3:] + names[: r % 3]:
            t = time.perf_counter()
            steps[k]()
            samples[k].append(time.perf_counter() - t)
    times = {k: C.median(v) for k, v in samples.items()}
    out = {k: round(v * 1e3, 1) for k, v in times.items()}
    out["rest"] = round((times["lens answer"] - times["forward with every activation"]
                         - times["logit lens read-out"]) * 1e3, 1)
    out["tokens"] = n
    for k, v in out.items():
        if k != "tokens":
            print(f"  {k:32s} {v:7.1f} ms", flush=True)
    return out


def batching(lm, rounds: int, sizes: tuple[int, ...]) -> list[dict]:
    import torch

    from qkv.lens.hooks import Recorded, finish, forward_steps

    model = lm.model
    ids = [lm.tokenizer.encode(t) for t in TEXTS]

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out, _ = finish(forward_steps(model, x, weights=True, record=Recorded()))
        return out

    out = []
    for B in sizes:
        group = ids[:B]
        T = max(map(len, group))
        padded = torch.tensor([i + [0] * (T - len(i)) for i in group])
        alone = [run(torch.tensor([i]))[0] for i in group]
        together = run(padded)
        diff = max(float((together[b, : len(i)] - alone[b]).abs().max()) for b, i in enumerate(group))
        times: dict[str, list[float]] = {"alone": [], "batched": []}
        for r in range(rounds):
            for k in (("alone", "batched") if r % 2 == 0 else ("batched", "alone")):
                t = time.perf_counter()
                if k == "alone":
                    for i in group:
                        run(torch.tensor([i]))
                else:
                    run(padded)
                times[k].append(time.perf_counter() - t)
        a, b = C.median(times["alone"]), C.median(times["batched"])
        row = {"texts": B, "tokens": [len(i) for i in group], "alone_ms": round(a * 1e3, 1),
               "batched_ms": round(b * 1e3, 1), "saved_per_text_ms": round((a - b) / B * 1e3, 1),
               "max_abs_logit_diff": diff}
        print(f"  {B} texts ({T} tokens padded): alone {a * 1e3:.0f} ms, one batch {b * 1e3:.0f} ms; saves "
              f"{row['saved_per_text_ms']:.1f} ms a text; logits {diff:.1e} from alone", flush=True)
        out.append(row)
    return out


def padding() -> dict:
    """Max |logit difference| of each text alone and the same text padded to the longest."""
    import torch

    import qkv
    from qkv.lens.hooks import Recorded, finish, forward_steps

    out = {}
    for weights in ("q4", "fp32"):
        lm = qkv.load("smollm2", weights=weights)
        ids = [lm.tokenizer.encode(t) for t in TEXTS[:4]]
        T = max(map(len, ids))
        worst = 0.0
        for i in ids:
            with torch.inference_mode():
                a = finish(forward_steps(lm.model, torch.tensor([i]), weights=True, record=Recorded()))[0]
                p = finish(forward_steps(lm.model, torch.tensor([i + [0] * (T - len(i))]), weights=True,
                                         record=Recorded()))[0]
            worst = max(worst, float((a[0] - p[0, : len(i)]).abs().max()))
        out[weights] = worst
        print(f"  {weights}: a text padded to {T} tokens: logits up to {worst:.1e} from alone", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not C.have_assets(NAME, ("smollm2",)):
        return
    import qkv

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    lm = qkv.load("smollm2")
    print("one lens answer and its parts (median):", flush=True)
    p = parts(lm, args.rounds)
    print("forward passes of several texts, alone and as one padded batch (median):", flush=True)
    b = batching(lm, args.rounds, (2, 4, 8))
    for row in b:
        row["saved_share_of_a_lens_answer"] = round(row["saved_per_text_ms"] / p["lens answer"], 3)
    best = max(row["saved_share_of_a_lens_answer"] for row in b)
    print(f"batching the lens's forward passes would save at most {best:.0%} of a lens answer", flush=True)
    print("padding alone:", flush=True)
    pad = padding()
    result = {"machine": machine, "parts_ms": p, "batching": b, "padding_max_abs_logit_diff": pad,
              "load": meter.stop()}
    print(C.load_line(result["load"]))
    C.write_json(NAME, result, args.out)


if __name__ == "__main__":
    main()
