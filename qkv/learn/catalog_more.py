"""More exercises: hardmax, the soft dictionary, grouped-query attention, attention in key tiles
with an online softmax (FlashAttention's recurrence), a ViT's patches, attribution patching by
hand, and predicting which heads attribution patching picks (then the check reveals its tables).
Same rules as :mod:`qkv.learn.catalog`: independent references, small inputs first, a diagnosis
for a recognised mistake."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from qkv.learn.exercise import CheckError, Exercise, check, close, forbid, gen, gradcheck, randn, show
from qkv.learn.handmade_model import Hand, forward, qkv_gpt

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


# --------------------------------------------------------------------------- which heads it will pick

Pair = tuple[int, int]  # (layer, head)
WEIGHTS = ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_U")
PUSH = 0.25  # what the first-token decoy writes into the answer's column (x W_U's 8: +2 to LD)
SIZES = ((8, 12, 4), (8, 12, 3), (10, 14, 5), (7, 11, 4))  # (vocab, n_ctx, heads a layer) per model
PATTERN = "an attention pattern says where a head reads, not whether anything reads what it writes"


@dataclass(frozen=True)
class Revealed:
    """One planted induction model with decoys, each layer's heads shuffled, and what qkv's lens
    says of it: the weights (float64), each head's role, the prompt pair, and (L, H) tables:
    ``estimate`` (attribution patching) and ``exact`` (activation patching), normalised (1 = as
    clean, 0 = as corrupt), and ``direct`` (each head's direct logit attribution on the clean
    prompt, in logits). ``top``: the estimate's two largest |values|, which are the circuit's."""

    weights: Hand
    roles: dict[Pair, str]  # "previous", "induction", "quiet", "duplicate", "first", "distractor"
    clean: list[int]
    corrupt: list[int]
    answer: int
    wrong: int
    estimate: Tensor
    exact: Tensor
    direct: Tensor
    top: frozenset[Pair]

    def head(self, role: str) -> Pair:
        return next(p for p, r in self.roles.items() if r == role)


def _read_hand(model: torch.nn.Module) -> Hand:
    """The weights of an attention-only qkv GPT laid out as :func:`qkv_gpt` lays them out (no
    biases, learned positions), read back as a :class:`Hand` (float64 copies)."""
    H, Dh, D = model.cfg.n_heads, model.cfg.head_dim, model.cfg.dim
    layers = []
    for block in model.stack.blocks:
        q, k, v = block.attn.qkv.weight.detach().double().split(H * Dh)  # (H·Dh, D) each: head h's rows W[h]ᵀ
        o = block.attn.out_proj.weight.detach().double().T  # (H·Dh, D): concat(z) @ W_O
        layers.append([m.reshape(H, Dh, D).transpose(1, 2) for m in (q, k, v)] + [o.reshape(H, Dh, D)])
    W_Q, W_K, W_V, W_O = (torch.stack(ms).clone() for ms in zip(*layers, strict=True))
    W_E, W_pos = (e.weight.detach().double().clone() for e in (model.tok_emb, model.pos_emb))
    return Hand(W_E, W_pos, W_Q, W_K, W_V, W_O, model.lm_head.weight.detach().double().T.clone())


def _with_decoys(w: Hand, vocab: int, n_ctx: int, answer: int) -> Hand:
    """planted.induction's weights with three decoys in place of distractors: head 0.1 a second
    previous-token head and head 1.1 a duplicate-token head, both attending sharply and writing
    nothing (W_O = 0), and head 1.2 a first-token head writing toward the answer, the same on
    every prompt. Columns as planted's: positions, tokens, previous token, answer."""
    from qkv.lens.planted import BIG

    tok, ans = n_ctx, n_ctx + 2 * vocab
    W_Q, W_K, W_V, W_O = (m.clone() for m in (w.W_Q, w.W_K, w.W_V, w.W_O))
    s = BIG * math.sqrt(W_Q.shape[-1])
    eye = torch.eye(vocab, dtype=torch.float64)
    for m in (W_Q, W_K, W_V):
        m[0, 1] = m[0, 0]  # 0.1 attends and reads as 0.0 does ...
    W_O[0, 1] = 0.0  # ... and writes nothing
    for m in (W_Q, W_K, W_V, W_O):
        m[1, 1:3] = 0.0
    W_Q[1, 1, tok:tok + vocab, :vocab] = s * eye  # 1.1: token t looks for token t (earlier copies, itself)
    W_K[1, 1, tok:tok + vocab, :vocab] = eye
    W_V[1, 1, tok:tok + vocab, :vocab] = eye  # it reads the token; W_O = 0: it writes nothing
    W_Q[1, 2, :n_ctx, 0] = s  # 1.2: every position looks at position 0 ...
    W_K[1, 2, 0, 0] = 1.0
    W_V[1, 2, tok:tok + vocab, :vocab] = eye
    W_O[1, 2, :vocab, ans + answer] = PUSH  # ... and whatever token is there, pushes the answer
    return Hand(w.W_E, w.W_pos, W_Q, W_K, W_V, W_O, w.W_U)


def _orders(H: int, g: torch.Generator, decoy_first: bool) -> list[Tensor]:
    """Each layer's new order of heads (new head j = old head order[j]), drawn until the circuit
    is not at planted's (0, 0), (1, 0), reading the pairs as (head, layer) does not give the
    circuit back, and each silent decoy comes before its twin in the circuit iff ``decoy_first``
    (so that a pick by attention pattern, ties to the first, meets both cases)."""
    while True:
        orders = [torch.randperm(H, generator=g) for _ in range(2)]
        where = [o.argsort() for o in orders]  # where[l][old] = new index
        circuit = {(0, int(where[0][0])), (1, int(where[1][0]))}
        swapped = {(h, layer) for layer, h in circuit}
        first = [bool(where[layer][1] < where[layer][0]) for layer in range(2)]
        if circuit != {(0, 0), (1, 0)} and swapped != circuit and first == [decoy_first] * 2:
            return orders


def _top2(table: Tensor) -> frozenset[Pair]:
    H = table.shape[1]
    return frozenset((int(i) // H, int(i) % H) for i in table.flatten().abs().topk(2).indices)


def _direct(w: Hand, ids: list[int], answer: int, wrong: int) -> Tensor:
    """(L, H): what each head writes into LD at the last position of ``ids`` (direct logit
    attribution; the model has no final norm, so these are its exact parts)."""
    u = w.W_U[:, answer] - w.W_U[:, wrong]  # (D,): the direction LD reads
    zs = forward(w, torch.tensor([ids])).z  # per layer (1, H, T, Dh)
    return torch.stack([torch.einsum("he,hed,d->h", z[0, :, -1], w.W_O[layer], u)
                        for layer, z in enumerate(zs)])


@lru_cache(maxsize=32)
def _revealed(vocab: int, n_ctx: int, heads: int, seed: int, decoy_first: bool) -> Revealed:
    """:func:`qkv.lens.planted.induction` with decoys and shuffled heads, and the lens's tables."""
    from qkv.lens import attribution_patch, patch
    from qkv.lens.planted import Planted, induction

    p = induction(vocab, n_ctx, heads, seed=seed)
    orders = _orders(heads, torch.Generator().manual_seed(seed), decoy_first)
    w = _with_decoys(_read_hand(p.model), vocab, n_ctx, p.answer)
    w = Hand(w.W_E, w.W_pos, *(torch.stack([m[layer, orders[layer]] for layer in range(2)])
                               for m in (w.W_Q, w.W_K, w.W_V, w.W_O)), w.W_U)
    kinds = (("previous", "quiet"), ("induction", "duplicate", "first"))
    roles = {(layer, new): kinds[layer][old] if old < len(kinds[layer]) else "distractor"
             for layer in range(2) for new, old in enumerate(orders[layer].tolist())}
    model = qkv_gpt(w)
    with torch.no_grad():
        last = model(torch.tensor([p.corrupt])).logits[0, -1]
    wrong = int(last.masked_fill(torch.arange(vocab) == p.answer, -math.inf).argmax())  # corrupt's best but Y
    circuit = frozenset(pr for pr, r in roles.items() if r in ("previous", "induction"))
    lm = Planted(model, sorted(circuit), p.clean, p.corrupt, p.answer, wrong)
    estimate = attribution_patch(lm, p.clean, p.corrupt, site="head", answer=p.answer, wrong=wrong).values
    exact = patch(lm, p.clean, p.corrupt, site="head", answer=p.answer, wrong=wrong).values
    direct = _direct(w, p.clean, p.answer, wrong)
    for table, what in ((estimate, "attribution patching"), (exact, "activation patching")):
        if _top2(table) != circuit:  # the instance does not hold what the exercise promises
            raise RuntimeError(f"planted instance {(vocab, n_ctx, heads, seed)}: {what} ranks "
                               f"{sorted(_top2(table))} highest, not the circuit {sorted(circuit)}")
    return Revealed(w, roles, list(p.clean), list(p.corrupt), p.answer, wrong, estimate.double(),
                    exact.double(), direct.double(), circuit)


def _instances() -> list[Revealed]:
    """The models the check asks about (their seeds from :func:`gen`: a grader's are others)."""
    return [_revealed(V, N, H, int(torch.randint(10_000, (1,), generator=gen(70 + i))), i % 2 == 0)
            for i, (V, N, H) in enumerate(SIZES)]


def _pairs(got: Any) -> list[Pair]:
    """The student's answer as (layer, head) pairs; CheckError when it is not a list of pairs."""
    if got is None:
        raise CheckError("it returned None: return a list of two (layer, head) pairs, e.g. [(0, 2), (1, 3)]")
    try:
        return [(int(a), int(b)) for a, b in (got.tolist() if isinstance(got, Tensor) else got)]
    except (TypeError, ValueError):
        raise CheckError(f"it returned {show(got)}: return a list of two (layer, head) pairs of ints, "
                         "e.g. [(0, 2), (1, 3)]") from None


def _name(p: Pair) -> str:
    return f"{p[0]}.{p[1]}"


def _why(got: set[Pair], r: Revealed) -> list[str]:
    """What a wrong prediction missed or mistook, head by head."""
    prev, ind = r.head("previous"), r.head("induction")
    if {(h, layer) for layer, h in got} == r.top:
        return ["the pairs are (layer, head): yours are (head, layer)"]
    if got == {(0, 0), (1, 0)}:
        return ["(0, 0) and (1, 0) are where qkv.lens.planted.induction puts its circuit, but here each "
                "layer's heads are shuffled: read the weights"]
    why = []
    for p in sorted(got - r.top):
        role = r.roles.get(p)
        if role == "quiet":
            why.append(f"head {_name(p)} attends to the previous token exactly as head {_name(prev)} does, "
                       f"but its W_O is zero: it writes nothing, so ∂LD/∂z = 0 and its estimate is 0 "
                       f"({PATTERN})")
        elif role == "duplicate":
            why.append(f"head {_name(p)} attends to earlier copies of the current token, and its pattern "
                       "changes between the prompts (on the clean one the last token finds its earlier "
                       f"copy), but its W_O is zero: it writes nothing, so its estimate is 0 ({PATTERN})")
        elif role == "first":
            why.append(f"head {_name(p)} writes toward the answer (its direct logit attribution on the "
                       f"clean prompt is {float(r.direct[p]):+.2f}), but it attends to the first token, the "
                       "same in both prompts: z_clean − z_corrupt = 0, so patching it changes nothing, and "
                       "its estimate is 0")
        elif role == "distractor":
            why.append(f"head {_name(p)} is a distractor (random queries and keys, a small write into the "
                       f"answer's columns): its estimate is only {float(r.estimate[p]):+.3f}")
    if prev not in got:
        why.append(f"you miss head {_name(prev)}, the previous-token head: it writes nothing toward the "
                   f"answer itself, but the induction head {_name(ind)}'s keys read what it writes "
                   "(K-composition) and the corruption changes it; the gradient carries that indirect effect "
                   f"back (its estimate: {float(r.estimate[prev]):.2f})")
    if ind not in got:
        why.append(f"you miss head {_name(ind)}, the induction head: on the clean prompt it copies the token "
                   "after the earlier X, on the corrupt one it finds none, and W_O W_U carry that straight "
                   f"into LD (its estimate: {float(r.estimate[ind]):.2f})")
    return why


def _reveal(r: Revealed) -> str:
    """The tables the prediction was about, and what they say."""
    def rows(t: Tensor) -> str:
        return "; ".join(f"layer {layer}: {[round(v, 3) + 0.0 for v in t[layer].tolist()]}"
                         for layer in range(t.shape[0]))

    prev, ind = r.head("previous"), r.head("induction")
    text = (f"\n        attribution patching (qkv.lens.attribution_patch, site='head') estimates "
            f"{rows(r.estimate)}\n        activation patching (qkv.lens.patch) measures {rows(r.exact)}"
            f"\n        (1 = as clean, 0 = as corrupt): the top 2 are {_name(prev)}, the previous-token "
            f"head, and {_name(ind)}, the induction head")
    if abs(float(r.estimate[prev] - r.exact[prev])) > 0.2:
        text += (f"; the estimate for {_name(prev)} ({float(r.estimate[prev]):.2f}) overshoots the patch "
                 f"({float(r.exact[prev]):.2f}): it is first order in the induction head's scores, which the "
                 "patch moves far past where its softmax is linear")
    return text


@check("the two heads attribution patching ranks highest, on 4 planted induction models with decoys "
       "(each layer's heads shuffled)")
def _predict_top(f) -> str:
    for r in _instances():
        L, H = r.estimate.shape
        got = _pairs(f({name: getattr(r.weights, name).clone() for name in WEIGHTS}, list(r.clean),
                       list(r.corrupt), r.answer, r.wrong))
        if set(got) == r.top and len(got) == 2:
            continue
        inputs = (f"{L} layers of {H} heads, clean {r.clean}, corrupt {r.corrupt}, answer {r.answer}, "
                  f"wrong {r.wrong}")
        outside = [p for p in got if not (0 <= p[0] < L and 0 <= p[1] < H)]
        if len(got) != 2 or len(set(got)) != 2:
            twice = " (one of them twice)" if len(set(got)) < len(got) else ""
            why = [f"it returned {len(got)} pair{'' if len(got) == 1 else 's'}{twice}: predict the two heads "
                   "that attribution patching ranks highest", *_why(set(got), r)]
        elif outside and {(h, layer) for layer, h in got} == r.top:
            why = [f"there is no head {outside[0]}: the pairs are (layer, head); yours are (head, layer)"]
        elif outside:
            why = [f"there is no head {outside[0]}: the model has {L} layers of {H} heads, as (layer, head)"]
        else:
            why = _why(set(got), r)
        raise CheckError(f"for {inputs}: you predict {sorted(got)}, attribution patching's top 2 are "
                         f"{sorted(r.top)}: {'; '.join(why)}{_reveal(r)}")
    first = _instances()[0]  # passed: reveal what the prediction was about (the first model)
    return (f"revealed, for the first model ({first.estimate.shape[0]} layers of {first.estimate.shape[1]} "
            f"heads), your {sorted(first.top)} as the lens computes them:{_reveal(first)}")


PREDICT_ATTRIBUTION = Exercise(
    name="predict_attribution_heads",
    section=S_HEADS,
    difficulty=3,
    signature="(weights, clean, corrupt, answer, wrong)",
    stub="""
Predict, then reveal: which two heads will attribution patching (Nanda 2023; your
attribution_patch_heads) rank highest on this model, by |estimate|? Reason from the weights; the
check runs qkv.lens.attribution_patch and qkv.lens.patch on the model and shows you both tables.

The model completes repeats, [… X Y … X] -> Y: a two-layer Transformer set by hand
(qkv.lens.planted.induction), with decoy heads beside its circuit and each layer's heads in a
shuffled order. Attention only, causal, no MLP, no LayerNorm, no biases (Elhage et al. 2021):

    x_i = W_E[t_i] + W_pos[i]                      the residual stream at position i, (d_model,)
    for each layer l, every head h reading the same x:
        q_i = x_i W_Q[l, h],  k_j = x_j W_K[l, h],  v_j = x_j W_V[l, h]               (d_head,)
        A[i, j] = softmax over j ≤ i of (q_i · k_j) / √d_head
        z_i = Σ_j A[i, j] v_j                      the head's output, the input of W_O
        x_i <- x_i + Σ_h z_i W_O[l, h]
    logits = x_last W_U

Args: weights, a dict of float64 tensors: W_E (vocab, d_model), W_pos (n_ctx, d_model), W_Q,
W_K, W_V (n_layers, n_heads, d_model, d_head), W_O (n_layers, n_heads, d_head, d_model), W_U
(d_model, vocab); clean, corrupt: lists of token ids of the same length (corrupt: the earlier X
replaced); answer, wrong: token ids. The metric is LD = logit[answer] − logit[wrong] at the last
position; attribution patching estimates what patching each head's clean output into the
corrupt run does to it:

    Δ(l, h) ≈ Σ_t (z_clean − z_corrupt)[t] · ∂LD/∂z[t]      (the gradient at the corrupt run)

Returns a list of two (layer, head) pairs in any order (a list: a set cannot cross to the check).
Example: [(0, 2), (1, 3)] predicts head 2 of layer 0 and head 3 of layer 1. Do not take a gradient
(grad, backward): running attribution patching is the check's job, predicting it yours.
""",
    checks=(_predict_top, forbid("grad", "backward")),
    hints=(
        "A head's estimate needs both an output that changes between the prompts (z_clean − z_corrupt ≠ 0) "
        "and a path from that output to LD (∂LD/∂z ≠ 0). A sharp attention pattern is neither.",
        "Run the model by hand on both prompts, keeping each head's z. In the last layer the path is direct: "
        "Δz at the last position @ W_O[l, h] @ (W_U[:, answer] − W_U[:, wrong]).",
        "Layer 0 reaches LD only through layer 1: which layer-0 head's change of the stream, Δz @ W_O[0, h], "
        "does the layer-1 head you found read through its W_K (K-composition), W_Q or W_V?",
    ),
    see="qkv lens smollm2 --patch --estimate --compare",
    forbidden=("grad", "backward"),
    solution="""
def predict_attribution_heads(weights, clean, corrupt, answer, wrong):
    W = weights
    L = W["W_Q"].shape[0]

    def outputs(tokens):  # each layer's head outputs z, (H, T, d_head)
        T = len(tokens)
        x = W["W_E"][tokens] + W["W_pos"][:T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        zs = []
        for layer in range(L):
            q, k, v = (torch.einsum("td,hde->hte", x, W[m][layer]) for m in ("W_Q", "W_K", "W_V"))
            s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~causal, -math.inf)
            z = torch.softmax(s, dim=-1) @ v
            x = x + torch.einsum("hte,hed->td", z, W["W_O"][layer])
            zs.append(z)
        return zs

    zc, zk = outputs(clean), outputs(corrupt)
    u = W["W_U"][:, answer] - W["W_U"][:, wrong]  # the direction LD reads
    direct = torch.einsum("he,hed,d->h", zc[-1][:, -1] - zk[-1][:, -1], W["W_O"][-1], u)
    last = int(direct.abs().argmax())
    change = torch.einsum("hte,hed->htd", zc[0] - zk[0], W["W_O"][0])  # what each layer-0 head changes
    read = sum((change @ W[m][-1, last]).flatten(1).norm(dim=1) for m in ("W_Q", "W_K", "W_V"))
    return [(0, int(read.argmax())), (L - 1, last)]
""",
)


MORE = (HARDMAX, SOFT_LOOKUP, GQA, ONLINE, PATCHIFY, ATTRIBUTION_HEADS, PREDICT_ATTRIBUTION)
