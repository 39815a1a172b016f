"""Writing a GGUF file from a tiny `transformers` model the way llama.cpp's converter,
convert_hf_to_gguf.py (its model classes now under llama.cpp's conversion/), writes one: the
pieces the GGUF tests share. Each function names the converter's code it mirrors; what differs
per architecture (the tokenizer, which tensors are dropped or changed) stays in the tests.

Not a test module (no ``test_`` prefix). Import it as ``pretrained.gguf_writing`` after
``pytest.importorskip("gguf")``, so that it also resolves when a test outside tests/pretrained
imports a GGUF test module (tests/serve/test_serve_hf_folder.py does).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


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
