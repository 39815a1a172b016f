"""Saved decoding steps for opened models: the command that builds one in another process, and
starting it in the background where a model has none yet (:mod:`qkv.generation.aot`).

``qkv generate`` (after an eager run) and ``qkv serve`` (when a model's batch empties; stopped
when the next request arrives) start the build; the process that started it keeps decoding
eagerly, and the next one, or the same server's next requests once the build is done, load the
steps. ``qkv serve --build-steps MODEL`` builds them first, before it listens (:func:`build_now`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from qkv.generation import aot
from qkv.inference.resolve import ModelRef
from qkv.pipelines.text import CausalLM


def build_command(ref: ModelRef, lm: CausalLM, rows: int = 1, cache_len: int | None = None) -> list[str]:
    """The command that builds ``lm``'s saved step in another process, as this one opened it:
    ``qkv generate REF --weights W --device D --threads N --compile on`` for one token
    (``--compile on`` builds first; the same weights and thread count give the same key);
    ``rows`` > 1 also the step of a running batch of up to that many rows over a
    ``cache_len``-position cache (``--batch-step ROWS:LEN``)."""
    name = ref.name if ref.source == "bundled" else str(ref.path.resolve())
    prompt = [] if ref.source == "run" else ["--prompt", "The"]  # a run continues its newline
    device = lm.model.tok_emb.weight.device.type
    return [sys.executable, "-m", "qkv", "generate", name, "--weights", lm.weights, "--device", device,
            "--compile", "on", "--max-new-tokens", "1", *prompt, "--threads", str(torch.get_num_threads()),
            *(["--batch-step", f"{rows}:{aot.cache_len_for(lm.model, cache_len)}"] if rows > 1 else [])]


def missing(lm: CausalLM, rows: int = 1, cache_len: int | None = None) -> bool:
    """Whether this machine lacks ``lm``'s one-request saved step or, with ``rows`` > 1, its
    running batch's (``cache_len`` positions), with saved steps on (nothing is built)."""
    notes = [aot.saved_step(lm.model)[1]]
    if rows > 1:
        notes.append(aot.saved_step(lm.model, rows=rows, cache_len=cache_len)[1])
    return aot.NO_STEP in notes


def build_later(ref: ModelRef, lm: CausalLM, rows: int = 1, cache_len: int | None = None) -> str | None:
    """Start building ``lm``'s saved step in the background if it has none on this machine
    (:func:`qkv.generation.aot.build_in_background`), and with ``rows`` > 1 the step of a
    running batch of up to that many rows (``cache_len`` positions); what was done, or None
    when it has them, when a build this process started is still running, or when saved steps
    or background builds are off."""
    if not aot.background_enabled() or aot.building() or not missing(lm, rows, cache_len):
        return None
    return aot.build_in_background(lm.model, build_command(ref, lm, rows, cache_len), rows, cache_len)


@dataclass(frozen=True)
class StepBuild:
    """What :func:`build_now` did for one of a model's saved steps."""

    what: str  # "one request" or "a batch of up to R rows x S positions"
    ready: bool  # the step is built and loads: requests decode through it
    note: str  # "built in 46 s", "already built", or why there is none (decoding stays eager)


def build_now(lm: CausalLM, rows: int = 1, cache_len: int | None = None) -> list[StepBuild]:
    """Build ``lm``'s saved steps in this process where this machine has none, and wait: the
    one-request step and, with ``rows`` > 1, the step of a running batch of up to that many rows
    over a ``cache_len``-position cache (``qkv serve --build-steps``; tens of seconds to minutes
    each, once per model and machine, the same keys :func:`build_later` builds). A failure (no
    compiler, saved steps off, a full disk) is a note, never an exception: decoding stays eager."""
    out = []
    for r in (1, rows) if rows > 1 else (1,):
        length = cache_len if r > 1 else None
        what = ("one request" if r == 1 else
                f"a batch of up to {r} rows x {aot.cache_len_for(lm.model, cache_len)} positions")
        if aot.saved_step(lm.model, rows=r, cache_len=length)[0] is not None:
            out.append(StepBuild(what, True, "already built"))
            continue
        t0 = time.perf_counter()
        step, note = aot.saved_step(lm.model, build_missing=True, rows=r, cache_len=length)
        done = f"built in {time.perf_counter() - t0:.0f} s"
        out.append(StepBuild(what, step is not None, done if step is not None else note or aot.NO_STEP))
    return out
