"""BPETokenizer: byte-level BPE trained offline with HF tokenizers; exact round trip on any text."""

import json
import pydoc_data.topics
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.tokenizers import (
    END_OF_TEXT,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    end_of_text_id,
    load_tokenizer,
    save_tokenizer,
    tokenizer_from_dict,
)

CORPUS = list(pydoc_data.topics.topics.values())  # ~465k characters of Python docs, offline

SAMPLES = [
    "",
    "def f(x):\n    return x + 1\n",
    "Café, naïve, résumé, Ångström, façade",
    "e\u0301 (combining accent) vs é",
    "😀🎉👩‍👩‍👧 emoji, ZWJ sequences",
    "中文字符，日本語のテキスト、한국어",
    "مرحبا بالعالم (right to left)",
    "   leading and trailing spaces   ",
    "\t\t tabs \t and   runs     of  spaces",
    "windows\r\nline\r\nendings\r\n\r\n",
    "\n\n\n\n",
    "\x00\x01\x7f control bytes \u200b zero width \ufeff",
]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(CORPUS, vocab_size=1000)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


@settings(deadline=None)
@given(st.text())
def test_round_trip_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_learns_merges(bpe):
    assert bpe.vocab_size == 1000
    text = "The function returns the value of the expression."
    n = len(bpe.encode(text))
    assert n < len(text.encode("utf-8")) / 2  # merges at work: < 2 bytes per token
    assert len(bpe.encode(" return")) == 1  # a common word in Python docs is one token


def test_unseen_characters_fall_back_to_bytes(bpe):
    ids = bpe.encode("😀")  # never in the training text: 4 UTF-8 bytes, 4 byte tokens
    assert len(ids) == 4 and bpe.decode(ids) == "😀"
    assert bpe.decode(ids[:2]) == "\ufffd"  # a sample cut mid-character does not crash


def test_training_is_deterministic(bpe):
    again = BPETokenizer.train(CORPUS, vocab_size=1000)
    assert again == bpe


def test_small_corpus_gives_smaller_vocab():
    tok = BPETokenizer.train(["aaaa bbbb aaaa"], vocab_size=5000)
    assert 256 < tok.vocab_size < 300
    assert tok.decode(tok.encode("aaaa zzz")) == "aaaa zzz"


def test_save_and_load(bpe, tmp_path):
    path = save_tokenizer(bpe, tmp_path / "tokenizer.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["type"] == "bpe" and data["tokenizer"]["model"]["type"] == "BPE"
    assert data["tokenizer"]["pre_tokenizer"]["type"] == "ByteLevel"
    loaded = load_tokenizer(path)
    assert isinstance(loaded, BPETokenizer) and loaded == bpe
    for text in SAMPLES:
        assert loaded.encode(text) == bpe.encode(text)


def test_corrupt_bpe_dict():
    with pytest.raises(ValueError, match="corrupt BPE tokenizer"):
        tokenizer_from_dict({"type": "bpe", "tokenizer": {"model": "nonsense"}})
    with pytest.raises(ValueError, match="corrupt 'bpe' tokenizer"):
        tokenizer_from_dict({"type": "bpe"})


def test_bad_arguments(bpe):
    with pytest.raises(ValueError, match="vocab_size must be > 257"):
        BPETokenizer.train(["abc"], vocab_size=257)
    with pytest.raises(ValueError, match="min_frequency"):
        BPETokenizer.train(["abc"], vocab_size=300, min_frequency=0)
    with pytest.raises(ValueError, match=r"range \[0, 1000\)"):
        bpe.decode([5, 1000])
    with pytest.raises(ValueError, match="range"):
        bpe.decode([-1])
    with pytest.raises(TypeError, match="takes a str"):
        bpe.encode(b"bytes")


def test_end_of_text_is_the_last_id(bpe):
    """GPT-2's convention: <|endoftext|> is one special token with the last id; a marker in the
    text encodes to it and no merge spans it (the pieces are counted as separate documents)."""
    eot = end_of_text_id(bpe)
    assert eot == bpe.vocab_size - 1 == 999
    assert bpe.encode(END_OF_TEXT) == [eot]
    tok = BPETokenizer.train(["xyxyxy" + END_OF_TEXT + "xyxyxy"] * 50, vocab_size=300)
    ids = tok.encode("xyxyxy" + END_OF_TEXT + "xy")
    assert ids.count(end_of_text_id(tok)) == 1
    assert tok.decode(ids) == "xyxyxy" + END_OF_TEXT + "xy"
    vocab = json.loads(tok.tokenizer.to_str())["model"]["vocab"]
    assert not any("<|" in t or "|>" in t for t in vocab)  # no piece of the marker was merged
    assert end_of_text_id(CharTokenizer("abc")) is None


def test_follows_the_protocol(bpe):
    assert isinstance(bpe, Tokenizer)


def test_missing_tokenizers_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    with pytest.raises(ImportError, match="pip install tokenizers"):
        BPETokenizer.train(["abc"], vocab_size=300)
