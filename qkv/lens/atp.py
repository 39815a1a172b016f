"""Attribution patching: every cell of an activation patching sweep estimated from two forward
passes and one backward pass, instead of one forward pass per cell.

    est = lens.attribution_patch(lm, clean, corrupt, site="head")   # (L, H) in ~2 forward passes
    exact = lens.patch(lm, clean, corrupt, site="head")             # the sweep it estimates
    lens.agreement(est.values, exact.values)                        # Spearman, top-10 recall

Activation patching (:func:`qkv.lens.patch`) runs the corrupt prompt with one activation a of the
clean run put back and measures the metric M (the answer's logit minus the wrong answer's at the
last position). Attribution patching (Nanda 2023, "Attribution patching: activation patching at
industrial scale"; Syed, Rager & Conmy 2023) replaces each such run by the first-order Taylor
term around the corrupt run:

    M(a_corrupt + (a_clean - a_corrupt)) - M(a_corrupt)  ≈  (a_clean - a_corrupt) · ∂M/∂a |corrupt

one dot product per cell, every gradient from a single backward pass of the corrupt run. It is
exact where M is linear in a (a head of the last layer read by a head without a final norm) and
an estimate elsewhere; it is known to miss effects where attention saturates or where a cell's
direct and indirect effects cancel (Kramár et al. 2024, AtP*), which is why the exact sweep stays
one call away and :func:`agreement` says how well the two agree on a given prompt pair.

Sites: "head" (L, H), head h's output z (every position) of layer l; "resid" (L, T), the stream
entering block l at position t. Values are normalised as :class:`~qkv.lens.Patching`'s:
(M_estimated - M_corrupt) / (M_clean - M_corrupt), 0 = as corrupt, 1 = as clean.

Shapes: L layers, H query heads, T tokens, Dh head width, dim model width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import InputError
from qkv.layers.quant import Int4Linear, Int4SwiGLU, Int8Linear, Q8Linear, TopKRefinedLinear
from qkv.lens.cache import labels
from qkv.lens.causal import PatchPair, answer_pair, prompt_pair
from qkv.lens.hooks import TextModel, blocks, device_of, forward, shape
from qkv.lens.predict import check_decoder

SITES = ("head", "resid")
QUANTISED = (Int4Linear, Int4SwiGLU, Int8Linear, Q8Linear, TopKRefinedLinear)  # no gradient through them


@dataclass
class PatchEstimate(PatchPair):
    """Attribution patching's estimate of an activation patching sweep (see the module's text).

    values: (L, H) for site "head", (L, T) for "resid": the estimated normalised metric, as
    :attr:`Patching.values <qkv.lens.Patching>`; ``delta``: the estimated change of the logit
    difference itself, (a_clean - a_corrupt) · ∂M/∂a. ``seconds``: the two forward passes and the
    backward passes. ``grad_drop`` (asked for): AtP*'s GradDrop magnitudes, same shape, ≥ 0
    (:func:`attribution_patch`).
    """

    values: Tensor
    delta: Tensor
    seconds: float
    grad_drop: Tensor | None = None


@dataclass
class Agreement:
    """How an estimate ranks the cells against the exact sweep's ranking (by |value|).

    spearman: Spearman's rank correlation of the two (L·C,) value tables (signed values);
    recall: of the exact sweep's ``k`` largest cells by |value|, the share among the estimate's
    ``k`` largest; k the number of cells compared.
    """

    spearman: float
    recall: float
    k: int


def _ranks(x: Tensor) -> Tensor:
    """Ranks 0..n-1 of a 1-d tensor, ties broken by position (float values rarely tie)."""
    r = torch.empty(x.numel(), dtype=torch.float64)
    r[x.argsort(stable=True)] = torch.arange(x.numel(), dtype=torch.float64)
    return r


def agreement(estimate: Tensor, exact: Tensor, k: int = 10) -> Agreement:
    """Spearman's rank correlation between two tables of cell values of the same shape, and the
    top-``k`` recall of the exact table's largest cells (by magnitude) among the estimate's."""
    if estimate.shape != exact.shape:
        raise InputError(f"an estimate of shape {tuple(estimate.shape)} cannot be compared with a sweep "
                         f"of shape {tuple(exact.shape)}")
    e, x = estimate.flatten().double(), exact.flatten().double()
    k = max(1, min(k, e.numel()))
    re, rx = _ranks(e), _ranks(x)
    re, rx = re - re.mean(), rx - rx.mean()
    denom = float((re.square().sum() * rx.square().sum()).sqrt())
    rho = float((re * rx).sum()) / denom if denom > 0 else float("nan")
    top_e = set(e.abs().topk(k).indices.tolist())
    top_x = set(x.abs().topk(k).indices.tolist())
    return Agreement(rho, len(top_e & top_x) / k, k)


def _run(model, ids: list[int], grad: bool, drop: list[int] | None = None
         ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One forward pass recording each block's head outputs z (1, T, H·Dh) and entering stream
    (1, T, dim) as they are in the graph (not detached: the backward pass reads them). ``drop``:
    a one-element list naming the layer whose attention and MLP outputs pass no gradient back
    (GradDrop: read at each backward pass; -1 drops none)."""
    z: list[Tensor | None] = [None] * len(blocks(model))
    resid: list[Tensor | None] = [None] * len(blocks(model))
    handles = []
    for i, block in enumerate(blocks(model)):
        def keep_z(mod, args, i=i):
            z[i] = args[0]

        def keep_resid(mod, args, i=i):
            x = args[0]
            if grad and not x.requires_grad:  # weights loaded without gradients: the stream is the leaf
                x = x.detach().requires_grad_(True)
            resid[i] = x
            return (x, *args[1:])

        def dropped(mod, args, out, i=i):
            t = out[0] if isinstance(out, tuple) else out  # attention: (out, weights); MLP: out
            if drop is not None and t.requires_grad:
                t.register_hook(lambda g, i=i: torch.zeros_like(g) if drop[0] == i else g)

        handles += [block.attn.out_proj.register_forward_pre_hook(keep_z),
                    block.register_forward_pre_hook(keep_resid),
                    block.attn.register_forward_hook(dropped), block.mlp.register_forward_hook(dropped)]
    try:
        with torch.set_grad_enabled(grad):
            logits, _ = forward(model, torch.tensor([ids], device=device_of(model)))
    finally:
        for h in handles:
            h.remove()
    if any(t is None for t in z + resid):
        raise RuntimeError(f"{type(model).__name__} did not run every block")
    return logits, z, resid  # type: ignore[return-value]


def attribution_patch(lm: TextModel, clean: str | list[int], corrupt: str | list[int], site: str = "head",
                      answer: str | int | None = None, wrong: str | int | None = None,
                      grad_drop: bool = False) -> PatchEstimate:
    """Estimate :func:`qkv.lens.patch` (same arguments, same normalisation) for every cell of
    ``site`` at once: a clean forward pass, a corrupt one with gradients, one backward pass of
    the logit difference, and a dot product per cell (see the module's text). The model must
    hold float weights (``--weights fp32`` or bf16: the quantised kernels have no gradient).

    ``grad_drop``: also AtP*'s GradDrop (Kramár et al. 2024, §3.3), against cancellation, where a
    cell's direct and indirect effects offset each other and plain AtP sees ~0: one more backward
    pass per layer l with the gradient through l's attention and MLP outputs dropped, and
    :attr:`PatchEstimate.grad_drop` = the mean over l of |the estimate with l dropped| (a cell's
    own layer's pass, where it gets no gradient, left out), normalised by |LD_clean - LD_corrupt|:
    a magnitude, to rank cells by, not a signed value."""
    check_decoder(lm, "attribution patching towards an answer")
    if site not in SITES:
        raise InputError(f"site must be 'head' (layer x head) or 'resid' (layer x position), got {site!r}")
    model = lm.model
    if any(isinstance(m, QUANTISED) for m in model.modules()):
        raise InputError(f"attribution patching needs gradients, which {lm.name}'s quantised weights do not "
                         "have: load it with float weights (--weights fp32)")
    c_ids, k_ids = prompt_pair(lm, clean, corrupt)
    t0 = time.perf_counter()
    out_c, z_c, r_c = _run(model, c_ids, grad=False)
    drop = [-1]
    out_k, z_k, r_k = _run(model, k_ids, grad=True, drop=drop)
    a, b = answer_pair(lm, out_c[0, -1], out_k[0, -1], answer, wrong)
    metric = out_k[0, -1, a] - out_k[0, -1, b]
    acts_k = z_k if site == "head" else r_k
    acts_c = z_c if site == "head" else r_c
    L, H, Dh = shape(model)

    def estimate(retain: bool) -> Tensor:  # (L, H) or (L, T) float64: (a_clean - a_corrupt) · ∂M/∂a
        grads = torch.autograd.grad(metric, acts_k, retain_graph=retain)
        rows = []
        with torch.no_grad():
            for ac, ak, g in zip(acts_c, acts_k, grads, strict=True):
                prod = (ac.detach().double() - ak.detach().double()) * g.double()  # (1, T, H·Dh or dim)
                rows.append(prod[0].view(-1, H, Dh).sum((0, 2)) if site == "head" else prod[0].sum(-1))
        return torch.stack(rows)

    delta = estimate(retain=grad_drop).float()  # (L, H) or (L, T)
    gd = None
    if grad_drop:
        total = torch.zeros(delta.shape, dtype=torch.float64)
        for layer in range(L):
            drop[0] = layer
            total += estimate(retain=layer < L - 1).abs()
        drop[0] = -1
        # each cell of layer l got no gradient in the pass dropping l: the mean over the others
        # (a stream cell entering l still gets one from the skip connection: over all L for it)
        gd = (total / (max(1, L - 1) if site == "head" else L)).float()  # one layer: its cells get none
    seconds = time.perf_counter() - t0
    ld_c = float(out_c[0, -1, a] - out_c[0, -1, b])
    ld_k = float(metric.detach())
    span = ld_c - ld_k
    values = delta / span if span != 0 else torch.full_like(delta, float("nan"))
    if gd is not None:
        gd = gd / abs(span) if span != 0 else torch.full_like(gd, float("nan"))
    dec = lm.tokenizer.decode
    return PatchEstimate(site, labels(lm, c_ids), labels(lm, k_ids), dec([a]), dec([b]), ld_c, ld_k,
                         values, delta, seconds, gd)
