"""The largest entries of a long last dimension, in two passes over blocks: what an output head's
top-k and greedy decoding ask of a 49,152-token vocabulary every step.

PyTorch's CPU ``topk`` and ``argmax`` scan a long row slowly: on SmolLM2's vocabulary (1, 49,152),
``topk(64)`` takes ~160-190 µs and ``argmax`` ~90-110 µs on 2 cores, 4-5% of a token that decodes in
~3.8 ms (BENCHMARKS.md, issue 53), while ``amax`` over the same row in blocks of 128 takes ~10 µs.
So both look at each block's maximum first:

- :func:`top_indices`: the ``k`` blocks with the largest maxima hold the ``k`` largest entries (an
  entry outside them is smaller than, or tied with, ``k`` block maxima), so ``topk`` runs over those
  ``k``·128 candidates only. The values found are exactly ``torch.topk``'s; among entries tied at
  the k-th value, which ones are returned may differ (as ``topk`` itself does not promise).
- :func:`argmax_last`: the first block holding the row's maximum, then the first maximum in it: the
  index ``torch.argmax`` returns (the first largest), exactly. Where the process has loaded qkv's
  kernel library, its ``argmax_rows`` instead: one call (~7 µs on SmolLM2's row, ~23 µs the two passes).

Rows whose length is not a multiple of :data:`BLOCK`, or too short to gain, take PyTorch's op.
Shapes: (M, V) -> (M, k) or (M,).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.kernels import argmax_op

BLOCK = 128


def _blocked(x: Tensor, k: int) -> Tensor | None:
    """x (M, V) viewed as (M, V/BLOCK, BLOCK) where that pays (V a multiple of BLOCK, at least 4k
    blocks, floating point), else None."""
    if x.ndim != 2 or not x.is_floating_point() or x.shape[1] % BLOCK or x.shape[1] < 4 * k * BLOCK:
        return None
    return x.reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)


def top_indices(x: Tensor, k: int) -> Tensor:
    """(M, V) -> (M, k) int64: indices of the k largest entries of each row (``torch.topk(x,
    k).indices``, in descending order of value)."""
    blocks = _blocked(x, k)
    if blocks is None:
        return x.topk(k, dim=-1).indices
    M = x.shape[0]
    best = blocks.amax(-1).topk(k, dim=-1).indices  # (M, k): the blocks with the largest maxima
    cand = blocks.gather(1, best.unsqueeze(-1).expand(M, k, BLOCK)).reshape(M, k * BLOCK)
    pick = cand.topk(k, dim=-1).indices  # (M, k) among the candidates
    return best.gather(1, pick // BLOCK) * BLOCK + pick % BLOCK


def argmax_last(x: Tensor) -> Tensor:
    """(M, V) -> (M,) int64: the index of the first largest entry of each row, as
    ``x.argmax(dim=-1)``: qkv's kernel library's ``argmax_rows`` where this process has loaded it
    (one call, ~7 µs on SmolLM2's row), else the two passes below."""
    if x.dtype == torch.float32 and x.ndim == 2 and x.device.type == "cpu" and x.shape[1] > 0:
        op = argmax_op()
        if op is not None:
            return op(x.contiguous())
    blocks = _blocked(x, 1)
    if blocks is None:
        return x.argmax(dim=-1)
    first = blocks.amax(-1).argmax(-1)  # (M,): the first block holding the row's maximum
    within = blocks[torch.arange(x.shape[0], device=x.device), first].argmax(-1)
    return first * BLOCK + within


__all__ = ["BLOCK", "argmax_last", "top_indices"]
