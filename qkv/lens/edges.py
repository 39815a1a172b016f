"""Edge attribution patching: which *paths* between heads and MLPs carry an answer, every edge
estimated from two forward passes and one backward pass.

    e = lens.edge_attribution(lm, clean, corrupt)           # EAP (Syed, Rager & Conmy 2023)
    e = lens.edge_attribution(lm, clean, corrupt, ig_steps=5)  # EAP-IG (Hanna et al. 2024)
    e.top(10)                                              # the ten strongest edges, signed

Every component of a pre-LN Transformer writes into the residual stream and every later one
reads the sum of what was written (Elhage et al. 2021, "A Mathematical Framework"): so an edge
u → r is u's write as the input of r alone. Patching that edge (r reads the corrupt stream plus
u's clean-minus-corrupt write; nothing else changes) is estimated to first order by

    edge(u → r) = Σ_t (out_u,clean - out_u,corrupt)[t] · ∂M/∂(r's input)[t]   at the corrupt run

Senders u: the embedding ("embed"), each head's write z_h W_O,h ("a3.1"), each MLP ("m3").
Receivers r: each head's query, key and value inputs ("a5.2.q", "a5.2.k", "a5.2.v": its own
row of a key/value head a group shares), each MLP ("m5"), and the output ("logits": the final
norm and unembedding). r's gradient is taken through r's own norm and projection only, so the
edges out of a sender sum to that sender's node estimate (:func:`qkv.lens.attribution_patch`):
the stream's gradient is the sum of its readers'. EAP-IG averages the receivers' gradients over
m inputs on the way from the corrupt to the clean prompt, as :func:`attribution_patch`'s
``ig_steps`` does for nodes; MIB (Mueller et al. 2025) found it among the most faithful methods.

Values are normalised like patching's, (M_edge - M_corrupt) / (M_clean - M_corrupt); an edge
whose sender runs after its receiver does not exist (NaN). Shapes: S senders, R receivers,
L layers, H query heads, T tokens, dim model width.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import InputError
from qkv.lens.atp import _Pass, _run, quantised
from qkv.lens.cache import labels
from qkv.lens.causal import Metric, PatchPair, answer_pair, attend, head_parts, prompt_pair
from qkv.lens.hooks import TextModel, blocks, pre_ln, shape
from qkv.lens.predict import check_decoder


@dataclass(frozen=True)
class Edge:
    """One edge: the sender's name, the receiver's, its normalised value."""

    sender: str
    receiver: str
    value: float


@dataclass
class Edges(PatchPair):
    """Edge attribution patching's estimate of every edge (see the module's text).

    senders (S,), receivers (R,): the components' names; values (S, R): the normalised estimate
    (NaN: no such edge); delta (S, R): the estimated change of the metric itself. ``seconds``:
    the forward and backward passes; ``ig_steps``: 0 for EAP, m for EAP-IG."""

    senders: list[str]
    receivers: list[str]
    values: Tensor
    delta: Tensor
    seconds: float
    ig_steps: int = 0

    def top(self, k: int = 10) -> list[Edge]:
        """The ``k`` edges of largest |value|, largest first."""
        flat = torch.nan_to_num(self.values.abs().flatten(), nan=-1.0)
        k = max(0, min(k, int((~self.values.isnan()).sum())))
        R = len(self.receivers)
        return [Edge(self.senders[int(i) // R], self.receivers[int(i) % R], float(self.values.flatten()[i]))
                for i in flat.topk(k).indices]

    def sent(self) -> Tensor:
        """(S,): each sender's edges summed: its node estimate (normalised)."""
        return torch.nan_to_num(self.values).sum(-1)


def _names(L: int, H: int, mlps: bool) -> tuple[list[str], list[str], Tensor]:
    """Senders, receivers, and the (S, R) mask of edges that exist (sender before receiver)."""
    senders, s_order = ["embed"], [-1]
    receivers, r_order = [], []
    for layer in range(L):
        senders += [f"a{layer}.{h}" for h in range(H)]
        s_order += [2 * layer] * H
        receivers += [f"a{layer}.{h}.{p}" for h in range(H) for p in "qkv"]
        r_order += [2 * layer] * (3 * H)
        if mlps:
            senders.append(f"m{layer}")
            s_order.append(2 * layer + 1)
            receivers.append(f"m{layer}")
            r_order.append(2 * layer + 1)
    receivers.append("logits")
    r_order.append(2 * L)
    exists = torch.tensor(s_order)[:, None] < torch.tensor(r_order)[None, :]
    return senders, receivers, exists


def _writes(model: nn.Module, run: _Pass, mlps: bool) -> Tensor:
    """(S, T, dim) float64: what each sender writes into the stream in a run (biases left out:
    the same in both runs, they cancel in the difference)."""
    H, Dh = shape(model)[1:]
    out = [run.resid[0][0].detach().double()[None]]
    for layer, block in enumerate(blocks(model)):
        W = block.attn.out_proj.weight.double().view(-1, H, Dh)  # (dim, H, Dh)
        z = run.z[layer][0].detach().double().view(-1, H, Dh)  # (T, H, Dh)
        out.append(torch.einsum("thd,ehd->hte", z, W))  # (H, T, dim)
        if mlps:
            out.append(run.mlp_out[layer][0].detach().double()[None])
    return torch.cat(out)


def _reads(model: nn.Module, ids: list[int], metric: Metric, mlps: bool, entering: Tensor | None = None
           ) -> Tensor:
    """(R, T, dim) float64: ∂M/∂(each receiver's input) in one run with gradients (``entering``:
    the stream to enter block 0 with instead of the embedding of ``ids``)."""
    L, H, _ = shape(model)
    run = _run(model, ids, grad=True, entering=entering)
    grads = torch.autograd.grad(metric(run.logits[0, -1]), run.z + (run.mlp_out if mlps else []) + [run.last])
    g_z, g_mlp, g_last = grads[:L], grads[L:L + L * mlps], grads[-1]
    reads = []
    for layer, block in enumerate(blocks(model)):
        x = run.resid[layer].detach()
        q, k, v = (t.detach() for t in head_parts(model, layer, block.norm1(x)))
        G = q.shape[1] // k.shape[1]
        q, k, v = (t.requires_grad_(True) for t in (q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)))
        with torch.enable_grad():
            zz = attend(model, layer, q, k, v)[0]  # (1, T, H, Dh)
            gq, gk, gv = torch.autograd.grad((zz * g_z[layer].view_as(zz)).sum(), (q, k, v))
            # one copy of the stream per receiver (head h's q, k, v), each read through its own slice
            xs = x.expand(3 * H, -1, -1).clone().requires_grad_(True)
            qs, ks, vs = head_parts(model, layer, block.norm1(xs))  # (3H, H, T, Dh), (3H, K, T, Dh)
            cq, ck, cv = torch.zeros_like(qs), torch.zeros_like(ks), torch.zeros_like(vs)
            for h in range(H):
                cq[3 * h, h] = gq[0, h]
                ck[3 * h + 1, h // G] = gk[0, h]
                cv[3 * h + 2, h // G] = gv[0, h]
            (g_heads,) = torch.autograd.grad((qs * cq).sum() + (ks * ck).sum() + (vs * cv).sum(), xs)
            reads.append(g_heads.double())
            if mlps:
                xm = run.mlp_in[layer].requires_grad_(True)
                (g_m,) = torch.autograd.grad(block.mlp(block.norm2(xm)), xm, g_mlp[layer])
                reads.append(g_m.double())
    reads.append(g_last.double())
    return torch.cat(reads).detach()


def edge_attribution(lm: TextModel, clean: str | list[int], corrupt: str | list[int],
                     answer: str | int | None = None, wrong: str | int | None = None, metric: str = "diff",
                     ig_steps: int = 0) -> Edges:
    """Estimate every edge between the embedding, the heads, the MLPs and the output (see the
    module's text): EAP from a clean pass, a corrupt pass and one backward pass (and a local
    backward pass a layer for the receivers' own gradients); with ``ig_steps`` = m > 0, EAP-IG:
    the receivers' gradients averaged at the m midpoints e_corrupt + (j - ½)/m (e_clean -
    e_corrupt) of the input. Arguments as :func:`qkv.lens.attribution_patch`; pre-LN decoders
    with float weights."""
    check_decoder(lm, "edge attribution towards an answer")
    model = lm.model
    if not pre_ln(model):
        raise InputError(f"edge attribution reads each component's input as the stream it normalises; "
                         f"{lm.name} normalises after the residual sum (post-LN): use attribution_patch")
    if quantised(model):
        raise InputError(f"edge attribution needs gradients, which {lm.name}'s quantised weights do not "
                         "have: load it with float weights (--weights fp32)")
    if ig_steps < 0:
        raise InputError(f"ig_steps is a number of interpolation points (0: none), got {ig_steps}")
    c_ids, k_ids = prompt_pair(lm, clean, corrupt)
    L, H, _ = shape(model)
    mlps = blocks(model)[0].cfg.mlp != "none"
    t0 = time.perf_counter()
    run_c, run_k = (_run(model, ids, grad=False) for ids in (c_ids, k_ids))
    last = [run_c.logits[0, -1], run_k.logits[0, -1]]
    m = answer_pair(lm, last[0], last[1], answer, wrong, metric)
    with torch.no_grad():
        moved = _writes(model, run_c, mlps) - _writes(model, run_k, mlps)  # (S, T, dim)
    if ig_steps:
        e_c, e_k = run_c.resid[0], run_k.resid[0]
        reads = sum(_reads(model, k_ids, m, mlps, e_k + (j + 0.5) / ig_steps * (e_c - e_k))
                    for j in range(ig_steps)) / ig_steps
    else:
        reads = _reads(model, k_ids, m, mlps)
    delta = moved.flatten(1) @ reads.flatten(1).T  # (S, R)
    senders, receivers, exists = _names(L, H, mlps)
    delta = delta.float().masked_fill(~exists, math.nan)
    seconds = time.perf_counter() - t0
    ld_c, ld_k = float(m(last[0])), float(m(last[1]))
    span = ld_c - ld_k
    values = delta / span if span != 0 else torch.full_like(delta, math.nan)
    dec = lm.tokenizer.decode
    return Edges("edges", labels(lm, c_ids), labels(lm, k_ids), dec([m.answer]), dec([m.wrong]), ld_c, ld_k,
                 metric, senders, receivers, values, delta, seconds, ig_steps)


__all__ = ["Edge", "Edges", "edge_attribution"]
