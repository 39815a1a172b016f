"""``qkv explain softmax``: hardmax vs softmax, temperature, and softmax row by row.

CS189 Lec 21-22 ("softmax replaces hardmax"): for X = [1, 2, 3] the hardmax is the one-hot
[0, 0, 1] of an exact lookup, the softmax exp(x_i) / Σ_j exp(x_j) ≈ [0.09, 0.24, 0.67] its
differentiable, "soft" version. Dividing the scores by a temperature T before the softmax
moves it between the two: T → 0 gives the hardmax, T → ∞ the uniform average. On a matrix
the softmax is taken row by row (each row of attention weights sums to 1), and qkv's
softmax subtracts each row's maximum first, which changes nothing (softmax is shift
invariant) but keeps exp() from overflowing where the textbook formula returns NaN.

Everything is computed with :func:`qkv.attention.softmax` and :func:`qkv.attention.hardmax`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import hardmax, softmax

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_VALUES = (1.0, 2.0, 3.0)
DEFAULT_TEMPERATURES = (0.1, 0.5, 1.0, 2.0, 10.0)
MATRIX_SHIFT = 1000.0  # the third matrix row: large enough that exp() overflows in float64


@dataclass
class SoftmaxResult:
    """The numbers behind ``qkv explain softmax`` (plain lists, float64 precision).

    values: the scores x. hardmax, softmax: of x. tempered[i]: softmax(x / temperatures[i]).
    matrix: rows x, reversed x, x + 1000; matrix_softmax: qkv's row-wise softmax of it;
    naive_finite[r]: whether exp(x) / Σ exp(x) (no max subtracted) stays finite on row r.
    """

    values: list[float]
    hardmax: list[float]
    softmax: list[float]
    temperatures: list[float]
    tempered: list[list[float]]
    matrix: list[list[float]]
    matrix_softmax: list[list[float]]
    naive_finite: list[bool]


def _check_scores(values: Sequence[float]) -> None:
    if len(values) < 2:
        raise ValueError(f"give at least two scores, got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"scores must be finite numbers, got {list(values)}")


def explain_softmax(
    values: Sequence[float] = DEFAULT_VALUES,
    temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
) -> SoftmaxResult:
    """Hardmax, softmax and tempered softmaxes of ``values``; softmax of a 3-row matrix.

    Args:
        values: two or more finite scores. temperatures: each > 0.

    Returns:
        SoftmaxResult. Lecture: CS189 Lec 21 (hardmax [0, 0, 1], softmax ≈ [0.09, 0.24, 0.67]).
    """
    _check_scores(values)
    if not temperatures or any(not (t > 0 and math.isfinite(t)) for t in temperatures):
        raise ValueError(f"temperatures must be finite and > 0, got {list(temperatures)}")
    x = torch.tensor(list(values), dtype=torch.float64)
    matrix = torch.stack([x, x.flip(0), x + MATRIX_SHIFT])  # (3, n)
    naive = torch.exp(matrix) / torch.exp(matrix).sum(dim=-1, keepdim=True)  # the textbook formula
    return SoftmaxResult(
        values=x.tolist(),
        hardmax=hardmax(x).tolist(),
        softmax=softmax(x).tolist(),
        temperatures=[float(t) for t in temperatures],
        tempered=[softmax(x / t).tolist() for t in temperatures],
        matrix=matrix.tolist(),
        matrix_softmax=softmax(matrix, dim=-1).tolist(),
        naive_finite=torch.isfinite(naive).all(dim=-1).tolist(),
    )


def render_softmax(r: SoftmaxResult, console: Console) -> None:
    """Print the tables of ``qkv explain softmax``."""
    from qkv.explain._render import add_row, num, say, table

    t = table(f"hardmax vs softmax of x = {_list(r.values)}  (CS189 Lec 21)",
              ["", *(f"x={num(v)}" for v in r.values)])
    add_row(t, "hardmax (exact lookup)", *(num(w) for w in r.hardmax))
    add_row(t, "softmax  e^x / Σ e^x", *(num(w) for w in r.softmax), style="bold")
    for temp, row in zip(r.temperatures, r.tempered, strict=True):
        add_row(t, f"softmax(x / T), T = {temp:g}", *(num(w) for w in row))
    console.print(t)
    say(console, "T → 0 approaches the hardmax, T → ∞ the uniform average; every row sums to 1.", "dim")
    if list(r.values) == [1.0, 2.0, 3.0]:
        say(console, "The notes: softmax([1, 2, 3]) ≈ [0.09, 0.24, 0.66] (CS189 Lec 21 transcript); the "
            f"third is {r.softmax[2]:.4f}, so 0.66 is truncated: rounded, 0.67.", "yellow")
    m = table("softmax of a matrix is taken row by row", ["row", "x", "qkv softmax (max subtracted)",
                                                          "e^x / Σ e^x as written"])
    for i, (x, s, ok) in enumerate(zip(r.matrix, r.matrix_softmax, r.naive_finite, strict=True)):
        add_row(m, str(i + 1), _list(x), _list(s), "same" if ok else "NaN (e^x overflows)")
    console.print(m)
    say(console, "Rows 1 and 3 differ by a constant: softmax is shift invariant, so qkv subtracts "
        "each row's maximum before exp().", "dim")


def _list(xs: Sequence[float]) -> str:
    from qkv.explain._render import vec

    return vec(xs)
