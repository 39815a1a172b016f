"""Byte-level BPE tokenizer (GPT-2 style), trained with Hugging Face ``tokenizers``.

Byte-pair encoding starts from the 256 byte values and repeatedly merges the most frequent
adjacent pair into a new token (Sennrich, Haddow & Birch 2016, "Neural Machine Translation of
Rare Words with Subword Units"). Working on UTF-8 bytes rather than characters (Radford et
al. 2019, GPT-2) means every string can be encoded, emojis and CJK included, and decoded back
exactly: there is no unknown token.

``tokenizers`` is an optional dependency (``pip install tokenizers``), imported only when a
BPE tokenizer is built or loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

N_BYTES = 256  # the byte alphabet every byte-level BPE vocabulary starts from


def _tokenizers() -> ModuleType:
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "the BPE tokenizer needs the Hugging Face `tokenizers` package: "
            "pip install tokenizers (or use the character tokenizer)"
        ) from e
    return tokenizers


class BPETokenizer:
    """Byte-level BPE: exact round trip on any Unicode text.

    Build one with :meth:`train` or :meth:`from_dict`; ``tokenizer`` is a
    ``tokenizers.Tokenizer`` with a BPE model, a ByteLevel pre-tokenizer (no prefix space, so
    nothing is added to the text) and a ByteLevel decoder, and no normalizer (nothing removed).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2
    ) -> BPETokenizer:
        """Learn merges from ``texts`` until the vocabulary has ``vocab_size`` tokens.

        Args:
            texts: training texts (e.g. lines or documents); consumed once.
            vocab_size: target vocabulary, >= 257 (256 bytes + at least one merge). A small
                corpus may end with fewer tokens: check ``vocab_size`` afterwards.
            min_frequency: a pair must occur at least this often to be merged.
        """
        if vocab_size <= N_BYTES:
            raise ValueError(
                f"BPE vocab_size must be > {N_BYTES} (the byte alphabet) to learn any merge, "
                f"got {vocab_size}; try 512 or more, or use the character tokenizer"
            )
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
        tk = _tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``: any string, no unknown tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``. Ids that end mid-character decode to U+FFFD (a model's sample may
        stop anywhere). Raises ValueError on an id outside ``[0, vocab_size)``."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(
                f"ids {bad[:5]} are outside this BPE tokenizer's range [0, {n}); were they "
                "produced by a model with a different vocabulary?"
            )
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def to_dict(self) -> dict[str, Any]:
        """``{"type": "bpe", "tokenizer": <tokenizers' own JSON, as an object>}``."""
        return {"type": "bpe", "tokenizer": json.loads(self.tokenizer.to_str())}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BPETokenizer:
        tk = _tokenizers()
        try:
            tok = tk.Tokenizer.from_str(json.dumps(data["tokenizer"]))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            if isinstance(e, KeyError):
                raise
            raise ValueError(f"corrupt BPE tokenizer: `tokenizers` cannot read it ({e})") from e
        return cls(tok)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and other.to_dict() == self.to_dict()

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"
