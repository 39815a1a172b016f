"""Text generation: sampling rules and the decoding loop (with or without a KV cache)."""

from qkv.generation.decode import generate, text_pieces
from qkv.generation.sampling import sample_next

__all__ = ["generate", "sample_next", "text_pieces"]
