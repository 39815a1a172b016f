"""`qkv bench`: run the benchmark scripts of a source checkout (each prints its own table)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_scripts() -> dict[str, Path]:
    d = _benchmarks_dir()
    return {p.stem: p for p in sorted(d.glob("*.py")) if not p.stem.startswith("_")}


def _has_quick(path: Path) -> bool:
    """Whether a script takes ``--quick`` (a smoke run at small sizes): it names the option."""
    return re.search(r"[\"']--quick[\"']", path.read_text(errors="replace")) is not None


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the project's benchmark scripts (each prints its own table)."""
    scripts = _bench_scripts()
    if not scripts:
        raise ValueError(
            f"no benchmark scripts found in {_benchmarks_dir()}; `qkv bench` needs a source "
            "checkout (git clone, then pip install -e .)"
        )
    if args.list:
        for name in scripts:
            print(name)
        return 0
    names = args.names or list(scripts)
    unknown = [n for n in names if n not in scripts]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}; choose from: {', '.join(scripts)}")
    if args.quick:
        without = [n for n in names if not _has_quick(scripts[n])]
        if without and args.names:
            raise ValueError(f"{without[0]} has no quick mode: run it without --quick (its --help "
                             "gives its options)")
        if without:
            print(f"not run with --quick (no quick mode; run each alone): {', '.join(without)}", flush=True)
        names = [n for n in names if n not in without]
    for name in names:
        cmd = [sys.executable, str(scripts[name])] + (["--quick"] if args.quick else [])
        print(f"$ {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            return rc
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="run the benchmarks in benchmarks/ and print their tables",
        description="Run the project's benchmarks. Each reports ratios against a baseline "
        "measured in the same run; results are recorded in BENCHMARKS.md.",
    )
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all; see --list)")
    bench.add_argument("--quick", action="store_true",
                       help="small sizes, for a smoke run (the scripts that have such a mode; "
                       "with no names, the others are listed and left out)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.set_defaults(func=cmd_bench)
