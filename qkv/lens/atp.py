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
entering block l at position t; "query" / "key" / "value" (L, H), one input of head h's attention
(every position; a key/value head shared by a group patched for head h's row alone). Metrics:
"diff" (the answer's logit minus the wrong one's), "prob" (the answer's probability), "loss" (its
cross-entropy). Values are normalised as :class:`~qkv.lens.Patching`'s: (M_estimated - M_corrupt)
/ (M_clean - M_corrupt), 0 = as corrupt, 1 = as clean.

AtP* (Kramár et al. 2024) fixes plain AtP's two false negatives: ``qk_fix`` computes the
change of a head's attention exactly when its queries or keys are patched (a saturated softmax
has a ~0 gradient however large the change of its pattern) and linearises only what follows;
``grad_drop`` repeats the backward pass with each layer's gradient dropped in turn, so
that a cell whose direct and indirect effects cancel still shows. Every site reduces to one
change of an activation per cell (Δz, or Δ of the stream) dotted with one gradient:

    head:            Δz = z_clean - z_corrupt
    query/key:       Δz = J_q (q_clean - q_corrupt)   (first order: plain AtP)
    query/key, QK fix / value:  Δz = z(q_clean, k, v) - z_corrupt   (the softmax exactly; value: linear)

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
from qkv.lens.causal import (
    PARTS,
    Metric,
    PatchPair,
    answer_pair,
    attend,
    check_site,
    head_parts,
    prompt_pair,
    substitute_z,
)
from qkv.lens.hooks import TextModel, blocks, device_of, forward, shape
from qkv.lens.predict import check_decoder

QUANTISED = (Int4Linear, Int4SwiGLU, Int8Linear, Q8Linear, TopKRefinedLinear)  # no gradient through them


def quantised(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a layer whose kernel has no gradient (int4 / int8): attribution
    patching and edge attribution refuse it."""
    return any(isinstance(m, QUANTISED) for m in model.modules())
SATURATED = 0.99  # a query row whose largest attention weight is at least this is saturated
CANCELS = 3.0  # GradDrop's magnitude this many times plain AtP's (and >= 0.1): a cancellation


@dataclass
class PatchEstimate(PatchPair):
    """Attribution patching's estimate of an activation patching sweep (see the module's text).

    values: (L, H) for the head sites, (L, T) for "resid": the estimated normalised metric, as
    :attr:`Patching.values <qkv.lens.Patching>`; ``delta``: the estimated change of the metric
    itself, Δa · ∂M/∂a. ``seconds``: the two forward passes and the backward passes.
    ``grad_drop`` (asked for): AtP*'s GradDrop magnitudes, same shape, ≥ 0. ``qk_fix``: whether
    query/key cells had their attention recomputed exactly; ``ig_steps``: the points the gradient
    was averaged over (0: the corrupt run's alone). ``peak`` (L, H, T): each head's largest
    attention weight in each query row of the corrupt run: a row at ≥ :data:`SATURATED` is a
    saturated softmax, whose gradient is ~0 however far the patch would move its pattern.
    """

    values: Tensor
    delta: Tensor
    seconds: float
    grad_drop: Tensor | None = None
    qk_fix: bool = False
    ig_steps: int = 0
    peak: Tensor | None = None

    def saturated(self) -> list[tuple[int, int]]:
        """Heads (layer, head) whose attention is saturated on the last row (the one the answer is
        read at) or on at least half of the rows after the first (which attends to one key)."""
        if self.peak is None:
            return []
        sat = self.peak >= SATURATED
        rows = sat[..., 1:].double().mean(-1) if sat.shape[-1] > 1 else torch.zeros(sat.shape[:2])
        return [(int(a), int(b)) for a, b in (sat[..., -1] | (rows >= 0.5)).nonzero().tolist()]

    def cancelling(self) -> list[tuple[int, int]]:
        """Cells (layer, column) whose GradDrop magnitude is ≥ :data:`CANCELS` × |plain AtP| and
        ≥ 0.1: direct and indirect effects that offset each other in the plain estimate."""
        if self.grad_drop is None:
            return []
        flag = (self.grad_drop >= 0.1) & (self.grad_drop >= CANCELS * self.values.abs())
        return [(int(a), int(b)) for a, b in flag.nonzero().tolist()]


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


@dataclass
class _Pass:
    """One forward pass as attribution patching reads it: the logits (1, T, V); per block the
    heads' outputs z (1, T, H·Dh), the entering stream (1, T, dim), the MLP's output (1, T, dim),
    and the last block's output (1, T, dim), in the graph (a backward pass reads them); what each
    block's attention and its MLP's norm read (1, T, dim), detached."""

    logits: Tensor
    z: list[Tensor]
    resid: list[Tensor]
    attn_in: list[Tensor]
    mlp_in: list[Tensor]
    mlp_out: list[Tensor]
    last: Tensor


def _run(model, ids: list[int], grad: bool, drop: list[int] | None = None, entering: Tensor | None = None
         ) -> _Pass:
    """One forward pass recording a :class:`_Pass`. ``drop``: a one-element list naming the
    layer whose attention and MLP outputs pass no gradient back (GradDrop: read at each backward
    pass; -1 drops none). ``entering``: the stream (1, T, dim) to enter block 0 with instead of
    the embedding of ``ids`` (integrated gradients' interpolated inputs)."""
    stack = blocks(model)
    n = len(stack)
    z, resid, attn_in, mlp_in, mlp_out = ([None] * n for _ in range(5))
    last: list[Tensor] = []
    handles = []
    for i, block in enumerate(stack):
        def keep(store: list, i: int = i, detach: bool = False):
            def hook(mod, args, out=None):
                t = args[0] if out is None else out
                store[i] = t.detach() if detach else t
            return hook

        def keep_resid(mod, args, i=i):
            x = args[0] if i or entering is None else entering.to(args[0].dtype)
            if grad and not x.requires_grad:  # weights loaded without gradients: the stream is the leaf
                x = x.detach().requires_grad_(True)
            resid[i] = x
            return (x, *args[1:])

        def dropped(mod, args, out, i=i):
            t = out[0] if isinstance(out, tuple) else out  # attention: (out, weights); MLP: out
            if drop is not None and t.requires_grad:
                t.register_hook(lambda g, i=i: torch.zeros_like(g) if drop[0] == i else g)

        handles += [block.attn.out_proj.register_forward_pre_hook(keep(z)),
                    block.attn.register_forward_pre_hook(keep(attn_in, detach=True)),
                    block.norm2.register_forward_pre_hook(keep(mlp_in, detach=True)),
                    block.register_forward_pre_hook(keep_resid),
                    block.attn.register_forward_hook(dropped), block.mlp.register_forward_hook(dropped),
                    block.mlp.register_forward_hook(keep(mlp_out))]
    handles.append(stack[-1].register_forward_hook(lambda mod, args, out: last.append(out.x)))
    try:
        with torch.set_grad_enabled(grad):
            logits, _ = forward(model, torch.tensor([ids], device=device_of(model)))
    finally:
        for h in handles:
            h.remove()
    if any(t is None for t in z + resid + attn_in + mlp_in + mlp_out) or not last:
        raise RuntimeError(f"{type(model).__name__} did not run every block")
    return _Pass(logits, z, resid, attn_in, mlp_in, mlp_out, last[0])  # type: ignore[arg-type]


def _first_order_z(model, layer: int, site: str, clean_in: Tensor, corrupt_in: Tensor) -> Tensor:
    """J·Δ: the first-order change of each head's output z (1, T, H, Dh), float64, when its
    queries (or keys) move from the corrupt run's to the clean run's: plain AtP's view of a
    query/key patch, through the softmax's gradient at the corrupt run. Keys are repeated per
    query head first, so that head h's slice moves with its own keys only."""
    qc, kc, _ = (t.double() for t in head_parts(model, layer, clean_in))
    qk, kk, vk = (t.double() for t in head_parts(model, layer, corrupt_in))
    G = qk.shape[1] // kk.shape[1]
    kc, kk, vk = (t.repeat_interleave(G, dim=1) for t in (kc, kk, vk))  # query head h reads h // G

    if site == "query":
        def f(q: Tensor) -> Tensor:
            return attend(model, layer, q, kk, vk)[0]
        _, dz = torch.func.jvp(f, (qk,), (qc - qk,))
    else:
        def g(k: Tensor) -> Tensor:
            return attend(model, layer, qk, k, vk)[0]
        _, dz = torch.func.jvp(g, (kk,), (kc - kk,))
    return dz


def _peak(model, layer: int, attn_in: Tensor) -> Tensor:
    """(H, T): each head's largest attention weight in each query row."""
    q, k, v = head_parts(model, layer, attn_in)
    return attend(model, layer, q, k, v, weights=True)[1][0].amax(-1)  # type: ignore[index]


def attribution_patch(lm: TextModel, clean: str | list[int], corrupt: str | list[int], site: str = "head",
                      answer: str | int | None = None, wrong: str | int | None = None,
                      grad_drop: bool = False, qk_fix: bool = False, ig_steps: int = 0,
                      metric: str = "diff") -> PatchEstimate:
    """Estimate :func:`qkv.lens.patch` (same arguments, same normalisation) for every cell of
    ``site`` at once: a clean forward pass, a corrupt one with gradients, one backward pass of
    the metric, and a dot product per cell (see the module's text). The model must hold float
    weights (``--weights fp32`` or bf16: the quantised kernels have no gradient).

    ``qk_fix`` (sites "query" and "key"): AtP*'s QK fix (Kramár et al. 2024): the head's
    attention recomputed exactly with the clean queries (keys), only the rest of the model
    linearised. ``grad_drop``: also AtP*'s GradDrop, against cancellation, where a
    cell's direct and indirect effects offset each other and plain AtP sees ~0: one more backward
    pass per layer l with the gradient through l's attention and MLP outputs dropped, and
    :attr:`PatchEstimate.grad_drop` = the mean over l of |the estimate with l dropped| (a cell's
    own layer's pass, where it gets no gradient, left out), normalised by |M_clean - M_corrupt|:
    a magnitude, to rank cells by, not a signed value.

    ``ig_steps`` = m > 0: integrated gradients (Sundararajan et al. 2017; as EAP-IG, Hanna et al.
    2024, does for edges): the gradient averaged over m more forward and backward passes whose
    stream enters block 0 at the midpoints e_corrupt + (j - ½)/m · (e_clean - e_corrupt), j = 1..m,
    instead of taken at the corrupt run alone: a softmax saturated in the corrupt run is not on the
    way, so effects that pass through it (an earlier head read by its keys) are seen."""
    check_decoder(lm, "attribution patching towards an answer")
    if ig_steps < 0:
        raise InputError(f"ig_steps is a number of interpolation points (0: none), got {ig_steps}")
    site = check_site(site)
    if qk_fix and site not in ("query", "key"):
        raise InputError(f"the QK fix recomputes a head's attention when its queries or keys are patched: "
                         f"use it with site 'query' or 'key' (site {site!r} needs none: a head's output, its "
                         "values and the stream enter the rest of the model directly)")
    model = lm.model
    if quantised(model):
        raise InputError(f"attribution patching needs gradients, which {lm.name}'s quantised weights do not "
                         "have: load it with float weights (--weights fp32)")
    c_ids, k_ids = prompt_pair(lm, clean, corrupt)
    t0 = time.perf_counter()
    run_c = _run(model, c_ids, grad=False)
    drop = [-1]
    run_k = _run(model, k_ids, grad=True, drop=drop)
    m: Metric = answer_pair(lm, run_c.logits[0, -1], run_k.logits[0, -1], answer, wrong, metric)
    value = m(run_k.logits[0, -1])
    L, H, Dh = shape(model)
    with torch.no_grad():
        if site == "resid":
            moved = [(c.detach().double() - k.detach().double())[0]
                     for c, k in zip(run_c.resid, run_k.resid, strict=True)]
        elif site == "head":
            moved = [(c.double() - k.detach().double())[0].view(-1, H, Dh)
                     for c, k in zip(run_c.z, run_k.z, strict=True)]
        elif site in PARTS and (qk_fix or site == "value"):  # the head's output recomputed exactly
            moved = [(substitute_z(model, i, site, run_c.attn_in[i], run_k.attn_in[i]).double()
                      - run_k.z[i].detach().double().view(1, -1, H, Dh))[0] for i in range(L)]
        else:
            moved = [_first_order_z(model, i, site, run_c.attn_in[i], run_k.attn_in[i])[0] for i in range(L)]
        peak = torch.stack([_peak(model, i, run_k.attn_in[i]) for i in range(L)]).float()
    acts = run_k.resid if site == "resid" else run_k.z

    def dot(grads: list[Tensor] | tuple[Tensor, ...]) -> Tensor:  # (L, H) or (L, T) float64: Δa · ∂M/∂a
        with torch.no_grad():
            if site == "resid":
                return torch.stack([(d * g[0].double()).sum(-1) for d, g in zip(moved, grads, strict=True)])
            return torch.stack([(d * g[0].double().view(-1, H, Dh)).sum((0, 2))
                                for d, g in zip(moved, grads, strict=True)])

    def estimate(retain: bool) -> Tensor:
        return dot(torch.autograd.grad(value, acts, retain_graph=retain))

    if ig_steps:
        e_c, e_k = run_c.resid[0].detach(), run_k.resid[0].detach()
        mean: list[Tensor] = [torch.zeros_like(a, dtype=torch.float64) for a in acts]
        for j in range(ig_steps):
            run = _run(model, k_ids, grad=True, entering=e_k + (j + 0.5) / ig_steps * (e_c - e_k))
            grads = torch.autograd.grad(m(run.logits[0, -1]), run.resid if site == "resid" else run.z)
            mean = [s + g.double() / ig_steps for s, g in zip(mean, grads, strict=True)]
        delta = dot(mean).float()
    else:
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
        gd = (total / (max(1, L - 1) if site != "resid" else L)).float()  # one layer: its cells get none
    seconds = time.perf_counter() - t0
    ld_c = float(m(run_c.logits[0, -1]))
    ld_k = float(value.detach())
    span = ld_c - ld_k
    values = delta / span if span != 0 else torch.full_like(delta, float("nan"))
    if gd is not None:
        gd = gd / abs(span) if span != 0 else torch.full_like(gd, float("nan"))
    dec = lm.tokenizer.decode
    return PatchEstimate(site, labels(lm, c_ids), labels(lm, k_ids), dec([m.answer]), dec([m.wrong]),
                         ld_c, ld_k, metric, values, delta, seconds, gd, qk_fix, ig_steps, peak)
