"""What one step of a running batch costs per row: SmolLM2 (q4, the server's weights) in a
:class:`qkv.generation.batch.Batch` of 8 rows x 256 positions, 1, 2, 4 and 8 rows decoding,
milliseconds a step and tokens/s, three ways in alternated rounds: through the native step (every
row in place, ``NativeStep.step_rows``: what a model it runs decodes with, no set-up; greedy rows
ranked by the head's 4-bit copy), the same with the 8-bit head (``QKV_NATIVE_GREEDY_HEAD=q8``) and through
the saved steps (``QKV_NATIVE_STEP=off``: one row alone through the saved step for one request,
several through the saved step for the running batch; built first if missing, ~40 s each, as
`QKV_NATIVE_STEP=off qkv prepare smollm2 --batch-rows 8 --max-tokens 256` would); and, eagerly,
where a step's time goes for 1 and 8 rows (torch profiler: qkv's 4-bit products, the int8 head,
attention, the rest).

    python benchmarks/batch_rows.py          # ~2 minutes on 2 cores (plus any build)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator

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


@contextlib.contextmanager
def native_step(on: bool, head: str = "") -> Iterator[None]:
    """QKV_NATIVE_STEP on or off for the block (read at each batch's first step), and
    QKV_NATIVE_GREEDY_HEAD (``"q8"``: greedy rows' steps on the 8-bit head; read at binding)."""
    old = {k: os.environ.get(k) for k in ("QKV_NATIVE_STEP", "QKV_NATIVE_GREEDY_HEAD")}
    os.environ["QKV_NATIVE_STEP"] = "on" if on else "off"
    os.environ["QKV_NATIVE_GREEDY_HEAD"] = head
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def step_ms(model, n: int, steps: int, way: str) -> float:
    """ms a step of n rows (greedy), ``way`` "native", "native 8-bit head" (its greedy rows on
    the 8-bit head, as sampled rows are) or "saved" (the native step off for this batch)."""
    with native_step(way != "saved", "q8" if way == "native 8-bit head" else ""):
        b = batch(model, n, "auto")
        t = time.perf_counter()
        for _ in range(steps):
            b.step()
        ms = (time.perf_counter() - t) / steps * 1e3
        took = b.rows_steps if way != "saved" else (b.solo_steps if n == 1 else b.rows_steps)
    if took < steps:  # the step asked for did not run: a wrong comparison, not a slow one
        raise SystemExit(f"batch_rows: {n} rows did not step through the {way} step ({took} of the {steps} "
                         "timed)")
    return ms


def build_saved(model) -> None:
    """The saved steps the "saved" rows take, built here if missing (said, with the time)."""
    from qkv.generation.builds import ensure

    with native_step(False):
        for rows, S in ((1, None), (8, 256)):
            st = ensure(model, rows, S)
            if not st.ready:
                raise SystemExit(f"batch_rows: no saved step for {rows} row(s): {st.message()}")
            if st.seconds:
                print(f"built the saved step for {rows} row(s) in {st.seconds:.0f} s", flush=True)


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
    build_saved(model)
    rows, ways = (1, 2, 4, 8), ("native", "native 8-bit head", "saved")
    samples = {(w, n): [] for w in ways for n in rows}
    for r in range(args.rounds):
        for n in (rows if r % 2 == 0 else rows[::-1]):
            for w in (ways if r % 2 == 0 else ways[::-1]):
                samples[w, n].append(round(step_ms(model, n, args.steps, w), 2))
    out: dict[str, dict[int, dict]] = {w: {} for w in ways}
    for n in rows:
        for w in ways:
            ms = C.median(samples[w, n])
            out[w][n] = {"ms_per_step": ms, "tok_s": round(n / ms * 1e3, 1), "samples_ms": samples[w, n]}
        ratio = C.median([s / n_ for s, n_ in zip(samples["saved", n], samples["native", n], strict=True)])
        out["native"][n]["saved_over_native"] = round(ratio, 3)
        head = C.median([s / n_ for s, n_ in zip(samples["native 8-bit head", n], samples["native", n],
                                                 strict=True)])
        out["native"][n]["8bit_head_over_native"] = round(head, 3)
        print(f"{n} rows: native {out['native'][n]['ms_per_step']:.1f} ms a step "
              f"({out['native'][n]['tok_s']:.0f} tok/s), saved {out['saved'][n]['ms_per_step']:.1f} ms "
              f"({out['saved'][n]['tok_s']:.0f} tok/s); saved / native {ratio:.2f}, the native step on the "
              f"8-bit head / native {head:.2f} (medians of rounds)", flush=True)
    eager = {n: profile(model, n) for n in (1, 8)}
    for n, parts in eager.items():
        print(f"eager, {n} rows, ms a step: " + ", ".join(f"{k} {v}" for k, v in parts.items()), flush=True)
    result = {"machine": machine, "native_step": out["native"],
              "native_step_8bit_head": out["native 8-bit head"], "saved_steps": out["saved"],
              "eager_profile_ms": eager, "load": meter.stop()}
    print(C.load_line(result["load"]))
    C.write_json(NAME, result, args.out)


if __name__ == "__main__":
    main()
