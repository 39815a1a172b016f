"""The attention explorer's web app: a JSON API (FastAPI) and one static page.

    GET  /                      the page (static/index.html, app.js, style.css; no build step)
    GET  /api/models            pretrained models installed + runs found under the runs directory
    POST /api/attention         text -> one layer's / head's attention (seq2seq: the alignment)
    POST /api/generate          a GPT continues a prompt; each new token streams with its attention
    POST /api/image-attention   an image upload -> overlays (ViT heads + rollout, captioner words)
    POST /api/lens              text -> next-token logits, logit lens, every head (thumbnails,
                                scores), with heads knocked out (qkv.lens)
    POST /api/qk                one head's attention row for one query, term by term
    POST /api/history           a GPT run's head scores at each evaluation (history.jsonl)
    POST /api/patch             activation patching, clean prompt into corrupt (decoders): the
                                estimate by default (attribution patching, float weights; 422 on a
                                quantised model), method "exact" the sweep (progress streamed),
                                with compare both and their agreement (Spearman, top-10 recall)
    POST /api/quiz/question     a question computed from a model; /api/quiz/answer reveals it (quiz_api.py)
    GET  /openapi.json          the schema of all of the above

Errors are JSON ``{"detail": "..."}`` with 400 (malformed model name, or a Host header this
server does not answer to), 403 (a cross-site POST from a browser page), 404 (unknown model),
413 (upload or image too large), 415 (not an image), 422 (input the model cannot take),
503 (the server is busy: ``Retry-After`` says when to retry; or a missing optional
dependency). Models are loaded once and shared, at most ``max_loaded_models`` in memory (see
registry.py); every model computation runs on the server's one compute loop, which also steps
each model's running batch of generations, ``max_queued`` requests at most waiting (see
loop.py). No response names a filesystem path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from qkv.serve.api import Explorer
from qkv.serve.config import ServeConfig
from qkv.serve.guards import BodyLimit, HostCheck, OriginCheck
from qkv.serve.loop import CLIENT, ComputeLoop
from qkv.serve.quiz_api import mount_quiz
from qkv.serve.registry import Registry
from qkv.serve.schemas import (
    AttentionResponse,
    ErrorMessage,
    GenerateEvent,
    HistoryResponse,
    ImageAttentionResponse,
    LensResponse,
    ModelList,
    PatchResponse,
    QKResponse,
)
from qkv.version import __version__

STATIC = Path(__file__).resolve().parent / "static"
# The page loads nothing from elsewhere: the browser enforces it.
_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")  # the page's X-QKV-Client: a random id per browser
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorMessage, "description": text} for code, text in {
        400: "a malformed model name (e.g. a path that leaves the runs directory)",
        403: "a cross-site request from a browser (Origin or Sec-Fetch-Site names another site)",
        404: "no such model or run",
        413: "the upload or the image is too large",
        415: "the upload is not an image",
        422: "input the model cannot take (empty text, an image for a text model, ...)",
        503: "the model is busy (retry after the Retry-After header's seconds), or an optional "
             "dependency is missing",
    }.items()
}


def create_app(config: ServeConfig | None = None, **overrides: Any) -> FastAPI:
    """The app. ``create_app(runs_dir=...)`` is ``create_app(ServeConfig(runs_dir=...))``."""
    cfg = config or ServeConfig(**overrides)
    # models load in the compute loop, which must never wait inside: a load that finds every
    # model in use is answered busy at once (503) instead of waiting for rows the loop steps
    registry = Registry(cfg.runs_dir, cfg.max_loaded_models, max_wait_s=0.0, weights=cfg.weights)
    loop = ComputeLoop(cfg.max_queued, cfg.max_wait_s)
    app = FastAPI(
        title="qkv attention explorer", version=__version__,
        description="See what attention does: per layer and head, as heatmaps and lines, for "
        "pretrained models (MiniLM, SmolLM2) and runs from `qkv train`.",
        docs_url=None, redoc_url=None,  # their pages load scripts from a CDN; the page must not
    )
    app.state.config, app.state.registry, app.state.loop = cfg, registry, loop
    # the last added runs first: Host, then Origin, then the body's size
    app.add_middleware(BodyLimit, max_bytes=cfg.max_upload_bytes + 256_000)
    app.add_middleware(OriginCheck)
    app.add_middleware(HostCheck, allowed=cfg.allowed_hosts, bound=cfg.host)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query"))
            parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", "invalid"))
        return JSONResponse({"detail": " ".join("; ".join(parts).split()) or "invalid request"},
                            status_code=422)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # a bug: the traceback goes to the server's log, the client gets one line without paths
        return JSONResponse({"detail": f"internal error ({type(exc).__name__}) on {request.url.path}; "
                             "the server's log has the details"}, status_code=500)

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Any:
        # who asks, for the compute loop's fair queue: the page's id for this browser, else the address
        client = request.headers.get("x-qkv-client", "")
        if not _CLIENT_ID.fullmatch(client):
            client = "@" + (request.client.host if request.client else "")
        CLIENT.set(client)
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        if not request.url.path.startswith("/api/"):
            response.headers.setdefault("Content-Security-Policy", CSP)
        return response

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/lectures", include_in_schema=False)
    def lectures() -> HTMLResponse:
        from qkv.explain.lectures import lectures_html

        return HTMLResponse(lectures_html())

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    api = Explorer(cfg, registry, loop)
    app.state.explorer = api
    json_errors = {"responses": ERRORS}
    app.add_api_route("/api/models", api.models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/api/attention", api.attention, methods=["POST"],
                      response_model=AttentionResponse, **json_errors)
    app.add_api_route("/api/generate", api.generate, methods=["POST"], responses={
        200: {"description": "one GenerateEvent per line", "content": {
            "application/x-ndjson": {"schema": GenerateEvent.model_json_schema()}}}, **ERRORS})
    app.add_api_route("/api/lens", api.lens, methods=["POST"], response_model=LensResponse, **json_errors)
    app.add_api_route("/api/history", api.history, methods=["POST"], response_model=HistoryResponse,
                      **json_errors)
    app.add_api_route("/api/qk", api.qk, methods=["POST"], response_model=QKResponse, **json_errors)
    app.add_api_route("/api/patch", api.patch, methods=["POST"], response_model=PatchResponse, **json_errors)
    app.add_api_route("/api/image-attention", api.image_attention, methods=["POST"],
                      response_model=ImageAttentionResponse, **json_errors)
    mount_quiz(app, api, ERRORS)
    return app
