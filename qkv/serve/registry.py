"""Which models the server offers, and each one loaded once and shared between requests.

Model ids: the pretrained names (``minilm``, ``smollm2``; listed when their asset is installed)
and ``runs/NAME`` for each run directory ``NAME`` directly inside the runs directory. A run name
is a single folder name: no separators, no ``..``; the folder and the files the loaders read
must resolve inside the runs directory (a symlink pointing out of it is refused), so no request
can make the server read a file elsewhere.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.viz.sources import (
    Source,
    TextAttention,
    UnknownModelError,
    kind_of,
    load_pretrained,
    load_source,
    run_family,
)

RUN_PREFIX = "runs/"
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_RUN_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class InvalidNameError(ValueError):
    """A model id that could never name a model (path separators, ``..``, control characters)."""


@dataclass(frozen=True)
class Entry:
    """One model the page can choose."""

    id: str
    family: str
    description: str

    @property
    def kind(self) -> str:
        return kind_of(self.family)


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except OSError:  # a symlink loop, a permission error
        return False


class Registry:
    """Lists the models and loads each one once (a lock per model, so two requests for the
    same model wait for one load; different models load in parallel).

    At most ``max_loaded`` models stay in memory (least recently used goes first); a run whose
    weights changed on disk since it was loaded is loaded again.
    """

    def __init__(self, runs_dir: Path, max_loaded: int = 4) -> None:
        self.runs_dir = Path(runs_dir)
        self.root = self.runs_dir.resolve()
        self.max_loaded = max_loaded
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self._loaded: OrderedDict[str, tuple[Any, Source]] = OrderedDict()
        self._serial = itertools.count()

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
            out.append(Entry(name, name, text))
        return out

    def runs(self) -> list[Entry]:
        """Run directories directly inside the runs directory, newest name last."""
        if not self.root.is_dir():
            return []
        out = []
        for child in sorted(self.root.iterdir(), key=lambda p: p.name):
            if not _RUN_NAME.fullmatch(child.name) or not self._safe_run_dir(child):
                continue
            family = run_family(child)
            if family is not None:
                out.append(Entry(RUN_PREFIX + child.name, family, f"{family} run {child.name}"))
        return out

    def entries(self) -> list[Entry]:
        return self.pretrained() + self.runs()

    def _safe_run_dir(self, path: Path) -> bool:
        if not (_inside(path, self.root) and path.resolve() != self.root and path.is_dir()):
            return False
        return all(_inside(path / f, self.root) for f in _RUN_FILES if (path / f).exists()
                   or (path / f).is_symlink())

    # ----------------------------------------------------------------- resolving

    def run_dir(self, model_id: str) -> Path:
        """The folder of ``runs/NAME``; InvalidNameError for names that try to leave the runs
        directory, UnknownModelError for runs that do not exist."""
        name = model_id[len(RUN_PREFIX):]
        if not _RUN_NAME.fullmatch(name):
            raise InvalidNameError(f"invalid run name {name!r}: a run is named by its folder inside "
                                   "the runs directory (letters, digits, '.', '_', '-')")
        path = self.root / name
        if not path.is_dir() and not path.is_symlink():
            raise UnknownModelError(f"no run {name!r} in the runs directory; GET /api/models lists them")
        if not self._safe_run_dir(path):
            raise InvalidNameError(f"run {name!r} points outside the runs directory; refused")
        if run_family(path) is None:
            raise UnknownModelError(f"{name!r} is not a run of gpt, vit, captioner or seq2seq")
        return path

    def check_id(self, model_id: str) -> None:
        """InvalidNameError for ids that are not a pretrained name or ``runs/NAME`` in shape."""
        bad = (".." in model_id or model_id.startswith(("/", "~")) or "\\" in model_id
               or any(ord(c) < 32 for c in model_id))
        if bad and not model_id.startswith(RUN_PREFIX):
            raise InvalidNameError(f"invalid model name {model_id!r}: choose one from GET /api/models")

    def get(self, model_id: str) -> Source:
        """The loaded model (loading it on first use)."""
        from qkv.viz.sources import pretrained_names

        self.check_id(model_id)
        is_run = model_id.startswith(RUN_PREFIX)
        if is_run:
            path = self.run_dir(model_id)
            weights = path / "model.safetensors"
            version: Any = weights.stat().st_mtime_ns if weights.exists() else None
            target: str | Path = path
        elif model_id in pretrained_names():
            version, target = None, model_id
        else:
            raise UnknownModelError(f"unknown model {model_id!r}; choose one from GET /api/models")
        with self._lock:
            hit = self._loaded.get(model_id)
            if hit is not None and hit[0] == version:
                self._loaded.move_to_end(model_id)
                return hit[1]
            lock = self._loading.setdefault(model_id, threading.Lock())
        if not is_run and model_id not in {e.id for e in self.pretrained()}:
            raise UnknownModelError(f"{model_id} is not installed: qkv assets install {model_id}")
        with lock:  # one load per model, however many requests ask at once
            with self._lock:
                hit = self._loaded.get(model_id)
                if hit is not None and hit[0] == version:
                    return hit[1]
            # a pretrained name never resolves to a folder of that name in the working directory
            src = load_source(target, display_name=model_id) if is_run else load_pretrained(model_id)
            src.serial = next(self._serial)  # tells cached results of a reload apart
            with self._lock:
                self._loaded[model_id] = (version, src)
                self._loaded.move_to_end(model_id)
                while len(self._loaded) > self.max_loaded:
                    self._loaded.popitem(last=False)
            return src


class AttentionCache:
    """Recent :class:`TextAttention` results, so that switching layer or head costs no forward
    pass; bounded by the bytes of the weights it holds (least recently used goes first)."""

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
