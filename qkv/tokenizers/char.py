"""Character-level tokenizer: one id per distinct character of the training text.

The tokenizer of nanoGPT's ``shakespeare_char`` and Karpathy's "Let's build GPT": ids are the
positions of the characters in the sorted set of the corpus's characters (65 for Shakespeare
in nanoGPT's version). Tiny vocabulary, long sequences, exact round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

_SHOW = 5  # how many offending characters / ids an error message lists


class CharTokenizer:
    """Maps each character seen in training to an id in ``0 .. V-1`` (sorted by code point).

    Args:
        chars: the training text, or any iterable of single characters; duplicates are
            dropped and the rest sorted, so ``CharTokenizer(text)`` is the usual call.
    """

    def __init__(self, chars: Iterable[str]) -> None:
        vocab = sorted(set(chars))
        bad = [c for c in vocab if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(
                f"CharTokenizer needs single characters, got {bad[:_SHOW]!r}; pass the "
                "training text itself (a str)"
            )
        if not vocab:
            raise ValueError("CharTokenizer needs a non-empty training text to learn characters")
        self.chars: list[str] = vocab
        self._stoi = {c: i for i, c in enumerate(vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of each character of ``text``.

        Raises:
            ValueError: ``text`` has characters the training corpus did not (named, first few).
        """
        stoi = self._stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            unseen = sorted({c for c in text if c not in stoi})
            shown = ", ".join(repr(c) for c in unseen[:_SHOW])
            more = f" and {len(unseen) - _SHOW} more" if len(unseen) > _SHOW else ""
            raise ValueError(
                f"text has {len(unseen)} character(s) this character tokenizer never saw: "
                f"{shown}{more}; the model knows only the {self.vocab_size} characters of its "
                "training corpus, so remove them from the text or retrain on text that has them"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``. Raises ValueError on an id outside ``[0, vocab_size)``."""
        chars, n = self.chars, len(self.chars)
        try:
            # chars[n] raises IndexError, so negative ids fail too instead of wrapping around.
            return "".join(chars[i] if i >= 0 else chars[n] for i in map(int, ids))
        except IndexError:
            bad = [int(i) for i in ids if not 0 <= int(i) < n][:_SHOW]
            raise ValueError(
                f"ids {bad} are outside this character tokenizer's range [0, {n}); were they "
                "produced by a model with a different vocabulary?"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharTokenizer:
        chars = data["chars"]
        if not isinstance(chars, list) or sorted(set(chars)) != chars:
            raise ValueError("corrupt char tokenizer: \"chars\" must be a sorted list of "
                             "distinct characters")
        return cls(chars)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
