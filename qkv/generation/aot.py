"""A saved decoding step: the 1-token step compiled ahead of time (torch.export + AOTInductor),
stored in qkv's cache folder and loaded by every later process without tracing or compiling.

Today's compiled step (:mod:`qkv.generation.compiled`) re-traces the model's Python in every
process (6.5-7.4 s warm, 35-65 s cold). Here the step is exported once per model shape x
weight format x machine into packages of native code (the weights are not in them) bound to
the live model's tensors when loaded (no second copy in memory): loading takes milliseconds
and imports neither dynamo nor inductor.

What is compiled is not the whole model but a **group of G consecutive blocks** (G the largest
divisor of the layer count up to :data:`GROUP_MAX`), with the blocks' weights as *inputs*: one
package serves every group of the same signature (module types, settings, dtypes and shapes),
each call passing its own group's weights, so SmolLM2's 30 layers compile as 5 blocks and run as
six calls a token. Compiling one group instead of tracing 30 layers is what makes set-up short
(SmolLM2's one-request step: 66 s on 2 cores as one package; ~30 s for a group of 5 plus ~12 s
for the head, once). The token embedding (one row looked up) runs eagerly before the calls;
the stack's final norm and a quantised output layer (SmolLM2's int8 head with its exact top
logits) are a package of their own (``head.pt2`` in ``<cache>/heads``, for 1 to
:data:`HEAD_ROWS` rows: one per model shape, shared by the one-request step and every running
batch), its tensors inputs too (0.3 ms a token less than eagerly on SmolLM2). A float output
layer runs eagerly instead (:func:`compiled_head`). A group as exported::

    group(x (B, 1, dim), k, v (G, B, K, S, D) and q (G, B, H, 1, D) written in place,
          marker (pos,), weights [each block's parameters and buffers]) -> x (B, 1, dim)

where k, v and q are the group's slices of the model's cache (views: written in place). The
position is the *length* of ``marker`` (a dynamic dimension of the exported program), so the
KV-cache position is an input, not Python state; K/V are written with one ``index_put_`` on
the group's cache (:meth:`qkv.attention.kv_cache.LayerKVCache.update`), which Inductor turns
into a write of slot ``pos`` only. Positions 0, 1 and S - 1 fall outside the exported range
and decode eagerly; the step itself does not check bounds, so :meth:`SavedStep.step` does.

A running batch (:mod:`qkv.generation.batch`) has a step of its own, exported once for up to R
rows with the number of rows n and the longest row's length as dynamic dimensions::

    group(x (n, 1, dim), k, v (G, R, K, S, D), q (G, R, H, 1, D), marker (max(pos) + 1,),
          weights, pos (n,) each row's position) -> x (n, 1, dim)

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
the imports), the model's shape, module types and weight formats, the group size, the cache
length and batch size. A step's packages are written under a lock into a private folder (0700)
and renamed into place; their SHA-256 is recorded beside them and checked on load, so a damaged
or foreign package is refused (and rebuilt by the next build).

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
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv import owned
from qkv.attention import BatchKVCache, KVCache
from qkv.generation.compiled import fingerprint, shape_signature
from qkv.generation.decoders import attention_rows, keep_queries
from qkv.models.gpt import GPT, position_bias
from qkv.native import NativeError, build_once, compiler, cpu_identity, private_folder, sha256
from qkv.paths import cache_root

STEP_VERSION = 3  # bump when the exported step's contract changes
DEFAULT_CACHE_LEN = 2048
PACKAGE = "step.pt2"  # the first group's package; step1.pt2, ... for groups of other signatures
# Blocks per compiled group (the largest divisor of the layer count up to this). One call of the
# package per group and token: on SmolLM2 (30 layers, Zen 3) groups of 1 / 5 / 10 decoded at 1.05 /
# 1.01 / 1.02x the time of all 30 blocks in one call, which took 94 s to build where 1 block took
# 29 s and 10 blocks 46 s (benchmarks/step_groups.py).
GROUP_MAX = 5
HEAD_PACKAGE = "head.pt2"  # the final norm and the output layer, in <cache>/heads/<key>
HEAD_ROWS = 1024  # rows a head package takes: any running batch qkv serves
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


def _keyed(**what: Any) -> tuple[str, dict[str, Any]]:
    """(digest, what it digests) of a package: ``what`` it is built for, with what every package
    shares: the step's version, qkv's code, this machine (CPU, threads, torch, compiler)."""
    info = {"step_version": STEP_VERSION, "code": _code_digest(), "cpu": cpu_identity(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "torch_git": torch.version.git_version, "compiler": compiler(), **what}
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:32], info


def step_key(model: GPT, cache_len: int, batch: int = 1) -> tuple[str, dict[str, Any]]:
    """(digest, what it digests) of the step of ``model`` on this machine (see the module doc)."""
    return _keyed(model=hashlib.sha256(shape_signature(model).encode()).hexdigest(), cache_len=cache_len,
                  batch=batch, group=group_size(model.cfg.n_layers))


def cache_len_for(model: GPT, cache_len: int | None = None) -> int:
    """The fixed cache length of a model's saved step: 2,048 tokens or its context if shorter."""
    return min(model.cfg.max_seq_len, cache_len or DEFAULT_CACHE_LEN)


# --------------------------------------------------------------------------- building


def group_size(n_layers: int) -> int:
    """Blocks per compiled group: the largest divisor of ``n_layers`` up to :data:`GROUP_MAX`
    (SmolLM2's 30 layers: groups of 5, six calls a token)."""
    return max(g for g in range(1, min(GROUP_MAX, n_layers) + 1) if n_layers % g == 0)


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """A module's parameters, buffers and tensors held as plain attributes (a tied output
    matrix), by name: what a package takes as inputs for it (a block of a group, the head)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    for prefix, m in module.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, Tensor) and not k.startswith("_"):
                out.setdefault(f"{prefix}.{k}" if prefix else k, v)
    return out


def _shape(module: nn.Module) -> str:
    """What a package is specific to for ``module``: its tree as printed (types and their
    settings: a 4-bit layer's group size and kernel) and every tensor's dtype and shape."""
    return repr((repr(module), [(n, t.dtype, tuple(t.shape)) for n, t in _tensors(module).items()]))


def _signature(blocks: Sequence[nn.Module]) -> str:
    """What a group's package is specific to: each of its blocks' :func:`_shape`."""
    return repr([_shape(b) for b in blocks])


def _layout(model: GPT) -> tuple[int, list[int]]:
    """(G, the package of each group): groups of G consecutive blocks with the same signature
    share one package (every group of a uniform model, as SmolLM2's: one package)."""
    blocks = list(model.stack.blocks)
    G = group_size(len(blocks))
    sigs = [_signature(blocks[i : i + G]) for i in range(0, len(blocks), G)]
    first = list(dict.fromkeys(sigs))
    return G, [first.index(sg) for sg in sigs]


class _Group(nn.Module):
    """What is exported: G consecutive blocks of the model, their weights as inputs, for one token
    per row. The position (one row: ``marker.shape[0]``; a running batch: each row's in ``pos``,
    over the first ``marker.shape[0]`` keys) and the layers' caches are inputs too; RoPE's and
    ALiBi's tables, shared by every layer, are the package's only constants. The blocks are held
    as templates (not submodules), so no weight is baked in: every group of the same signature
    runs the same package with its own weights."""

    def __init__(self, model: GPT, start: int, size: int) -> None:
        super().__init__()
        self.rope, self.alibi = model.rope, model.alibi
        self._blocks = tuple(model.stack.blocks[start : start + size])
        self._names = tuple(_tensors(self._blocks[0]))

    def forward(self, x: Tensor, k: Tensor, v: Tensor, q: Tensor, marker: Tensor, weights: list[Tensor],
                pos: Tensor | None = None) -> Tensor:
        end = marker.shape[0]
        if pos is None:
            cache: KVCache = KVCache.wrap(k, v, end, queries=q)
            bias = position_bias(self.alibi, end, 1, end + 1)
        else:
            cache = BatchKVCache.wrap(k, v, pos, span=end - 1, queries=q)
            bias = position_bias(self.alibi, pos, 1, end)
        n = len(self._names)
        for g, block in enumerate(self._blocks):
            own = dict(zip(self._names, weights[g * n : (g + 1) * n], strict=True))
            x = torch.func.functional_call(block, own, (x,), {"bias": bias, "rope": self.rope,
                                                              "cache": cache.layer(g)}).x
        return x


class _Tail(nn.Module):
    """The stack's final norm and the output layer: (B, 1, dim) -> (B, 1, V)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.norm = model.stack.norm if model.stack.norm is not None else nn.Identity()
        self.lm_head = model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


class _Head(nn.Module):
    """What is exported after the groups: :class:`_Tail` with every tensor it holds an input, as
    the groups' weights are (held as a template, not a submodule: nothing is lifted as a
    constant, where export would name a tied output matrix with a name of its own)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self._tail = (_Tail(model),)
        self._names = tuple(_tensors(self._tail[0]))

    def forward(self, x: Tensor, weights: list[Tensor]) -> Tensor:
        own = dict(zip(self._names, weights, strict=True))
        return torch.func.functional_call(self._tail[0], own, (x,))


def _export_head(model: GPT) -> torch.export.ExportedProgram:
    """The head's exported program, for 1 to :data:`HEAD_ROWS` rows: one package serves the
    one-request step and every running batch of the model's shapes."""
    head = _Head(model).eval()
    weights = list(_tensors(_Tail(model)).values())
    rows = {0: torch.export.Dim("rows", min=1, max=HEAD_ROWS)}
    x = torch.zeros(2, 1, model.cfg.dim, dtype=model.tok_emb.weight.dtype)
    with torch.no_grad():
        return torch.export.export(head, (x, weights), dynamic_shapes=(rows, [{} for _ in weights]),
                                   strict=False)


def head_key(model: GPT) -> tuple[str, dict[str, Any]]:
    """(digest, what it digests) of the head package of ``model``'s shapes on this machine: as a
    step's key, but for the final norm and output layer only (their types, settings, dtypes and
    shapes) and for any row count and cache length."""
    return _keyed(head=hashlib.sha256(_shape(_Tail(model)).encode()).hexdigest(), rows=HEAD_ROWS)


def _heads() -> Path:
    """The private folder of head packages (``<cache>/heads``, 0700)."""
    try:
        return private_folder("heads")
    except NativeError as e:
        raise SavedStepError(str(e)) from None


def compiled_head(model: GPT) -> bool:
    """Whether ``model``'s final norm and output layer get a package of their own: yes for a
    quantised output layer (several kernels and Python between them: SmolLM2's int8 head and its
    exact top-64 logits, 1.56 -> 1.28 ms a call compiled); no for a float one, whose eager call is
    one product on every core (qkv's Linear): measured by hand (2 threads, Zen 3, medians of 300
    calls) at 35 vs 10 us for 65 x 384, 142 vs 150 us for 8,192 x 128 and 1.9 vs 3.3 ms for
    32,000 x 256, eager vs package: not worth the 12-18 s its compile adds to a set-up."""
    return not isinstance(model.lm_head, nn.Linear)


def build_head(model: GPT) -> Path:
    """The head package of ``model``'s shapes, built unless a valid one is there (~10 s)."""
    key, info = head_key(model)

    def make(tmp: Path) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            _compile(_export_head(model), tmp / HEAD_PACKAGE)
        return {"key": key, "info": info, "sha256": sha256(tmp / HEAD_PACKAGE)}

    return build_once(_heads(), key, META, lambda path: _valid_head(path, key, info), make)


def _valid_head(path: Path, key: str, info: dict[str, Any]) -> bool:
    """Whether ``path`` holds an intact head package built for exactly ``info``."""
    meta = _record(path, key, info)
    try:
        return meta is not None and sha256(path / HEAD_PACKAGE) == meta.get("sha256")
    except OSError:
        return False


def _record(path: Path, key: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """The record beside a package folder if it was built for exactly ``key`` and ``info``."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    ok = meta.get("key") == key and meta.get("info") == json.loads(json.dumps(info))
    return meta if ok else None


def _export(model: GPT, cache_len: int, batch: int, start: int = 0) -> torch.export.ExportedProgram:
    """The exported program of the group of blocks from ``start`` (see :class:`_Group`)."""
    G = group_size(model.cfg.n_layers)
    cache = _make_cache(model, batch, cache_len)  # the buffers every request will pass
    k, v, q = (t[start : start + G] for t in (cache.k, cache.v, cache.queries))
    weights = [t for b in model.stack.blocks[start : start + G] for t in _tensors(b).values()]
    fixed: list[dict] = [{} for _ in weights]
    marker = torch.zeros(cache_len, dtype=torch.uint8)[:3]
    pos = torch.export.Dim("pos", min=2, max=cache_len - 2)  # S - 1 would break a guard on S
    group = _Group(model, start, G).eval()
    with torch.no_grad():
        if batch == 1:
            x = model.embed(torch.zeros(1, 1, dtype=torch.long, device=k.device), 3)
            return torch.export.export(group, (x, k, v, q, marker, weights),
                                       dynamic_shapes=({}, {}, {}, {}, {0: pos}, fixed), strict=False)
        rows: dict[int, Any] = {0: torch.export.Dim("rows", min=2, max=batch)} if batch > 2 else {}
        at = torch.tensor([2, 0], dtype=torch.long, device=k.device)
        x = model.embed(torch.zeros(2, 1, dtype=torch.long, device=k.device), at)
        return torch.export.export(group, (x, k, v, q, marker, weights, at),
                                   dynamic_shapes=(rows, {}, {}, {}, {0: pos}, fixed, rows), strict=False)


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


def _made_constants(package: Path, blocks: Sequence[nn.Module]) -> dict[str, int]:
    """Constants Inductor adds that are not the model's: on CPU each int4 product's group size
    (a 0-d int64 tensor ``constantNNN``, from PyTorch's int4 kernel), whose values a weight-less
    package does not hold: the group size of the group's 4-bit layers on that kernel."""
    with zipfile.ZipFile(package) as z:
        src = "\n".join(z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith(".cpp"))
    consts = sorted(set(re.findall(r"_weight_int4pack_mm_cpu_tensor\([^;]*?\b(constant\d+)\b", src)))
    if not consts:
        return {}
    sizes = {int(m.group_size) for b in blocks for m in b.modules()
             if getattr(m, "kernel", None) == "aten" and hasattr(m, "group_size")}
    if len(sizes) != 1:
        raise SavedStepError(f"cannot tell the group size of {consts[0]} (its 4-bit layers have {sizes})")
    return dict.fromkeys(consts, sizes.pop())


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
# The weights are not in the package (bound at load, no second copy); no precompiled headers: on
# a fresh cache building them cost ~15 s of g++ and saved none on the two files a step compiles.
COMPILE_CONFIG = {"aot_inductor.package_constants_in_so": False, "aot_inductor.precompile_headers": False}


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
        aoti_compile_and_package(ep, package_path=str(pkg), inductor_configs=COMPILE_CONFIG)
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
        G, layout = _layout(model)
        blocks = list(model.stack.blocks)
        packages = []
        for j in range(max(layout) + 1):  # one package per signature, built from its first group
            start = G * layout.index(j)
            pkg = tmp / package_name(j)
            with warnings.catch_warnings():  # torch's own deprecation notice inside export, not the user's
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                if on_stage is not None and j == 0:
                    on_stage("exporting")
                ep = _export(model, S, batch, start)
                if on_stage is not None and j == 0:
                    on_stage("compiling")
                _compile(ep, pkg)
            packages.append({"file": pkg.name, "sha256": sha256(pkg),
                             "made": _made_constants(pkg, blocks[start : start + G])})
        return {"key": key, "info": info, "group": G, "layout": layout, "packages": packages}

    if compiled_head(model):
        build_head(model)  # shared by every step of these shapes: found when another step built it
    return build_once(folder(), key, META, lambda path: _valid(path, key, info) is not None, make)


def package_name(index: int) -> str:
    """The file of a step's ``index``-th package (``step.pt2``, ``step1.pt2``, ...)."""
    return PACKAGE if index == 0 else PACKAGE.replace(".", f"{index}.", 1)


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
    meta = _record(path, key, info)
    if meta is None:
        return None
    try:
        packages = meta.get("packages") or []
        if not packages or sorted(set(meta.get("layout", []))) != list(range(len(packages))):
            return None
        for j, p in enumerate(packages):
            if p.get("file") != package_name(j) or sha256(path / p["file"]) != p.get("sha256"):
                return None
        return meta
    except OSError:
        return None


# --------------------------------------------------------------------------- loading and stepping


class SavedStep:
    """A loaded step of one model (see the module doc), a
    :class:`~qkv.generation.decoders.StepDecoder` (``fits``, ``begin``, ``make_cache``,
    ``step``, ``attention``, ``release``) and, for a running batch, :meth:`step_rows`. It holds
    its model weakly: it lives as long as the model does."""

    kind = "saved"

    def __init__(self, model: GPT, cache_len: int, batch: int, path: Path, loaders: list[Any],
                 layout: list[int], made: list[dict[str, Tensor]], head: Any | None) -> None:
        self._model = weakref.ref(model)
        self.key = path.name
        self.cache_len, self.batch, self.path = cache_len, batch, path
        self._loaders, self._layout, self._made = loaders, layout, made
        self._head_loader = head
        self.group = model.cfg.n_layers // len(layout)  # blocks per package call
        self._runs: list[tuple[int, Callable[[list[Tensor]], list[Tensor]], list[Tensor]]] = []
        self._bound: tuple = ()
        self.load_seconds = 0.0
        self.requests = 0  # requests decoded through it (make_cache calls)
        self.runs = 0  # steps of a running batch through the package (step_rows, the eager fallback not)
        self._marker = torch.zeros(cache_len, dtype=torch.uint8)
        self._free: list[KVCache] = []
        self._lock = threading.Lock()
        # A package is loaded with one runner, which two threads must not enter at once (they
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
        """Bind the packages to the model's tensors (again, if they were replaced since): the
        shared tables (RoPE, ALiBi) as each package's constants, each group's weights as the
        inputs of its calls (the model's own storage: no copy)."""
        model = self.model
        stamp = fingerprint(model)  # the tensors it is bound to, as the jit step checks
        if stamp == self._bound:
            return
        shared = {f"{owner}.{n}": t for owner in ("rope", "alibi") if getattr(model, owner) is not None
                  for n, t in getattr(model, owner).named_buffers()}
        for loader, made in zip(self._loaders, self._made, strict=True):
            tensors = {**shared, **made}
            want = loader.get_constant_fqns()
            missing = [n for n in want if n not in tensors]
            if missing:
                raise SavedStepError(f"the saved step wants tensors the model lacks: {missing[:3]}")
            # user-managed: the package reads the model's own storage (no copy); rebound on change
            loader.load_constants({n: tensors[n] for n in want}, False, True, True, False)
        self._tail = _Tail(model)
        if self._head_loader is not None:
            if self._head_loader.get_constant_fqns():
                raise SavedStepError("the saved step's head wants constants: it takes its tensors as inputs")
            self._head_run = self._head_loader.boxed_run
            self._head_weights = list(_tensors(self._tail).values())
        blocks, G = list(model.stack.blocks), self.group
        self._runs = [(i * G, self._loaders[j].boxed_run,
                       [t for b in blocks[i * G : (i + 1) * G] for t in _tensors(b).values()])
                      for i, j in enumerate(self._layout)]
        self._bound = stamp

    def _head(self, x: Tensor) -> Tensor:
        """The stack's final norm and the output layer (B, 1, dim) -> (B, 1, V), through the
        head's package where it has one (compiled: 0.3 ms a token less than eagerly on SmolLM2's
        head), else eagerly (:func:`compiled_head`)."""
        if self._head_loader is None:
            return self._tail(x)
        return self._head_run([x, *self._head_weights])[0]

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
        G, marker = self.group, self._marker[:pos]
        with torch.no_grad():
            x = self.model.embed(tok, pos)
            with self._run_lock:  # one runner per package: requests in other threads take turns
                for i, run, weights in self._runs:
                    x = run([x, cache.k[i : i + G], cache.v[i : i + G], cache.queries[i : i + G], marker,
                             *weights])[0]
                out = self._head(x)
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
        G, marker, pos = self.group, self._marker[: span + 1], cache.pos[:n]
        with torch.no_grad():
            x = self.model.embed(tok, pos)
            with self._run_lock:
                for i, run, weights in self._runs:
                    x = run([x, cache.k[i : i + G], cache.v[i : i + G], cache.queries[i : i + G], marker,
                             *weights, pos])[0]
                out = self._head(x)
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
    packages = meta["packages"]
    loaders = [_open(path / p["file"]) for p in packages]
    made = [{k: torch.tensor(v, dtype=torch.int64) for k, v in p.get("made", {}).items()} for p in packages]
    head = None
    if compiled_head(model):
        hkey, hinfo = head_key(model)
        try:
            where = _heads() / hkey
        except SavedStepError:
            return None
        if not _valid_head(where, hkey, hinfo):
            return None
        head = _open(where / HEAD_PACKAGE)
    step = SavedStep(model, S, batch, path, loaders, meta["layout"], made, head)
    step.load_seconds = time.perf_counter() - t0
    return step
