"""GGUF files (llama.cpp's format; SmolLM2-135M-Instruct is the bundled one) -> qkv's own models.

SmolLM2 is a Llama-architecture decoder: RMSNorm, SwiGLU, RoPE (θ = 100000), grouped-query
attention (9 query heads, 3 key/value heads), no biases, tied input/output embeddings
(Allal et al. 2025). All of that is a :class:`~qkv.models.gpt.GPTConfig`; this file only maps
llama.cpp's tensor names onto qkv's (the tables are in :mod:`~qkv.pretrained.architectures`)
and undoes one layout difference:

llama.cpp's converter permutes the rows of W_Q and W_K inside each head so that the two
halves of every rotated pair sit next to each other (its RoPE rotates adjacent pairs
(x0, x1), (x2, x3), ...). qkv, like the original checkpoint, rotates pairs (x_i, x_{i+D/2})
("rotate half"). :func:`unpermute_rope_rows` puts the rows back.

Other files load by their ``general.architecture`` (:data:`GGUF_ARCHITECTURES`):

    llama   GPT      also Mistral-style files; Q/K rows permuted (undone)
    qwen2   GPT      llama + q/k/v biases; rows as they were
    gpt2    GPT      LayerNorm, tanh GELU, learned positions, biases
    gemma   GPT      llama + GeGLU (tanh), embeddings × √dim, head_dim from ``attention.key_length``;
                     rows as they were, RMSNorm weights stored with Gemma's +1 already added
    bert    Encoder  post-LN BERT (all-MiniLM-L6-v2 and other embedding models)

The tokenizer comes from the same file's metadata (:mod:`~qkv.pretrained.gguf_tokenizers`):
byte-level BPE (``tokenizer.ggml.model`` "gpt2": vocabulary, merges, control tokens),
SentencePiece BPE ("llama": Llama-2, TinyLlama, Mistral and Gemma files; pieces with "▁" for a
space, merges rebuilt from the scores, byte fallback), or BERT's WordPiece ("bert", in
llama.cpp's "phantom space" spelling, turned back into ``##`` pieces); and the chat template.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from qkv.models.encoder import Encoder, EncoderConfig
from qkv.models.gpt import GPT, GPTConfig
from qkv.pipelines.text import CausalLM, SentenceEncoder
from qkv.pretrained._build import build_with_weights, parameter_names
from qkv.pretrained.architectures import (
    BERT_GGUF,
    GEMMA_GGUF,
    GPT2_GGUF,
    LLAMA_GGUF,
    REFUSED,
    Names,
    map_names,
)
from qkv.pretrained.cache import entry_dir, load_gpt_entry, save_gpt_entry
from qkv.pretrained.gguf_file import GGUFFile, PretrainedFormatError, read_gguf
from qkv.pretrained.gguf_tokenizers import tokenizer_from_gguf

INSTALL_HINT = "reinstall it with `qkv assets install smollm2`"


def _fix(path: Any) -> str:
    """What to do about a damaged file: reinstall the bundled SmolLM2, or check a file of one's own."""
    from qkv.assets import AssetMissingError, asset_path

    try:
        bundled = Path(asset_path("smollm2")).resolve() == Path(path).resolve()
    except (AssetMissingError, OSError, ValueError):
        bundled = False
    return INSTALL_HINT if bundled else "the file is incomplete, or not a GGUF as llama.cpp writes it"


def _meta(g: GGUFFile, key: str) -> Any:
    full = key.replace("{arch}", g.metadata.get("general.architecture", "llama"))
    return g.metadata[full] if full in g.metadata else g.require(full, _fix(g.path))


GGUF_DECODERS = ("llama", "qwen2", "gpt2", "gemma")  # llama also covers Mistral-style files (same names)
GGUF_ENCODERS = ("bert",)
GGUF_ARCHITECTURES = (*GGUF_DECODERS, *GGUF_ENCODERS)


def not_a_decoder(path: str | os.PathLike[str], arch: str) -> PretrainedFormatError:
    """The one line for an encoder GGUF (bert) where a language model was asked for."""
    return PretrainedFormatError(f"{path}: a {arch} GGUF is a sentence encoder, not a language model: "
                                 "embed with it (`qkv embed FILE`, `qkv similarity FILE`, qkv.load(FILE))")


def _architecture(g: GGUFFile, kinds: tuple[str, ...]) -> str:
    """The file's ``general.architecture`` if it is one of ``kinds``; see :func:`check_architecture`."""
    return check_architecture(g.path, g.metadata.get("general.architecture"), kinds)


def check_architecture(path: str | os.PathLike[str], arch: Any,
                       kinds: tuple[str, ...] = GGUF_ARCHITECTURES) -> str:
    """``arch`` (a file's ``general.architecture``) if it is one of ``kinds``; else one line
    naming it (and every GGUF architecture qkv reads, or what the file is instead: an encoder
    where a language model is asked for, and the reverse)."""
    if arch in kinds:
        return arch
    if arch in GGUF_ENCODERS:
        raise not_a_decoder(path, arch)
    if arch in GGUF_DECODERS:
        raise PretrainedFormatError(f"{path}: a {arch} GGUF is a decoder (a language model), "
                                    "not a sentence encoder")
    why = f" ({REFUSED[arch]})" if arch in REFUSED else ""
    raise PretrainedFormatError(f"{path}: GGUF architecture {arch!r} is not supported{why} "
                                f"(supported: {', '.join(GGUF_ARCHITECTURES)})")


def gpt_config_from_gguf(g: GGUFFile) -> GPTConfig:
    """The GPTConfig of a decoder GGUF (sizes, heads, head width, RoPE base, norm epsilon;
    qwen2: biases on q/k/v; gemma: GeGLU, embeddings × √dim)."""
    arch = _architecture(g, GGUF_DECODERS)
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
    # Gemma's heads are wider than dim / n_heads (256 x 8 heads on a 2048-wide model).
    head_dim = int(g.metadata.get(f"{arch}.attention.key_length", dim // n_heads))
    value_dim = int(g.metadata.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise PretrainedFormatError(f"{g.path}: values {value_dim} wide but keys {head_dim}: qkv's "
                                    "attention has one head width")
    rope_dims = int(g.metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise PretrainedFormatError(f"{g.path}: partial RoPE ({rope_dims} of {head_dim}) unsupported")
    gemma = arch == "gemma"
    # Optional, as in llama.cpp (its default 10000, the original RoPE's base): its converter
    # writes the key only where config.json has a rope_theta, and never for Gemma.
    rope_theta = float(g.metadata.get(f"{arch}.rope.freq_base", 10000.0))
    return GPTConfig(
        vocab_size=len(_meta(g, "tokenizer.ggml.tokens")),
        max_seq_len=int(_meta(g, "{arch}.context_length")),
        dim=dim,
        n_layers=int(_meta(g, "{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(g.metadata.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=None if head_dim * n_heads == dim else head_dim,  # None: dim / n_heads
        mlp_hidden=int(_meta(g, "{arch}.feed_forward_length")),
        mlp="geglu_tanh" if gemma else "swiglu",
        norm="rmsnorm",
        norm_eps=float(_meta(g, "{arch}.attention.layer_norm_rms_epsilon")),
        positions="rope",
        rope_theta=rope_theta,
        tie_embeddings="output.weight" not in g.tensor_names(),  # gemma: always tied
        embed_scale=gemma,
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
    def unpermute(name: str, w: np.ndarray) -> np.ndarray:
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            return unpermute_rope_rows(w, cfg.n_heads if "attn_q" in name else cfg.resolved_kv_heads)
        return w

    return map_names(parameter_names(lambda: GPT(cfg)), names, _tensor_getter(tensors, unpermute),
                     cfg.tie_embeddings)


# llama.cpp's bert.pooling_type: 0 none (per-token states), 1 mean, 2 cls, 3 last, 4 rank.
# A file without one, or with none, is read out by the mean (what a folder without
# 1_Pooling/config.json gets).
GGUF_POOLING = {0: "mean", 1: "mean", 2: "cls"}


def encoder_config_from_gguf(g: GGUFFile) -> EncoderConfig:
    """The EncoderConfig of a bert GGUF: sizes, LayerNorm epsilon, read-out (``pooling_type``),
    and the token-type rows (the ``token_types`` tensor's; none without it)."""
    _architecture(g, GGUF_ENCODERS)
    pooling = int(g.metadata.get("bert.pooling_type", 1))
    if pooling not in GGUF_POOLING:
        raise PretrainedFormatError(f"{g.path}: bert.pooling_type {pooling} (3 last, 4 rank) unsupported; "
                                    "read: 0 none and 1 mean (mean-pooled), 2 cls")
    types = next((t for t in g.reader.tensors if t.name == "token_types.weight"), None)
    return EncoderConfig(
        vocab_size=len(_meta(g, "tokenizer.ggml.tokens")),
        max_seq_len=int(_meta(g, "{arch}.context_length")),
        type_vocab_size=0 if types is None else int(types.shape[-1]),  # GGUF: innermost first
        dim=int(_meta(g, "{arch}.embedding_length")),
        n_layers=int(_meta(g, "{arch}.block_count")),
        n_heads=int(_meta(g, "{arch}.attention.head_count")),
        mlp_hidden=int(_meta(g, "{arch}.feed_forward_length")),
        norm_eps=float(_meta(g, "{arch}.attention.layer_norm_epsilon")),
        pooling=GGUF_POOLING[pooling],  # type: ignore[arg-type]
    )


def _tensor_getter(tensors: dict[str, np.ndarray], layout: Any = None):
    """``get(name) -> Tensor`` over a GGUF's tensors for :func:`map_names`, through ``layout(name,
    array)`` (a row order to undo) where given; one line for a missing tensor."""
    def get(name: str) -> Tensor:
        if name not in tensors:
            raise PretrainedFormatError(f"tensor {name!r} missing from the GGUF file; the file is "
                                        "incomplete, or its architecture's tensors are named otherwise")
        w = tensors[name]
        return torch.from_numpy(w if layout is None else layout(name, w))

    return get


GGUFKind = Literal["decoder", "encoder"]


def load_gguf(path: str | os.PathLike[str] | None = None, cache: bool = True) -> CausalLM | SentenceEncoder:
    """Read a GGUF of any :data:`GGUF_ARCHITECTURES` (default: the installed ``smollm2`` asset),
    float32 on the CPU, named by its file: a decoder (a GPT with the file's chat template, stop
    ids and storage formats) or, for bert, a sentence encoder. With ``cache`` a decoder's
    conversion is stored once and reused (see :mod:`qkv.pretrained.cache`); encoders are small.

    Raises:
        PretrainedFormatError: one line naming the file and what is wrong.
    """
    fix = INSTALL_HINT
    if path is None:
        from qkv.assets import asset_path

        path = asset_path("smollm2")
    else:
        fix = ("check that it is a complete GGUF file of one of: "
               f"{', '.join(GGUF_ARCHITECTURES)} (the bundled one: `qkv assets install smollm2`)")
    path = Path(path)
    entry = entry_dir(path) if cache and path.is_file() else None
    if entry is not None and entry.is_dir():
        hit = load_gpt_entry(entry)
        if hit is not None:
            return replace(hit, name=path.name)
        shutil.rmtree(entry, ignore_errors=True)  # damaged: convert again
    g = read_gguf(path, fix=fix)
    arch = _architecture(g, GGUF_ARCHITECTURES)
    try:
        if arch in GGUF_ENCODERS:
            ecfg = encoder_config_from_gguf(g)
            tok = tokenizer_from_gguf(g)
            sd = map_names(parameter_names(lambda: Encoder(ecfg)), BERT_GGUF, _tensor_getter(g.tensors()),
                           tied=False)
            encoder = build_with_weights(lambda: Encoder(ecfg), sd, str(path))
            return SentenceEncoder(path.name, encoder, tok, ecfg.max_seq_len, arch)
        cfg = gpt_config_from_gguf(g)
        tok = tokenizer_from_gguf(g)
        names = {"gpt2": GPT2_GGUF, "gemma": GEMMA_GGUF}.get(arch, LLAMA_GGUF)
        sd = gpt_state_dict_from_gguf(g.tensors(), cfg, permuted=arch == "llama", names=names)
        model = build_with_weights(lambda: GPT(cfg), sd, str(path))
    except ValueError as e:  # sizes in the metadata that do not fit the tensors, ...
        if isinstance(e, PretrainedFormatError):
            raise
        raise PretrainedFormatError(f"{e}; {fix}") from None
    meta = g.metadata
    # The file's end of text and end of turn (Gemma's <end_of_turn>), and ChatML's <|im_end|>.
    stops = {meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"),
             tok.token_to_id("<|im_end|>")} - {None}
    # The storage format of the block matrices (Q4_1 for the bundled file): whether
    # weights="q4" can decode from the file's own 4-bit groups (see CausalLM.quantize).
    stored = sorted({t.tensor_type.name for t in g.reader.tensors
                     if t.name.startswith("blk.") and len(t.shape) == 2})
    lm = CausalLM(path.name, model, tok, meta.get("tokenizer.chat_template"),
                  tuple(sorted(int(i) for i in stops)), arch, tuple(stored))
    if entry is not None:
        try:
            save_gpt_entry(entry, lm)
        except OSError:  # a read-only or full disk only costs the next load its speed
            pass
    return lm


def load_gguf_decoder(path: str | os.PathLike[str] | None = None, cache: bool = True) -> CausalLM:
    """:func:`load_gguf` where a language model is needed: a bert (encoder) file is one
    PretrainedFormatError line."""
    lm = load_gguf(path, cache)
    if not isinstance(lm, CausalLM):
        raise not_a_decoder(path or "smollm2", lm.architecture)
    return lm
