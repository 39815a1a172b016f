"""`qkv generate`: stream text from a trained GPT run or from a pretrained decoder (SmolLM2, a
GGUF file of a decoder architecture), eagerly or through the compiled decoding step."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.inference import ModelRef
    from qkv.pipelines.text import CausalLM


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a trained run or from SmolLM2, with a KV cache",
        description="Sample a continuation of --prompt from a run directory written by `qkv train`, "
        "or from the pretrained SmolLM2-135M-Instruct (`qkv generate smollm2 --prompt ... [--chat]`; "
        "needs `qkv assets install smollm2`), a .gguf file (llama, qwen2, gpt2, gemma), or a Hugging Face "
        "checkpoint folder (llama, mistral, qwen2, gemma, gpt2: config.json + *.safetensors + "
        "tokenizer.json). Tokens stream to the terminal as they are generated.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_OR_MODEL",
                   help="a run directory from `qkv train`, a pretrained model (smollm2), a "
                   ".gguf file (llama, qwen2, gpt2, gemma), or a Hugging Face checkpoint folder; a "
                   "bundled name always means the bundled model (a folder of that name: ./NAME)")
    p.add_argument("--prompt", default=None,
                   help="text to continue (a trained run's default: a newline, or its first character "
                   "if its text has no newline; a pretrained model needs one)")
    p.add_argument("--max-new-tokens", type=int, default=300, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; <1 sharper, >1 more random")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with this mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible samples")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step (slow)")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=("auto", "on", "off", "jit"),
                   help="how each new token is computed. auto (default): through the model's saved "
                   "step when one was built on this machine (a step compiled ahead of time, loaded in "
                   "milliseconds: ~2x eager per token), else eagerly, and a low-priority process "
                   "builds one in the background for later runs (QKV_SAVED_STEP_BACKGROUND=off: not); "
                   "on (or a bare --compile): build "
                   "the saved step first if there is none (about a minute, once per model, weight "
                   "format and machine; kept in qkv's cache folder); off: eagerly; jit: torch.compile "
                   "in this process (~7-65 s each time). QKV_SAVED_STEP=off also turns saved steps off")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads PyTorch decodes with (default: one per core); a saved step is "
                   "built for a thread count")
    p.add_argument("--batch-step", default=None, metavar="ROWS:LEN", help=argparse.SUPPRESS)  # qkv serve's
    # background build: also the saved step of a running batch of up to ROWS rows, LEN positions
    p.add_argument("--chat", action="store_true",
                   help="(pretrained) wrap the prompt in the model's chat template and print the reply")
    p.add_argument("--system", default=None, help="(pretrained, --chat) a system message")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="weights' precision (default %(default)s: as loaded, i.e. float32, "
                   "exact to the reference)")
    p.add_argument("--weights", default=None, choices=("auto", "fp32", "bf16", "int8", "q4"),
                   help="how the weights are stored while decoding (overrides --dtype): int8 rows or "
                   "(pretrained GGUFs stored in 4 bits) the file's own 4-bit groups read fewer bytes "
                   "per token; fp32 is exact to the reference. Default (auto): fp32 for a trained run, "
                   "q4 for a GGUF stored in 4 bits such as smollm2's (BENCHMARKS.md: speed, agreement)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """One decoding path for every decoder: a run, a bundled model, a GGUF file or a Hugging
    Face folder is opened as a :class:`~qkv.pipelines.CausalLM` and streamed by it."""
    from qkv.device import check_device
    from qkv.generation import aot
    from qkv.generation.sampling import check_sampling
    from qkv.inference import open_model, resolve
    from qkv.pipelines.text import CausalLM

    check_device(args.device)
    check_sampling(args.temperature, args.top_k, args.top_p, ("--temperature", "--top-k", "--top-p"))
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.prompt is not None and not args.prompt.strip(" \t") and not args.chat:
        raise ValueError("the prompt is empty; give --prompt TEXT (a run continues a newline without one)")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat message: add --chat")
    check_compile(args)
    batch = parse_batch_step(args.batch_step) if args.batch_step else None
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    ref = resolve(args.run)
    if args.prompt is None and ref.source != "run":  # only a run has a prompt of its own (a newline)
        raise ValueError(f"{args.run} continues a prompt: give --prompt TEXT (with --chat: your message)")
    if ref.note:
        print(f"qkv: note: {ref.note}", file=sys.stderr)
    # a previous run's background build would slow this one many times (a build-first run,
    # --compile on, as background builds are, lets them go on: it may wait for one of them)
    with aot.paused_builds() if args.compile != "on" else contextlib.nullcontext():
        t0 = time.perf_counter()
        weights = args.weights or {"float32": "fp32", "bfloat16": "bf16", None: None}[args.dtype]
        lm = open_model(ref, device=args.device, weights=weights, kinds=("decoder",))
        assert isinstance(lm, CausalLM)
        loaded = f"[{args.run}: loaded in {time.perf_counter() - t0:.1f} s, weights {lm.weights}]"
        prompt = args.prompt if args.prompt is not None else lm.default_prompt
        if prompt is None:
            raise ValueError(f"{args.run} continues a prompt: give --prompt TEXT (with --chat: your message)")
        pieces = lm.stream(prompt, args.max_new_tokens, chat=args.chat, system=args.system,
                           temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p,
                           seed=args.seed, use_cache=not args.no_cache, compile=COMPILE[args.compile],
                           slide=not args.chat)
        started = False  # notes and the echoed prompt come once generation has started (errors first)
        for piece in pieces:
            if not started:
                _start(lm, prompt, args.chat, loaded)
                started = True
            sys.stdout.write(piece)
            sys.stdout.flush()
        if not started:
            _start(lm, prompt, args.chat, loaded)
    sys.stdout.write("\n")
    st = lm.last_stats
    print(f"[{st.new_tokens} tokens in {st.seconds:.2f} s after a {st.prompt_tokens}-token prompt, "
          f"{st.tokens_per_s:.1f} tok/s, {decode_mode(args, lm, ref, st)}]",
          file=sys.stderr)
    if batch is not None:
        print(f"[{batch_step(lm, *batch)}]", file=sys.stderr)
    return 0


def parse_batch_step(spec: str) -> tuple[int, int]:
    """``ROWS:LEN`` -> (rows, positions), checked (ValueError: one line)."""
    try:
        rows, length = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--batch-step takes ROWS:LEN, got {spec!r}") from None
    if not 2 <= rows <= 64 or length < 8:
        raise ValueError(f"--batch-step: 2..64 rows and at least 8 positions, got {spec!r}")
    return rows, length


def batch_step(lm: CausalLM, rows: int, length: int) -> str:
    """Build (or find) the saved step of a running batch of up to ``rows`` rows and ``length``
    positions (what ``qkv serve``'s background build asks for besides the one-row step)."""
    from qkv.generation import aot

    step, note = aot.saved_step(lm.model, build_missing=True, rows=rows, cache_len=length)
    if step is None:
        return f"no saved step for {rows} rows: {note}"
    return f"saved step for up to {rows} rows of {step.cache_len} positions: {note or 'already built'}"


def _start(lm: CausalLM, prompt: str, chat: bool, loaded: str) -> None:
    """What goes out before the first new text, once the request is known to be good (an error
    is then the only line): how the model loaded, notes on the request, then the prompt (a chat
    prints only the reply)."""
    print(loaded, file=sys.stderr)
    for note in lm.last_stats.notes:
        print(f"qkv: warning: {note}", file=sys.stderr)
    if not chat:
        sys.stdout.write(prompt)


COMPILE: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False, "jit": "jit"}


def bare_compile(argv: list[str]) -> list[str]:
    """``qkv generate ... --compile`` alone means ``--compile on`` wherever it stands: argparse
    would otherwise read the next word (``qkv generate --compile smollm2``) as its value."""
    if not argv or argv[0] != "generate":
        return argv
    out: list[str] = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == "--compile" and (i + 1 == len(argv) or argv[i + 1] not in COMPILE):
            out.append("on")
    return out


def check_compile(args: argparse.Namespace) -> None:
    if args.compile in ("on", "jit") and args.no_cache:
        raise ValueError("--compile compiles the KV-cache step; drop --no-cache")


def decode_mode(args: argparse.Namespace, lm: CausalLM, ref: ModelRef, st) -> str:
    """'KV cache', 'no cache', the saved step (or why not: with ``--compile auto`` and none built
    yet, one is started in the background for later runs), or the jit-compiled step's compile
    time and rate after it, for the closing stats line (``st``: the stream's StreamStats)."""
    model = lm.model
    if args.no_cache:
        return "no cache"
    if args.compile == "off":
        return "KV cache"
    n_tokens, seconds = st.new_tokens, st.seconds
    if args.compile in ("auto", "on"):
        from qkv.generation import aot
        from qkv.generation.aot import cache_len_for, saved_step

        step, note = saved_step(model)
        if step is not None and step.requests:
            return (f"KV cache, saved step ({note + ', ' if note else ''}loaded in "
                    f"{step.load_seconds * 1000:.0f} ms)")
        if st.prompt_tokens + args.max_new_tokens > cache_len_for(model):
            return (f"KV cache (decoded eagerly: prompt + new tokens exceed the saved step's "
                    f"{cache_len_for(model)})")
        if args.compile == "auto" and note == aot.NO_STEP:
            from qkv.inference.steps import build_command

            later = aot.build_in_background(model, build_command(ref, lm))
            return f"KV cache ({note}: decoded eagerly; {later})"
        return f"KV cache ({note or 'saved step not used'}: decoded eagerly; --compile builds one)"
    from qkv.generation.compiled import compiled_decoder

    dec = compiled_decoder(model)
    if dec.failed:
        return "KV cache (could not compile: decoded eagerly)"
    if not dec.compilations:  # the request did not fit the compiled step's fixed cache
        return f"KV cache (decoded eagerly: prompt + new tokens exceed the compiled step's {dec.cache_len})"
    rest = seconds - dec.compile_seconds
    return (f"KV cache, compiled step: {dec.compile_seconds:.1f} s compiling, then "
            f"{n_tokens / max(rest, 1e-9):.1f} tok/s")
