"""SmolLM2-135M-Instruct (GGUF) -> qkv's own :class:`~qkv.models.gpt.GPT`.

SmolLM2 is a Llama-architecture decoder: RMSNorm, SwiGLU, RoPE (θ = 100000), grouped-query
attention (9 query heads, 3 key/value heads), no biases, tied input/output embeddings
(Allal et al. 2025). All of that is a :class:`~qkv.models.gpt.GPTConfig`; this file only maps
llama.cpp's tensor names onto qkv's and undoes one layout difference:

llama.cpp's converter permutes the rows of W_Q and W_K inside each head so that the two
halves of every rotated pair sit next to each other (its RoPE rotates adjacent pairs
(x0, x1), (x2, x3), ...). qkv, like the original checkpoint, rotates pairs (x_i, x_{i+D/2})
("rotate half"). :func:`unpermute_rope_rows` puts the rows back.

The tokenizer (byte-level BPE: vocabulary, merges, control tokens) and the ChatML chat
template are read from the same file's metadata.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.models.gpt import GPT, GPTConfig
from qkv.pretrained._build import build_with_weights, parameter_names
from qkv.pretrained.architectures import GPT2_GGUF, LLAMA_GGUF, Names, map_names
from qkv.pretrained.cache import entry_dir, load_gpt_entry, save_gpt_entry
from qkv.pretrained.gguf_file import GGUFFile, PretrainedFormatError, read_gguf
from qkv.tokenizers.hf import HFTokenizer, hf_tokenizers

INSTALL_HINT = "reinstall it with `qkv assets install smollm2`"

GGUF_TOKEN_CONTROL = 3  # llama.cpp's token type for special tokens (<|im_start|>, ...)
GGUF_TOKEN_USER_DEFINED = 4


def _meta(g: GGUFFile, key: str) -> Any:
    arch = g.metadata.get("general.architecture", "llama")
    full = key.replace("{arch}", arch)
    if full not in g.metadata:
        raise PretrainedFormatError(f"{g.path}: metadata key {full!r} missing; {INSTALL_HINT}")
    return g.metadata[full]


GGUF_ARCHITECTURES = ("llama", "qwen2", "gpt2")  # llama also covers Mistral-style files (same names)


def gpt_config_from_gguf(g: GGUFFile) -> GPTConfig:
    """The GPTConfig of a llama- or qwen2-architecture GGUF (sizes, heads, RoPE base, norm
    epsilon; qwen2: biases on q/k/v)."""
    arch = g.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise PretrainedFormatError(f"{g.path}: GGUF architecture {arch!r} is not supported (supported: "
                                    f"{', '.join(GGUF_ARCHITECTURES)}; bert and the rest: load "
                                    "their Hugging Face folder)")
    dim = int(_meta(g, "{arch}.embedding_length"))
    n_heads = int(_meta(g, "{arch}.attention.head_count"))
    if arch == "gpt2":  # LayerNorm, tanh GELU (llama.cpp's), learned positions, biases
        return GPTConfig(
            vocab_size=len(_meta(g, "tokenizer.ggml.tokens")),
            max_seq_len=int(_meta(g, "{arch}.context_length")), dim=dim,
            n_layers=int(_meta(g, "{arch}.block_count")), n_heads=n_heads,
            mlp_hidden=int(_meta(g, "{arch}.feed_forward_length")), mlp="gelu_tanh", norm="layernorm",
            norm_eps=float(_meta(g, "{arch}.attention.layer_norm_epsilon")), positions="learned",
            tie_embeddings="output.weight" not in g.tensor_names(), bias=True)
    head_dim = dim // n_heads
    rope_dims = int(g.metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise PretrainedFormatError(f"{g.path}: partial RoPE ({rope_dims} of {head_dim}) unsupported")
    tied = "output.weight" not in g.tensor_names()
    return GPTConfig(
        vocab_size=len(_meta(g, "tokenizer.ggml.tokens")),
        max_seq_len=int(_meta(g, "{arch}.context_length")),
        dim=dim,
        n_layers=int(_meta(g, "{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_meta(g, "{arch}.attention.head_count_kv")),
        mlp_hidden=int(_meta(g, "{arch}.feed_forward_length")),
        mlp="swiglu",
        norm="rmsnorm",
        norm_eps=float(_meta(g, "{arch}.attention.layer_norm_rms_epsilon")),
        positions="rope",
        rope_theta=float(_meta(g, "{arch}.rope.freq_base")),
        tie_embeddings=tied,
        bias=False,
        qkv_bias=arch == "qwen2",
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of W_Q / W_K, shape (n_heads·Dh, dim).

    llama.cpp stored head rows in the order (0, D/2, 1, D/2+1, ...): view each head's rows as
    (2, D/2) -> (D/2, 2); this reads them back as (D/2, 2) -> (2, D/2).
    """
    rows, cols = w.shape
    dh = rows // n_heads
    return w.reshape(n_heads, dh // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gpt_state_dict_from_gguf(tensors: dict[str, np.ndarray], cfg: GPTConfig,
                             permuted: bool = True, names: Names = LLAMA_GGUF) -> dict[str, Tensor]:
    """llama.cpp tensor names -> GPT parameter names, by the llama table's GGUF column
    (:data:`~qkv.pretrained.architectures.LLAMA_GGUF`), with the Q/K rows unpermuted where
    llama.cpp permuted them (``permuted``: its llama converter does; its qwen2 one, whose
    RoPE rotates halves as qkv's does, stores them as they were)."""
    def get(name: str) -> Tensor:
        if name not in tensors:
            raise PretrainedFormatError(f"tensor {name!r} missing from the GGUF file; {INSTALL_HINT}")
        w = tensors[name]
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rope_rows(w, cfg.n_heads if "attn_q" in name else cfg.resolved_kv_heads)
        return torch.from_numpy(w)

    return map_names(parameter_names(lambda: GPT(cfg)), names, get, cfg.tie_embeddings)


def tokenizer_from_gguf(g: GGUFFile) -> HFTokenizer:
    """The byte-level BPE tokenizer stored in GGUF metadata, as a ``tokenizers.Tokenizer``:
    GPT-2 byte-level pre-tokenisation (no prefix space), the stored merges, and the control
    tokens (<|im_start|>, <|im_end|>, ...) matched whole in the text."""
    model = g.metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise PretrainedFormatError(f"{g.path}: tokenizer model {model!r} unsupported (only gpt2 BPE)")
    tk = hf_tokenizers()
    tokens: list[str] = _meta(g, "tokenizer.ggml.tokens")
    types: list[int] = g.metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise PretrainedFormatError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types")
    merges = [tuple(m.split(" ", 1)) for m in _meta(g, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # the tokenizers library's own error: a merge of unknown tokens, ...
        raise PretrainedFormatError(f"{g.path}: its BPE tokenizer does not build ({e})") from None
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    kinds = (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
    special = [tk.AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty in kinds]
    tok.add_special_tokens(special)
    return HFTokenizer(tok)


def load_smollm2(
    path: str | os.PathLike[str] | None = None, cache: bool = True
) -> tuple[GPT, HFTokenizer, dict[str, Any]]:
    """Read the GGUF (default: the installed ``smollm2`` asset) into (GPT, tokenizer, info).

    ``info`` holds ``chat_template``, ``bos_id``, ``eos_id`` and the file's name. With
    ``cache`` the conversion is stored once and reused (see :mod:`qkv.pretrained.cache`).
    """
    fix = INSTALL_HINT
    if path is None:
        from qkv.assets import asset_path

        path = asset_path("smollm2")
    else:
        fix = ("check that it is a complete llama-architecture GGUF file "
               "(the bundled one: `qkv assets install smollm2`)")
    path = Path(path)
    entry = entry_dir("smollm2", path) if cache and path.is_file() else None
    if entry is not None and entry.is_dir():
        hit = load_gpt_entry(entry)
        if hit is not None:
            return hit
        shutil.rmtree(entry, ignore_errors=True)  # damaged: convert again
    g = read_gguf(path, fix=fix)
    try:
        cfg = gpt_config_from_gguf(g)
        tok = tokenizer_from_gguf(g)
        arch = g.metadata.get("general.architecture")
        sd = gpt_state_dict_from_gguf(g.tensors(), cfg, permuted=arch == "llama",
                                      names=GPT2_GGUF if arch == "gpt2" else LLAMA_GGUF)
        model = build_with_weights(lambda: GPT(cfg), sd, str(path))
    except ValueError as e:  # sizes in the metadata that do not fit the tensors, ...
        if isinstance(e, PretrainedFormatError):
            raise
        raise PretrainedFormatError(f"{e}; {fix}") from None
    info: dict[str, Any] = {
        "name": g.metadata.get("general.name", "SmolLM2"),
        "chat_template": g.metadata.get("tokenizer.chat_template"),
        "bos_id": g.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_id": g.metadata.get("tokenizer.ggml.eos_token_id"),
        # The storage format of the block matrices (Q4_1 for the bundled file): whether
        # weights="q4" can decode from the file's own 4-bit groups (see pipelines.quantize).
        "weight_types": sorted({t.tensor_type.name for t in g.reader.tensors
                                if t.name.startswith("blk.") and len(t.shape) == 2}),
    }
    if entry is not None:
        try:
            save_gpt_entry(entry, model, tok, info)
        except OSError:  # a read-only or full disk only costs the next load its speed
            pass
    return model, tok, info
