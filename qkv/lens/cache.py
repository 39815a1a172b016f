"""One forward pass with everything inside it kept: ``run_with_cache(lm, text)``.

    cache = run_with_cache(lm, "When Mary and John went to the store, John gave a drink to")
    cache["blocks.0.hook_resid_pre"]      # (T, dim)   = cache.resid_pre[0]
    cache["blocks.3.attn.hook_z"]         # (T, H, Dh) each head's output
    cache["blocks.3.attn.hook_pattern"]   # (H, T, T)  its attention weights
    cache.logits                          # (T, V)

The names are TransformerLens's (``hook_embed`` is the stream entering block 0, token and
position embeddings together). One text, so the batch dimension is dropped; every tensor is
float32 on the CPU, whatever the model's dtype.

Shapes: L layers, H query heads, T tokens, Dh head width, dim model width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import InputError
from qkv.lens.hooks import Recorded, TextModel, device_of, finish, forward_steps, is_decoder, shape

# The one rule for texts longer than the model's context, in `qkv lens` and `qkv attend` alike
# (qkv.commands.options.LONG_TEXT_RULE says it in both --help texts): refused, with the limit,
# never cut. A cut text would answer about another text than the one given (the next token after
# a different ending, --query positions that moved), and which end to keep is the reader's choice.


def check_context(lm: TextModel, n_tokens: int) -> None:
    """InputError, naming the limit, when ``n_tokens`` exceed the model's context (the rule above)."""
    context = lm.model.cfg.max_seq_len
    if n_tokens > context:
        raise InputError(f"the text is {n_tokens} tokens, more than {lm.name}'s context of {context}; "
                         f"give at most {context} tokens (a shorter text)")


def encode(lm: TextModel, text: str | list[int]) -> list[int]:
    """The token ids of ``text`` (a string, or ids already): InputError for empty text, text the
    tokenizer cannot read, or more tokens than the model's context."""
    if isinstance(text, str):
        if not text.strip():
            raise InputError("the text is empty; give some text to look at")
        try:
            ids = lm.tokenizer.encode(text)
        except ValueError as e:
            raise InputError(str(e)) from None
    else:
        ids = [int(i) for i in text]
    if not ids:
        raise InputError("the text encodes to no tokens; give some text")
    check_context(lm, len(ids))
    return ids


def labels(lm: TextModel, ids: list[int]) -> list[str]:
    """Each token decoded on its own ('The', ' cat', '\\n')."""
    return [lm.tokenizer.decode([i]) for i in ids]


def one_token(lm: TextModel, text: str | int, what: str = "the answer") -> int:
    """The id of a text that must be exactly one token (an answer to attribute or patch towards),
    or a token id itself; InputError naming the tokens it splits into otherwise."""
    if isinstance(text, int):
        if not 0 <= text < lm.model.cfg.vocab_size:
            raise InputError(f"{what}: token id {text} is not in {lm.name}'s vocabulary of "
                             f"{lm.model.cfg.vocab_size}")
        return text
    try:
        ids = lm.tokenizer.encode(text)
    except ValueError as e:
        raise InputError(f"{what} {text!r}: {e}") from None
    if len(ids) != 1:
        parts = ", ".join(repr(lm.tokenizer.decode([i])) for i in ids) or "nothing"
        raise InputError(f"{what} must be one token of {lm.name}'s vocabulary; {text!r} is {len(ids)} "
                         f"tokens ({parts}): give one of them (mind the leading space)")
    return ids[0]


@dataclass
class ActivationCache:
    """Everything one forward pass over one text computed, per layer.

    tokens / ids: the T tokens. resid_pre, resid_mid, resid_post: L tensors (T, dim), the stream
    entering each block, between its attention and MLP, and leaving it. z: L tensors (T, H, Dh),
    each query head's output (the input of ``out_proj``). attn_out, mlp_out: L tensors (T, dim),
    what each sublayer adds. pattern: L tensors (H, T, T), rows = queries. out: the model's output,
    logits (T, V) for a decoder, final hidden states (T, dim) for an encoder.
    """

    tokens: list[str]
    ids: list[int]
    resid_pre: list[Tensor]
    resid_mid: list[Tensor]
    resid_post: list[Tensor]
    z: list[Tensor]
    attn_out: list[Tensor]
    mlp_out: list[Tensor]
    pattern: list[Tensor]
    out: Tensor
    decoder: bool

    @property
    def logits(self) -> Tensor:
        """(T, V) the decoder's next-token logits at every position."""
        if not self.decoder:
            raise InputError("an encoder has no next-token logits; use cache.out (its hidden states)")
        return self.out

    @property
    def n_layers(self) -> int:
        return len(self.resid_pre)

    def names(self) -> list[str]:
        """Every name ``cache[name]`` answers, TransformerLens-style."""
        out = ["hook_embed"]
        for i in range(self.n_layers):
            out += [f"blocks.{i}.hook_{s}" for s in ("resid_pre", "resid_mid", "resid_post", "attn_out",
                                                     "mlp_out")]
            out += [f"blocks.{i}.attn.hook_{s}" for s in ("z", "pattern")]
        return [*out, "logits" if self.decoder else "hidden"]

    def __getitem__(self, name: str) -> Tensor:
        if name == "hook_embed":
            return self.resid_pre[0]
        if name in ("logits", "hidden"):
            return self.logits if name == "logits" else self.out
        parts = name.split(".")
        if len(parts) in (3, 4) and parts[0] == "blocks" and parts[1].isdigit():
            layer, what = int(parts[1]), parts[-1].removeprefix("hook_")
            if layer < self.n_layers and hasattr(self, what) and what in (
                    "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "pattern"):
                return getattr(self, what)[layer]
        raise KeyError(f"no activation named {name!r}; cache.names() lists them "
                       f"(e.g. blocks.0.attn.hook_z)")


def _float(rec: dict[int, Tensor], n: int) -> list[Tensor]:
    return [rec[i][0].float().cpu() for i in range(n)]


@torch.inference_mode()
def run_with_cache(lm: TextModel, text: str | list[int]) -> ActivationCache:
    """Run ``lm`` over ``text`` once and keep every activation (see :class:`ActivationCache`)."""
    return finish(run_with_cache_steps(lm, text))


@torch.inference_mode()  # on a generator: around each of its pieces, whoever runs them
def run_with_cache_steps(lm: TextModel, text: str | list[int]) -> Generator[None, None, ActivationCache]:
    """:func:`run_with_cache` in pieces, one block per ``next`` (:func:`~qkv.lens.hooks.forward_steps`:
    no hook on the model between pieces); the cache is the return value."""
    ids = encode(lm, text)
    model = lm.model
    rec = Recorded()
    x = torch.tensor([ids], device=device_of(model))
    out, weights = yield from forward_steps(model, x, weights=True, record=rec)
    L = shape(model)[0]
    assert weights is not None
    return ActivationCache(
        labels(lm, ids), ids, _float(rec.resid_pre, L), _float(rec.resid_mid, L), _float(rec.resid_post, L),
        _float(rec.z, L), _float(rec.attn_out, L), _float(rec.mlp_out, L),
        [w[0].float().cpu() for w in weights], out[0].float().cpu(), is_decoder(model))
