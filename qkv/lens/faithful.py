"""How faithful is a circuit: keep a method's top-k heads, counterfactually ablate the rest, and
measure how much of the model's answer survives (MIB's CPR and CMD).

    f = lens.faithfulness(lm, clean, corrupt, scores, answer=" Mary", wrong=" John")
    f.sizes, f.f            # circuit sizes k = 0..L·H and the faithfulness at each
    f.cpr, f.cmd            # area under f (higher is better), area between f and 1 (0 is best)

A method (exact patching, attribution patching, ...) gives each head a score, (L, H). Rank the
heads by |score|; the circuit of size k is the top k. Run the *clean* prompt with every head
outside the circuit patched to its output on the *corrupt* prompt (its z, every position: the
counterfactual ablation of the Mechanistic Interpretability Benchmark, Mueller et al. 2025) and
measure M = the answer's logit minus the wrong answer's at the last position (or the answer's
probability or loss: ``metric``, as :func:`qkv.lens.patch`'s). Then

    f(k) = (M(circuit_k) - M(∅)) / (M(full model) - M(∅))

with M(full model) = the clean run (every head kept) and M(∅) = every head patched: f(0) = 0
and f(L·H) = 1 by construction. Over x = k / (L·H), the circuit's share of all heads,

    CPR = ∫₀¹ f(x) dx          (circuit performance ratio: a method whose small circuits already
                                 restore the answer scores near 1; above 1 where a circuit beats
                                 the full model)
    CMD = ∫₀¹ |1 - f(x)| dx    (circuit-model distance: 0 = every circuit as the full model)

both by the trapezoid rule over the sizes measured. A head's output is its slice of W_O's input
(Elhage et al. 2021: the heads' outputs add up in the residual stream), so "patch head h" sets
z[..., h, :] and nothing else; the embeddings and MLPs always run on the clean prompt (MIB's node
circuits are made of heads, as here).

Every circuit is one row of a batch: the clean stream entering layer 0 repeated K times, each
row with its own heads patched (hooks on z, :mod:`qkv.lens.hooks`), run once to the last
position's logits.

Shapes: L layers, H query heads, K circuits (sizes), T tokens, Dh head width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import InputError
from qkv.lens.causal import Head, Metric, _rows, answer_pair, check_heads, prompt_pair
from qkv.lens.hooks import Edits, Recorded, TextModel, device_of, forward, hooked, shape, tail
from qkv.lens.predict import check_decoder


@dataclass
class Faithfulness:
    """A faithfulness curve (see the module's text).

    sizes: the circuit sizes k measured (ascending); fractions: k / (L·H), (K,); f: the
    faithfulness at each, (K,); diffs: M of each circuit, (K,); full / empty:
    M with every head kept / every head patched to its corrupt output; order: every head, highest
    |score| first (ties in (layer, head) order): the circuit of size k is order[:k]; cpr, cmd: the
    areas under f and under |1 - f| over the fractions; metric: what M is ("diff": the logit
    difference; "prob", "loss").
    """

    sizes: list[int]
    fractions: Tensor
    f: Tensor
    diffs: Tensor
    full: float
    empty: float
    order: list[Head]
    cpr: float
    cmd: float
    metric: str = "diff"


def area(x: Tensor | Sequence[float], y: Tensor | Sequence[float]) -> float:
    """The trapezoid rule: ∫ y dx over the points (x_i, y_i), x ascending (as ``numpy.trapz``)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    y = torch.as_tensor(y, dtype=torch.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise InputError(f"area needs two 1-d sequences of one length, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    return float(((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2).sum())


def ranking(scores: Tensor) -> list[Head]:
    """Every head of an (L, H) score table, highest |score| first (ties: (layer, head) order)."""
    if scores.ndim != 2:
        raise InputError(f"scores must be an (L, H) table of heads, got shape {tuple(scores.shape)}")
    H = scores.shape[1]
    flat = scores.detach().flatten().double().abs().nan_to_num(nan=0.0)
    idx = torch.argsort(-flat, stable=True)
    return [(int(i) // H, int(i) % H) for i in idx]


@torch.inference_mode()
def circuit_metric(lm: TextModel, clean: str | list[int], corrupt: str | list[int], kept: Tensor,
                   answer: str | int | None = None, wrong: str | int | None = None, metric: str = "diff"
                   ) -> tuple[Tensor, Metric]:
    """The metric M at the last position (``metric`` "diff": the answer's logit minus the wrong
    answer's; "prob", "loss": the answer's probability, its cross-entropy) of the clean prompt run
    with each circuit: ``kept`` (K, L, H) bool, True = the head runs as it is, False = its output z
    is the corrupt run's. (M per circuit (K,) float64, the metric with its token ids); ``answer``
    defaults to the clean run's top token, ``wrong`` to the corrupt run's."""
    check_decoder(lm, "faithfulness towards an answer")
    model = lm.model
    L, H, _ = shape(model)
    if kept.ndim != 3 or tuple(kept.shape[1:]) != (L, H):
        raise InputError(f"kept must be (K, {L}, {H}) for {lm.name}, got {tuple(kept.shape)}")
    c_ids, k_ids = prompt_pair(lm, clean, corrupt)
    dev = device_of(model)
    rec_c, rec_k = Recorded(), Recorded()
    with hooked(model, record=rec_c):
        out_c, _ = forward(model, torch.tensor([c_ids], device=dev))
    with hooked(model, record=rec_k):
        out_k, _ = forward(model, torch.tensor([k_ids], device=dev))
    m = answer_pair(lm, out_c[0, -1], out_k[0, -1], answer, wrong, metric)
    kept = kept.to(dev)
    diffs = torch.empty(len(kept), dtype=torch.float64)
    chunk = _rows(model, len(c_ids))  # as many rows as a patching sweep's batch holds
    for start in range(0, len(kept), chunk):
        rows = kept[start:start + chunk]  # (n, L, H)

        def patched(layer: int, rows: Tensor = rows):
            keep = rows[:, layer][:, None, :, None]  # (n, 1, H, 1)
            corrupt_z = rec_k.z[layer]  # (1, T, H, Dh)
            return lambda z: torch.where(keep, z, corrupt_z.to(z.dtype))

        x = rec_c.resid_pre[0].expand(len(rows), -1, -1)  # the clean embedding, (n, T, dim)
        with hooked(model, edits=Edits(z={layer: patched(layer) for layer in range(L)})):
            out = tail(model, x, 0, last_only=True)  # (n, 1, V)
        diffs[start:start + len(rows)] = m(out[:, -1]).double().cpu()
    return diffs, m


def faithfulness(lm: TextModel, clean: str | list[int], corrupt: str | list[int], scores: Tensor,
                 answer: str | int | None = None, wrong: str | int | None = None,
                 sizes: Sequence[int] | None = None, metric: str = "diff") -> Faithfulness:
    """The faithfulness curve of the circuits a head score table (L, H) ranks (see the module's
    text; Mueller et al. 2025, MIB), at circuit ``sizes`` (default every k = 0..L·H; the empty and
    full circuits are always measured, and the areas run over the sizes given). ``metric``: as
    :func:`circuit_metric`'s (MIB: the logit difference, "diff", for tasks with a wrong answer)."""
    L, H, _ = shape(lm.model)
    if tuple(scores.shape) != (L, H):
        raise InputError(f"scores must be ({L}, {H}) for {lm.name} (layers, heads), got "
                         f"{tuple(scores.shape)}")
    n = L * H
    sizes = sorted(set(range(n + 1) if sizes is None else sizes))
    if not sizes or sizes[0] < 0 or sizes[-1] > n:
        raise InputError(f"circuit sizes must lie in 0..{n} for {lm.name}, got {sizes}")
    order = ranking(scores)
    kept = torch.zeros(len(sizes) + 2, L, H, dtype=torch.bool)  # the sizes, then ∅ and the full model
    for row, k in enumerate(sizes):
        for layer, head in order[:k]:
            kept[row, layer, head] = True
    kept[-1] = True
    diffs, m = circuit_metric(lm, clean, corrupt, kept, answer, wrong, metric)
    empty, full = float(diffs[-2]), float(diffs[-1])
    diffs = diffs[:-2]
    span = full - empty
    f = (diffs - empty) / span if span != 0 else torch.full_like(diffs, float("nan"))
    x = torch.tensor(sizes, dtype=torch.float64) / n
    return Faithfulness(sizes, x, f, diffs, full, empty, order, area(x, f), area(x, (1 - f).abs()), m.name)


def circuit_faithfulness(lm: TextModel, clean: str | list[int], corrupt: str | list[int],
                         heads: Sequence[Head], answer: str | int | None = None,
                         wrong: str | int | None = None, metric: str = "diff") -> float:
    """f of one circuit: the clean prompt with every head but ``heads`` patched to its corrupt
    output, as a share of the way from the empty circuit (0) to the full model (1)."""
    L, H, _ = shape(lm.model)
    kept = torch.zeros(3, L, H, dtype=torch.bool)
    for layer, head in check_heads(lm, heads):
        kept[0, layer, head] = True
    kept[2] = True
    diffs, _ = circuit_metric(lm, clean, corrupt, kept, answer, wrong, metric)
    span = float(diffs[2] - diffs[1])
    return float(diffs[0] - diffs[1]) / span if span != 0 else float("nan")


__all__ = ["Faithfulness", "area", "circuit_faithfulness", "circuit_metric", "faithfulness", "ranking"]
