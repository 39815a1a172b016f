"""Attention rollout (Abnar & Zuidema 2020) against a float64 loop written from the paper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv.attention.rollout import attention_rollout, readout_attention


def _random_weights(L: int, B: int, H: int, T: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, T, generator=g).softmax(-1) for _ in range(L)]


def _paper_rollout(weights: list[np.ndarray], residual: float) -> np.ndarray:
    """One sequence: weights[l] (H, T, T). Â_l = rownorm((1-r)·mean_h A_l + r·I); R = Â_L ··· Â_1."""
    T = weights[0].shape[-1]
    R = np.eye(T)
    for A in weights:
        a = (1 - residual) * A.mean(axis=0) + residual * np.eye(T)
        a = a / a.sum(axis=1, keepdims=True)
        R = a @ R
    return R


@pytest.mark.parametrize("residual", [0.0, 0.5, 0.9])
def test_rollout_matches_the_paper_in_float64(residual: float) -> None:
    ws = _random_weights(L=4, B=3, H=2, T=5)
    got = attention_rollout(ws, residual=residual)
    for b in range(3):
        want = _paper_rollout([w[b].double().numpy() for w in ws], residual)
        np.testing.assert_allclose(got[b].numpy(), want, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(3, 5))


def test_one_layer_without_residual_is_the_head_mean() -> None:
    [w] = _random_weights(L=1, B=2, H=4, T=6)
    torch.testing.assert_close(attention_rollout([w], residual=0.0), w.mean(1))


def test_layer_order_matters() -> None:
    """R = Â2·Â1, not Â1·Â2: the second layer mixes what the first produced."""
    a, b = _random_weights(L=2, B=1, H=1, T=4, seed=3)
    ab, ba = attention_rollout([a, b], 0.0), attention_rollout([b, a], 0.0)
    torch.testing.assert_close(ab[0], b[0, 0] @ a[0, 0])
    assert not torch.allclose(ab, ba)


def test_readout_attention() -> None:
    rows = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.2, 0.2, 0.6]])
    torch.testing.assert_close(readout_attention(rows, "cls"), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(readout_attention(rows, "mean"), rows.mean(0))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([])
    with pytest.raises(ValueError, match="residual"):
        attention_rollout(_random_weights(1, 1, 1, 2), residual=1.0)
