"""``--dtype auto`` and ``--compile auto``: chosen by measuring, not by capability.

Whether bf16 autocast pays on a CPU depends on the CPU *and* on the model's shapes: with AMX
or avx512_bf16 a large bf16 matrix product is 4–6× faster than fp32, but a 128-wide model's
products are small, the casts around them are not free, and autocast can end up slower than
plain fp32 (issue 14 measured 0.70× on an AMX Xeon). So before training starts, the trainer
times a few real training steps each way, on a copy of the model and optimiser (the run itself
is untouched), and keeps the faster. The answer is cached per machine and shape in
``~/.cache/qkv/speed_probe.json`` (``$QKV_CACHE_DIR`` moves it, ``=off`` turns it off), so
the next run of the same shape starts at once.

Compilation is judged by its cost: a cold ``torch.compile`` of a small GPT takes ~40 s on two
CPU cores and saves ~10% of a step (BENCHMARKS.md). Auto compiles on a CPU only when the run
is long enough that a 10% saving of the measured step time could repay that compile time.
(A cache entry may hold ``compile_s`` / ``compile_saving`` measured on this machine, which
then replace the two assumptions; the trainer does not record them itself yet.)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.paths import cache_root

# Below this speed-up bf16 is not worth its rounding: fp32 is the exact choice, so a tie
# (within the probe's noise, about ±3% between rounds on a quiet machine) goes to fp32.
MIN_BF16_GAIN = 1.03
COMPILE_SAVING = 0.10  # the per-step saving assumed before compile has been measured here
COLD_COMPILE_S = 40.0  # assumed cold compile time on a CPU before it has been measured here


@dataclass
class SpeedChoice:
    """What auto picked and why, in the words the run prints first."""

    dtype: str  # "fp32", "bf16" or "fp16"
    compile: bool
    reason: str
    cached: bool = False


def cache_path() -> Path | None:
    """The probe's answers (None when ``QKV_CACHE_DIR=off``: measure every time)."""
    root = cache_root()
    return None if root is None else root / "speed_probe.json"


def machine_id() -> str:
    """CPU model + ISA + threads + torch version: what the probe's answer depends on."""
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{name}|{isa}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def probe_key(**shape) -> str:
    """A short hash of the machine and of everything about the step that changes its speed."""
    text = json.dumps({"machine": machine_id(), **shape}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_cache(key: str) -> dict | None:
    path = cache_path()
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None  # no cache yet, or a damaged one: measure again
    return entry if isinstance(entry, dict) else None


def write_cache(key: str, entry: dict) -> None:
    """Merge ``entry`` under ``key``; atomic, and never fatal (a read-only home is fine)."""
    path = cache_path()
    if path is None:
        return
    try:
        try:
            data = json.loads(path.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data[key] = {**data.get(key, {}), **entry}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def time_options(
    step: Callable[[str], None],
    options: tuple[str, ...],
    rounds: int = 3,
    steps: int = 2,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median ms per step of each option: one warm-up step each, then ``rounds`` rounds of
    ``steps`` steps per option, the order rotating each round so drift hits all alike."""
    for opt in options:
        step(opt)
    times: dict[str, list[float]] = {o: [] for o in options}
    for r in range(rounds):
        order = options[r % len(options):] + options[: r % len(options)]
        for opt in order:
            t0 = timer()
            for _ in range(steps):
                step(opt)
            times[opt].append((timer() - t0) / steps * 1000)
    return {o: statistics.median(v) for o, v in times.items()}


def choose_dtype(ms: dict[str, float]) -> tuple[str, str]:
    """(dtype, reason) from measured fp32 and bf16 step times."""
    ratio = ms["fp32"] / ms["bf16"]  # > 1: bf16 is faster
    pick = "bf16" if ratio >= MIN_BF16_GAIN else "fp32"
    return pick, (f"bf16 autocast {ms['bf16']:.1f} ms/step vs fp32 {ms['fp32']:.1f} "
                  f"({ratio:.2f}x) here -> {pick}")


def compile_worth_trying(ms_per_step: float, max_iters: int, entry: dict | None) -> tuple[bool, str]:
    """Whether a CPU run of ``max_iters`` steps could repay a cold compile, and why.

    Uses this machine's measured compile time and saving when an earlier run recorded them.
    """
    cost = float((entry or {}).get("compile_s", COLD_COMPILE_S))
    saving = float((entry or {}).get("compile_saving", COMPILE_SAVING))
    gain_s = max(saving, 0.0) * ms_per_step / 1000 * max_iters
    measured = "measured" if entry and "compile_s" in entry else "typical"
    worth = gain_s > cost
    return worth, (f"compile {'on' if worth else 'off'}: it could save ~{gain_s:.0f} s of this "
                   f"run against a {measured} {cost:.0f} s cold compile")


def emulated_bf16_cost(n: int = 256) -> str:
    """How much slower a bf16 matrix product is than fp32 here, measured (a fraction of a
    second), for the warning given when bf16 is asked for on a CPU that emulates it."""
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    ms = time_options(lambda o: (a32 @ b32) if o == "fp32" else (a16 @ b16), ("fp32", "bf16"),
                      rounds=1, steps=1)
    return f"a {n}x{n} bf16 matrix product takes {ms['bf16'] / max(ms['fp32'], 1e-6):.0f}x as long as fp32"
