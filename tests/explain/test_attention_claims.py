"""`qkv explain bottleneck | addressing | hard-attention`: the numbers they print, checked
against what the lectures claim and against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_one_line_error, call

from qkv.explain.attention_claims import explain_addressing, explain_bottleneck, explain_hard_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def test_addressing_numbers() -> None:
    r = explain_addressing(cells=6, seed=0)
    perm = r.permutation
    assert sorted(perm) == list(range(6)) and perm != list(range(6))
    for ws in (r.content_before, r.content_after, r.location_before, r.location_after):
        assert math.isclose(sum(ws), 1.0, abs_tol=1e-12) and min(ws) > 0
    # content-based: cell i now holds a_{P(i)} and gets its score; location-based: nothing moves
    assert r.content_after == pytest.approx([r.content_before[j] for j in perm], abs=1e-12)
    assert r.content_after != pytest.approx(r.content_before, abs=1e-6)
    assert r.location_after == r.location_before
    assert r.content_more == 12 and "cannot address 12" in r.location_more


def test_hard_attention_estimators_are_unbiased_and_baselines_shrink_the_spread() -> None:
    r = explain_hard_attention(cells=5, samples=4, trials=20_000, seed=1)
    alpha, f = torch.tensor(r.alpha, dtype=torch.float64), torch.tensor(r.log_p, dtype=torch.float64)
    exact = alpha * (f - (alpha * f).sum())  # ∇_e Σ_i softmax(e)_i f_i, by hand
    torch.testing.assert_close(torch.tensor(r.exact, dtype=torch.float64), exact)
    spreads = {}
    for name, (mean, std) in r.estimates.items():
        torch.testing.assert_close(torch.tensor(mean, dtype=torch.float64), exact, atol=0.01, rtol=0)
        spreads[name.split()[0]] = std
    assert spreads["expected"] < spreads["no"] and spreads["leave-one-out"] < spreads["no"]


@pytest.mark.slow  # ~40 s; benchmarks/seq2seq_copy.py measures the same comparison at full size
def test_bottleneck_shows_the_fixed_context_losing_long_strings() -> None:
    r = explain_bottleneck(min_len=4, max_len=20, steps=300, seed=0)
    longest = list(r.exact["rnn"])[-1]
    assert r.exact["rnn"][longest] >= 0.5 > r.exact["rnn-noattn"][longest]
    assert r.params["rnn"] == r.params["rnn-noattn"]


@pytest.mark.parametrize(("topic", "args", "match"), [
    ("bottleneck", ["--max-len", "99"], "max_len <= 60"),
    ("addressing", ["--cells", "1"], "cells must be in"),
    ("hard-attention", ["--samples", "1"], "samples in [2, 64]"),
])
def test_bad_options_are_one_line(topic: str, args: list[str], match: str) -> None:
    rc, _, err = call(["explain", topic, *args])
    assert match in assert_one_line_error(rc, err)


def test_the_cli_prints_the_tables() -> None:
    rc, out, err = call(["explain", "addressing"])
    assert rc == 0, err
    assert "location: softmax(W h)" in out and "cannot address 12" in out
    rc, out, err = call(["explain", "hard-attention", "--trials", "200"])
    assert rc == 0, err
    assert "exact" in out and "REINFORCE" in out and "leave-one-out" in out
