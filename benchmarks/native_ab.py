"""Two versions of qkv's native one-token step (``qkv::Decoder`` in ``qkv/kernels/qmatmul.cpp``)
timed against each other in one process, on SmolLM2-135M q4: what a change to the kernel buys,
measured so that the host's swings fall on both alike.

Each version of ``qmatmul.cpp`` (a git revision, a file, or ``work``: the working tree's) is
compiled under an ops namespace of its own (``qkv_ab0``, ``qkv_ab1``, ...; ~10 s each) and bound to
the same model tensors and the same cache; then ``--blocks`` blocks, each running every version
for 32 tokens in turn (positions spread over ``--positions``, 32 160 by default; one row; the
cache's keys and values as the prompt left them: the step's arithmetic, not a text's). Reported
per version: the median and mean ms a token over the blocks, and the median of its blocks' ratios
to the first version's in the same block (below 1: faster). A revision's kernel must take the
same ``Decoder(tensors, ints, floats)`` as this checkout's ``qkv.generation.native_step._tensors``
gives (true from bc4c917 on; a kernel from before the tenth int, the far prefetches, is given the
first nine; a kernel from before e4bae3d, the greedy steps' 4-bit head, the tensors without it).

    python benchmarks/native_ab.py 0329dcb work            # the working tree against a commit
    python benchmarks/native_ab.py HEAD~1 HEAD --blocks 400
    python benchmarks/native_ab.py HEAD~1 work --positions 960 1088   # a long context
    python benchmarks/native_ab.py HEAD work --rows 2 4 8              # a running batch's steps

``--rows`` times a running batch's steps (``step_rows``, or ``greedy_step_rows`` with
``--greedy``) of each number of rows instead of one row's ``step``: every row at the block's
position, ms a step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

NAME = "native_ab"
ROOT = Path(__file__).resolve().parents[1]
SOURCE = "qkv/kernels/qmatmul.cpp"


def source_of(version: str, folder: Path, i: int) -> Path:
    """The qmatmul.cpp of ``version`` (a revision, a path, or "work") as a file in ``folder``."""
    if version == "work":
        return ROOT / SOURCE
    if Path(version).is_file():
        return Path(version)
    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{version}:{SOURCE}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"no {SOURCE} at {version!r}: {r.stderr.strip()} "
                         "(give a revision, a file or 'work')")
    out = folder / f"qmatmul_{i}.cpp"
    out.write_text(r.stdout)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="+", help="git revisions, qmatmul.cpp files, or 'work' (two or more)")
    p.add_argument("--blocks", type=int, default=200, help="blocks of 32 tokens per version (default 200)")
    p.add_argument("--positions", type=int, nargs=2, default=(32, 160), metavar=("FROM", "TO"),
                   help="the 32 tokens of a block at positions spread over [FROM, TO) (default 32 160)")
    p.add_argument("--greedy", action="store_true",
                   help="time greedy steps (greedy_step: the head's 4-bit copy; kernels from e4bae3d on)")
    p.add_argument("--rows", type=int, nargs="+", default=None, metavar="N",
                   help="time a running batch's steps of N rows (step_rows), each N in turn, not step")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/native_ab.json)")
    args = p.parse_args()
    first, last = args.positions
    if len(args.versions) < 2 or args.blocks < 1 or not 1 <= first < last:
        raise SystemExit("give two or more versions, --blocks >= 1 and --positions FROM TO "
                         "with 1 <= FROM < TO")
    if args.rows is not None and not all(1 <= n <= 64 for n in args.rows):
        raise SystemExit("--rows: each number of rows from 1 to 64")

    import torch

    import qkv
    from qkv.generation import native_step as ns
    from qkv.kernels import compile_library, int4_op

    machine = C.machine_info()
    print(C.machine_line(machine))
    int4_op()  # this checkout's library first: the model's layers load their ops from it
    lm = qkv.load("smollm2", weights="q4")
    m = lm.model
    why = ns.unsupported(m)
    if why is not None:
        raise SystemExit(f"the native step does not run here: {why}")
    if last > m.cfg.max_seq_len:
        raise SystemExit(f"--positions: SmolLM2's context is {m.cfg.max_seq_len} positions")
    tensors, ints, floats = ns._tensors(m)
    decoders = []
    with tempfile.TemporaryDirectory(prefix="qkv-native-ab-") as tmp:
        for i, v in enumerate(args.versions):
            src = source_of(v, Path(tmp), i)
            lib = Path(tmp) / f"ab{i}.so"
            t = time.perf_counter()
            compile_library(lib, namespace=f"qkv_ab{i}", source=src)
            torch.ops.load_library(str(lib))
            cls = getattr(torch.classes, f"qkv_ab{i}").Decoder
            # a kernel from before the greedy steps' 4-bit head takes the tensors without it, one
            # from before the tenth int (the far prefetches) the first nine; any other refusal is
            # raised again by the last try
            plain = tensors[: 8 + 12 * m.cfg.n_layers]
            tries = [(tensors, ints), (plain, ints), (plain, ints[:9])]
            for j, (ts, xs) in enumerate(tries):
                try:
                    decoders.append(cls(ts, xs, floats))
                    break
                except RuntimeError:
                    if j == len(tries) - 1:
                        raise
            if args.greedy and not hasattr(decoders[-1], "greedy_step"):
                raise SystemExit(f"native_ab: {v}'s kernel has no greedy_step (from e4bae3d on): "
                                 "leave out --greedy")
            if args.rows and not hasattr(decoders[-1], "step_rows"):
                raise SystemExit(f"native_ab: {v}'s kernel has no step_rows (a running batch's step): "
                                 "leave out --rows")
            print(f"{v}: built in {time.perf_counter() - t:.0f} s", flush=True)
    counts = args.rows or [0]  # 0: one row's step
    cache_rows = max(args.rows) if args.rows else 1
    cache = m.make_cache(cache_rows, last)
    positions = [first + (last - first) * i // 32 for i in range(32)]
    # (the version's index, rows) in the order timed: by index, so that a version named twice
    # (an A/A run, the noise) times its own decoder
    runs = [(i, n) for n in counts for i in range(len(args.versions))]
    times: list[list[float]] = [[] for _ in runs]
    load = C.LoadMeter()
    with torch.inference_mode():
        m(torch.tensor([[1] * first] * cache_rows), cache=cache)
        empty = torch.empty(0)
        for _ in range(args.blocks):
            for j, (i, n) in enumerate(runs):
                d = decoders[i]
                t = time.perf_counter()
                if n == 0:
                    step = d.greedy_step if args.greedy else d.step
                    for pos in positions:
                        step(42, pos, cache.k, cache.v, empty)
                else:
                    step_rows = d.greedy_step_rows if args.greedy else d.step_rows
                    tokens = torch.full((n,), 42, dtype=torch.long)
                    for pos in positions:
                        step_rows(tokens, torch.full((n,), pos, dtype=torch.long), cache.k, cache.v, empty)
                times[j].append((time.perf_counter() - t) / 32)
    load_info = load.stop()
    rows, summary = [], {}

    def label(i: int, n: int) -> str:  # a version named twice is told apart by its place
        v = args.versions[i]
        v = f"{v} #{i + 1}" if args.versions.count(v) > 1 else v
        return v if n == 0 else f"{v} x{n} rows"

    for j, (i, n) in enumerate(runs):
        ratios = [a / b for a, b in zip(times[j], times[runs.index((0, n))], strict=True)]
        key = label(i, n)
        summary[key] = {"median_ms": round(C.median(times[j]) * 1e3, 4),
                        "mean_ms": round(sum(times[j]) / len(times[j]) * 1e3, 4),
                        "ratio_to_first": round(C.median(ratios), 4)}
        rows.append([key, f"{summary[key]['median_ms']:.3f}", f"{summary[key]['mean_ms']:.3f}",
                     f"{summary[key]['ratio_to_first']:.4f}"])
    what = "ms a token" if not args.rows else "ms a step of the rows"
    C.print_table(f"the native step, SmolLM2 q4, {what} ({args.blocks} blocks of 32 steps at positions "
                  f"{first}-{last - 1}; "
                  f"{C.load_line(load_info)})", ["version", "median", "mean", "÷ first (paired median)"],
                  rows)
    per_block = {label(i, n): [round(x * 1e3, 4) for x in ts] for (i, n), ts in zip(runs, times, strict=True)}
    out = C.write_json(NAME, {"machine": machine, "blocks": args.blocks, "versions": args.versions,
                              "rows": args.rows, "greedy": args.greedy, "positions": [first, last],
                              "summary": summary, "load": load_info, "ms_per_block": per_block}, args.out)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    sys.exit(main())
