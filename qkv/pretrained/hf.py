"""A Hugging Face checkpoint folder -> qkv's own GPT or Encoder, chosen by ``model_type``.

    config.json                      the architecture (``model_type``) and its sizes
    model.safetensors                the weights, or shards listed in model.safetensors.index.json
    tokenizer.json                   the tokenizer (read by the ``tokenizers`` library)
    tokenizer_config.json            chat template and eos token, if present (or chat_template.jinja)
    generation_config.json           eos token ids, if present

The architecture tables live in :mod:`qkv.pretrained.architectures`; this file only reads
files. Every problem (no config.json, a truncated shard, shapes that disagree with the
config, an architecture qkv does not build) is one :class:`PretrainedFormatError` line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.models.encoder import Encoder
from qkv.models.gpt import GPT
from qkv.pipelines.text import CausalLM, SentenceEncoder
from qkv.pretrained._build import build_with_weights, parameter_names
from qkv.pretrained.architectures import (
    DECODERS,
    ENCODERS,
    IGNORED_SUFFIXES,
    REFUSED,
    SUPPORTED,
    bert_config,
    map_names,
)
from qkv.pretrained.gguf_file import PretrainedFormatError
from qkv.pretrained.minilm import (
    encoder_state_dict_from_bert,
    read_safetensors,
    sentence_transformers_settings,
)
from qkv.pretrained.minilm import read_json as _read_json
from qkv.tokenizers.hf import HFTokenizer

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def hf_model_type(folder: str | os.PathLike[str]) -> str | None:
    """The ``model_type`` of a Hugging Face checkpoint folder (a config.json that has one and
    no qkv ``family``), read without loading anything; None for any other path."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "family" in cfg or not isinstance(cfg.get("model_type"), str):
        return None
    return cfg["model_type"]


def is_hf_folder(name: str) -> bool:
    """Whether ``name`` is meant as a folder (an existing one, or written like a path)."""
    return os.path.isdir(name) or os.sep in name or name.startswith(".")


FIX = "copy the checkpoint folder again"


def read_json(path: Path) -> Any:
    return _read_json(path, FIX)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of ``folder``; PretrainedFormatError if there is no such folder or file."""
    if not folder.is_dir():
        raise PretrainedFormatError(f"{folder} is not a folder (expected a Hugging Face checkpoint folder)")
    if not (folder / "config.json").is_file():
        raise PretrainedFormatError(f"{folder} has no config.json; a Hugging Face checkpoint folder "
                                    "holds config.json, *.safetensors and tokenizer.json")
    config = read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise PretrainedFormatError(f"{folder / 'config.json'} is not a JSON object")
    return config


def _read_shard(path: Path) -> dict[str, Tensor]:
    return read_safetensors(path, "it may be truncated: copy it again")


def read_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's safetensors file, or of all shards its index lists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise PretrainedFormatError(f"{index} has no weight_map")
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(_read_shard(folder / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise PretrainedFormatError(f"{index} lists {missing[0]}, which no shard holds")
        return tensors
    if (folder / "model.safetensors").is_file():
        return _read_shard(folder / "model.safetensors")
    bins = sorted(p.name for p in folder.glob("*.bin"))
    found = f" (found {bins[0]}: PyTorch pickles are not read; save with safe_serialization)" if bins else ""
    raise PretrainedFormatError(f"{folder} has no model.safetensors{found}")


def _check_types(tensors: dict[str, Tensor], folder: Path) -> None:
    for name, t in tensors.items():
        if t.dtype not in FLOAT_TYPES:
            raise PretrainedFormatError(
                f"{folder}: tensor {name} is {str(t.dtype).removeprefix('torch.')}; supported tensor "
                "types: float32, float16, bfloat16 (quantized checkpoints are not read)")


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _stop_ids(folder: Path, config: dict[str, Any], tok_config: dict[str, Any],
              tok: HFTokenizer) -> tuple[int, ...]:
    """eos ids from generation_config.json / config.json, plus tokenizer_config's eos token."""
    gen = folder / "generation_config.json"
    ids: list[Any] = []
    for source in ((read_json(gen) if gen.is_file() else {}), config):
        eos = source.get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos])
    eos_token = tok_config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str):
        ids.append(tok.token_to_id(eos_token))
    return tuple(sorted({int(i) for i in ids if isinstance(i, int) and 0 <= i < tok.vocab_size}))


def _tokenizer(folder: Path, add_special_tokens: bool) -> HFTokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise PretrainedFormatError(f"{folder} has no tokenizer.json (save the fast tokenizer into it)")
    try:
        return HFTokenizer.from_file(str(path), add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise PretrainedFormatError(str(e)) from None


def model_type(config: dict[str, Any], folder: Path) -> str:
    """The folder's ``model_type``; PretrainedFormatError naming it when qkv does not build it."""
    arch = config.get("model_type")
    if arch in SUPPORTED:
        return arch
    why = f" ({REFUSED[arch]})" if arch in REFUSED else ""
    raise PretrainedFormatError(f"{folder}: architecture {arch!r} is not supported{why}; "
                                f"supported: {', '.join(SUPPORTED)}")


def _fit(fn: Any, folder: Path, hint: str = "") -> Any:
    """``fn()``, its ValueErrors (a config qkv's dataclasses refuse, shapes that do not fit
    the tensors) as one PretrainedFormatError line naming the folder, ``hint`` appended."""
    try:
        return fn()
    except ValueError as e:
        msg = str(e)
        msg = msg if msg.startswith(str(folder)) else f"{folder}: {msg}"
        raise PretrainedFormatError(msg + hint) from None


SIZES_HINT = "; config.json's sizes do not fit the weights"


def load_decoder(folder: Path, config: dict[str, Any], arch: str) -> GPT:
    """A GPT from the folder's weights, in float32."""
    if config.get("quantization_config"):
        raise PretrainedFormatError(f"{folder}: quantized checkpoints are not supported "
                                    f"({config['quantization_config'].get('quant_method', '?')})")
    make_config, names, fix = DECODERS[arch]
    cfg = _fit(lambda: make_config(config, arch), folder)
    tensors = read_weights(folder)
    _check_types(tensors, folder)
    used: set[str] = set()

    def get(name: str) -> Tensor:
        if name not in tensors:
            raise PretrainedFormatError(f"{folder}: tensor {name} missing (the config asks for it)")
        used.add(name)
        t = tensors[name].float()
        return t if fix is None else fix(name, t)

    sd = map_names(parameter_names(lambda: GPT(cfg)), names, get, cfg.tie_embeddings)
    unread = {k: v for k, v in tensors.items() if k not in used and not k.endswith(IGNORED_SUFFIXES)}
    if unread and not (cfg.tie_embeddings and set(unread) == {"lm_head.weight"}):
        first = sorted(unread)[0]
        raise PretrainedFormatError(f"{folder}: tensor {first} is not used by a {arch} model of this "
                                    "config.json (a feature qkv does not build, or a mismatched config)")
    return _fit(lambda: build_with_weights(lambda: GPT(cfg), sd, str(folder)), folder, SIZES_HINT)


def load_encoder(folder: Path, config: dict[str, Any]) -> tuple[Encoder, int]:
    """A BERT-style Encoder (bare ``BertModel`` names, or ``bert.``-prefixed ones)."""
    pooling, max_tokens = sentence_transformers_settings(folder)
    cfg = _fit(lambda: bert_config(config, pooling), folder)
    tensors = read_weights(folder)
    _check_types(tensors, folder)
    bare = {k.removeprefix("bert."): v.float() for k, v in tensors.items()}
    try:
        sd = encoder_state_dict_from_bert(bare, cfg)
    except PretrainedFormatError as e:
        raise PretrainedFormatError(f"{folder}: {str(e).split(';')[0]}") from None
    model = _fit(lambda: build_with_weights(lambda: Encoder(cfg), sd, str(folder)), folder, SIZES_HINT)
    return model, min(max_tokens or cfg.max_seq_len, cfg.max_seq_len)


def load_hf_folder(path: str | os.PathLike[str]) -> CausalLM | SentenceEncoder:
    """Read a Hugging Face checkpoint folder, float32 on the CPU, named by the folder: a decoder
    (its chat template and stop ids from the folder's files) or, for bert, a sentence encoder.

    Raises:
        PretrainedFormatError: one line naming the file and what is wrong.
    """
    folder = Path(path)
    config = read_config(folder)
    arch = model_type(config, folder)
    name = folder.resolve().name
    if arch in ENCODERS:
        model, max_tokens = load_encoder(folder, config)
        tok = _tokenizer(folder, add_special_tokens=True)
        tok.tokenizer.no_padding()  # qkv pads per batch and truncates itself
        tok.tokenizer.no_truncation()
        return SentenceEncoder(name, model, tok, max_tokens, arch)
    gpt = load_decoder(folder, config, arch)
    # The tokenizer's own post-processor adds what transformers' tokenizer(text) adds (Llama's <s>).
    tok = _tokenizer(folder, add_special_tokens=True)
    tc_path = folder / "tokenizer_config.json"
    tok_config = read_json(tc_path) if tc_path.is_file() else {}
    return CausalLM(name, gpt, tok, _chat_template(folder, tok_config),
                    tuple(_stop_ids(folder, config, tok_config, tok)), arch)
