"""Model families, each a config dataclass plus composition of qkv.layers."""
