"""KV cache: the keys and values of tokens already seen, kept for incremental decoding.

When a decoder generates token t+1, the keys and values of tokens 0..t do not change
(CS189 Lec 22 / Discussion 11: "the KV cache caches exactly K and V"), so each step only
projects the new token and attends over the stored ones: O(T) work per token, not O(T²).

Shapes: L layers, B batch, K key/value heads (GQA stores K, not H), S_max = max_seq_len,
D head dim. Buffers are allocated once, (L, B, K, S_max, D), so decoding never reallocates.

The cache is explicit inference state, owned by the decoding loop: attention layers write
their new keys/values at the current position, and the loop calls :meth:`KVCache.advance`
once every layer has run (never a layer advancing shared state behind the caller's back).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys and values for every layer of a decoder.

    Args:
        n_layers: number of attention layers that share this cache (L).
        batch_size: B. n_kv_heads: K. max_seq_len: S_max. head_dim: D (keys and values).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, val in (
            ("n_layers", n_layers),
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("max_seq_len", max_seq_len),
            ("head_dim", head_dim),
        ):
            if val < 1:
                raise ValueError(f"KVCache: {name} must be >= 1, got {val}")
        self.k = torch.zeros(n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=dtype,
                             device=device)
        self.v = torch.zeros(n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=dtype,
                             device=device)
        self.pos = 0  # tokens stored so far (the same for every layer once a step is done)
        self._layers: list[LayerKVCache] = []  # built on first use (after k/v exist)
        self.queries: Tensor | None = None  # (L, B, H, 1, D): each layer's last query, when kept

    @classmethod
    def wrap(cls, k: Tensor, v: Tensor, pos: int = 0, queries: Tensor | None = None) -> KVCache:
        """A cache around existing (L, B, K, S_max, D) buffers, written in place. ``pos`` may be
        symbolic (``marker.shape[0]`` inside :mod:`qkv.generation.aot`'s exported step, whose
        position is an input rather than Python state). ``queries``: see :meth:`keep_queries`."""
        if k.ndim != 5 or v.ndim != 5 or v.shape[:4] != k.shape[:4]:
            raise ValueError(f"KVCache.wrap: k and v must be (L, B, K, S_max, D), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        self = cls.__new__(cls)
        self.k, self.v, self.pos, self._layers, self.queries = k, v, pos, [], None
        if queries is not None:
            self.keep_queries(queries)
        return self

    def keep_queries(self, queries: Tensor) -> None:
        """Have every attention layer write its last query, after RoPE, into ``queries``
        (L, B, H, 1, D), written in place at each step: with the keys stored here, that is all it
        takes to compute any layer's attention row afterwards (softmax(q·Kᵀ/√D), as the reference
        backend does), without the step itself returning weights. A decoding step compiled ahead
        of time (:mod:`qkv.generation.aot`) keeps its queries this way."""
        L, B = self.k.shape[:2]
        if queries.ndim != 5 or tuple(queries.shape[:2]) != (L, B) or queries.shape[3] != 1:
            raise ValueError(f"KVCache.keep_queries: queries must be ({L}, {B}, H, 1, D), got "
                             f"{tuple(queries.shape)}")
        self.queries = queries

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    def layer(self, index: int) -> LayerKVCache:
        """The view of this cache that attention layer ``index`` reads and writes."""
        if not 0 <= index < self.n_layers:
            raise ValueError(f"KVCache: layer index {index} out of range [0, {self.n_layers})")
        if not self._layers:  # one view object per layer, reused at every decoding step
            self._layers = [LayerKVCache(self, i) for i in range(self.n_layers)]
        return self._layers[index]

    def advance(self, n: int) -> None:
        """Record that ``n`` more tokens are stored in every layer (call after each step)."""
        if self.pos + n > self.max_seq_len:
            raise ValueError(
                f"KVCache overflow: position {self.pos} + {n} new tokens > "
                f"max_seq_len {self.max_seq_len}; allocate a larger cache"
            )
        self.pos += n

    def reset(self) -> None:
        """Forget every stored token (the buffers are reused, not freed)."""
        self.pos = 0

    def reorder(self, index: Tensor) -> None:
        """Row b of the batch becomes old row ``index[b]`` (index: (B,)), e.g. the surviving
        hypotheses of a beam search. In place, so the layer views stay valid."""
        if index.ndim != 1 or len(index) != self.k.shape[1]:
            raise ValueError(f"KVCache.reorder: index must have shape ({self.k.shape[1]},), "
                             f"got {tuple(index.shape)}")
        self.k.copy_(self.k.index_select(1, index))
        self.v.copy_(self.v.index_select(1, index))


class BatchKVCache(KVCache):
    """A cache whose rows sit at their own positions: the running batch of continuous batching.

    Each row b holds ``pos[b]`` tokens, so requests of different lengths, started at different
    times, decode together: a step feeds one token per row, written at that row's position, and
    each row attends over its own keys only (:func:`qkv.attention.multihead.attend_rows`). Rows
    are filled one at a time by a prefill into :meth:`row` (a batch-1 cache over the row's own
    buffers, so nothing is copied), and a row that leaves is replaced by the last one
    (:meth:`move_row`), so the live rows are always ``0 .. n - 1`` and a step runs on
    :meth:`head` ``(n)``.

    Shapes: as :class:`KVCache`; ``pos`` is (B,) int64 instead of an int, mirrored in the
    Python list ``lengths`` (what each layer's attention reads without a device sync).
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=dtype, device=device)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=self.k.device)  # type: ignore[assignment]
        # pos as Python ints (each layer's attention reads them); None on a masked view (see wrap)
        self.lengths: list[int] | None = [0] * batch_size
        self._index: tuple | None = None  # (key, write indices) of the current step
        self._span: int | None = None

    @classmethod
    def wrap(cls, k: Tensor, v: Tensor, pos: int | Tensor = 0, span: int | None = None,
             queries: Tensor | None = None) -> BatchKVCache:
        """A batch cache around existing (L, B, K, S_max, D) buffers and (B,) positions (views
        are written in place, so :meth:`head` shares its parent's storage).

        ``span`` given (max(pos), possibly symbolic): a *masked* view, as a decoding step
        compiled ahead of time sees the running batch (:mod:`qkv.generation.aot`): the positions
        are never read back into Python, every row attends over the first ``span + T`` keys
        with the keys past its own masked out (:meth:`LayerKVCache.row_mask`), and the caller,
        not the step, advances the positions. Its ``pos`` may be shorter than the buffers' B:
        the step runs the first ``len(pos)`` rows (written in place in the whole buffers).
        ``queries``: see :meth:`KVCache.keep_queries`."""
        if k.ndim != 5 or v.ndim != 5 or v.shape[:4] != k.shape[:4]:
            raise ValueError(f"BatchKVCache.wrap: k and v must be (L, B, K, S_max, D), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if not isinstance(pos, Tensor) or pos.ndim != 1 or (
                pos.shape[0] > k.shape[1] if span is not None else pos.shape[0] != k.shape[1]):
            raise ValueError(f"BatchKVCache.wrap: pos must be a ({k.shape[1]},) tensor")
        self = cls.__new__(cls)
        self.k, self.v, self.pos, self._layers, self.queries = k, v, pos, [], None
        self._index = None
        self._span = span
        self.lengths = pos.tolist() if span is None else None  # type: ignore[assignment]
        if queries is not None:
            self.keep_queries(queries)
        return self

    @property
    def span(self) -> int:
        """max(pos): how far a step must read."""
        if self.lengths is None:
            return self._span  # type: ignore[return-value]
        return max(self.lengths, default=0)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def head(self, n: int) -> BatchKVCache:
        """The first ``n`` rows, sharing this cache's buffers and positions (a step on them
        advances this cache's rows too: call :meth:`sync` after it)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"BatchKVCache.head: n must be in [1, {self.batch_size}], got {n}")
        return BatchKVCache.wrap(self.k[:, :n], self.v[:, :n], self.pos[:n],
                                 queries=None if self.queries is None else self.queries[:, :n])

    def sync(self) -> None:
        """Re-read the positions after a step on a :meth:`head` view (which advanced them in the
        shared tensor, and its own copy of the Python lengths)."""
        self.lengths = self.pos.tolist()

    def row(self, b: int) -> KVCache:
        """Row ``b`` as a batch-1 :class:`KVCache` over the same buffers, emptied (its position
        set to 0): prefill a prompt into it, then :meth:`set_length`."""
        if not 0 <= b < self.batch_size:
            raise ValueError(f"BatchKVCache.row: row {b} out of range [0, {self.batch_size})")
        return KVCache.wrap(self.k[:, b : b + 1], self.v[:, b : b + 1], 0)

    def set_length(self, b: int, n: int) -> None:
        """Row ``b`` holds ``n`` tokens (after a prefill into :meth:`row`)."""
        if not 0 <= n <= self.max_seq_len:
            raise ValueError(f"BatchKVCache: length {n} outside [0, {self.max_seq_len}]")
        self.pos[b] = n
        self.lengths[b] = n

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (its stored tokens only)."""
        n = int(self.pos[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.set_length(dst, n)

    def write_index(self, T: int) -> tuple[Tensor, Tensor, Tensor]:
        """Indices of (B, K, S_max, D) where a step's (B, K, T, D) new keys go: row b at
        ``pos[b] .. pos[b] + T - 1``. Built once per step, shared by every layer."""
        key = None if self.lengths is None else (tuple(self.lengths), T)
        if key is None or self._index is None or self._index[0] != key:
            B, K, dev = self.pos.shape[0], self.k.shape[2], self.k.device
            self._index = (key, (torch.arange(B, device=dev).view(B, 1, 1),
                                 torch.arange(K, device=dev).view(1, K, 1),
                                 (self.pos.view(B, 1) + torch.arange(T, device=dev)).view(B, 1, T)))
        return self._index[1]

    def advance(self, n: int) -> None:
        """Every row stored ``n`` more tokens (a step feeds the same count to each row). A
        masked view leaves this to its caller."""
        if self.lengths is None:
            return
        if self.span + n > self.max_seq_len:
            raise ValueError(f"KVCache overflow: a row at position {self.span} + {n} new tokens > "
                             f"max_seq_len {self.max_seq_len}; allocate a larger cache")
        self.pos += n
        self.lengths = [m + n for m in self.lengths]

    def reset(self) -> None:
        self.pos.zero_()
        self.lengths = [0] * len(self.lengths)

    def reorder(self, index: Tensor) -> None:
        super().reorder(index)
        self.pos.copy_(self.pos.index_select(0, index))
        self.sync()


class LayerKVCache:
    """One layer's slice of a :class:`KVCache`; what ``MultiHeadAttention`` receives."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index
        # This layer's buffers as views, so code that reads them (and torch.compile's guards)
        # depends on tensors, not on the layer number: one compiled block serves every layer.
        self.k, self.v = cache.k[index], cache.v[index]  # (B, K, S_max, D)

    def keep_query(self, q: Tensor) -> None:
        """Write the last of q (B, H, T, D) into the cache's kept queries, if it keeps them."""
        kept = self.cache.queries
        if kept is None:
            return
        B = q.shape[0]  # a masked batch may run fewer rows than the buffer holds
        if torch.compiler.is_exporting():  # one index_put_ on the whole buffer, in place (see update)
            dev = q.device
            idx = (torch.full((1, 1), self.index, dtype=torch.long, device=dev),
                   torch.arange(B, device=dev).view(1, B))
            kept.index_put_(idx, q[:, :, -1:].unsqueeze(0))
        else:
            kept[self.index, :B].copy_(q[:, :, -1:])

    @property
    def pos(self) -> int | Tensor:
        """Absolute position of the first new token (= number of tokens already stored); per row,
        a (B,) tensor, in a :class:`BatchKVCache`."""
        return self.cache.pos

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, K, T, D) at ``pos`` and return all of them so far.

        Returns:
            (B, K, pos + T, D) keys and values: views into the preallocated buffers.
        """
        if isinstance(self.cache, BatchKVCache):
            return self._update_rows(k, v, self.cache.span)
        pos = self.cache.pos
        B, K, S_max, D = self.k.shape
        if k.ndim != 4 or k.shape[0] != B or k.shape[1] != K or k.shape[3] != D:
            raise ValueError(
                f"KVCache: new keys have shape {tuple(k.shape)}, expected (B={B}, K={K}, T, D={D})"
            )
        T = k.shape[2]
        if v.ndim != 4 or v.shape[:3] != k.shape[:3] or v.shape[3] != self.v.shape[-1]:
            raise ValueError(
                f"KVCache: new values have shape {tuple(v.shape)}, expected "
                f"({B}, {K}, {T}, {self.v.shape[-1]})"
            )
        if pos + T > S_max:
            raise ValueError(
                f"KVCache overflow: position {pos} + {T} new tokens > max_seq_len {S_max}; "
                "allocate a larger cache or shorten the sequence"
            )
        if torch.compiler.is_exporting():
            # One index_put_ on the whole (L, B, K, S_max, D) buffer, which Inductor writes in
            # place into the exported step's input. The slice write below goes through this
            # layer's view and is functionalised into a select_scatter that Inductor lowers as
            # a rewrite of the WHOLE cache, once per layer, every token. (Export only: under
            # torch.compile the slice write is in place, and index_put_ fails for q4 models.)
            dev = k.device
            idx = (torch.full((1, 1, 1), self.index, dtype=torch.long, device=dev),
                   torch.arange(B, device=dev).view(B, 1, 1), torch.arange(K, device=dev).view(1, K, 1),
                   torch.arange(pos, pos + T, device=dev).view(1, 1, T))
            self.cache.k.index_put_(idx, k)
            self.cache.v.index_put_(idx, v)
        else:
            self.k[:, :, pos : pos + T] = k
            self.v[:, :, pos : pos + T] = v
        return self.k[:, :, : pos + T], self.v[:, :, : pos + T]

    def row_lengths(self, T: int) -> list[int] | None:
        """After :meth:`update` of ``T`` tokens, how many keys each row holds (a
        :class:`BatchKVCache`'s rows differ), or None when every row holds the same."""
        if isinstance(self.cache, BatchKVCache) and self.cache.lengths is not None:
            return [n + T for n in self.cache.lengths]
        return None

    def row_mask(self, T: int) -> Tensor | None:
        """For a masked :class:`BatchKVCache` view, after :meth:`update` of ``T`` tokens: which
        of the ``span + T`` keys each row's queries may attend, (B, 1, T, span + T) bool (row b's
        query t sees keys 0 .. pos[b] + t: its own, causally); None for any other cache."""
        cache = self.cache
        if not isinstance(cache, BatchKVCache) or cache.lengths is not None:
            return None
        dev = self.k.device
        last = cache.pos.view(-1, 1, 1, 1) + torch.arange(T, device=dev).view(1, 1, T, 1)  # (B, 1, T, 1)
        return torch.arange(cache.span + T, device=dev).view(1, 1, 1, -1) <= last

    def _update_rows(self, k: Tensor, v: Tensor, span: int) -> tuple[Tensor, Tensor]:
        """:meth:`update` for a :class:`BatchKVCache`: row b's T new keys/values go to
        ``pos[b] .. pos[b] + T - 1``; returns (B, K, span + T, D), the longest row's worth (each
        row's attention reads its own first :meth:`row_lengths` keys of it)."""
        _, K, S_max, D = self.k.shape
        B = self.cache.pos.shape[0]  # a masked view may run fewer rows than its buffers hold
        if k.ndim != 4 or k.shape[0] != B or k.shape[1] != K or k.shape[3] != D or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"KVCache: new keys/values have shapes {tuple(k.shape)}, {tuple(v.shape)}; "
                             f"expected (B={B}, K={K}, T, D={D})")
        T = k.shape[2]
        if span + T > S_max:
            raise ValueError(f"KVCache overflow: a row at position {span} + {T} new tokens > max_seq_len "
                             f"{S_max}; allocate a larger cache")
        idx = self.cache.write_index(T)
        if torch.compiler.is_exporting():  # on the whole buffer, in place (see update)
            layer = torch.full((1, 1, 1), self.index, dtype=torch.long, device=k.device)
            self.cache.k.index_put_((layer, *idx), k)
            self.cache.v.index_put_((layer, *idx), v)
        else:
            self.k.index_put_(idx, k)
            self.v.index_put_(idx, v)
        return self.k[:B, :, : span + T], self.v[:B, :, : span + T]
