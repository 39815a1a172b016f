"""Reading and changing what a Transformer computes inside: the residual stream, each head's
output, the attention patterns, the MLPs' outputs.

Every qkv text model (its own GPT runs, and the Llama / Qwen2 / Gemma / GPT-2 / BERT files its
converters load) is a stack of the same :class:`~qkv.layers.TransformerBlock`, so plain torch
hooks on four modules of each block see everything:

    block (pre-hook)        resid_pre   (B, T, dim)   the stream entering the block
    block.attn.out_proj     z           (B, T, H, Dh) each head's output, before W_O mixes them
    block.attn (pre-hook)   attn_in     (B, T, dim)   what attention reads (after a pre-LN norm)
    block.attn              attn_out    (B, T, dim)   what attention adds to the stream
    block.mlp               mlp_out     (B, T, dim)   what the MLP adds
    block                   resid_post  (B, T, dim)

A pre-LN block computes resid_mid = resid_pre + attn_out and resid_post = resid_mid + mlp_out
(CS189 Lec 22, "the Transformer layer"); the names are TransformerLens's (``blocks.3.attn.hook_z``)
so that what people know there carries over. Grouped-query models (SmolLM2: 9 query heads over
3 key/value heads) have one z per *query* head: ablating or patching a head touches only its
own slice of W_O's input, never the key/value head it shares.

Shapes: B batch, T tokens, H query heads, Dh head width, dim model width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from qkv.errors import InputError

T = TypeVar("T")
Edit = Callable[[Tensor], Tensor]  # an activation in, the activation to use instead out


class TextModel(Protocol):
    """What the lens needs of a loaded model (``qkv.load(...)``: a CausalLM or SentenceEncoder)."""

    name: str
    model: Any
    tokenizer: Any

    @property
    def kind(self) -> str: ...


def is_decoder(model: nn.Module) -> bool:
    """A model with an output head over the vocabulary (GPT and every decoder qkv loads)."""
    return hasattr(model, "lm_head")


def blocks(model: nn.Module) -> nn.ModuleList:
    """The model's Transformer blocks, first layer first."""
    stack = getattr(model, "stack", None)
    if stack is None or not hasattr(stack, "blocks"):
        raise InputError(f"{type(model).__name__} is not a stack of Transformer blocks: "
                         "the lens reads GPT-style decoders and BERT-style encoders")
    return stack.blocks


def shape(model: nn.Module) -> tuple[int, int, int]:
    """(layers, query heads, head width) of a text model."""
    attn = blocks(model)[0].attn
    return len(blocks(model)), attn.n_heads, attn.head_dim


def pre_ln(model: nn.Module) -> bool:
    """True when every sublayer reads a normalised copy of the stream (GPT-2, Llama, SmolLM2)."""
    return blocks(model)[0].cfg.norm_position == "pre"


@dataclass
class Edits:
    """Changes to make while the model runs: per layer, a function of each head's output
    (B, T, H, Dh) and of the stream entering the block (B, T, dim)."""

    z: dict[int, Edit] = field(default_factory=dict)
    resid_pre: dict[int, Edit] = field(default_factory=dict)


@dataclass
class Recorded:
    """Activations seen during one forward pass, per layer, batch kept: (B, T, ...) each."""

    resid_pre: dict[int, Tensor] = field(default_factory=dict)
    resid_mid: dict[int, Tensor] = field(default_factory=dict)
    resid_post: dict[int, Tensor] = field(default_factory=dict)
    z: dict[int, Tensor] = field(default_factory=dict)
    attn_in: dict[int, Tensor] = field(default_factory=dict)
    attn_out: dict[int, Tensor] = field(default_factory=dict)
    mlp_out: dict[int, Tensor] = field(default_factory=dict)


@contextmanager
def hooked(model: nn.Module, *, record: Recorded | None = None, edits: Edits | None = None,
           layers: Collection[int] | None = None) -> Iterator[None]:
    """Run ``model`` inside this block to fill ``record`` and apply ``edits``; hooks are removed
    on the way out, also after an error. ``layers``: hook only these blocks (a forward in
    pieces hooks the block it is about to run)."""
    edits = edits or Edits()
    handles = []
    n_heads, head_dim = shape(model)[1:]
    pre = pre_ln(model)

    def keep(store: dict[int, Tensor] | None, layer: int, t: Tensor) -> None:
        if store is not None:
            store[layer] = t.detach()

    for layer, block in enumerate(blocks(model)):
        if layers is not None and layer not in layers:
            continue

        def block_pre(mod, args, kwargs, layer=layer):
            x = args[0]
            if layer in edits.resid_pre:
                x = edits.resid_pre[layer](x)
                args = (x, *args[1:])
            keep(record and record.resid_pre, layer, x)
            return args, kwargs

        def block_post(mod, args, kwargs, out, layer=layer):
            keep(record and record.resid_post, layer, out.x)

        def z_pre(mod, args, layer=layer):
            flat = args[0]  # (B, T, H·Dh): the heads' outputs side by side
            z = flat.view(*flat.shape[:-1], n_heads, head_dim)
            if layer in edits.z:
                z = edits.z[layer](z)
                keep(record and record.z, layer, z)
                return (z.reshape(flat.shape),)
            keep(record and record.z, layer, z)
            return None

        def attn_pre(mod, args, layer=layer):
            keep(record and record.attn_in, layer, args[0])

        def attn_post(mod, args, kwargs, out, layer=layer):
            keep(record and record.attn_out, layer, out[0])

        def mlp_post(mod, args, out, layer=layer):
            keep(record and record.mlp_out, layer, out)

        handles += [
            block.register_forward_pre_hook(block_pre, with_kwargs=True),
            block.register_forward_hook(block_post, with_kwargs=True),
            block.attn.out_proj.register_forward_pre_hook(z_pre),
            block.attn.register_forward_pre_hook(attn_pre),
            block.attn.register_forward_hook(attn_post, with_kwargs=True),
            block.mlp.register_forward_hook(mlp_post),
        ]
        if record is not None:
            if pre:  # the second norm reads resid_pre + attn_out
                handles.append(block.norm2.register_forward_pre_hook(
                    lambda mod, args, layer=layer: keep(record.resid_mid, layer, args[0])))
            else:  # post-LN: the first norm's output is the stream between the sublayers
                handles.append(block.norm1.register_forward_hook(
                    lambda mod, args, out, layer=layer: keep(record.resid_mid, layer, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forward_kwargs(weights: bool) -> dict[str, Any]:
    """How :func:`forward` calls a model: with weights, through the explicit softmax(QKᵀ/√d)
    (the ``reference`` backend: the one that has weights)."""
    return {"return_weights": True, "backend": "reference"} if weights else {"return_weights": False}


def forward(model: nn.Module, ids: Tensor, *, weights: bool = False) -> tuple[Tensor, list[Tensor] | None]:
    """ids (B, T) -> (logits (B, T, V) for a decoder or final hidden states (B, T, dim) for an
    encoder, attention weights per layer (B, H, T, T) when asked for)."""
    out = model(ids, **_forward_kwargs(weights))
    if is_decoder(model):
        return out.logits, out.weights
    return out.hidden, out.weights


class _EnteredError(Exception):
    """Raised by a pre-hook of the first block: the model's embedding is done, and these are
    the arguments its stack gives every block."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.block_args, self.block_kwargs = args, kwargs


def forward_steps(model: nn.Module, ids: Tensor, *, weights: bool = False, record: Recorded | None = None,
                  edits: Edits | None = None
                  ) -> Generator[None, None, tuple[Tensor, list[Tensor] | None]]:
    """:func:`forward` in pieces, for a server that must not stop its token streams for a whole
    forward pass: the embedding, then one block per ``next``, then the final norm and head; the
    return value is forward's. Each block is called with the arguments the model's own stack
    gives it (caught by a pre-hook on block 0 as the model's forward reaches it), so the answer
    is the model's; ``record`` and ``edits`` are hooked around each piece only, so between two
    pieces nothing of this call sits on the model and others may run it (a running batch's
    decoding step). ids (B, T); no KV cache."""
    kw = _forward_kwargs(weights)
    stack = blocks(model)

    def caught(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _EnteredError(args, kwargs)

    handle = stack[0].register_forward_pre_hook(caught, with_kwargs=True)
    try:
        model(ids, **kw)
    except _EnteredError as e:
        args, kwargs = e.block_args, e.block_kwargs
    else:
        raise RuntimeError(f"{type(model).__name__} did not run its first block")
    finally:
        handle.remove()
    x, rest, ws = args[0], args[1:], []
    for i, block in enumerate(stack):
        yield
        with hooked(model, record=record, edits=edits, layers=(i,)):
            out = block(x, *rest, **kwargs)
        x = out.x
        ws.append(out.self_weights)
    yield
    norm = model.stack.norm
    if norm is not None:
        x = norm(x)
    return (model.lm_head(x) if is_decoder(model) else x), (ws if weights else None)


def finish(steps: Generator[Any, Any, T]) -> T:
    """Run a computation in pieces (a generator) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def tail(model: nn.Module, x: Tensor, start: int, last_only: bool = False, positions: slice | None = None
         ) -> Tensor:
    """Run blocks ``start``.. on the stream x (B, T, dim) entering block ``start``, then the
    final norm and (decoders) the output head: logits (B, T, V) or hidden states (B, T, dim);
    ``last_only``: the last position's only, (B, 1, ...); ``positions``: these positions' only
    (the head, the costly part for a large vocabulary, reads no others). The same blocks and
    modules as the model's forward, so hooks and edits apply."""
    return finish(tail_steps(model, x, start, last_only, positions=positions))


def tail_steps(model: nn.Module, x: Tensor, start: int, last_only: bool = False, edits: Edits | None = None,
               positions: slice | None = None) -> Generator[None, None, Tensor]:
    """:func:`tail` in pieces, one block per ``next``; ``edits`` are hooked around each block
    only (none: no hook is installed, the caller's apply), so between two pieces nothing of this
    call is on the model."""
    T = x.shape[1]
    alibi = getattr(model, "alibi", None)
    bias = alibi(T, T) if alibi is not None else None
    rope = getattr(model, "rope", None)
    for i, block in enumerate(blocks(model)[start:], start):
        if edits is None:
            x = block(x, bias=bias, rope=rope).x
        else:
            with hooked(model, edits=edits, layers=(i,)):
                x = block(x, bias=bias, rope=rope).x
        yield
    if last_only:
        positions = slice(-1, None)
    if positions is not None:
        x = x[:, positions]
    if model.stack.norm is not None:
        x = model.stack.norm(x)
    return model.lm_head(x) if is_decoder(model) else x


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm between the last block and the output head (pre-LN models), else None."""
    return model.stack.norm


def normed_streams(model: nn.Module, resid: Tensor) -> Tensor:
    """Residual streams (..., dim) as the model's output head reads its last one: through the
    final norm, computed on *each* stream (its own mean and scale); post-LN models, which have
    no final norm, as they are."""
    norm = final_norm(model)
    dtype = model.lm_head.weight.dtype if hasattr(model.lm_head, "weight") else resid.dtype
    h = resid.to(dtype)
    return norm(h) if norm is not None else h

