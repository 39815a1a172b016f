"""Llama-style SentencePiece GGUF files (Llama-2, TinyLlama, Mistral, CodeLlama): a tiny random
LlamaForCausalLM and a small SentencePiece BPE vocabulary, written here as llama.cpp's converter
writes a Llama-2 model (``tokenizer.ggml.model`` "llama": pieces with "▁" for a space and their
scores, <unk> <s> </s>, the 256 <0xNN> byte tokens, token types, bos/eos/unk ids, add_bos_token,
add_space_prefix; Q/K rows permuted). The reference is transformers reading the same file:
``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` and ``AutoModelForCausalLM`` likewise,
except where its tokenizer parts from the original SentencePiece one (DISPUTED: worked out by
hand), and a vocabulary trained with sentencepiece itself, whose own ids are the reference.

The vocabulary's merged pieces are written in the reverse of their score order (llama.cpp's
converter writes sentencepiece's order, which is by score): only the scores can then rank the
merges right ("her" is "▁", "he", "r", not "▁her" through "er").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call, dev_package

transformers = dev_package("transformers")
gguf = dev_package("gguf")
dev_package("tokenizers")

from pretrained.gguf_writing import (  # noqa: E402
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    add_hf_tensor,
    add_sizes,
    finish,
    open_gguf,
    permute_qk,
    transformers_tokenizer,
)

import qkv  # noqa: E402
from qkv.generation import generate  # noqa: E402
from qkv.pretrained import PretrainedFormatError  # noqa: E402

# The merges the vocabulary was "trained" with, best first; each one's joined piece scores -rank.
MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("n", "d"), ("▁a", "nd"), ("▁", "c"),
          ("a", "t"), ("▁c", "at"), ("▁", "h"), ("▁h", "at"), ("e", "r"), ("▁h", "er"), ("▁", "▁"),
          ("▁▁", "▁▁"), ("▁", "s"), ("▁s", "at"), ("▁", "m"), ("▁m", "at"), ("▁", "H"), ("e", "l"),
          ("l", "o"), ("▁H", "el"), ("▁Hel", "lo"), ("▁", "W"), ("h", "o"), ("▁W", "ho"), ("o", "n"),
          ("▁", "on")]
CHARS = list("▁abcdefghijklmnopqrstuvwxyzHW,.!?")  # scored below every merged piece, as in Llama-2
ADDED = "<|user|>"  # an added_tokens.json token: llama.cpp writes it user-defined, score -1000


def llama_vocab() -> tuple[list[str], list[float], list[int]]:
    """Llama-2's layout in small: <unk> <s> </s>, the 256 byte tokens, pieces, added tokens."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    scores = [0.0] * len(tokens)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    merged = [(a + b, -float(rank)) for rank, (a, b) in enumerate(MERGES)]
    for piece, score in [*reversed(merged), *((c, -100.0 - i) for i, c in enumerate(CHARS))]:
        tokens.append(piece)
        scores.append(score)
        types.append(NORMAL)
    return [*tokens, ADDED], [*scores, -1000.0], [*types, USER_DEFINED]


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(llama_vocab()[0]), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, initializer_range=0.1)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def write_llama_gguf(ref, path: Path, space_prefix: bool | None = True, scores: bool = True) -> None:
    """As convert_hf_to_gguf.py's LlamaModel writes a Llama-2 checkpoint (F32): its metadata keys,
    the sentencepiece vocabulary (tokens, scores, types) with the special ids and add_bos_token /
    add_eos_token as the gguf package's SpecialVocab writes them, Q/K rows permuted, the untied
    lm_head kept.
    ``space_prefix`` None: no add_space_prefix key (llama.cpp's default for llama is true)."""
    c = ref.config
    w, names = open_gguf(path, gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    add_sizes(w, context=c.max_position_embeddings, embedding=c.hidden_size, blocks=c.num_hidden_layers,
              feed_forward=c.intermediate_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, piece_scores, types = llama_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    if scores:
        w.add_token_scores(piece_scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    for hf_name, t in ref.state_dict().items():
        a = t.detach().float().numpy().copy()
        add_hf_tensor(w, names, hf_name, permute_qk(hf_name, a, c.num_attention_heads, c.num_key_value_heads))
    finish(w)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory) -> tuple[object, Path]:
    ref = tiny_llama()
    path = tmp_path_factory.mktemp("llama-gguf") / "tiny-llama.gguf"
    write_llama_gguf(ref, path)
    return ref, path


TEXTS = ["the cat and the hat", "the  cat   sat    ", "Hello\nthe hat\n\n", "her hat, the cat! Who?",
         "héllo wörld", "the cat 😀", "the cat</s>", ""]
# Where transformers' GGUF reader parts from the original tokenizer: SentencePiece's dummy prefix
# goes in front of every run of text, one that begins with a space too (" the" is "▁▁the"), and
# after a special token written in the text, as SentencePiece, Llama-2's tokenizer.json and
# llama.cpp put it (transformers' reader puts it only where the text does not begin with a
# space). The merges then run over the whole text by score, as llama.cpp's do: worked out by
# hand from MERGES ("▁▁" outranks "on", "▁a" outranks "at").
DISPUTED = {
    " the cat sat on the mat": ["<s>", "▁", "▁the", "▁cat", "▁sat", "▁on", "▁the", "▁mat"],
    "the cat</s><s> on the mat<|user|>Who": ["<s>", "▁the", "▁cat", "</s>", "<s>", "▁▁", "on", "▁the",
                                             "▁mat", "<|user|>", "▁Who"],
    "<unk>at": ["<s>", "<unk>", "▁a", "t"],
}


def test_a_llama_gguf_tokenizer_matches_transformers(llama_file) -> None:
    """Ids equal transformers' on trailing and repeated spaces, newlines (bytes: the vocabulary
    has no "\\n" piece), punctuation, characters outside the vocabulary and an emoji (UTF-8
    bytes), control tokens written in the text; <s> in front. Decoding (with and without <s>,
    with special tokens skipped) gives transformers' text. Where transformers' reader parts from
    the original tokenizer (DISPUTED), the original's pieces."""
    _, path = llama_file
    lm = qkv.load(str(path), weights="fp32", cache=False)
    want = transformers_tokenizer(path)
    for text, pieces in DISPUTED.items():
        assert want.convert_ids_to_tokens(lm.tokenizer.encode(text)) == pieces, text
    for text in TEXTS:
        ids = lm.tokenizer.encode(text)
        assert ids == want(text).input_ids, (text, want.convert_ids_to_tokens(want(text).input_ids))
        for part in (ids, ids[1:]):
            assert lm.tokenizer.decode(part) == want.decode(part), text
            assert lm.tokenizer.decode(part, skip_special_tokens=True) == \
                want.decode(part, skip_special_tokens=True), text
    assert want.convert_ids_to_tokens(lm.tokenizer.encode("her")) == ["<s>", "▁", "he", "r"]  # by score
    assert lm.tokenizer.decode(lm.tokenizer.encode("héllo 😀 the  cat")[1:]) == "héllo 😀 the  cat"
    assert lm.stop_ids == (2,)


def test_a_llama_gguf_matches_transformers(llama_file) -> None:
    """Logits of a prompt qkv's tokenizer spells equal transformers' model read from the same
    file (and the model it was written from) to 1e-5; 10 greedy tokens identical."""
    ref, path = llama_file
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    lm = qkv.load(str(path), weights="fp32", cache=False)
    assert not lm.model.cfg.tie_embeddings and lm.model.cfg.mlp == "swiglu"
    prompt = torch.tensor([lm.tokenizer.encode("Hello, the cat sat on the mat 😀")])
    with torch.no_grad():
        want = theirs(prompt).logits
        ref_ids = theirs.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, prompt.shape[1]:].tolist()
        diff = (lm.model(prompt).logits - want).abs().max().item()
        torch.testing.assert_close(ref(prompt).logits, want, rtol=0, atol=1e-5)  # the file is right
    assert diff <= 1e-5, diff
    assert [int(t[0]) for t in generate(lm.model, prompt, 10, temperature=0.0)] == ref_ids


def test_qkv_generate_reads_a_llama_gguf(llama_file) -> None:
    """`qkv generate FILE --temperature 0`: the prompt, then transformers' greedy continuation of
    transformers' ids, as transformers decodes prompt and continuation together (the first
    new token's "▁" is a space after the prompt, not dropped as at the start of a text)."""
    ref, path = llama_file
    want = transformers_tokenizer(path)
    prompt = "the cat sat"
    rc, out, err = call(["generate", str(path), "--prompt", prompt, "--temperature", "0",
                         "--max-new-tokens", "10"])
    assert rc == 0, err
    ids = torch.tensor([want(prompt).input_ids])
    with torch.no_grad():
        new = ref.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=2,
                           pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert out == want.decode(ids[0].tolist() + new, skip_special_tokens=True) + "\n"
    lm = qkv.load(str(path))  # the conversion `qkv generate` cached, read back
    assert [lm.tokenizer.encode(t) for t in TEXTS] == [want(t).input_ids for t in TEXTS]


def test_a_trained_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path: Path) -> None:
    """The original tokenizer as the reference: a SentencePiece BPE trained here with Llama-2's
    settings (byte fallback, dummy prefix, spaces kept, whitespace-only pieces, digits split),
    written as llama.cpp's converter writes its vocabulary (each id's piece, score and type),
    read back by qkv: ids equal <s> + sentencepiece's own on spaces at either end, runs of
    spaces, newlines, digits, accents and an emoji (byte fallback); decoding gives the text."""
    spm = dev_package("sentencepiece")
    from qkv.pretrained.gguf_file import read_gguf
    from qkv.pretrained.gguf_tokenizers import tokenizer_from_gguf

    lines = [f"the {w} sat on the mat, {n} times over." for n, w in enumerate(["cat", "dog", "hat"] * 30)]
    lines += ["Hello  world\n  indented line", "    four spaces", "ROMEO: But soft, what light?"] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    kinds = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i)
             else 5 if sp.is_unused(i) else NORMAL for i in range(n)]  # the converter's order of tests
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(kinds)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    finish(w)
    tok = tokenizer_from_gguf(read_gguf(tmp_path / "vocab.gguf"))
    for text in [" Hello world", "  two spaces first", "the cat sat on the mat, 12 times over.",
                 "    four spaces", "trailing  ", "Hello\n\n  indented", "héllo 😀 wörld 4567", "", " "]:
        assert tok.encode(text) == [1, *sp.encode(text)], (text, [sp.id_to_piece(i) for i in sp.encode(text)])
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == sp.decode(sp.encode(text)), text


@pytest.mark.parametrize("space_prefix", [None, False], ids=["no-key", "false"])
def test_add_space_prefix_is_read(tmp_path: Path, space_prefix: bool | None) -> None:
    """No add_space_prefix key means true (llama.cpp's default for llama files); false leaves the
    text as it is. transformers' GGUF reader ignores the key (always a prefix), so the reference
    for false is its LlamaTokenizer with add_prefix_space=False over the same merges."""
    from transformers.tokenization_utils_base import generate_merges

    path = tmp_path / "t.gguf"
    write_llama_gguf(tiny_llama(), path, space_prefix=space_prefix)
    tok = qkv.load(str(path), weights="fp32", cache=False).tokenizer
    if space_prefix is None:
        want = transformers_tokenizer(path)
    else:
        tokens, scores, _ = llama_vocab()
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
        want = transformers.LlamaTokenizer(vocab=vocab, merges=merges, add_prefix_space=False,
                                           add_bos_token=True)
        want.add_tokens([transformers.AddedToken(ADDED, normalized=False, special=False)])
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == want(text).input_ids, text
        assert tok.decode(ids) == want.decode(ids), text
    the = llama_vocab()[0].index("▁the")
    assert (tok.encode("the cat")[1] == the) == (space_prefix is None)  # "▁the", else "t", "he"


def test_a_sentencepiece_vocabulary_without_scores_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "noscores.gguf"
    write_llama_gguf(tiny_llama(), path, scores=False)
    with pytest.raises(PretrainedFormatError, match=r"SentencePiece tokens but no tokenizer\.ggml\.scores"):
        qkv.load(str(path), cache=False)
    rc, _, err = call(["generate", str(path), "--prompt", "the cat"])
    assert "SentencePiece tokens but no tokenizer.ggml.scores" in assert_one_line_error(rc, err)
