"""Sampling rules: greedy, top-k, top-p (nucleus) and temperature, checked against hand-computed
sets and against softmax(logits / T) frequencies; every draw through both of sample_next's paths
(PyTorch's ops, and qkv's kernel library's ``sample_rows`` where a process has loaded it)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import sampling_intervals, softmax64

import qkv.generation.sampling as S
import qkv.kernels as K
from qkv.generation import sample_next
from qkv.generation.sampling import filter_logits

NEG_INF = float("-inf")


@pytest.fixture(autouse=True, params=["pytorch", "kernel"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once through PyTorch's ops and once through the kernel library's op (whichever
    this process happened to load before would otherwise decide)."""
    if request.param == "kernel":
        assert K.int4_op() is not None, K.int4_status()
        monkeypatch.setattr(S, "sample_op", lambda: torch.ops.qkv.sample_rows)
    else:
        monkeypatch.setattr(S, "sample_op", lambda: None)
    return request.param


def kept(filtered: torch.Tensor) -> list[set[int]]:
    """The token ids that survive filtering, per row."""
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in filtered]


def frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def assert_frequencies(tokens: torch.Tensor, expected: list[float]) -> None:
    """Each token's frequency within 5 standard errors of its probability."""
    n = tokens.numel()
    freq = frequencies(tokens, len(expected))
    for i, p in enumerate(expected):
        se = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(freq[i].item() - p) <= 5 * se + 1e-12, (i, freq[i].item(), p)


# --------------------------------------------------------------------------- greedy


def test_temperature_zero_is_argmax(rng: torch.Generator) -> None:
    logits = torch.randn(64, 37, generator=rng)
    expected = [max(range(37), key=lambda j, r=row: r[j]) for row in logits.tolist()]
    assert sample_next(logits, temperature=0.0).tolist() == expected
    # Filters cannot change the greedy choice, and no randomness is drawn.
    state = rng.get_state()
    assert sample_next(logits, 0.0, top_k=3, top_p=0.5, generator=rng).tolist() == expected
    assert torch.equal(rng.get_state(), state)


def test_low_temperature_approaches_argmax(rng: torch.Generator) -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.9]]).expand(2000, 4)
    out = sample_next(logits, temperature=0.01, generator=rng)
    assert (out == 2).all()  # exp(-0.1 / 0.01) ≈ 4.5e-5 odds for the runner-up


# --------------------------------------------------------------------------- top-k


def test_top_k_keeps_exactly_the_k_largest(rng: torch.Generator) -> None:
    logits = torch.randn(16, 30, generator=rng)  # distinct values almost surely
    for k in (1, 2, 5, 29):
        filtered = filter_logits(logits, top_k=k)
        for row, keep in zip(logits.tolist(), kept(filtered), strict=True):
            largest = set(sorted(range(30), key=lambda j, r=row: -r[j])[:k])
            assert keep == largest
        # Kept logits are unchanged (filtering is not renormalisation).
        mask = torch.isfinite(filtered)
        assert torch.equal(filtered[mask], logits[mask])
        assert (filtered[~mask] == NEG_INF).all()


def test_top_k_off_values_keep_everything(rng: torch.Generator) -> None:
    logits = torch.randn(3, 10, generator=rng)
    for k in (None, 0, 10, 50):
        assert torch.equal(filter_logits(logits, top_k=k), logits)


def test_top_k_samples_never_leave_the_set(rng: torch.Generator) -> None:
    V, k, n = 20, 4, 20000
    logits = torch.randn(1, V, generator=rng).expand(n, V)
    out = sample_next(logits, temperature=1.5, top_k=k, generator=rng)
    top = set(torch.topk(logits[0], k).indices.tolist())
    assert set(out.tolist()) == top  # never outside, and every kept token does occur
    # Renormalised over the kept tokens: softmax over those k only.
    row = logits[0].tolist()
    probs = softmax64([row[i] for i in sorted(top)], temperature=1.5)
    expected = [0.0] * V
    for i, p in zip(sorted(top), probs, strict=True):
        expected[i] = p
    assert_frequencies(out, expected)


# --------------------------------------------------------------------------- top-p


def test_top_p_hand_computed() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled order: ids 2, 0, 3, 1
    probs = torch.tensor([0.3, 0.05, 0.5, 0.15])
    logits = probs.log().unsqueeze(0)
    cases = {
        0.10: {2},  # the first token alone is kept even though 0.5 > 0.1 overshoots
        0.49: {2},
        0.51: {2, 0},  # 0.5 < 0.51: the next one is needed; 0.8 reaches it
        0.79: {2, 0},
        0.81: {2, 0, 3},  # 0.8 < 0.81
        0.94: {2, 0, 3},
        0.96: {2, 0, 3, 1},
        1.00: {2, 0, 3, 1},  # p = 1 is no filtering
    }
    for p, expected in cases.items():
        filtered = filter_logits(logits, top_p=p)
        assert kept(filtered) == [expected], p
        mask = torch.isfinite(filtered)
        assert torch.equal(filtered[mask], logits[mask])


def test_top_p_first_token_always_kept_when_dominant() -> None:
    logits = torch.tensor([[10.0, 0.0, -1.0], [0.0, 0.0, 20.0]])  # top token ≈ all the mass
    assert kept(filter_logits(logits, top_p=0.01)) == [{0}, {2}]


def test_top_p_rows_are_independent() -> None:
    a = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    b = torch.tensor([0.25, 0.25, 0.25, 0.25]).log()
    # Uniform: three tokens reach 0.75 >= 0.7 (which three of the ties is immaterial).
    keep = kept(filter_logits(torch.stack([a, b]), top_p=0.7))
    assert keep[0] == {0, 1} and len(keep[1]) == 3


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 3 renormalises to 0.444, 0.333, 0.222; top-p 0.7 then needs two tokens (0.777).
    assert kept(filter_logits(probs.log(), top_k=3, top_p=0.7)) == [{0, 1}]
    # p = 0.75 shows the order matters: 0.4 + 0.3 = 0.7 < 0.75 needs a third token on its own,
    # but after top-k renormalises, 0.444 + 0.333 = 0.778 reaches it with two.
    assert kept(filter_logits(probs.log(), top_p=0.75)) == [{0, 1, 2}]
    assert kept(filter_logits(probs.log(), top_k=3, top_p=0.75)) == [{0, 1}]


def test_top_p_samples_match_the_renormalised_nucleus(rng: torch.Generator) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 20000
    logits = torch.tensor(probs).log().expand(n, 4)
    out = sample_next(logits, temperature=1.0, top_p=0.7, generator=rng)
    assert_frequencies(out, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


# --------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    row = [1.0, 0.0, -0.5, 2.0, 0.3]
    n = 40000
    logits = torch.tensor(row).expand(n, 5)
    gen = torch.Generator().manual_seed(1234)
    out = sample_next(logits, temperature=temperature, generator=gen)
    assert out.shape == (n,) and out.dtype == torch.long
    assert_frequencies(out, softmax64(row, temperature))


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    a = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(7))
    b = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16).expand(20000, 3)
    out = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(0))
    assert_frequencies(out, softmax64([0.0, 1.0, 2.0]))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_arguments_raise(kw: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        sample_next(torch.zeros(1, 4), **kw)


# --------------------------------------------------------------------------- the draw


def test_draw_takes_the_distribution_and_never_a_zero(rng: torch.Generator) -> None:
    """draw (the inverse of the cumulative sum) against the probabilities, zeros at both ends and
    between; a u next to 1 still lands on the last id with weight; a row that is no distribution
    goes to torch.multinomial's error."""
    from qkv.generation.sampling import draw

    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    out = draw(probs.expand(40000, 6), rng)
    assert out.dtype == torch.long and out.shape == (40000,)
    assert_frequencies(out, probs.tolist())
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0]])  # unnormalised: the total is the scale
    assert_frequencies(draw(weights.expand(20000, 5), rng), [0.0, 0.25, 0.0, 0.75, 0.0])


def test_draw_at_the_edge_of_the_unit_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from qkv.generation.sampling import draw

    for u, want in ((1.0 - 2.0**-53, 3), (0.0, 1)):
        monkeypatch.setattr(torch, "rand", lambda shape, u=u, **kw: torch.full(shape, u, dtype=torch.float64))
        assert draw(torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0, 0.0]])).tolist() == [want]
    monkeypatch.undo()
    with pytest.raises(RuntimeError):
        draw(torch.tensor([[0.5, float("nan")]]))
    with pytest.raises(RuntimeError):
        draw(torch.zeros(1, 3))


# --------------------------------------------------------------------------- the two paths


@pytest.mark.parametrize(("top_k", "top_p"), [(200, None), (200, 0.9), (None, None), (None, 0.8)])
def test_both_paths_draw_the_same_token_from_the_same_seed(
        path: str, monkeypatch: pytest.MonkeyPatch, top_k: int | None, top_p: float | None) -> None:
    """The kernel's op and PyTorch's ops take one float64 u a row from the generator and draw the
    id whose interval (from the float64 reference) holds it: the same ids from the same seed,
    except for a u within 1e-6 of an interval's end (float32 weights either way), and the op is
    what ran on the kernel's path."""
    g = torch.Generator().manual_seed(21)
    V = 49152 if top_k else 2000
    row = torch.randn(V, generator=g) * 2
    n = 400
    calls = []
    if path == "kernel":
        counted = lambda *a: calls.append(a) or torch.ops.qkv.sample_rows(*a)  # noqa: E731
        monkeypatch.setattr(S, "sample_op", lambda: counted)
    got = sample_next(row.expand(n, V), 0.8, top_k, top_p, torch.Generator().manual_seed(5))
    assert len(calls) == (1 if path == "kernel" else 0)
    u = torch.rand(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ids, ends = sampling_intervals(row, 0.8, top_k, top_p)
    at = torch.searchsorted(torch.tensor(ends, dtype=torch.float64), u, right=True).tolist()
    starts = [0.0, *ends[:-1]]
    near = [min(abs(ui - starts[j]), abs(ui - ends[j])) < 1e-6 for ui, j in zip(u.tolist(), at, strict=True)]
    assert sum(near) < n / 20  # ~0.4% expected with 2,000 ends: the rest are checked exactly
    for g_id, j, close in zip(got.tolist(), at, near, strict=True):
        assert g_id == ids[j] or close


def test_a_temperature_past_float32s_range_divides_by_inf_on_both_paths() -> None:
    """logits / 1e39 in float32 is logits / inf: every z 0, a uniform draw; the kernel declines
    such a T and PyTorch's path draws with the u it took: the same ids from the same seed."""
    n = 2000
    got = sample_next(torch.randn(1, 5).expand(n, 5), 1e39, generator=torch.Generator().manual_seed(4))
    u = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert torch.equal(got, (u * 5).floor().long())


def test_a_kernel_error_that_is_not_about_the_row_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args):
        raise RuntimeError("qkv::sample_rows: something else")

    monkeypatch.setattr(S, "sample_op", lambda: broken)
    with pytest.raises(RuntimeError, match="something else"):
        sample_next(torch.zeros(1, 4), 1.0, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_that_is_no_distribution_raises_pytorchs_error_on_both_paths(bad: float) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, bad, 1.0]])
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0))
