"""What one step of a running batch costs per row: SmolLM2 (q4, the server's weights) in a
:class:`qkv.generation.batch.Batch` of 8 rows x 256 positions, 1, 2, 4 and 8 rows decoding
(one row alone steps through the saved step for one request, several through the saved step
for the running batch, where `qkv prepare smollm2 --batch-rows 8 --max-tokens 256` built them),
milliseconds a step and tokens/s; and, eagerly, where a step's time goes for 1 and 8 rows (torch
profiler: qkv's 4-bit products, the int8 head, attention, the rest). Rounds alternate the row
counts.

    python benchmarks/batch_rows.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import time

import _common as C

NAME = "batch_rows"
OPS = {"qkv::int4_mm": "4-bit products", "qkv::q8_mm": "int8 head",
       "aten::_scaled_dot_product_flash_attention_for_cpu": "attention"}


def batch(model, n: int, mode: str):
    from qkv.generation.batch import Batch, Request

    b = Batch(model, 8, 256, mode=mode)
    for i in range(n):
        b.join(Request(ids=list(range(100 + i, 120 + i)), max_new_tokens=200))
    for _ in range(5):
        b.step()
    return b


def step_ms(model, n: int, steps: int) -> float:
    b = batch(model, n, "auto")
    t = time.perf_counter()
    for _ in range(steps):
        b.step()
    return (time.perf_counter() - t) / steps * 1e3


def profile(model, n: int, steps: int = 10) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    b = batch(model, n, "eager")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            b.step()
    got = {name: 0.0 for name in OPS.values()}
    total = 0.0
    for e in p.key_averages():
        total += e.self_cpu_time_total
        if e.key in OPS:
            got[OPS[e.key]] += e.self_cpu_time_total
    got["everything"] = total
    return {k: round(v / steps / 1e3, 2) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not C.have_assets(NAME, ("smollm2",)):
        return
    import qkv

    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    model = qkv.load("smollm2").model
    rows = (1, 2, 4, 8)
    samples: dict[int, list[float]] = {n: [] for n in rows}
    for r in range(args.rounds):
        for n in (rows if r % 2 == 0 else rows[::-1]):
            samples[n].append(round(step_ms(model, n, args.steps), 2))
    saved = {}
    for n in rows:
        ms = C.median(samples[n])
        saved[n] = {"ms_per_step": ms, "tok_s": round(n / ms * 1e3, 1), "samples_ms": samples[n]}
        print(f"{n} rows: {ms:.1f} ms a step, {n / ms * 1e3:.0f} tok/s (saved steps, median)", flush=True)
    eager = {n: profile(model, n) for n in (1, 8)}
    for n, parts in eager.items():
        print(f"eager, {n} rows, ms a step: " + ", ".join(f"{k} {v}" for k, v in parts.items()), flush=True)
    result = {"machine": machine, "saved_steps": saved, "eager_profile_ms": eager, "load": meter.stop()}
    print(C.load_line(result["load"]))
    C.write_json(NAME, result, args.out)


if __name__ == "__main__":
    main()
