"""The JSON API's handlers: requests in, the typed models of :mod:`qkv.pipelines` do the work
(the same values ``qkv attend`` draws), JSON out.

One :class:`Explorer` per app holds the model registry, the work queue and the cache of recent
attention results; :func:`qkv.serve.app.create_app` routes the endpoints to its methods. FastAPI
runs these (synchronous) methods in its thread pool, so requests run in parallel; models are
shared, and the work queue bounds how many compute at once (see work.py). Messages never carry
a filesystem path (see :class:`PathScrubber`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
from fastapi import File, Form, HTTPException, UploadFile
from fastapi.responses import StreamingResponse

from qkv.errors import InputError, UnknownModelError
from qkv.generation import aot
from qkv.generation.batch import Request, Token
from qkv.generation.decode import decode_after
from qkv.inference import ModelRef
from qkv.inference.steps import build_later
from qkv.pipelines import CausalLM, ImageCaptioner, ImageClassifier, Translator, check_layer_head
from qkv.pipelines import attention as text
from qkv.serve.batching import BatchEngine, RowStream
from qkv.serve.lens_api import LensEndpoints
from qkv.serve.registry import RUN_PREFIX, AttentionCache, Entry, InvalidNameError, Lease, Registry
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
from qkv.serve.threads import OwnThread, in_passing_thread
from qkv.serve.work import BusyError, WorkQueue

if TYPE_CHECKING:
    from qkv.serve.config import ServeConfig


def status_of(e: Exception) -> int | None:
    """The HTTP status of an error a request can cause (None: a bug, 500)."""
    from qkv.assets import AssetMissingError
    from qkv.data.images import ImageTooLargeError
    from qkv.training.checkpoint import CheckpointError

    for cls, code in ((InvalidNameError, 400), (UnknownModelError, 404), (AssetMissingError, 404),
                      (ImageTooLargeError, 413), (InputError, 422), (CheckpointError, 422),
                      (BusyError, 503), (ImportError, 503)):
        if isinstance(e, cls):
            return code
    return None


# An absolute path (two segments or more) that is not one of this API's own URLs.
_ABS_PATH = re.compile(r"(?<![\w.~:/-])/(?!api/|static/)[^\s'\"/,;()]+(?:/[^\s'\"/,;()]*)+")


class PathScrubber:
    """Takes absolute filesystem paths out of messages sent to the client: the runs directory
    becomes ``runs`` (so ``<root>/gpt-tiny/config.json`` reads ``runs/gpt-tiny/config.json``, as
    the model id does), any other absolute path becomes ``…/NAME``."""

    def __init__(self, runs_dir: Path) -> None:
        roots = {str(Path(runs_dir).resolve()), str(Path(runs_dir).absolute())}
        alternatives = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))  # longest first
        self.root = re.compile(rf"(?<![\w.~-])(?:{alternatives})(?=[/\s'\",;:()]|$)")

    def __call__(self, text: str) -> str:
        text = self.root.sub(RUN_PREFIX.rstrip("/"), text)
        return _ABS_PATH.sub(lambda m: "…/" + m.group().rstrip("/").rsplit("/", 1)[-1], text)


def one_line(e: BaseException, scrub: Callable[[str], str] = str) -> str:
    """The error's message on one line, without filesystem paths (or its type if it has none)."""
    return scrub(" ".join(str(e).split())) or type(e).__name__


@contextlib.contextmanager
def http_errors(scrub: Callable[[str], str] = str) -> Iterator[None]:
    """Turn the errors a user can cause into HTTP errors with a one-line message (503s with a
    Retry-After header); ``scrub`` takes paths out of the message."""
    try:
        yield
    except HTTPException:
        raise
    except Exception as e:
        code = status_of(e)
        if code is None:
            raise
        headers = {"Retry-After": str(e.retry_after)} if isinstance(e, BusyError) else None
        raise HTTPException(code, one_line(e, scrub), headers=headers) from None


def _info(e: Entry) -> ModelInfo:
    kind = e.kind
    return ModelInfo(id=e.id, family=e.family, kind=kind, input="image" if kind == "image" else "text",
                     can_generate=kind == "decoder", description=e.description)



def _rows(w: torch.Tensor) -> list[list[float]]:
    """A weight matrix as JSON-friendly rows, 6 decimals (rows still sum to 1 within 1e-5); 422
    for NaN or inf (JSON has no such numbers: they would go out as null, against the schema)."""
    if not bool(torch.isfinite(w).all()):
        raise HTTPException(422, "the attention weights are not all finite (NaN or inf): the model's "
                            "weights are damaged; retrain the run")
    return (torch.round(w.float() * 1e6) / 1e6).tolist()


def _event(**fields: Any) -> str:
    return GenerateEvent(**fields).model_dump_json(exclude_none=True) + "\n"


# What the upload's first bytes must look like (PNG, JPEG, GIF, BMP, WebP, TIFF): Pillow opens
# many more formats, some through external programs (EPS: Ghostscript); the page needs these.
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00",
                b"MM\x00*")


def _is_image(data: bytes) -> bool:
    return data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


class _Stream:
    """The events of one generation; ``release`` (the work slot and the model) is called when
    they end or fail, or when the iterator is dropped unstarted."""

    def __init__(self, events: Generator[str, None, None], release: Callable[[], None]) -> None:
        self.events = events
        self.release = release
        weakref.finalize(self, release)

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> str:
        try:
            return next(self.events)
        except BaseException:
            self.release()
            raise


class _ReleasingResponse(StreamingResponse):
    """A stream that gives its slot and model back as soon as the response is over, however it
    ends: done, the client gone (the next send fails, or the disconnect is seen), cancelled."""

    def __init__(self, stream: _Stream, media_type: str) -> None:
        super().__init__(stream, media_type=media_type)
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.release()
            with contextlib.suppress(ValueError):  # a worker thread is still in it (waiting for a step)
                self.stream.events.close()


class Explorer(LensEndpoints):
    """The endpoints' handlers, sharing one model registry, one work queue and one attention
    cache. Every handler that runs a model holds a slot of the work queue (503 when the queue
    is full) and a lease on the model (so the registry never evicts a model in use)."""

    def __init__(self, cfg: ServeConfig, registry: Registry, work: WorkQueue | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.work = work or WorkQueue()
        self.cache = AttentionCache(cfg.cache_bytes)
        self.scrub = PathScrubber(registry.runs_dir)
        self.head_scores: dict[Any, Any] = {}  # a model file's version -> its heads' scores
        self._engines: dict[int, BatchEngine] = {}  # id(a loaded decoder) -> its running batch
        self._engines_lock = threading.Lock()
        self._paused: set[int] = set()  # background builds of other processes stopped while busy
        atexit.register(aot.continue_builds, self._paused)  # never left stopped by a server that ends

    def _on_busy(self) -> None:
        """A batch starts: kill this server's own background build (it starts again at the next
        pause) and stop any other process's (a ``qkv generate`` run's) until no model decodes:
        on two cores a build beside decoding slows it many times over."""
        aot.stop_background_builds()
        paused = aot.pause_builds()
        with self._engines_lock:
            self._paused.update(paused)

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return http_errors(self.scrub)

    @contextlib.contextmanager
    def _model(self, model_id: str) -> Iterator[Lease]:
        """The model, held with a work slot for the block: a bad name is answered (400/404)
        before it queues, a full queue with 503."""
        with self._errors():
            self.registry.resolve(model_id)
            ticket = self.work.acquire(model_id)
        try:
            with self._errors():
                lease = self.registry.acquire(model_id)
                try:
                    yield lease
                finally:
                    lease.release()
        finally:
            ticket.release()

    def _check_text(self, text: str) -> None:
        if len(text) > self.cfg.max_chars:
            raise HTTPException(422, f"the text has {len(text):,} characters; the limit is "
                                f"{self.cfg.max_chars:,}")

    def models(self) -> ModelList:
        """The models the page can choose: installed pretrained ones, then runs."""
        cfg = self.cfg
        with self._errors():
            entries = self.registry.entries()
        # the folder's name only: the server's filesystem layout is none of the client's business
        return ModelList(models=[_info(e) for e in entries], runs_dir=self.registry.root.name or "runs",
                         limits={"max_chars": cfg.max_chars, "max_tokens": cfg.max_tokens,
                                 "max_new_tokens": cfg.max_new_tokens,
                                 "max_upload_bytes": cfg.max_upload_bytes})

    def attention(self, req: AttentionRequest) -> AttentionResponse:
        """One layer's attention over ``text`` (``head`` null: the mean over heads); for seq2seq
        runs, the alignment of the translation with the input."""
        return in_passing_thread(self._attention, req)  # every tensor op in a thread that ends (threads.py)

    def _attention(self, req: AttentionRequest) -> AttentionResponse:
        t0 = time.perf_counter()
        self._check_text(req.text)
        text_id = hashlib.sha256(req.text.encode()).hexdigest()  # small keys
        with self._errors():
            key = (self.registry.resolve(req.model).key, text_id, self.cfg.max_tokens)  # the file's version
            lm = self.registry.peek(req.model)  # a result already computed needs no slot
            att = self.cache.get(key) if lm is not None and lm.kind in ("encoder", "decoder") else None
        if lm is None or att is None:
            with self._model(req.model) as lease:
                lm = lease.src
                if isinstance(lm, Translator):
                    return self._alignment(lm, req, t0)
                if lm.kind == "image":
                    raise InputError(f"{req.model} is a {lease.ref.label} run: it reads images; upload one "
                                     "(POST /api/image-attention)")
                assert isinstance(lm, text.CausalLM | text.SentenceEncoder)
                check_layer_head(lm.n_layers, lm.n_heads, req.layer, req.head)
                key = (lease.ref.key, text_id, self.cfg.max_tokens)
                att = self.cache.get(key)
                if att is None:
                    att = text.text_attention(lm, req.text, self.cfg.max_tokens)
                    self.cache.put(key, att)
        with self._errors():
            layer, head = check_layer_head(lm.n_layers, lm.n_heads, req.layer, req.head)
        w = att.weights[layer]  # (H, T, T)
        w = w.mean(0) if head is None else w[head]
        return AttentionResponse(
            model=req.model, kind=lm.kind, query_tokens=att.tokens, key_tokens=att.tokens,
            weights=_rows(w), layer=layer, head=head, n_layers=lm.n_layers, n_heads=lm.n_heads,
            causal=att.causal, notes=att.notes, seconds=time.perf_counter() - t0)

    def _alignment(self, tr: Translator, req: AttentionRequest, t0: float) -> AttentionResponse:
        ali = tr.alignment(req.text)
        return AttentionResponse(
            model=req.model, kind=tr.kind, query_tokens=ali.output, key_tokens=ali.source,
            weights=_rows(ali.weights), layer=None, head=None, n_layers=1, n_heads=1, causal=False,
            output=ali.text, notes=ali.notes, seconds=time.perf_counter() - t0)

    def generate(self, req: GenerateRequest) -> StreamingResponse:
        """Continue ``prompt`` with a GPT model (SmolLM2 or a gpt run), streaming each new
        token with the attention of the position that chose it, as newline-delimited JSON.

        Requests on one model decode together in its running batch (:mod:`qkv.serve.batching`;
        ``batch_rows`` 0: each alone, holding a work slot). The model (and the slot or the row)
        is held until the stream ends or the client leaves."""
        t0 = time.perf_counter()
        self._check_text(req.prompt)
        batched = self.cfg.batch_rows > 0
        with self._errors():
            self.registry.resolve(req.model)
            ticket = None if batched else self.work.acquire(req.model)
        held: list[Any] = [] if ticket is None else [ticket]
        lock = threading.Lock()

        def take() -> list[Any]:  # what the request holds, taken (each part is given back once)
            with lock:
                parts, held[:] = list(held), []
            return parts

        def release(parts: list[Any] | None = None) -> None:
            for t in reversed(take() if parts is None else parts):
                t.release()

        try:
            with self._errors():
                lease = self.registry.acquire(req.model)
                held.append(lease)
                lm = lease.src
                if not isinstance(lm, CausalLM):
                    raise InputError(f"{req.model} is a {lease.ref.label} model: only GPT models (smollm2, "
                                     "gpt runs) generate")
                layer, head = check_layer_head(lm.n_layers, lm.n_heads, req.layer, req.head)
                total = self.cfg.longest(lm.context)
                ids, notes = text.encode_text(lm, req.prompt, max(1, total - 1), keep="last")
                n_new = min(req.max_new_tokens, self.cfg.max_new_tokens, total - len(ids))
                steps: Iterator[text.GenerationStep]
                if batched:
                    row = self._join_batch(req, lease.ref, lm, ids, n_new, layer, head, total)
                    held.append(_Cancel(row))
                    steps = text.batch_steps(lm, ids, row)  # type: ignore[arg-type]
                else:  # decoded in a thread of its own that ends with the reply (qkv.serve.threads),
                    # which gives the work slot and the model back once its last step is over
                    gen = text.generate_steps(lm, ids, n_new, layer=layer, head=head,
                                              temperature=req.temperature, top_k=req.top_k, seed=req.seed)
                    parts = take()
                    try:
                        own = OwnThread(gen, on_end=lambda: release(parts))
                    except BaseException:
                        release(parts)
                        raise
                    held.append(own)
                    steps = own
        except BaseException:
            release()
            raise
        if n_new < req.max_new_tokens:
            notes.append(f"{n_new} new tokens at most: the prompt has {len(ids)} tokens and the "
                         f"limit is {total}")
        scrub = self.scrub

        def events() -> Generator[str, None, None]:
            yield _event(event="start", tokens=text.token_labels(lm, ids), layer=layer, head=head,
                         n_layers=lm.n_layers, n_heads=lm.n_heads, notes=notes)
            new: list[int] = []
            try:
                for step in steps:
                    new.append(step.id)
                    row = torch.as_tensor(step.weights)
                    if not bool(torch.isfinite(row).all()):
                        yield _event(event="error", detail="the attention weights are not all finite "
                                     "(NaN or inf): the model's weights are damaged; retrain the run")
                        return
                    # one conversion per row, not one per element (~4x less of this thread's time
                    # per token, time the decoding thread's cores would otherwise lose)
                    yield _event(event="token", token=step.token, id=step.id,
                                 weights=[round(v, 6) for v in row.double().tolist()])
            except Exception as e:  # the status line has gone out: report in the stream
                yield _event(event="error", detail=one_line(e, scrub))
                return
            finally:
                release()
            yield _event(event="done", text=decode_after(lm.tokenizer.decode, ids, new),
                         seconds=time.perf_counter() - t0)

        return _ReleasingResponse(_Stream(events(), release), media_type="application/x-ndjson")

    def _join_batch(self, req: GenerateRequest, ref: ModelRef, lm: CausalLM, ids: list[int], n_new: int,
                    layer: int, head: int | None, total: int) -> RowStream:
        """A row of ``lm``'s running batch for this request (BusyError: a 503). When the batch
        empties, the model's saved steps are built in the background if this machine has none
        (:mod:`qkv.inference.steps`), and the build is stopped when a request arrives: on two
        cores a build beside decoding slows it many times over (it starts again at the next
        pause; a lone row and the batch decode through the steps once they are built)."""
        with self._engines_lock:
            engine = self._engines.get(id(lm))
            if engine is None:
                model, lm_ref, rows, said = req.model, weakref.ref(lm), self.cfg.batch_rows, []

                def on_idle() -> None:
                    with self._engines_lock:  # builds start only when no model is decoding
                        if any(e.running() or e.waiting() for e in self._engines.values()):
                            return
                        paused = set(self._paused)
                        self._paused.clear()
                    aot.continue_builds(paused)
                    held = lm_ref()
                    later = None if held is None else build_later(ref, held, rows, total)
                    if later is not None and later.startswith("building") and not said:
                        said.append(later)  # once per model: a build restarts at every pause
                        print(f"qkv serve: {model}: {aot.NO_STEP} yet: building the saved steps while "
                              f"the server is idle (a request stops the build, the next pause starts it "
                              f"again; about a minute each, once per machine; --build-steps {model} "
                              f"builds them before the server listens)", file=sys.stderr, flush=True)

                engine = BatchEngine(lm.model, rows=self.cfg.batch_rows, cache_len=total,
                                     queued=self.cfg.max_queued, max_wait_s=self.cfg.max_wait_s,
                                     slot=lambda: self.work.acquire(req.model), name=req.model,
                                     on_busy=self._on_busy, on_idle=on_idle)
                self._engines[id(lm)] = engine
                weakref.finalize(lm, self._engines.pop, id(lm), None)

        def pick(tok: Token) -> tuple[int, torch.Tensor]:  # the requested layer and head only
            assert tok.weights is not None
            return tok.id, text.head_row(tok.weights[layer], head)

        request = Request(ids, n_new, req.temperature, req.top_k, None, req.seed, lm.stop_ids, weights=True,
                          layers=(layer,))  # the one layer the page shows: the others stay fast
        return engine.submit(request, pick)

    def image_attention(self, model: Annotated[str, Form(max_length=256)],
                        image: Annotated[UploadFile, File()],
                        layer: Annotated[int | None, Form()] = None) -> ImageAttentionResponse:
        """An image upload -> where a ViT run looks (each head of ``layer`` and the rollout) or
        what a captioner run says and where it looked for each word."""
        return in_passing_thread(self._image_attention, model, image, layer)  # threads.py

    def _image_attention(self, model: str, image: UploadFile, layer: int | None) -> ImageAttentionResponse:
        t0 = time.perf_counter()
        limit = self.cfg.max_upload_bytes
        data = image.file.read(limit + 1)
        if len(data) > limit:
            raise HTTPException(413, f"the upload is larger than {limit:,} bytes; send a smaller image")
        if not data:
            raise HTTPException(422, "the upload is empty; choose an image file")
        not_image = HTTPException(415, f"{_shown(image.filename) or 'the upload'} is not an image this "
                                  "server can read (PNG, JPEG, GIF, BMP, WebP, TIFF)")
        with self._model(model) as lease:
            img = lease.src
            if not isinstance(img, ImageClassifier | ImageCaptioner):
                raise InputError(f"{model} is a {lease.ref.label} model: it reads text, not images")
            if not _is_image(data):
                raise not_image
            try:
                x, notes = img.read_image(data, self.cfg.max_pixels)
            except ValueError as e:
                if status_of(e) is not None:
                    raise
                raise not_image from None
            att = img.attention(x, layer)
        C, H, W = att.image.shape
        return ImageAttentionResponse(
            model=model, family=lease.ref.label, title=att.title,
            image=ImagePixels(width=W, height=H, channels=C,
                              pixels=att.image.permute(1, 2, 0).reshape(-1).tolist()),
            grid=att.grid, maps=[ImageMap(label=label, weights=_rows(m)) for label, m in att.maps],
            notes=notes + att.notes, details=att.details, seconds=time.perf_counter() - t0)


class _Cancel:
    """Frees a request's row of the batch when its stream is released."""

    def __init__(self, row: RowStream) -> None:
        self.row = row

    def release(self) -> None:
        self.row.cancel()


def _shown(filename: str | None) -> str:
    """An uploaded file's name as the message shows it: one line, 80 characters at most, no folders."""
    name = " ".join((filename or "").replace("\\", "/").rsplit("/", 1)[-1].split())
    return name[:80]
