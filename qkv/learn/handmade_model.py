"""The model the build-the-weights-by-hand exercises (:mod:`qkv.learn.handmade`) set by hand, and
the two ways their checks read it.

The model is the one of Elhage et al. 2021 ("A Mathematical Framework for Transformer Circuits"):
residual stream x_i = W_E[t_i] + W_pos[i]; each head adds softmax((x W_Q)(x W_K)ᵀ/√d_head) x W_V W_O
under a causal mask; logits = x W_U (CS189 Lec 22: attention is the only cross-token mixing; with
no MLP and no LayerNorm, softmax is the only non-linearity). Here:

- :func:`read_weights`: the student's answer (a dict or an object with W_E, W_pos, ...) as a
  :class:`Hand` in float64, CheckError naming the first matrix missing or of the wrong shape;
- :func:`forward`: that model in float64, written out (the reference the checks measure
  patterns and predictions with);
- :func:`qkv_gpt` and :func:`lens_scores`: a real qkv GPT (``--mlp none``) holding the weights,
  scored by qkv's own lens (:func:`qkv.lens.heads.score_model`), which must name the intended
  head after its job (:func:`need_lens`).

Shapes: B sequences, T tokens, V vocabulary, N context (n_ctx), D d_model, L layers, H heads,
Dh d_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qkv.learn.exercise import CheckError, gen

if TYPE_CHECKING:
    from qkv.lens.heads import HeadScores

NEED = 0.9  # the share of a query's attention the intended keys must get, every query


@dataclass(frozen=True)
class Hand:
    """The student's weights in float64, with every head's matrices stacked (L, H, ...)."""

    W_E: Tensor  # (V, D)
    W_pos: Tensor  # (N, D)
    W_Q: Tensor  # (L, H, D, Dh)
    W_K: Tensor  # (L, H, D, Dh)
    W_V: Tensor  # (L, H, D, Dh)
    W_O: Tensor  # (L, H, Dh, D)
    W_U: Tensor  # (D, V)

    @property
    def n_layers(self) -> int:
        return self.W_Q.shape[0]


def _matrix(got: Any, name: str) -> Tensor | None:
    """The student's ``name`` (a dict entry or an attribute) in float64, None when absent."""
    value = got.get(name) if isinstance(got, dict) else getattr(got, name, None)
    if value is None:
        return None
    try:
        return torch.as_tensor(value).detach().to(torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise CheckError(f"{name} should be a tensor, got {type(value).__name__}") from None


def _stacked(m: Tensor, name: str, n_layers: int) -> Tensor:
    """W_Q, W_K, W_V or W_O as (n_layers, n_heads, ., .): one head of a one-layer model may be a
    matrix, the heads of a one-layer model a (n_heads, ., .) tensor."""
    shown = tuple(m.shape)
    if m.ndim == 2:
        m = m[None, None]
    elif m.ndim == 3 and n_layers == 1:
        m = m[None]
    if m.ndim != 4 or m.shape[0] != n_layers:
        dims = "d_head, d_model" if name == "W_O" else "d_model, d_head"
        raise CheckError(f"{name} has shape {shown}: expected (n_layers={n_layers}, n_heads, {dims})")
    return m


def read_weights(got: Any, vocab: int, n_ctx: int, d_model: int, n_layers: int) -> Hand:
    """The student's answer (a dict, or anything with attributes W_E, W_pos, ...) as a
    :class:`Hand`; CheckError naming the first matrix that is missing or of the wrong shape."""
    if got is None:
        raise CheckError("it returned None: return a dict {'W_E': ..., 'W_pos': ..., 'W_Q': ..., ...}")
    mats = {name: _matrix(got, name) for name in ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_U")}
    need: dict[str, Tensor] = {}
    for name in ("W_E", "W_pos", "W_Q", "W_K"):
        m = mats[name]
        if m is None:
            raise CheckError(f"no {name} in what it returned: the answer needs W_E, W_pos, W_Q and W_K "
                             "(W_V, W_O, W_U may be left out where they do not matter: zeros then)")
        need[name] = m
    for name, shape in (("W_E", (vocab, d_model)), ("W_pos", (n_ctx, d_model))):
        if tuple(need[name].shape) != shape:
            raise CheckError(f"{name} has shape {tuple(need[name].shape)}, expected {shape} for "
                             f"vocab={vocab}, n_ctx={n_ctx}, d_model={d_model}")
    W_Q = _stacked(need["W_Q"], "W_Q", n_layers)
    L, H, _, Dh = W_Q.shape
    heads = {}
    for name, shape in (("W_Q", (L, H, d_model, Dh)), ("W_K", (L, H, d_model, Dh)),
                        ("W_V", (L, H, d_model, Dh)), ("W_O", (L, H, Dh, d_model))):
        given = mats[name]
        m = torch.zeros(shape, dtype=torch.float64) if given is None else _stacked(given, name, n_layers)
        if tuple(m.shape) != shape:
            dims = "d_head, d_model" if name == "W_O" else "d_model, d_head"
            raise CheckError(f"{name} has shape {tuple(m.shape)}, expected {shape} (n_layers, n_heads, "
                             f"{dims}) with d_model={d_model} and d_head={Dh} (W_Q's last dimension)")
        heads[name] = m
    W_U = mats["W_U"]
    W_U = torch.zeros(d_model, vocab, dtype=torch.float64) if W_U is None else W_U
    if tuple(W_U.shape) != (d_model, vocab):
        raise CheckError(f"W_U has shape {tuple(W_U.shape)}, expected (d_model, vocab) = {(d_model, vocab)}")
    hand = Hand(need["W_E"], need["W_pos"], heads["W_Q"], heads["W_K"], heads["W_V"], heads["W_O"], W_U)
    for name in ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_U"):
        if not torch.isfinite(getattr(hand, name)).all():
            raise CheckError(f"{name} holds inf or NaN: use a large finite scale (e.g. 20·√d_head), not inf")
    return hand


@dataclass(frozen=True)
class Forward:
    """What the model does on (B, T) tokens: per layer the scores (B, H, T, T) after / √d_head
    (-inf above the diagonal), the patterns and each head's output z (B, H, T, Dh), and the
    logits (B, T, V)."""

    scores: list[Tensor]
    patterns: list[Tensor]
    logits: Tensor
    z: list[Tensor]


def forward(w: Hand, tokens: Tensor) -> Forward:
    """The model of the stubs, in float64, written out (not qkv's GPT: the reference)."""
    T = tokens.shape[1]
    x = w.W_E[tokens] + w.W_pos[:T]  # (B, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores, patterns, zs = [], [], []
    for layer in range(w.n_layers):
        q = torch.einsum("btd,hde->bhte", x, w.W_Q[layer])
        k = torch.einsum("btd,hde->bhte", x, w.W_K[layer])
        v = torch.einsum("btd,hde->bhte", x, w.W_V[layer])
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~causal, -math.inf)
        a = torch.softmax(s, dim=-1)
        z = a @ v  # (B, H, T, Dh)
        x = x + torch.einsum("bhte,hed->btd", z, w.W_O[layer])  # every head reads the same x
        scores.append(s)
        patterns.append(a)
        zs.append(z)
    return Forward(scores, patterns, x @ w.W_U, zs)


def qkv_gpt(w: Hand) -> nn.Module:
    """A real qkv GPT (attention only, ``--mlp none``, no biases, learned positions, float64)
    holding the student's weights (:func:`qkv.lens.planted.attention_only_gpt`: its LayerNorms are
    identities, as the stubs' model, Elhage et al. 2021, has none)."""
    from qkv.lens.planted import attention_only_gpt

    return attention_only_gpt(w.W_E, w.W_pos, w.W_Q, w.W_K, w.W_V, w.W_O, w.W_U)


def lens_scores(w: Hand, seed: int) -> tuple[HeadScores, int]:
    """qkv's lens on the student's model: :func:`qkv.lens.heads.score_model` on 8 random
    sequences of R tokens written twice (R = min(n_ctx / 2, vocab): no token twice in a half)."""
    from qkv.lens.heads import repeated_tokens, score_model

    V, N = w.W_E.shape[0], w.W_pos.shape[0]
    R = min(N // 2, V)
    drawn = int(torch.randint(2**31 - 1, (1,), generator=gen(seed)))
    return score_model(qkv_gpt(w), repeated_tokens(V, R, batch=8, seed=drawn)), R


def lens_says(scores: HeadScores, layer: int, head: int) -> str:
    """What the lens says of head ``layer.head``: its four scores and the type it names."""
    values = ", ".join(f"{t} {float(getattr(scores, t)[layer, head]):.2f}"
                       for t in ("previous", "first", "duplicate", "induction"))
    label = scores.labels[layer][head] or "no type"
    return f"qkv's lens (qkv.lens.score_model) scores head {layer}.{head}: {values}; it names it {label!r}"


def need_lens(w: Hand, layer: int, head: int, kind: str, what: str, seed: int) -> None:
    """CheckError unless the lens names head ``layer.head`` ``kind`` with a score ≥ NEED."""
    scores, R = lens_scores(w, seed)
    got = float(getattr(scores, kind)[layer, head])
    if scores.labels[layer][head] != kind or got < NEED:
        raise CheckError(f"{lens_says(scores, layer, head)} (on 8 random sequences of {R} tokens written "
                         f"twice): a {what} should score ≥ {NEED} as {kind!r}, and that its highest")

