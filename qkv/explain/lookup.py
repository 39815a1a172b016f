"""``qkv explain lookup``: attention as a soft dictionary.

CS189 Lec 22 ("attention = a soft lookup table"): the Python dict {"A": 51, "B": 42, "C": 31}
needs an exact key. Make the keys one-hot vectors k_A = [1,0,0], k_B = [0,1,0], k_C = [0,0,1],
score a query q against every key by the inner product qᵀk_i, and return Σ_i p_i v_i with
p = softmax(s · qᵀk) (s a sharpness, an inverse temperature). The query [0,1,0] returns
(nearly) 42; the query [1,1,0] returns a mix of 51 and 42 (exactly half and half with the
hardmax). As s grows the softmax approaches the hardmax, the exact dictionary.

Computed with :class:`qkv.attention.SoftLookup` (``hard=True`` for the hardmax).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import SoftLookup

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_ENTRIES: dict[str, float] = {"A": 51.0, "B": 42.0, "C": 31.0}
DEFAULT_QUERIES = ((0.0, 1.0, 0.0), (1.0, 1.0, 0.0))
DEFAULT_SHARPNESS = (1.0, 10.0, 100.0)


@dataclass
class LookupAnswer:
    """One lookup: attention weights over the keys and the returned value Σ_i p_i v_i."""

    weights: list[float]
    value: float


@dataclass
class LookupResult:
    """The numbers behind ``qkv explain lookup``.

    names/values: the dictionary. keys: one-hot key vectors. For query i: scores[i] = qᵀk,
    hard[i] the hardmax lookup, soft[i][j] the softmax lookup at sharpness[j].
    """

    names: list[str]
    values: list[float]
    keys: list[list[float]]
    queries: list[list[float]]
    sharpness: list[float]
    scores: list[list[float]]
    hard: list[LookupAnswer]
    soft: list[list[LookupAnswer]]


def explain_lookup(
    entries: dict[str, float] | None = None,
    queries: Sequence[Sequence[float]] = DEFAULT_QUERIES,
    sharpness: Sequence[float] = DEFAULT_SHARPNESS,
) -> LookupResult:
    """Look ``queries`` up in the soft dictionary ``entries`` (default {A: 51, B: 42, C: 31}).

    Args:
        entries: name -> value; key i is the i-th one-hot vector. queries: vectors as long as
            the number of entries. sharpness: the softmax's inverse temperatures, each > 0.
    """
    entries = dict(DEFAULT_ENTRIES if entries is None else entries)
    n = len(entries)
    if n < 2:
        raise ValueError(f"a dictionary needs at least two entries, got {n}")
    if not queries:
        raise ValueError("give at least one query")
    for q in queries:
        if len(q) != n:
            raise ValueError(f"query {list(q)} has {len(q)} numbers; the keys are one-hot vectors of "
                             f"length {n} (one per entry: {', '.join(entries)})")
        if not all(math.isfinite(x) for x in q):
            raise ValueError(f"query {list(q)} must hold finite numbers")
    if not sharpness or any(not (s > 0 and math.isfinite(s)) for s in sharpness):
        raise ValueError(f"sharpness values must be finite and > 0, got {list(sharpness)}")
    keys = torch.eye(n, dtype=torch.float64)  # (N, N): key i is the i-th one-hot vector
    values = torch.tensor(list(entries.values()), dtype=torch.float64)  # (N,)
    qs = torch.tensor([list(q) for q in queries], dtype=torch.float64)  # (Q, N)

    def answers(table: SoftLookup) -> list[LookupAnswer]:
        out, w = table(qs)
        return [LookupAnswer(wi.tolist(), float(oi)) for wi, oi in zip(w, out, strict=True)]

    hard = answers(SoftLookup(keys, values, hard=True))
    soft_by_s = [answers(SoftLookup(keys, values, sharpness=float(s))) for s in sharpness]
    return LookupResult(
        names=list(entries), values=values.tolist(), keys=keys.tolist(), queries=qs.tolist(),
        sharpness=[float(s) for s in sharpness], scores=(qs @ keys.T).tolist(), hard=hard,
        soft=[[soft_by_s[j][i] for j in range(len(sharpness))] for i in range(len(queries))],
    )


def render_lookup(r: LookupResult, console: Console) -> None:
    """Print the tables of ``qkv explain lookup``."""
    from qkv.explain._render import add_row, num, say, table, vec

    d = table("the dictionary, with one-hot keys  (CS189 Lec 22)", ["name", "key vector", "value"])
    for name, k, v in zip(r.names, r.keys, r.values, strict=True):
        add_row(d, name, vec(k), num(v))
    console.print(d)
    for i, q in enumerate(r.queries):
        t = table(f"query q = {vec(q)}: scores qᵀk = {vec(r.scores[i])}, weights softmax(s·qᵀk)",
                  ["lookup", *(f"p_{name}" for name in r.names), "returns Σ p_i v_i"])
        add_row(t, "hardmax (exact dict)", *(num(w) for w in r.hard[i].weights), num(r.hard[i].value),
                  style="bold")
        for s, a in zip(r.sharpness, r.soft[i], strict=True):
            add_row(t, f"softmax, s = {num(s)}", *(num(w) for w in a.weights), num(a.value))
        console.print(t)
    say(console, "A Python dict answers D['B'] = 42 only for an exact key; the soft dictionary "
        "answers every query with a weighted average, and differentiably.", "dim")
    if r.queries and list(r.queries[0]) == [0.0, 1.0, 0.0] and r.hard[0].value == 42 and r.soft[0]:
        say(console, "The notes: q = [0, 1, 0] returns \"exactly 42\" (CS189 Lec 21). True of the hardmax "
            f"(an exact lookup) and of a sharp softmax (s = {num(r.sharpness[-1])}); the plain softmax (s = "
            f"{num(r.sharpness[0])}) returns {num(r.soft[0][0].value)}.", "yellow")
