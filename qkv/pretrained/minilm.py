"""all-MiniLM-L6-v2 (safetensors, BERT key names) -> qkv's own :class:`~qkv.models.encoder.Encoder`.

The checkpoint is a BERT encoder (Devlin et al. 2019) distilled to 6 layers x 384 wide
(Wang et al. 2020, MiniLM) and fine-tuned for sentence similarity (Reimers & Gurevych 2019).
This file maps BERT's parameter names onto qkv's (Q, K and V fused into one projection) and
checks every shape; the model code never sees a foreign name (DESIGN.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.models.encoder import Encoder, EncoderConfig
from qkv.pipelines.text import SentenceEncoder
from qkv.pretrained._build import build_with_weights
from qkv.pretrained.gguf_file import PretrainedFormatError
from qkv.tokenizers.hf import HFTokenizer

INSTALL_HINT = "check the model folder, or reinstall the bundled one: `qkv assets install minilm`"

_LAYER_MAP = {  # BERT name (under encoder.layer.{i}.) -> qkv name (under stack.blocks.{i}.)
    "attention.output.dense": "attn.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "mlp.fc_in",
    "output.dense": "mlp.fc_out",
    "output.LayerNorm": "norm2",
}


def encoder_config_from_bert(config: dict[str, Any], pooling: str = "mean") -> EncoderConfig:
    """EncoderConfig from a BERT ``config.json`` (only the fields BERT-style encoders use)."""
    if config.get("hidden_act", "gelu") != "gelu":
        raise PretrainedFormatError(f"hidden_act {config.get('hidden_act')!r} unsupported (gelu only)")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise PretrainedFormatError("only absolute position embeddings are supported")
    try:
        return EncoderConfig(
            vocab_size=int(config["vocab_size"]),
            max_seq_len=int(config["max_position_embeddings"]),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            mlp_hidden=int(config["intermediate_size"]),
            norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            pooling=pooling,  # type: ignore[arg-type]
        )
    except KeyError as e:
        raise PretrainedFormatError(f"config.json lacks {e.args[0]!r}; {INSTALL_HINT}") from None


def encoder_state_dict_from_bert(sd: dict[str, Tensor], cfg: EncoderConfig) -> dict[str, Tensor]:
    """BERT parameter names -> Encoder parameter names (Q, K, V rows stacked into ``qkv``)."""
    def get(name: str) -> Tensor:
        if name not in sd:
            raise PretrainedFormatError(f"weight {name!r} missing from the checkpoint; {INSTALL_HINT}")
        return sd[name]

    out = {
        "tok_emb.weight": get("embeddings.word_embeddings.weight"),
        "pos_emb.weight": get("embeddings.position_embeddings.weight"),
        "emb_norm.weight": get("embeddings.LayerNorm.weight"),
        "emb_norm.bias": get("embeddings.LayerNorm.bias"),
    }
    if cfg.type_vocab_size:
        out["type_emb.weight"] = get("embeddings.token_type_embeddings.weight")
    for i in range(cfg.n_layers):
        b, p = f"encoder.layer.{i}.", f"stack.blocks.{i}."
        for kind in ("weight", "bias"):
            out[p + f"attn.qkv.{kind}"] = torch.cat(
                [get(b + f"attention.self.{n}.{kind}") for n in ("query", "key", "value")]
            )
            for bert, ours in _LAYER_MAP.items():
                out[p + f"{ours}.{kind}"] = get(b + f"{bert}.{kind}")
    return out


def read_safetensors(path: Path, fix: str) -> dict[str, Tensor]:
    """Every tensor of a safetensors file; PretrainedFormatError (ending in ``fix``) if it is
    missing or unreadable (truncated, not safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise PretrainedFormatError(f"weights file not found: {path}; {fix}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise PretrainedFormatError(f"{path} is not a readable safetensors file ({e}); {fix}") from None


def read_json(path: Path, fix: str) -> Any:
    """A JSON file; PretrainedFormatError (ending in ``fix``) if it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PretrainedFormatError(f"{path} not found; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedFormatError(f"{path} is not valid JSON ({e}); {fix}") from None


def load_minilm(folder: str | os.PathLike[str] | None = None) -> SentenceEncoder:
    """Read the model folder (default: the installed ``minilm`` asset), float32 on the CPU: the
    Encoder, its WordPiece tokenizer adding [CLS]/[SEP], and the most tokens per sentence."""
    if folder is None:
        from qkv.assets import asset_path

        folder = asset_path("minilm")
    folder = Path(folder)
    try:
        return SentenceEncoder("minilm", *_load(folder))
    except ValueError as e:  # shapes that do not fit, an unreadable tokenizer.json, ...
        if isinstance(e, PretrainedFormatError):
            raise
        raise PretrainedFormatError(f"{e}; {INSTALL_HINT}") from None


def _load(folder: Path) -> tuple[Encoder, HFTokenizer, int]:
    config = read_json(folder / "config.json", INSTALL_HINT)
    pooling, max_len = sentence_transformers_settings(folder)
    cfg = encoder_config_from_bert(config, pooling)
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"), add_special_tokens=True)
    # The file pads and truncates everything to 128; qkv pads per batch and truncates itself.
    tok.tokenizer.no_padding()
    tok.tokenizer.no_truncation()
    sd = encoder_state_dict_from_bert(read_safetensors(folder / "model.safetensors", INSTALL_HINT), cfg)
    model = build_with_weights(lambda: Encoder(cfg), sd, str(folder / "model.safetensors"))
    return model, tok, min(max_len or 256, cfg.max_seq_len)


def sentence_transformers_settings(folder: Path) -> tuple[str, int | None]:
    """(pooling, max tokens) from a sentence-transformers folder's own files: "cls" when
    1_Pooling/config.json says so, else "mean"; None when sentence_bert_config.json is absent."""
    st_config = folder / "sentence_bert_config.json"
    max_len = (int(read_json(st_config, INSTALL_HINT).get("max_seq_length", 256))
               if st_config.exists() else None)
    pool_cfg = folder / "1_Pooling" / "config.json"
    cls = pool_cfg.exists() and read_json(pool_cfg, INSTALL_HINT).get("pooling_mode_cls_token")
    return ("cls" if cls else "mean"), max_len
