"""Hugging Face architectures -> qkv models: one config reader and one name table each.

A table maps qkv's module names (``{i}`` = layer index) to the checkpoint's; a tuple is
several checkpoint tensors stacked along the output rows (Q, K, V -> qkv's fused ``qkv``).
``.weight`` / ``.bias`` are appended from qkv's own parameter name, so a table lists modules,
and the biases a config turns on (Qwen2's on q/k/v) need no extra rows.

    architecture   qkv model   what the config turns into
    llama          GPT         RMSNorm, SwiGLU, RoPE, GQA, no biases (SmolLM2, TinyLlama)
    mistral        GPT         llama + a sliding window (the context is capped at the window)
    qwen2          GPT         llama + biases on the q/k/v projections
    gemma          GPT         llama + GeGLU (tanh), embeddings × √dim, RMSNorm weights stored as w − 1
    gpt2           GPT         LayerNorm, GELU (tanh), learned positions, biases, fused c_attn
    bert           Encoder     post-LN, GELU, learned positions + token types (MiniLM)

llama.cpp's names for the same tensors, for GGUF files (``LLAMA_GGUF``, ``GEMMA_GGUF``,
``GPT2_GGUF``, ``BERT_GGUF``), are read by :mod:`~qkv.pretrained.gguf_models`.

Refused, with the reason in the message (:data:`REFUSED`): gemma2 and gemma3, whose blocks
add what qkv's do not have (soft-capped logits and attention scores, a norm after each
sublayer as well as before, local sliding-window layers; gemma3 also q/k norms).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from qkv.models.encoder import EncoderConfig
from qkv.models.gpt import GPTConfig
from qkv.pretrained.gguf_file import PretrainedFormatError
from qkv.pretrained.minilm import encoder_config_from_bert

Names = dict[str, str | tuple[str, ...]]

LLAMA: Names = {  # also Mistral, Qwen2 (its q/k/v biases come through the same rows) and Gemma
    "tok_emb": "model.embed_tokens",
    "stack.blocks.{i}.norm1": "model.layers.{i}.input_layernorm",
    "stack.blocks.{i}.attn.qkv": ("model.layers.{i}.self_attn.q_proj", "model.layers.{i}.self_attn.k_proj",
                                  "model.layers.{i}.self_attn.v_proj"),
    "stack.blocks.{i}.attn.out_proj": "model.layers.{i}.self_attn.o_proj",
    "stack.blocks.{i}.norm2": "model.layers.{i}.post_attention_layernorm",
    "stack.blocks.{i}.mlp.w_gate": "model.layers.{i}.mlp.gate_proj",
    "stack.blocks.{i}.mlp.w_up": "model.layers.{i}.mlp.up_proj",
    "stack.blocks.{i}.mlp.w_down": "model.layers.{i}.mlp.down_proj",
    "stack.norm": "model.norm",
    "lm_head": "lm_head",
}

# llama.cpp's names for the same tensors (the GGUF that qkv.load("smollm2") reads); its W_Q
# and W_K rows are also permuted per head (undone in gguf_models.py).
LLAMA_GGUF: Names = {
    "tok_emb": "token_embd",
    "stack.blocks.{i}.norm1": "blk.{i}.attn_norm",
    "stack.blocks.{i}.attn.qkv": ("blk.{i}.attn_q", "blk.{i}.attn_k", "blk.{i}.attn_v"),
    "stack.blocks.{i}.attn.out_proj": "blk.{i}.attn_output",
    "stack.blocks.{i}.norm2": "blk.{i}.ffn_norm",
    "stack.blocks.{i}.mlp.w_gate": "blk.{i}.ffn_gate",
    "stack.blocks.{i}.mlp.w_up": "blk.{i}.ffn_up",
    "stack.blocks.{i}.mlp.w_down": "blk.{i}.ffn_down",
    "stack.norm": "output_norm",
    "lm_head": "output",
}

# llama.cpp's gemma files use the llama names, unpermuted, with the norm weights stored as 1 + w
# (its converter adds the 1 that gemma_norm_weight adds to a Hugging Face folder's).
GEMMA_GGUF: Names = LLAMA_GGUF

GPT2: Names = {  # every 2-D weight under transformer.h is a Conv1D: stored (in, out)
    "tok_emb": "transformer.wte",
    "pos_emb": "transformer.wpe",
    "stack.blocks.{i}.norm1": "transformer.h.{i}.ln_1",
    "stack.blocks.{i}.attn.qkv": "transformer.h.{i}.attn.c_attn",
    "stack.blocks.{i}.attn.out_proj": "transformer.h.{i}.attn.c_proj",
    "stack.blocks.{i}.norm2": "transformer.h.{i}.ln_2",
    "stack.blocks.{i}.mlp.fc_in": "transformer.h.{i}.mlp.c_fc",
    "stack.blocks.{i}.mlp.fc_out": "transformer.h.{i}.mlp.c_proj",
    "stack.norm": "transformer.ln_f",
    "lm_head": "lm_head",
}

# llama.cpp's gpt2 names; its converter stores the Conv1D weights transposed, as (out, in) rows.
GPT2_GGUF: Names = {
    "tok_emb": "token_embd",
    "pos_emb": "position_embd",
    "stack.blocks.{i}.norm1": "blk.{i}.attn_norm",
    "stack.blocks.{i}.attn.qkv": "blk.{i}.attn_qkv",
    "stack.blocks.{i}.attn.out_proj": "blk.{i}.attn_output",
    "stack.blocks.{i}.norm2": "blk.{i}.ffn_norm",
    "stack.blocks.{i}.mlp.fc_in": "blk.{i}.ffn_up",
    "stack.blocks.{i}.mlp.fc_out": "blk.{i}.ffn_down",
    "stack.norm": "output_norm",
    "lm_head": "output",
}

# llama.cpp's bert names (embedding models such as all-MiniLM-L6-v2 in GGUF), onto qkv's
# Encoder; its converter keeps BERT's (out, in) rows and drops the pooler and the MLM head.
BERT_GGUF: Names = {
    "tok_emb": "token_embd",
    "pos_emb": "position_embd",
    "type_emb": "token_types",
    "emb_norm": "token_embd_norm",
    "stack.blocks.{i}.attn.qkv": ("blk.{i}.attn_q", "blk.{i}.attn_k", "blk.{i}.attn_v"),
    "stack.blocks.{i}.attn.out_proj": "blk.{i}.attn_output",
    "stack.blocks.{i}.norm1": "blk.{i}.attn_output_norm",
    "stack.blocks.{i}.mlp.fc_in": "blk.{i}.ffn_up",
    "stack.blocks.{i}.mlp.fc_out": "blk.{i}.ffn_down",
    "stack.blocks.{i}.norm2": "blk.{i}.layer_output_norm",
}

# Checkpoint tensors that hold nothing to load: precomputed RoPE frequencies and causal masks
# stored by older transformers versions.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")

REFUSED = {
    "gemma2": "its blocks soft-cap logits and attention scores, norm after each sublayer too and "
              "alternate sliding-window layers, which qkv's blocks do not",
    "gemma3": "its blocks add q/k norms, norms after each sublayer and sliding-window layers, "
              "which qkv's blocks do not",
}


def _need(c: dict[str, Any], key: str) -> Any:
    if key not in c:
        raise PretrainedFormatError(f"config.json lacks {key!r}")
    return c[key]


def _refuse_unless(ok: bool, arch: str, what: str) -> None:
    if not ok:
        raise PretrainedFormatError(f"{arch}: {what} is not supported")


def _rope_theta(c: dict[str, Any], arch: str) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    _refuse_unless(kind == "default", arch, f"rope_type {kind!r} (scaled RoPE; only 'default')")
    _refuse_unless(float(c.get("partial_rotary_factor", 1.0)) == 1.0, arch, "partial RoPE")
    return float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))


GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # both the tanh form of GELU


def llama_config(c: dict[str, Any], arch: str = "llama") -> GPTConfig:
    """GPTConfig of a llama / mistral / qwen2 / gemma ``config.json``."""
    gemma = arch == "gemma"
    act = (c.get("hidden_activation") or c.get("hidden_act")) if gemma else c.get("hidden_act", "silu")
    _refuse_unless(act in (GEMMA_ACTIVATIONS if gemma else ("silu",)), arch, f"hidden_act {act!r}")
    attn_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    _refuse_unless(attn_bias == mlp_bias, arch, "attention_bias without mlp_bias (or the reverse)")
    n_heads = int(_need(c, "num_attention_heads"))
    dim = int(_need(c, "hidden_size"))
    max_seq_len = int(_need(c, "max_position_embeddings"))
    qkv_bias = None
    if arch == "qwen2":
        types = set(c.get("layer_types") or ["full_attention"])
        _refuse_unless(not c.get("use_sliding_window") and types == {"full_attention"}, arch,
                       "sliding-window attention (use_sliding_window)")
        qkv_bias = True
    if arch == "mistral" and c.get("sliding_window"):
        # Within the window, sliding-window attention is full causal attention: cap the context.
        max_seq_len = min(max_seq_len, int(c["sliding_window"]))
    return GPTConfig(
        vocab_size=int(_need(c, "vocab_size")), max_seq_len=max_seq_len, dim=dim,
        n_layers=int(_need(c, "num_hidden_layers")), n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or dim // n_heads),
        mlp_hidden=int(_need(c, "intermediate_size")), mlp="geglu_tanh" if gemma else "swiglu",
        norm="rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-6)), positions="rope",
        rope_theta=_rope_theta(c, arch), tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
        embed_scale=gemma, bias=attn_bias, qkv_bias=qkv_bias,
    )


GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(c: dict[str, Any], arch: str = "gpt2") -> GPTConfig:
    """GPTConfig of a GPT-2 ``config.json`` (pre-LN, learned positions, biases everywhere)."""
    act = c.get("activation_function", "gelu_new")
    _refuse_unless(act in GPT2_ACTIVATIONS, arch, f"activation_function {act!r}")
    _refuse_unless(c.get("scale_attn_weights", True), arch, "scale_attn_weights=false")
    _refuse_unless(not c.get("scale_attn_by_inverse_layer_idx"), arch, "scale_attn_by_inverse_layer_idx")
    _refuse_unless(not c.get("add_cross_attention"), arch, "add_cross_attention")
    dim = int(_need(c, "n_embd"))
    return GPTConfig(
        vocab_size=int(_need(c, "vocab_size")), max_seq_len=int(_need(c, "n_positions")), dim=dim,
        n_layers=int(_need(c, "n_layer")), n_heads=int(_need(c, "n_head")),
        mlp_hidden=int(c.get("n_inner") or 4 * dim), mlp=GPT2_ACTIVATIONS[act],  # type: ignore[arg-type]
        norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), positions="learned",
        tie_embeddings=bool(c.get("tie_word_embeddings", True)), bias=True,
    )


def bert_config(c: dict[str, Any], pooling: str = "mean") -> EncoderConfig:
    """EncoderConfig of a BERT ``config.json`` (minilm.py's reader)."""
    _refuse_unless(not c.get("is_decoder") and not c.get("add_cross_attention"), "bert",
                   "a BERT decoder (is_decoder / add_cross_attention)")
    try:
        return encoder_config_from_bert(c, pooling)
    except PretrainedFormatError as e:
        raise PretrainedFormatError(f"bert: {e}") from None


def conv1d_transposed(name: str, t: Tensor) -> Tensor:
    """GPT-2's Conv1D stores W as (in, out); qkv's Linear, like nn.Linear, as (out, in)."""
    return t.t().contiguous() if t.ndim == 2 and ".h." in name else t


def gemma_norm_weight(name: str, t: Tensor) -> Tensor:
    """Gemma's RMSNorm multiplies by (1 + w) and stores w: qkv's multiplies by its weight."""
    return t + 1.0 if name.endswith("norm.weight") else t


Fix = Callable[[str, Tensor], Tensor]

# model_type -> (config reader, name table, layout fix of a checkpoint tensor or None)
DECODERS: dict[str, tuple[Callable[[dict[str, Any], str], GPTConfig], Names, Fix | None]] = {
    "llama": (llama_config, LLAMA, None),
    "mistral": (llama_config, LLAMA, None),
    "qwen2": (llama_config, LLAMA, None),
    "gemma": (llama_config, LLAMA, gemma_norm_weight),
    "gpt2": (gpt2_config, GPT2, conv1d_transposed),
}
ENCODERS = ("bert",)
SUPPORTED = (*DECODERS, *ENCODERS)


def map_names(
    expected: list[str], names: Names, get: Callable[[str], Tensor], tied: bool
) -> dict[str, Tensor]:
    """qkv's state dict, parameter by parameter, from ``get(checkpoint name)`` via ``names``.

    ``expected`` are the qkv model's parameter names (e.g. ``stack.blocks.3.attn.qkv.bias``);
    with ``tied`` the output head reads the token embedding.
    """
    out: dict[str, Tensor] = {}
    for key in expected:
        module, _, kind = key.rpartition(".")  # kind: weight | bias
        layer = re.fullmatch(r"stack\.blocks\.(\d+)\.(.+)", module)
        pattern = f"stack.blocks.{{i}}.{layer.group(2)}" if layer else module
        if tied and pattern == "lm_head":
            pattern = "tok_emb"
        if pattern not in names:
            raise PretrainedFormatError(f"no checkpoint tensor maps to qkv's {key}")
        src = names[pattern]
        parts = [get(n.format(i=layer.group(1) if layer else "") + "." + kind)
                 for n in ((src,) if isinstance(src, str) else src)]
        out[key] = parts[0] if len(parts) == 1 else torch.cat(parts)  # stacked output rows
    return out
