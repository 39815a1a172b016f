"""Building blocks below attention that are not attention math: ``Linear`` (``nn.Linear`` with
a two-core path for one-row products) and a long row's top-k and argmax in two passes
(:mod:`qkv.nn.top`)."""

from qkv.nn.linear import Linear
from qkv.nn.top import argmax_last, top_indices

__all__ = ["Linear", "argmax_last", "top_indices"]
