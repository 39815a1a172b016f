"""How long the rows already decoding wait while a long prompt joins `qkv serve`'s running batch:
SmolLM2 (the server's q4 weights), one row decoding, then a 240-token prompt (the server's
default limit is 256 tokens) joins; the longest turn of the loop's batch (the prefill done in
that turn plus one step), with the prompt prefilled whole and in chunks of 64 and 32 tokens
(`qkv.generation.batch.CHUNK`, one chunk a turn), and how long the prompt took to its first
token. Rounds alternate the chunk sizes.

    python benchmarks/prefill_chunks.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import time

import _common as C

NAME = "prefill_chunks"


def run(model, chunk: int) -> tuple[float, float]:
    import qkv.generation.batch as bm
    import qkv.serve.batching as sb
    from qkv.generation.batch import Request
    from qkv.serve.batching import ModelBatch

    bm.CHUNK = sb.CHUNK = chunk
    sb.PREFILL_TOKENS = min(32, chunk)
    e = ModelBatch(model, rows=8, cache_len=256, queued=4, name="smollm2")
    e.submit(Request(list(range(200, 216)), 200))
    for _ in range(5):
        e.tick()
    arrived: list[float] = []  # when the long prompt's tokens reach its stream (the loop's thread)
    t0 = time.perf_counter()
    def seen(tok: object) -> object:
        arrived.append(time.perf_counter())
        return tok

    e.submit(Request(list(range(300, 540)), 4), transform=seen)
    turns = []
    while not arrived:
        t = time.perf_counter()
        e.tick()
        turns.append(time.perf_counter() - t)
    e.close()
    return max(turns), arrived[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not C.have_assets(NAME, ("smollm2",)):
        return
    import qkv

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    model = qkv.load("smollm2").model
    chunks = {"whole": 10**6, "64": 64, "32": 32}
    got: dict[str, dict[str, list[float]]] = {k: {"longest_turn_s": [], "first_token_s": []} for k in chunks}
    run(model, 32)  # warm
    for r in range(args.rounds):
        for name in (list(chunks) if r % 2 == 0 else list(chunks)[::-1]):
            turn, first = run(model, chunks[name])
            got[name]["longest_turn_s"].append(round(turn, 4))
            got[name]["first_token_s"].append(round(first, 4))
    summary = {}
    for name, v in got.items():
        summary[name] = {k: C.median(x) for k, x in v.items()}
        wait, first = summary[name]["longest_turn_s"], summary[name]["first_token_s"]
        print(f"prefill {name:>5}: the decoding row's longest wait {wait * 1e3:.0f} ms, the 240-token "
              f"prompt's first token {first * 1e3:.0f} ms (medians)", flush=True)
    result = {"machine": machine, "prompt_tokens": 240, "rounds": got, "median": summary,
              "load": meter.stop()}
    print(C.load_line(result["load"]))
    C.write_json(NAME, result, args.out)


if __name__ == "__main__":
    main()
