"""`qkv serve [--host 127.0.0.1] [--port 8000] [--runs DIR] [--build-steps MODEL ...]`: the
attention explorer page."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.serve import ServeConfig
    from qkv.serve.registry import Registry


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="a local web page to explore attention (pretrained models and your runs)",
        description="Serve the attention explorer: choose MiniLM, SmolLM2 or a run found under "
        "--runs, type text and see every layer's and head's attention as a heatmap and as "
        "token-to-token lines; generate with a GPT model and watch each new token's attention; "
        "upload an image for ViT and captioner runs. A JSON API backs the page (its schema: "
        "/openapi.json). Listens on the loopback interface only, unless --host says otherwise; "
        "on a loopback address, requests naming another host are refused (DNS rebinding); "
        "uploads and other POSTs from another web site are refused (Origin, Sec-Fetch-Site); at "
        "most --max-busy requests compute at once, a few wait, the rest get 503 + Retry-After; "
        "generation requests on one model decode together in one running batch (--batch-rows), "
        "through the model's saved decoding steps (compiled ahead of time, kept in qkv's cache "
        "folder) once built: the server builds them in the background while it is idle (a "
        "request stops the build, the next pause starts it again; about a minute each, once per "
        "model and machine; QKV_SAVED_STEP=off: eager decoding; QKV_SAVED_STEP_BACKGROUND=off: "
        "no build; --build-steps MODEL builds them before the server listens). "
        "Needs `pip install 'qkv[serve]'`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; anything but loopback exposes the page to the network")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--runs", default="runs", metavar="DIR",
                   help="where to look for run directories from `qkv train`, Hugging Face checkpoint "
                   "folders and .gguf files (one level deep); nothing outside it is ever read")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="longest text (in tokens) a request may show; longer text is truncated, with a note")
    p.add_argument("--max-upload-mb", type=float, default=5.0, help="largest image upload, in MB")
    p.add_argument("--max-busy-per-model", type=int, default=2,
                   help="requests computing on one model at once")
    p.add_argument("--max-busy", type=int, default=4, help="requests computing on all models at once")
    p.add_argument("--max-queued", type=int, default=4,
                   help="requests waiting per model; beyond that a 503 with Retry-After")
    p.add_argument("--max-wait", type=float, default=30.0,
                   help="seconds a request waits for a slot before a 503")
    p.add_argument("--batch-rows", type=int, default=8,
                   help="generation requests decoded together on one model (continuous batching: a "
                   "request joins the running batch between two steps, and decodes as it would "
                   "alone, to float rounding); 0 = each request decodes alone, in its own work slot")
    p.add_argument("--build-steps", nargs="+", default=[], metavar="MODEL",
                   help="before listening, build the saved decoding steps these models lack on this "
                   "machine (names as the page lists them: smollm2, runs/NAME): the one-request step "
                   "and, with --batch-rows 2 or more, the running batch's (that many rows x --max-tokens "
                   "positions, or the model's context if shorter); about a "
                   "minute each, once per model and machine, so that a busy server decodes fast from "
                   "its first request (without it, steps are built only while the server is idle)")
    p.set_defaults(func=cmd_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port "
                             "or --host") from None


@contextlib.contextmanager
def _status(text: str) -> Iterator[None]:
    """A spinner with ``text`` on a terminal (rich), the line alone otherwise."""
    console = None
    if sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from rich.console import Console

            console = Console(stderr=True)
    if console is None:
        print(text, file=sys.stderr, flush=True)
        yield
        return
    with console.status(text):
        yield


def build_steps(registry: Registry, cfg: ServeConfig, names: list[str]) -> None:
    """``--build-steps``: every name checked first (one line, exit 2, before any build), then
    each decoder loaded and its missing saved steps built (:func:`qkv.inference.steps.build_now`),
    with one line per step; a step that cannot be built is said, and serving goes on eagerly.
    ``registry`` and ``cfg``: the app's (``app.state``)."""
    from qkv.inference.steps import build_now, missing
    from qkv.pipelines.text import CausalLM
    from qkv.serve.threads import in_passing_thread

    def not_a_decoder(name: str, label: str) -> ValueError:
        return ValueError(f"--build-steps {name}: a {label} model has no decoding steps; name a decoder "
                          "(smollm2, a gpt run, a GGUF or Hugging Face decoder)")

    for name in names:  # one line, exit 2, before anything is loaded or built
        try:
            ref = registry.resolve(name)
        except ValueError as e:  # unknown or malformed: say which names there are
            decoders = [x.id for x in registry.entries() if x.kind == "decoder"]
            shown = ", ".join(decoders[:8]) + (", ..." if len(decoders) > 8 else "")
            shown = shown or "none (qkv assets install smollm2, or a gpt run in --runs)"
            why = str(e).split("; ")[0]
            raise ValueError(f"--build-steps {name}: {why}; the decoders here: {shown}") from None
        if ref.kind != "decoder":
            raise not_a_decoder(name, ref.label)
    for name in dict.fromkeys(names):
        ref = registry.resolve(name)
        lm = registry.get(name)
        if not isinstance(lm, CausalLM):
            raise not_a_decoder(name, ref.label)
        total = cfg.longest(lm.context)
        # in threads that end with them, not this one, which serves: see qkv.serve.threads
        building = (_status(f"qkv serve: {name}: building the saved decoding steps this machine lacks "
                            "(about a minute each, once per model and machine)")
                    if in_passing_thread(missing, lm, cfg.batch_rows, total) else contextlib.nullcontext())
        with building:
            done = in_passing_thread(build_now, lm, cfg.batch_rows, total)
        for b in done:
            print(f"qkv serve: {name}: saved step for {b.what}: {b.note}"
                  f"{'' if b.ready else ' (its requests decode eagerly)'}", file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError("qkv serve needs FastAPI and uvicorn: pip install 'qkv[serve]'") from e
    from qkv.serve import ServeConfig, create_app

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_upload_mb <= 0:
        raise ValueError(f"--max-upload-mb must be positive, got {args.max_upload_mb}")
    if Path(args.runs).exists() and not Path(args.runs).is_dir():
        raise ValueError(f"--runs {args.runs} is a file, not a folder of run directories")
    # On a loopback address (IPv4 or IPv6) the app answers only to loopback names: a web page
    # elsewhere cannot reach it through a DNS name it controls (DNS rebinding).
    cfg = ServeConfig(runs_dir=Path(args.runs), max_tokens=args.max_tokens,
                      max_upload_bytes=int(args.max_upload_mb * 1_000_000), host=args.host,
                      max_busy_per_model=args.max_busy_per_model, max_busy=args.max_busy,
                      max_queued=args.max_queued, max_wait_s=args.max_wait, batch_rows=args.batch_rows)
    app = create_app(cfg)
    _check_port_free(args.host, args.port)
    if args.build_steps:
        build_steps(app.state.registry, cfg, args.build_steps)
        _check_port_free(args.host, args.port)  # again: the builds took minutes
    if not _is_loopback(args.host):
        print(f"qkv: warning: serving on {args.host}: anyone who can reach this machine can use "
              "the page and its models", file=sys.stderr)
    runs = cfg.runs_dir.resolve()
    print(f"qkv serve: runs from {runs}{'' if runs.is_dir() else ' (missing: pretrained models only)'}")
    url_host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"qkv serve: open http://{url_host}:{args.port}/ (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
