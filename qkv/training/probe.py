"""``--dtype auto`` and ``--compile auto``: chosen by measuring, not by capability.

Whether bf16 autocast pays on a CPU depends on the CPU *and* on the model's shapes: with AMX
or avx512_bf16 a large bf16 matrix product is 4–6× faster than fp32, but a 128-wide model's
products are small, the casts around them are not free, and autocast can end up slower than
plain fp32 (issue 14 measured 0.70× on an AMX Xeon). So before training starts, the trainer
times a few real training steps each way, on a copy of the model and optimiser (the run itself
is untouched), and keeps the faster. The answer is cached per machine and shape in
``~/.cache/qkv/speed_probe.json`` (``$QKV_CACHE_DIR`` moves it, ``=off`` turns it off), so
the next run of the same shape starts at once.

A measurement is only as good as the machine was quiet while it ran. Beside other programs a
step can take 6× as long (issue 39: ``bf16 405 ms/step vs fp32 427`` at load 5 on two cores,
against ~70 ms quiet), and not evenly between fp32 and bf16. So the probe watches how the CPU
was shared while it measured (:class:`Watch`): Linux keeps, for every thread, the time it ran
on a CPU and the time it waited, runnable, for one (``/proc/self/task/*/schedstat``), and the
fraction of the CPU time this process's threads wanted that they got is the contention itself,
however many threads the step keeps busy. Measured on two cores (real probes of GPTs of dim
16–256, 1 or 2 threads): alone 0.99–1.00 (at most 2 ms waited); beside two CPU hogs 0.55–0.63;
2 threads beside another program's test run (a core's worth) 0.50–0.54, the probe then taking
0.3–11 s instead of 0.1 s and reading the same model's fp32/bf16 ratio anywhere from 0.05× to
7.95× (0.62× alone). A share below :data:`MIN_CPU_SHARE` (0.9) makes the measurement *busy*:
the run says so in one line, nothing is cached (the next run measures again), and this run
takes the safe choice instead of what it read: fp32 (exact; the busy ratios above would have
picked bf16 as often as not) and no compiling (a busy step time overstates what compiling can
save). Other signals were weaker: the process's CPU time against wall time × threads is
0.54–0.59 on a quiet machine already (a small model's step does not keep two threads busy),
against 0.34–0.37 beside two hogs; the one-minute load average lags (it rose only from 0.75
to 1.4 during a series of 2-s probes beside two hogs) and counts this process too. It judges
only where the kernel keeps no schedstat (macOS): busy when it exceeds this process's threads
by the number of cores, i.e. other programs alone filled every core.

Compilation is judged by its cost: a cold ``torch.compile`` of a small GPT takes ~40 s on two
CPU cores and saves ~10% of a step (BENCHMARKS.md). Auto compiles on a CPU only when the run
is long enough that a 10% saving of the measured step time could repay that compile time.
Those two numbers are only the first guess: a compiled run measures what compiling cost it and
what a compiled step saves (:class:`qkv.training.speed.CompileMeter`) and writes them into the
same cache entry as ``compile_s`` / ``compile_saving``, which then replace the assumptions for
the next run of that shape on this machine.
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

from qkv.device import cpu_has_native_bf16
from qkv.paths import cache_root

# Below this speed-up bf16 is not worth its rounding: fp32 is the exact choice, so a tie
# (within the probe's noise, about ±3% between rounds on a quiet machine) goes to fp32.
MIN_BF16_GAIN = 1.03
# Below this share of the CPU time its threads wanted, a measurement is not trusted (see the
# module's docstring): a quiet machine gives 0.99-1.00, one program taking a core beside a
# 2-thread probe ~0.5; a tenth lost is already more than the ±3% the bf16 choice tolerates.
MIN_CPU_SHARE = 0.9
# A window in which the threads wanted less CPU than this is too short to judge (a timeslice
# lost is several percent of it): taken as quiet. A real probe wants ~0.1 s or more.
MIN_WANTED_S = 0.05
COMPILE_SAVING = 0.10  # the per-step saving assumed before compile has been measured here
COLD_COMPILE_S = 40.0  # assumed cold compile time on a CPU before it has been measured here


@dataclass
class SpeedChoice:
    """What --dtype / --compile came to and why, in the words the run prints first.

    ``step_ms``: the eager time of one optimiser step as measured (None: not measured), which
    the compile meter compares compiled steps with. ``cpu_share`` and ``busy``: how the CPU was
    shared while measuring (:class:`Sharing`); a busy measurement is neither trusted nor cached.
    """

    dtype: str  # "fp32", "bf16" or "fp16"
    compile: bool
    dtype_why: str
    compile_why: str = ""
    cached: bool = False  # the dtype came from the probe cache
    step_ms: float | None = None
    recorded: bool = False  # a resumed run's own record (config.json), not measured again
    cpu_share: float | None = None  # of the CPU its threads wanted while measuring, what they got
    busy: str = ""  # why the measurement was neither trusted nor cached ("": quiet, or not measured)

    @property
    def reason(self) -> str:
        why = "; ".join(x for x in (self.dtype_why, self.compile_why) if x)
        return f"as this run recorded in its config.json ({why})" if self.recorded else why


def cache_path() -> Path | None:
    """The probe's answers (None when ``QKV_CACHE_DIR=off``: measure every time)."""
    root = cache_root()
    return None if root is None else root / "speed_probe.json"


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(native_bf16: bool | None = None) -> dict[str, str | bool | int]:
    """The CPU a run computes with: model, the kernels torch picked for it (ISA), whether it
    multiplies bf16 natively (``native_bf16``: as the caller decided it; default: asked of
    oneDNN), threads and torch version; recorded in every run's config.json."""
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    return {"model": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": native, "threads": torch.get_num_threads(), "torch": torch.__version__}


def machine_id() -> str:
    """CPU model + ISA + threads + torch version: what the probe's answer depends on."""
    m = machine()
    return f"{m['model']}|{m['isa']}|{m['threads']} threads|torch {m['torch']}"


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


def thread_times() -> dict[int, tuple[int, int]] | None:
    """Each thread of this process: (ns it ran on a CPU, ns it waited runnable for one), from
    Linux's ``/proc/self/task/*/schedstat``; None where the kernel keeps no such file."""
    tasks = Path("/proc/self/task")
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    times = {}
    for tid in tids:
        try:
            ran, waited, _ = (tasks / tid / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile (or no schedstat here)
        times[int(tid)] = (int(ran), int(waited))
    return times or None


def load_average() -> float | None:
    """The one-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_note(times: str = "the times the documentation gives (measured on quiet machines)") -> str | None:
    """One line for a long command to print when the machine is busy: the one-minute load
    average above the number of cores (other programs fill every core), so that ``times`` will
    be longer here; None when it is not busy, or the OS keeps no load average."""
    load, cores = load_average(), os.cpu_count() or 1
    if load is None or load <= cores:
        return None
    return f"the machine is busy (load {load:.1f} on {cores} cores): this will take longer than {times}"


@dataclass(frozen=True)
class Sharing:
    """How the CPU was shared while something was measured (see :class:`Watch`).

    share: of the CPU time this process's threads wanted, the fraction they got (None: the
    kernel does not say); wanted_s: that CPU time in seconds; load: the one-minute load average
    at the end; cores, threads: the machine's cores and the threads torch computes with.
    """

    share: float | None
    wanted_s: float | None
    load: float | None
    cores: int
    threads: int

    @property
    def busy(self) -> bool:
        """Whether other programs took enough of the CPU that the measurement cannot be trusted."""
        if self.share is not None and self.wanted_s is not None:
            return self.wanted_s >= MIN_WANTED_S and self.share < MIN_CPU_SHARE
        return self.load is not None and self.load - self.threads >= self.cores

    def describe(self) -> str:
        """'this process got 35% of the CPU its 2 threads wanted; load 4.9 on 2 cores'."""
        load = "" if self.load is None else f"load {self.load:.1f} on {self.cores} cores"
        if self.share is None:
            return f"{load} with {self.threads} threads of this process" if load else "not known here"
        threads = f"{self.threads} thread{'s' * (self.threads != 1)}"
        got = f"this process got {100 * self.share:.0f}% of the CPU its {threads} wanted"
        return f"{got}; {load}" if load else got

    def note(self) -> str:
        """The run's line about a busy measurement."""
        return (f"the machine was busy while measuring ({self.describe()}): not cached, measured "
                "again next run")


class Watch:
    """Started before measuring; :meth:`stop` says how the CPU was shared since."""

    def __init__(self) -> None:
        self.start = thread_times()

    def stop(self) -> Sharing:
        end = thread_times()
        share = wanted = None
        if self.start is not None and end is not None:
            ran = waited = 0
            for tid, (r, w) in end.items():  # threads started meanwhile count from zero
                r0, w0 = self.start.get(tid, (0, 0))
                if r < r0 or w < w0:  # a new thread under a finished one's id
                    r0 = w0 = 0
                ran, waited = ran + r - r0, waited + w - w0
            wanted = (ran + waited) / 1e9
            share = ran / (ran + waited) if ran + waited > 0 else 1.0
        return Sharing(share, wanted, load_average(), os.cpu_count() or 1, torch.get_num_threads())


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


def choose_dtype(ms: dict[str, float], busy: bool = False) -> tuple[str, str]:
    """(dtype, reason) from measured fp32 and bf16 step times; fp32 whatever they say when they
    were measured on a busy machine (``busy``)."""
    ratio = ms["fp32"] / ms["bf16"]  # > 1: bf16 is faster
    pick = "bf16" if ratio >= MIN_BF16_GAIN and not busy else "fp32"
    return pick, (f"bf16 autocast {ms['bf16']:.1f} ms/step vs fp32 {ms['fp32']:.1f} "
                  f"({ratio:.2f}x) {'on a busy machine' if busy else 'here'} -> {pick}")


def step_ratio(compiled: float, eager: float) -> str:
    """Compiled over eager step time in words that read right whichever is faster: '0.92× as long
    as', '2.8× as long as', 'as long as' (a percentage 'faster' goes negative when it is slower)."""
    ratio = compiled / max(eager, 1e-12)
    said = f"{ratio:.2f}".rstrip("0").rstrip(".") if ratio < 10 else f"{ratio:.0f}"
    return "as long as" if said == "1" else f"{said}× as long as"


def compile_worth_trying(ms_per_step: float, max_iters: int, entry: dict | None) -> tuple[bool, str]:
    """Whether a CPU run of ``max_iters`` steps could repay compiling, and why.

    Uses what an earlier compiled run of this shape measured here (``compile_s``: the compile
    time it paid, recompiles included; ``compile_saving``: the fraction of a step saved) when
    the cache holds it, else the typical 40 s and 10%.
    """
    entry = entry or {}
    cost = float(entry.get("compile_s", COLD_COMPILE_S))
    saving = float(entry.get("compile_saving", COMPILE_SAVING))
    gain_s = max(saving, 0.0) * ms_per_step / 1000 * max_iters
    worth = gain_s > cost
    if "compile_s" in entry:
        paid = f"{cost:.0f} s of compiling measured here"
        if "compile_saving" in entry:
            paid += f" (compiled steps took {step_ratio(1 - saving, 1.0)} eager)"
    else:
        paid = f"a typical {cost:.0f} s cold compile"
    return worth, (f"compile {'on' if worth else 'off'}: it could save ~{gain_s:.0f} s of this "
                   f"run against {paid}")


def emulated_bf16_cost(n: int = 256) -> str:
    """How much slower a bf16 matrix product is than fp32 here, measured (a fraction of a
    second), for the warning given when bf16 is asked for on a CPU that emulates it."""
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    ms = time_options(lambda o: (a32 @ b32) if o == "fp32" else (a16 @ b16), ("fp32", "bf16"),
                      rounds=1, steps=1)
    return f"a {n}x{n} bf16 matrix product takes {ms['bf16'] / max(ms['fp32'], 1e-6):.0f}x as long as fp32"
