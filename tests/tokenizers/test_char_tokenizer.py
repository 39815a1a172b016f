"""CharTokenizer, and the shared JSON format (save_tokenizer / load_tokenizer) it goes through."""

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkv.tokenizers import CharTokenizer, Tokenizer, load_tokenizer, save_tokenizer
from qkv.tokenizers import base as tokenizers_base

TEXT = "To be, or not to be: that is the question.\r\n\tÉté — 中文 😀  \n\n"


def test_ids_are_positions_in_sorted_characters():
    tok = CharTokenizer("hello")
    assert tok.chars == ["e", "h", "l", "o"]
    assert tok.vocab_size == 4
    assert tok.encode("hello") == [1, 0, 2, 2, 3]
    assert tok.decode([3, 2, 0]) == "ole"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_round_trip_on_its_training_text():
    tok = CharTokenizer(TEXT)
    assert tok.vocab_size == len(set(TEXT))
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT) and max(ids) == tok.vocab_size - 1 and min(ids) == 0
    assert tok.decode(ids) == TEXT


@given(st.text(min_size=1))
def test_round_trip_any_text(text):
    tok = CharTokenizer(text)
    assert tok.decode(tok.encode(text)) == text


def test_decode_accepts_numpy_and_torch_ints():
    import numpy as np
    import torch

    tok = CharTokenizer("abc")
    assert tok.decode(np.array([2, 0], dtype=np.uint16)) == "ca"
    assert tok.decode(torch.tensor([1, 1])) == "bb"


def test_unseen_characters_are_named():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError) as e:
        tok.encode("abcé😀é")
    msg = str(e.value)
    assert "2 character(s)" in msg and "'é'" in msg and "'😀'" in msg
    assert "3 characters of its training corpus" in msg and "\n" not in msg


def test_unseen_characters_message_is_truncated():
    tok = CharTokenizer("a")
    with pytest.raises(ValueError, match=r"'b', 'c', 'd', 'e', 'f' and 3 more"):
        tok.encode("abcdefghi")


@pytest.mark.parametrize("ids", [[0, 3], [-1], [1, 99, 5]])
def test_decode_rejects_out_of_range_ids(ids):
    with pytest.raises(ValueError, match=r"outside this character tokenizer's range \[0, 3\)"):
        CharTokenizer("abc").decode(ids)


@pytest.mark.parametrize("chars", ["", [], ["ab", "c"]])
def test_bad_vocabulary(chars):
    with pytest.raises(ValueError, match="CharTokenizer needs"):
        CharTokenizer(chars)


def test_follows_the_protocol():
    assert isinstance(CharTokenizer("ab"), Tokenizer)


# --------------------------------------------------------------------------- JSON format


def test_save_and_load(tmp_path):
    tok = CharTokenizer(TEXT)
    path = save_tokenizer(tok, tmp_path / "tokenizer.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == {"type": "char", "chars": sorted(set(TEXT))}
    loaded = load_tokenizer(path)
    assert isinstance(loaded, CharTokenizer) and loaded == tok
    assert loaded.encode(TEXT) == tok.encode(TEXT)
    assert os.listdir(tmp_path) == ["tokenizer.json"]  # no temp file left behind


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    save_tokenizer(CharTokenizer("old"), path)
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizers_base.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_tokenizer(CharTokenizer("new text"), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["tokenizer.json"]


@pytest.mark.parametrize("content, match", [
    ("{not json", "corrupt: not valid JSON"),
    ("[1, 2]", "not a qkv tokenizer"),
    ('{"chars": ["a"]}', "not a qkv tokenizer"),
    ('{"type": "wordpiece"}', "unknown tokenizer type 'wordpiece'"),
    ('{"type": "char"}', "corrupt 'char' tokenizer"),
    ('{"type": "char", "chars": ["b", "a"]}', "sorted list of distinct characters"),
])
def test_load_rejects_bad_files(tmp_path, content, match):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        load_tokenizer(path)
    assert str(path) in str(e.value) or "sorted" in match


def test_load_missing_and_binary_files(tmp_path):
    with pytest.raises(ValueError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read tokenizer file"):
        load_tokenizer(tmp_path / "bin.json")
