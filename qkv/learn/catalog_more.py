"""More exercises: hardmax, the soft dictionary, grouped-query attention, attention in key tiles
with an online softmax (FlashAttention's recurrence), and a ViT's patches. Same rules as
:mod:`qkv.learn.catalog`: independent references, small inputs first, a diagnosis for a
recognised mistake."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.learn.exercise import CheckError, Exercise, check, close, forbid, gradcheck, randn, show

# --------------------------------------------------------------------------- hardmax

S_CONTENT = "1 Content-based attention: hardmax vs softmax, inner-product retrieval"


def ref_hardmax(x: Tensor, dim: int = -1) -> Tensor:
    top = x == x.amax(dim=dim, keepdim=True)
    return (top.double() / top.sum(dim=dim, keepdim=True)).to(x.dtype)


@check("1 on the largest entry, 0 elsewhere, along the last dimension and along dim=0")
def _hard_values(f) -> None:
    for x, dim in ((torch.tensor([1.0, 3.0, 2.0]), -1), (randn(2, 5, seed=1), -1), (randn(4, 3, seed=2), 0)):
        close(
            f(x, dim=dim),
            ref_hardmax(x, dim),
            f"hardmax(x, dim={dim})",
            f"x = {show(x)}",
            causes=[
                (
                    torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
                    if dim == 0 and x.ndim == 2
                    else x,
                    "it always works on the last dimension: use the dim you are given",
                )
            ],
        )


@check("ties share the weight equally: hardmax([1, 1, 0]) = [0.5, 0.5, 0] (the lecture's soft dictionary)")
def _hard_ties(f) -> None:
    x = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    close(
        f(x),
        ref_hardmax(x),
        "hardmax(x)",
        f"x = {show(x)}",
        causes=[
            (
                torch.nn.functional.one_hot(x.argmax(-1), 3).float(),
                "argmax picks one of the tied entries; the "
                "lecture's hardmax gives each of the k tied entries 1/k",
            )
        ],
    )


HARDMAX = Exercise(
    name="hardmax",
    section=S_CONTENT,
    difficulty=1,
    signature="(x, dim=-1)",
    stub="""
The hardmax: weight 1 on the largest entry of x along ``dim``, 0 elsewhere; k entries tied for the
largest share it, 1/k each (so every slice sums to 1, like a softmax at infinite sharpness).

Example: hardmax(torch.tensor([1.0, 3.0, 2.0])) -> [0, 1, 0]; hardmax([1, 1, 0]) -> [0.5, 0.5, 0]
(CS189 Lec 21: an exact dictionary lookup is a hardmax over key matches.)
""",
    checks=(_hard_values, _hard_ties),
    hints=(
        "Compare x with x.amax(dim=dim, keepdim=True): True where an entry is a maximum.",
        "Divide that (as floats) by its sum along dim: ties share the weight.",
    ),
    see="qkv explain softmax",
    solution="""
def hardmax(x, dim=-1):
    top = (x == x.amax(dim=dim, keepdim=True)).to(x.dtype)
    return top / top.sum(dim=dim, keepdim=True)
""",
)


# --------------------------------------------------------------------------- the soft dictionary

S_LOOKUP = "2.4 Attention = a soft lookup table {A: 51, B: 42, C: 31}"


def ref_lookup(query: Tensor, keys: Tensor, values: Tensor, sharpness: float) -> Tensor:
    w = torch.softmax(sharpness * (keys.double() @ query.double()), -1)
    return (w @ values.double()).to(values.dtype)


@check("the lecture's dictionary: q = [0, 1, 0] returns ≈ 42, q = [1, 1, 0] ≈ 46.5 when sharp")
def _lookup_lecture(f) -> None:
    keys = torch.eye(3, dtype=torch.float64)
    values = torch.tensor([51.0, 42.0, 31.0], dtype=torch.float64)
    for q, s, want in (
        ([0.0, 1.0, 0.0], 1.0, 41.5761),
        ([0.0, 1.0, 0.0], 100.0, 42.0),
        ([1.0, 1.0, 0.0], 1.0, 44.0919),
        ([1.0, 1.0, 0.0], 100.0, 46.5),
    ):
        got = f(torch.tensor(q, dtype=torch.float64), keys, values, s)
        got_v = float(torch.as_tensor(got))
        if abs(got_v - want) > 1e-3:
            plain = float((torch.tensor(q, dtype=torch.float64) @ keys.T) @ values)
            why = (
                ": the scores are not passed through a softmax (weights must sum to 1)"
                if abs(got_v - plain) < 1e-6
                else ""
            )
            raise CheckError(f"soft_lookup(q={q}, sharpness={s}) = {got_v:.4f}, expected {want}{why}")


@check("random keys and values (vectors), against softmax(s · K q)ᵀ V")
def _lookup_random(f) -> None:
    q, keys, values = randn(4, seed=1), randn(6, 4, seed=2), randn(6, 3, seed=3)
    close(
        f(q, keys, values, 2.0),
        ref_lookup(q, keys, values, 2.0),
        "soft_lookup",
        "random q (4,), keys (6, 4), values (6, 3), sharpness 2",
        causes=[(ref_lookup(q, keys, values, 1.0), "the sharpness is not used: the scores are s · qᵀk_i")],
    )


SOFT_LOOKUP = Exercise(
    name="soft_lookup",
    section=S_LOOKUP,
    difficulty=1,
    signature="(query, keys, values, sharpness=1.0)",
    stub="""
Attention as a soft dictionary: score the query against every key by an inner product, turn the
scores into weights with a softmax, return the weighted average of the values.

    weights_i = softmax(sharpness · qᵀk_i),   answer = Σ_i weights_i · v_i

Args: query (d,), keys (n, d), values (n,) or (n, dv), sharpness s (an inverse temperature).
Returns a scalar tensor (values (n,)) or (dv,).

Example: keys = one-hot A, B, C, values [51, 42, 31]: the query [0, 1, 0] returns 41.58 at s = 1
and 42.00 at s = 100 (CS189 Lec 22: "attention = a soft lookup table").
""",
    checks=(_lookup_lecture, _lookup_random),
    hints=(
        "scores = keys @ query: one inner product per key, (n,).",
        "weights = torch.softmax(sharpness * scores, dim=0); answer = weights @ values.",
    ),
    see="qkv explain lookup",
    solution="""
def soft_lookup(query, keys, values, sharpness=1.0):
    weights = torch.softmax(sharpness * (keys @ query), dim=0)
    return weights @ values
""",
)


# --------------------------------------------------------------------------- grouped-query attention

S_GQA = "Multi-head attention, and its four matrix multiplications"


def ref_gqa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    H, K = q.shape[-3], k.shape[-3]
    idx = torch.arange(H) // (H // K)
    k, v = k[..., idx, :, :].double(), v[..., idx, :, :].double()
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, -1) @ v).to(q.dtype)


@check("H query heads over K key/value heads (GQA; K = 1 is MQA; K = H is MHA)")
def _gqa_values(f) -> None:
    for H, K in ((4, 2), (6, 3), (4, 1), (2, 2)):
        q, k, v = randn(2, H, 5, 8, seed=H), randn(2, K, 7, 8, seed=K + 10), randn(2, K, 7, 4, seed=K + 20)
        want = ref_gqa(q, k, v)
        idx = torch.arange(H) % K  # the heads dealt round-robin: a common mistake
        s = q @ k[:, idx].transpose(-1, -2) / math.sqrt(8)
        round_robin = torch.softmax(s, -1) @ v[:, idx]
        close(
            f(q, k, v),
            want,
            "grouped_query_attention(q, k, v)",
            f"H = {H} query heads, K = {K} key/value heads",
            causes=[
                (
                    round_robin,
                    "query head h shares key/value head h // (H / K), consecutive "
                    "heads forming a group (repeat_interleave), not h % K (repeat)",
                )
            ],
        )


GQA = Exercise(
    name="grouped_query_attention",
    section=S_GQA,
    difficulty=2,
    signature="(q, k, v)",
    stub="""
Grouped-query attention (Ainslie et al. 2023; SmolLM2 has 9 query heads over 3 key/value heads).

Args: q (B, H, T, d); k (B, K, S, d), v (B, K, S, dv) with K dividing H. Query head h reads
key/value head h // (H / K): heads 0..H/K-1 share key/value head 0, and so on. Returns
(B, H, T, dv) = softmax(q kᵀ / √d) v per query head (no mask). K = 1 is multi-query attention.
Do not call F.scaled_dot_product_attention (its enable_gqa would do it for you).

Example: q of shape (1, 2, 1, 2) with query heads [1, 0] and [0, 1], one key/value head with keys
[[1, 0], [0, 1]] and values [[1, 2], [3, 4]] -> [[1.6605, 2.6605]] for head 0, [[2.3395, 3.3395]]
for head 1.

(CS231N Lec 8, multi-head attention; the KV cache shrinks by H / K.)
""",
    checks=(_gqa_values, forbid("scaled_dot_product_attention")),
    hints=(
        "Repeat each key/value head H // K times along the head dimension: repeat_interleave(H // K, dim=1).",
        "Then it is ordinary attention per head: softmax(q @ k.transpose(-1, -2) / √d) @ v.",
    ),
    see="qkv explain heads",
    forbidden=("scaled_dot_product_attention",),
    solution="""
def grouped_query_attention(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v
""",
)


# --------------------------------------------------------------------------- online softmax

S_COST = "Cost: parameters O(d²) whatever n, compute O(n²); a 16K model on 1M tokens"


@check("equals softmax(qkᵀ/√d)v for tiles of 1, 3 and 64 keys (one tile, several, a ragged last one)")
def _online_values(f) -> None:
    q, k, v = randn(2, 5, 8, seed=1), randn(2, 10, 8, seed=2), randn(2, 10, 3, seed=3)
    want = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
    for tile in (1, 3, 64):
        close(
            f(q, k, v, tile),
            want,
            f"online_softmax_attention(q, k, v, tile={tile})",
            "q (2, 5, 8), k (2, 10, 8), v (2, 10, 3)",
        )


@check("large scores (q, k scaled by 30): no overflow; the running maximum rescales the sums")
def _online_large(f) -> None:
    q, k, v = randn(1, 4, 8, seed=4) * 30, randn(1, 9, 8, seed=5) * 30, randn(1, 9, 2, seed=6)
    want = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
    got = f(q, k, v, 4)
    if isinstance(got, Tensor) and not torch.isfinite(got).all():
        raise CheckError(
            "with scores in the hundreds the result has inf or NaN: keep a running maximum m per "
            "query, exponentiate scores − m, and when m grows rescale the running sums by exp(m_old − m_new)"
        )
    close(got, want, "online_softmax_attention", "large scores, tiles of 4", rtol=1e-6)


@check("its gradient (gradcheck, float64)")
def _online_grad(f) -> None:
    gradcheck(
        lambda a, b, c: f(a, b, c, 2),
        (randn(1, 3, 4, seed=1), randn(1, 5, 4, seed=2), randn(1, 5, 2, seed=3)),
        "online_softmax_attention",
    )


ONLINE = Exercise(
    name="online_softmax_attention",
    section=S_COST,
    difficulty=3,
    signature="(q, k, v, tile=64)",
    stub="""
Attention over the keys in tiles, with an online softmax (the recurrence of FlashAttention, Dao et
al. 2022): memory O(T · tile) instead of O(T · S), the same result as softmax(q kᵀ / √d) v.

Args: q (..., T, d), k (..., S, d), v (..., S, dv), tile: keys per step. For each tile j keep, per
query, the running maximum m, the running sum of exponentials l and the running output o:
    s = q k_jᵀ / √d;  m' = max(m, max s);  l' = l·e^(m − m') + Σ e^(s − m');
    o' = o·e^(m − m') + e^(s − m') v_j
and return o / l at the end. Do not call softmax on the whole score matrix.

Example: q = [[1, 0]], k = [[1, 0], [0, 1]], v = [[1, 2], [3, 4]], tile=1: after key 0, m = 0.7071,
l = 1, o = [1, 2]; after key 1, m stays, l = 1 + e^(-0.7071) = 1.4931, o = [2.4793, 3.9724];
o / l = [1.6605, 2.6605].

(CS189 Lec 22, the cost of attention: compute O(n²), but memory need not be.)
""",
    checks=(_online_values, _online_large, _online_grad, forbid("softmax", "scaled_dot_product_attention")),
    hints=(
        "Start with m = -inf, l = 0, o = 0 of shapes (..., T, 1), (..., T, 1), (..., T, dv).",
        "Per tile: m_new = torch.maximum(m, s.amax(-1, keepdim=True)); scale = torch.exp(m - m_new).",
        "l = l * scale + p.sum(-1, keepdim=True) with p = torch.exp(s - m_new); o = o * scale + p @ v_j.",
    ),
    see="qkv explain cost",
    forbidden=("softmax", "scaled_dot_product_attention"),
    solution="""
def online_softmax_attention(q, k, v, tile=64):
    T, S = q.shape[-2], k.shape[-2]
    m = q.new_full((*q.shape[:-1], 1), float("-inf"))
    l = q.new_zeros((*q.shape[:-1], 1))
    o = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    for j in range(0, S, tile):
        s = q @ k[..., j:j + tile, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        scale = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        l = l * scale + p.sum(-1, keepdim=True)
        o = o * scale + p @ v[..., j:j + tile, :]
        m = m_new
    return o / l
""",
)


# --------------------------------------------------------------------------- ViT patches

S_VIT = "Vision Transformer: patches, positions, blocks, pooling"


def ref_patchify(images: Tensor, p: int) -> Tensor:
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


@check("(B, C, H, W) -> (B, H/p · W/p, C·p·p), patches in reading order, each flattened (C, p, p)")
def _patch_values(f) -> None:
    for shape, p in (((1, 1, 4, 4), 2), ((2, 3, 6, 4), 2), ((1, 3, 8, 8), 4)):
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        B, C = shape[:2]
        naive = x.reshape(B, -1, C * p * p)  # cuts rows of pixels, not squares
        cols_first = ref_patchify(x.transpose(-1, -2), p)
        close(
            f(x, p),
            ref_patchify(x, p),
            f"patchify(x, {p})",
            f"x = arange of shape {shape}",
            causes=[
                (
                    naive,
                    "a plain reshape cuts runs of consecutive pixels (parts of rows), not p x p squares: "
                    "reshape to (B, C, H/p, p, W/p, p) and permute first",
                ),
                (
                    cols_first,
                    "the patches are in column order; reading order is row by row (the patch row first)",
                ),
            ],
        )


PATCHIFY = Exercise(
    name="patchify",
    section=S_VIT,
    difficulty=2,
    signature="(images, p)",
    stub="""
A Vision Transformer's first step (Dosovitskiy et al. 2021): cut each image into p x p patches and
flatten each into a vector, a token.

Args: images (B, C, H, W) with p dividing H and W. Returns (B, N, C·p·p), N = (H/p)·(W/p), patches
in reading order (left to right along the top row of patches, then the next row), each flattened
as (C, p, p) in that order (channel, then pixel row, then pixel column).

Example: a (1, 1, 4, 4) image of 0..15 with p = 2 -> patch 0 = [0, 1, 4, 5], patch 1 = [2, 3, 6, 7]
(CS231N Lec 8, "an image is worth 16x16 words").
""",
    checks=(_patch_values,),
    hints=(
        "images.reshape(B, C, H // p, p, W // p, p): split each side into (which patch, where in it).",
        "permute(0, 2, 4, 1, 3, 5) -> (B, patch row, patch column, C, p, p); then reshape(B, N, C * p * p).",
    ),
    see="qkv train vit --help",
    solution="""
def patchify(images, p):
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)
""",
)


# --------------------------------------------------------------------------- which head matters

S_HEADS = "3.1 Multi-head attention: h heads, concatenated, 3hd² vs 3d² parameters"


def ref_attribution(z_clean: Tensor, z_corrupt: Tensor, grad: Tensor) -> Tensor:
    return ((z_clean.double() - z_corrupt.double()) * grad.double()).sum((0, 2)).to(z_clean.dtype)


def _atp_inputs(T: int, H: int, D: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    return randn(T, H, D, seed=seed), randn(T, H, D, seed=seed + 1), randn(T, H, D, seed=seed + 2)


@check("each head's estimate, Σ over positions and dimensions of (z_clean − z_corrupt) · ∂LD/∂z")
def _atp_values(f) -> None:
    one = torch.tensor([[[1.0, 2.0], [0.0, 1.0]]])  # T = 1, H = 2, Dh = 2
    cases = [(one, torch.zeros_like(one), torch.tensor([[[0.5, 0.25], [3.0, -1.0]]])),
             _atp_inputs(5, 3, 4, seed=11), _atp_inputs(7, 9, 8, seed=21)]
    for zc, zk, g in cases:
        inputs = f"z_clean {show(zc)}, z_corrupt {show(zk)}, grad {show(g)}"
        close(f(zc, zk, g), ref_attribution(zc, zk, g), "attribution_patch_heads(z_clean, z_corrupt, grad)",
              inputs, causes=[
                  (ref_attribution(zk, zc, g), "the sign is turned: patching puts the clean activation into "
                   "the corrupt run, so the change is z_clean − z_corrupt"),
                  ((zc * g).sum((0, 2)), "the gradient multiplies the change of the activation "
                   "(z_clean − z_corrupt), not the clean activation itself"),
                  ((zc - zk).sum((0, 2)) * g.sum((0, 2)), "sum the products term by term; the product of "
                   "the sums is not the first-order change"),
              ])


@check("a head's estimate reads only its own slice: sum over positions and its own dimensions")
def _atp_heads_apart(f) -> None:
    zc, zk, g = _atp_inputs(4, 3, 3, seed=31)  # as many heads as dimensions: a wrong sum keeps the shape
    moved = zc.clone()
    moved[:, 1] += 1.0  # only head 1's clean output changes
    close(f(moved, zk, g), ref_attribution(moved, zk, g), "attribution_patch_heads(z_clean, z_corrupt, grad)",
          f"z_clean {show(moved)} (head 1 moved by 1), z_corrupt {show(zk)}, grad {show(g)}", causes=[
              (((moved - zk) * g).sum((0, 1)), "it sums over the heads (dim 1) and keeps the dimensions: "
               "sum over positions (dim 0) and each head's dimensions (dim 2) instead"),
          ])


ATTRIBUTION_HEADS = Exercise(
    name="attribution_patch_heads",
    section=S_HEADS,
    difficulty=1,
    signature="(z_clean, z_corrupt, grad)",
    stub="""
Attribution patching (Nanda 2023) for every head of one layer at once: the first-order estimate of
what patching head h's clean output into the corrupt run does to the logit difference LD,

    Δ_h ≈ Σ_t Σ_d (z_clean − z_corrupt)[t, h, d] · ∂LD/∂z[t, h, d]   (the gradient at the corrupt run)

Args: z_clean, z_corrupt (T, H, Dh): each head's output (the input of W_O, heads side by side) at
every position of the two runs; grad (T, H, Dh): ∂LD/∂z of the corrupt run. Returns (H,).

Example: T = 1, two heads of width 2, z_clean [[1, 2], [0, 1]], z_corrupt zeros, grad
[[0.5, 0.25], [3, -1]] -> [1.0, -1.0]. `qkv lens smollm2 --patch --corrupt ... --site head
--estimate --compare` computes it for all 270 heads and compares it with patching each one.
""",
    checks=(_atp_values, _atp_heads_apart),
    hints=(
        "The change a patch makes is z_clean − z_corrupt: multiply it by grad, element by element.",
        "Then sum over positions (dim 0) and over each head's dimensions (dim 2): .sum((0, 2)).",
    ),
    see="qkv lens smollm2 --patch --estimate --compare",
    solution="""
def attribution_patch_heads(z_clean, z_corrupt, grad):
    return ((z_clean - z_corrupt) * grad).sum((0, 2))
""",
)


MORE = (HARDMAX, SOFT_LOOKUP, GQA, ONLINE, PATCHIFY, ATTRIBUTION_HEADS)
