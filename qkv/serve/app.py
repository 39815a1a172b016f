"""The attention explorer's web app: a JSON API (FastAPI) and one static page.

    GET  /                      the page (static/index.html, app.js, style.css; no build step)
    GET  /api/models            pretrained models installed + runs found under the runs directory
    POST /api/attention         text -> one layer's / head's attention (seq2seq: the alignment)
    POST /api/generate          a GPT continues a prompt; each new token streams with its attention
    POST /api/image-attention   an image upload -> overlays (ViT heads + rollout, captioner words)
    GET  /openapi.json          the schema of all of the above

Errors are JSON ``{"detail": "..."}`` with 400 (malformed model name), 404 (unknown model),
413 (upload or image too large), 415 (not an image), 422 (input the model cannot take),
503 (a missing optional dependency). Models are loaded once and shared (see registry.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from qkv import __version__
from qkv.serve.api import Explorer
from qkv.serve.registry import Registry
from qkv.serve.schemas import (
    MAX_CHARS,
    AttentionResponse,
    ErrorMessage,
    GenerateEvent,
    ImageAttentionResponse,
    ModelList,
)

STATIC = Path(__file__).resolve().parent / "static"
# The page loads nothing from elsewhere: the browser enforces it.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


@dataclass
class ServeConfig:
    """Limits and places. Every limit answers with a 4xx JSON message when crossed, except
    ``max_tokens``, beyond which text is truncated with a note."""

    runs_dir: Path = Path("runs")
    max_tokens: int = 256  # longest text a request shows (and never more than the model's context)
    max_chars: int = MAX_CHARS  # longest text accepted at all (422 beyond)
    max_new_tokens: int = 128  # most tokens one /api/generate request may ask for
    max_upload_bytes: int = 5_000_000  # largest image upload (413 beyond)
    max_pixels: int = 25_000_000  # largest image, width x height (413 beyond)
    max_loaded_models: int = 4  # models kept in memory at once
    cache_bytes: int = 256 * 2**20  # recent attention results, so switching head is instant
    allowed_hosts: Sequence[str] | None = field(default=None)  # Host headers accepted (None: any)

    def __post_init__(self) -> None:
        self.runs_dir = Path(self.runs_dir)
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if self.max_upload_bytes < 1:
            raise ValueError(f"max upload size must be positive, got {self.max_upload_bytes} bytes")


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorMessage, "description": text} for code, text in {
        400: "a malformed model name (e.g. a path that leaves the runs directory)",
        404: "no such model or run",
        413: "the upload or the image is too large",
        415: "the upload is not an image",
        422: "input the model cannot take (empty text, an image for a text model, ...)",
        503: "an optional dependency is missing",
    }.items()
}


class _BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413, counting what arrives (a missing or
    false Content-Length cannot get around it), before anything is parsed or spooled."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"detail": f"the request is larger than the {self.max_bytes:,} bytes "
                           "allowed; send a smaller file"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        seen, over, started = 0, False, False

        async def limited_receive() -> dict:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if over:  # the app's answer to a cut-off body: ours goes out instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(send)


def create_app(config: ServeConfig | None = None, **overrides: Any) -> FastAPI:
    """The app. ``create_app(runs_dir=...)`` is ``create_app(ServeConfig(runs_dir=...))``."""
    cfg = config or ServeConfig(**overrides)
    registry = Registry(cfg.runs_dir, cfg.max_loaded_models)
    app = FastAPI(
        title="qkv attention explorer", version=__version__,
        description="See what attention does: per layer and head, as heatmaps and lines, for "
        "pretrained models (MiniLM, SmolLM2) and runs from `qkv train`.",
        docs_url=None, redoc_url=None,  # their pages load scripts from a CDN; the page must not
    )
    app.state.config, app.state.registry = cfg, registry
    app.add_middleware(_BodyLimit, max_bytes=cfg.max_upload_bytes + 256_000)
    if cfg.allowed_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(cfg.allowed_hosts))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query"))
            parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", "invalid"))
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        if not request.url.path.startswith("/api/"):
            response.headers.setdefault("Content-Security-Policy", CSP)
        return response

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    api = Explorer(cfg, registry)
    json_errors = {"responses": ERRORS}
    app.add_api_route("/api/models", api.models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/api/attention", api.attention, methods=["POST"],
                      response_model=AttentionResponse, **json_errors)
    app.add_api_route("/api/generate", api.generate, methods=["POST"], responses={
        200: {"description": "one GenerateEvent per line", "content": {
            "application/x-ndjson": {"schema": GenerateEvent.model_json_schema()}}}, **ERRORS})
    app.add_api_route("/api/image-attention", api.image_attention, methods=["POST"],
                      response_model=ImageAttentionResponse, **json_errors)
    return app
