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

The tokenizer comes from the same file's metadata: byte-level BPE (``tokenizer.ggml.model``
"gpt2": vocabulary, merges, control tokens), Gemma's SentencePiece BPE ("llama": pieces with
"▁" for a space, merges rebuilt from the vocabulary, byte fallback), or BERT's WordPiece
("bert", in llama.cpp's "phantom space" spelling, turned back into ``##`` pieces); and the
chat template.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from qkv.models.encoder import Encoder, EncoderConfig
from qkv.models.gpt import GPT, GPTConfig
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
from qkv.tokenizers.hf import HFTokenizer, hf_tokenizers

INSTALL_HINT = "reinstall it with `qkv assets install smollm2`"

# llama.cpp's token types (its SentencePiece converter's numbering, used by every vocabulary)
GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_UNKNOWN = 2
GGUF_TOKEN_CONTROL = 3  # special tokens (<|im_start|>, <bos>, [CLS], ...)
GGUF_TOKEN_USER_DEFINED = 4


def _meta(g: GGUFFile, key: str) -> Any:
    arch = g.metadata.get("general.architecture", "llama")
    full = key.replace("{arch}", arch)
    if full not in g.metadata:
        raise PretrainedFormatError(f"{g.path}: metadata key {full!r} missing; {INSTALL_HINT}")
    return g.metadata[full]


GGUF_DECODERS = ("llama", "qwen2", "gpt2", "gemma")  # llama also covers Mistral-style files (same names)
GGUF_ENCODERS = ("bert",)
GGUF_ARCHITECTURES = (*GGUF_DECODERS, *GGUF_ENCODERS)


def not_a_decoder(path: str | os.PathLike[str], arch: str) -> PretrainedFormatError:
    """The one line for an encoder GGUF (bert) where a language model was asked for."""
    return PretrainedFormatError(f"{path}: a {arch} GGUF is a sentence encoder, not a language model: "
                                 "embed with it (`qkv embed FILE`, `qkv similarity FILE`, qkv.load(FILE))")


def _architecture(g: GGUFFile, kinds: tuple[str, ...]) -> str:
    """The file's ``general.architecture`` if it is one of ``kinds``; else one line naming it
    (and every GGUF architecture qkv reads, or what the file is instead)."""
    arch = g.metadata.get("general.architecture")
    if arch in kinds:
        return arch
    if arch in GGUF_ENCODERS:
        raise not_a_decoder(g.path, arch)
    if arch in GGUF_DECODERS:
        raise PretrainedFormatError(f"{g.path}: a {arch} GGUF is a decoder (a language model), "
                                    "not a sentence encoder")
    why = f" ({REFUSED[arch]})" if arch in REFUSED else ""
    raise PretrainedFormatError(f"{g.path}: GGUF architecture {arch!r} is not supported{why} "
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
    # llama.cpp's gemma converter writes no RoPE base: its default, 10000, is Gemma's.
    rope_theta = (float(g.metadata.get(f"{arch}.rope.freq_base", 10000.0)) if gemma
                  else float(_meta(g, "{arch}.rope.freq_base")))
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
    def get(name: str) -> Tensor:
        if name not in tensors:
            raise PretrainedFormatError(f"tensor {name!r} missing from the GGUF file; {INSTALL_HINT}")
        w = tensors[name]
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rope_rows(w, cfg.n_heads if "attn_q" in name else cfg.resolved_kv_heads)
        return torch.from_numpy(w)

    return map_names(parameter_names(lambda: GPT(cfg)), names, get, cfg.tie_embeddings)


def _token_types(g: GGUFFile, tokens: list[str]) -> list[int]:
    types: list[int] = g.metadata.get("tokenizer.ggml.token_type", [GGUF_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise PretrainedFormatError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types")
    return types


def tokenizer_from_gguf(g: GGUFFile) -> HFTokenizer:
    """The tokenizer stored in GGUF metadata (``tokenizer.ggml.model``): "gpt2" byte-level BPE,
    "llama" SentencePiece BPE (Gemma's files), "bert" WordPiece (:func:`wordpiece_from_gguf`)."""
    model = g.metadata.get("tokenizer.ggml.model")
    if model == "bert":
        return wordpiece_from_gguf(g)
    if model == "llama" and g.metadata.get("general.architecture") == "gemma":
        return sentencepiece_from_gguf(g)
    if model != "gpt2":
        raise PretrainedFormatError(f"{g.path}: tokenizer model {model!r} unsupported (read: gpt2 "
                                    "BPE, bert WordPiece, and llama SentencePiece in gemma files)")
    return byte_bpe_from_gguf(g)


def byte_bpe_from_gguf(g: GGUFFile) -> HFTokenizer:
    """Byte-level BPE as a ``tokenizers.Tokenizer``: GPT-2 byte-level pre-tokenisation (no
    prefix space), the stored merges, and the control tokens (<|im_start|>, <|im_end|>, ...)
    matched whole in the text."""
    tk = hf_tokenizers()
    tokens: list[str] = _meta(g, "tokenizer.ggml.tokens")
    types = _token_types(g, tokens)
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


def _special(g: GGUFFile, tokens: list[str], keys: tuple[str, ...], default: str) -> str:
    """The token the first ``tokenizer.ggml.<key>`` present names, else ``default`` if the
    vocabulary has it."""
    for key in keys:
        i = g.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokens):
            return tokens[i]
    if default not in tokens:
        raise PretrainedFormatError(f"{g.path}: no tokenizer.ggml.{keys[0]} and no {default} token")
    return default


def sentencepiece_from_gguf(g: GGUFFile) -> HFTokenizer:
    """Gemma's SentencePiece BPE from GGUF metadata (``tokenizer.ggml.model`` "llama").

    A space is "▁" inside pieces; characters no piece spells fall back to <0xNN> byte tokens.
    The file lists no merges: every piece that is two pieces joined is their merge, ranked by
    the piece's place in the file (as transformers' GGUF reader does for Gemma, whose scores
    do not follow its merge order). llama.cpp's converter stores Gemma's runs of spaces (user-
    defined pieces "▁▁", ...) with real spaces: they are spelled with "▁" again. <bos> is added
    in front of the text (``tokenizer.ggml.add_bos_token``, default true, as llama.cpp does).
    """
    tk = hf_tokenizers()
    if g.metadata.get("tokenizer.ggml.add_space_prefix", False):
        raise PretrainedFormatError(f"{g.path}: a SentencePiece vocabulary with add_space_prefix "
                                    "(Llama-style) is not read; only Gemma's")
    stored: list[str] = _meta(g, "tokenizer.ggml.tokens")
    types = _token_types(g, stored)
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in stored]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated piece: its first id
    pieces = {t for t, ty in zip(tokens, types, strict=True)
              if ty in (GGUF_TOKEN_NORMAL, GGUF_TOKEN_USER_DEFINED)}
    merges = []  # (rank of the joined piece, -len(left), left, right)
    for t in pieces:
        merges += [(vocab[t], -k, t[:k], t[k:]) for k in range(1, len(t))
                   if t[:k] in pieces and t[k:] in pieces]
    merges.sort()
    unk = _special(g, tokens, ("unknown_token_id",), "<unk>")
    try:
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                         unk_token=unk, fuse_unk=True, byte_fallback=True))
    except Exception as e:  # the tokenizers library's own error
        raise PretrainedFormatError(f"{g.path}: its SentencePiece tokenizer does not build ({e})") from None
    tok.normalizer = tk.normalizers.Replace(" ", "▁")
    tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(),
                                        tk.decoders.Fuse()])
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True)
                            if ty in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_UNKNOWN)])
    tok.add_tokens([tk.AddedToken(t, special=False, normalized=False)  # <start_of_turn>, "\n\n", ...
                    for t, ty in zip(tokens, types, strict=True)
                    if ty == GGUF_TOKEN_USER_DEFINED and t.strip("▁")])
    template = []
    if g.metadata.get("tokenizer.ggml.add_bos_token", True):
        template.append(_special(g, tokens, ("bos_token_id",), "<bos>"))
    template.append("$A")
    if g.metadata.get("tokenizer.ggml.add_eos_token", False):
        template.append(_special(g, tokens, ("eos_token_id",), "<eos>"))
    tok.post_processor = tk.processors.TemplateProcessing(
        single=" ".join(template), special_tokens=[(t, vocab[t]) for t in template if t != "$A"])
    return HFTokenizer(tok, add_special_tokens=True)


def _wordpiece_spelling(token: str, kind: int) -> str:
    """llama.cpp's "phantom space" spelling of a BERT token back to BERT's own: "▁word" begins
    a word ("word"), a bare "piece" continues one ("##piece"). "[...]" tokens are stored as they
    are by older converters, control tokens ([CLS], <extra>) by newer ones."""
    if token.startswith("[") and token.endswith("]"):
        return token
    if token.startswith("▁"):
        return token[1:]
    return token if kind == GGUF_TOKEN_CONTROL else "##" + token


def wordpiece_from_gguf(g: GGUFFile) -> HFTokenizer:
    """BERT's WordPiece from GGUF metadata (``tokenizer.ggml.model`` "bert"), as Hugging Face's
    BertTokenizerFast builds it: lower-cased and accent-stripped text (llama.cpp's default for
    a bert vocabulary), split at spaces and punctuation, greedy longest-match pieces
    ("##" continues a word), "[CLS] … [SEP]" around each text; [UNK] for a word no piece spells.
    Newer converters store a cased vocabulary's ``tokenizer.ggml.normalizer.lowercase`` false."""
    tk = hf_tokenizers()
    stored: list[str] = _meta(g, "tokenizer.ggml.tokens")
    types = _token_types(g, stored)
    tokens = [_wordpiece_spelling(t, ty) for t, ty in zip(stored, types, strict=True)]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    unk = _special(g, tokens, ("unknown_token_id",), "[UNK]")
    # Older files name [CLS] cls_token_id; llama.cpp's converter now stores it as bos ([SEP]: eos).
    cls = _special(g, tokens, ("cls_token_id", "bos_token_id"), "[CLS]")
    sep = _special(g, tokens, ("seperator_token_id", "eos_token_id"), "[SEP]")  # sic: llama.cpp's key
    tok = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lowercase = bool(g.metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(g.metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    tok.normalizer = tk.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                   strip_accents=strip_accents, lowercase=lowercase)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tk.processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.decoder = tk.decoders.WordPiece(prefix="##")
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == GGUF_TOKEN_CONTROL])
    return HFTokenizer(tok, add_special_tokens=True)


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


def _tensor_getter(tensors: dict[str, np.ndarray]):
    def get(name: str) -> Tensor:
        if name not in tensors:
            raise PretrainedFormatError(f"tensor {name!r} missing from the GGUF file")
        return torch.from_numpy(tensors[name])

    return get


GGUFKind = Literal["decoder", "encoder"]


def load_gguf(
    path: str | os.PathLike[str] | None = None, cache: bool = True
) -> tuple[GGUFKind, GPT | Encoder, HFTokenizer, dict[str, Any]]:
    """Read a GGUF of any :data:`GGUF_ARCHITECTURES` (default: the installed ``smollm2`` asset).

    Returns (kind, model, tokenizer, info): "decoder" with a GPT (info: ``chat_template``,
    ``bos_id``, ``eos_id``, ``eot_id``, ``weight_types``, the file's name) or "encoder" with a
    BERT-style Encoder (info: ``max_tokens``, the context length). With ``cache`` a decoder's
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
    entry = entry_dir("smollm2", path) if cache and path.is_file() else None
    if entry is not None and entry.is_dir():
        hit = load_gpt_entry(entry)
        if hit is not None:
            return ("decoder", *hit)
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
            info = {"name": g.metadata.get("general.name", path.name), "architecture": arch,
                    "max_tokens": ecfg.max_seq_len}
            return "encoder", encoder, tok, info
        cfg = gpt_config_from_gguf(g)
        tok = tokenizer_from_gguf(g)
        names = {"gpt2": GPT2_GGUF, "gemma": GEMMA_GGUF}.get(arch, LLAMA_GGUF)
        sd = gpt_state_dict_from_gguf(g.tensors(), cfg, permuted=arch == "llama", names=names)
        model = build_with_weights(lambda: GPT(cfg), sd, str(path))
    except ValueError as e:  # sizes in the metadata that do not fit the tensors, ...
        if isinstance(e, PretrainedFormatError):
            raise
        raise PretrainedFormatError(f"{e}; {fix}") from None
    info = {
        "name": g.metadata.get("general.name", "SmolLM2"),
        "architecture": arch,
        "chat_template": g.metadata.get("tokenizer.chat_template"),
        "bos_id": g.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_id": g.metadata.get("tokenizer.ggml.eos_token_id"),
        "eot_id": g.metadata.get("tokenizer.ggml.eot_token_id"),  # Gemma's <end_of_turn>
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
    return "decoder", model, tok, info


def load_smollm2(
    path: str | os.PathLike[str] | None = None, cache: bool = True
) -> tuple[GPT, HFTokenizer, dict[str, Any]]:
    """Read a decoder GGUF (default: the installed ``smollm2`` asset) into (GPT, tokenizer,
    info); see :func:`load_gguf`. A bert (encoder) file is one PretrainedFormatError line."""
    _, model, tok, info = load_gguf(path, cache)
    if not isinstance(model, GPT):
        raise not_a_decoder(path or "smollm2", info["architecture"])
    return model, tok, info
