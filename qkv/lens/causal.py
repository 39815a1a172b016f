"""Cause and effect inside a Transformer: knock heads out, patch one prompt's activations into
another, and split a prediction into what each head and MLP wrote towards it.

    ablate(lm, text, heads=[(3, 1)])            # logits (T, V) with layer 3's head 1 zeroed
    head_effects(lm, text)                      # every head's effect on the loss, (L, H)
    patch(lm, clean, corrupt, site="resid")     # (L, T): how much of clean's answer each cell restores
    patch(lm, clean, corrupt, site="query")     # (L, H): a head's queries alone patched (also key, value)
    attribute(lm, text, " Paris", " London")    # each head's and MLP's share of the logit difference

A head's output is its slice of W_O's input (the heads are concatenated, then mixed by W_O;
Vaswani et al. 2017 §3.2.2, CS189 Lec 22), so "zeroing head h" zeroes z[..., h, :] and nothing
else: in a grouped-query model the key/value head it shares with its group is untouched.
Activation patching: Meng et al. 2022 (causal tracing), Heimersheim & Nanda 2024 (how to use
and read it); direct logit attribution: Elhage et al. 2021.

Shapes: L layers, H query heads, T tokens, Dh head width, dim model width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.functional import scaled_dot_product_attention
from qkv.errors import InputError
from qkv.lens.cache import encode, labels, one_token
from qkv.lens.hooks import (
    Edits,
    Recorded,
    TextModel,
    blocks,
    device_of,
    finish,
    forward,
    forward_steps,
    hooked,
    is_decoder,
    shape,
    tail,
    tail_steps,
)
from qkv.lens.predict import check_decoder

Head = tuple[int, int]
Mode = Literal["zero", "mean"]
MODES: tuple[Mode, ...] = ("zero", "mean")
ROW_FLOATS = 2**27  # the most logits one batch of ablated or patched rows may hold (512 MiB)


def check_heads(lm: TextModel, heads: Sequence[Head]) -> list[Head]:
    """Heads as (layer, head) in range (negative indices count from the end); InputError naming
    the model's layers and heads otherwise."""
    L, H, _ = shape(lm.model)
    out = []
    for layer, head in heads:
        if not (-L <= layer < L and -H <= head < H):
            raise InputError(f"head {layer}.{head} is not in {lm.name}, which has {L} layers (0-{L - 1}) "
                             f"of {H} heads (0-{H - 1})")
        out.append((layer % L, head % H))
    return out


def parse_heads(spec: str) -> list[Head]:
    """'0.1,2.3' -> [(0, 1), (2, 3)]; InputError for anything else."""
    bad = InputError(f"heads are written LAYER.HEAD, comma-separated (e.g. 0.1,2.3); got {spec!r}")
    heads = []
    for part in spec.split(","):
        layer, dot, head = part.strip().partition(".")
        if not dot:
            raise bad
        try:
            heads.append((int(layer), int(head)))
        except ValueError:
            raise bad from None
    return heads


def _check_mode(mode: str) -> Mode:
    if mode not in MODES:
        raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _record(model: nn.Module, ids: list[int]) -> tuple[Recorded, Tensor]:
    rec = Recorded()
    with hooked(model, record=rec):
        out, _ = forward(model, torch.tensor([ids], device=device_of(model)))
    return rec, out


def _knockout(heads: Sequence[int], mode: Mode, means: Tensor | None):
    """An edit of z (B, T, H, Dh) replacing ``heads`` by zero or by their mean over the text."""
    def edit(z: Tensor) -> Tensor:
        z = z.clone()
        for h in heads:
            z[:, :, h] = 0.0 if mode == "zero" else means[h]  # type: ignore[index]
        return z
    return edit


@torch.inference_mode()
def ablate(lm: TextModel, text: str | list[int], heads: Sequence[Head], mode: str = "zero") -> Tensor:
    """The model's output over ``text`` with ``heads`` knocked out: logits (T, V) for a decoder,
    final hidden states (T, dim) for an encoder, float32.

    mode "zero": the heads' outputs are zero; "mean": each is replaced by its mean over the
    text's positions (from an unablated pass), which keeps the stream's average intact.
    """
    return finish(ablate_steps(lm, text, heads, mode))


@torch.inference_mode()  # on a generator: around each of its pieces
def ablate_steps(lm: TextModel, text: str | list[int], heads: Sequence[Head], mode: str = "zero"
                 ) -> Generator[None, None, Tensor]:
    """:func:`ablate` in pieces, one block per ``next`` (no hook on the model between pieces)."""
    mode = _check_mode(mode)
    heads = check_heads(lm, heads)
    ids = encode(lm, text)
    model = lm.model
    x = torch.tensor([ids], device=device_of(model))
    rec = None
    if mode == "mean":
        rec = Recorded()
        yield from forward_steps(model, x, record=rec)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    edits = Edits(z={layer: _knockout(hs, mode, rec.z[layer][0].mean(0) if rec else None)
                     for layer, hs in by_layer.items()})
    out, _ = yield from forward_steps(model, x, edits=edits)
    return out[0].float().cpu()


def _rows(model: nn.Module, T: int) -> int:
    """How many ablated or patched copies of a T-token text one batch may hold."""
    width = model.cfg.vocab_size if is_decoder(model) else model.cfg.dim
    return max(1, ROW_FLOATS // (T * width))


def knockout_sweep(model: nn.Module, rec: Recorded, measure: Callable[[Tensor], Tensor], mode: Mode = "zero",
                   positions: slice | None = None) -> Tensor:
    """(L, H): ``measure`` of the model's output with each head knocked out in turn (its slice of
    W_O's input zeroed, or set to its mean over the recorded sequences and positions), averaged
    over the B sequences ``rec`` holds (a pass over them, recorded with :func:`hooked`). Each
    layer's heads are batched, n copies of the B sequences a pass, run from that layer on; the
    output is read at ``positions`` only (all: None); ``measure`` maps it, (n·B, T', V or dim),
    to (n·B,)."""
    L, H, _ = shape(model)
    B, T = rec.resid_pre[0].shape[:2]
    kept = len(range(T)[positions]) if positions is not None else T
    per = max(1, _rows(model, kept) // B)  # heads a pass
    values = torch.empty(L, H)
    for layer in range(L):
        means = rec.z[layer].mean((0, 1))  # (H, Dh)
        for start in range(0, H, per):
            heads = list(range(start, min(H, start + per)))

            def edit(z: Tensor, heads: list[int] = heads, means: Tensor = means) -> Tensor:
                z = z.clone()
                for r, h in enumerate(heads):
                    z[r * B:(r + 1) * B, :, h] = 0.0 if mode == "zero" else means[h]
                return z

            x = rec.resid_pre[layer].repeat(len(heads), 1, 1)
            with hooked(model, edits=Edits(z={layer: edit})):
                out = tail(model, x, layer, positions=positions)
            values[layer, start:start + len(heads)] = measure(out).float().view(len(heads), B).mean(-1).cpu()
    return values


@dataclass
class HeadEffects:
    """What each head does to a measure of the model's output when knocked out.

    metric: "loss" (mean next-token cross-entropy over the text), "logit difference" (the answer's
    logit minus the wrong one's at the last position) or "embedding change" (encoders: 1 - the
    cosine between the mean-pooled final states with and without the head). base: the metric
    unablated. values: (L, H) the metric with each head knocked out; ``effect`` = values - base.
    """

    tokens: list[str]
    metric: str
    mode: Mode
    base: float
    values: Tensor

    @property
    def effect(self) -> Tensor:
        return self.values - self.base


@torch.inference_mode()
def head_effects(lm: TextModel, text: str | list[int], mode: str = "zero",
                 answer: str | int | None = None, wrong: str | int | None = None) -> HeadEffects:
    """Knock out every head in turn (one forward pass from its layer on, the heads of a layer
    batched) and measure the loss over ``text`` (or, with ``answer``, the answer's logit minus
    ``wrong``'s at the last position; encoders: the change of the sentence embedding)."""
    mode = _check_mode(mode)
    model = lm.model
    decoder = is_decoder(model)
    ids = encode(lm, text)
    if decoder and answer is None and len(ids) < 2:
        raise InputError("the loss needs a text of at least two tokens (or give an answer token)")
    a = one_token(lm, answer) if decoder and answer is not None else None
    b = one_token(lm, wrong, "the wrong answer") if decoder and wrong is not None else None
    target = torch.tensor(ids[1:], device=device_of(model))
    rec, clean = _record(model, ids)

    def measure(out: Tensor) -> Tensor:  # (B, T, V or dim) -> (B,)
        if not decoder:
            pooled = out.float().mean(1)
            return 1 - F.cosine_similarity(pooled, clean.float().mean(1), dim=-1)
        if a is not None:
            last = out[:, -1].float()
            return last[:, a] - (last[:, b] if b is not None else 0.0)
        return F.cross_entropy(out[:, :-1].float().transpose(1, 2), target.expand(out.shape[0], -1),
                               reduction="none").mean(-1)

    # a loss reads every position; a logit difference, the last
    last = slice(-1, None) if decoder and a is not None else None
    values = knockout_sweep(model, rec, measure, mode, last)
    metric = "embedding change" if not decoder else "logit difference" if a is not None else "loss"
    return HeadEffects(labels(lm, ids), metric, mode, float(measure(clean)[0]), values)


METRICS = ("diff", "prob", "loss")
SITES = ("resid", "head", "query", "key", "value")
PARTS = ("query", "key", "value")  # sites that patch one input of a head's attention


@dataclass(frozen=True)
class Metric:
    """What patching measures at the last position, from its logits (..., V) -> (...):

    "diff": the answer's logit minus the wrong answer's (the logit difference, LD);
    "prob": the answer's probability; "loss": the answer's cross-entropy, -log p(answer).
    Computed in float32 at least (float64 stays float64)."""

    name: str
    answer: int
    wrong: int

    def __call__(self, last: Tensor) -> Tensor:
        if self.name == "diff":
            return last[..., self.answer] - last[..., self.wrong]
        wide = last.to(torch.promote_types(last.dtype, torch.float32))
        logp = torch.log_softmax(wide, dim=-1)[..., self.answer]
        return logp.exp() if self.name == "prob" else -logp


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise InputError(f"metric must be 'diff' (the answer's logit minus the wrong one's), 'prob' (the "
                         f"answer's probability) or 'loss' (its cross-entropy), got {metric!r}")
    return metric


def check_site(site: str) -> str:
    if site not in SITES:
        raise InputError(f"site must be 'resid' (layer x position), 'head' (layer x head: its output) or "
                         f"'query' / 'key' / 'value' (layer x head: that input of its attention): {site!r}")
    return site


@dataclass
class PatchPair:
    """What a patching result says of its two prompts: the site ("resid", "head", "query", "key" or
    "value"), each prompt's tokens, the answer and the wrong answer, and the metric (``metric``:
    "diff", the answer's logit minus the wrong answer's at the last position, LD; "prob"; "loss";
    see :class:`Metric`) of the clean run (``clean_diff``) and of the corrupt run
    (``corrupt_diff``)."""

    site: str
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    answer: str
    wrong: str
    clean_diff: float
    corrupt_diff: float
    metric: str

    def measured(self) -> str:
        """The metric in words, for tables: logit[' Paris'] - logit[' Rome'], p(' Paris'), ..."""
        return {"diff": f"logit[{self.answer!r}] - logit[{self.wrong!r}]", "prob": f"p({self.answer!r})",
                "loss": f"-log p({self.answer!r})"}[self.metric]


@dataclass
class Patching(PatchPair):
    """Activation patching: the corrupt prompt run with one piece of the clean run put back.

    site "resid": values (L, T), the stream entering block l at position t patched; "head":
    values (L, H), head h's output at every position of layer l patched; "query" / "key" /
    "value": values (L, H), only head h's queries (keys, values) at every position taken from the
    clean run, its attention recomputed exactly. Each value is the normalised metric
    (M - M_corrupt) / (M_clean - M_corrupt): 0 = as corrupt, 1 = as clean. ``raw``: the
    metric itself.
    """

    values: Tensor
    raw: Tensor


def head_parts(model: nn.Module, layer: int, attn_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The queries (B, H, T, Dh), keys and values (B, K, T, Dh) layer ``layer`` computes from what
    its attention reads (``Recorded.attn_in``), RoPE applied as in the model's own forward."""
    return blocks(model)[layer].attn._project(attn_in, None, getattr(model, "rope", None), 0)


def attend(model: nn.Module, layer: int, q: Tensor, k: Tensor, v: Tensor, weights: bool = False
           ) -> tuple[Tensor, Tensor | None]:
    """Layer ``layer``'s attention of q (B, H, T, Dh) over k, v (B, K, T, Dh) as the model runs it
    (its causality, its ALiBi bias), written out (:func:`qkv.attention.scaled_dot_product_attention`):
    each head's output z (B, T, H, Dh) and, asked for, the weights (B, H, T, T)."""
    T = q.shape[2]
    alibi = getattr(model, "alibi", None)
    bias = alibi(T, T) if alibi is not None else None
    out = scaled_dot_product_attention(q, k, v, is_causal=blocks(model)[layer].cfg.causal, bias=bias,
                                       return_weights=weights)
    return out.out.transpose(1, 2), out.weights


def substitute_z(model: nn.Module, layer: int, site: str, clean_in: Tensor, corrupt_in: Tensor) -> Tensor:
    """Each head's output (B, T, H, Dh) in the corrupt run had its ``site`` ("query", "key" or
    "value") come from the clean run: the attention recomputed exactly (softmax included) from the
    two runs' attention inputs (``Recorded.attn_in``). Head h's slice is its output with only its
    own part patched (a key/value head shared by a group is patched for head h's row alone)."""
    qc, kc, vc = head_parts(model, layer, clean_in)
    qk, kk, vk = head_parts(model, layer, corrupt_in)
    q, k, v = {"query": (qc, kk, vk), "key": (qk, kc, vk), "value": (qk, kk, vc)}[site]
    return attend(model, layer, q, k, v)[0]


def prompt_pair(lm: TextModel, clean: str | list[int], corrupt: str | list[int]
                ) -> tuple[list[int], list[int]]:
    """The two prompts' ids, InputError unless they have the same number of tokens (a patch puts
    each position of one into the other)."""
    c_ids, k_ids = encode(lm, clean), encode(lm, corrupt)
    if len(c_ids) != len(k_ids):
        raise InputError(f"the clean and corrupt prompts must have the same number of tokens to patch "
                         f"position by position; they have {len(c_ids)} and {len(k_ids)}")
    return c_ids, k_ids


def answer_pair(lm: TextModel, clean_last: Tensor, corrupt_last: Tensor, answer: str | int | None,
                wrong: str | int | None, metric: str = "diff") -> Metric:
    """The metric towards (answer, wrong) token ids: as given, else the clean run's top prediction
    and the corrupt run's (``*_last``: (V,) logits at the last position); InputError when they
    are one token and the metric compares them ("diff")."""
    metric = check_metric(metric)
    a = one_token(lm, answer) if answer is not None else int(clean_last.argmax())
    b = one_token(lm, wrong, "the wrong answer") if wrong is not None else int(corrupt_last.argmax())
    if a == b and metric == "diff":
        raise InputError(f"the clean and corrupt prompts both predict {lm.tokenizer.decode([a])!r}: "
                         "give the answer and the wrong answer to compare (--answer, --wrong)")
    return Metric(metric, a, b)


@torch.inference_mode()
def patch(lm: TextModel, clean: str | list[int], corrupt: str | list[int], site: str = "resid",
          answer: str | int | None = None, wrong: str | int | None = None, metric: str = "diff") -> Patching:
    """Patch each cell of ``site`` from ``clean`` into ``corrupt`` (same number of tokens) and
    measure how much of the clean answer comes back (see :class:`Patching`). ``answer`` defaults
    to the clean run's top token, ``wrong`` to the corrupt run's; ``metric``: "diff" (their logit
    difference), "prob" or "loss" (the answer's probability, its cross-entropy)."""
    return finish(patch_steps(lm, clean, corrupt, site, answer, wrong, metric))


@torch.inference_mode()  # on a generator: around each of its pieces, whoever runs them
def patch_steps(lm: TextModel, clean: str | list[int], corrupt: str | list[int], site: str = "resid",
                answer: str | int | None = None, wrong: str | int | None = None, metric: str = "diff"
                ) -> Generator[tuple[int, int] | None, None, Patching]:
    """:func:`patch` in pieces, one block of a forward pass per ``next``: yields ``(done, total)``
    after each forward pass of patched cells (None between) and returns the :class:`Patching`.
    No hook stays on the model between two pieces, so other forward passes may run on it in
    between (the server interleaves a sweep with other students' requests and token streams)."""
    check_decoder(lm, "patching towards an answer")
    site = check_site(site)
    check_metric(metric)
    model = lm.model
    c_ids, k_ids = prompt_pair(lm, clean, corrupt)
    rec_c, rec_k = Recorded(), Recorded()
    out_c, _ = yield from forward_steps(model, torch.tensor([c_ids], device=device_of(model)), record=rec_c)
    out_k, _ = yield from forward_steps(model, torch.tensor([k_ids], device=device_of(model)), record=rec_k)
    m = answer_pair(lm, out_c[0, -1], out_k[0, -1], answer, wrong, metric)

    def measure(out: Tensor) -> Tensor:
        return m(out[:, -1]).float().cpu()

    ld_c, ld_k = float(measure(out_c)[0]), float(measure(out_k)[0])
    L, H, _ = shape(model)
    T = len(c_ids)
    cols = T if site == "resid" else H
    raw = torch.empty(L, cols)
    chunk = _rows(model, T)
    total, done = L * math.ceil(cols / chunk), 0
    yield done, total
    for layer in range(L):
        if site in PARTS:  # each head's output with only its queries (keys, values) from the clean run
            put = substitute_z(model, layer, site, rec_c.attn_in[layer], rec_k.attn_in[layer])[0]
        else:
            put = rec_c.z[layer][0]
        for start in range(0, cols, chunk):
            idx = list(range(start, min(cols, start + chunk)))
            x = rec_k.resid_pre[layer].expand(len(idx), -1, -1).clone()
            edits = Edits()
            if site == "resid":
                for r, t in enumerate(idx):
                    x[r, t] = rec_c.resid_pre[layer][0, t]
            else:
                def edit(z: Tensor, idx: list[int] = idx, put: Tensor = put) -> Tensor:
                    z = z.clone()
                    for r, h in enumerate(idx):
                        z[r, :, h] = put[:, h]
                    return z
                edits.z[layer] = edit
            out = yield from tail_steps(model, x, layer, last_only=True, edits=edits)  # a block per piece
            raw[layer, start:start + len(idx)] = measure(out)
            done += 1
            yield done, total
    span = ld_c - ld_k
    values = (raw - ld_k) / span if span != 0 else torch.full_like(raw, float("nan"))
    dec = lm.tokenizer.decode
    return Patching(site, labels(lm, c_ids), labels(lm, k_ids), dec([m.answer]), dec([m.wrong]), ld_c, ld_k,
                    metric, values, raw)
