"""The soft dictionary: attention as a differentiable lookup table.

A Python dict {"A": 51, "B": 42, "C": 31} needs an exact key. Make the keys vectors
(k1 = [1,0,0], k2 = [0,1,0], k3 = [0,0,1]), score a query against every key by an inner
product, and return the softmax-weighted mix of the values:

    lookup(q) = Σ_i softmax(s·qᵀk)_i · v_i

Query [0,1,0] at high sharpness s returns 42; query [1,1,0] returns the even mix of 51 and
42. Lecture: CS189 Lec 22, "attention = a soft lookup table". With ``hard=True`` the
softmax becomes a hardmax: the exact (non-differentiable) dictionary.

Shapes: N entries, d key width, Dv value width (values may also be scalars, shape (N,)).
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.attention.functional import AttentionOutput, hardmax, softmax


class SoftLookup(nn.Module):
    """A dictionary whose lookups are weighted averages.

    Args:
        keys: (N, d). values: (N,) or (N, Dv).
        sharpness: multiplies the scores before the softmax (an inverse temperature).
        hard: use hardmax instead (the exact-match dictionary).
    """

    def __init__(
        self, keys: Tensor, values: Tensor, sharpness: float = 1.0, hard: bool = False
    ) -> None:
        super().__init__()
        if keys.ndim != 2 or values.shape[0] != keys.shape[0]:
            raise ValueError(
                f"keys must be (N, d) and values (N,) or (N, Dv); got {tuple(keys.shape)} "
                f"and {tuple(values.shape)}"
            )
        self.register_buffer("keys", keys)
        self.register_buffer("values", values)
        self.sharpness, self.hard = sharpness, hard

    def forward(self, query: Tensor) -> AttentionOutput:
        """query (d,) or (B, d) -> AttentionOutput(value (…, [Dv]), weights (…, N))."""
        if query.shape[-1] != self.keys.shape[1]:
            raise ValueError(
                f"query width {query.shape[-1]} does not match key width {self.keys.shape[1]}"
            )
        scores = self.sharpness * (query.to(self.keys.dtype) @ self.keys.T)  # (…, N)
        weights = hardmax(scores) if self.hard else softmax(scores)
        values = self.values.to(weights.dtype)
        return AttentionOutput(weights @ values, weights)
