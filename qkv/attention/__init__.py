"""All of qkv's attention math. Models get attention only from here (DESIGN.md)."""

from qkv.attention.additive import AdditiveAttention
from qkv.attention.functional import (
    BACKENDS,
    AttentionOutput,
    Backend,
    attention,
    causal_mask,
    chunked_attention,
    hardmax,
    padding_mask,
    repeat_kv,
    scaled_dot_product_attention,
    sdpa_attention,
    sliding_window_mask,
    softmax,
)
from qkv.attention.kv_cache import BatchKVCache, KVCache, LayerKVCache
from qkv.attention.multihead import MultiHeadAttention
from qkv.attention.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    alibi_slopes,
    rotate_half,
    sinusoidal_2d_table,
    sinusoidal_table,
)
from qkv.attention.soft_lookup import SoftLookup

__all__ = [
    "BACKENDS",
    "ALiBi",
    "AdditiveAttention",
    "AttentionOutput",
    "Backend",
    "BatchKVCache",
    "KVCache",
    "LayerKVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "SoftLookup",
    "alibi_slopes",
    "attention",
    "causal_mask",
    "chunked_attention",
    "hardmax",
    "padding_mask",
    "repeat_kv",
    "rotate_half",
    "scaled_dot_product_attention",
    "sdpa_attention",
    "sinusoidal_2d_table",
    "sinusoidal_table",
    "sliding_window_mask",
    "softmax",
]
