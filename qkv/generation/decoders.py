"""How the 1-token steps of decoding are computed: the choices (:class:`DecodeMode`), what every
way of computing them offers (:class:`StepDecoder`), the eager one, and the attention of a step
read back from the queries its cache kept.

Three decoders implement :class:`StepDecoder`: :class:`EagerDecoder` (the model's own forward,
one Python call per module), :class:`qkv.generation.compiled.CompiledDecoder` (``torch.compile``
in this process) and :class:`qkv.generation.aot.SavedStep` (compiled ahead of time once per model
and machine, loaded in milliseconds). Which one a request gets is decided in one place,
:func:`qkv.generation.builds.decoder_for`. The prompt (prefill, many tokens) always runs through
the eager model into the decoder's cache; only 1-token steps go through the decoder.

The attention of a step is not returned by the fused step itself (a fused kernel never forms the
weights): each attention layer writes its last query, after RoPE, into the cache
(:meth:`qkv.attention.KVCache.keep_queries`), and :func:`attention_rows` recomputes the weights
of that one query against the cached keys, softmax(q·Kᵀ/√D + bias), only in the layers asked for.
Lecture: CS189 Lec 21-22, the scores of one query against every stored key.

Shapes: B batch, L layers, H query heads, K key/value heads, S cache length, D head width,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from qkv.attention import BatchKVCache, KVCache
from qkv.attention.functional import scaled_dot_product_attention
from qkv.models.gpt import GPT


class DecodeMode(str, Enum):
    """How a request's 1-token steps run.

    - ``auto``: through the model's saved step where one was built on this machine
      (``qkv prepare MODEL``), else eagerly (and said once: :mod:`qkv.generation.builds`);
    - ``build``: the same, building the saved step first if it is missing (tens of seconds
      to minutes, once per model, weight format, thread count and machine);
    - ``jit``: ``torch.compile`` in this process (seconds to a minute each process);
    - ``eager``: the model's own forward, no compiled code.
    """

    AUTO = "auto"
    BUILD = "build"
    JIT = "jit"
    EAGER = "eager"

    @classmethod
    def of(cls, value: DecodeMode | str) -> DecodeMode:
        """``value`` as a mode (ValueError, one line, for anything else)."""
        if isinstance(value, DecodeMode):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"mode must be one of {names}, got {value!r}") from None


@runtime_checkable
class StepDecoder(Protocol):
    """What the decoding loops (:func:`qkv.generation.generate`, the running batch's lone row)
    ask of a way to compute 1-token steps. ``kind``: "eager", "jit", "saved" or "native". A
    decoder may also have ``greedy() -> (B,)``, the argmax of its last step's logits found by the
    step itself, which greedy ``generate`` takes instead of a pass over the logits (the native step)."""

    kind: str
    cache_len: int

    def fits(self, n_tokens: int) -> bool:
        """Whether a request of ``n_tokens`` (prompt + new) fits this decoder's cache."""
        ...

    def begin(self) -> None:
        """Called before each request: bind to the model's current tensors (or recompile)."""
        ...

    def make_cache(self, batch_size: int) -> KVCache:
        """An empty cache of :attr:`cache_len` positions, keeping queries where the decoder can
        give attention rows."""
        ...

    def step(self, tok: Tensor, cache: KVCache) -> Tensor:
        """(B, 1) ids at ``cache.pos`` -> (B, 1, V) logits; advances the cache."""
        ...

    def attention(self, cache: KVCache, layers: Collection[int] | None = None) -> list[Tensor | None]:
        """Per layer, (B, H, 1, pos) weights of the last token fed through ``cache`` (None for a
        layer not asked); ValueError where the decoder cannot give them."""
        ...

    def release(self, cache: KVCache) -> None:
        """Hand a request's cache back (its contents are not read again)."""
        ...


def keep_queries(model: GPT, cache: KVCache) -> None:
    """Give ``cache`` a buffer for each layer's last query (L, B, H, 1, D), which every forward
    through it fills (:meth:`qkv.attention.KVCache.keep_queries`), so that
    :func:`attention_rows` can give that token's attention afterwards."""
    cfg, B = model.cfg, cache.k.shape[1]
    cache.keep_queries(cache.k.new_zeros(cfg.n_layers, B, cfg.n_heads, 1, cfg.resolved_head_dim))


def attention_rows(model: GPT, cache: KVCache, layers: Collection[int] | None = None,
                   rows: int | None = None) -> list[Tensor | None]:
    """The attention of the last token fed through ``cache``, in ``layers`` (None: every layer),
    from the queries the cache kept and its keys: per layer (B, H, 1, n) weights, n =
    ``cache.pos`` (None for a layer not asked), as the eager model's reference backend returns
    them: softmax(q·Kᵀ/√D + ALiBi's bias). For a :class:`~qkv.attention.BatchKVCache`, its
    first ``rows`` rows (default all), each over its own ``pos[b]`` keys: (rows, H, 1, max pos),
    zero past each row's keys. Lecture: CS189 Lec 21-22."""
    q = cache.queries
    if q is None:
        raise ValueError("this cache keeps no queries: make it with the decoder's make_cache")
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
        out.append(scaled_dot_product_attention(q[i, :B], k, v, mask=mask, bias=bias,
                                                return_weights=True).weights)
    return out


class EagerDecoder:
    """The model's own forward, one token at a time, over a cache of ``cache_len`` positions
    sized to the request (zeroing a 2,048-position cache for a short reply costs more than the
    reply). With ``weights``, the cache keeps queries so that :meth:`attention` can give each
    step's attention rows."""

    kind = "eager"

    def __init__(self, model: GPT, cache_len: int, weights: bool = False) -> None:
        self.model, self.cache_len, self.weights = model, cache_len, weights

    def fits(self, n_tokens: int) -> bool:
        return n_tokens <= self.cache_len

    def begin(self) -> None:
        pass

    def make_cache(self, batch_size: int) -> KVCache:
        cache = self.model.make_cache(batch_size, self.cache_len)
        if self.weights:
            keep_queries(self.model, cache)
        return cache

    def step(self, tok: Tensor, cache: KVCache) -> Tensor:
        return self.model(tok, cache=cache, last_only=True).logits

    def attention(self, cache: KVCache, layers: Collection[int] | None = None) -> list[Tensor | None]:
        return attention_rows(self.model, cache, layers)

    def release(self, cache: KVCache) -> None:
        pass


__all__ = ["DecodeMode", "EagerDecoder", "StepDecoder", "attention_rows", "keep_queries"]
