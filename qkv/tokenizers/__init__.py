"""Tokenizers behind one small protocol: text -> ids -> text, saved as JSON.

``CharTokenizer`` (one id per character), ``BPETokenizer`` (byte-level BPE trained by qkv) and
``HFTokenizer`` (pretrained WordPiece / BPE from a ``tokenizer.json`` or GGUF metadata); the
last two need the optional ``tokenizers`` package. ``save_tokenizer``/``load_tokenizer`` read
and write the ``tokenizer.json`` of a run directory.
"""

from qkv.tokenizers.base import (
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_from_dict,
    tokenizer_json,
)
from qkv.tokenizers.bpe import END_OF_TEXT, BPETokenizer, end_of_text_id, stop_ids
from qkv.tokenizers.char import CharTokenizer
from qkv.tokenizers.hf import HFTokenizer

__all__ = [
    "END_OF_TEXT",
    "BPETokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "end_of_text_id",
    "load_tokenizer",
    "save_tokenizer",
    "stop_ids",
    "tokenizer_from_dict",
    "tokenizer_json",
]
