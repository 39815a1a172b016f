"""The JSON API's handlers: requests in, the typed models of :mod:`qkv.pipelines` do the work
(the same values ``qkv attend`` draws), JSON out.

One :class:`Explorer` per app holds the model registry, the compute loop and the cache of recent
attention results; :func:`qkv.serve.app.create_app` routes the endpoints to its methods. FastAPI
runs these (synchronous) methods in its thread pool; they check the request, then hand every
model computation to the server's one compute loop (:mod:`qkv.serve.loop`) and wait for its
answer, or stream the tokens of a generation's row. No handler runs a model: requests never
see each other's hooks, and their answers equal the same requests alone. Messages never carry
a filesystem path (see :class:`PathScrubber`).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from fastapi import File, Form, HTTPException, UploadFile
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from qkv.errors import InputError, UnknownModelError
from qkv.generation.batch import Request, Token
from qkv.generation.decode import decode_after
from qkv.pipelines import CausalLM, ImageCaptioner, ImageClassifier, Translator, check_layer_head
from qkv.pipelines import attention as text
from qkv.serve.batching import ModelBatch, RowStream
from qkv.serve.lens_api import LensEndpoints
from qkv.serve.loop import BusyError, ComputeLoop, Job
from qkv.serve.registry import RUN_PREFIX, AttentionCache, Entry, InvalidNameError, Lease, Registry
from qkv.serve.schemas import (
    AttentionRequest,
    AttentionResponse,
    ComputeEvent,
    GenerateEvent,
    GenerateRequest,
    ImageAttentionResponse,
    ImageMap,
    ImagePixels,
    ModelInfo,
    ModelList,
)
from qkv.serve.sharing import Shared

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
        error = as_http(e, scrub)
        if error is None:
            raise
        raise error from None


def as_http(e: Exception, scrub: Callable[[str], str] = str) -> HTTPException | None:
    """The HTTP error a request gets for ``e``: itself if it is one, else its status
    (:func:`status_of`) with a one-line message and, for a 503, Retry-After; None: a bug (500)."""
    if isinstance(e, HTTPException):
        return e
    code = status_of(e)
    if code is None:
        return None
    headers = {"Retry-After": str(e.retry_after)} if isinstance(e, BusyError) else None
    return HTTPException(code, one_line(e, scrub), headers=headers)


def _info(e: Entry) -> ModelInfo:
    kind = e.kind
    return ModelInfo(id=e.id, family=e.family, kind=kind, input="image" if kind == "image" else "text",
                     can_generate=kind == "decoder", description=e.description)



def _rows(w: Any) -> list[list[float]]:
    """A weight matrix (a CPU tensor or an array) as JSON-friendly rows, 6 decimals (rows still
    sum to 1 within 1e-5); 422 for NaN or inf (JSON has no such numbers: they would go out as
    null, against the schema). In NumPy, which starts no OpenMP pool in a request's thread."""
    a = np.asarray(w, dtype=np.float64)
    if not np.isfinite(a).all():
        raise HTTPException(422, "the attention weights are not all finite (NaN or inf): the model's "
                            "weights are damaged; retrain the run")
    return np.round(a, 6).tolist()


def _event(**fields: Any) -> str:
    return GenerateEvent(**fields).model_dump_json(exclude_none=True) + "\n"


# What the upload's first bytes must look like (PNG, JPEG, GIF, BMP, WebP, TIFF): Pillow opens
# many more formats, some through external programs (EPS: Ghostscript); the page needs these.
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00",
                b"MM\x00*")


def _is_image(data: bytes) -> bool:
    return data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


@dataclass
class _Generation:
    """A generation request as the compute loop accepted it: its row of the model's running
    batch, and what the first event says."""

    row: RowStream
    batch: ModelBatch
    tokens: list[str]
    ids: list[int]
    layer: int
    head: int | None
    n_layers: int
    n_heads: int
    notes: list[str]
    decode: Callable[[list[int]], str]


class _ReleasingResponse(StreamingResponse):
    """A stream that lets go of what it holds (a generation's row of the batch, a place in the
    compute loop's queue: ``on_end``) as soon as the response is over, however it ends: done,
    the client gone (the next send fails, or the disconnect is seen), cancelled."""

    def __init__(self, events: Generator[str, None, None], on_end: Callable[[], None]) -> None:
        super().__init__(events, media_type="application/x-ndjson")
        self.on_end, self.events = on_end, events
        weakref.finalize(self, on_end)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()
            with contextlib.suppress(ValueError):  # a worker thread is still in it (waiting)
                self.events.close()


POLL_S = 0.1  # how often a computation's stream looks at where it stands


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, called at most once however many times this is."""
    lock, done = threading.Lock(), [False]

    def call() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        fn()

    return call


def _where(loop: ComputeLoop, job: Job) -> ComputeEvent | None:
    """Where ``job`` stands: queued (its place) or running (a sweep's progress); None: done."""
    at = loop.position(job)
    if at is None:
        return None
    if at:
        return ComputeEvent(event="queued", position=at)
    done, total = job.progress or (None, None)
    return ComputeEvent(event="running", done=done, total=total)


def _line(event: ComputeEvent) -> str:
    return event.model_dump_json(exclude_none=True) + "\n"


def _error_event(e: BaseException, scrub: Callable[[str], str]) -> ComputeEvent:
    """What the plain request would have been answered for ``e``, as a stream's last line."""
    error = as_http(e, scrub) if isinstance(e, Exception) else None
    if error is None:  # a bug: the traceback to the server's log, one line to the client
        traceback.print_exception(e, file=sys.stderr)
        return ComputeEvent(event="error", status=500, detail=f"internal error ({type(e).__name__}); "
                            "the server's log has the details")
    after = (error.headers or {}).get("Retry-After")
    return ComputeEvent(event="error", status=error.status_code, detail=str(error.detail),
                        retry_after=int(after) if after else None)


class Explorer(LensEndpoints):
    """The endpoints' handlers, sharing one model registry, one compute loop and one attention
    cache. Every model computation runs in the loop (:meth:`_compute`), holding a lease on its
    model (so the registry never evicts a model in use)."""

    def __init__(self, cfg: ServeConfig, registry: Registry, loop: ComputeLoop | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.loop = loop or ComputeLoop(cfg.max_queued, cfg.max_wait_s)
        self.cache = AttentionCache(cfg.cache_bytes)
        self.shared = Shared(cfg.shared_answers)
        self.scrub = PathScrubber(registry.runs_dir)
        self.head_scores: dict[Any, Any] = {}  # a model file's version -> its heads' scores

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return http_errors(self.scrub)

    def _submit(self, model_id: str, fn: Callable[[Lease], Any], label: str = "request",
                request: BaseModel | None = None, sweep: bool = False, pieces: bool = False) -> Job:
        """``fn(lease)`` queued in the compute loop, with ``model_id`` loaded and held while it
        runs: a bad name is answered (400/404) before it queues, a full queue with 503. With
        ``request`` (a deterministic computation's whole request), identical requests share one
        job (:mod:`qkv.serve.sharing`: keyed by the model file's version, ``label`` and the
        request); ``sweep``: queued behind every interactive request (:class:`ComputeLoop`);
        ``pieces``: ``fn`` is a generator the loop runs a slice at a time."""
        with self._errors():
            ref = self.registry.resolve(model_id)

            def run() -> Any:
                lease = self.registry.acquire(model_id)
                try:
                    return fn(lease)
                finally:
                    lease.release()

            def run_in_pieces() -> Generator[Any, None, Any]:
                lease = self.registry.acquire(model_id)  # held from the first piece to the last
                try:
                    return (yield from fn(lease))
                finally:
                    lease.release()

            def submit() -> Job:
                return self.loop.submit(run_in_pieces if pieces else run, label=label, sweep=sweep,
                                        pieces=pieces)

            if request is None:
                return submit()
            return self.shared.job((ref.key, label, request.model_dump_json()), submit)

    def _compute(self, model_id: str, fn: Callable[[Lease], Any], label: str = "request",
                 request: BaseModel | None = None, sweep: bool = False, pieces: bool = False,
                 http: HTTPRequest | None = None) -> Any:
        """:meth:`_submit`'s answer, waited for here; or, when ``http`` asks for
        ``application/x-ndjson``, a stream of where it stands and then the answer
        (:class:`~qkv.serve.schemas.ComputeEvent`)."""
        job = self._submit(model_id, fn, label, request, sweep, pieces)
        if http is not None and "application/x-ndjson" in http.headers.get("accept", ""):
            return self._stream(job)
        with self._errors():
            return job.future.result()

    def _stream(self, job: Job) -> StreamingResponse:
        """The stream of ``job``: ``queued`` with its place whenever that changes, ``running``
        (with a sweep's progress), then ``result`` or ``error``; the client closing it leaves the job
        (stopped when no one else waits for it)."""
        loop, scrub = self.loop, self.scrub
        left = _once(lambda: loop.leave(job))

        def events() -> Generator[str, None, None]:
            last: ComputeEvent | None = None
            try:
                while True:
                    try:
                        value = job.future.result(timeout=POLL_S)
                    except TimeoutError:
                        now = _where(loop, job)
                        if now is not None and now != last:
                            yield _line(now)
                            last = now
                        else:
                            yield ""  # nothing is sent; the server sees a client that went away
                        continue
                    except Exception as e:
                        yield _line(_error_event(e, scrub))
                        return
                    yield _line(ComputeEvent(event="result", result=value.model_dump(mode="json")))
                    return
            finally:
                left()

        return _ReleasingResponse(events(), left)

    @contextlib.contextmanager
    def _model(self, model_id: str) -> Iterator[Lease]:
        """The model, held for the block; for code already running in the compute loop."""
        with self._errors():
            lease = self.registry.acquire(model_id)
            try:
                yield lease
            finally:
                lease.release()

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
        runs, the alignment of the translation with the input. A text already computed is
        answered from the cache without queueing (switching layer or head is instant)."""
        t0 = time.perf_counter()
        self._check_text(req.text)
        text_id = hashlib.sha256(req.text.encode()).hexdigest()  # small keys
        with self._errors():
            key = (self.registry.resolve(req.model).key, text_id, self.cfg.max_tokens)  # the file's version
            lm = self.registry.peek(req.model)
            att = self.cache.get(key) if lm is not None and lm.kind in ("encoder", "decoder") else None
        if lm is None or att is None:
            return self._compute(req.model, lambda lease: self._attention(lease, req, text_id, t0),
                                 "attention", pieces=True)
        return self._attention_response(lm, att, req, t0)

    def _attention(self, lease: Lease, req: AttentionRequest, text_id: str, t0: float
                   ) -> Generator[None, None, AttentionResponse]:
        """In pieces: a block of the forward pass per ``next`` (a translation runs whole)."""
        lm = lease.src
        if isinstance(lm, Translator):
            ali = lm.alignment(req.text)
            return AttentionResponse(
                model=req.model, kind=lm.kind, query_tokens=ali.output, key_tokens=ali.source,
                weights=_rows(ali.weights), layer=None, head=None, n_layers=1, n_heads=1, causal=False,
                output=ali.text, notes=ali.notes, seconds=time.perf_counter() - t0)
        if lm.kind == "image":
            raise InputError(f"{req.model} is a {lease.ref.label} run: it reads images; upload one "
                             "(POST /api/image-attention)")
        assert isinstance(lm, text.CausalLM | text.SentenceEncoder)
        check_layer_head(lm.n_layers, lm.n_heads, req.layer, req.head)
        key = (lease.ref.key, text_id, self.cfg.max_tokens)
        att = self.cache.get(key)
        if att is None:
            att = yield from text.text_attention_steps(lm, req.text, self.cfg.max_tokens)
            self.cache.put(key, att)
        return self._attention_response(lm, att, req, t0)

    def _attention_response(self, lm: Any, att: text.TextAttention, req: AttentionRequest,
                            t0: float) -> AttentionResponse:
        with self._errors():
            layer, head = check_layer_head(lm.n_layers, lm.n_heads, req.layer, req.head)
        w = att.weights[layer].numpy()  # (H, T, T)
        w = w.mean(0) if head is None else w[head]
        return AttentionResponse(
            model=req.model, kind=lm.kind, query_tokens=att.tokens, key_tokens=att.tokens,
            weights=_rows(w), layer=layer, head=head, n_layers=lm.n_layers, n_heads=lm.n_heads,
            causal=att.causal, notes=att.notes, seconds=time.perf_counter() - t0)

    def generate(self, req: GenerateRequest) -> StreamingResponse:
        """Continue ``prompt`` with a GPT model (SmolLM2 or a gpt run), streaming each new
        token with the attention of the position that chose it, as newline-delimited JSON.

        The compute loop opens a row of the model's running batch for it (:mod:`qkv.serve.batching`);
        this thread waits until the row is taken (at most ``max_wait_s``, else 503), then streams
        its tokens. The model is held until the row ends; the row ends when the client leaves."""
        t0 = time.perf_counter()
        self._check_text(req.prompt)
        with self._errors():
            self.registry.resolve(req.model)
            gen: _Generation = self.loop.call(self._start_generation, req, label="generation")
        if not gen.row.joined.wait(self.cfg.max_wait_s) and gen.batch.withdraw(gen.row):
            gen.row._end()
            with self._errors():
                raise BusyError(f"{req.model} is busy (no row came free in {self.cfg.max_wait_s:g} s); "
                                "try again in a few seconds", 5)
        scrub = self.scrub

        def events() -> Generator[str, None, None]:
            yield _event(event="start", tokens=gen.tokens, layer=gen.layer, head=gen.head,
                         n_layers=gen.n_layers, n_heads=gen.n_heads, notes=gen.notes)
            new: list[int] = []
            try:
                for tid, token, weights in gen.row:  # type: ignore[misc]
                    if weights is None:
                        yield _event(event="error", detail="the attention weights are not all finite "
                                     "(NaN or inf): the model's weights are damaged; retrain the run")
                        return
                    new.append(tid)
                    yield _event(event="token", token=token, id=tid, weights=weights)
            except Exception as e:  # the status line has gone out: report in the stream
                yield _event(event="error", detail=one_line(e, scrub))
                return
            yield _event(event="done", text=decode_after(gen.decode, gen.ids, new),
                         seconds=time.perf_counter() - t0)

        return _ReleasingResponse(events(), gen.row.cancel)

    def _start_generation(self, req: GenerateRequest) -> _Generation:
        """In the compute loop: the model held, the prompt encoded, a row of the model's running
        batch requested (BusyError when its rows and waiting room are full)."""
        lease = self.registry.acquire(req.model)
        try:
            lm = lease.src
            if not isinstance(lm, CausalLM):
                raise InputError(f"{req.model} is a {lease.ref.label} model: only GPT models (smollm2, "
                                 "gpt runs) generate")
            layer, head = check_layer_head(lm.n_layers, lm.n_heads, req.layer, req.head)
            total = self.cfg.longest(lm.context)
            ids, notes = text.encode_text(lm, req.prompt, max(1, total - 1), keep="last")
            n_new = min(req.max_new_tokens, self.cfg.max_new_tokens, total - len(ids))
            if n_new < req.max_new_tokens:
                notes.append(f"{n_new} new tokens at most: the prompt has {len(ids)} tokens and the "
                             f"limit is {total}")
            seen = list(ids)  # the text of each token as it reads after what came before

            def pick(tok: Token) -> tuple[int, str, list[float] | None]:  # in the loop: one layer, one head
                assert tok.weights is not None
                row = text.head_row(tok.weights[layer], head).double()
                token = decode_after(lm.tokenizer.decode, seen, [tok.id])
                seen.append(tok.id)
                finite = bool(row.isfinite().all())
                return tok.id, token, [round(v, 6) for v in row.tolist()] if finite else None

            request = Request(ids, n_new, req.temperature, req.top_k, None, req.seed, lm.stop_ids,
                              weights=True, layers=(layer,))  # the layer the page shows: the others stay fast
            batch = self._batch(req.model, lm, total)
            row = batch.submit(request, pick)
        except BaseException:
            lease.release()
            raise
        row.on_end.append(lease.release)
        return _Generation(row, batch, text.token_labels(lm, ids), ids, layer, head, lm.n_layers, lm.n_heads,
                           notes, lm.tokenizer.decode)

    def _batch(self, model_id: str, lm: CausalLM, total: int) -> ModelBatch:
        """``lm``'s running batch, made on its first request (with one line, once, when this
        machine has no saved steps for it: it then decodes eagerly, about half the speed)."""
        def make() -> ModelBatch:
            from qkv.generation.builds import saved_steps_wanted, status

            steps = []
            if saved_steps_wanted(lm.model):  # else the native step decodes it: nothing to say
                steps = [status(lm.model)]
                if self.cfg.batch_rows > 1:
                    steps.append(status(lm.model, self.cfg.batch_rows, total))
            missing = [st for st in steps if not st.ready]
            weights = "" if self.cfg.weights == "auto" else f" --weights {self.cfg.weights}"  # the step's key
            if missing:
                print(f"qkv serve: {model_id}: {missing[0].message()}: decoding eagerly (about half the "
                      f"speed); `qkv prepare {model_id} --batch-rows {self.cfg.batch_rows} --max-tokens "
                      f"{total}{weights}` (or --build-steps {model_id}) builds them, once", file=sys.stderr,
                      flush=True)
            weakref.finalize(lm, self.loop.drop_batch, id(lm))
            return ModelBatch(lm.model, rows=self.cfg.batch_rows, cache_len=total,
                              queued=self.cfg.max_queued, name=model_id, wake=self.loop.wake)

        return self.loop.add_batch(id(lm), make)  # type: ignore[return-value]

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
        return self._compute(model, lambda lease: self._image_attention(lease, model, image, data, layer, t0),
                             "image")

    def _image_attention(self, lease: Lease, model: str, image: UploadFile, data: bytes, layer: int | None,
                         t0: float) -> ImageAttentionResponse:
        not_image = HTTPException(415, f"{_shown(image.filename) or 'the upload'} is not an image this "
                                  "server can read (PNG, JPEG, GIF, BMP, WebP, TIFF)")
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


def _shown(filename: str | None) -> str:
    """An uploaded file's name as the message shows it: one line, 80 characters at most, no folders."""
    name = " ".join((filename or "").replace("\\", "/").rsplit("/", 1)[-1].split())
    return name[:80]
