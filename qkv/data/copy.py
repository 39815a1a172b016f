"""Where the fixed-context bottleneck bites: copy a random string, or translate it symbol by
symbol through a fixed substitution (a toy "translation" with a perfect alignment).

A date is ~15 bits, which fits in one context vector, so on the dates task the RNN without
attention does almost as well as the one with it. A random string of n symbols over 26 letters
is n·log2(26) ≈ 4.7n bits: 280 bits at n = 60. The encoder-decoder that squeezes the source
into one vector (Cho et al. 2014, Sutskever et al. 2014) must lose it as n grows; attention
reads every source position again at every step (Bahdanau et al. 2015, Fig. 2: BLEU by
sentence length). Lectures: CS189 Lec 21, CS231N Lec 8.

Splits: train/val/test draw lengths uniformly from [min_len, max_len]; ``heldout`` holds
strings *longer* than any in training (max_len + 1 .. long_len), to test length
generalisation. Test and held-out strings never occur in training.
"""

from __future__ import annotations

import random
import string

from qkv.data.dates import DatePairs

SYMBOLS = string.ascii_lowercase  # 26 symbols
TASKS = ("copy", "substitute")


def substitution(seed: int = 0) -> dict[str, str]:
    """The fixed per-symbol substitution of the ``substitute`` task: a random permutation of
    the alphabet with no fixed point (every symbol changes)."""
    rng = random.Random(seed)
    while True:
        perm = list(SYMBOLS)
        rng.shuffle(perm)
        if all(a != b for a, b in zip(SYMBOLS, perm, strict=True)):
            return dict(zip(SYMBOLS, perm, strict=True))


def length_edges(min_len: int, max_len: int, long_len: int, width: int = 5) -> tuple[int, ...]:
    """Bucket edges for per-length scores, as in Bahdanau et al.'s plot: 5-10, 11-15, ...,
    56-60 for lengths 5-60 (buckets (edge_i, edge_i+1]), then tens beyond training."""
    inner = [e for e in range(width, max_len, width) if e > min_len]
    edges = [min_len - 1, *inner, max_len]
    if long_len > max_len:
        edges += sorted({*range(max_len + 10, long_len, 10), long_len})
    return tuple(edges)


def make_copy_pairs(task: str = "copy", n_train: int = 50_000, n_val: int = 1_000, n_test: int = 2_000,
                    n_heldout: int = 1_000, min_len: int = 5, max_len: int = 60, long_len: int = 80,
                    seed: int = 0) -> DatePairs:
    """Deterministic splits for ``task`` ("copy": target = source; "substitute": every symbol
    through :func:`substitution`); ValueError for lengths out of range."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"lengths must satisfy 1 <= min_len <= max_len, got {min_len} and {max_len}")
    if long_len < max_len:
        raise ValueError(f"long_len ({long_len}) must be >= max_len ({max_len}): it is the longest "
                         "held-out string, beyond the training lengths")
    if n_heldout and long_len == max_len:
        raise ValueError("held-out strings are longer than max_len: raise long_len or set n_heldout 0")
    sub = substitution(seed) if task == "substitute" else None
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(n: int, lo: int, hi: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            s = "".join(rng.choice(SYMBOLS) for _ in range(rng.randint(lo, hi)))
            if s in seen:
                continue  # test strings never occur in training (short ones could by chance)
            seen.add(s)
            out.append((s, s if sub is None else "".join(sub[c] for c in s)))
        return out

    train = draw(n_train, min_len, max_len)
    val, test = draw(n_val, min_len, max_len), draw(n_test, min_len, max_len)
    heldout = draw(n_heldout, max_len + 1, long_len) if n_heldout else []
    return DatePairs(train, val, test, heldout, name=task,
                     heldout_what=f"longer than training ({max_len + 1}-{long_len})",
                     length_edges=length_edges(min_len, max_len, long_len))
