"""``qkv explain scaling``: why attention divides the scores by √d (Discussion 10, problem 2).

If the d components of q and k are independent with mean μ and variance σ², then
E[qᵀk] = d·μ² and Var(qᵀk) = d·(σ⁴ + 2μ²σ²); with μ = 0, σ = 1 the variance is exactly d.
Scores that grow like √d make the softmax over the keys ever more peaked (one weight near 1,
the gradients of the others near 0); dividing by s = √d keeps mean 0 and variance 1 whatever
the width, which is the 1/√d in softmax(QKᵀ/√d)V (CS189 Discussion 10; CS231N Lec 8, "scaled
dot product"; Vaswani et al. 2017 §3.2.1).

The sampled scores are scored by qkv's :func:`qkv.attention.softmax`; the expectations come
from the formulas above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import softmax

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_DIMS = (4, 16, 64, 256, 1024)
CHUNK_NUMBERS = 2**22  # keys drawn at once (32 MiB of float64), whatever d and the number of keys


@dataclass
class ScalingRow:
    """One width d: sampled statistics of qᵀk and of softmax over ``keys`` keys, unscaled and
    divided by √d. ``max_weight``: mean of the largest weight; ``entropy``: mean entropy
    (nats; ln(keys) = uniform); ``saturated``: fraction of queries with a weight above 0.99."""

    d: int
    mean: float
    var: float
    var_scaled: float
    expected_mean: float
    expected_var: float
    max_weight: float
    max_weight_scaled: float
    entropy: float
    entropy_scaled: float
    saturated: float
    saturated_scaled: float


@dataclass
class ScalingResult:
    rows: list[ScalingRow]
    samples: int
    keys: int
    mu: float
    sigma: float
    seed: int


def expected_score_moments(d: int, mu: float = 0.0, sigma: float = 1.0) -> tuple[float, float]:
    """(E[qᵀk], Var(qᵀk)) for q, k with d i.i.d. N(μ, σ²) components (Discussion 10 problem 2)."""
    return d * mu**2, d * (sigma**4 + 2 * mu**2 * sigma**2)


def _peakedness(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (Q, n) -> (largest weight (Q,), entropy in nats (Q,)) of softmax over n keys."""
    p = softmax(scores, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=-1)
    return p.amax(dim=-1), entropy


def explain_scaling(
    dims: Sequence[int] = DEFAULT_DIMS,
    samples: int = 2000,
    keys: int = 16,
    seed: int = 0,
    mu: float = 0.0,
    sigma: float = 1.0,
) -> ScalingResult:
    """Sample ``samples`` queries and ``keys`` keys per query for every width in ``dims``.

    The score statistics use all samples x keys scores; the softmax statistics one softmax
    over the keys per query. Float64, seeded: the same numbers every run.
    """
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"dims must be >= 1, got {list(dims)}")
    if samples < 2:
        raise ValueError(f"samples must be >= 2, got {samples}")
    if keys < 2:
        raise ValueError(f"keys must be >= 2 (a softmax over one key is always 1), got {keys}")
    if not (sigma > 0 and math.isfinite(sigma) and math.isfinite(mu)):
        raise ValueError(f"need a finite mu and sigma > 0, got mu={mu}, sigma={sigma}")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        scores = []
        chunk = max(1, CHUNK_NUMBERS // (keys * d))  # queries per draw
        for start in range(0, samples, chunk):
            n = min(chunk, samples - start)
            q = mu + sigma * torch.randn(n, 1, d, generator=g, dtype=torch.float64)
            k = mu + sigma * torch.randn(n, keys, d, generator=g, dtype=torch.float64)
            scores.append((q * k).sum(dim=-1))  # (n, keys): qᵀk for each key
        s = torch.cat(scores)  # (samples, keys)
        scaled = s / math.sqrt(d)
        top, ent = _peakedness(s)
        top_s, ent_s = _peakedness(scaled)
        e_mean, e_var = expected_score_moments(d, mu, sigma)
        rows.append(ScalingRow(
            d=int(d), mean=float(s.mean()), var=float(s.var()), var_scaled=float(scaled.var()),
            expected_mean=e_mean, expected_var=e_var,
            max_weight=float(top.mean()), max_weight_scaled=float(top_s.mean()),
            entropy=float(ent.mean()), entropy_scaled=float(ent_s.mean()),
            saturated=float((top > 0.99).double().mean()),
            saturated_scaled=float((top_s > 0.99).double().mean()),
        ))
    return ScalingResult(rows, samples, keys, mu, sigma, seed)


def render_scaling(r: ScalingResult, console: Console) -> None:
    """Print the tables of ``qkv explain scaling``."""
    from qkv.explain._render import add_row, num, say, table

    dist = f"N({num(r.mu)}, {num(r.sigma)}²)"
    t = table(f"qᵀk for q, k with i.i.d. {dist} components; {r.samples} queries x {r.keys} keys, "
              f"seed {r.seed}  (Discussion 10 problem 2)",
              ["d", "E[qᵀk]", "mean", "Var(qᵀk) = d(σ⁴+2μ²σ²)", "sampled", "Var(qᵀk/√d)"])
    for row in r.rows:
        add_row(t, str(row.d), num(row.expected_mean, 2), num(row.mean, 2), num(row.expected_var, 2),
                  num(row.var, 2), num(row.var_scaled, 3))
    console.print(t)
    p = table(f"how peaked softmax over {r.keys} keys gets (uniform: weight {num(1 / r.keys, 3)}, "
              f"entropy {math.log(r.keys):.2f} nats)",
              ["d", "max weight", "/√d", "entropy", "/√d", "weight > 0.99", "/√d"])
    for row in r.rows:
        add_row(p, str(row.d), num(row.max_weight, 3), num(row.max_weight_scaled, 3),
                  num(row.entropy, 3), num(row.entropy_scaled, 3),
                  f"{row.saturated:.0%}", f"{row.saturated_scaled:.0%}")
    console.print(p)
    say(console, "Without scaling the variance grows like d and the softmax saturates (a one-hot "
        "with vanishing gradients); s = √d keeps mean 0 and variance 1 at every width when "
        "μ = 0, σ = 1.", "dim")
