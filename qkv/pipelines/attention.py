"""Attention of a text model as values: every layer and head over one text, and each generated
token with the attention row that chose it. ``qkv attend`` and ``qkv serve`` both read these, so
the command line and the web page show the same numbers for the same input:

    att = text_attention(lm, "The cat sat.")          # tokens, weights (L, H, T, T), notes
    ids, notes = encode_text(lm, "Once", keep="last")
    for step in generate_steps(lm, ids, 20): ...     # each new token and its attention row

Every weight comes from the models' own ``backend="reference"`` forward pass (the explicit
softmax(QKᵀ/√d), which can return its weights); nothing here recomputes attention.

Shapes: L layers, H heads, T tokens (queries), S keys.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from qkv.errors import InputError
from qkv.pipelines.kinds import check_layer_head
from qkv.pipelines.text import CausalLM, SentenceEncoder

TextModel = CausalLM | SentenceEncoder
MAX_TOKENS = 512  # attention maps over more tokens than this are unreadable (and (L,H,T,T) is big)
ATTENTION_BYTES = 2 * 1024**3  # the most memory the (L, H, T, T) float32 maps of one text may take


@dataclass
class TextAttention:
    """Self-attention of every layer and head over one text.

    tokens: T labels (each token decoded alone). weights: (L, H, T, T) float32, row = query,
    column = key; each row sums to 1 (causal models: zero above the diagonal).
    notes: what was changed about the input (truncation), to show the user.
    """

    tokens: list[str]
    ids: list[int]
    weights: Tensor
    notes: list[str]
    causal: bool


def encode_text(lm: TextModel, text: str, max_tokens: int = MAX_TOKENS,
                keep: Literal["first", "last"] = "first") -> tuple[list[int], list[str]]:
    """Token ids of ``text`` for a text model, truncated to its context and to ``max_tokens``
    (keeping the first tokens, or the last: a prompt to continue), with a note saying so;
    InputError for empty text or characters the model cannot read."""
    if not text.strip():
        raise InputError("the text is empty; type some text to see its attention")
    try:
        ids = lm.tokenizer.encode(text)
    except ValueError as e:
        raise InputError(str(e)) from None
    if not ids:
        raise InputError("the text encodes to no tokens; type some text")
    limit = max(1, min(lm.context, max_tokens))
    notes = []
    if len(ids) > limit:
        why = (f"the model's context is {lm.context} tokens" if limit == lm.context
               else f"the limit here is {limit} tokens")
        notes.append(f"truncated to the {keep} {limit} of {len(ids)} tokens ({why})")
        if lm.kind == "encoder":  # keep [CLS] ... [SEP], as BERT's own truncation does
            ids = ids[: limit - 1] + ids[-1:]
        else:
            ids = ids[:limit] if keep == "first" else ids[-limit:]
    return ids, notes


def token_labels(lm: TextModel, ids: list[int]) -> list[str]:
    """Each token decoded on its own: 'the', '##ing', ' upon', '[CLS]', '\\n'."""
    return [lm.tokenizer.decode([i]) for i in ids]


def check_attention_size(lm: TextModel, n_tokens: int) -> None:
    """InputError, naming the memory, when the (L, H, T, T) float32 attention maps of
    ``n_tokens`` tokens would take more than ``ATTENTION_BYTES``."""
    L, H, T = lm.n_layers, lm.n_heads, n_tokens
    need = L * H * T * T * 4
    if need > ATTENTION_BYTES:
        fits = int((ATTENTION_BYTES / (L * H * 4)) ** 0.5)
        raise InputError(f"the attention maps of {T} tokens would need {need / 1e9:.1f} GB ({L} layers x "
                         f"{H} heads x {T}x{T} weights x 4 bytes), more than the "
                         f"{ATTENTION_BYTES / 2**30:.0f} GiB allowed: use --max-tokens {fits} or fewer")


@torch.inference_mode()
def text_attention(lm: TextModel, text: str, max_tokens: int = MAX_TOKENS) -> TextAttention:
    """Every layer's and head's attention over ``text`` (MiniLM, SmolLM2, GPT runs)."""
    from qkv.lens.hooks import finish

    return finish(text_attention_steps(lm, text, max_tokens))


@torch.inference_mode()  # on a generator: around each of its pieces
def text_attention_steps(lm: TextModel, text: str, max_tokens: int = MAX_TOKENS
                         ) -> Generator[None, None, TextAttention]:
    """:func:`text_attention` in pieces, one block per ``next`` (for the server's compute loop:
    its token streams move between them); the same weights."""
    from qkv.lens.hooks import forward_steps

    ids, notes = encode_text(lm, text, max_tokens)
    check_attention_size(lm, len(ids))
    device = next(lm.model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    _, ws = yield from forward_steps(lm.model, x, weights=True)
    assert ws is not None
    weights = torch.stack([w[0] for w in ws]).float().cpu()  # (L, H, T, T)
    return TextAttention(token_labels(lm, ids), ids, weights, notes, lm.kind == "decoder")


@dataclass
class GenerationStep:
    """One generated token and the attention of the position that chose it (the last query
    of that step) over every token before it: (S,), in the requested layer and head (or the
    mean over heads)."""

    id: int
    token: str
    weights: Tensor


def head_row(w: Tensor, head: int | None) -> Tensor:
    """One position's attention in one layer, (H, S), as the page shows it: head ``head``'s row,
    or the mean over heads (None); (S,) float32, a copy (not a view into the step's weights)."""
    w = w.float()
    return (w.mean(0) if head is None else w[head]).to("cpu", copy=True)


def batch_steps(lm: CausalLM, prompt_ids: list[int],
                tokens: Iterable[tuple[int, Tensor]]) -> Iterator[GenerationStep]:
    """:func:`generate_steps`'s items for a stream of (id, attention row (S,)) pairs, decoded here
    or elsewhere (a row of a running batch, :mod:`qkv.serve.batching`): each id with its text as
    it reads after what came before (a SentencePiece "▁the" keeps its space)."""
    from qkv.generation.decode import decode_after

    seen = list(prompt_ids)
    for tid, weights in tokens:
        yield GenerationStep(tid, decode_after(lm.tokenizer.decode, seen, [tid]), weights)
        seen.append(tid)


@torch.inference_mode()
def generate_steps(lm: CausalLM, prompt_ids: list[int], max_new_tokens: int, *, layer: int = -1,
                   head: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                   seed: int | None = None) -> Iterator[GenerationStep]:
    """Sample up to ``max_new_tokens`` tokens after ``prompt_ids`` with a KV cache, yielding
    each token with its attention row; stops at the context's end and at the model's stop ids.
    Use :func:`encode_text` for the prompt."""
    if lm.kind != "decoder":
        raise InputError(f"{lm.name} is an {lm.kind}: it does not continue a prompt")
    layer, head = check_layer_head(lm.n_layers, lm.n_heads, layer, head)
    n_new = min(max_new_tokens, lm.context - len(prompt_ids))  # never past the context's end
    steps = lm.steps(prompt_ids, max(n_new, 0), temperature=temperature, top_k=top_k, seed=seed,
                     return_weights=True)
    # weights: one (1, H, S) tensor per layer, the last position's row
    yield from batch_steps(lm, prompt_ids, ((tid, head_row(ws[layer][0], head)) for tid, ws in steps))
