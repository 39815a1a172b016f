"""A saved decoding step: the 1-token step compiled ahead of time (torch.export + AOTInductor),
stored in qkv's cache folder and loaded by every later process without tracing or compiling.

Today's compiled step (:mod:`qkv.generation.compiled`) re-traces the model's Python in every
process (6.5-7.4 s warm, 35-65 s cold). Here the step is exported once per model shape x
weight format x machine into a package (native code, ~4 MB for SmolLM2: the weights are not
in it) and bound to the live model's tensors when loaded (no second copy in memory): loading
takes milliseconds and imports neither dynamo nor inductor.

The step as exported::

    step(tok (B, 1) int64, k, v (L, B, K, S, D) and q (L, B, H, 1, D) written in place,
         marker (pos,)) -> (B, 1, V)

The position is the *length* of ``marker`` (a dynamic dimension of the exported program), so
the KV-cache position is an input, not Python state; K/V are written with one ``index_put_``
on the whole cache (:meth:`qkv.attention.kv_cache.LayerKVCache.update`), which Inductor turns
into a write of slot ``pos`` only. Positions 0, 1 and S - 1 fall outside the exported range
and decode eagerly; the step itself does not check bounds, so :meth:`SavedStep.step` does.

A running batch (:mod:`qkv.generation.batch`) has a step of its own, exported once for up to R
rows with the number of rows n and the longest row's length as dynamic dimensions::

    step(tok (n, 1), k, v (L, R, K, S, D) and q (L, R, H, 1, D) written in place,
         pos (n,) each row's position, marker (max(pos) + 1,)) -> (n, 1, V)

each row attending over its own keys by a mask (a masked :class:`~qkv.attention.BatchKVCache`
view), keyed like the one-row step with R and S (``load(model, cache_len=S, batch=R)``).

The step returns no attention weights (the fused attention never forms them), but it keeps
each layer's query after RoPE in ``q`` (:meth:`qkv.attention.KVCache.keep_queries`): with the
keys already in the cache, :meth:`SavedStep.attention` computes any layer's row afterwards by
the reference backend's formula, so a page that shows attention (``qkv serve``) still decodes
through the saved step, paying one small product per layer it shows.

Where a package may run is decided by its key, never by the package: CPU vendor, family, model
and flag set (Inductor builds with ``-march=native``), thread count, torch version and build,
the C++ compiler, the source of every module the step runs (:func:`step_sources`, derived from
the imports), the model's shape, module types and weight formats, the cache length and batch
size. A package is written under a lock into a
private folder (0700) and renamed into place; its SHA-256 is recorded beside it and checked on
load, so a damaged or foreign package is refused (and rebuilt by the next build).

This module exports, keys, stores and loads; *when* a step is built and whether a request
uses it is decided in :mod:`qkv.generation.builds`. ``QKV_CACHE_DIR=off`` or
``QKV_SAVED_STEP=off`` turns saved steps off.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import weakref
import zipfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv import owned
from qkv.attention import BatchKVCache, KVCache
from qkv.generation.compiled import fingerprint, shape_signature
from qkv.generation.decoders import attention_rows, keep_queries
from qkv.models.gpt import GPT
from qkv.native import NativeError, build_once, compiler, cpu_identity, private_folder, sha256
from qkv.paths import cache_root

STEP_VERSION = 2  # bump when the exported step's contract changes
DEFAULT_CACHE_LEN = 2048
PACKAGE = "step.pt2"
META = "step.json"
# Where the sources that key a step start: this module (the exported wrapper), the model and
# every layer it may hold (quantised ones included), and the kernels; :func:`step_sources`
# follows their imports.
_ROOTS = ("qkv.generation.aot", "qkv.models.gpt", "qkv.layers.quant", "qkv.kernels")


class SavedStepError(RuntimeError):
    """Why a saved step could not be built or loaded (the caller decodes eagerly)."""


def enabled() -> bool:
    """Saved steps are on unless ``QKV_SAVED_STEP=off`` or qkv's cache is off."""
    off = os.environ.get("QKV_SAVED_STEP", "").lower() in ("off", "0", "false")
    return not off and cache_root() is not None


def folder() -> Path:
    """The private folder of saved steps (``<cache>/steps``, mode 0700, owned by this user)."""
    try:
        return private_folder("steps")
    except NativeError as e:
        raise SavedStepError(str(e)) from None


# --------------------------------------------------------------------------- the key


def _module_file(name: str, base: Path) -> Path | None:
    """The source file of qkv module ``name`` (a package's ``__init__.py``), None if not qkv's."""
    rel = Path(*name.split("."))
    for p in (base / rel / "__init__.py", base / rel.with_suffix(".py")):
        if p.is_file():
            return p
    return None


def _lazy(node: ast.stmt) -> bool:
    """A module-level statement whose imports do not run on import: a function or an
    ``if TYPE_CHECKING:`` block."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return True
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, name: str) -> set[str]:
    """The qkv modules ``path`` (module ``name``) imports anywhere in it, functions included:
    ``from qkv.x import y`` names both qkv.x and, where it is a module, qkv.x.y. The package
    ``qkv`` itself counts only its module-level imports: its functions (``qkv.load``,
    ``qkv.show``) import the whole library lazily and no step calls them (without this, a change
    to the lens or the server rebuilt every saved step)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    tops = [t for t in tree.body if name != "qkv" or not _lazy(t)]
    nodes = (n for top in tops for n in ast.walk(top))
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = package.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in out if m == "qkv" or m.startswith("qkv.")}


@functools.cache
def step_sources() -> tuple[Path, ...]:
    """Every source file of qkv that the step runs, derived, not listed by hand: the modules
    :data:`_ROOTS` import, followed transitively (a superset of what one step executes, so a
    change anywhere it could reach rebuilds the step), and the kernels' C++ files.
    ``tests/generation/test_aot.py`` traces a decoding step and fails if it ran a file
    missing here."""
    base = Path(__file__).resolve().parents[2]
    seen: dict[str, Path] = {}
    todo = list(_ROOTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name, base)
        if path is None:
            continue
        seen[name] = path
        todo += sorted(_imports(path, name) - seen.keys())
    kernels = sorted((base / "qkv" / "kernels").glob("*.cpp"))
    return tuple(sorted(set(seen.values()))) + tuple(kernels)


@functools.cache
def _code_digest() -> str:
    """SHA-256 over the source of every module the step runs (a change rebuilds the step)."""
    base = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for f in step_sources():
        h.update(str(f.relative_to(base)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def step_key(model: GPT, cache_len: int, batch: int = 1) -> tuple[str, dict[str, Any]]:
    """(digest, what it digests) of the step of ``model`` on this machine (see the module doc)."""
    info = {"step_version": STEP_VERSION, "code": _code_digest(), "cpu": cpu_identity(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "torch_git": torch.version.git_version, "compiler": compiler(),
            "model": hashlib.sha256(shape_signature(model).encode()).hexdigest(),
            "cache_len": cache_len, "batch": batch}
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:32], info


def cache_len_for(model: GPT, cache_len: int | None = None) -> int:
    """The fixed cache length of a model's saved step: 2,048 tokens or its context if shorter."""
    return min(model.cfg.max_seq_len, cache_len or DEFAULT_CACHE_LEN)


# --------------------------------------------------------------------------- building


class _Step(nn.Module):
    """What is exported: one token per row at position ``marker.shape[0]``."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, tok: Tensor, k: Tensor, v: Tensor, q: Tensor, marker: Tensor) -> Tensor:
        cache = KVCache.wrap(k, v, marker.shape[0], queries=q)
        return self.model(tok, cache=cache, last_only=True).logits


class _RowsStep(nn.Module):
    """What is exported for a running batch of up to R rows: the first n = ``len(pos)`` rows
    of the cache (n a dynamic dimension, 2..R), row b's token at its own position ``pos[b]``,
    attending over its own keys among the first ``marker.shape[0]`` (= max(pos) + 1) (a masked
    :class:`~qkv.attention.BatchKVCache` view; the caller advances the positions)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, tok: Tensor, k: Tensor, v: Tensor, q: Tensor, pos: Tensor, marker: Tensor) -> Tensor:
        cache = BatchKVCache.wrap(k, v, pos, span=marker.shape[0] - 1, queries=q)
        return self.model(tok, cache=cache, last_only=True).logits


def _export(model: GPT, cache_len: int, batch: int) -> torch.export.ExportedProgram:
    cache = _make_cache(model, batch, cache_len)  # the buffers every request will pass
    k, v, q = cache.k, cache.v, cache.queries
    tok = torch.zeros(batch, 1, dtype=torch.long, device=k.device)
    marker = torch.zeros(cache_len, dtype=torch.uint8)[:3]
    pos = torch.export.Dim("pos", min=2, max=cache_len - 2)  # S - 1 would break a guard on S
    with torch.no_grad():
        if batch == 1:
            return torch.export.export(_Step(model).eval(), (tok, k, v, q, marker),
                                       dynamic_shapes=({}, {}, {}, {}, {0: pos}), strict=False)
        rows: dict[int, Any] = {0: torch.export.Dim("rows", min=2, max=batch)} if batch > 2 else {}
        at = torch.tensor([2, 0], dtype=torch.long, device=k.device)
        return torch.export.export(_RowsStep(model).eval(), (tok[:2], k, v, q, at, marker),
                                   dynamic_shapes=(rows, {}, {}, {}, rows, {0: pos}), strict=False)


def _make_cache(model: GPT, batch: int, cache_len: int) -> KVCache:
    """A cache for the step: keys, values and each layer's kept query (L, B, H, 1, D); for
    more than one row, a running batch's (a :class:`~qkv.attention.BatchKVCache`)."""
    cfg, p = model.cfg, model.tok_emb.weight
    if batch == 1:
        cache = model.make_cache(batch, cache_len)
    else:
        cache = BatchKVCache(cfg.n_layers, batch, cfg.resolved_kv_heads, cache_len, cfg.resolved_head_dim,
                             dtype=p.dtype, device=p.device)
    keep_queries(model, cache)
    return cache


def _made_constants(package: Path, model: GPT) -> dict[str, int]:
    """Constants Inductor adds that are not the model's: on CPU each int4 product's group size
    (a 0-d int64 tensor ``constantNNN``), whose values a weight-less package does not hold."""
    with zipfile.ZipFile(package) as z:
        src = "\n".join(z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith(".cpp"))
    mods = {n.replace(".", "_"): m for n, m in model.named_modules()}
    out = {}
    call = r"_weight_int4pack_mm_cpu_tensor\(\w+, \w+, (constant\d+), (\w+)_scales_zeros"
    for const, sz in re.findall(call, src):
        mod = mods.get(sz.removeprefix("model_"))
        if mod is None or not hasattr(mod, "group_size"):
            raise SavedStepError(f"cannot tell which product {const} belongs to ({sz})")
        out[const] = int(mod.group_size)
    return out


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _compile(ep: Any, pkg: Path) -> None:
    """AOTInductor's compile of ``ep`` into the package ``pkg``, with Inductor's cache (generated
    C++, objects, precompiled headers) in qkv's private ``<cache>/inductor``, reused by the next
    build, instead of ``/tmp/torchinductor_<user>`` (0.5 GB there after a day of builds). The
    variable is set for the compile only (Inductor reads it at each use); a process started
    meanwhile inherits a folder that stays."""
    from torch._inductor import aoti_compile_and_package

    try:
        inductor = str(private_folder("inductor"))
    except NativeError as e:
        raise SavedStepError(str(e)) from None
    old = os.environ.get(INDUCTOR_CACHE)
    os.environ[INDUCTOR_CACHE] = inductor
    try:
        aoti_compile_and_package(ep, package_path=str(pkg),
                                 inductor_configs={"aot_inductor.package_constants_in_so": False})
    finally:
        if old is None:
            os.environ.pop(INDUCTOR_CACHE, None)
        else:
            os.environ[INDUCTOR_CACHE] = old


def build(model: GPT, cache_len: int | None = None, batch: int = 1,
          on_stage: Callable[[Any], object] | None = None) -> Path:
    """Export and compile the step of ``model`` (tens of seconds to minutes) into the saved-step
    folder, unless a valid one is there already; returns its folder. Two processes building at
    once: one builds, the other waits and finds it. ``on_stage("exporting")`` and
    ``on_stage("compiling")`` as each stage begins. Everything runs in this process and
    returns when done (:mod:`qkv.generation.builds` owns when a build happens)."""
    if compiler() is None:
        raise SavedStepError("no C++ compiler found (c++ or g++): the step cannot be compiled here")
    S = cache_len_for(model, cache_len)
    if S < 8:
        raise SavedStepError(f"a context of {S} tokens is too short for a saved step")
    key, info = step_key(model, S, batch)

    def make(tmp: Path) -> dict[str, Any]:
        pkg = tmp / PACKAGE
        with warnings.catch_warnings():  # torch's own deprecation notice inside export, not the user's
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            if on_stage is not None:
                on_stage("exporting")
            ep = _export(model, S, batch)
            if on_stage is not None:
                on_stage("compiling")
            _compile(ep, pkg)
        return {"key": key, "info": info, "sha256": sha256(pkg), "made": _made_constants(pkg, model)}

    return build_once(folder(), key, META, lambda path: _valid(path, key, info) is not None, make)


def building(key: str) -> bool:
    """Whether a build of ``key`` is running now (another process, or thread, holds its lock)."""
    try:
        lock = folder() / f"{key}.lock"
    except SavedStepError:
        return False
    if not lock.exists():
        return False
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _valid(path: Path, key: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """The package's record if ``path`` holds an intact package built for exactly ``info``."""
    try:
        meta = json.loads((path / META).read_text())
        if meta.get("key") != key or meta.get("info") != json.loads(json.dumps(info)):
            return None
        if sha256(path / PACKAGE) != meta.get("sha256"):
            return None
        return meta
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- loading and stepping


class SavedStep:
    """A loaded step of one model (see the module doc), a
    :class:`~qkv.generation.decoders.StepDecoder` (``fits``, ``begin``, ``make_cache``,
    ``step``, ``attention``, ``release``) and, for a running batch, :meth:`step_rows`. It holds
    its model weakly: it lives as long as the model does."""

    kind = "saved"

    def __init__(self, model: GPT, cache_len: int, batch: int, path: Path, loader: Any,
                 made: dict[str, Tensor]) -> None:
        self._model = weakref.ref(model)
        self.key = path.name
        self.cache_len, self.batch, self.path = cache_len, batch, path
        self._loader, self._made = loader, made
        self._bound: tuple = ()
        self.load_seconds = 0.0
        self.requests = 0  # requests decoded through it (make_cache calls)
        self.runs = 0  # steps of a running batch through the package (step_rows, the eager fallback not)
        self._marker = torch.zeros(cache_len, dtype=torch.uint8)
        self._free: list[KVCache] = []
        self._lock = threading.Lock()
        # The package is loaded with one runner, which two threads must not enter at once (they
        # hung there: the second waits for the runner inside the call).
        self._run_lock = threading.Lock()
        self.begin()

    @property
    def model(self) -> GPT:
        m = self._model()
        if m is None:
            raise RuntimeError("the model of this saved step no longer exists")
        return m

    def fits(self, n_tokens: int) -> bool:
        return n_tokens <= self.cache_len

    def begin(self) -> None:
        """Bind the package to the model's tensors (again, if they were replaced since)."""
        stamp = fingerprint(self.model)  # the tensors it is bound to, as the jit step checks
        if stamp == self._bound:
            return
        tensors = {"model." + n: t for n, t in self.model.named_parameters(remove_duplicate=False)}
        tensors.update({"model." + n: t for n, t in self.model.named_buffers(remove_duplicate=False)})
        tensors.update(self._made)
        want = self._loader.get_constant_fqns()
        missing = [n for n in want if n not in tensors]
        if missing:
            raise SavedStepError(f"the saved step wants tensors the model lacks: {missing[:3]}")
        # user-managed: the package reads the model's own storage (no copy); rebound on change
        self._loader.load_constants({n: tensors[n] for n in want}, False, True, True, False)
        self._bound = stamp

    def make_cache(self, batch_size: int) -> KVCache:
        if batch_size != self.batch:
            raise ValueError(f"this saved step decodes {self.batch} row(s) at a time, not {batch_size}")
        with self._lock:
            self.requests += 1
            cache = self._free.pop() if self._free else None
        if cache is None:
            return _make_cache(self.model, batch_size, self.cache_len)
        cache.reset()
        return cache

    def release(self, cache: KVCache) -> None:
        with self._lock:
            self._free[:] = [cache]

    def step(self, tok: Tensor, cache: KVCache) -> Tensor:
        """(B, 1) ids at ``cache.pos`` -> (B, 1, V) logits; advances the cache. Positions the
        package was not exported for (0, 1, the last) run eagerly."""
        if self.batch != 1:
            raise ValueError(f"this is the step of a running batch of up to {self.batch} rows: use step_rows")
        pos = cache.pos
        if cache.max_seq_len != self.cache_len or tuple(tok.shape) != (self.batch, 1):
            raise ValueError(f"a saved step takes ({self.batch}, 1) tokens and a {self.cache_len}-position "
                             f"cache; got {tuple(tok.shape)} and {cache.max_seq_len}")
        if not 2 <= pos <= self.cache_len - 2:
            return self.model(tok, cache=cache, last_only=True).logits
        if cache.queries is None:
            raise ValueError("a saved step's cache keeps its queries: make it with SavedStep.make_cache")
        with self._run_lock:  # one runner: requests in other threads take turns, token by token
            out = self._loader.boxed_run([tok, cache.k, cache.v, cache.queries, self._marker[:pos]])[0]
        cache.advance(1)
        return out

    def step_rows(self, tok: Tensor, cache: BatchKVCache) -> Tensor:
        """A running batch's step: (n, 1) ids for its first n rows (2 <= n <= R), row b's at
        ``cache.pos[b]`` -> (n, 1, V) logits; those rows advance. ``cache``: the batch's cache
        of R rows, with kept queries. A span the package was not exported for runs the batch's
        eager step instead (every row on its own keys)."""
        R, S, n = self.batch, self.cache_len, tok.shape[0]
        if cache.max_seq_len != S or cache.k.shape[1] != R or tok.ndim != 2 or tok.shape[1] != 1 \
                or not 2 <= n <= R:
            raise ValueError(f"a saved step of up to {R} rows takes (2..{R}, 1) tokens and a {S}-position "
                             f"cache of {R} rows; got {tuple(tok.shape)}, {cache.max_seq_len} and "
                             f"{cache.k.shape[1]}")
        if cache.queries is None:
            raise ValueError("a saved step's cache keeps its queries: decoders.keep_queries(model, cache)")
        span = max(cache.lengths[:n])
        if not 1 <= span <= S - 3:
            out = self.model(tok, cache=cache.head(n), last_only=True).logits
            cache.sync()
            return out
        with self._run_lock:
            out = self._loader.boxed_run([tok, cache.k, cache.v, cache.queries, cache.pos[:n],
                                          self._marker[: span + 1]])[0]
            self.runs += 1
        cache.pos[:n] += 1
        cache.sync()
        return out

    def attention(self, cache: KVCache, layers: Collection[int] | None = None,
                  rows: int | None = None) -> list[Tensor | None]:
        """The attention of the token just stepped (see :func:`attention_rows`)."""
        return attention_rows(self.model, cache, layers, rows)


def _open(package: Path) -> Any:
    """The loader of a saved step's package, leaving nothing behind: AOTInductor extracts the
    package into a new ``aotinductor_*`` folder under TMPDIR and never removes it (2-5 MB for
    every process that loads a step). Here it extracts into a private folder, removed as soon as
    the loader has loaded the compiled library (a loaded library needs no file)."""
    scratch = tempfile.mkdtemp(prefix="qkv-step-")
    try:
        with owned.environment("TMPDIR", scratch):
            return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load(model: GPT, cache_len: int | None = None, batch: int = 1) -> SavedStep | None:
    """The saved step of ``model`` on this machine, or None when there is none (or it is damaged,
    or saved steps are off). Loading reads and checks the package and binds it: milliseconds."""
    if not enabled():
        return None
    t0 = time.perf_counter()
    S = cache_len_for(model, cache_len)
    key, info = step_key(model, S, batch)
    try:
        path = folder() / key
    except SavedStepError:
        return None
    meta = _valid(path, key, info)
    if meta is None:
        return None
    loader = _open(path / PACKAGE)
    made = {k: torch.tensor(v, dtype=torch.int64) for k, v in meta.get("made", {}).items()}
    step = SavedStep(model, S, batch, path, loader, made)
    step.load_seconds = time.perf_counter() - t0
    return step
