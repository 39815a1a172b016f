"""`qkv serve [--host 127.0.0.1] [--port 8000] [--runs DIR] [--build-steps MODEL ...]`: the
attention explorer page."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any


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
        "uploads and other POSTs from another web site are refused (Origin, Sec-Fetch-Site). Every "
        "model computation runs on one compute loop, fair per client (one computation of each in "
        "turn, interactive ones before patching sweeps; up to --max-queued wait, the rest get 503 + "
        "Retry-After), tokens first (computations run in slices of at most 40 ms, the running "
        "batches step between them; a request sent with Accept: application/x-ndjson hears its "
        "place in the queue and its progress, and closing it cancels it), and identical lens, q·k "
        "and patching requests are computed once (--shared-answers); several replicas can serve "
        "one class behind a load balancer (docs/serving.md); generation requests on one model "
        "decode together in one running batch (--batch-rows), through the model's saved decoding "
        "steps where this machine has them (`qkv prepare MODEL --batch-rows R --max-tokens T`, or "
        "--build-steps MODEL before listening; `qkv assets install smollm2` prepares the bundled "
        "model for the defaults), else eagerly (about half the speed; the server says so once). "
        "The server starts no other process. Needs `pip install 'qkv[serve]'`.",
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
    p.add_argument("--max-queued", type=int, default=32,
                   help="requests that may wait for the compute loop (and generations for a row of a "
                   "model's batch); beyond that a 503 with Retry-After")
    p.add_argument("--max-wait", type=float, default=30.0,
                   help="seconds a request may wait to start before a 503")
    p.add_argument("--shared-answers", type=int, default=64,
                   help="recent lens, q·k and patching answers kept for identical requests (keyed by "
                   "the model file, the kind and the whole request); identical requests in flight "
                   "share one computation even with 0")
    p.add_argument("--batch-rows", type=int, default=8,
                   help="generation requests decoded together on one model (continuous batching: a "
                   "request joins the running batch between two steps, and decodes as it would "
                   "alone, to float rounding); 1 = one at a time")
    p.add_argument("--weights", default="auto", choices=("auto", "fp32", "bf16", "int8", "q4"),
                   help="how decoders' weights are held: auto (a 4-bit file such as the bundled SmolLM2's as "
                   "q4 where the int4 kernels run: fastest), fp32 or bf16 (gradients: the patching "
                   "view's estimate needs them; SmolLM2 in fp32 takes ~0.5 GB), int8, q4")
    p.add_argument("--build-steps", nargs="+", default=[], metavar="MODEL",
                   help="before listening, build the saved decoding steps these models lack on this "
                   "machine (names as the page lists them: smollm2, runs/NAME): the one-request step "
                   "and, with --batch-rows 2 or more, the running batch's (that many rows x --max-tokens "
                   "positions, or the model's context if shorter), as `qkv prepare` does; 1-3 "
                   "minutes each on 2 cores, once per model and machine, so that the server decodes fast "
                   "from its first request")
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


def build_steps(app: Any, names: list[str]) -> None:
    """``--build-steps``: every name checked first (one line, exit 2, before any build), then
    each decoder loaded and its missing saved steps built, as ``qkv prepare NAME --batch-rows
    ROWS --max-tokens TOKENS`` would (:func:`qkv.commands.prepare.prepare`), in the server's
    compute loop (the thread that will decode with them); a step that cannot be built is said,
    and serving goes on eagerly. ``app``: the server's (its ``state`` holds the registry, the
    config and the loop)."""
    from qkv.assets import AssetMissingError
    from qkv.commands.prepare import prepare
    from qkv.pipelines.text import CausalLM

    registry, cfg, loop = app.state.registry, app.state.config, app.state.loop

    def not_a_decoder(name: str, label: str) -> ValueError:
        return ValueError(f"--build-steps {name}: a {label} model has no decoding steps; name a decoder "
                          "(smollm2, a gpt run, a GGUF or Hugging Face decoder)")

    for name in names:  # one line, exit 2, before anything is loaded or built
        try:
            ref = registry.resolve(name)
        except AssetMissingError:
            raise ValueError(f"--build-steps {name}: not installed: qkv assets install {name}") from None
        except ValueError:  # unknown or malformed: say which names there are
            decoders = [x.id for x in registry.entries() if x.kind == "decoder"]
            shown = ", ".join(decoders[:8]) + (", ..." if len(decoders) > 8 else "")
            shown = shown or "none (qkv assets install smollm2, or a gpt run in --runs)"
            raise ValueError(f"--build-steps {name}: no such model here; the decoders here: "
                             f"{shown}") from None
        if ref.kind != "decoder":
            raise not_a_decoder(name, ref.label)

    def build(name: str) -> None:
        lm = registry.get(name)
        if not isinstance(lm, CausalLM):
            raise not_a_decoder(name, registry.resolve(name).label)
        prepare(f"qkv serve: {name}", lm, cfg.batch_rows, cfg.longest(lm.context))

    for name in dict.fromkeys(names):
        loop.call(build, name, label="build")


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
                      max_queued=args.max_queued, max_wait_s=args.max_wait, batch_rows=args.batch_rows,
                      shared_answers=args.shared_answers, weights=args.weights)
    app = create_app(cfg)
    _check_port_free(args.host, args.port)
    if args.build_steps:
        build_steps(app, args.build_steps)
        _check_port_free(args.host, args.port)  # again: the builds took minutes
    if not _is_loopback(args.host):
        print(f"qkv: warning: serving on {args.host}: anyone who can reach this machine can use "
              "the page and its models", file=sys.stderr)
    runs = cfg.runs_dir.resolve()
    print(f"qkv serve: runs from {runs}{'' if runs.is_dir() else ' (missing: pretrained models only)'}")
    url_host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"qkv serve: open http://{url_host}:{args.port}/ (Ctrl-C stops)", flush=True)
    before = _exit_on_sigterm()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    return 0


def _exit_on_sigterm() -> Any:
    """SIGTERM ends the server as Ctrl-C does: uvicorn shuts down gracefully, then raises the signal
    again with the handler it found, which here exits through Python (atexit runs: the compute
    loop stops, a compiler this process started is ended) instead of the default action, which
    kills the process on the spot and leaves its children running. Returns the handler it
    replaced (None off the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)
