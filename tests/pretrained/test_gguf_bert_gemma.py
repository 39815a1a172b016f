"""GGUF files of the gemma and bert architectures, written here as llama.cpp's converter
(convert_hf_to_gguf.py) writes them, from tiny random `transformers` models; the references
are those models and transformers' own tokenizers (transformers reads neither architecture
from a GGUF).

    gemma  GemmaForCausalLM (2 layers, head_dim 32 on a 64-wide model, MQA), its RMSNorm weights
           stored +1 and its Q/K rows unpermuted, as the converter does; a SentencePiece-style
           vocabulary ("llama" tokenizer model: "▁" pieces, <0xNN> bytes, no merges stored)
    bert   BertModel (2 layers x 32) with a WordPiece vocabulary stored in llama.cpp's
           "phantom space" spelling ("▁word", bare continuation pieces, [CLS] as is)
"""

from __future__ import annotations

import json
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
    bert_file,
    bert_reference,
    finish,
    open_gguf,
    write_bert_gguf,
    write_stub_gguf,
)

import qkv  # noqa: E402
from qkv.generation import generate  # noqa: E402
from qkv.pretrained import CausalLM, PretrainedFormatError, SentenceEncoder  # noqa: E402

# --------------------------------------------------------------------------- gemma

SPECIALS = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
            ("<mask>", CONTROL), ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
# Gemma's runs of spaces come early in its vocabulary, as added (user-defined) pieces.
SPACES, SPACE_MERGES = ["▁▁", "▁▁▁"], [("▁", "▁"), ("▁▁", "▁")]
CHARS = list("▁abcdefghijklmnopqrstuvwxyzTH,.!")
# The BPE merges the vocabulary was "trained" with, in order; each appends its joined piece.
MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("n", "d"), ("▁a", "nd"), ("▁", "c"),
          ("a", "t"), ("▁c", "at"), ("▁", "h"), ("▁h", "at"), ("i", "n"), ("▁", "s"), ("▁s", "at"),
          ("▁", "o"), ("▁o", "n"), ("T", "he"), ("▁", "m"), ("▁m", "at"), ("e", "r"), ("▁h", "er")]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_vocab() -> tuple[list[str], list[int]]:
    """Gemma's layout in small: specials, runs of spaces, the 256 byte tokens, characters,
    merged pieces."""
    tokens = [t for t, _ in SPECIALS] + SPACES + [f"<0x{b:02X}>" for b in range(256)] + CHARS
    types = [ty for _, ty in SPECIALS] + [USER_DEFINED] * len(SPACES) + [BYTE] * 256 + [NORMAL] * len(CHARS)
    for a, b in MERGES:
        tokens.append(a + b)
        types.append(NORMAL)
    return tokens, types


def gemma_reference_tokenizer():
    """transformers' GemmaTokenizer over the vocabulary and the merges it was built with."""
    tokens, _ = gemma_vocab()
    return transformers.GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)},
                                       merges=SPACE_MERGES + MERGES, add_bos_token=True,
                                       extra_special_tokens=["<start_of_turn>", "<end_of_turn>"])


def tiny_gemma():
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=len(gemma_vocab()[0]), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=32, max_position_embeddings=64, initializer_range=0.1)
    ref = transformers.GemmaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # Gemma initialises its norms' w to 0 (scale 1 + w): give them values
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return ref


def write_gemma_gguf(ref, path: Path) -> None:
    """As convert_hf_to_gguf.py's GemmaModel writes it: its metadata keys (key/value length =
    head_dim, no RoPE base), lm_head dropped (tied), every norm weight stored as 1 + w, Q/K rows
    as they are; the vocabulary as its SentencePiece reader lists it (pieces, scores, types;
    its user-defined runs of "▁" written with spaces), with Gemma's special ids."""
    c = ref.config
    w, names = open_gguf(path, gguf.MODEL_ARCH.GEMMA, c.num_hidden_layers)
    add_sizes(w, context=c.max_position_embeddings, embedding=c.hidden_size, blocks=c.num_hidden_layers,
              feed_forward=c.intermediate_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types = gemma_vocab()
    tokens = [t.replace("▁", " ") if t in SPACES else t for t in tokens]  # stored with real spaces
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) if ty == NORMAL else -1000.0 if ty == USER_DEFINED else 0.0
                        for i, ty in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_eot_token_id(tokens.index("<end_of_turn>"))
    w.add_chat_template(GEMMA_TEMPLATE)
    w.add_add_space_prefix(False)
    for hf_name, t in ref.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        a = t.detach().float().numpy().copy()
        if hf_name.endswith("norm.weight"):
            a = a + 1.0
        add_hf_tensor(w, names, hf_name, a)
    finish(w)


PROMPT = torch.tensor([[2, 302, 43, 19, 292, 303, 11, 312]])  # <bos>, pieces, a byte token


def test_a_gemma_gguf_matches_transformers(tmp_path: Path) -> None:
    ref = tiny_gemma()
    path = tmp_path / "tiny-gemma.gguf"
    write_gemma_gguf(ref, path)
    lm = qkv.load(str(path), weights="fp32", cache=False)
    assert isinstance(lm, CausalLM)
    cfg = lm.model.cfg
    assert (cfg.mlp, cfg.embed_scale, cfg.resolved_head_dim, cfg.n_kv_heads) == ("geglu_tanh", True, 32, 1)
    assert cfg.tie_embeddings and cfg.rope_theta == 10000.0
    with torch.no_grad():
        want = ref(PROMPT).logits
        got = lm.model(PROMPT).logits
        ref_ids = ref.generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, PROMPT.shape[1]:].tolist()
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, diff
    assert [int(t[0]) for t in generate(lm.model, PROMPT, 10, temperature=0.0)] == ref_ids


def test_a_gemma_gguf_norm_weights_are_read_as_stored(tmp_path: Path) -> None:
    """The file holds 1 + w already: adding 1 again (what a Hugging Face folder needs) would
    double the scale. Checked on the weights themselves, not only through the logits."""
    ref = tiny_gemma()
    write_gemma_gguf(ref, tmp_path / "g.gguf")
    gpt = qkv.load(str(tmp_path / "g.gguf"), weights="fp32", cache=False).model
    want = ref.model.layers[1].post_attention_layernorm.weight.detach() + 1
    assert torch.equal(gpt.stack.blocks[1].norm2.weight.detach(), want)


SENTENCES = ["the cat and the hat", "The cat sat on the mat!", "a  b   c", "her hat, the cat.",
             "héllo wörld €", "<start_of_turn>user\nthe cat<end_of_turn>\n", "zzz qqq"]


def test_a_gemma_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    """Ids equal transformers' GemmaTokenizer built from the vocabulary's own merges (which the
    file does not store): merge order ("her" is "he" + "r"), runs of spaces, byte fallback,
    special tokens whole, <bos> in front; and the chat template and stop tokens are read."""
    ref = tiny_gemma()
    path = tmp_path / "g.gguf"
    write_gemma_gguf(ref, path)
    lm = qkv.load(str(path), weights="fp32", cache=False)
    want = gemma_reference_tokenizer()
    for text in SENTENCES:
        ids = lm.tokenizer.encode(text)
        assert ids == want(text).input_ids, text
        assert lm.tokenizer.decode(ids[1:]) == text
    assert lm.stop_ids == (1, 6)  # <eos>, and <end_of_turn> (the file's eot id)
    chat = lm.format_chat("the cat")
    assert chat == "<start_of_turn>user\nthe cat<end_of_turn>\n<start_of_turn>model\n"
    assert lm.tokenizer.encode(chat) == want(chat).input_ids  # one <bos>, from the tokenizer
    text = lm.generate("the cat", 4, stop_at_eos=False)  # text in, text out, through the tokenizer
    with torch.no_grad():
        ids = torch.tensor([want("the cat").input_ids])
        ref_ids = ref.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert text == want.decode(ref_ids[0, ids.shape[1]:])


# --------------------------------------------------------------------------- bert

BERT_SENTENCES = ["Hello, World!", "The cat sat on the mat.", "unaffable cats",
                  "Paris is the [MASK] of France?", "héllo running dogs", "qwerty xyzzy", "the  cat's mat",
                  "a <extra> dog"]


def _mean_state(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).last_hidden_state.mean(dim=1)[0]


def test_a_bert_gguf_matches_transformers(tmp_path: Path) -> None:
    ref, tok, path = bert_file(tmp_path)
    enc = qkv.load(str(path), cache=False)
    assert isinstance(enc, SentenceEncoder)
    assert (enc.model.cfg.pooling, enc.model.cfg.type_vocab_size, enc.max_tokens) == ("mean", 2, 64)
    ids = torch.tensor([[3, 11, 12, 14, 15, 11, 16, 6, 4], [3, 19, 20, 21, 13, 4, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        got = enc.model(ids, mask).hidden
    real = mask.bool()
    diff = (got[real] - want[real]).abs().max().item()
    assert diff <= 1e-5, diff
    # From text: transformers' tokenizer and mean over its tokens' states; qkv's own tokenizer.
    texts = BERT_SENTENCES[:3]
    e = enc.embed(texts, normalize=False)
    for row, text in zip(e, texts, strict=True):
        torch.testing.assert_close(row, _mean_state(ref, tok(text).input_ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("newer", [False, True], ids=["converter-2025", "converter-2026-cased"])
def test_a_bert_gguf_tokenizer_matches_transformers(tmp_path: Path, newer: bool) -> None:
    """The phantom-space vocabulary, turned back into WordPiece, gives transformers' ids: lower
    case, accents stripped, punctuation split, ## pieces, [UNK], [MASK] whole, [CLS] … [SEP];
    a cased vocabulary (stored so by newer converters) keeps its case and accents."""
    ref, tok, folder = bert_reference(tmp_path, lowercase=not newer)
    path = tmp_path / "b.gguf"
    write_bert_gguf(ref, tok, folder, path, newer=newer)
    enc = qkv.load(str(path), cache=False)
    for text in BERT_SENTENCES:
        assert enc.tokenizer.encode(text) == tok(text).input_ids, text
    assert tok.convert_ids_to_tokens(enc.tokenizer.encode("unaffable running")) == \
        ["[CLS]", "un", "##aff", "##able", "run", "##ning", "[SEP]"]


def test_a_cls_pooled_bert_gguf_reads_out_the_cls_state(tmp_path: Path) -> None:
    ref, tok, path = bert_file(tmp_path, gguf.PoolingType.CLS)
    enc = qkv.load(str(path), cache=False)
    assert enc.model.cfg.pooling == "cls"
    ids = tok("the cat sat").input_ids
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
    torch.testing.assert_close(enc.embed("the cat sat", normalize=False)[0], want, rtol=0, atol=1e-5)


def test_qkv_embed_and_similarity_read_a_bert_gguf(tmp_path: Path) -> None:
    """`qkv embed FILE.gguf --json`: unit-length means of transformers' states of its own
    tokenization; `qkv similarity` ranks by them; `qkv generate` refuses the file in one line."""
    ref, tok, path = bert_file(tmp_path)
    texts = ["The cat sat on the mat.", "a dog"]
    rc, out, err = call(["embed", str(path), *texts, "--json"])
    assert rc == 0, err
    for row, text in zip(json.loads(out), texts, strict=True):
        mean = _mean_state(ref, tok(text).input_ids).double()
        torch.testing.assert_close(torch.tensor(row["embedding"], dtype=torch.float64), mean / mean.norm(),
                                   rtol=0, atol=1e-5)
    docs = ["a dog", "the cat sat", "paris is the capital of france"]
    rc, out, err = call(["similarity", str(path), "the cat sat", *docs, "--json"])
    assert rc == 0, err
    e = {t: _mean_state(ref, tok(t).input_ids) for t in ["the cat sat", *docs]}
    cos = {d: float(torch.nn.functional.cosine_similarity(e["the cat sat"], e[d], dim=0)) for d in docs}
    assert [r["text"] for r in json.loads(out)] == sorted(docs, key=cos.get, reverse=True)
    rc, _, err = call(["generate", str(path), "--prompt", "the cat"])
    assert "a bert GGUF is a sentence encoder, not a language model" in assert_one_line_error(rc, err)


# --------------------------------------------------------------------------- bad input


def test_a_decoder_gguf_is_not_an_encoder_and_an_encoder_takes_no_weights(tmp_path: Path) -> None:
    write_gemma_gguf(tiny_gemma(), tmp_path / "g.gguf")
    rc, _, err = call(["embed", str(tmp_path / "g.gguf"), "the cat"])
    assert "is a decoder (a language model), not a sentence encoder" in assert_one_line_error(rc, err)
    _, _, path = bert_file(tmp_path)
    with pytest.raises(ValueError, match="weights= is for decoders"):
        qkv.load(str(path), weights="int8", cache=False)


@pytest.mark.parametrize("arch", ["phi2", "gemma2", "nomic-bert"])
def test_unsupported_gguf_architectures_are_one_line(tmp_path: Path, arch: str) -> None:
    path = write_stub_gguf(tmp_path / f"{arch}.gguf", arch)
    for argv in (["generate", str(path), "--prompt", "a"], ["embed", str(path), "a"]):
        rc, _, err = call(argv)
        line = assert_one_line_error(rc, err)
        assert f"GGUF architecture {arch!r} is not supported" in line
        assert "(supported: llama, qwen2, gpt2, gemma, bert)" in line
        assert ("soft-cap" in line) == (arch == "gemma2")  # a refused architecture says why


def test_a_bert_gguf_pooled_by_its_last_token_is_refused(tmp_path: Path) -> None:
    ref, tok, folder = bert_reference(tmp_path)
    path = tmp_path / "last.gguf"
    write_bert_gguf(ref, tok, folder, path, gguf.PoolingType.LAST)
    with pytest.raises(PretrainedFormatError, match=r"bert.pooling_type 3 .* unsupported") as e:
        qkv.load(str(path), cache=False)
    assert "\n" not in str(e.value)
