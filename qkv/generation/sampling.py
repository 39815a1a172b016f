"""Choosing the next token from the model's logits.

temperature: divide the logits (T < 1 sharpens, T > 1 flattens; T = 0 means greedy argmax).
top-k: keep only the k most likely tokens (Fan et al. 2018).
top-p (nucleus): keep the smallest set of tokens whose probability sums to >= p
(Holtzman et al. 2020).

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.kernels import sample_op
from qkv.nn.top import argmax_last


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """(B, V) -> (B, V) with -inf on the tokens that top-k / top-p exclude."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1) k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def make_generator(device: str | torch.device, seed: int | None = None) -> torch.Generator:
    """The RNG of one sampling request: seeded with ``seed`` (reproducible), or, with None, from
    fresh entropy (each request differs; the global RNG is left alone)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


MIN_TEMPERATURE = 1e-6  # below this (but above 0) logits / T overflow to inf: use 0 for greedy


def check_sampling(temperature: float, top_k: int | None = None, top_p: float | None = None,
                   flags: tuple[str, str, str] = ("temperature", "top_k", "top_p")) -> None:
    """ValueError (one line) for sampling settings that cannot draw a token: a temperature that
    is not 0 (greedy) or a finite number >= 1e-6, a negative top-k, a top-p outside (0, 1]."""
    t, k, p = flags
    if not math.isfinite(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"{t} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                         f"got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"{k} must be >= 0 (0 = off), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"{p} must be in (0, 1], got {top_p}")


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, V) logits of the last position -> (B,) next token ids.

    Where this process has loaded qkv's kernel library (:func:`qkv.kernels.sample_op`), one call
    of its ``sample_rows`` filters and draws each row (16-61 µs on SmolLM2's 49,152 logits at
    top-k 200, where the PyTorch ops below take 80-100 µs on its rows and 535 µs on a N(0, 9) row);
    the same distribution, from the same uniform draw of ``generator``."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return argmax_last(logits)  # logits.argmax(dim=-1), faster on a long vocabulary
    op = sample_op() if logits.ndim == 2 and logits.device.type == "cpu" and logits.shape[1] > 0 else None
    u = None
    if op is not None and logits.is_floating_point():
        # the same draws as draw()'s (one float64 a row): a seed picks the same tokens either way
        u = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64)
        try:
            return op(logits.float().contiguous(), temperature, top_k or 0, top_p or 1.0, u)
        except ValueError:  # the op's refusal of a row; its other errors are RuntimeErrors
            pass  # a NaN or +inf (PyTorch's path below says what is wrong), or T past float32's
            # range (PyTorch's division by inf defines it): drawn with the same u
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return draw(probs, generator, u)


def draw(probs: Tensor, generator: torch.Generator | None = None, u: Tensor | None = None) -> Tensor:
    """(B, V) non-negative weights (a softmax's) -> (B,) ids, one a row drawn from its distribution
    by the inverse of its cumulative sum (float64): u ~ U[0, 1) times the row's total, then the
    first id whose cumulative sum exceeds it (a zero-probability id never is). The distribution
    ``torch.multinomial(probs, 1)`` draws from, at a fraction of its cost on a long row: it draws
    one exponential a token (~1.1 ms on SmolLM2's 49,152 logits, half a decoded token; this ~0.08
    ms). A row whose total is not a positive number (a NaN, an inf, all zero) goes to
    ``torch.multinomial``, which says what is wrong. ``u``: (B,) float64 uniforms already drawn
    from ``generator`` (by :func:`sample_next` before its kernel path declined the row)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    if not (torch.isfinite(total).all() and (total > 0).all()):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if u is None:
        u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    else:
        u = u.to(device=probs.device, dtype=torch.float64).reshape(total.shape)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # < total, always
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)
