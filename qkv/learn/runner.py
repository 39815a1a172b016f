"""`qkv learn run NAME [FILE]`: your function inside a real qkv model, beside qkv's own.

The parent reads the file (a syntax error or a missing function: one line, exit 2), then runs
the model in a child process (``python -m qkv.learn.runner``) with a time limit, so that a
student's infinite loop ends as one clear line; the child trains or decodes (see
:mod:`qkv.learn.inside`), writes its measurements as JSON, and the parent draws the plot and
prints the verdict. Exit 0 when the verdict passes, 1 when it does not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from qkv.errors import InputError

TIMEOUT_S = 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Put your function inside a real qkv model and compare it with qkv's own, same seed. "
        "softmax, scaled_dot_product_attention, causal_mask, multi_head_attention, sinusoidal_positions, "
        "layer_norm, feed_forward and cross_entropy go into the `cpu` GPT on Shakespeare: two copies "
        "train from the same weights on the same batches (200 steps: 28-37 s measured on 2 cores of an "
        "AMD Zen 3 or Zen 4), one with your function in every block; the verdict compares their outputs "
        "before training (to 1e-4 of the largest) and their last validation loss (to 0.02 nats), and a "
        "plot shows both loss curves. When the outputs already differ before training it stops there "
        "and says where (the first block and position; 6 s measured), without training. rope and "
        "kv_cache_step "
        "go into SmolLM2-135M (`qkv assets install smollm2`): the greedy text must be qkv's own. "
        "additive_attention goes into the dates RNN (CS231N's Bahdanau attention), trained beside qkv's."
    )
    p.add_argument("name", help="the exercise (qkv learn list)")
    p.add_argument("file", nargs="?", default=None, help="your file (default ./qkv-exercises/NAME.py)")
    p.add_argument("--steps", type=int, default=None, help="training steps (GPT: 200, dates RNN: 100)")
    p.add_argument("--seed", type=int, default=0, help="the seed both models share (default 0)")
    p.add_argument("-o", "--output", default=None,
                   help="the plot (.png or .svg; default ./qkv-exercises/NAME-run.png)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds (default {TIMEOUT_S:g})")


def main(args: argparse.Namespace) -> int:
    from qkv.learn import DEFAULT_DIR, get
    from qkv.learn.inside import GPT_EXERCISES, RUNNABLE, SMOLLM2_EXERCISES
    from qkv.learn.source import read_solution

    e = get(args.name)
    if e.name not in RUNNABLE:
        raise InputError(f"{e.name} has no model to run in; `qkv learn run` takes {', '.join(RUNNABLE)} "
                         f"(`qkv learn check {e.name}` checks it)")
    if args.steps is not None and not 1 <= args.steps <= 5000:
        raise InputError(f"--steps must be between 1 and 5000, got {args.steps}")
    path = Path(args.file) if args.file else Path(DEFAULT_DIR) / f"{e.name}.py"
    read_solution(e.name, path)
    out = Path(args.output) if args.output else Path(DEFAULT_DIR) / f"{e.name}-run.png"
    if out.suffix.lower() not in (".png", ".svg"):
        raise InputError(f"-o {out}: the plot is a .png or an .svg")
    from qkv.assets import is_installed

    if e.name in SMOLLM2_EXERCISES and not is_installed("smollm2"):
        raise InputError(f"{e.name} runs inside SmolLM2: `qkv assets install smollm2` first")
    if e.name in GPT_EXERCISES and not is_installed("shakespeare"):
        raise InputError(f"{e.name} trains a GPT on Shakespeare: `qkv assets install shakespeare` first")
    result = _in_child(e.name, path, args.steps, args.seed, args.timeout)
    if "error" in result:
        print(f"{e.name}: {result['error']}")
        return 1
    _plot(result, out)
    if args.json:
        print(json.dumps({**result, "plot": str(out)}, ensure_ascii=False))
    else:
        print(f"{e.name} inside {result['model']}: {'PASS' if result['passed'] else 'FAIL'}")
        print(f"  {result['verdict']}")
        for label, text in result.get("texts", {}).items():
            print(f"  {label:6s} {text!r}")
        print(f"  tolerance: {result['tolerance']}; {result['seconds']:.1f} s; plot: {out}")
    return 0 if result["passed"] else 1


def _in_child(name: str, path: Path, steps: int | None, seed: int, timeout: float) -> dict[str, Any]:
    """Run the model in a child process (progress on this terminal); its measurements."""
    with tempfile.TemporaryDirectory(prefix="qkv-learn-run-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "qkv.learn.runner", name, str(path.resolve()), str(result),
               str(steps or 0), str(seed)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, cwd=str(path.resolve().parent), env=os.environ)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"error": f"it did not finish in {timeout:g} s (an infinite loop in your function?)"}
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
            raise
        if result.is_file():
            return json.loads(result.read_text())
        return {"error": f"the run ended without a result (exit code {proc.returncode})"}


def _plot(result: dict[str, Any], out: Path) -> None:
    """Loss curves (training runs) or the greedy tokens side by side (SmolLM2 runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qkv.fileio import atomic_write

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    if not result["curves"] and not result["tokens"]:  # stopped before training: nothing to draw but why
        ax.axis("off")
    elif result["curves"]:
        styles = {"yours": dict(color="#d95f02"), "qkv's": dict(color="#1b9e77", linestyle="--")}
        for who, splits in result["curves"].items():
            for split, pts in splits.items():
                steps, losses = zip(*pts, strict=True) if pts else ((), ())
                train = split == "train"
                kw = dict(styles[who], alpha=0.35 if train else 1.0, lw=1 if train else 2.2,
                          marker=None if train else "o", ms=3)
                ax.plot(steps, losses, label=f"{split}, {who}", **kw)
        ax.set_xlabel("training step")
        ax.set_ylabel("cross-entropy (nats)")
        ax.legend(frameon=False)
    else:
        ours, yours = result["tokens"]["qkv's"], result["tokens"]["yours"]
        same = [int(a == b) for a, b in zip(yours, ours, strict=True)]
        ax.bar(range(len(same)), [1] * len(same), color=["#1b9e77" if s else "#d95f02" for s in same])
        ax.set_yticks([])
        ax.set_xlabel("generated token (green: the same as qkv's, orange: different)")
        ours_text = result["texts"]["qkv's"]
        ax.text(0, 1.08, f"qkv's: {ours_text[:70]!r}", fontsize=8)
        ax.text(0, 1.2, f"yours: {result['texts']['yours'][:70]!r}", fontsize=8)
        ax.set_ylim(0, 1.35)
    import textwrap

    verdict = textwrap.fill(f"{'PASS' if result['passed'] else 'FAIL'}: {result['verdict']}", 95)
    ax.set_title(f"your {result['exercise']} in {result['model'].split(' (')[0]}\n{verdict}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format=out.suffix.lower().lstrip(".")))
    plt.close(fig)


def _child(name: str, path: str, result: str, steps: str, seed: str) -> None:
    import runpy

    from qkv.learn.inside import StudentError, run

    ns = runpy.run_path(path, run_name="student")
    fn = ns.get(name)
    tty = sys.stderr.isatty()

    def progress(label: str, step: int, total: int) -> None:
        if tty:  # one line per model, rewritten in place
            end = "\n" if step == total else ""
            print(f"\r  {label:6s} {step}/{total}", end=end, file=sys.stderr, flush=True)
        elif step == total or step % max(1, total // 5) == 0:  # a log: a line every fifth of the run
            print(f"  {label:6s} {step}/{total}", file=sys.stderr, flush=True)

    try:
        out = run(name, fn, steps=int(steps) or None, seed=int(seed), progress=progress).as_dict()
    except NotImplementedError:
        out = {"error": f"{name} is not written yet (it raises NotImplementedError)"}
    except StudentError as e:
        out = {"error": str(e)}
    Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    _child(*sys.argv[1:6])
