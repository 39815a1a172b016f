"""Tokenizers held by Hugging Face ``tokenizers``: pretrained ones (MiniLM's WordPiece, SmolLM2's
byte-level BPE) and, as the subclass :class:`~qkv.tokenizers.bpe.BPETokenizer`, ones qkv trains.

The Rust library does the string work (normalisation, pre-tokenisation regexes, merges,
special tokens); qkv only wraps it in its small protocol (``encode``/``decode``/``vocab_size``/
``to_dict``) and adds batch encoding with padding for encoders.
``tokenizers`` is an optional dependency, imported only when such a tokenizer is built or loaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar


def hf_tokenizers() -> ModuleType:
    """The ``tokenizers`` module, or ImportError saying how to install it."""
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "this tokenizer needs the Hugging Face `tokenizers` package: pip install tokenizers"
        ) from e
    return tokenizers


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind qkv's protocol.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` (e.g. ``Tokenizer.from_file("tokenizer.json")``).
        add_special_tokens: default for :meth:`encode`: add the tokenizer's post-processor
            tokens ([CLS] ... [SEP] for BERT; nothing for byte-level BPE).
    """

    kind: ClassVar[str] = "hf"

    def __init__(self, tokenizer: Any, add_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_file(cls, path: str, add_special_tokens: bool = False) -> HFTokenizer:
        """Read a ``tokenizer.json``; ValueError if ``tokenizers`` cannot parse it."""
        tk = hf_tokenizers()
        try:
            tok = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path} is not a readable tokenizer.json ({e})") from None
        return cls(tok, add_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. ``"<|im_end|>"``), or None."""
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Ids of ``text``; special tokens written in the text (``<|im_start|>``) map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(text, add_special_tokens=add).ids

    def encode_batch(
        self, texts: Sequence[str], max_length: int | None = None, pad_id: int = 0
    ) -> tuple[list[list[int]], list[int]]:
        """Encode several texts (with special tokens), truncating each to ``max_length`` ids.

        Returns (ids padded with ``pad_id`` to the longest, true lengths).
        """
        ids = self.encode_many(texts, max_length)
        lengths = [len(i) for i in ids]
        width = max(lengths, default=0)
        return [i + [pad_id] * (width - len(i)) for i in ids], lengths

    def encode_many(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        """Ids of each text (with special tokens, truncated to ``max_length``), unpadded; the
        parallel Rust encoder does the work."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch() takes a sequence of str")
        n_special = self.tokenizer.num_special_tokens_to_add(False)
        if max_length is not None and max_length <= n_special:
            raise ValueError(f"max_length must be > {n_special} (the special tokens this "
                             f"tokenizer adds), got {max_length}")
        if max_length is not None:
            # The library truncates the text and keeps the special tokens ([CLS] ... [SEP]).
            self.tokenizer.enable_truncation(max_length)
        try:
            encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        finally:
            if max_length is not None:
                self.tokenizer.no_truncation()
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Ids that end mid-character decode to U+FFFD (a model's sample may
        stop anywhere). ValueError on an id outside ``[0, vocab_size)``."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(
                f"ids {bad[:5]} are outside this tokenizer's range [0, {n}); were they "
                "produced by a model with a different vocabulary?"
            )
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_dict(self) -> dict[str, Any]:
        """``{"type": kind, "tokenizer": <tokenizers' own JSON, as an object>}``."""
        d: dict[str, Any] = {"type": self.kind, "tokenizer": json.loads(self.tokenizer.to_str())}
        if self.add_special_tokens:
            d["add_special_tokens"] = True
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HFTokenizer:
        tk = hf_tokenizers()
        try:
            tok = tk.Tokenizer.from_str(json.dumps(data["tokenizer"]))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            if isinstance(e, KeyError):
                raise
            raise ValueError(
                f"corrupt {cls.kind.upper()} tokenizer: `tokenizers` cannot read it ({e})"
            ) from e
        return cls(tok, bool(data.get("add_special_tokens", False)))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
