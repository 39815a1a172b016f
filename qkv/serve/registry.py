"""Which models the server offers, and each one loaded once and shared between requests.

Model ids: the bundled names (``minilm``, ``smollm2``; listed when their asset is installed)
and ``runs/NAME`` for each model ``NAME`` directly inside the runs directory (a run directory, a
Hugging Face folder or a .gguf file, told apart by :func:`qkv.inference.resolve` as everywhere
else). A run name is a single folder name: no separators, no ``..``; the folder and the files
the loaders read must resolve inside the runs directory (a symlink pointing out of it is
refused), so no request can make the server read a file elsewhere. A bundled name never means
a folder of that name, and ``runs/smollm2`` never means the bundled model.

Loaded models are kept by the file they were read from (:attr:`ModelRef.key`): a run whose
weights change on disk is loaded again.

Memory is bounded before anything loads: at most ``max_loaded`` models are in memory, those
being loaded included (see :class:`Registry`).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.errors import UnknownModelError
from qkv.inference import Loaded, ModelRef, open_model, resolve
from qkv.pipelines.attention import TextAttention
from qkv.serve.loop import BusyError

RUN_PREFIX = "runs/"
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class InvalidNameError(ValueError):
    """A model id that could never name a model (path separators, ``..``, control characters)."""


@dataclass(frozen=True)
class Entry:
    """One model the page can choose: its id, what it is (``family``: a bundled model's name, a
    run's family, ``gguf``/``hf-decoder``/...), what it reads and shows, and a description."""

    id: str
    family: str
    kind: str
    description: str


def _echo(name: str) -> str:
    """A name the client sent, as a message shows it: quoted, 100 characters at most, and not at
    all if it holds an absolute path. Messages have their paths rewritten (see api.py); echoing
    one would tell a client whether it guessed where the runs directory is. A relative name
    (``../../etc/passwd``: each '/' after a name character) can never hold one."""
    rest = name[len(RUN_PREFIX):] if name.startswith(RUN_PREFIX) else name
    if re.search(r"(?:^|[^\w.~-])/", rest) or "\\" in rest:
        return "(not shown: it has an absolute path in it)"
    return repr(name[:100]) + ("…" if len(name) > 100 else "")


def _is_gguf(path: Path) -> bool:
    return path.name.lower().endswith(".gguf") and path.is_file()


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except OSError:  # a symlink loop, a permission error
        return False


@dataclass(eq=False)
class _Model:
    """One model in memory (``src`` None while it loads), the file version it was read from,
    and how many requests use it."""

    version: Any
    src: Loaded | None = None
    users: int = 0


class Lease:
    """A model held in memory for one request (``src``, the typed model; ``ref``, what its id
    names, with the key of the file it was read from); :meth:`release` (once, from any thread)
    lets the registry evict it again."""

    def __init__(self, src: Loaded, ref: ModelRef, release: Callable[[], None]) -> None:
        self.src, self.ref = src, ref
        self._release = release
        self._lock = threading.Lock()
        self.released = False

    def release(self) -> None:
        with self._lock:
            if self.released:
                return
            self.released = True
        self._release()


class Registry:
    """Lists the models and loads each one once: two requests for the same model wait for one
    load; different models load in parallel.

    At most ``max_loaded`` models are in memory at once, counting those being loaded and those
    still in use by a request after a newer version replaced them: before a load starts, the
    least recently used model that no request is using is dropped; if every one is in use, the
    load waits (at most ``max_wait_s`` seconds, then BusyError: a 503). A run whose weights
    changed on disk since it was loaded is loaded again. Requests hold a model with
    :meth:`use` or :meth:`acquire`; :meth:`get` loads one without holding it.
    """

    def __init__(self, runs_dir: Path, max_loaded: int = 4, max_wait_s: float = 30.0, weights: str = "auto"
                 ) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.runs_dir = Path(runs_dir)
        self.root = self.runs_dir.resolve()
        self.max_loaded = max_loaded
        self.max_wait_s = max_wait_s
        self.weights = weights  # decoders' weights, as qkv.load's weights= ("auto": as each file holds them)
        self._cond = threading.Condition()
        self._models: OrderedDict[str, _Model] = OrderedDict()  # least recently used first
        self._replaced: list[_Model] = []  # replaced by a newer version while still in use

    # ----------------------------------------------------------------- listing

    def pretrained(self) -> list[Entry]:
        """Installed pretrained models (without loading them)."""
        from qkv.assets import AssetMissingError, asset_path
        from qkv.pretrained import PRETRAINED

        out = []
        for name, text in PRETRAINED.items():
            try:
                asset_path(name)
            except AssetMissingError:
                continue
            out.append(Entry(name, name, resolve(name).kind, text))
        return out

    def runs(self) -> list[Entry]:
        """Run directories directly inside the runs directory, newest name last."""
        if not self.root.is_dir():
            return []
        out = []
        for child in sorted(self.root.iterdir(), key=lambda p: p.name):
            try:
                ref = self.resolve(RUN_PREFIX + child.name)
            except Exception:  # not a model, unsafe, or damaged: not listed (a request says why)
                continue
            what = {"run": f"{ref.family} run", "gguf": "GGUF file", "hf": "Hugging Face checkpoint"}
            try:
                label, kind = ref.label, ref.kind
            except (ValueError, OSError):  # a GGUF qkv cannot read: listed, a request says why
                label, kind = "gguf", "decoder"
            out.append(Entry(RUN_PREFIX + child.name, label, kind, f"{what[ref.source]} {child.name}"))
        return out

    def entries(self) -> list[Entry]:
        return self.pretrained() + self.runs()

    def _safe_run_dir(self, path: Path) -> bool:
        if not (_inside(path, self.root) and path.resolve() != self.root and path.is_dir()):
            return False
        files = [path / f for f in _RUN_FILES if (path / f).exists() or (path / f).is_symlink()]
        from qkv.pretrained.hf import hf_model_type

        if hf_model_type(path) is not None:  # a Hugging Face folder: every shard and file it may read
            files += list(path.iterdir())
        return all(_inside(f, self.root) for f in files)

    # ----------------------------------------------------------------- resolving

    def run_dir(self, model_id: str) -> Path:
        """The folder or file of ``runs/NAME``; InvalidNameError for names that try to leave the
        runs directory, UnknownModelError for runs that do not exist."""
        name = model_id[len(RUN_PREFIX):]
        if not _RUN_NAME.fullmatch(name):
            raise InvalidNameError(f"invalid run name {_echo(name)}: a run is named by its folder inside "
                                   "the runs directory (letters, digits, '.', '_', '-')")
        path = self.root / name
        if _is_gguf(path):  # a GGUF file of a supported architecture (see qkv.load)
            if not _inside(path, self.root):
                raise InvalidNameError(f"run {name!r} points outside the runs directory; refused")
            return path
        if not path.is_dir() and not path.is_symlink():
            raise UnknownModelError(f"no run {name!r} in the runs directory; GET /api/models lists them")
        if not self._safe_run_dir(path):
            raise InvalidNameError(f"run {name!r} points outside the runs directory; refused")
        return path

    def check_id(self, model_id: str) -> None:
        """InvalidNameError for ids that are not a pretrained name or ``runs/NAME`` in shape."""
        bad = (".." in model_id or model_id.startswith(("/", "~")) or "\\" in model_id
               or any(ord(c) < 32 for c in model_id))
        if bad and not model_id.startswith(RUN_PREFIX):
            raise InvalidNameError(f"invalid model name {_echo(model_id)}: choose one from GET /api/models")

    def resolve(self, model_id: str) -> ModelRef:
        """What ``model_id`` names, by :func:`qkv.inference.resolve` (a bundled name, or a run,
        GGUF file or Hugging Face folder inside the runs directory), named by the id.
        InvalidNameError, UnknownModelError or AssetMissingError, without loading anything."""
        from dataclasses import replace

        from qkv.assets import AssetMissingError
        from qkv.inference import bundled_names

        self.check_id(model_id)
        if model_id.startswith(RUN_PREFIX):
            path = self.run_dir(model_id)
            from qkv.training.checkpoint import CheckpointError

            try:
                ref = resolve(path)  # a Path: never a bundled name
            except (ValueError, OSError, CheckpointError):
                raise UnknownModelError(f"{model_id[len(RUN_PREFIX):]!r} is not a run of gpt, vit, "
                                        "captioner or seq2seq, nor a Hugging Face checkpoint folder or "
                                        "a .gguf file") from None
            return replace(ref, name=model_id)
        if model_id not in bundled_names():
            raise UnknownModelError(f"unknown model {_echo(model_id)}; choose one from GET /api/models")
        if model_id not in {e.id for e in self.pretrained()}:
            raise AssetMissingError(f"{model_id} is not installed: qkv assets install {model_id}")
        return replace(resolve(model_id), note=None)  # the server's folder is never read for it

    def in_memory(self) -> int:
        """Models in memory now: loaded, being loaded, or replaced but still in use."""
        with self._cond:
            return len(self._models) + len(self._replaced)

    def peek(self, model_id: str) -> Loaded | None:
        """The model if it is loaded and up to date (loading nothing, waiting for nothing)."""
        ref = self.resolve(model_id)
        with self._cond:
            m = self._models.get(model_id)
            return m.src if m is not None and m.version == ref.key else None

    def _evict_one(self) -> Callable[[], object] | None:
        """Drop the least recently used model no request holds; a weak reference to it (None when
        every model is in use)."""
        for key, m in self._models.items():  # least recently used first
            if m.users == 0 and m.src is not None:
                del self._models[key]
                src, m.src = m.src, None  # old leases keep their own reference, the entry none
                try:
                    return weakref.ref(src)
                except TypeError:  # not weakly referable: trust that it is gone
                    return lambda: None
        return None

    def _let_go(self, gone: Callable[[], object], deadline: float) -> None:
        """Give a just-evicted model a moment to be collected before another loads: a request
        that released it may still be returning with it in hand (a quarter second at most, with
        the lock released while waiting)."""
        until = min(deadline, time.monotonic() + 0.25)
        while gone() is not None and time.monotonic() < until:
            self._cond.wait(0.005)

    def _claim(self, model_id: str, version: Any) -> tuple[_Model, bool]:
        """The model's entry with one more user, and whether this caller must load it."""
        deadline = time.monotonic() + self.max_wait_s
        with self._cond:
            while True:
                m = self._models.get(model_id)
                if m is not None and m.version == version and m.src is not None:
                    m.users += 1
                    self._models.move_to_end(model_id)
                    return m, False
                if m is not None and m.src is not None:  # an older version: replace it
                    del self._models[model_id]
                    if m.users:
                        self._replaced.append(m)
                    continue
                full = len(self._models) + len(self._replaced) >= self.max_loaded
                if m is None and full and (gone := self._evict_one()) is not None:
                    self._let_go(gone, deadline)
                    continue  # the world may have changed while waiting: look again
                if m is None and not full:
                    m = _Model(version, users=1)
                    self._models[model_id] = m
                    return m, True
                # someone is loading it, or every model in memory is in use: wait for a change
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BusyError(f"cannot load {model_id} now: the {self.max_loaded} models in memory "
                                    "(the limit) are all in use; try again in a few seconds", 2)
                self._cond.wait(left)

    def _release(self, m: _Model) -> None:
        with self._cond:
            m.users -= 1
            if m.users == 0 and m in self._replaced:
                self._replaced.remove(m)
            self._cond.notify_all()

    def acquire(self, model_id: str) -> Lease:
        """The model, loaded on first use and kept in memory until the lease is released."""
        ref = self.resolve(model_id)
        m, load = self._claim(model_id, ref.key)
        if load:
            try:
                # as qkv.load opens it (in the server: in its compute loop)
                src = open_model(ref, weights=self.weights if ref.kind == "decoder" else None)
            except BaseException:
                with self._cond:
                    if self._models.get(model_id) is m:
                        del self._models[model_id]
                    self._cond.notify_all()
                raise
            with self._cond:
                m.src = src
                self._cond.notify_all()
        assert m.src is not None
        return Lease(m.src, ref, lambda: self._release(m))

    @contextlib.contextmanager
    def use(self, model_id: str) -> Iterator[Loaded]:
        """``with registry.use(model_id) as model: ...``: the model, held for the block."""
        lease = self.acquire(model_id)
        try:
            yield lease.src
        finally:
            lease.release()

    def get(self, model_id: str) -> Loaded:
        """The loaded model (loading it on first use), not held: it may be evicted later."""
        with self.use(model_id) as model:
            return model


class AttentionCache:
    """Recent :class:`TextAttention` results, so that switching layer or head costs no forward
    pass; keyed by the model's file version (:attr:`ModelRef.key`) and the request, bounded by
    the bytes of the weights it holds (least recently used goes first)."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple, TextAttention] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> TextAttention | None:
        with self._lock:
            att = self._items.get(key)
            if att is not None:
                self._items.move_to_end(key)
            return att

    def put(self, key: tuple, att: TextAttention) -> None:
        size = att.weights.numel() * att.weights.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.weights.numel() * old.weights.element_size()
            self._items[key] = att
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self._bytes -= gone.weights.numel() * gone.weights.element_size()
