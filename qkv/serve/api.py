"""The JSON API's handlers: requests in, :mod:`qkv.viz.sources` does the work, JSON out.

One :class:`Explorer` per app holds the model registry and the cache of recent attention
results; :func:`qkv.serve.app.create_app` routes the endpoints to its methods. FastAPI runs these
(synchronous) methods in its thread pool, so requests run in parallel; models are shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import torch
from fastapi import File, Form, HTTPException, UploadFile
from fastapi.responses import StreamingResponse

from qkv.serve.registry import AttentionCache, Entry, InvalidNameError, Registry
from qkv.serve.schemas import (
    AttentionRequest,
    AttentionResponse,
    GenerateEvent,
    GenerateRequest,
    ImageAttentionResponse,
    ImageMap,
    ImagePixels,
    ModelInfo,
    ModelList,
)
from qkv.viz import sources
from qkv.viz.sources import InputError, Source, UnknownModelError

if TYPE_CHECKING:
    from qkv.serve.app import ServeConfig


def status_of(e: Exception) -> int | None:
    """The HTTP status of an error a request can cause (None: a bug, 500)."""
    from qkv.assets import AssetMissingError
    from qkv.data.images import ImageTooLargeError
    from qkv.training.checkpoint import CheckpointError

    for cls, code in ((InvalidNameError, 400), (UnknownModelError, 404), (AssetMissingError, 404),
                      (ImageTooLargeError, 413), (InputError, 422), (CheckpointError, 422),
                      (ImportError, 503)):
        if isinstance(e, cls):
            return code
    return None


@contextlib.contextmanager
def http_errors() -> Iterator[None]:
    """Turn the errors a user can cause into HTTP errors with a one-line message."""
    try:
        yield
    except HTTPException:
        raise
    except Exception as e:
        code = status_of(e)
        if code is None:
            raise
        raise HTTPException(code, " ".join(str(e).split()) or type(e).__name__) from None


def _info(e: Entry) -> ModelInfo:
    kind = e.kind
    return ModelInfo(id=e.id, family=e.family, kind=kind, input="image" if kind == "image" else "text",
                     can_generate=kind == "decoder", description=e.description)


def _rows(w: torch.Tensor) -> list[list[float]]:
    """A weight matrix as JSON-friendly rows, 6 decimals (rows still sum to 1 within 1e-5)."""
    return (torch.round(w.float() * 1e6) / 1e6).tolist()


def _event(**fields: Any) -> str:
    return GenerateEvent(**fields).model_dump_json(exclude_none=True) + "\n"


class Explorer:
    """The endpoints' handlers, sharing one model registry and one attention cache."""

    def __init__(self, cfg: ServeConfig, registry: Registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.cache = AttentionCache(cfg.cache_bytes)

    def _load(self, model_id: str) -> Source:
        with http_errors():
            return self.registry.get(model_id)

    def _check_text(self, text: str) -> None:
        if len(text) > self.cfg.max_chars:
            raise HTTPException(422, f"the text has {len(text):,} characters; the limit is "
                                f"{self.cfg.max_chars:,}")

    def models(self) -> ModelList:
        """The models the page can choose: installed pretrained ones, then runs."""
        cfg = self.cfg
        with http_errors():
            entries = self.registry.entries()
        return ModelList(models=[_info(e) for e in entries], runs_dir=str(self.registry.root),
                         limits={"max_chars": cfg.max_chars, "max_tokens": cfg.max_tokens,
                                 "max_new_tokens": cfg.max_new_tokens,
                                 "max_upload_bytes": cfg.max_upload_bytes})

    def attention(self, req: AttentionRequest) -> AttentionResponse:
        """One layer's attention over ``text`` (``head`` null: the mean over heads); for seq2seq
        runs, the alignment of the translation with the input."""
        t0 = time.perf_counter()
        self._check_text(req.text)
        src = self._load(req.model)
        with http_errors():
            if src.kind == "seq2seq":
                return self._alignment(src, req, t0)
            if src.input == "image":
                raise InputError(f"{req.model} is a {src.family} run: it reads images; upload one "
                                 "(POST /api/image-attention)")
            layer, head = sources.check_layer_head(src, req.layer, req.head)
            text_id = hashlib.sha256(req.text.encode()).hexdigest()  # keys stay small, whatever the text
            key = (req.model, src.serial, text_id, self.cfg.max_tokens)
            att = self.cache.get(key)
            if att is None:
                att = sources.text_attention(src, req.text, self.cfg.max_tokens)
                self.cache.put(key, att)
        w = att.weights[layer]  # (H, T, T)
        w = w.mean(0) if head is None else w[head]
        return AttentionResponse(
            model=req.model, kind=src.kind, query_tokens=att.tokens, key_tokens=att.tokens,
            weights=_rows(w), layer=layer, head=head, n_layers=src.n_layers, n_heads=src.n_heads,
            causal=att.causal, notes=att.notes, seconds=time.perf_counter() - t0)

    def _alignment(self, src: Source, req: AttentionRequest, t0: float) -> AttentionResponse:
        ali = sources.alignment(src, req.text)
        return AttentionResponse(
            model=req.model, kind=src.kind, query_tokens=ali.output, key_tokens=ali.source,
            weights=_rows(ali.weights), layer=None, head=None, n_layers=1, n_heads=1, causal=False,
            output=ali.text, notes=ali.notes, seconds=time.perf_counter() - t0)

    def generate(self, req: GenerateRequest) -> StreamingResponse:
        """Continue ``prompt`` with a GPT model (SmolLM2 or a gpt run), streaming each new
        token with the attention of the position that chose it, as newline-delimited JSON."""
        t0 = time.perf_counter()
        self._check_text(req.prompt)
        src = self._load(req.model)
        with http_errors():
            if src.kind != "decoder":
                raise InputError(f"{req.model} is a {src.family} model: only GPT models (smollm2, gpt "
                                 "runs) generate")
            layer, head = sources.check_layer_head(src, req.layer, req.head)
            total = min(self.cfg.max_tokens, src.context)
            ids, notes = sources.encode_text(src, req.prompt, max(1, total - 1), keep="last")
        n_new = min(req.max_new_tokens, self.cfg.max_new_tokens, total - len(ids))
        if n_new < req.max_new_tokens:
            notes.append(f"{n_new} new tokens at most: the prompt has {len(ids)} tokens and the "
                         f"limit is {total}")

        def events() -> Iterator[str]:
            yield _event(event="start", tokens=sources.token_labels(src, ids), layer=layer, head=head,
                         n_layers=src.n_layers, n_heads=src.n_heads, notes=notes)
            new: list[int] = []
            try:
                for step in sources.generate_steps(src, ids, n_new, layer=layer, head=head,
                                                   temperature=req.temperature, top_k=req.top_k,
                                                   seed=req.seed):
                    new.append(step.id)
                    yield _event(event="token", token=step.token, id=step.id,
                                 weights=[round(float(v), 6) for v in step.weights])
            except Exception as e:  # the status line has gone out: report in the stream
                yield _event(event="error", detail=" ".join(str(e).split()) or type(e).__name__)
                return
            yield _event(event="done", text=src.tokenizer.decode(new), seconds=time.perf_counter() - t0)

        return StreamingResponse(events(), media_type="application/x-ndjson")

    def image_attention(self, model: Annotated[str, Form(max_length=256)],
                        image: Annotated[UploadFile, File()],
                        layer: Annotated[int | None, Form()] = None) -> ImageAttentionResponse:
        """An image upload -> where a ViT run looks (each head of ``layer`` and the rollout) or
        what a captioner run says and where it looked for each word."""
        t0 = time.perf_counter()
        limit = self.cfg.max_upload_bytes
        data = image.file.read(limit + 1)
        if len(data) > limit:
            raise HTTPException(413, f"the upload is larger than {limit:,} bytes; send a smaller image")
        if not data:
            raise HTTPException(422, "the upload is empty; choose an image file")
        src = self._load(model)
        with http_errors():
            if src.input != "image":
                raise InputError(f"{model} is a {src.family} model: it reads text, not images")
            try:
                x, notes = sources.read_model_image(src, data, self.cfg.max_pixels)
            except ValueError as e:
                if status_of(e) is not None:
                    raise
                raise HTTPException(415, f"{image.filename or 'the upload'} is not an image this "
                                    "server can read (PNG, JPEG, GIF, BMP, WebP, TIFF)") from None
            att = sources.image_attention(src, x, layer)
        C, H, W = att.image.shape
        return ImageAttentionResponse(
            model=model, family=src.family, title=att.title,
            image=ImagePixels(width=W, height=H, channels=C,
                              pixels=att.image.permute(1, 2, 0).reshape(-1).tolist()),
            grid=att.grid, maps=[ImageMap(label=label, weights=_rows(m)) for label, m in att.maps],
            notes=notes + att.notes, details=att.details, seconds=time.perf_counter() - t0)
