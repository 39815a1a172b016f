"""Tokenizers behind one small protocol: text -> ids -> text, saved as JSON.

``CharTokenizer`` (one id per character) and ``BPETokenizer`` (byte-level BPE, needs the
optional ``tokenizers`` package). ``save_tokenizer``/``load_tokenizer`` read and write the
``tokenizer.json`` of a run directory.
"""

from qkv.tokenizers.base import (
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_from_dict,
    tokenizer_json,
)
from qkv.tokenizers.bpe import BPETokenizer
from qkv.tokenizers.char import CharTokenizer

__all__ = [
    "BPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "save_tokenizer",
    "tokenizer_from_dict",
    "tokenizer_json",
]
