"""A compiled decoding step: one new token per call through ``torch.compile``.

At batch 1 an eager decoding step is bound by dispatch, not by bytes: SmolLM2's step is ~1,000
small PyTorch ops (norms, casts around each quantised product, RoPE, cache writes, residual
adds) and the Python of 30 blocks (BENCHMARKS.md, "why decoding is short of llama.cpp").
``torch.compile`` turns the step into one generated program with the elementwise work fused.

What keeps it to one compilation:

- the KV cache has one fixed length (``cache_len``), so its buffers have the same shape in
  every request; only the position changes, and it becomes a symbolic int after the second
  step (automatic dynamic shapes). PyTorch's local profile-guided cache, keyed by the job id
  below, remembers that, so a later process compiles the position-generic step at once;
- the prompt (prefill, many tokens) runs eagerly into the same cache: only 1-token steps
  go through the compiled program.

The guards dynamo would check on every module attribute at every step cost ~0.7 ms of a
~5 ms step (measured); they are skipped (``skip_guard_on_all_nn_modules_unsafe``). What they protected
against, a model changed after it was compiled (weights replaced, cast, quantised, modules
swapped), is checked once per request instead: :meth:`CompiledDecoder.begin` compares a
fingerprint of every parameter and buffer (identity, storage, dtype, shape) and of the
module tree, and compiles afresh when it differs. Each model gets its own ``torch.compile``
wrapper around its own copy of the step's code, so compiled programs are never shared.

One-row products inside the step are written as multiply-and-sum
(:func:`qkv.nn.linear._compiled_matvec`), which inductor emits as one reduction at
memory speed; the quantised products keep PyTorch's int4/int8 kernels. The glue between the
kernels is generated as C++ (``cpp_wrapper``), not Python: ~10% less per token, a longer
first compile.

Cost (SmolLM2, 2 cores, BENCHMARKS.md): 34-64 s to compile on a machine whose compile cache
is empty (two compilations: the position is static in the first), 6.5-7.4 s in a later
process. Then q4 decodes at 1.69x its eager rate, fp32 1.69x, bf16 1.96x: it pays after
~2,000-14,000 tokens, i.e. for long generations and for processes that generate many times;
``qkv generate`` leaves it off unless ``--compile jit``.
"""

from __future__ import annotations

import gc
import hashlib
import threading
import time
import types
import warnings
import weakref
from collections.abc import Collection

import torch
from torch import Tensor

from qkv.attention import KVCache
from qkv.models.gpt import GPT

CPP_WRAPPER = True  # the step's glue code in C++, not Python: ~10% less per token, slower first compile
DEFAULT_CACHE_LEN = 2048  # tokens (prompt + reply) a compiled step serves; longer ones decode eagerly


def _step(model: GPT, tok: Tensor, cache: KVCache) -> Tensor:
    """The program that is compiled: (B, 1) new tokens -> (B, 1, V) logits, cache advanced."""
    return model(tok, cache=cache, last_only=True).logits


def fingerprint(model: torch.nn.Module) -> tuple:
    """What the skipped guards would have checked: the module tree and, for every parameter
    and buffer, its identity, storage, dtype, device and shape."""
    mods = tuple((name, id(m), type(m)) for name, m in model.named_modules())
    tensors = tuple(
        (name, id(t), t.data_ptr(), t.dtype, t.device, tuple(t.shape))
        for name, t in model.state_dict(keep_vars=True).items()
    )
    return mods, tensors, model.training


def shape_signature(model: GPT) -> str:
    """What a compiled step is specific to: the config, the module tree's types and every
    tensor's dtype and shape (so the weight format), as one string."""
    return repr((repr(model.cfg), [(n, type(m).__name__) for n, m in model.named_modules()],
                 [(n, t.dtype, tuple(t.shape)) for n, t in model.state_dict(keep_vars=True).items()]))


def _job_id(model: GPT, cache_len: int) -> str:
    """PyTorch's profile-guided cache keeps, per job id, which sizes varied: one id per model
    shape and cache length, so another model's sizes never make this one's dynamic."""
    shape = (shape_signature(model), cache_len)
    return "qkv-decode-" + hashlib.sha256(repr(shape).encode()).hexdigest()[:16]


def _cache_len(model: GPT, cache_len: int | None) -> int:
    return min(model.cfg.max_seq_len, cache_len or DEFAULT_CACHE_LEN)


class CompiledDecoder:
    """The compiled 1-token step of one model, with the fixed cache length it was built for (a
    :class:`~qkv.generation.decoders.StepDecoder`; it gives no attention rows).

    Args:
        model: a :class:`~qkv.models.gpt.GPT` (any weight format: fp32, bf16, int8, q4).
        cache_len: tokens per request (prompt + new), at most the model's context.

    Use through :func:`qkv.generation.generate` with ``mode="jit"``; by hand::

        dec = compiled_decoder(model)
        dec.begin()
        cache = dec.make_cache(batch_size)
        model(prompt, cache=cache)                  # prefill, eager
        logits = dec.step(tok, cache)               # (B, 1) -> (B, 1, V)
        dec.release(cache)                          # reused by the next request
    """

    kind = "jit"

    def __init__(self, model: GPT, cache_len: int | None = None) -> None:
        self._model = weakref.ref(model)
        self.cache_len = _cache_len(model, cache_len)
        self._fn = None
        self._stamp: tuple | None = None
        self._watch = 0  # steps still timed for compilation
        self.compile_seconds = 0.0  # spent in steps that compiled, this process
        self.compilations = 0  # torch.compile wrappers built (1 unless the model changed)
        self.failed: str | None = None  # why compiling failed (then every step runs eagerly)
        self._free: dict[int, KVCache] = {}  # released caches by batch size, reused (not re-zeroed)
        self._lock = threading.Lock()

    @property
    def model(self) -> GPT:
        m = self._model()
        if m is None:
            raise RuntimeError("the model of this CompiledDecoder no longer exists")
        return m

    def fits(self, n_tokens: int) -> bool:
        """Whether a request of ``n_tokens`` (prompt + new) fits the compiled cache."""
        return n_tokens <= self.cache_len

    def begin(self) -> None:
        """Call before each request: (re)compiles if the model changed since the last one."""
        stamp = fingerprint(self.model)
        if self._fn is None or stamp != self._stamp:
            t = time.perf_counter()  # (the first torch.compile of a process imports the compiler)
            # A copy of _step's code object: dynamo keeps compiled code per code object, so this
            # model's programs are never tried for another model (the skipped guards would
            # have told them apart). One graph (no breaks): every guard is on this frame.
            fn = types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)
            self._fn = torch.compile(
                fn, fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                         "cpp_wrapper": CPP_WRAPPER})
            self._stamp = stamp
            self._free.clear()  # caches of the old model (dtype, device)
            self.compilations += 1
            self._watch = 3  # the first steps compile: a static one, then the dynamic position
            self._job_id = _job_id(self.model, self.cache_len)
            self.compile_seconds += time.perf_counter() - t

    def make_cache(self, batch_size: int) -> KVCache:
        """An empty cache of the fixed length this step was compiled for: a released one
        if there is one (a 2,048-token cache of SmolLM2 is 94 MB to allocate), else new."""
        with self._lock:
            cache = self._free.pop(batch_size, None)
        if cache is None:
            return self.model.make_cache(batch_size, self.cache_len)
        cache.reset()
        return cache

    def release(self, cache: KVCache) -> None:
        """Hand a request's cache back for the next request (its contents are not read again)."""
        with self._lock:
            self._free[cache.k.shape[1]] = cache

    def attention(self, cache: KVCache, layers: Collection[int] | None = None) -> list[Tensor | None]:
        """The compiled step keeps no queries: ValueError (use the saved step or eager)."""
        raise ValueError("the torch.compile step returns no attention weights; use mode 'auto' or 'eager'")

    def step(self, tok: Tensor, cache: KVCache) -> Tensor:
        """(B, 1) token ids at position ``cache.pos`` -> (B, 1, V) logits; advances the cache."""
        if self._fn is None:
            raise RuntimeError("call begin() before step()")
        if cache.max_seq_len != self.cache_len or tok.shape[1] != 1:
            raise ValueError(f"a compiled step takes one token per row and a cache of "
                             f"{self.cache_len} positions (make_cache); got {tok.shape[1]} tokens "
                             f"and {cache.max_seq_len} positions")
        if self.failed is not None:
            return _step(self.model, tok, cache)
        if not self._watch:
            return self._fn(self.model, tok, cache)
        self._watch -= 1
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        t = time.perf_counter()
        try:
            with torch.compiler.config.patch(job_id=self._job_id):
                out = self._fn(self.model, tok, cache)
        except torch._dynamo.exc.TorchDynamoException as e:  # e.g. a graph break: decode eagerly
            self.failed = " ".join(str(e).split())[:300] or type(e).__name__
            warnings.warn(f"the decoding step could not be compiled, decoding eagerly: {self.failed}",
                          stacklevel=2)
            return _step(self.model, tok, cache)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != frames:
            # Compiling leaves much cyclic garbage that Python's collector would reach only
            # late; until it does, the decoding steps run ~10-15% slower (BENCHMARKS.md).
            gc.collect()
            self.compile_seconds += time.perf_counter() - t
        return out


_DECODERS: weakref.WeakKeyDictionary[GPT, CompiledDecoder] = weakref.WeakKeyDictionary()


def compiled_decoder(model: GPT, cache_len: int | None = None) -> CompiledDecoder:
    """The model's compiled step, built on first use and kept as long as the model lives."""
    dec = _DECODERS.get(model)
    want = _cache_len(model, cache_len)
    if dec is None or dec.cache_len != want:
        dec = _DECODERS[model] = CompiledDecoder(model, want)
    return dec


__all__ = ["DEFAULT_CACHE_LEN", "CompiledDecoder", "compiled_decoder", "fingerprint"]
