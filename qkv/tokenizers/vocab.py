"""Symbol vocabularies of the seq2seq and captioning models: characters or words <-> ids, with
four special ids shared by every such model (declared here, once).

Ids: 0 = padding, 1 = BOS (begin), 2 = EOS (end), 3 = unknown; the symbols seen in training
follow, sorted. Saved in a run's ``config.json`` as the symbol list.
"""

from __future__ import annotations

from collections.abc import Sequence

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class CharVocab:
    """Characters <-> ids; ids 0-3 are padding, BOS, EOS and unknown. Subclasses change what a
    symbol is by overriding ``split`` and ``join`` (words: :class:`WordVocab`)."""

    def __init__(self, symbols: Sequence[str]) -> None:
        self.itos = list(SPECIALS) + [c for c in symbols if c not in SPECIALS]
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    @staticmethod
    def split(text: str) -> list[str]:
        return list(text)

    @staticmethod
    def join(symbols: Sequence[str]) -> str:
        return "".join(symbols)

    @classmethod
    def build(cls, texts: Sequence[str]) -> CharVocab:
        return cls(sorted({c for t in texts for c in cls.split(t)}))

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, UNK) for c in self.split(text)]

    def unknown(self, text: str) -> list[str]:
        return sorted({c for c in self.split(text) if c not in self.stoi})

    def decode(self, ids: Sequence[int]) -> str:
        return self.join([self.itos[i] for i in ids if i >= len(SPECIALS)])

    def symbols(self) -> list[str]:
        return self.itos[len(SPECIALS):]


class WordVocab(CharVocab):
    """Words <-> ids (split at spaces), with the same special ids as :class:`CharVocab`."""

    @staticmethod
    def split(text: str) -> list[str]:
        return text.split()

    @staticmethod
    def join(symbols: Sequence[str]) -> str:
        return " ".join(symbols)
