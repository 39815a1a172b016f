"""Building blocks below attention that are not attention math: ``Linear`` (``nn.Linear`` with
a two-core path for one-row products)."""

from qkv.nn.linear import Linear

__all__ = ["Linear"]
