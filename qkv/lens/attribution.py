"""Direct logit attribution: how much each head, each MLP and the embeddings write towards one
answer (or towards it and away from a wrong one), read straight off the residual stream.

In a pre-LN Transformer the last stream is a sum, r = embed + Σ_layers (Σ_heads head + attn bias
+ mlp), and the logit difference is (W_U[a] − W_U[b]) · norm(r). The norm is not linear, so, as
is the convention (Elhage et al. 2021; TransformerLens's ``apply_ln``), its scale is **frozen at
its value on this text**: LayerNorm's norm(r) = (r − mean r) / s · γ + β with s fixed is linear
in r, and so is RMSNorm's r / s · γ. Each part c then contributes ((c − mean c) / s · γ) · d (no
centring for RMSNorm), the norm's β and the head's bias give a constant, and the parts sum to
the model's own logit difference exactly (to float rounding). A head's part is its output z_h
times its slice of W_O; "attn bias" is the rest of the attention sublayer's output (W_O's bias,
and for quantised weights the difference between their kernel and the dequantised matrix).

Shapes: L layers, H query heads, Dh head width, dim model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import InputError
from qkv.layers.norm import LayerNorm, RMSNorm
from qkv.lens.cache import ActivationCache, one_token, run_with_cache
from qkv.lens.hooks import TextModel, pre_ln, shape
from qkv.lens.predict import check_decoder


def weight_of(linear: nn.Module) -> Tensor:
    """(out, in) float64 matrix a linear layer multiplies by (dequantised where it is int8/int4)."""
    w = linear.dequantize() if hasattr(linear, "dequantize") else linear.weight
    return w.detach().double()


@dataclass
class Attribution:
    """Each part's direct contribution to ``total`` = logit[answer] − logit[wrong] (or the
    answer's logit alone) at the last position.

    names / values (N,): "embed", "L{l}H{h}" for every head, "L{l} attn bias", "L{l} mlp",
    "constant" (the final norm's bias and the head's bias); they sum to ``total``.
    heads: (L, H) and mlps: (L,) the same numbers arranged by layer.
    """

    tokens: list[str]
    answer: str
    wrong: str | None
    total: float
    names: list[str]
    values: Tensor
    heads: Tensor
    mlps: Tensor
    note: str = "final-norm scale frozen at its value on this text"


@torch.inference_mode()
def attribute(lm: TextModel, text: str | list[int] | ActivationCache, answer: str | int,
              wrong: str | int | None = None) -> Attribution:
    """Split the last position's logit difference between ``answer`` and ``wrong`` (each one
    token) into what each head, MLP and the embeddings wrote (see :class:`Attribution`);
    ``text`` may be a :class:`ActivationCache` of it (no second forward pass)."""
    check_decoder(lm, "logit attribution")
    model = lm.model
    if not pre_ln(model):
        raise InputError(f"{lm.name} normalises after each sublayer (post-LN): its last stream is not "
                         "a sum of the parts, so direct logit attribution does not apply")
    a = one_token(lm, answer)
    b = one_token(lm, wrong, "the wrong answer") if wrong is not None else None
    L, H, Dh = shape(model)
    cache = text if isinstance(text, ActivationCache) else run_with_cache(lm, text)
    last = cache.logits[-1].double()
    total = float(last[a] - (last[b] if b is not None else 0.0))

    w_u = weight_of(model.lm_head)
    direction = w_u[a] - (w_u[b] if b is not None else 0.0)  # (dim,): the unembedding's answer - wrong
    d = direction
    const = 0.0
    head_bias = getattr(model.lm_head, "bias", None)
    if head_bias is not None:
        const += float(head_bias[a] - (head_bias[b] if b is not None else 0.0))
    r = cache.resid_post[L - 1][-1].double()  # the last stream, before the final norm
    norm = model.stack.norm
    if isinstance(norm, LayerNorm):
        scale = torch.sqrt(r.var(unbiased=False) + norm.eps)
        d = d * norm.weight.double() / scale
        if norm.bias is not None:
            const += float(norm.bias.double() @ direction)
        center = True
    elif isinstance(norm, RMSNorm):
        d = d * norm.weight.double() / torch.sqrt(r.pow(2).mean() + norm.eps)
        center = False
    else:
        raise InputError(f"{lm.name}'s final norm ({type(norm).__name__}) is not one the lens knows")

    def part(c: Tensor) -> float:
        c = c.double()
        return float(((c - c.mean()) if center else c) @ d)

    names, values = ["embed"], [part(cache.resid_pre[0][-1])]
    heads, mlps = torch.zeros(L, H, dtype=torch.float64), torch.zeros(L, dtype=torch.float64)
    for layer, block in enumerate(model.stack.blocks):
        w_o = weight_of(block.attn.out_proj)  # (dim, H·Dh)
        z = cache.z[layer][-1].double()  # (H, Dh)
        per_head = torch.einsum("hd,ehd->he", z, w_o.view(-1, H, Dh))  # (H, dim): z_h W_O[:, h]ᵀ
        for h in range(H):
            heads[layer, h] = part(per_head[h])
            names.append(f"L{layer}H{h}")
            values.append(float(heads[layer, h]))
        names.append(f"L{layer} attn bias")
        values.append(part(cache.attn_out[layer][-1].double() - per_head.sum(0)))
        mlps[layer] = part(cache.mlp_out[layer][-1])
        names.append(f"L{layer} mlp")
        values.append(float(mlps[layer]))
    names.append("constant")
    values.append(const)
    dec = lm.tokenizer.decode
    return Attribution(cache.tokens, dec([a]), dec([b]) if b is not None else None, total, names,
                       torch.tensor(values), heads.float(), mlps.float())
