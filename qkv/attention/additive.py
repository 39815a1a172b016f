"""Additive (Bahdanau) attention: a small MLP scores each key against the query.

    e_j = w_vᵀ tanh(W_q q + W_k k_j),   α = softmax(e),   c = Σ_j α_j v_j

Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by Jointly Learning to Align and
Translate": the decoder state is the query, the encoder states are keys and values.
Lectures: CS189 Lec 21 (RNN + attention, image captioning with soft attention),
CS231N Lec 8 (seq2seq with RNNs and attention).

Shapes: B batch, T queries, S keys, Dq query width, Dk key width, Dv value width,
A hidden ("alignment") width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.attention.functional import AttentionOutput, softmax


class AdditiveAttention(nn.Module):
    """Bahdanau attention.

    Args:
        query_dim: Dq (e.g. decoder hidden size). key_dim: Dk (e.g. encoder output size).
        hidden_dim: A, width of the scoring MLP.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_q = nn.Linear(query_dim, hidden_dim, bias=False)
        self.w_k = nn.Linear(key_dim, hidden_dim, bias=True)
        self.w_v = nn.Linear(hidden_dim, 1, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """(B, S, Dk) -> (B, S, A). Compute once per source sentence, reuse at every step."""
        return self.w_k(keys)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        mask: Tensor | None = None,
        projected_keys: Tensor | None = None,
    ) -> AttentionOutput:
        """Score every key against the query and return the weighted values.

        Args:
            query: (B, Dq) one decoder state, or (B, T, Dq) several.
            keys: (B, S, Dk). values: (B, S, Dv), default ``keys``.
            mask: bool (B, S) or (B, T, S), True = may attend (e.g. not padding).
            projected_keys: ``project_keys(keys)`` computed earlier, to skip that matmul.

        Returns:
            AttentionOutput(context (B, Dv) or (B, T, Dv), weights (B, S) or (B, T, S)).
        """
        single = query.ndim == 2
        if single:
            query = query.unsqueeze(1)  # (B, 1, Dq)
        if query.ndim != 3 or keys.ndim != 3:
            raise ValueError(
                f"query must be (B, Dq) or (B, T, Dq) and keys (B, S, Dk); got "
                f"{tuple(query.shape)} and {tuple(keys.shape)}"
            )
        values = keys if values is None else values
        B, T, Dq = query.shape
        S = keys.shape[1]
        if Dq != self.w_q.in_features or keys.shape[-1] != self.w_k.in_features:
            raise ValueError(
                f"query width {Dq} / key width {keys.shape[-1]} do not match the module's "
                f"query_dim {self.w_q.in_features} / key_dim {self.w_k.in_features}"
            )
        if keys.shape[0] != B or values.ndim != 3 or values.shape[:2] != (B, S):
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be (B={B}, S, ...) "
                "with the same S"
            )
        pk = self.project_keys(keys) if projected_keys is None else projected_keys  # (B, S, A)
        hidden = (self.w_q(query).unsqueeze(2) + pk.unsqueeze(1)).tanh()  # (B, T, S, A)
        scores = self.w_v(hidden).squeeze(-1)  # (B, T, S)
        if mask is not None:
            if mask.dtype != torch.bool:
                raise ValueError(f"mask must be bool (True = may attend), got {mask.dtype}")
            if mask.ndim == 2:
                mask = mask.unsqueeze(1)  # (B, 1, S)
            if mask.ndim != 3 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, T) \
                    or mask.shape[2] != S:
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} ({mask.shape[-1]} key positions) must be "
                    f"(B, S) or (B, T, S) with B={B}, T={T}, S={S}"
                )
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = softmax(scores, dim=-1)  # (B, T, S)
        context = weights @ values  # (B, T, Dv)
        if single:
            return AttentionOutput(context.squeeze(1), weights.squeeze(1))
        return AttentionOutput(context, weights)
