"""Byte-level BPE tokenizer (GPT-2 style), trained with Hugging Face ``tokenizers``.

Byte-pair encoding starts from the 256 byte values and repeatedly merges the most frequent
adjacent pair into a new token (Sennrich, Haddow & Birch 2016, "Neural Machine Translation of
Rare Words with Subword Units"). Working on UTF-8 bytes rather than characters (Radford et
al. 2019, GPT-2) means every string can be encoded, emojis and CJK included, and decoded back
exactly: there is no unknown token.

``tokenizers`` is an optional dependency (``pip install tokenizers``), imported only when a
BPE tokenizer is built or loaded.

Every vocabulary qkv trains ends with one special token, ``<|endoftext|>`` (GPT-2's end of a
document, at the last id as in GPT-2): a text that contains the marker between its documents
trains the model to end them, ``qkv generate`` stops there, and an export names it as the
end-of-text token, so that llama.cpp and ``transformers`` stop where qkv does. Runs trained
before the marker existed have none (:func:`end_of_text_id` is None for them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from qkv.tokenizers.hf import HFTokenizer, hf_tokenizers

N_BYTES = 256  # the byte alphabet every byte-level BPE vocabulary starts from
END_OF_TEXT = "<|endoftext|>"  # the special token that ends a document (GPT-2's)


def end_of_text_id(tok: Any) -> int | None:
    """The id of ``<|endoftext|>`` in ``tok``'s vocabulary, or None (a character tokenizer, a
    BPE run trained before qkv reserved it)."""
    return tok.token_to_id(END_OF_TEXT) if isinstance(tok, HFTokenizer) else None


def stop_ids(tok: Any) -> tuple[int, ...]:
    """The ids that end a trained run's generation: its ``<|endoftext|>``, if it has one."""
    eot = end_of_text_id(tok)
    return () if eot is None else (eot,)


class BPETokenizer(HFTokenizer):
    """Byte-level BPE: exact round trip on any Unicode text.

    Build one with :meth:`train` or :meth:`from_dict`; ``tokenizer`` is a
    ``tokenizers.Tokenizer`` with a BPE model, a ByteLevel pre-tokenizer (no prefix space, so
    nothing is added to the text) and a ByteLevel decoder, and no normalizer (nothing removed).
    """

    kind: ClassVar[str] = "bpe"

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2
    ) -> BPETokenizer:
        """Learn merges from ``texts`` until the vocabulary has ``vocab_size`` tokens, the last
        of them ``<|endoftext|>``.

        Args:
            texts: training texts (e.g. lines or documents); consumed once. A literal
                ``<|endoftext|>`` in them separates documents: no merge is learned across it.
            vocab_size: target vocabulary, >= 258 (256 bytes, at least one merge, the end of
                text). A small corpus may end with fewer tokens: check ``vocab_size`` afterwards.
            min_frequency: a pair must occur at least this often to be merged.
        """
        if vocab_size <= N_BYTES + 1:
            raise ValueError(
                f"BPE vocab_size must be > {N_BYTES + 1} (the byte alphabet and <|endoftext|>) to "
                "learn any merge, "
                f"got {vocab_size}; try 512 or more, or use the character tokenizer"
            )
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
        tk = hf_tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size - 1,  # the last id is <|endoftext|>
            min_frequency=min_frequency,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator(_documents(texts), trainer=trainer)
        tok.add_special_tokens([tk.AddedToken(END_OF_TEXT, special=True, normalized=False)])
        return cls(tok)


def _documents(texts: Iterable[str]) -> Iterator[str]:
    """The pieces of ``texts`` between ``<|endoftext|>`` markers (the marker is a token of its
    own, never a merge)."""
    for text in texts:
        yield from text.split(END_OF_TEXT)
