"""HFTokenizer: qkv's protocol around a Hugging Face ``tokenizers.Tokenizer``. A tiny BERT-style
WordPiece tokenizer built in code (no asset): encode with and without [CLS]/[SEP], JSON round
trip, batch encoding with padding and truncation (checked against the Rust library's own
truncation), decode and its range check."""

from __future__ import annotations

import json

import pytest

from qkv.tokenizers import BPETokenizer, Tokenizer, load_tokenizer, save_tokenizer, tokenizer_from_dict
from qkv.tokenizers.base import tokenizer_json
from qkv.tokenizers.hf import HFTokenizer

tk = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", ".", ",", "!", "##s", "##ing"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS)}
PAD, UNK, CLS, SEP = range(4)


def wordpiece() -> tk.Tokenizer:
    """Uncased WordPiece with BERT's normaliser, pre-tokeniser, [CLS] $A [SEP] and decoder."""
    tok = tk.Tokenizer(tk.models.WordPiece(VOCAB, unk_token="[UNK]"))
    tok.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)]
    )
    tok.decoder = tk.decoders.WordPiece()
    tok.add_special_tokens(SPECIAL)  # registered as special (as in BERT's tokenizer.json): same ids
    return tok


@pytest.fixture
def bert() -> HFTokenizer:
    return HFTokenizer(wordpiece(), add_special_tokens=True)


def ids_of(*words: str) -> list[int]:
    return [VOCAB[w] for w in words]


# --------------------------------------------------------------------------- encode / decode


def test_encode_with_and_without_special_tokens(bert: HFTokenizer) -> None:
    body = ids_of("the", "cat", "sat", "on", "the", "mat", ".")
    assert bert.encode("The cat sat on the mat.") == [CLS, *body, SEP]
    assert bert.encode("The cat sat on the mat.", add_special_tokens=False) == body
    assert HFTokenizer(wordpiece()).encode("The cat") == ids_of("the", "cat")  # default: off
    assert bert.encode("cats running zebra") == [CLS, *ids_of("cat", "##s"), UNK, UNK, SEP]
    assert bert.encode("") == [CLS, SEP]


def test_protocol_and_vocabulary(bert: HFTokenizer) -> None:
    assert isinstance(bert, Tokenizer)
    assert bert.vocab_size == len(VOCAB)
    assert bert.token_to_id("[SEP]") == SEP and bert.token_to_id("zebra") is None
    assert repr(bert) == f"HFTokenizer(vocab_size={len(VOCAB)})"
    with pytest.raises(TypeError, match="str"):
        bert.encode(["the cat"])  # type: ignore[arg-type]


def test_decode(bert: HFTokenizer) -> None:
    ids = bert.encode("The cats ran far!")
    assert bert.decode(ids, skip_special_tokens=True) == "the cats ran far!"
    assert bert.decode(ids).startswith("[CLS] the cats") and bert.decode(ids).endswith("[SEP]")
    assert bert.decode([]) == ""


@pytest.mark.parametrize("bad", [len(VOCAB), 10**6, -1])
def test_decode_rejects_ids_outside_the_vocabulary(bert: HFTokenizer, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"outside this tokenizer's range \[0, {len(VOCAB)}\)"):
        bert.decode([CLS, bad, SEP])
    assert bert.decode([len(VOCAB) - 1]) == "##ing"  # the last id is fine


# --------------------------------------------------------------------------- serialisation


def test_to_dict_from_dict_round_trip(bert: HFTokenizer) -> None:
    d = bert.to_dict()
    assert d["type"] == "hf" and d["add_special_tokens"] is True
    d = json.loads(json.dumps(d))  # plain JSON, nothing pickled
    back = HFTokenizer.from_dict(d)
    assert back == bert and back.add_special_tokens
    for text in ["The cat sat on the mat.", "dogs, running far!", "", "zebra"]:
        assert back.encode(text) == bert.encode(text)
        assert back.decode(back.encode(text)) == bert.decode(bert.encode(text))
    plain = HFTokenizer(wordpiece())
    assert "add_special_tokens" not in plain.to_dict()
    assert HFTokenizer.from_dict(plain.to_dict()).add_special_tokens is False
    assert plain != bert  # the flag is part of the tokenizer


def test_save_and_load_through_the_registry(bert: HFTokenizer, tmp_path) -> None:
    path = save_tokenizer(bert, tmp_path / "tokenizer.json")
    back = load_tokenizer(path)
    assert type(back) is HFTokenizer and back == bert
    assert tokenizer_json(back) == tokenizer_json(bert)  # byte-equal JSON
    assert type(tokenizer_from_dict(bert.to_dict())) is HFTokenizer


def test_from_file(bert: HFTokenizer, tmp_path) -> None:
    good = tmp_path / "tokenizer.json"
    good.write_text(bert.tokenizer.to_str(), encoding="utf-8")
    assert HFTokenizer.from_file(str(good), add_special_tokens=True) == bert
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=r"not a readable tokenizer\.json"):
        HFTokenizer.from_file(str(bad))


def test_corrupt_dict_is_a_value_error(bert: HFTokenizer) -> None:
    with pytest.raises(ValueError, match="corrupt"):
        HFTokenizer.from_dict({"type": "hf", "tokenizer": {"model": "nonsense"}})
    with pytest.raises(ValueError, match="corrupt"):
        tokenizer_from_dict({"type": "hf"})  # no "tokenizer" field


def test_bpe_is_an_hf_tokenizer_with_its_own_type() -> None:
    bpe = BPETokenizer.train(["the cat sat on the mat"] * 20, vocab_size=270)
    assert isinstance(bpe, HFTokenizer) and bpe.to_dict()["type"] == "bpe"
    assert type(tokenizer_from_dict(bpe.to_dict())) is BPETokenizer
    assert HFTokenizer(bpe.tokenizer) != bpe  # same tokenizer, different type


# --------------------------------------------------------------------------- batches

TEXTS = ["The cat sat on the mat.", "A dog ran.", "", "the cats, the dogs, the mats ran far far far!"]


def test_encode_batch_pads_to_the_longest(bert: HFTokenizer) -> None:
    ids, lengths = bert.encode_batch(TEXTS, pad_id=PAD)
    singles = [bert.encode(t) for t in TEXTS]
    assert lengths == [len(s) for s in singles]
    width = max(lengths)
    for row, single in zip(ids, singles, strict=True):
        assert len(row) == width
        assert row == single + [PAD] * (width - len(single))
    other, _ = bert.encode_batch(TEXTS, pad_id=99)
    assert other[2] == [CLS, SEP] + [99] * (width - 2)
    assert bert.encode_batch([]) == ([], [])


@pytest.mark.parametrize("max_length", [3, 5, 8, 100])
def test_encode_batch_truncation_keeps_sep(bert: HFTokenizer, max_length: int) -> None:
    ids, lengths = bert.encode_batch(TEXTS, max_length=max_length)
    # The reference: the Rust library's own truncation, which BERT pipelines use.
    ref = wordpiece()
    ref.enable_truncation(max_length)
    for row, n, text in zip(ids, lengths, TEXTS, strict=True):
        expected = ref.encode(text).ids
        assert row[:n] == expected
        assert n == min(len(bert.encode(text)), max_length)
        assert row[0] == CLS and row[n - 1] == SEP


def test_encode_batch_type_errors(bert: HFTokenizer) -> None:
    with pytest.raises(TypeError, match="sequence of str"):
        bert.encode_batch("the cat")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of str"):
        bert.encode_batch(["the cat", 3])  # type: ignore[list-item]


def test_encode_batch_truncation_without_special_tokens_keeps_a_prefix() -> None:
    bpe = BPETokenizer.train(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=280)
    text = "the quick brown fox jumps over the lazy dog"
    full = bpe.encode(text)
    assert len(full) > 4
    ids, lengths = bpe.encode_batch([text], max_length=4)
    assert ids[0][: lengths[0]] == full[:4]


@pytest.mark.parametrize("max_length", [3, 4, 6, 9])
def test_encode_batch_never_exceeds_max_length(bert: HFTokenizer, max_length: int) -> None:
    ids, lengths = bert.encode_batch(TEXTS, max_length=max_length, pad_id=PAD)
    full = [bert.encode(t) for t in TEXTS]  # untruncated, one text at a time
    # Each row keeps min(its length, max_length) ids; a truncated one keeps [CLS], the text's
    # first max_length - 2 word pieces, then [SEP].
    assert lengths == [min(len(f), max_length) for f in full]
    assert max(lengths) <= max_length and all(len(row) == max(lengths) for row in ids)
    for row, n, f in zip(ids, lengths, full, strict=True):
        assert row[:n] == (f if len(f) <= max_length else [*f[: max_length - 1], SEP])
        assert row[n:] == [PAD] * (len(row) - n)
    assert max(len(f) for f in full) > max_length  # the limit did cut something


@pytest.mark.parametrize("max_length", [0, 1, 2])
def test_encode_batch_rejects_a_limit_without_room_for_text(bert: HFTokenizer, max_length: int) -> None:
    # [CLS] and [SEP] take 2 of the ids: a limit of 2 or less leaves none for the text.
    with pytest.raises(ValueError, match="max_length must be > 2"):
        bert.encode_batch(TEXTS, max_length=max_length)
    bpe = BPETokenizer.train(["the cat sat on the mat"] * 20, vocab_size=270)  # adds no special tokens
    with pytest.raises(ValueError, match="max_length must be > 0"):
        bpe.encode_batch(["the cat"], max_length=0)
    ids, lengths = bpe.encode_batch(["the cat sat", "a"], max_length=1)
    assert lengths == [1, 1] and ids[0] == bpe.encode("the cat sat")[:1]
