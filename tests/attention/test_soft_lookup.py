"""The lectures' soft dictionary: D = {"A": 51, "B": 42, "C": 31} with one-hot keys.

CS189 Lec 22: query [0,1,0] hits 42; query [1,1,0] returns the even mix of 51 and 42.
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention import SoftLookup, hardmax, softmax

KEYS = torch.eye(3)  # k1 = [1,0,0], k2 = [0,1,0], k3 = [0,0,1]
VALUES = torch.tensor([51.0, 42.0, 31.0])


def test_lecture_softmax_numbers() -> None:
    p = softmax(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(p, torch.tensor([0.09, 0.24, 0.67]), rtol=0, atol=5e-3)
    z = math.e + math.e**2 + math.e**3
    exact = torch.tensor([math.e / z, math.e**2 / z, math.e**3 / z])
    torch.testing.assert_close(p, exact, rtol=0, atol=1e-7)
    assert torch.equal(hardmax(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([0.0, 0.0, 1.0]))


def test_sharp_query_hits_42() -> None:
    value, weights = SoftLookup(KEYS, VALUES, sharpness=50.0)(torch.tensor([0.0, 1.0, 0.0]))
    assert value.shape == () and weights.shape == (3,)
    assert value.item() == pytest.approx(42.0, abs=1e-6)
    assert weights[1].item() == pytest.approx(1.0, abs=1e-6)


def test_sharpness_one_gives_hand_computed_mix() -> None:
    value, weights = SoftLookup(KEYS, VALUES, sharpness=1.0)(torch.tensor([0.0, 1.0, 0.0]))
    e = math.e
    # scores [0, 1, 0] -> weights [1, e, 1] / (2 + e)
    expected_w = [1 / (2 + e), e / (2 + e), 1 / (2 + e)]
    torch.testing.assert_close(weights, torch.tensor(expected_w), rtol=0, atol=1e-7)
    expected_v = (51 + 42 * e + 31) / (2 + e)  # ≈ 41.58: pulled towards 42, not equal to it
    assert value.item() == pytest.approx(expected_v, abs=1e-5)
    assert abs(value.item() - 42.0) > 0.1


def test_sharpness_is_an_inverse_temperature() -> None:
    q = torch.tensor([0.0, 1.0, 0.0])
    errors = [abs(SoftLookup(KEYS, VALUES, sharpness=s)(q).out.item() - 42.0) for s in (1, 3, 10)]
    assert errors[0] > errors[1] > errors[2]
    s = 3.0
    w = SoftLookup(KEYS, VALUES, sharpness=s)(q).weights
    e = math.exp(s)
    torch.testing.assert_close(w, torch.tensor([1 / (2 + e), e / (2 + e), 1 / (2 + e)]),
                               rtol=0, atol=1e-7)


def test_two_hot_query_gives_even_mix() -> None:
    value, weights = SoftLookup(KEYS, VALUES, sharpness=50.0)(torch.tensor([1.0, 1.0, 0.0]))
    assert value.item() == pytest.approx(46.5, abs=1e-5)  # (51 + 42) / 2
    torch.testing.assert_close(weights, torch.tensor([0.5, 0.5, 0.0]), rtol=0, atol=1e-6)


def test_hard_lookup_is_exact() -> None:
    lookup = SoftLookup(KEYS, VALUES, hard=True)
    value, weights = lookup(torch.tensor([0.0, 1.0, 0.0]))
    assert value.item() == 42.0
    assert torch.equal(weights, torch.tensor([0.0, 1.0, 0.0]))
    # A tie shares the weight evenly, so [1,1,0] is exactly the mean of 51 and 42.
    assert lookup(torch.tensor([1.0, 1.0, 0.0])).out.item() == 46.5


def test_batched_queries() -> None:
    lookup = SoftLookup(KEYS, VALUES, sharpness=50.0)
    queries = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    value, weights = lookup(queries)
    assert value.shape == (4,) and weights.shape == (4, 3)
    torch.testing.assert_close(value, torch.tensor([51.0, 42.0, 31.0, 46.5]), rtol=0, atol=1e-5)
    for i in range(4):
        torch.testing.assert_close(lookup(queries[i]).out, value[i], rtol=0, atol=0)


def test_vector_values() -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(5, 4), torch.randn(5, 3)
    query = torch.randn(2, 4)
    s = 0.7
    value, weights = SoftLookup(keys, values, sharpness=s)(query)
    assert value.shape == (2, 3) and weights.shape == (2, 5)
    scores = s * query.double() @ keys.double().T
    ref_w = scores.exp() / scores.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), ref_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(value.double(), ref_w @ values.double(), rtol=0, atol=1e-6)


def test_gradient_flows_to_query() -> None:
    q = torch.tensor([0.0, 1.0, 0.0], requires_grad=True)
    SoftLookup(KEYS, VALUES)(q).out.backward()
    # d/dq_i of Σ softmax(q)_j v_j = p_i (v_i - mean_p(v)); hand-checked with the e/(2+e) weights
    e = math.e
    p = torch.tensor([1 / (2 + e), e / (2 + e), 1 / (2 + e)])
    expected = p * (VALUES - (p * VALUES).sum())
    torch.testing.assert_close(q.grad, expected, rtol=0, atol=1e-5)  # fp32, values ~50


def test_mismatched_widths_raise() -> None:
    lookup = SoftLookup(KEYS, VALUES)
    with pytest.raises(ValueError, match="width"):
        lookup(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="keys must be"):
        SoftLookup(torch.ones(3), VALUES)  # 1-D keys
    with pytest.raises(ValueError, match="keys must be"):
        SoftLookup(KEYS, torch.tensor([1.0, 2.0]))  # 2 values for 3 keys
