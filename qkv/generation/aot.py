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
view), keyed like the one-row step with R and S (``saved_step(model, rows=R, cache_len=S)``).

The step returns no attention weights (the fused attention never forms them), but it keeps
each layer's query after RoPE in ``q`` (:meth:`qkv.attention.KVCache.keep_queries`): with the
keys already in the cache, :meth:`SavedStep.attention` computes any layer's row afterwards by
the reference backend's formula, so a page that shows attention (``qkv serve``) still decodes
through the saved step, paying one small product per layer it shows.

Where a package may run is decided by its key, never by the package: CPU vendor, family, model
and flag set (Inductor builds with ``-march=native``), thread count, torch version and build,
the C++ compiler, the source of every module the step runs, the model's shape, module types and
weight formats, the cache length and batch size. A package is written under a lock into a
private folder (0700) and renamed into place; its SHA-256 is recorded beside it and checked on
load, so a damaged or foreign package is refused (and rebuilt by the next build).

``QKV_CACHE_DIR=off`` or ``QKV_SAVED_STEP=off`` turns saved steps off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import warnings
import weakref
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention import BatchKVCache, KVCache
from qkv.attention.functional import scaled_dot_product_attention
from qkv.generation.compiled import fingerprint, shape_signature
from qkv.models.gpt import GPT
from qkv.native import NativeError, build_once, compiler, cpu_identity, private_folder, sha256
from qkv.paths import cache_root

STEP_VERSION = 2  # bump when the exported step's contract changes
DEFAULT_CACHE_LEN = 2048
PACKAGE = "step.pt2"
META = "step.json"
_SOURCES = ("qkv/generation/aot.py", "qkv/attention", "qkv/layers", "qkv/models/gpt.py", "qkv/nn",
            "qkv/kernels")


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


@functools.cache
def _code_digest() -> str:
    """SHA-256 over the source of every module the step runs (a change rebuilds the step)."""
    base = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in _SOURCES:
        p = base / rel
        for f in sorted([*p.rglob("*.py"), *p.rglob("*.cpp")]) if p.is_dir() else [p]:
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


def keep_queries(model: GPT, cache: KVCache) -> None:
    """Give ``cache`` a buffer for each layer's last query (L, B, H, 1, D), as a saved step's
    cache has (:meth:`qkv.attention.KVCache.keep_queries`)."""
    cfg, B = model.cfg, cache.k.shape[1]
    cache.keep_queries(cache.k.new_zeros(cfg.n_layers, B, cfg.n_heads, 1, cfg.resolved_head_dim))


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


def build(model: GPT, cache_len: int | None = None, batch: int = 1) -> Path:
    """Export and compile the step of ``model`` (tens of seconds to minutes) into the saved-step
    folder, unless a valid one is there already; returns its folder. Two processes building at
    once: one builds, the other waits and finds it."""
    if compiler() is None:
        raise SavedStepError("no C++ compiler found (c++ or g++): the step cannot be compiled here")
    S = cache_len_for(model, cache_len)
    if S < 8:
        raise SavedStepError(f"a context of {S} tokens is too short for a saved step")
    key, info = step_key(model, S, batch)

    def make(tmp: Path) -> dict[str, Any]:
        from torch._inductor import aoti_compile_and_package

        pkg = tmp / PACKAGE
        with warnings.catch_warnings():  # torch's own deprecation notice inside export, not the user's
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = _export(model, S, batch)
            aoti_compile_and_package(ep, package_path=str(pkg),
                                     inductor_configs={"aot_inductor.package_constants_in_so": False})
        return {"key": key, "info": info, "sha256": sha256(pkg), "made": _made_constants(pkg, model)}

    if _held(folder() / f"{key}.lock"):  # a build of this key is running: it may be paused
        resume_builds()
    return build_once(folder(), key, META, lambda path: _valid(path, key, info) is not None, make)


NO_STEP = "no saved step for this model here"


def background_enabled() -> bool:
    """Building in the background after an eager run is on unless ``QKV_SAVED_STEP_BACKGROUND=off``
    (or saved steps are off)."""
    off = os.environ.get("QKV_SAVED_STEP_BACKGROUND", "").lower() in ("off", "0", "false")
    return enabled() and not off


def build_in_background(model: GPT, cmd: list[str], rows: int = 1, cache_len: int | None = None) -> str:
    """Start ``cmd``, a command that builds ``model``'s step in another process (``qkv generate
    REF --compile on`` with this process's weights and thread count: the same key; with ``rows``
    > 1 also the step of a running batch of that many rows and ``cache_len`` positions),
    detached and at the lowest priority (:func:`lower_priority`), and return at once with what the closing
    line of an eager ``qkv generate`` says; the next process loads the step. Its output goes to
    ``<key>.log`` beside the packages (the last key it builds). Nothing is started when a build
    of one of its keys is already running (it holds that key's lock), without a compiler, or
    when background builds are off."""
    if not background_enabled():
        return "background builds are off"
    if compiler() is None:
        return "no C++ compiler found: no saved step can be built here"
    try:
        keys = [step_key(model, cache_len_for(model), 1)[0]]
        if rows > 1:
            keys.append(step_key(model, cache_len_for(model, cache_len), rows)[0])
        root = folder()
        running = {k for _, ks in _live_builds() for k in ks}  # started, maybe not yet at the lock
        if running & set(keys) or any(_held(root / f"{key}.lock") for key in keys):
            return "a build of it is already running"
        with (root / f"{keys[-1]}.log").open("w") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        lower_priority(proc.pid)
        _record_build(root, proc.pid, keys)
        with _BUILDS_LOCK:
            _BUILDS.append(proc)
    except (OSError, SavedStepError) as e:
        return f"could not start a background build ({' '.join(str(e).split())[:200]})"
    return f"building one now in the background (pid {proc.pid}, about a minute, once): later runs load it"


_BUILDS: list[subprocess.Popen] = []  # background builds this process started
_BUILDS_LOCK = threading.Lock()


def building() -> bool:
    """Whether a background build this process started is still running."""
    with _BUILDS_LOCK:
        _BUILDS[:] = [p for p in _BUILDS if p.poll() is None]
        return bool(_BUILDS)


def stop_background_builds() -> int:
    """End every background build this process started that is still running, at once (SIGKILL
    to its process group: the build and its compilers; its half-written folder is removed by the
    next build of the key, which holds the key's lock). ``qkv serve`` calls this when a request
    arrives: on two cores a build beside decoding slows it many times over, whatever its
    priority, and one given SIGTERM kept a core for a second or more while it unwound. Returns
    how many were stopped."""
    with _BUILDS_LOCK:
        live = [p for p in _BUILDS if p.poll() is None]
        _BUILDS.clear()
    for p in live:
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)
        threading.Thread(target=p.wait, daemon=True).start()  # reaped, never waited for here
    return len(live)


def _held(lock: Path) -> bool:
    """Whether another process holds the lock file ``lock`` (a build in progress holds its key's)."""
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _started_at(pid: int) -> str | None:
    """When process ``pid`` started (field 22 of ``/proc/<pid>/stat``, in clock ticks since boot),
    or None if it is gone: a pid and its start time name one process, even after pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _record_build(root: Path, pid: int, keys: list[str]) -> None:
    """Write ``root/.bg-<pid>.json`` (pid, start time, the keys it builds) for a background build,
    so that a later process can find it: to pause it while decoding (:func:`paused_builds`), and
    not to start a second build of the same keys while this one still loads its model."""
    started = _started_at(pid)
    if started is None:
        return
    tmp = root / f".bg-{pid}.json.tmp"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"pid": pid, "started": started, "keys": keys}))
        os.replace(tmp, root / f".bg-{pid}.json")


def _live_builds(root: Path | None = None) -> list[tuple[int, list[str]]]:
    """(pid, keys) of the background builds still running on this machine, started by any
    process of this user (:func:`build_in_background`); the records of ended ones are removed.
    ``root``: the saved-step folder (default :func:`folder`; a benchmark names another cache's)."""
    if root is None:
        try:
            root = folder()
        except (SavedStepError, NativeError):
            return []
    live = []
    for rec in root.glob(".bg-*.json"):
        try:
            info = json.loads(rec.read_text())
            pid = int(info["pid"])
            alive = _started_at(pid) == info["started"]
            keys = [str(k) for k in info.get("keys", [])]
        except (OSError, ValueError, KeyError, TypeError):
            alive = False
        if alive:
            live.append((pid, keys))
        else:
            with contextlib.suppress(OSError):
                rec.unlink()
    return live


def background_builds() -> list[int]:
    """The process groups of the background builds running on this machine (not this process's
    own: a build never pauses itself)."""
    own = os.getpgid(0)
    return [pid for pid, _ in _live_builds() if pid != own]


def _signal_builds(pids: list[int], sig: int) -> list[int]:
    done = []
    for pid in pids:
        try:
            os.killpg(pid, sig)  # the build and the compilers it started (its own session)
            done.append(pid)
        except OSError:  # ended meanwhile, or not ours
            pass
    return done


def pause_builds() -> list[int]:
    """Stop (SIGSTOP) every background build running on this machine; returns the process
    groups stopped, for :func:`continue_builds`. See :func:`paused_builds`."""
    return _signal_builds(background_builds(), signal.SIGSTOP)


def continue_builds(pids: Collection[int]) -> None:
    """Let the builds :func:`pause_builds` stopped go on (SIGCONT)."""
    _signal_builds(list(pids), signal.SIGCONT)


@contextlib.contextmanager
def paused_builds():
    """Stop (SIGSTOP) every background build running on this machine while the block decodes,
    and let them go on (SIGCONT) after it, whatever ends the block.

    On two cores a build beside decoding slows it many times over, whatever its priority
    (:func:`lower_priority`): ``qkv generate`` run again while the previous run's build went on
    decoded SmolLM2 q4 at 6 tok/s instead of ~90 (``benchmarks/first_runs.py``). Paused, a
    build keeps its work and goes on in the pauses between runs. A process killed (SIGKILL)
    inside the block leaves the builds stopped until the next block ends, or
    :func:`resume_builds`. Yields the pids paused."""
    paused = pause_builds()
    try:
        yield paused
    finally:
        continue_builds(paused)


def resume_builds() -> int:
    """Let every background build go on (SIGCONT), as a build that waits on one's lock must
    (one left stopped by a decoding process that was killed would hold it forever). Returns how
    many were signalled."""
    return len(_signal_builds(background_builds(), signal.SIGCONT))


def lower_priority(pid: int) -> str:
    """Let process ``pid`` (and the compilers it starts, which inherit it) run only when a core
    is idle: Linux's SCHED_IDLE, else the lowest nice. Set from outside, after the start
    (``preexec_fn`` is unsafe in a threaded server). Even so a build beside decoding slows it on
    two cores (each slice it takes stalls an OpenMP thread at the next barrier; by hand, SmolLM2
    in ``qkv serve``, 32 tokens: 1.2 s alone, 7-22 s beside a SCHED_IDLE build, 18-36 s beside
    one at nice 15), so ``qkv serve`` also stops its builds while requests run
    (:func:`stop_background_builds`). Returns what was set."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        return "nice 19"
    except (AttributeError, OSError):
        return "unchanged"


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
    """A loaded step of one model (see the module doc); the interface of
    :class:`qkv.generation.compiled.CompiledDecoder` (``fits``, ``begin``, ``make_cache``,
    ``step``, ``release``). It holds its model weakly: it lives as long as the model does."""

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
            raise ValueError("a saved step's cache keeps its queries: aot.keep_queries(model, cache)")
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


def attention_rows(model: GPT, cache: KVCache, layers: Collection[int] | None = None,
                   rows: int | None = None) -> list[Tensor | None]:
    """The attention of the last token fed through ``cache``, in ``layers`` (None: every layer),
    from the queries the cache kept (:meth:`qkv.attention.KVCache.keep_queries`) and its keys:
    per layer (B, H, 1, n) weights, n = ``cache.pos`` (None for a layer not asked), as the
    eager model's reference backend returns them: softmax(q·Kᵀ/√D + ALiBi's bias). For a
    :class:`~qkv.attention.BatchKVCache`, its first ``rows`` rows (default all), each over its
    own ``pos[b]`` keys: (rows, H, 1, max pos), zero past each row's keys.
    Lecture: CS189 Lec 21-22, the scores of one query against every stored key."""
    q = cache.queries
    if q is None:
        raise ValueError("this cache keeps no queries: make it with SavedStep.make_cache")
    L = model.cfg.n_layers
    want = set(range(L)) if layers is None else {i % L for i in layers}
    if isinstance(cache, BatchKVCache):
        B = cache.batch_size if rows is None else rows
        lengths = cache.lengths[:B]
        n = max(lengths, default=0)
        at = cache.pos[:B] - 1  # each row's last token
        mask = torch.arange(n, device=at.device).view(1, 1, 1, n) <= at.view(B, 1, 1, 1)
        bias = None if model.alibi is None else model.alibi.rows(at, 1, n)  # (B, H, 1, n)
    else:
        B, n, mask = q.shape[1], cache.pos, None
        bias = None if model.alibi is None else model.alibi(1, n)  # (H, 1, n)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"no token has been fed through this cache yet (pos {n})")
    out: list[Tensor | None] = []
    for i in range(L):
        if i not in want:
            out.append(None)
            continue
        k, v = cache.k[i, :B, :, :n], cache.v[i, :B, :, :n]
        w = scaled_dot_product_attention(q[i, :B], k, v, mask=mask, bias=bias, return_weights=True).weights
        out.append(w)
    return out


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
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path / PACKAGE), "model", False, 1, -1)
    made = {k: torch.tensor(v, dtype=torch.int64) for k, v in meta.get("made", {}).items()}
    step = SavedStep(model, S, batch, path, loader, made)
    step.load_seconds = time.perf_counter() - t0
    return step


_LOADED: weakref.WeakKeyDictionary[GPT, dict[tuple[int, int], tuple[SavedStep | None, float, str | None]]] = \
    weakref.WeakKeyDictionary()
RECHECK_S = 30.0  # how long "no saved step for this model" is believed before the folder is read again


def saved_step(model: GPT, build_missing: bool = False, rows: int = 1,
               cache_len: int | None = None) -> tuple[SavedStep | None, str | None]:
    """(the model's saved step or None, why not / what was done) for the decoding loop: loaded
    once per model and kept; with ``build_missing``, built first when there is none (the
    caller's ``--compile``). Any failure leaves decoding eager, with the reason. ``rows`` > 1:
    the step of a running batch of up to that many rows (:meth:`SavedStep.step_rows`) with a
    ``cache_len``-position cache (default :func:`cache_len_for`)."""
    with _LOADING:  # one load per model, however many threads ask at once
        return _saved_step(model, build_missing, rows, cache_len_for(model, cache_len))


_LOADING = threading.RLock()


def _saved_step(model: GPT, build_missing: bool, rows: int, S: int) -> tuple[SavedStep | None, str | None]:
    now = time.monotonic()
    known = _LOADED.setdefault(model, {})
    got = known.get((rows, S))
    held = got[0] if got is not None else None
    if held is not None and step_key(model, held.cache_len, held.batch)[0] != held.key:
        got = None  # the model was cast, quantised or changed shape, or the thread count changed
    if got is not None and (got[0] is not None or (not build_missing and now - got[1] < RECHECK_S)):
        return got[0], got[2]
    note = None
    try:
        step = load(model, S, rows)
        if step is None and build_missing and enabled():
            t0 = time.perf_counter()
            build(model, S, rows)
            step = load(model, S, rows)
            note = f"saved step built in {time.perf_counter() - t0:.0f} s"
    except Exception as e:  # a compiler error is not one exception type: any failure decodes eagerly
        step, note = None, f"no saved step ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    if step is None and note is None:
        note = NO_STEP if enabled() else "saved steps are off"
    known[(rows, S)] = (step, now, note)
    return step, note
