"""Shared helpers for the benchmark scripts (not a benchmark itself: the leading underscore
keeps ``qkv bench`` from running it).

What lives here: a description of the machine (CPU, ISA flags, cores, torch, threads), a
meter for how busy the CPUs were with *other* processes during a run, small statistics,
table printing (``rich`` when it is importable, plain text otherwise) and JSON output to
``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# the decoding benchmarks' prompt (its first 32 SmolLM2 tokens): saved_step.py, decode_limit.py,
# sampled_decoding.py, avx2_paths.py
DECODE_TEXT = ("The history of the city begins with a small settlement on an island in the river. Over the "
               "centuries it grew into a centre of trade and learning, with markets, bridges and churches. ")
REPO_DIR = Path(__file__).resolve().parent.parent

# ISA features that decide which CPU kernels PyTorch can use (bf16 GEMMs need avx512_bf16
# or AMX to be fast; without them PyTorch falls back to a much slower path).
_FLAGS_OF_INTEREST = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                      "amx_bf16", "amx_tile")


# --------------------------------------------------------------------------- machine


def cpu_info() -> dict[str, str]:
    """This CPU's /proc/cpuinfo fields (its first processor's block: vendor_id, cpu family, model,
    flags, ...; empty off Linux)."""
    info: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if not line.strip():
            if info:
                break
            continue
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty off Linux)."""
    return set(cpu_info().get("flags", "").split())


def _meminfo_gb(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    except OSError:
        pass
    return None


def mem_available_gb() -> float | None:
    """MemAvailable from /proc/meminfo in GiB (None where unknown)."""
    return _meminfo_gb("MemAvailable")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict:
    """Everything needed to tell whether two result files are comparable."""
    cpu = cpu_info()
    flags = set(cpu.get("flags", "").split())
    try:
        cores_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        cores_usable = os.cpu_count()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    model = cpu.get("model name") or platform.processor() or "unknown"
    return {
        "cpu_model": model,
        "cpu_family_model": f"family {cpu.get('cpu family', '?')} model {cpu.get('model', '?')}",
        "isa_flags": {f: f in flags for f in _FLAGS_OF_INTEREST},
        "torch_cpu_capability": capability,
        "cores_logical": os.cpu_count(),
        "cores_usable": cores_usable,
        "mem_total_gb": _meminfo_gb("MemTotal"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def machine_line(m: dict) -> str:
    """One human line: CPU, flags present, cores, torch, threads."""
    have = [f for f, ok in m["isa_flags"].items() if ok]
    return (
        f"{m['cpu_model']} ({m['cpu_family_model']}; {' '.join(have) or 'no AVX2'}; "
        f"torch kernels: {m['torch_cpu_capability']}), {m['cores_usable']} cores, "
        f"{m['mem_total_gb']:.0f} GiB RAM, torch {m['torch']}, {m['torch_threads']} threads"
    )


# --------------------------------------------------------------------------- load meter


def _proc_stat_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    v = [int(x) for x in first[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class LoadMeter:
    """How much CPU *other* processes used while a benchmark ran.

    Reads /proc/stat (all CPU time on the machine) and ``os.times()`` (this process and its
    waited-for children) at start and stop; the difference is everybody else. A quiet
    machine shows ~0%; anything well above that means the timings were shared.
    """

    def __init__(self) -> None:
        self.start_wall = time.perf_counter()
        self.start_stat = _proc_stat_jiffies()
        self.start_self = self._self_seconds()
        self.load_start = os.getloadavg() if hasattr(os, "getloadavg") else None

    @staticmethod
    def _self_seconds() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def stop(self) -> dict:
        wall = time.perf_counter() - self.start_wall
        out: dict = {
            "wall_s": round(wall, 1),
            "loadavg_start": self.load_start,
            "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        }
        end = _proc_stat_jiffies()
        if self.start_stat and end:
            hz = os.sysconf("SC_CLK_TCK")
            busy = (end[0] - self.start_stat[0]) / hz
            total = (end[1] - self.start_stat[1]) / hz
            mine = self._self_seconds() - self.start_self
            others = max(busy - mine, 0.0)
            out["cpu_seconds_total"] = round(total, 1)
            out["cpu_seconds_this_benchmark"] = round(mine, 1)
            out["cpu_seconds_other_processes"] = round(others, 1)
            out["other_processes_share"] = round(others / total, 3) if total else None
        return out


def load_line(load: dict) -> str:
    share = load.get("other_processes_share")
    ncpu = os.cpu_count() or 1
    s = f"wall {load['wall_s']:.0f} s"
    if share is not None:
        s += (
            f"; other processes used {100 * share:.0f}% of the machine's CPU time "
            f"(≈{share * ncpu:.1f} of {ncpu} cores)"
        )
    if load.get("loadavg_start") is not None:
        s += (
            f"; load average {load['loadavg_start'][0]:.1f} at start, "
            f"{load['loadavg_end'][0]:.1f} at end"
        )
    return s


# --------------------------------------------------------------------------- statistics


def decode_rate(model, prompt, n_new: int, **kwargs) -> float:
    """Tokens/s of ``qkv.generation.generate`` after its first token: ``n_new`` tokens from
    ``prompt`` (1, T) less the time of one (the prompt and the first step), over ``n_new - 1``;
    ``kwargs`` go to ``generate`` (temperature, top_k, seed, ...)."""
    from qkv.generation import generate

    t = time.perf_counter()
    list(generate(model, prompt, 1, **kwargs))
    first = time.perf_counter() - t
    t = time.perf_counter()
    list(generate(model, prompt, n_new, **kwargs))
    return (n_new - 1) / max(time.perf_counter() - t - first, 1e-9)


def end_child(child: subprocess.Popen, timeout: float = 60) -> None:
    """End a benchmark's child process that reads its work from stdin: its stdin closed (its loop
    ends), waited for; killed if it has not ended within ``timeout`` seconds."""
    try:
        if child.stdin is not None:
            child.stdin.close()
    except OSError:  # it died with work unread (a broken pipe): wait for it all the same
        pass
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# --------------------------------------------------------------------------- output


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on stdout: rich if available, aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        print("  ".join("-" * w for w in widths))
        for r in rows:
            print("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)))
        sys.stdout.flush()
        return
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < 3 else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=max(120, len(title) + 4)).print(table)


def write_json(name: str, payload: dict, path: str | None = None) -> Path:
    """Write ``payload`` to benchmarks/results/<name>.json (or ``path``); return the path."""
    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def have_assets(name: str, assets: Sequence[str]) -> bool:
    """Whether ``assets`` are installed (benchmarks of qkv alone, no reference packages); if not,
    say which is missing and how to install it."""
    from qkv.assets import AssetMissingError, asset_path

    try:
        for a in assets:
            asset_path(a)
    except AssetMissingError as e:
        print(f"{name}: needs qkv assets install {' '.join(assets)} ({e})", file=sys.stderr)
        return False
    return True


def have_reference(name: str, assets: Sequence[str] = ("minilm", "smollm2")) -> bool:
    """Whether the reference packages (transformers, sentence-transformers) and ``assets`` are
    installed; if not, say which is missing and how to install it (the caller exits 2)."""
    try:
        import sentence_transformers  # noqa: F401
        import transformers  # noqa: F401

        from qkv.assets import asset_path

        for a in assets:
            asset_path(a)
    except Exception as e:  # a missing reference package or asset: say which
        print(f"{name}: needs the reference packages and assets: pip install -e '.[reference]' "
              f"&& qkv assets install {' '.join(assets)} ({e})", file=sys.stderr)
        return False
    return True
