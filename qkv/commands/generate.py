"""`qkv generate`: stream text from a trained GPT run or from a pretrained decoder (SmolLM2, a
GGUF file of a decoder architecture), eagerly or through the compiled decoding step."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.pipelines.text import CausalLM, StreamStats


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
                   help="how each new token is computed. auto (default): through the native step "
                   "where it runs the model (a 4-bit Llama-shaped decoder such as smollm2: one call of "
                   "qkv's kernels a token, no set-up, ~4-5x eager), else through the model's saved step "
                   "when one was built on this machine (`qkv prepare MODEL`: a step compiled ahead of "
                   "time, loaded in milliseconds, ~3x eager per token), else eagerly (the closing line "
                   "says why and how to build one); on (or a bare --compile): the same, building the "
                   "saved step first where it is the one used and there is none (~40 s on 2 cores, in "
                   "the foreground, once per model, weight format, thread count and machine; kept in "
                   "qkv's cache folder); off: eagerly; jit: torch.compile in this process (~7-65 s each "
                   "time). QKV_NATIVE_STEP=off and QKV_SAVED_STEP=off turn those steps off")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads PyTorch decodes with (default: one per core); a saved step is "
                   "built for a thread count")
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
    from qkv.generation.builds import EagerDecodingWarning
    from qkv.generation.sampling import check_sampling
    from qkv.inference import open_model
    from qkv.inference.loading import resolve_model
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
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    ref = resolve_model(args.run)
    if args.prompt is None and ref.source != "run":  # only a run has a prompt of its own (a newline)
        raise ValueError(f"{args.run} continues a prompt: give --prompt TEXT (with --chat: your message)")
    if ref.note:
        print(f"qkv: note: {ref.note}", file=sys.stderr)
    with warnings.catch_warnings():  # the closing line says why decoding was eager, every run
        warnings.simplefilter("ignore", EagerDecodingWarning)
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
                           seed=args.seed, use_cache=not args.no_cache, mode=MODES[args.compile],
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
    rate = f", {st.decode_tokens_per_s:.1f} after the first" if st.new_tokens > 1 else ""
    print(f"[{st.new_tokens} tokens in {st.seconds:.2f} s after a {st.prompt_tokens}-token prompt, "
          f"{st.tokens_per_s:.1f} tok/s{rate}, {decode_mode(args, lm, st)}]",
          file=sys.stderr)
    return 0


def _start(lm: CausalLM, prompt: str, chat: bool, loaded: str) -> None:
    """What goes out before the first new text, once the request is known to be good (an error
    is then the only line): how the model loaded, notes on the request, then the prompt (a chat
    prints only the reply)."""
    print(loaded, file=sys.stderr)
    for note in lm.last_stats.notes:
        print(f"qkv: warning: {note}", file=sys.stderr)
    if not chat:
        sys.stdout.write(prompt)


MODES: dict[str, str] = {"auto": "auto", "on": "build", "off": "eager", "jit": "jit"}  # --compile: mode


def bare_compile(argv: list[str]) -> list[str]:
    """``qkv generate ... --compile`` alone means ``--compile on`` wherever it stands: argparse
    would otherwise read the next word (``qkv generate --compile smollm2``) as its value."""
    if not argv or argv[0] != "generate":
        return argv
    out: list[str] = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == "--compile" and (i + 1 == len(argv) or argv[i + 1] not in MODES):
            out.append("on")
    return out


def check_compile(args: argparse.Namespace) -> None:
    if args.compile in ("on", "jit") and args.no_cache:
        raise ValueError("--compile compiles the KV-cache step; drop --no-cache")


def decode_mode(args: argparse.Namespace, lm: CausalLM, st: StreamStats) -> str:
    """'KV cache, saved step (loaded in 14 ms)', 'KV cache, eager: none built ...; qkv prepare ...',
    'no cache', or the jit-compiled step's compile time and rate after it: the closing stats
    line, read from the stream's typed decision (``st.decision``), never from message text."""
    if args.no_cache:
        return "no cache"
    d = st.decision
    if d is None:  # nothing was decoded (0 new tokens asked)
        return "KV cache"
    if d.kind == "jit":
        from qkv.generation.compiled import compiled_decoder

        dec = compiled_decoder(lm.model)
        if dec.failed:
            return "KV cache (could not compile: decoded eagerly)"
        rest = st.seconds - dec.compile_seconds
        return (f"KV cache, compiled step: {dec.compile_seconds:.1f} s compiling, then "
                f"{st.new_tokens / max(rest, 1e-9):.1f} tok/s")
    import torch

    from qkv.generation.builds import Why
    from qkv.training.run import command_line

    said = f"KV cache, {d.says()}"
    if d.why in (Why.NOT_BUILT, Why.OTHER_KEY):
        threads = ["--threads", str(torch.get_num_threads())] if d.why is Why.OTHER_KEY else []
        said += f"; `{command_line(['qkv', 'prepare', args.run, *threads])}` builds one (once) for ~3x"
    return said
