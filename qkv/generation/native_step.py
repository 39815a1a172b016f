"""The native one-token step: a whole decoder-only model's step in one call of qkv's own kernel
library (``qkv::Decoder`` in :mod:`qkv.kernels`), with no set-up and no compiler run per model.

Decoding one token of SmolLM2 eagerly dispatches ~1,460 PyTorch operations (~12 ms on 2 cores,
of which the weights' products are ~2); a saved step (:mod:`qkv.generation.aot`, compiled
once per model and machine) still spends ~45% of its token between its products (allocations,
dispatch, threads joined after each kernel). ``qkv::Decoder`` runs the step as one parallel
region: the threads share every product's blocks of 16 outputs (q|k|v in whole heads, each
thread rotating the heads it computed), the query heads of attention and the gate/up ranges of
the MLP, and meet at five barriers a layer. Greedy decoding takes the step's own argmax
(:meth:`NativeStep.greedy`), and its steps rank the vocabulary with a 4-bit copy of the head
before recomputing the top 64 in fp32 (:func:`greedy_head`: 0.59 of the 8-bit head's bytes, the
same tokens; sampled steps read the 8-bit head, whose whole distribution they draw from). Its products are
``int4_mm``'s and ``q8_mm``'s own block kernels on activations quantised the same way; its float
work between them (RMSNorm, RoPE, softmax over the cache, SiLU) is the eager model's formulas
summed in another order (~1e-6 relative, which can move an activation's int8 code by one step:
the tests hold its logits to the eager model's within 1e-3 of their scale, the same top token).

What it runs: a :class:`~qkv.models.gpt.GPT` with RoPE, pre-norm RMSNorm blocks, self-attention
with one fused q|k|v projection (MHA, GQA or MQA; biases allowed, as Qwen2's), a SwiGLU MLP, every
block's matrices 4-bit on qkv's kernel (:class:`~qkv.layers.quant.Int4Linear`,
:class:`~qkv.layers.quant.Int4SwiGLU`) and an 8-bit output layer
(:class:`~qkv.layers.quant.Q8Linear`, or the :class:`~qkv.layers.quant.TopKRefinedLinear` around
it, whose top logits it recomputes in fp32 the same way): SmolLM2, Llama- and Qwen2-shaped
GGUF files loaded with ``weights="q4"``. :func:`unsupported` says why any other model is not;
it then decodes as before. One row (:meth:`NativeStep.step`) or a running batch's live rows
together (:meth:`NativeStep.step_rows`, each row's numbers those it gets alone), float32 cache;
the attention of a step is read back from the queries it keeps
(:func:`~qkv.generation.decoders.attention_rows`). A model whose weights outgrow the CPU's
last-level cache (SmolLM2 on an AMD EPYC whose threads share one CCD's 32 MB of L3) streams them
from DRAM: its products then ask for their weights into L2 further ahead as well
(:func:`prefetch_far`).

Lectures: CS189 Lec 21-22 (a query against every cached key, the KV cache), CS231N Lec 8.
Shapes: L layers, H query heads, K key/value heads, S cache length, D head width, V vocabulary.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from qkv.attention import BatchKVCache, KVCache
from qkv.generation.compiled import fingerprint
from qkv.generation.decoders import attention_rows, keep_queries
from qkv.layers.norm import RMSNorm
from qkv.layers.quant import Int4Linear, Int4SwiGLU, Q8Linear, TopKRefinedLinear
from qkv.models.gpt import GPT


def _int4(m: Any) -> bool:
    return isinstance(m, Int4Linear) and m.kernel == "qkv" and m.group_size == 32


def unsupported(model: GPT) -> str | None:
    """Why ``model`` cannot decode through the native step (one line), or None if it can."""
    from qkv.kernels import int4_op

    if not enabled():
        return "QKV_NATIVE_STEP=off"
    cfg = model.cfg
    if model.training:
        return "the model is in training mode"
    if cfg.positions != "rope" or model.rope is None or model.alibi is not None or model.pos_emb is not None:
        return "it takes RoPE models only"
    if cfg.norm != "rmsnorm" or cfg.norm_placement != "pre" or cfg.mlp != "swiglu" or cfg.tie_qk:
        return "it takes pre-norm RMSNorm blocks with a SwiGLU MLP only"
    head = model.lm_head
    approx = head.approx if isinstance(head, TopKRefinedLinear) else head
    if not isinstance(approx, Q8Linear):
        return "its output layer is not 8-bit on qkv's kernel (weights='q4' makes it so)"
    if not isinstance(model.stack.norm, RMSNorm):
        return "the stack has no final RMSNorm"
    for b in model.stack.blocks:
        a = b.attn
        if (b.cfg.cross_attention or a.cross or a.tie_qk or not _int4(getattr(a, "qkv", None))
                or not _int4(a.out_proj)):
            return "its attention is not 4-bit self-attention with a fused q|k|v on qkv's kernel"
        if (not isinstance(b.mlp, Int4SwiGLU) or not _int4(b.mlp.gate_up) or not _int4(b.mlp.down)
                or b.mlp.gate_up.bias is not None or b.mlp.down.bias is not None):
            return "its MLP is not a 4-bit SwiGLU on qkv's kernel"
        if not isinstance(b.norm1, RMSNorm) or not isinstance(b.norm2, RMSNorm):
            return "its blocks' norms are not RMSNorm"
    shapes = {(b.attn.n_heads, b.attn.n_kv_heads, b.attn.head_dim, b.mlp.hidden, b.norm1.eps, b.norm2.eps)
              for b in model.stack.blocks}
    if len(shapes) != 1:
        return "its blocks differ in heads, widths or norms"
    tensors = [model.tok_emb.weight, model.rope.cos, model.stack.norm.weight]
    tensors += [t for b in model.stack.blocks for t in (b.norm1.weight, b.norm2.weight)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return "it takes float32 embeddings and norms on the CPU"
    if isinstance(head, TopKRefinedLinear) and head.weight.dtype != torch.float32:
        return "the exact output matrix is not float32"
    if int4_op() is None or not _has_decoder():
        return "qkv's kernels are not available here"
    return None


def _has_decoder() -> bool:
    """The loaded kernel library registers ``qkv::Decoder`` (torch raises, not AttributeError,
    for a class it does not know)."""
    try:
        torch.classes.qkv.Decoder  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _empty() -> Tensor:
    return torch.empty(0)


def _tensors(model: GPT) -> tuple[list[Tensor], list[int], list[float]]:
    """What ``qkv::Decoder`` is built from (its constructor's comment gives the order)."""
    cfg, head = model.cfg, model.lm_head
    approx = head.approx if isinstance(head, TopKRefinedLinear) else head
    exact = head.weight.detach().contiguous() if isinstance(head, TopKRefinedLinear) else _empty()
    rope = model.rope
    assert rope is not None and isinstance(approx, Q8Linear) and isinstance(model.stack.norm, RMSNorm)
    tensors = [model.tok_emb.weight.detach().contiguous(), rope.cos.contiguous(), rope.sin.contiguous(),
               model.stack.norm.weight.detach().contiguous(), approx.w8, approx.ds,
               approx.bias if approx.bias is not None else _empty(), exact]
    for b in model.stack.blocks:
        qkv, out, mlp = b.attn.qkv, b.attn.out_proj, b.mlp
        tensors += [b.norm1.weight.detach(), qkv.w4, qkv.dm, qkv.bias if qkv.bias is not None else _empty(),
                    out.w4, out.dm, out.bias if out.bias is not None else _empty(), b.norm2.weight.detach(),
                    mlp.gate_up.w4, mlp.gate_up.dm, mlp.down.w4, mlp.down.dm]
    four = greedy_head(model)
    if four is not None:
        tensors += [four.w4, four.dm]
    first = model.stack.blocks[0]
    ints = [cfg.n_layers, cfg.dim, cfg.n_heads, first.attn.n_kv_heads, first.attn.head_dim,
            first.mlp.hidden, cfg.vocab_size, head.k if isinstance(head, TopKRefinedLinear) else 0,
            int(cfg.embed_scale)]
    floats = [float(first.norm1.eps), float(model.stack.norm.eps)]
    return tensors, [*ints, int(prefetch_far(model))], floats


def last_level_cache() -> int | None:
    """Bytes of last-level cache the CPUs this process may run on reach together (Linux's sysfs):
    each distinct cache of the highest level counted once, over the CPUs of its affinity (an AMD
    EPYC's L3 a CCD, summed where its threads span several CCDs; a Xeon's whole L3 as its guest
    sees it); None where none is reported."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = [0]
    found: dict[tuple[int, str], int] = {}  # (level, the CPUs sharing it) -> bytes
    for cpu in cpus:
        for d in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
            try:
                level = int((d / "level").read_text())
                shared = (d / "shared_cpu_list").read_text().strip()
                text = (d / "size").read_text().strip()
                size = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            except (OSError, ValueError):
                continue
            found[(level, shared)] = size
    if not found:
        return None
    top = max(level for level, _ in found)
    return sum(size for (level, _), size in found.items() if level == top)


def product_bytes(model: GPT, greedy: bool = False) -> dict[str, int]:
    """Bytes of weights (codes and scales) each of one step's products reads, by
    :data:`PRODUCT_PHASES`' names: every block's 4-bit matrices and the 8-bit head, or with
    ``greedy`` the head a greedy step reads (its 4-bit copy where :func:`greedy_head` makes one)."""
    head = model.lm_head.approx if isinstance(model.lm_head, TopKRefinedLinear) else model.lm_head
    blocks = model.stack.blocks
    got = {name: sum(m.w4.nbytes + m.dm.nbytes for m in (pick(b) for b in blocks))
           for name, pick in (("q|k|v", lambda b: b.attn.qkv), ("out", lambda b: b.attn.out_proj),
                              ("gate|up", lambda b: b.mlp.gate_up), ("down", lambda b: b.mlp.down))}
    four = greedy_head(model) if greedy else None
    got["head"] = (four.nbytes if four is not None
                   else head.w8.nbytes + head.ds.nbytes if isinstance(head, Q8Linear) else 0)
    return got


def weight_bytes(model: GPT, greedy: bool = False) -> int:
    """Bytes of weights one step reads: every block's 4-bit matrices and the 8-bit head (with
    ``greedy``, the head a greedy step reads: see :func:`product_bytes`)."""
    return sum(product_bytes(model, greedy).values())


@dataclass(frozen=True)
class GreedyHead:
    """The 4-bit copy of an output matrix (V, D) a greedy step ranks with, in qkv's 4-bit kernel's
    layout (:func:`qkv.kernels.pack_int4`): ``w4`` (V/16, D/32, 4, 64) uint8 codes and ``dm``
    (V/16, D/32, 2, 16) float16 scales and offsets, ``w = d·q + m`` per group of 32 (Q4_1's grid
    of the float matrix)."""

    w4: Tensor
    dm: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes a step reads: its codes and scales."""
        return self.w4.nbytes + self.dm.nbytes


# the float matrix (by identity: a tensor's == is elementwise) -> (its version, storage and shape
# when copied, its 4-bit copy or None)
_GREEDY_HEADS = WeakIdKeyDictionary()
_GREEDY_LOCK = threading.Lock()
_GREEDY_CHUNK = 8192  # rows quantised at a time (a large vocabulary's float temporaries stay small)


def greedy_head(model: GPT) -> GreedyHead | None:
    """The 4-bit copy of the output layer a greedy step reads (:meth:`NativeStep.step` with
    ``greedy``), or None where greedy steps read the 8-bit head (``QKV_NATIVE_GREEDY_HEAD=q8``,
    or a head without an exact top-k, a float matrix made in inference mode, or groups whose
    scales leave float16).

    Greedy decoding needs only the largest logit. The head's first pass ranks the vocabulary
    and its top 64 are recomputed in fp32 from the float matrix (:class:`TopKRefinedLinear`);
    ranking by 4-bit groups (Q4_1's grid of the float matrix, groups of 32; 17.7 MB for
    SmolLM2's 49,152 x 576 against the 8-bit head's 30.1) reads 0.59 of the bytes, and the fp32
    recomputation gives the same token unless the largest exact logit falls outside the 4-bit
    pass's top 64 (on 1,000 positions of held text, never). Not for sampling: the other logits
    are within the 4-bit head's error (KL 0.016 against the 8-bit head's distribution there), so
    sampled steps read the 8-bit head. Made from the float matrix (~0.3 s for SmolLM2, when the
    model is bound), and again after the matrix changes (its version counter, storage or shape).
    The 8-bit head is the model's own, made when it was quantised: a float matrix changed in
    place afterwards leaves it as it was (eager greedy decoding and sampling rank with it), while
    greedy steps rank with a copy of the matrix as it is."""
    head = model.lm_head
    if _greedy_head_wanted() == "q8" or not isinstance(head, TopKRefinedLinear):
        return None
    weight = head.weight
    V, D = weight.shape
    key = _head_version(model)
    if head.k <= 0 or V % 16 or D % 32 or weight.dtype != torch.float32 or key is None:
        return None
    with _GREEDY_LOCK:
        known = _GREEDY_HEADS.get(weight)
        if known is not None and known[0] == key:
            return known[1]
        w4, dm = [], []
        for r in range(0, V, _GREEDY_CHUNK):  # (a multiple of 16 rows: whole blocks of the layout)
            part = Int4Linear.from_float(weight.detach()[r : r + _GREEDY_CHUNK], 32)
            if not _int4(part):  # its scales do not keep in float16 (or qkv's kernel is missing)
                _GREEDY_HEADS[weight] = (key, None)
                return None
            w4.append(part.w4)
            dm.append(part.dm)
        four = GreedyHead(torch.cat(w4), torch.cat(dm))
        _GREEDY_HEADS[weight] = (key, four)
        return four


def _greedy_head_wanted() -> str:
    """QKV_NATIVE_GREEDY_HEAD as :func:`greedy_head` reads it (a binding's stamp holds it too)."""
    return os.environ.get("QKV_NATIVE_GREEDY_HEAD", "").lower()


def _head_version(model: GPT) -> tuple | None:
    """What decides whether greedy steps' copy of the head is current: the float matrix's
    version counter (bumped by every in-place change), storage and shape; None for a head without
    a float matrix or one made in inference mode (no version counter)."""
    head = model.lm_head
    if not isinstance(head, TopKRefinedLinear):
        return None
    try:
        version = int(head.weight._version)
    except RuntimeError:
        return None
    return version, head.weight.data_ptr(), tuple(head.weight.shape)


def prefetch_far(model: GPT) -> bool:
    """Whether the step's products also ask for their weights into L2 three times as far ahead
    (``FAR`` in qmatmul.cpp): where they outgrow the last-level cache and come from DRAM, which
    the near prefetches alone may not keep busy (the cache: :func:`last_level_cache`, every L3
    the process's CPUs reach). Not settled by measuring: on a Xeon decoding a
    695 MB model 1.11x the tokens/s in a calm half hour (the AVX2 build's 1.13x), 1.00x and 1.04x
    in noisy hours; from L3 it costs 0-4% of the step's time, so a model the cache holds goes
    without (BENCHMARKS.md, issue 53). ``QKV_NATIVE_PREFETCH=far`` or ``near`` decides instead
    (read whenever a request binds the model: ``benchmarks/from_memory.py`` times both).
    """
    forced = _forced_prefetch()
    if forced in ("far", "near"):
        return forced == "far"
    cache = last_level_cache()
    return cache is not None and weight_bytes(model) > cache


def _forced_prefetch() -> str:
    """QKV_NATIVE_PREFETCH as :func:`prefetch_far` reads it (a binding's stamp holds it too)."""
    return os.environ.get("QKV_NATIVE_PREFETCH", "").lower()


class _Binding:
    """One model's ``qkv::Decoder``, bound to its tensors (rebound when they change), shared by
    every request on that model; its lock lets one step run at a time (its buffers are its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.decoder: Any = None
        self._stamp: tuple = ()

    def bind(self, model: GPT) -> None:
        # (the exact head's version: greedy steps' 4-bit copy is made again after it changes in place)
        stamp = (fingerprint(model), _forced_prefetch(), _greedy_head_wanted(), _head_version(model))
        with self.lock:
            if stamp != self._stamp:
                tensors, ints, floats = _tensors(model)
                self.decoder = torch.classes.qkv.Decoder(tensors, ints, floats)
                self._stamp = stamp


_BINDINGS: weakref.WeakKeyDictionary[GPT, _Binding] = weakref.WeakKeyDictionary()
_BINDINGS_LOCK = threading.Lock()


def _binding(model: GPT) -> _Binding:
    with _BINDINGS_LOCK:
        b = _BINDINGS.get(model)
        if b is None:
            b = _BINDINGS[model] = _Binding()
    b.bind(model)
    return b


def enabled() -> bool:
    """The native step is wanted unless ``QKV_NATIVE_STEP=off``."""
    return os.environ.get("QKV_NATIVE_STEP", "").lower() not in ("off", "0", "false")


class NativeStep:
    """A :class:`~qkv.generation.decoders.StepDecoder` over ``qkv::Decoder`` for one row: ``step``
    feeds a (1, 1) token at ``cache.pos`` through every layer and returns its (1, 1, V) logits;
    the prompt runs through the eager model into the same cache. Bound to the model's tensors
    (no copy, one binding per model); :meth:`begin` rebinds after they change. ``cache_len``:
    the request's cache, sized to it as the eager decoder's is."""

    kind = "native"

    def __init__(self, model: GPT, cache_len: int) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the native step cannot decode this model: {why}")
        self.model, self.cache_len = model, cache_len
        self._bound = _binding(model)
        self._argmax = 0

    def fits(self, n_tokens: int) -> bool:
        return n_tokens <= self.cache_len

    def begin(self) -> None:
        self._bound.bind(self.model)

    def make_cache(self, batch_size: int) -> KVCache:
        if batch_size != 1:
            raise ValueError(f"the native step decodes one row at a time, not {batch_size}")
        cache = self.model.make_cache(1, self.cache_len)
        keep_queries(self.model, cache)
        return cache

    def step(self, tok: Tensor, cache: KVCache, greedy: bool = False) -> Tensor:
        """(1, 1) ids at ``cache.pos`` -> (1, 1, V) float32 logits; advances the cache. With
        ``greedy`` the caller reads :meth:`greedy` (and at most the top 64 logits, which are
        exact): the head's first pass may read its 4-bit copy (:func:`greedy_head`), the other
        logits then within that copy's error."""
        if tuple(tok.shape) != (1, 1) or cache.k.shape[1] != 1:
            raise ValueError(f"the native step takes (1, 1) tokens and a one-row cache, "
                             f"got {tuple(tok.shape)}")
        pos = cache.pos
        if pos >= cache.max_seq_len:
            raise ValueError(f"KVCache overflow: position {pos} of a {cache.max_seq_len}-position cache")
        queries = cache.queries if cache.queries is not None else _empty()
        with self._bound.lock:
            d = self._bound.decoder
            out = (d.greedy_step if greedy else d.step)(int(tok[0, 0]), pos, cache.k, cache.v, queries)
            self._argmax = d.argmax()
        cache.advance(1)
        return out

    def step_rows(self, tok: Tensor, cache: BatchKVCache, greedy: bool = False) -> Tensor:
        """A running batch's step: (n, 1) ids for the first n rows of ``cache`` (the batch's
        :class:`~qkv.attention.BatchKVCache` of R >= n rows, float32, kept queries or none), row b's
        at ``cache.pos[b]`` -> (n, 1, V) float32 logits; those rows advance. The products take
        the n rows together (each weight read once for all of them); each row's logits, keys,
        values and queries are those :meth:`step` gives it alone, bit for bit (with ``greedy``,
        for rows that all decode greedily, those of ``step(..., greedy=True)``)."""
        n = tok.shape[0]
        if tok.ndim != 2 or tok.shape[1] != 1 or not 1 <= n <= cache.batch_size or cache.lengths is None:
            raise ValueError(f"the native step of a running batch takes (n, 1) tokens for n <= "
                             f"{cache.batch_size} rows of a batch cache, got {tuple(tok.shape)}")
        lengths = cache.lengths[:n]
        if max(lengths) >= cache.max_seq_len:
            raise ValueError(f"KVCache overflow: a row at position {max(lengths)} of a "
                             f"{cache.max_seq_len}-position cache")
        queries = cache.queries if cache.queries is not None else _empty()
        ids = tok[:, 0].to(torch.long).contiguous()
        pos = cache.pos[:n].contiguous()
        with self._bound.lock:
            d = self._bound.decoder
            out = (d.greedy_step_rows if greedy else d.step_rows)(ids, pos, cache.k, cache.v, queries)
        cache.pos[:n] += 1
        cache.sync()
        return out

    def greedy(self) -> Tensor:
        """(1,) int64: the argmax of the logits :meth:`step` returned last (``torch.argmax``'s index,
        the first largest), found by the step where it wrote them: greedy decoding's choice without
        another pass over the 49,152 logits from Python (~20 µs a token, measured in ``generate``)."""
        return torch.tensor([self._argmax])

    def attention(self, cache: KVCache, layers: Collection[int] | None = None,
                  rows: int | None = None) -> list[Tensor | None]:
        """The attention of the token just stepped (see :func:`attention_rows`; ``rows``: a
        batch cache's first rows)."""
        return attention_rows(self.model, cache, layers, rows)

    def release(self, cache: KVCache) -> None:
        pass


# qkv::Decoder's phases (qmatmul.cpp: Phase), in their order; a layer's from "norm 1" to "wait down",
# a token's from "final norm"
PROFILE_PHASES = ("norm 1", "q|k|v", "wait q|k|v", "attention", "wait attention", "merge heads", "out",
                  "wait out", "norm 2", "gate|up", "wait gate|up", "quantize mlp", "down", "wait down",
                  "final norm", "head", "serial")
PRODUCT_PHASES = ("q|k|v", "out", "gate|up", "down", "head")
LAYER_PHASES = PROFILE_PHASES[:PROFILE_PHASES.index("final norm")]


@dataclass(frozen=True)
class StepProfile:
    """Where the native step's tokens spent their time, by phase (:data:`PROFILE_PHASES`) and
    thread: ``seconds`` (threads, phases) float64, summed over the timed steps; ``counts`` (threads,
    phases) int64, the times each thread ended each phase (a layer's phases L a step, a token's one;
    "serial", thread 0's time outside the threads' phases, once a step). A thread's waits are
    its time at the barrier after a phase: what the other threads' slower share cost it."""

    seconds: Tensor
    counts: Tensor

    @property
    def steps(self) -> int:
        """The steps timed."""
        return int(self.counts[0, PROFILE_PHASES.index("serial")]) if self.counts.numel() else 0

    @property
    def threads(self) -> int:
        """The threads the timed steps ran on (the most, where their number changed)."""
        return int(self.seconds.shape[0])

    def per_step(self) -> Tensor:
        """(threads, phases) seconds a step."""
        return self.seconds / max(1, self.steps)

    def total(self) -> float:
        """Seconds of the timed steps (thread 0's phases, serial included: the steps' wall time)."""
        return float(self.seconds[0].sum()) if self.seconds.numel() else 0.0


def profile_steps(model: GPT, on: bool) -> StepProfile:
    """What ``model``'s native step timed since the last call (nothing before the first: a step
    is timed only once asked for), then the steps to come timed where ``on``. Timing costs a
    clock read at each phase's end (14 a layer and 2 a token, ~23 ns each on the Emerald Rapids
    Xeon); off, a branch. The binding's lock is held, as a step holds it: another thread's step
    is timed whole or not at all. Weights replaced (the model bound again) start the profile over,
    off. Used by ``benchmarks/step_profile.py``."""
    b = _binding(model)
    with b.lock:
        table = b.decoder.profile(on)  # (threads, phases, 2) float64
    if table.shape[1:] != (len(PROFILE_PHASES), 2):
        raise RuntimeError(f"qkv::Decoder.profile gave {tuple(table.shape)}: its phases are not "
                           f"PROFILE_PHASES' {len(PROFILE_PHASES)}")
    return StepProfile(seconds=table[..., 0].clone(), counts=table[..., 1].round().to(torch.int64))


__all__ = [
    "LAYER_PHASES",
    "PRODUCT_PHASES",
    "PROFILE_PHASES",
    "GreedyHead",
    "NativeStep",
    "StepProfile",
    "enabled",
    "greedy_head",
    "last_level_cache",
    "prefetch_far",
    "product_bytes",
    "profile_steps",
    "unsupported",
    "weight_bytes",
]
