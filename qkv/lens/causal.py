"""Cause and effect inside a Transformer: knock heads out, patch one prompt's activations into
another, and split a prediction into what each head and MLP wrote towards it.

    ablate(lm, text, heads=[(3, 1)])            # logits (T, V) with layer 3's head 1 zeroed
    head_effects(lm, text)                      # every head's effect on the loss, (L, H)
    patch(lm, clean, corrupt, site="resid")     # (L, T): how much of clean's answer each cell restores
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

from qkv.errors import InputError
from qkv.lens.cache import encode, labels, one_token
from qkv.lens.hooks import (
    Edits,
    Recorded,
    TextModel,
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


@dataclass
class PatchPair:
    """What a patching result says of its two prompts: the site ("resid" or "head"), each
    prompt's tokens, the answer and the wrong answer, and the logit difference LD (the answer's
    logit minus the wrong answer's at the last position) of the clean and the corrupt run."""

    site: str
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    answer: str
    wrong: str
    clean_diff: float
    corrupt_diff: float


@dataclass
class Patching(PatchPair):
    """Activation patching: the corrupt prompt run with one piece of the clean run put back.

    site "resid": values (L, T), the stream entering block l at position t patched; "head":
    values (L, H), head h's output at every position of layer l patched. Each value is the
    normalised logit difference (LD - LD_corrupt) / (LD_clean - LD_corrupt): 0 = as corrupt,
    1 = as clean. ``raw``: the logit differences themselves.
    """

    values: Tensor
    raw: Tensor


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
                wrong: str | int | None) -> tuple[int, int]:
    """(answer, wrong) token ids: as given, else the clean run's top prediction and the corrupt
    run's (``*_last``: (V,) logits at the last position); InputError when they are one token."""
    a = one_token(lm, answer) if answer is not None else int(clean_last.argmax())
    b = one_token(lm, wrong, "the wrong answer") if wrong is not None else int(corrupt_last.argmax())
    if a == b:
        raise InputError(f"the clean and corrupt prompts both predict {lm.tokenizer.decode([a])!r}: "
                         "give the answer and the wrong answer to compare (--answer, --wrong)")
    return a, b


@torch.inference_mode()
def patch(lm: TextModel, clean: str | list[int], corrupt: str | list[int], site: str = "resid",
          answer: str | int | None = None, wrong: str | int | None = None) -> Patching:
    """Patch each cell of ``site`` from ``clean`` into ``corrupt`` (same number of tokens) and
    measure how much of the clean answer comes back (see :class:`Patching`). ``answer`` defaults
    to the clean run's top token, ``wrong`` to the corrupt run's."""
    return finish(patch_steps(lm, clean, corrupt, site, answer, wrong))


@torch.inference_mode()  # on a generator: around each of its pieces, whoever runs them
def patch_steps(lm: TextModel, clean: str | list[int], corrupt: str | list[int], site: str = "resid",
                answer: str | int | None = None,
                wrong: str | int | None = None) -> Generator[tuple[int, int] | None, None, Patching]:
    """:func:`patch` in pieces, one block of a forward pass per ``next``: yields ``(done, total)``
    after each forward pass of patched cells (None between) and returns the :class:`Patching`.
    No hook stays on the model between two pieces, so other forward passes may run on it in
    between (the server interleaves a sweep with other students' requests and token streams)."""
    check_decoder(lm, "patching towards an answer")
    if site not in ("resid", "head"):
        raise InputError(f"site must be 'resid' (layer x position) or 'head' (layer x head), got {site!r}")
    model = lm.model
    c_ids, k_ids = prompt_pair(lm, clean, corrupt)
    rec_c, rec_k = Recorded(), Recorded()
    out_c, _ = yield from forward_steps(model, torch.tensor([c_ids], device=device_of(model)), record=rec_c)
    out_k, _ = yield from forward_steps(model, torch.tensor([k_ids], device=device_of(model)), record=rec_k)
    a, b = answer_pair(lm, out_c[0, -1], out_k[0, -1], answer, wrong)

    def diff(out: Tensor) -> Tensor:
        return (out[:, -1, a] - out[:, -1, b]).float().cpu()

    ld_c, ld_k = float(diff(out_c)[0]), float(diff(out_k)[0])
    L, H, _ = shape(model)
    T = len(c_ids)
    cols = T if site == "resid" else H
    raw = torch.empty(L, cols)
    chunk = _rows(model, T)
    total, done = L * math.ceil(cols / chunk), 0
    yield done, total
    for layer in range(L):
        for start in range(0, cols, chunk):
            idx = list(range(start, min(cols, start + chunk)))
            x = rec_k.resid_pre[layer].expand(len(idx), -1, -1).clone()
            edits = Edits()
            if site == "resid":
                for r, t in enumerate(idx):
                    x[r, t] = rec_c.resid_pre[layer][0, t]
            else:
                def edit(z: Tensor, idx: list[int] = idx, clean_z: Tensor = rec_c.z[layer][0]) -> Tensor:
                    z = z.clone()
                    for r, h in enumerate(idx):
                        z[r, :, h] = clean_z[:, h]
                    return z
                edits.z[layer] = edit
            out = yield from tail_steps(model, x, layer, last_only=True, edits=edits)  # a block per piece
            raw[layer, start:start + len(idx)] = diff(out)
            done += 1
            yield done, total
    span = ld_c - ld_k
    values = (raw - ld_k) / span if span != 0 else torch.full_like(raw, float("nan"))
    dec = lm.tokenizer.decode
    return Patching(site, labels(lm, c_ids), labels(lm, k_ids), dec([a]), dec([b]), ld_c, ld_k, values, raw)
