"""Saved decoding steps for opened models: the command that builds one in another process, and
starting it in the background where a model has none yet (:mod:`qkv.generation.aot`).

``qkv generate`` (after an eager run) and ``qkv serve`` (when a model's batch empties; stopped
when the next request arrives) start the build; the process that started it keeps decoding
eagerly, and the next one, or the same server's next requests once the build is done, load the
steps.
"""

from __future__ import annotations

import sys

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


def build_later(ref: ModelRef, lm: CausalLM, rows: int = 1, cache_len: int | None = None) -> str | None:
    """Start building ``lm``'s saved step in the background if it has none on this machine
    (:func:`qkv.generation.aot.build_in_background`), and with ``rows`` > 1 the step of a
    running batch of up to that many rows (``cache_len`` positions); what was done, or None
    when it has them, when a build this process started is still running, or when saved steps
    or background builds are off."""
    if not aot.background_enabled() or aot.building():
        return None
    notes = [aot.saved_step(lm.model)[1]]
    if rows > 1:
        notes.append(aot.saved_step(lm.model, rows=rows, cache_len=cache_len)[1])
    if aot.NO_STEP not in notes:
        return None
    return aot.build_in_background(lm.model, build_command(ref, lm, rows, cache_len), rows, cache_len)
