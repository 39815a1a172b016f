"""qkv's own GPT runs -> Hugging Face checkpoint folders: the inverse of :mod:`qkv.pretrained.hf`
(which reads them), through the same name tables (:mod:`qkv.pretrained.architectures`) read
backwards. :func:`qkv.pretrained.exporter.export_model` dispatches here and to
:mod:`qkv.pretrained.export_gguf`.

    GPTConfig of the run                                   HF model_type
    positions learned, LayerNorm, MLP gelu/gelu_tanh/relu  gpt2   (fused c_attn, Conv1D (in, out))
    positions rope, RMSNorm, SwiGLU (GQA allowed)          llama

Exact by construction, so nothing is approximated:

- qkv's ``gelu`` (exact erf GELU) is gpt2's ``activation_function="gelu"``, ``gelu_tanh`` is
  ``"gelu_new"`` (GPT-2's own tanh form), ``relu`` is ``"relu"``.
- A run without biases (``bias=false``, the ``tiny``/``cpu`` presets) exports to gpt2 with zero
  biases (gpt2 always has them); to llama, a run with any bias gets ``attention_bias`` and
  ``mlp_bias`` with zeros where qkv had none. Zeros add nothing: logits are unchanged.
- ``norm_eps`` becomes ``layer_norm_epsilon`` / ``rms_norm_eps``; ``rope_theta`` becomes
  ``rope_parameters``; ``tie_embeddings`` becomes ``tie_word_embeddings``.

Refused, with the option named (:func:`hf_architecture`): sinusoidal, ALiBi or no positions (gpt2
and llama have no such position scheme), RMSNorm with learned positions or LayerNorm with RoPE,
a gated MLP in gpt2 or an ungated one (or GeGLU) in llama, ``embed_scale`` (Gemma's √dim),
grouped-query heads or a custom ``head_dim`` in gpt2 (one head count, width dim / n_heads).

What cannot be carried: the training state (optimizer, step, metrics: only the best weights
go); ``dropout`` is written but only matters for training; ``backend`` (an attention
implementation, not a weight). A BPE run's ``<|endoftext|>`` (the last id of every vocabulary
qkv trains) becomes ``bos_token_id`` and ``eos_token_id``, as in GPT-2, so ``generate`` stops
where ``qkv generate`` does; a character run, or a BPE run trained before the marker existed,
has no such token: ``eos_token_id`` is null and generation runs to its length limit.
``generation_config.json`` carries ``qkv generate``'s defaults (sampling at temperature 0.8
among the top 200 tokens) and the context as ``max_length``. A character tokenizer becomes a
``tokenizers`` BPE model with the characters as its vocabulary and no merges, no pre-tokenizer
(the whole text is split into characters) and a Fuse decoder; a character qkv never saw is an
error in qkv but is dropped by ``tokenizers``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.fileio import current_umask
from qkv.models.gpt import GPT, GPTConfig
from qkv.pretrained.architectures import GPT2, GPT2_ACTIVATIONS, LLAMA, Names, conv1d_transposed

# qkv's MLP kind -> gpt2's activation_function (the inverse of GPT2_ACTIVATIONS, preferring
# GPT-2's own name "gelu_new" for the tanh form)
GPT2_ACTIVATION_OF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
assert all(GPT2_ACTIVATIONS[a] == m for m, a in GPT2_ACTIVATION_OF.items())

TABLES: dict[str, Names] = {"gpt2": GPT2, "llama": LLAMA}


def hf_architecture(cfg: GPTConfig) -> str:
    """``"gpt2"`` or ``"llama"``: the Hugging Face architecture that computes what ``cfg`` does.

    Raises:
        ValueError: one line naming the option (and its value) that neither can represent.
    """
    def refuse(what: str) -> ValueError:
        return ValueError(f"cannot export: {what} has no counterpart in Hugging Face's gpt2 or llama "
                          "(gpt2 = --positions learned --norm layernorm --mlp gelu|gelu_tanh|relu; "
                          "llama = --positions rope --norm rmsnorm --mlp swiglu)")

    if cfg.embed_scale:
        raise refuse("--embed_scale true (embeddings x sqrt(dim))")
    if cfg.norm_placement == "post":
        raise refuse("--norm_placement post (a norm after each residual sum, none at the end)")
    if cfg.mlp == "none":
        raise refuse("--mlp none (attention-only blocks)")
    if cfg.tie_qk:
        raise refuse("--tie_qk true (one matrix for queries and keys)")
    if cfg.positions == "learned":
        if cfg.norm != "layernorm":
            raise refuse(f"--norm {cfg.norm} with --positions learned")
        if cfg.mlp not in GPT2_ACTIVATION_OF:
            raise refuse(f"--mlp {cfg.mlp} with --positions learned")
        if cfg.resolved_kv_heads != cfg.n_heads:
            raise refuse(f"--n_kv_heads {cfg.n_kv_heads} (grouped-query attention) with --positions learned")
        if cfg.resolved_head_dim * cfg.n_heads != cfg.dim:
            raise refuse(f"--head_dim {cfg.head_dim} (not dim / n_heads) with --positions learned")
        return "gpt2"
    if cfg.positions == "rope":
        if cfg.norm != "rmsnorm":
            raise refuse(f"--norm {cfg.norm} with --positions rope")
        if cfg.mlp != "swiglu":
            raise refuse(f"--mlp {cfg.mlp} with --positions rope")
        return "llama"
    raise refuse(f"--positions {cfg.positions}")


def has_bias(cfg: GPTConfig) -> bool:
    return cfg.bias or bool(cfg.qkv_bias)


def hf_config(cfg: GPTConfig, arch: str, eos: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as Hugging Face architecture ``arch``; ``eos``: the id of
    the end-of-text token (also the bos token, as in GPT-2), or None."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "float32"}
    if arch == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **common,
                "n_positions": cfg.max_seq_len, "n_embd": cfg.dim, "n_layer": cfg.n_layers,
                "n_head": cfg.n_heads, "n_inner": cfg.mlp_hidden or 4 * cfg.dim,
                "activation_function": GPT2_ACTIVATION_OF[cfg.mlp], "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common,
            "hidden_size": cfg.dim, "intermediate_size": cfg.mlp_hidden or 4 * cfg.dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.resolved_kv_heads, "head_dim": cfg.resolved_head_dim,
            "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": has_bias(cfg), "mlp_bias": has_bias(cfg),
            "attention_dropout": cfg.dropout}


def with_zero_biases(sd: dict[str, Tensor], cfg: GPTConfig, arch: str) -> dict[str, Tensor]:
    """``sd`` plus a zero bias for every linear/norm module the HF model gives one and qkv did not."""
    if arch == "llama" and not has_bias(cfg):
        return sd
    out = dict(sd)
    for key, w in sd.items():
        module, _, kind = key.rpartition(".")
        if kind != "weight" or module in ("tok_emb", "pos_emb", "lm_head") or f"{module}.bias" in sd:
            continue
        if arch == "llama" and "norm" in module:  # RMSNorm has no bias
            continue
        out[f"{module}.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    return out


def row_split(cfg: GPTConfig) -> list[int]:
    """Rows of qkv's fused qkv projection that are Q, K, V (H·D, K·D, K·D)."""
    d = cfg.resolved_head_dim
    return [cfg.n_heads * d, cfg.resolved_kv_heads * d, cfg.resolved_kv_heads * d]


def unmap_names(sd: dict[str, Tensor], names: Names, split: list[int], tied: bool) -> dict[str, Tensor]:
    """The inverse of :func:`qkv.pretrained.architectures.map_names`: qkv names -> checkpoint
    names; a tuple entry (Q, K, V) is cut back into its parts by rows (``split``). With
    ``tied`` the output head is left out (the checkpoint's ``tie_word_embeddings`` restores it)."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        module, _, kind = key.rpartition(".")
        layer = re.fullmatch(r"stack\.blocks\.(\d+)\.(.+)", module)
        pattern = f"stack.blocks.{{i}}.{layer.group(2)}" if layer else module
        if tied and pattern == "lm_head":
            continue
        if pattern not in names:
            raise ValueError(f"cannot export: no Hugging Face tensor for qkv's {key}")
        src = names[pattern]
        parts = (src,) if isinstance(src, str) else src
        pieces = (t,) if len(parts) == 1 else torch.split(t, split)
        for name, piece in zip(parts, pieces, strict=True):
            out[name.format(i=layer.group(1) if layer else "") + "." + kind] = piece.contiguous()
    return out


def hf_state_dict(model: GPT, arch: str) -> dict[str, Tensor]:
    """The model's weights under ``arch``'s Hugging Face names and layouts (float32)."""
    cfg = model.cfg
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    sd = with_zero_biases(sd, cfg, arch)
    out = unmap_names(sd, TABLES[arch], row_split(cfg), cfg.tie_embeddings)
    if arch == "gpt2":  # Conv1D is its own inverse: (out, in) -> (in, out)
        out = {k: conv1d_transposed(k, v) for k, v in out.items()}
    return out


def hf_tokenizer(tok: Any) -> Any:
    """A ``tokenizers.Tokenizer`` that gives the ids qkv's ``tok`` gives.

    A qkv BPE tokenizer already is one (byte-level BPE trained by ``tokenizers``); a character
    tokenizer becomes a BPE model whose vocabulary is the characters, with no merges.
    """
    from qkv.tokenizers import CharTokenizer, HFTokenizer
    from qkv.tokenizers.hf import hf_tokenizers

    if isinstance(tok, HFTokenizer):
        return hf_tokenizers().Tokenizer.from_str(tok.tokenizer.to_str())
    if isinstance(tok, CharTokenizer):
        tk = hf_tokenizers()
        out = tk.Tokenizer(tk.models.BPE(vocab={c: i for i, c in enumerate(tok.chars)}, merges=[]))
        out.decoder = tk.decoders.Fuse()
        return out
    raise ValueError(f"cannot export a {type(tok).__name__} tokenizer (only char and bpe)")


def new_output_dir(out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(OUT, a fresh temporary folder beside it) for an atomic export; ValueError if OUT exists
    and is not an empty folder (an export never overwrites)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty folder; an export does not "
                         "overwrite: remove it or choose another -o")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # a folder's usual permissions, not mkdtemp's 0700
    return out, tmp


def publish(tmp: Path, out: Path) -> Path:
    """Rename the finished ``tmp`` folder to ``out`` (an empty ``out`` is replaced)."""
    if out.is_dir():
        out.rmdir()  # empty, checked by new_output_dir
    os.replace(tmp, out)
    return out


def generation_config(cfg: GPTConfig, eos: int | None) -> dict[str, Any]:
    """``generation_config.json``: ``qkv generate``'s defaults (temperature 0.8, top-k 200), the
    end-of-text id where there is one, and the context as the longest sequence."""
    return {"bos_token_id": eos, "eos_token_id": eos, "do_sample": True, "temperature": 0.8,
            "top_k": 200, "max_length": cfg.max_seq_len}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_hf_folder(model: GPT, tok: Any, folder: Path) -> str:
    """config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json of ``model`` and ``tok`` into ``folder``; returns the architecture."""
    from safetensors.torch import save_file

    from qkv.tokenizers import END_OF_TEXT, end_of_text_id

    arch = hf_architecture(model.cfg)
    hf_tok = hf_tokenizer(tok)
    eos = end_of_text_id(tok)
    _write_json(folder / "config.json", hf_config(model.cfg, arch, eos))
    _write_json(folder / "generation_config.json", generation_config(model.cfg, eos))
    save_file(hf_state_dict(model, arch), str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_tok.save(str(folder / "tokenizer.json"))
    tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "model_max_length": model.cfg.max_seq_len,
                                  "clean_up_tokenization_spaces": False}
    if eos is not None:
        tok_config |= {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}
    _write_json(folder / "tokenizer_config.json", tok_config)
    return arch
