"""`qkv generate`: stream text from a trained GPT run or from a pretrained decoder (SmolLM2, a
GGUF file of a decoder architecture), eagerly or through the compiled decoding step."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


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
                   ".gguf file (llama, qwen2, gpt2, gemma), or a Hugging Face checkpoint folder")
    p.add_argument("--prompt", default=None,
                   help="text to continue (a trained run's default: a newline, or its first character "
                   "if its text has no newline; a pretrained model needs one)")
    p.add_argument("--max-new-tokens", type=int, default=300, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; <1 sharper, >1 more random")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with this mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible samples")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step (slow)")
    p.add_argument("--compile", action="store_true",
                   help="decode through a torch.compile'd step: ~1.7-2x faster per token once "
                   "compiled (smollm2 q4 on a 2-core Zen 5: 204 tok/s, llama.cpp 195), but compiling takes "
                   "35-65 s the first time on a machine and ~7 s once PyTorch's cache holds it, so "
                   "it pays for long outputs (BENCHMARKS.md)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
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
    import torch

    from qkv.commands.pretrained import DECODERS
    from qkv.device import check_device
    from qkv.families.gpt import GPTFamily
    from qkv.generation import generate, text_pieces
    from qkv.generation.decode import crop_prompt
    from qkv.generation.sampling import check_sampling, make_generator
    from qkv.pretrained.hf import hf_model_type
    from qkv.tokenizers import stop_ids

    check_device(args.device)
    check_sampling(args.temperature, args.top_k, args.top_p, ("--temperature", "--top-k", "--top-p"))
    if ((args.run in DECODERS and not Path(args.run).is_dir()) or args.run.lower().endswith(".gguf")
            or hf_model_type(args.run) is not None):
        return cmd_generate_pretrained(args)
    if args.chat or args.system:
        raise ValueError("--chat and --system need a chat model (smollm2), not a trained run")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    check_compile(args)
    run = GPTFamily().load(Path(args.run), args.device)
    model, tok = run.model, run.tokenizer
    if args.dtype:
        model.to(getattr(torch, args.dtype))
    if args.weights == "q4":
        raise ValueError("--weights q4 decodes from a GGUF's own 4-bit groups (smollm2); for a trained "
                         "run use --weights int8")
    if args.weights in ("auto", "fp32", "bf16"):  # auto: a trained run decodes in fp32
        model.to(torch.bfloat16 if args.weights == "bf16" else torch.float32)
    elif args.weights == "int8":
        from qkv.layers.quant import quantize_linears

        quantize_linears(model, "int8")
    if args.prompt is None:  # a newline (a new speech, in Shakespeare), or a character of its text
        from qkv.families.gpt import sample_prompt

        args.prompt = sample_prompt(tok)
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    x, cropped = crop_prompt(x, model.cfg.max_seq_len)
    if cropped:
        print(f"qkv: warning: prompt has {len(ids)} tokens, more than the context; "
              f"keeping the last {x.shape[1]}", file=sys.stderr)
    gen = make_generator(args.device, args.seed)
    stops = stop_ids(tok)  # a BPE run's <|endoftext|>
    sys.stdout.write(args.prompt)
    out: list[int] = []

    def new_ids():
        for t in generate(model, x, args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k or None, top_p=args.top_p, use_cache=not args.no_cache,
                          generator=gen, compile=args.compile, stop_ids=stops):
            out.append(int(t[0]))
            yield out[-1]

    t0 = time.perf_counter()
    for piece in text_pieces(tok.decode, new_ids(), context=ids):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    dt = time.perf_counter() - t0
    print(f"[{len(out)} tokens in {dt:.2f} s, {len(out) / max(dt, 1e-9):.1f} tok/s, "
          f"{decode_mode(args, model, len(out), dt)}]", file=sys.stderr)
    return 0


DEFAULT_WEIGHTS = "auto"  # q4 for a GGUF stored in 4 bits: fastest, keeps the answers (BENCHMARKS.md)


def cmd_generate_pretrained(args: argparse.Namespace) -> int:
    """`qkv generate smollm2 ...`: stream a continuation (or a chat reply) from the GGUF model."""
    from qkv.pretrained import load

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.prompt is None:
        raise ValueError(f"{args.run} continues a prompt: give --prompt TEXT (with --chat: your message)")
    if not args.prompt.strip() and not args.chat:
        raise ValueError("the prompt is empty; give --prompt TEXT")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat message: add --chat")
    check_compile(args)
    t0 = time.perf_counter()
    weights = args.weights or {"float32": "fp32", "bfloat16": "bf16", None: DEFAULT_WEIGHTS}[args.dtype]
    path = args.run if args.run.lower().endswith(".gguf") else None  # a GGUF of any decoder architecture
    lm = load("smollm2" if path else args.run, path=path, device=args.device, weights=weights)
    used = lm.info.get("weights", weights)
    print(f"[{args.run}: loaded in {time.perf_counter() - t0:.1f} s, weights {used}]", file=sys.stderr)
    n_prompt = len(lm.tokenizer.encode(lm.format_chat(args.prompt, args.system) if args.chat
                                       else args.prompt))
    room = lm.model.cfg.max_seq_len - n_prompt
    if args.max_new_tokens > room > 0:
        print(f"qkv: note: --max-new-tokens {args.max_new_tokens} bounded to {room} by the "
              f"{lm.model.cfg.max_seq_len}-token context", file=sys.stderr)
    pieces = lm.stream(args.prompt, args.max_new_tokens, chat=args.chat, system=args.system,
                       temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p,
                       seed=args.seed, use_cache=not args.no_cache, compile=args.compile)
    echoed = args.chat  # the prompt is echoed once generation has started (errors come first)
    for piece in pieces:
        if not echoed:
            sys.stdout.write(args.prompt)
            echoed = True
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write(("" if echoed else args.prompt) + "\n")
    st = lm.last_stats
    print(f"[{st['prompt_tokens']} prompt + {st['new_tokens']} new tokens in {st['seconds']:.2f} s, "
          f"{st['new_tokens'] / max(st['seconds'], 1e-9):.1f} tok/s, "
          f"{decode_mode(args, lm.model, st['new_tokens'], st['seconds'])}]", file=sys.stderr)
    return 0


def check_compile(args: argparse.Namespace) -> None:
    if args.compile and args.no_cache:
        raise ValueError("--compile compiles the KV-cache step; drop --no-cache")


def decode_mode(args: argparse.Namespace, model, n_tokens: int, seconds: float) -> str:
    """'KV cache', 'no cache' or the compiled step's compile time and rate after it, for the
    closing stats line."""
    if args.no_cache:
        return "no cache"
    if not args.compile:
        return "KV cache"
    from qkv.generation.compiled import compiled_decoder

    dec = compiled_decoder(model)
    if dec.failed:
        return "KV cache (could not compile: decoded eagerly)"
    if not dec.compilations:  # the request did not fit the compiled step's fixed cache
        return f"KV cache (decoded eagerly: prompt + new tokens exceed the compiled step's {dec.cache_len})"
    rest = seconds - dec.compile_seconds
    return (f"KV cache, compiled step: {dec.compile_seconds:.1f} s compiling, then "
            f"{n_tokens / max(rest, 1e-9):.1f} tok/s")
