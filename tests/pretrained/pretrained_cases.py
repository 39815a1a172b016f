"""The inputs shared by the pretrained parity tests and ``make_reference_fixture.py``.

The parity tests compare qkv with the reference implementations live (when transformers and
sentence-transformers are installed) and with ``reference_fixture.json``, which the script
wrote from the same references on the same inputs. Both read the inputs from here, so they can
never drift apart. Nothing in this file imports qkv's models.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

FIXTURE = Path(__file__).with_name("reference_fixture.json")
FIXTURE_MAX_BYTES = 200_000

# A sentence far past MiniLM's 256-token limit (~450 WordPiece tokens), to check truncation.
LONG = " ".join(
    f"Sentence number {i} keeps going, with words like attention, transformers and embeddings."
    for i in range(25)
)

# ---------------------------------------------------------------- MiniLM (uncased WordPiece)

MINILM_TEXTS = [
    "The cat sat on the mat.",
    "Café naïve résumé Ångström façade — ÉCOLE",  # accents are stripped by the uncased normaliser
    "e\u0301 combining accent vs é",
    "中文字符，日本語のテキスト、한국어",  # CJK is split per character; some become [UNK]
    "😀🎉 emoji",
    "12345 3.14159 1,000,000 2024-01-31",
    "Hello!!! What?? (yes) [no] {maybe}; a:b, c/d \"quoted\" 'single' #hash @at $5 50% a&b",
    "   spaces   and\ttabs\nnewlines  ",
    "",
    LONG,
]

# Five-plus sentences of different lengths: a padded batch for the hidden-state comparison.
MINILM_BATCH = [
    "The cat sat on the mat.",
    "A man is playing a guitar on a small stage in front of a quiet audience.",
    "Hi",
    "Transformers compute attention between every pair of tokens, then mix the values.",
    "Café naïve résumé, 3.14159!",
    "Where, exactly, is the capital of France?",
]

# The sentences whose embeddings are stored in the fixture (the last one is truncated).
MINILM_EMBED = ["The cat sat on the mat.", "Café naïve résumé: 12345 3.14159!", LONG]

# ---------------------------------------------------------------- SmolLM2 (byte-level BPE)

SMOLLM2_TEXTS = [
    "Once upon a time",
    "Café naïve résumé Ångström façade",
    "中文字符，日本語のテキスト、한국어",
    "😀🎉👩\u200d👩\u200d👧 emoji with ZWJ",
    "مرحبا بالعالم",
    "12345 3.14159",
    "a    b\n\n\tc",
    "\r\n\r\n  leading and trailing   ",
    "don't I'll we've",
    "<|im_start|>user\nhi<|im_end|>",  # control tokens written in the text map to their ids
    "x<|im_start|>y<|endoftext|>z",
    "<|im_start",  # a prefix of a control token is ordinary text
    "def f(x):\n    return x ** 2\n",
    "",
]

# Chat conversations rendered through the GGUF's ChatML template (a system message, when
# present, comes first; without one the template inserts its default).
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Arr!"},
        {"role": "user", "content": "Où est la Tour Eiffel ? 🗼"},
    ],
]

# Prompts continued greedily for GREEDY_TOKENS tokens; logits of the first LOGIT_PROMPTS.
# All are 5 tokens long, so that they can also be decoded as one batch (qkv's GPT takes no
# padding mask): a story, a fact, code.
SMOLLM2_PROMPTS = ["Once upon a time,", "The capital of France is", "def fib(n):"]
PROMPT_TOKENS = 5
LOGIT_PROMPTS = SMOLLM2_PROMPTS[:2]
GREEDY_TOKENS = 32
TOP_K = 20


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy (argmax) tokens from a transformers causal LM, with its own KV cache.

    Written out rather than calling ``model.generate``, which would stop at the end-of-text
    token: qkv's decoding loop is compared over all ``n`` tokens.
    """
    # transformers >= 5.2x names the cache argument ``cache``; earlier, ``past_key_values``.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    x = torch.tensor([ids])
    past, out = None, []
    for _ in range(n):
        o = model(input_ids=x, use_cache=True, **{name: past})
        past = o[name]
        x = o.logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(x))
    return out


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Ids of ``messages`` through a transformers tokenizer's chat template, assistant turn open."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def load_fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))
