"""Writing a GGUF file from a tiny `transformers` model the way llama.cpp's converter,
convert_hf_to_gguf.py (its model classes now under llama.cpp's conversion/), writes one: the
pieces the GGUF tests share. Each function names the converter's code it mirrors; what differs
per architecture (the tokenizer, which tensors are dropped or changed) stays in the tests.

Not a test module (no ``test_`` prefix). Import it as ``pretrained.gguf_writing`` after
``pytest.importorskip("gguf")`` (and, for the tiny references, "transformers"), from any test
folder: tests/serve/test_serve_hf_folder.py serves the files written here too.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp's token types


def open_gguf(path: Path, kind: gguf.MODEL_ARCH, n_layers: int):
    """``(writer, tensor-name map)`` for a file of architecture ``kind``, as the converter makes
    them: ModelBase's ``gguf.GGUFWriter`` named ``gguf.MODEL_ARCH_NAMES[kind]`` and TextModel's
    ``gguf.get_tensor_name_map(kind, block_count)``, the gguf package's own map."""
    return gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[kind]), gguf.get_tensor_name_map(kind, n_layers)


def add_hf_tensor(w, names, hf_name: str, a: np.ndarray) -> None:
    """``a`` under the GGUF name of the Hugging Face tensor ``hf_name``, as the converter's
    ModelBase.map_tensor_name finds it (looked up without its ".weight" / ".bias", which is put back)."""
    w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), a)


def add_sizes(w, *, context: int, embedding: int, blocks: int, feed_forward: int, heads: int,
              kv_heads: int | None = None, blocks_first: bool = False) -> None:
    """The size keys every architecture's ``set_gguf_parameters`` writes first: context length,
    embedding length, block count, feed-forward length, head count and (given ``kv_heads``) the
    key/value head count, in GemmaModel's order; ``blocks_first``: the block count ahead of the
    others, as the base TextModel's (which BertModel keeps) and GPT2Model's write it."""
    if blocks_first:
        w.add_block_count(blocks)
    w.add_context_length(context)
    w.add_embedding_length(embedding)
    if not blocks_first:
        w.add_block_count(blocks)
    w.add_feed_forward_length(feed_forward)
    w.add_head_count(heads)
    if kv_heads is not None:
        w.add_head_count_kv(kv_heads)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, from its definition: the rows of each of
    ``n_head`` heads reordered from Hugging Face's rotate-half RoPE layout to llama.cpp's
    interleaved one."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute_qk(hf_name: str, a: np.ndarray, n_head: int, n_kv_head: int) -> np.ndarray:
    """``a`` as LlamaModel.modify_tensors stores the Hugging Face weight ``hf_name``: q_proj's
    rows permuted by ``n_head`` heads, k_proj's by ``n_kv_head``, any other tensor as it is (the
    converter permutes Q/K biases too; the tiny Llamas here have none)."""
    if hf_name.endswith("q_proj.weight"):
        return llama_cpp_permute(a, n_head)
    if hf_name.endswith("k_proj.weight"):
        return llama_cpp_permute(a, n_kv_head)
    return a


def finish(w) -> None:
    """Header, key/value data, tensors, close: the converter's ModelBase.write, in that order."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_stub_gguf(path: Path, arch: str) -> Path:
    """Not a converter's file: a GGUF that only names ``arch`` (two tokens, a zero embedding),
    for the tests of an architecture qkv refuses."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    finish(w)
    return path


# --------------------------------------------------------------------------- whole files


def write_decoder_gguf(ref, arch: str, path: Path, q4_0: bool = False, rope_base: bool = True) -> None:
    """``ref`` (a transformers Llama or Qwen2, ``arch``) as llama.cpp's converter would store it:
    F32 (``q4_0``: the blocks' matrices in llama.cpp's Q4_0, by the gguf package's own quantiser),
    llama's Q/K rows permuted, with a tokenizer of its vocabulary size V: "w", "0", "w0", "w3" ..
    "w{V-1}" (byte-level BPE metadata, one merge); ``rope_base``: the RoPE base written or left out."""
    c = ref.config
    V = c.vocab_size
    kind = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    w, names = open_gguf(path, kind, c.num_hidden_layers)
    add_sizes(w, context=c.max_position_embeddings, embedding=c.hidden_size, blocks=c.num_hidden_layers,
              feed_forward=c.intermediate_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads)
    if rope_base:  # the converter writes it only where config.json has a rope_theta
        w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["w", "0", "w0", *(f"w{i}" for i in range(3, V))])  # the merge: w + 0 -> w0
    w.add_token_types([1] * V)
    w.add_token_merges(["w 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf_name, t in ref.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama":
            a = permute_qk(hf_name, a, c.num_attention_heads, c.num_key_value_heads)
        if q4_0 and a.ndim == 2 and hf_name.startswith("model.layers."):
            kind = gguf.GGMLQuantizationType.Q4_0
            w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), gguf.quants.quantize(a, kind),
                         raw_dtype=kind)
            continue
        add_hf_tensor(w, names, hf_name, a)
    finish(w)


BERT_VOCAB = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "!", "?", "'",
              "the", "cat", "cats", "sat", "on", "mat", "a", "dog", "un", "##aff", "##able", "##s",
              "hello", "world", "paris", "is", "capital", "of", "france", "run", "##ning", "##n", "##i",
              "<extra>"]  # an added special token not written "[...]"


def bert_reference(tmp_path: Path, lowercase: bool = True):
    """A tiny random BertModel (LayerNorms given values too) and transformers' fast BERT
    tokenizer of BERT_VOCAB, saved as a folder the way a checkpoint ships it."""
    import transformers

    folder = tmp_path / "bert-hf"
    folder.mkdir()
    tok = transformers.BertTokenizerFast(vocab={t: i for i, t in enumerate(BERT_VOCAB)},
                                         do_lower_case=lowercase, extra_special_tokens=["<extra>"])
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(BERT_VOCAB), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  initializer_range=0.1)
    ref = transformers.BertModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    return ref, tok, folder


def write_bert_gguf(ref, tok, folder: Path, path: Path, pooling=None, newer: bool = False) -> None:
    """As convert_hf_to_gguf.py's BertModel writes it: the base metadata keys plus non-causal
    attention and the pooling type, the vocabulary in its phantom-space spelling with the
    added tokens marked control, the special ids from the gguf package's own SpecialVocab
    ([CLS] as bos, [SEP] as eos), the pooler dropped, every tensor in (out, in) rows.
    ``newer``: as its 2026 converter does, control tokens (not "[...]" ones) kept as they are,
    and the normalizer's lower-casing stored."""
    c = ref.config
    w, names = open_gguf(path, gguf.MODEL_ARCH.BERT, c.num_hidden_layers)
    add_sizes(w, context=c.max_position_embeddings, embedding=c.hidden_size, blocks=c.num_hidden_layers,
              feed_forward=c.intermediate_size, heads=c.num_attention_heads, blocks_first=True)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_causal_attention(False)
    w.add_pooling_type(pooling or gguf.PoolingType.MEAN)
    w.add_token_type_count(c.type_vocab_size)

    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    added = {i for i, a in tok.added_tokens_decoder.items() if a.special}
    types = [CONTROL if i in added else NORMAL for _, i in vocab]

    def phantom(t: str, kind: int) -> str:
        if (kind == CONTROL) if newer else (t.startswith("[") and t.endswith("]")):
            return t
        return t[2:] if t.startswith("##") else "\u2581" + t

    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([phantom(t, ty) for (t, _), ty in zip(vocab, types, strict=True)])
    w.add_token_types(types)
    if newer:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", tok.do_lower_case)
    gguf.SpecialVocab(folder, n_vocab=len(vocab)).add_to_gguf(w)
    for hf_name, t in ref.state_dict().items():
        if hf_name.startswith("pooler.") or hf_name == "embeddings.position_ids":
            continue
        add_hf_tensor(w, names, hf_name, t.detach().float().numpy().copy())
    finish(w)


def bert_file(folder: Path, pooling=None):
    """:func:`bert_reference` written by :func:`write_bert_gguf` as ``folder/tiny-bert.gguf``:
    (model, tokenizer, path)."""
    ref, tok, hf_folder = bert_reference(folder)
    path = folder / "tiny-bert.gguf"
    write_bert_gguf(ref, tok, hf_folder, path, pooling)
    return ref, tok, path


def transformers_tokenizer(path: Path):
    """transformers' own reading of the tokenizer in the GGUF file ``path`` (the reference)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
