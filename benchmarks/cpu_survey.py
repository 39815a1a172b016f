"""Issue 53's decoding measurements on this CPU, in one command: each benchmark run alone, one
after another, its JSON named for the CPU class (``<script>_survey_<cpu>.json`` in
benchmarks/results/), then one table of what each measured against llama.cpp and the limit
(``cpu_survey_<cpu>.json``).

The CPU class is named from /proc/cpuinfo's vendor, family and model (``zen3``, ``zen4``,
``zen5``, ``sapphire_rapids``, ``emerald_rapids``, ``granite_rapids``; otherwise
``<vendor>_f<family>_m<model>``), so that a session on a CPU the docs call unmeasured fills that
row with the same commands as the last. The scripts and their options (``--only`` picks some):

- ``saved_step``: one request, qkv (eager, saved step, native step) against llama.cpp's portable
  and native builds, round robin, quality (top-1 agreement) beside it;
- ``first_runs``: fresh processes before and after ``qkv assets install smollm2``;
- ``decode_limit``: each decoder's fraction of the bandwidth limit;
- ``step_profile``: where the native step's token goes, phase by phase;
- ``from_memory``: the same model read from DRAM (its blocks repeated past the last-level cache);
- ``busy_core``: beside another process's work on one core;
- ``sampled_decoding``: sampling as ``qkv generate`` does, against ``llama-completion``;
- ``batch_rows``, ``serve_batch``: a running batch, and ``qkv serve`` against ``llama-server``;
- ``avx2_paths``: qkv's AVX2 builds against llama.cpp's AVX2 build (where the CPU has AVX2);
- ``setup_time``: ``qkv prepare smollm2`` in an empty cache.

Run nothing else meanwhile (a test run, a build: on 2 cores any other process slows both sides).
llama.cpp is built where missing (``--build-llama-cpp`` is passed to the scripts that take it).

    python benchmarks/cpu_survey.py                   # ~12 minutes on 2 cores (llama.cpp built)
    python benchmarks/cpu_survey.py --only saved_step first_runs
    python benchmarks/cpu_survey.py --summary         # the table from the files already written
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common as C

HERE = Path(__file__).resolve().parent
# script -> its options for the survey (what the closing notes of issue 53 ran on each CPU)
PLAN: dict[str, list[str]] = {
    "saved_step": ["--rounds", "9", "--build-llama-cpp"],
    "first_runs": ["--rounds", "4", "--build-llama-cpp"],
    "decode_limit": ["--rounds", "7", "--build-llama-cpp"],
    "step_profile": ["--rounds", "3"],
    "from_memory": ["--rounds", "6", "--build-llama-cpp"],
    "busy_core": ["--rounds", "6", "--build-llama-cpp"],
    "sampled_decoding": ["--build-llama-cpp"],
    "batch_rows": [],
    "serve_batch": ["--build-llama-cpp"],
    "avx2_paths": ["--rounds", "5", "--build-llama-cpp"],
    "setup_time": [],
}

_INTEL = {143: "sapphire_rapids", 207: "emerald_rapids", 173: "granite_rapids", 174: "granite_rapids"}


def cpu_class(cpuinfo: dict[str, str]) -> str:
    """A short name for the CPU class: AMD's Zen generation by family and model, Intel's server
    cores by model, else vendor, family and model."""
    vendor = cpuinfo.get("vendor_id", "unknown")
    try:
        family, model = int(cpuinfo.get("cpu family", "-1")), int(cpuinfo.get("model", "-1"))
    except ValueError:
        family, model = -1, -1
    if vendor == "AuthenticAMD":
        if family == 25:  # Zen 3: models 0x00-0x0f, 0x20-0x5f; Zen 4: 0x10-0x1f, 0x60-0xaf
            return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "zen3"
        if family == 26 and (model <= 0x2F or 0x40 <= model <= 0x4F or 0x60 <= model <= 0x7F):
            return "zen5"
    if vendor == "GenuineIntel" and family == 6 and model in _INTEL:
        return _INTEL[model]
    if family < 0:
        return "unknown"
    names = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}
    name = names.get(vendor) or re.sub(r"[^a-z0-9]", "", vendor.lower()) or "unknown"
    return f"{name}_f{family}_m{model}"


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}× ({min(xs):.2f}–{max(xs):.2f})"


def summary_rows(name: str, d: dict) -> list[list[str]]:
    """The lines of a result file worth a row: ratios per round (median and range), fractions of
    the limit, first_runs' and step_profile's summaries."""
    rows = []
    for key, v in (d.get("ratios") or {}).items():
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            rows.append([name, key, _spread([float(x) for x in v])])
        elif isinstance(v, dict) and "median" in v:
            rows.append([name, key, f"{v['median']:.2f}× ({v.get('min', float('nan')):.2f}–"
                                    f"{v.get('max', float('nan')):.2f})"])
    for key, v in (d.get("fraction_of_limit") or {}).items():
        rows.append([name, f"fraction of the limit: {key}", f"{v:.2f}"])
    if name == "first_runs":
        rows += [[name, key, f"{v:.2f}" if isinstance(v, float) else str(v)]
                 for key, v in (d.get("summary") or {}).items() if isinstance(v, (int, float))]
    if name == "serve_batch":
        rows += [[name, f"{n} clients: qkv serve ÷ llama-server", _spread(v["batched_vs_llama_server"])]
                 for n, v in (d.get("summary") or {}).items() if v.get("batched_vs_llama_server")]
    if name == "batch_rows":
        rows += [[name, f"{n} rows: native step tok/s; saved ÷ native step time"
                  + ("; on the 8-bit head ÷ native" if "8bit_head_over_native" in v else ""),
                  f"{v['tok_s']:.0f}; {v['saved_over_native']:.2f}"
                  + (f"; {v['8bit_head_over_native']:.2f}" if "8bit_head_over_native" in v else "")]
                 for n, v in (d.get("native_step") or {}).items() if "saved_over_native" in v]
    if name == "setup_time":
        rows += [[name, f"{d.get('command', 'set-up')} ({who}), s", f"{v['wall_s']:.1f}"]
                 for who, v in (d.get("runs") or {}).items() if "wall_s" in v]
    if name == "step_profile":
        rows.append([name, "tokens/s in the step; fraction of the limit (weights / with the cache)",
                     f"{d['tokens_per_s']:.1f}; {d['fraction_weights']:.2f} / "
                     f"{d['fraction_with_cache']:.2f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(PLAN), metavar="SCRIPT",
                    help=f"run these only (of {', '.join(PLAN)}); the summary keeps the other "
                    "scripts' earlier files for this CPU class")
    ap.add_argument("--tag", default=None,
                    help="the CPU class in the files' names (default: named from the CPU)")
    ap.add_argument("--summary", action="store_true",
                    help="print the table of the files already written; run none, write none")
    args = ap.parse_args()

    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9_]+", args.tag):
        ap.error(f"--tag {args.tag!r}: letters, digits and underscores only")
    tag = args.tag or cpu_class(C.cpu_info())
    scripts = args.only or list(PLAN)
    suffix = f"survey_{tag}"
    print(C.machine_line(C.machine_info()) + f"; class {tag}", flush=True)
    failed = []
    if not args.summary:
        for i, script in enumerate(scripts, 1):
            out = C.RESULTS_DIR / f"{script}_{suffix}.json"
            out.unlink(missing_ok=True)  # a failed run leaves no earlier run's file to be read as its
            cmd = [sys.executable, str(HERE / f"{script}.py"), *PLAN[script], "--out", str(out)]
            print(f"\n[{i}/{len(scripts)}] {' '.join(cmd[1:])}", flush=True)
            t = time.perf_counter()
            rc = subprocess.run(cmd, cwd=HERE).returncode  # its output on this terminal, as it goes
            took = C.fmt_time(time.perf_counter() - t)
            print(f"[{i}/{len(scripts)}] {script}: exit {rc} after {took}", flush=True)
            if rc != 0:
                failed.append(script)
    rows = []
    for script in PLAN:  # this run's scripts and, where --only left some out, their earlier files
        path = C.RESULTS_DIR / f"{script}_{suffix}.json"
        if script in failed:
            rows.append([script, "failed in this run", "its output is above"])
        elif path.is_file():
            got = summary_rows(script, json.loads(path.read_text()))
            earlier = script not in scripts
            rows += [[r[0], f"{r[1]} (an earlier run's file)" if earlier else r[1], r[2]] for r in got]
        elif script in scripts:
            rows.append([script, "no result file", str(path.name)])
    C.print_table(f"issue 53 on {tag}", ["script", "measure", "value"], rows)
    if not args.summary:  # (a summary only reads: the file stays the run's, with its machine and date)
        payload = {"machine": C.machine_info(), "cpu_class": tag, "scripts": scripts, "failed": failed,
                   "earlier_files": [s for s in PLAN if s not in scripts
                                     and (C.RESULTS_DIR / f"{s}_{suffix}.json").is_file()],
                   "rows": [{"script": r[0], "measure": r[1], "value": r[2]} for r in rows]}
        print(f"wrote {C.write_json(f'cpu_survey_{tag}', payload)}")
    if failed:
        raise SystemExit(f"cpu_survey: {', '.join(failed)} failed (their output is above)")


if __name__ == "__main__":
    main()
