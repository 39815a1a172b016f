"""qkv's own GPT runs -> a GGUF file (llama.cpp's format), with the ``gguf`` package's
GGUFWriter: the write direction of :mod:`qkv.pretrained.gguf_models`.

A llama-style run (RoPE, RMSNorm, SwiGLU, GQA allowed) is written as llama.cpp's ``llama``; one
with biases on q/k/v only (``--qkv_bias true``) as its ``qwen2`` (the same blocks with those
biases). Tensor names come from the llama table's GGUF column
(:data:`~qkv.pretrained.architectures.LLAMA_GGUF`); for ``llama`` the W_Q and W_K rows are
permuted per head into llama.cpp's order (:func:`permute_rope_rows`, the inverse of smollm2's
``unpermute_rope_rows``); its ``qwen2`` rotates halves as qkv does, so they stay in order.
A gpt2-style run (learned positions, LayerNorm, GELU) is written as llama.cpp's ``gpt2``: the
fused ``attn_qkv``, (out, in) matrices as qkv stores them, zero biases where qkv has none, and
the output head always present (llama.cpp's own converter writes GPT-2's tied head so).
Metadata: ``{arch}.*`` sizes, heads, norm epsilon (RoPE base for llama/qwen2), and the tokenizer
(``tokenizer.ggml.model = "gpt2"``: the byte-level BPE vocabulary, merges, GPT-2's
pre-tokenizer regex, ``<|endoftext|>`` as bos and eos token where the run has it).

Written, with a note (:func:`gguf_notes`): a gpt2-style run with exact ``gelu``: GGUF's gpt2 has
no activation key and llama.cpp applies the tanh form, so the file computes ``gelu_tanh``.
Known limit of a reader, not of the file: transformers' GGUF reader sizes gpt2's position table
at 1024 whatever ``gpt2.context_length`` says (it maps that key to ``n_ctx``, not
``n_positions``), so it reads a gpt2 GGUF only of a 1024-token run; llama.cpp and qkv read any.

Refused (one line each), because a GGUF reader would compute something else or not read it:
- ``--mlp relu`` with learned positions (llama.cpp's gpt2 applies GELU);
- ``--bias true`` on a llama-style run (biases in every linear layer: neither reader's llama
  nor qwen2 takes them all), a ``head_dim`` other than dim / n_heads;
- a character tokenizer: GGUF's ``gpt2`` tokenizer model is byte-level (each token spelled in
  GPT-2's byte-to-unicode alphabet), which a character vocabulary is not, and GGUF has no
  character-level model.

``dtype``: f32, f16, bf16, q8_0 (blocks of 32 weights with one f16 scale, llama.cpp's Q8_0) or
q4_0 (blocks of 32 4-bit weights with one f16 scale) for 2-D tensors; 1-D tensors (the norms)
stay f32, as llama.cpp writes them, and a 2-D tensor whose rows are not a multiple of 32 stays
f16 under q8_0 and q4_0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from qkv.models.gpt import GPT, GPTConfig
from qkv.pretrained.architectures import GPT2_GGUF, LLAMA_GGUF
from qkv.pretrained.export import hf_architecture, row_split, unmap_names, with_zero_biases
from qkv.pretrained.gguf_tokenizers import GGUF_TOKEN_CONTROL, GGUF_TOKEN_NORMAL


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's per-head row order of W_Q / W_K, (n_heads·Dh, dim): each head's rows viewed as
    (2, D/2) -> (D/2, 2), so that the two halves of every rotated pair sit side by side."""
    rows, cols = w.shape
    dh = rows // n_heads
    return w.reshape(n_heads, 2, dh // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_architecture(cfg: GPTConfig) -> str:
    """The llama.cpp architecture a run is written as: ``gpt2`` (learned positions, LayerNorm,
    GELU), ``qwen2`` (llama-style with biases on q/k/v, ``--qkv_bias true``) or ``llama``.
    ValueError (one line) for a run no Hugging Face architecture represents either."""
    arch = hf_architecture(cfg)
    if arch == "gpt2":
        return "gpt2"
    return "qwen2" if cfg.qkv_bias else "llama"


def gguf_notes(cfg: GPTConfig) -> list[str]:
    """What a GGUF reader computes differently from the run (written anyway, said aloud)."""
    if gguf_architecture(cfg) == "gpt2" and cfg.mlp == "gelu":
        return ["llama.cpp's gpt2 computes GELU in its tanh form and this run was trained with exact "
                "GELU, so the file's logits differ from the run's by a few 1e-3 (train with --mlp "
                "gelu_tanh for an exact file)"]
    return []


def check_gguf(model: GPT, tok: Any) -> None:
    """ValueError (one line) unless ``model`` and ``tok`` can be written as a GGUF."""
    from qkv.tokenizers import BPETokenizer

    cfg = model.cfg
    if cfg.norm_placement == "post":
        raise ValueError("--format gguf: --norm_placement post (a norm after each residual sum, none at the "
                         "end) has no counterpart in llama.cpp's gpt2, llama or qwen2")
    for flag, on in (("--mlp none (attention-only blocks)", cfg.mlp == "none"),
                     ("--tie_qk true (one matrix for queries and keys)", cfg.tie_qk)):
        if on:
            raise ValueError(f"--format gguf: {flag} has no counterpart in llama.cpp's gpt2, llama or qwen2")
    arch = gguf_architecture(cfg)
    if arch == "gpt2" and cfg.mlp not in ("gelu", "gelu_tanh"):
        raise ValueError(f"--format gguf: --mlp {cfg.mlp} with --positions learned has no counterpart in "
                         "llama.cpp's gpt2 (it applies GELU); use --format hf")
    if arch != "gpt2" and cfg.bias:
        raise ValueError("--format gguf: --bias true (biases in every linear layer) has no counterpart in "
                         "the GGUF readers' llama or qwen2 (qwen2 has them on q/k/v only: --qkv_bias true); "
                         "use --format hf")
    if cfg.resolved_head_dim * cfg.n_heads != cfg.dim:
        raise ValueError(f"--format gguf: --head_dim {cfg.head_dim} (not dim / n_heads) is not written; "
                         "use --format hf")
    if not isinstance(tok, BPETokenizer):
        raise ValueError("--format gguf: a character tokenizer cannot be carried (GGUF's gpt2 tokenizer is "
                         "byte-level BPE); train with --tokenizer bpe, or use --format hf")


def _tensor(gguf: Any, name: str, w: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """(data, raw type) of one tensor in ``dtype`` (1-D tensors stay f32)."""
    q = gguf.GGMLQuantizationType
    if w.ndim == 1 or dtype == "f32":
        return w.astype(np.float32), q.F32
    if dtype == "f16" or (dtype in ("q8_0", "q4_0") and w.shape[-1] % 32):
        return w.astype(np.float16), q.F16
    kind = {"bf16": q.BF16, "q8_0": q.Q8_0, "q4_0": q.Q4_0}[dtype]
    return gguf.quants.quantize(w.astype(np.float32), kind), kind


FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_* numbers


def write_gguf(model: GPT, tok: Any, path: Path, dtype: str = "f32") -> str:
    """Write ``model`` and its BPE ``tok`` as a GGUF at ``path`` (architecture:
    :func:`gguf_architecture`); returns the architecture."""
    import gguf

    check_gguf(model, tok)
    if dtype not in FILE_TYPES:
        raise ValueError(f"--dtype must be one of {', '.join(FILE_TYPES)}, got {dtype!r}")
    cfg = model.cfg
    arch = gguf_architecture(cfg)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if arch == "gpt2":  # biases everywhere (zeros where qkv has none); the output head always
        # written, as llama.cpp's own converter writes GPT-2's tied one
        named = unmap_names(with_zero_biases(sd, cfg, "gpt2"), GPT2_GGUF, row_split(cfg), tied=False)
    else:
        named = unmap_names(sd, LLAMA_GGUF, row_split(cfg), cfg.tie_embeddings)
    tensors = {k: v.numpy() for k, v in named.items()}
    for name in tensors:  # llama.cpp's qwen2 rotates halves, as qkv does: its rows stay in order
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.n_heads if "attn_q" in name else cfg.resolved_kv_heads
            tensors[name] = permute_rope_rows(tensors[name], heads)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("qkv GPT")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.mlp_hidden or 4 * cfg.dim)
    w.add_head_count(cfg.n_heads)
    if arch == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
    else:
        w.add_head_count_kv(cfg.resolved_kv_heads)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_rope_dimension_count(cfg.resolved_head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(FILE_TYPES[dtype])
    _add_tokenizer(w, tok)
    for name, t in tensors.items():
        data, kind = _tensor(gguf, name, t, dtype)
        w.add_tensor(name, data, raw_dtype=kind)  # quantized bytes: the writer infers the shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arch


def _add_tokenizer(w: Any, tok: Any) -> None:
    """A qkv byte-level BPE tokenizer as GGUF tokenizer metadata (tokens by id, merges; the
    special tokens, ``<|endoftext|>``, as control tokens, which llama.cpp never splits)."""
    from qkv.tokenizers import end_of_text_id

    data = json.loads(tok.tokenizer.to_str())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    vocab |= {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("--format gguf: the BPE vocabulary's ids are not 0..V-1")
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for the GPT-2 pre-tokenizer regex
    w.add_token_list(tokens)
    w.add_token_types([GGUF_TOKEN_CONTROL if i in special else GGUF_TOKEN_NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(merges)
    eos = end_of_text_id(tok)
    if eos is not None:  # GPT-2's convention: one token begins and ends a text
        w.add_bos_token_id(eos)
        w.add_eos_token_id(eos)
    w.add_add_bos_token(False)  # qkv prepends nothing to a prompt
    w.add_add_eos_token(False)
