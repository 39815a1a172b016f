"""Streaming text out of token ids: whole characters only, and the first piece reads as it
does after the prompt (a SentencePiece decoder drops the space that begins a text)."""

from __future__ import annotations

import pytest

from qkv.generation.decode import decode_after, text_pieces

tokenizers = pytest.importorskip("tokenizers")


def _sentencepiece():
    """A Llama-style vocabulary: "▁" marks a space, the decoder drops the text's first one."""
    pieces = ["<unk>", "▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁."]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({p: i for i, p in enumerate(pieces)},
                                                           unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = tokenizers.decoders.Metaspace(prepend_scheme="first")
    return tok, {p: i for i, p in enumerate(pieces)}


def test_the_first_new_word_keeps_its_space() -> None:
    tok, ids = _sentencepiece()
    decode = tok.decode
    prompt = tok.encode("the cat").ids
    assert prompt == [ids["▁the"], ids["▁cat"]]
    new = [ids["▁sat"], ids["▁on"], ids["▁the"], ids["▁mat"], ids["▁."]]
    assert decode(new) == "sat on the mat ."  # alone, the reply's first space is gone
    assert "".join(text_pieces(decode, iter(new), context=prompt)) == " sat on the mat ."
    assert list(text_pieces(decode, iter(new[:2]), context=prompt)) == [" sat", " on"]
    assert decode_after(decode, prompt, [ids["▁sat"]]) == " sat"
    assert "".join(text_pieces(decode, iter(new))) == "sat on the mat ."  # no prompt: as decoded


def test_a_character_split_over_tokens_is_held_back() -> None:
    """Byte-level BPE: "é" is two byte tokens; nothing is shown until both have come."""
    from qkv.tokenizers import BPETokenizer

    bpe = BPETokenizer.train(["plain ascii text only"] * 10, vocab_size=300)
    ids = bpe.encode("café")
    prompt, new = ids[:2], ids[2:]
    pieces = list(text_pieces(bpe.decode, iter(new), context=prompt))
    assert "".join(pieces) == "café"[len(bpe.decode(prompt)):]
    assert all("\ufffd" not in p for p in pieces)


def test_each_step_decodes_a_bounded_number_of_ids() -> None:
    """Streaming 2,000 tokens after a 5,000-token prompt decodes a few ids per token, not the
    whole reply (or prompt) again each step; the text is the whole decode's."""
    tok, ids = _sentencepiece()
    seen = []

    def decode(part):
        seen.append(len(part))
        return tok.decode(list(part))

    prompt = [ids["▁the"]] * 5000
    new = [ids["▁cat"], ids["▁sat"]] * 1000
    text = "".join(text_pieces(decode, iter(new), context=prompt))
    assert text == tok.decode(prompt + new)[len(tok.decode(prompt)):]
    assert sum(seen) <= 2 * 20 * len(new)  # two decodes of at most 8 + a few ids per token
