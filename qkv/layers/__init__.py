"""Transformer building blocks made from qkv.attention: norms, MLPs, blocks, stacks."""

from qkv.layers.block import (
    BlockConfig,
    BlockOutput,
    StackOutput,
    TransformerBlock,
    TransformerStack,
    decoder_stack,
    encoder_stack,
)
from qkv.layers.mlp import MLP, SwiGLU, make_mlp
from qkv.layers.norm import LayerNorm, RMSNorm, make_norm

__all__ = [
    "MLP",
    "BlockConfig",
    "BlockOutput",
    "LayerNorm",
    "RMSNorm",
    "StackOutput",
    "SwiGLU",
    "TransformerBlock",
    "TransformerStack",
    "decoder_stack",
    "encoder_stack",
    "make_mlp",
    "make_norm",
]
