"""``qkv explain positions``: positional encodings as the notes design them, checked on qkv's own.

Attention is permutation equivariant (``qkv explain equivariance``), so order must be put in.
The notes ask four things of a positional encoding (CS189 Lec 22: a unique code per position,
bounded values, relative distance easy to express, any length; CS231N Lec 8 and CS189 Lec 22
§四 name uniqueness and "relative position can be queried") and say:

- plain integer positions (1, 2, 3, … added as a coordinate) work poorly (CS189 Lec 22 §四);
- positions are *added*, not concatenated: concatenating widens the input, and a linear layer
  adds the two parts anyway; in high dimension x and r are nearly orthogonal (CS189 Lec 22);
- sinusoids (Vaswani et al. 2017 §3.5) are a "continuous binary code"; a fixed shift k is a
  rotation R_k, PE(p + k) = R_k PE(p) for every p, so a linear layer can read relative
  position; the inner product PE(p)·PE(p + k) falls with distance; they extrapolate;
- RoPE (Su et al. 2021; CS231N Lec 8, Discussion 11) rotates q and k, so qᵀk depends only on
  the offset m − n; ALiBi (Press et al. 2022) adds −m_h·|i − j| to the scores.

Each claim is computed here on the encodings qkv builds (:func:`qkv.attention.sinusoidal_table`,
:class:`qkv.attention.LearnedPositionalEmbedding`, :class:`qkv.attention.RotaryEmbedding`,
:class:`qkv.attention.ALiBi`) beside plain integer positions. Whether a *trained model*
extrapolates is another question, measured by ``benchmarks/length_extrapolation.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import ALiBi, LearnedPositionalEmbedding, RotaryEmbedding, sinusoidal_table

if TYPE_CHECKING:
    from rich.console import Console

FAR = 100_000  # "any length": how far the bounded/unique checks look past the table
SHIFTS = (1, 5, 20)
DISTANCES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WIDTHS = (4, 16, 64, 256, 1024)
SHIFT_TOL = 1e-5  # a float32 table's rounding gives ~3e-8


@dataclass
class Requirement:
    """One encoding against the notes' four requirements.

    ``min_gap``: the smallest distance ‖PE(p) − PE(q)‖ between two of the first ``positions``
    positions (unique when > 0). ``largest``: max |value| up to position ``reach - 1``.
    ``shift_error``: relative error of the best single linear map PE(p) ↦ PE(p + 1) for all
    positions at once (least squares; 0 when a fixed shift is a linear map, as for sinusoids).
    ``reach``: positions the encoding can give (None: any).
    """

    encoding: str
    unique: bool
    min_gap: float
    bounded: bool
    largest: float
    relative: bool
    shift_error: float
    any_length: bool
    reach: int | None
    note: str


@dataclass
class IntegerRow:
    """Integer position p added as one coordinate to a token of width ``dim`` (‖x‖² ≈ 1):
    the share of ‖x + r‖² that is position, and the score term p_i·p_j of two tokens."""

    position: int
    position_share: float
    score_term: float


@dataclass
class PositionsResult:
    """Every check of ``qkv explain positions`` (float64 unless said)."""

    dim: int
    positions: int
    requirements: list[Requirement]
    integer: list[IntegerRow]
    normalised_clash: tuple[float, float]  # p/N of position 5 of 10 and of position 50 of 100
    concat_vs_add: float  # max |W [x; r] − (W_x x + W_r r)|
    cosines: list[tuple[int, float, float]]  # (width d, mean |cos(x, PE)|, √(2/(πd)))
    rotation: list[tuple[int, float]]  # (k, max_p |PE(p + k) − R_k PE(p)|) on qkv's float32 table
    decay: list[tuple[int, float]]  # (k, PE(p)·PE(p + k)), the same for every p
    decay_p_spread: float  # max over k of the spread of PE(p)·PE(p + k) across p
    first_rise: int | None  # the first distance k where the inner product goes up again
    rope_spread: list[tuple[int, float, float]]  # (offset, spread of RoPE qᵀk over m, same with added PE)
    alibi_error: float  # max |ALiBi bias − (−m_h·|i − j|)| by hand
    table: list[list[float]]  # qkv's sinusoidal table (positions, dim), for the plot
    curve: list[float]  # PE(0)·PE(k) for k = 0 … max(DISTANCES)


def _min_gap(table: torch.Tensor) -> float:
    """Smallest distance between two different rows of a (P, d) table."""
    d = torch.cdist(table, table)
    d.fill_diagonal_(math.inf)
    return float(d.min())


def _shift_error(table: torch.Tensor) -> float:
    """Relative error of the best single linear map M with row p + 1 = M·row p for every p of
    the table (least squares over all its positions; 0 when such a map exists)."""
    src, dst = table[:-1], table[1:]
    m = torch.linalg.lstsq(src, dst, driver="gelsd").solution
    return float((src @ m - dst).norm() / dst.norm())


def _rotation(dim: int, k: int, base: float = 10000.0) -> torch.Tensor:
    """R_k (dim, dim): rotates each (sin, cos) channel pair of the sinusoidal table by k·ω_i."""
    freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    r = torch.zeros(dim, dim, dtype=torch.float64)
    for i, w in enumerate(freq.tolist()):
        c, s = math.cos(k * w), math.sin(k * w)
        # sin(a + b) = sin a cos b + cos a sin b; cos(a + b) = cos a cos b − sin a sin b
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = c, s
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = -s, c
    return r


def _check(name: str, near: torch.Tensor, far: torch.Tensor, reach: int | None, note: str,
           bounded: bool = True) -> Requirement:
    """One row: uniqueness and the shift map on ``near`` (the first positions), the largest value
    on ``far`` (as far as the encoding goes)."""
    gap, err = _min_gap(near), _shift_error(near)
    return Requirement(name, gap > 0, gap, bounded, float(far.abs().max()), err < SHIFT_TOL, err,
                       reach is None, reach, note)


def _requirements(dim: int, n: int, seed: int) -> list[Requirement]:
    p = torch.arange(n, dtype=torch.float64).unsqueeze(1)  # (n, 1)
    far = torch.arange(FAR, dtype=torch.float64).unsqueeze(1)
    sin_far = sinusoidal_table(FAR, dim).double()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        learned = LearnedPositionalEmbedding(n, dim)
    try:
        learned(n + 1)
        reach: int | None = None
    except ValueError:
        reach = n
    table = learned.weight.detach().double()
    rope = RotaryEmbedding(dim, n)
    rope_rows = torch.cat([rope.cos[:, : dim // 2], rope.sin[:, : dim // 2]], dim=1).double()  # (n, d)
    freq = rope.theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (d/2,)
    rope_far = torch.cat([torch.cos(far * freq), torch.sin(far * freq)], dim=1)  # (FAR, d)
    row = _check("integer p (one coordinate)", p, far, None, "unbounded: the position swamps the token "
                 "(table below); p + 1 is a shift, not a linear map", bounded=False)
    scaled = _check("integer p / N (N = length)", p / n, p / n, None, "bounded, but one position gets "
                    "another code in a longer text, and neighbours come 1/N apart")
    scaled.any_length = False
    return [
        row, scaled,
        _check("learned table (GPT-1/2, BERT, ViT)", table, table, reach, "untrained here; relative distance "
               f"must be learned; it ends at max_seq_len = {n}"),
        _check("sinusoidal (Vaswani et al.)", sin_far[:n], sin_far, None,
               "a shift by k is the rotation R_k (below); computed for any p"),
        _check("RoPE's angles (cos, sin of p·θ_i)", rope_rows, rope_far, None,
               "applied to q and k, not added: qᵀk depends only on m − n (below)"),
    ]


def explain_positions(dim: int = 64, positions: int = 128, seed: int = 0) -> PositionsResult:
    """All the checks, on tables of width ``dim`` (even) over ``positions`` positions."""
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be even and >= 2 (sin/cos pairs), got {dim}")
    if not 8 <= positions <= 4096 or positions < 2 * dim:
        raise ValueError(f"positions must be in 8..4096 and at least 2 x dim ({2 * dim}: more positions than "
                         f"a linear map has freedom), got {positions}")
    g = torch.Generator().manual_seed(seed)
    requirements = _requirements(dim, positions, seed)

    x = torch.randn(dim, generator=g, dtype=torch.float64)
    x = x / x.norm()  # a token of norm 1
    integer = [IntegerRow(p, p * p / (1 + p * p), float(p * (p + 1))) for p in (1, 10, 100, 1000)]

    # add vs concatenate: W [x; r] = W_x x + W_r r, for any W
    r = sinusoidal_table(positions, dim).double()[positions // 2]
    w = torch.randn(dim, 2 * dim, generator=g, dtype=torch.float64)
    concat = float((w @ torch.cat([x, r]) - (w[:, :dim] @ x + w[:, dim:] @ r)).abs().max())
    cosines = []
    for d in WIDTHS:
        xs = torch.randn(2000, d, generator=g, dtype=torch.float64)
        pe = sinusoidal_table(2000, d).double()[torch.randperm(2000, generator=g)]
        cos = torch.nn.functional.cosine_similarity(xs, pe, dim=1).abs().mean()
        cosines.append((d, float(cos), math.sqrt(2 / (math.pi * d))))

    table32 = sinusoidal_table(positions + max(SHIFTS), dim).double()  # qkv's float32 table, widened
    rotation = []
    for k in SHIFTS:
        rk = _rotation(dim, k)
        rotation.append((k, float((table32[k : k + positions] - table32[:positions] @ rk.T).abs().max())))
    long = sinusoidal_table(positions + max(DISTANCES) + 1, dim).double()
    decay, spread = [], 0.0
    for k in DISTANCES:
        dots = (long[: positions] * long[k : k + positions]).sum(1)  # PE(p)·PE(p + k) for every p
        decay.append((k, float(dots.mean())))
        spread = max(spread, float(dots.max() - dots.min()))
    freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    every = torch.cos(torch.arange(max(DISTANCES) + 1, dtype=torch.float64).unsqueeze(1) * freq).sum(1)
    rises = [k for k in range(1, len(every)) if every[k] > every[k - 1]]

    rope = RotaryEmbedding(dim, positions).double()
    q = torch.randn(dim, generator=g, dtype=torch.float64)
    k_ = torch.randn(dim, generator=g, dtype=torch.float64)
    qs = rope(q.expand(1, 1, positions, dim).contiguous())[0, 0]  # (P, d): q placed at every position
    ks = rope(k_.expand(1, 1, positions, dim).contiguous())[0, 0]
    pe = sinusoidal_table(positions, dim).double()
    rope_spread = []
    for off in (0, 3, 10):
        ms = torch.arange(off, positions)
        rot = (qs[ms] * ks[ms - off]).sum(1)
        added = ((q + pe[ms]) * (k_ + pe[ms - off])).sum(1)
        rope_spread.append((off, float(rot.max() - rot.min()), float(added.max() - added.min())))

    alibi = ALiBi(4).double()
    bias = alibi(positions)[0]  # (H, T, S)
    i = torch.arange(positions, dtype=torch.float64)
    hand = -alibi.slopes.view(-1, 1, 1) * (i.view(-1, 1) - i.view(1, -1)).abs()
    return PositionsResult(dim, positions, requirements, integer, (5 / 10, 50 / 100), concat, cosines,
                           rotation, decay, spread, rises[0] if rises else None, rope_spread,
                           float((bias - hand).abs().max()), pe.float().tolist(), every.tolist())


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def render_positions(r: PositionsResult, console: Console) -> None:
    """Print the tables of ``qkv explain positions``."""
    from qkv.explain._render import add_row, say, table

    t = table(f"the notes' four requirements (CS189 Lec 22), width {r.dim}, {r.positions} positions",
              ["encoding", "unique", "bounded", "relative: PE(p+1) = M·PE(p)?", "any length", "why"])
    for q in r.requirements:
        add_row(t, q.encoding, f"{_yes(q.unique)} (gap {q.min_gap:.2g})",
                f"{_yes(q.bounded)} (max {q.largest:,.4g})",
                f"{_yes(q.relative)} (error {q.shift_error:.1e})",
                _yes(q.any_length) if q.reach is None else f"no (ends at {q.reach})", q.note)
    console.print(t)
    say(console, "'relative': the error of the best single matrix M with PE(p+1) = M·PE(p) for every "
        "position p (least squares). ALiBi has no position vector: its bias −m_h·|i − j| is relative "
        f"by construction (qkv's ALiBi against the formula by hand: {r.alibi_error:.0e}).", "dim")

    t = table("integer positions (CS189 Lec 22 §四: 'position = 1, 2, 3 … works poorly')",
              ["position p", "share of ‖x + r‖² that is position", "score term p·(p+1) of neighbours"])
    for row in r.integer:
        add_row(t, f"{row.position:,}", f"{row.position_share:.6f}", f"{row.score_term:,.0f}")
    console.print(t)
    a, b = r.normalised_clash
    say(console, f"A token of norm 1 plus p in one coordinate: by p = 10 the position is 99% of the vector, "
        "and in qᵀk the term p_i·p_j dwarfs the content, so the softmax picks by position alone. Dividing "
        f"by the length N bounds it but position 5 of 10 and position 50 of 100 both become {a:g} = {b:g}: "
        "a code that changes with the text's length.", "dim")

    t = table("add, not concatenate (CS189 Lec 22)", ["width d", "mean |cos(x, PE(p))|", "√(2/(πd))"])
    for d, c, want in r.cosines:
        add_row(t, str(d), f"{c:.3f}", f"{want:.3f}")
    console.print(t)
    say(console, f"A linear layer on the concatenation [x; r] is W_x x + W_r r, an addition (by hand: "
        f"{r.concat_vs_add:.0e}); adding keeps the width. And in high dimension a token x and a position r "
        "are nearly orthogonal (|cos| ≈ √(2/(πd)) for random x), so the sum keeps both readable.", "dim")

    t = table("sinusoids: a shift is a rotation, PE(p + k) = R_k PE(p) for every p",
              ["k", "max_p |PE(p+k) − R_k PE(p)| (qkv's float32 table)"])
    for k, err in r.rotation:
        add_row(t, str(k), f"{err:.1e}")
    console.print(t)
    t = table("sinusoids: PE(p)·PE(p + k) = Σ_i cos(k·ω_i), the same for every p",
              ["distance k", "PE(p)·PE(p+k)"])
    for k, dot in r.decay:
        add_row(t, str(k), f"{dot:.2f}")
    console.print(t)
    rise = (f"not monotonically: it first rises again at k = {r.first_rise}" if r.first_rise is not None
            else "monotonically over these distances")
    say(console, f"The notes: 'the inner product falls with distance'. It falls overall, {rise} (spread "
        f"across p: {r.decay_p_spread:.0e}).", "yellow")

    t = table("RoPE: qᵀk after rotating q to m and k to n, for every m at one offset m − n",
              ["m − n", "spread of qᵀk over m (RoPE)", "spread with added sinusoids"])
    for off, rot, add in r.rope_spread:
        add_row(t, str(off), f"{rot:.1e}", f"{add:.2f}")
    console.print(t)
    say(console, "RoPE's score depends only on the offset; an added table's score moves with the absolute "
        "position as well.", "dim")
    say(console, "The notes: sinusoids (CS189) and RoPE (CS231N) 'extrapolate to longer sequences'. The "
        "encoding can be computed for any length (table 1); whether a trained model generalises to it is "
        "measured by benchmarks/length_extrapolation.py: mostly it does not (BENCHMARKS.md).", "yellow")
