"""The decoding loop: feed the context, pick a token, append, repeat.

With a KV cache (the default) each step feeds only the newest token and attends over the
stored keys/values: O(T) work per token instead of re-running the whole context, O(T²).

Context policy, shared by both paths so that they produce identical tokens: the model sees
``tokens[start:]`` with at most ``max_seq_len`` tokens. When the sequence outgrows the
context, ``start`` jumps forward so that the newest ``max_seq_len // 2`` tokens remain; the
cached path then rebuilds its cache from that window (one prefill), instead of paying a full
forward pass on every later token as a sliding window would.

Shapes: B batch, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from qkv.generation.sampling import sample_next
from qkv.models.gpt import GPT


def crop_prompt(ids: Tensor, max_seq_len: int) -> tuple[Tensor, bool]:
    """Keep the last ``max_seq_len - 1`` tokens of (B, T) ids (room for one new token)."""
    limit = max(1, max_seq_len - 1)
    if ids.shape[1] <= limit:
        return ids, False
    return ids[:, -limit:], True


def text_pieces(decode: Callable[[Sequence[int]], str], ids: Iterable[int]) -> Iterator[str]:
    """Turn a stream of token ids into a stream of text, whole characters only.

    A byte-level BPE token can end in the middle of a UTF-8 character; text that decodes to a
    trailing U+FFFD is held back until a later token completes it (and flushed as it is at the
    end of the stream).
    """
    out: list[int] = []
    shown = ""
    for i in ids:
        out.append(i)
        text = decode(out)
        if not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text
    rest = decode(out)[len(shown):]
    if rest:
        yield rest


@torch.inference_mode()
def generate(
    model: GPT,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """Yield (B,) new token ids one step at a time (so callers can stream them).

    Args:
        prompt: (B, T0) token ids, T0 >= 1. Longer than the context: cropped (see
            :func:`crop_prompt`; the caller may warn).
        temperature / top_k / top_p: see :func:`qkv.generation.sampling.sample_next`.
        use_cache: decode with a preallocated KV cache (False = full forward each step).
        generator: RNG for sampling, for reproducible output.
    """
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (B, T) with T >= 1, got shape {tuple(prompt.shape)}")
    model.eval()
    W = model.cfg.max_seq_len
    tokens, _ = crop_prompt(prompt, W)
    # The cache never holds more than the context, nor more than this call can produce:
    # sizing it to the need avoids zeroing a (L, B, K, 8192, D) buffer for a short reply.
    cache_len = min(W, tokens.shape[1] + max(max_new_tokens, 1))
    cache = model.make_cache(tokens.shape[0], cache_len) if use_cache else None
    start, fed = 0, 0  # context = tokens[:, start:]; the cache holds tokens[:, start:fed]
    for _ in range(max_new_tokens):
        if tokens.shape[1] - start > W:  # outgrew the context: keep the newest half
            start = tokens.shape[1] - max(1, W // 2)
            fed = start
            if cache is not None:
                cache.reset()
        if cache is None:
            logits = model(tokens[:, start:], last_only=True).logits
        else:
            logits = model(tokens[:, fed:], cache=cache, last_only=True).logits
            fed = tokens.shape[1]
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
        yield nxt
