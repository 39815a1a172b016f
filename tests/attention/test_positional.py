"""Positional information: sinusoids (1-D, 2-D), learned tables, RoPE, ALiBi.

Every check compares against an independent computation written here in float64
(the Vaswani formula, complex-number rotations, the ALiBi paper's slope recipe), or, for ALiBi
through the backends, tests/conftest.py's float64 attention reference.
"""

from __future__ import annotations

import cmath
import math

import pytest
import torch

from qkv.attention import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    alibi_slopes,
    attention,
    rotate_half,
    sinusoidal_2d_table,
    sinusoidal_table,
)

# --------------------------------------------------------------------------- references


def vaswani_pe(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)), by loops."""
    pe = torch.zeros(n_positions, dim, dtype=torch.float64)
    for p in range(n_positions):
        for i in range(dim // 2):
            angle = p / base ** (2 * i / dim)
            pe[p, 2 * i] = math.sin(angle)
            pe[p, 2 * i + 1] = math.cos(angle)
    return pe


def rope_complex(x: torch.Tensor, positions: list[int], theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE with complex numbers: z_i = x_i + i·x_{i+D/2}, times e^{i·p·θ^(-2i/D)}.

    x: (T, D), row t sits at absolute position positions[t]. Returns float64 (T, D).
    """
    T, D = x.shape
    half = D // 2
    out = torch.zeros(T, D, dtype=torch.float64)
    for t, p in enumerate(positions):
        for i in range(half):
            z = complex(float(x[t, i]), float(x[t, i + half]))
            z *= cmath.exp(1j * p * theta ** (-2 * i / D))
            out[t, i], out[t, i + half] = z.real, z.imag
    return out


def paper_alibi_slopes(n: int) -> list[float]:
    """The recipe from Press et al.'s reference code (attention_with_linear_biases)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_alibi_slopes(2 * closest)[0::2][: n - closest]


def rope_at(rope: RotaryEmbedding, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate one vector (D,) as if it sat at absolute position ``pos``."""
    return rope(v.view(1, 1, 1, -1), offset=pos).view(-1)


# --------------------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize(("n", "dim"), [(7, 4), (50, 16), (3, 2)])
def test_sinusoidal_table_equals_vaswani_formula(n: int, dim: int) -> None:
    table = sinusoidal_table(n, dim)
    assert table.shape == (n, dim)
    assert table.dtype == torch.float32
    torch.testing.assert_close(table.double(), vaswani_pe(n, dim), rtol=0, atol=1e-6)


def test_sinusoidal_table_custom_base() -> None:
    torch.testing.assert_close(
        sinusoidal_table(9, 6, base=100.0).double(), vaswani_pe(9, 6, base=100.0), rtol=0,
        atol=1e-6,
    )


def test_sinusoidal_table_hand_values() -> None:
    table = sinusoidal_table(4, 8)
    # p = 0: sin 0 = 0 in even channels, cos 0 = 1 in odd channels.
    assert torch.equal(table[0, 0::2], torch.zeros(4))
    assert torch.equal(table[0, 1::2], torch.ones(4))
    # Channel pair 0 has frequency 1: PE(p, 0) = sin p, PE(p, 1) = cos p.
    assert table[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert table[3, 1].item() == pytest.approx(math.cos(3.0), abs=1e-7)
    # Last pair (i = 3, d = 8): frequency 10000^(-6/8) = 10^-3.
    assert table[2, 6].item() == pytest.approx(math.sin(2e-3), abs=1e-7)


def test_sinusoidal_table_odd_dim_raises() -> None:
    with pytest.raises(ValueError, match="even"):
        sinusoidal_table(4, 5)


def test_sinusoidal_2d_layout() -> None:
    h, w, dim = 3, 4, 8
    table = sinusoidal_2d_table(h, w, dim)
    assert table.shape == (h * w, dim)
    ref = vaswani_pe(max(h, w), dim // 2)
    for r in range(h):
        for c in range(w):
            row = table[r * w + c].double()  # row-major patch order
            torch.testing.assert_close(row[: dim // 2], ref[r], rtol=0, atol=1e-6)
            torch.testing.assert_close(row[dim // 2 :], ref[c], rtol=0, atol=1e-6)


def test_sinusoidal_2d_same_row_shares_first_half() -> None:
    table = sinusoidal_2d_table(2, 5, 12)
    # Patches (0, c) all share the row code; patches (r, 0) all share the column code.
    assert torch.equal(table[0:5, :6], table[0:1, :6].expand(5, 6))
    assert torch.equal(table[0, 6:], table[5, 6:])
    assert not torch.equal(table[0, :6], table[5, :6])


def test_sinusoidal_2d_dim_not_multiple_of_4_raises() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        sinusoidal_2d_table(2, 2, 6)


# --------------------------------------------------------------------------- absolute tables


def test_learned_embedding_offsets_return_rows() -> None:
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(10, 6)
    assert emb.weight.shape == (10, 6)
    assert torch.equal(emb(4), emb.weight[:4])
    assert torch.equal(emb(3, offset=5), emb.weight[5:8])
    assert torch.equal(emb(1, offset=9), emb.weight[9:10])
    # Trainable: only the rows used get gradient.
    emb(2, offset=3).sum().backward()
    grad = emb.weight.grad
    assert torch.equal(grad[3:5], torch.ones(2, 6))
    assert torch.equal(grad[:3], torch.zeros(3, 6)) and torch.equal(grad[5:], torch.zeros(5, 6))


@pytest.mark.parametrize(("T", "offset"), [(11, 0), (3, 8), (1, 10), (2, -1)])
def test_learned_embedding_out_of_range_raises(T: int, offset: int) -> None:
    emb = LearnedPositionalEmbedding(10, 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        emb(T, offset=offset)


def test_sinusoidal_embedding_offsets_return_rows() -> None:
    emb = SinusoidalPositionalEmbedding(20, 8)
    ref = vaswani_pe(20, 8)
    torch.testing.assert_close(emb(5).double(), ref[:5], rtol=0, atol=1e-6)
    torch.testing.assert_close(emb(4, offset=16).double(), ref[16:20], rtol=0, atol=1e-6)
    assert list(emb.parameters()) == []  # fixed, nothing to train
    assert "table" not in emb.state_dict()  # rebuilt on construction, not saved


@pytest.mark.parametrize(("T", "offset"), [(21, 0), (5, 16), (1, 20)])
def test_sinusoidal_embedding_out_of_range_raises(T: int, offset: int) -> None:
    emb = SinusoidalPositionalEmbedding(20, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        emb(T, offset=offset)


# --------------------------------------------------------------------------- RoPE


def test_rotate_half() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert torch.equal(rotate_half(x), torch.tensor([-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]))


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_equals_complex_rotation(theta: float) -> None:
    torch.manual_seed(0)
    D, T = 8, 6
    rope = RotaryEmbedding(D, max_seq_len=64, theta=theta)
    x = torch.randn(2, 3, T, D)
    out = rope(x)
    assert out.shape == x.shape
    for b in range(2):
        for h in range(3):
            ref = rope_complex(x[b, h], list(range(T)), theta)
            torch.testing.assert_close(out[b, h].double(), ref, rtol=0, atol=1e-5)


def test_rope_equals_explicit_2x2_rotation_at_large_offset() -> None:
    torch.manual_seed(1)
    D, offset = 6, 1000
    rope = RotaryEmbedding(D, max_seq_len=1024)
    x = torch.randn(1, 1, 3, D)
    out = rope(x, offset=offset)[0, 0].double()
    xd = x[0, 0].double()
    for t in range(3):
        p = offset + t
        for i in range(D // 2):
            a = p * 10000.0 ** (-2 * i / D)
            rot = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]],
                               dtype=torch.float64)
            pair = rot @ torch.stack([xd[t, i], xd[t, i + D // 2]])
            torch.testing.assert_close(out[t, [i, i + D // 2]], pair, rtol=0, atol=1e-4)


def test_rope_position_zero_is_identity() -> None:
    torch.manual_seed(2)
    rope = RotaryEmbedding(4, max_seq_len=8)
    x = torch.randn(1, 2, 1, 4)
    assert torch.equal(rope(x), x)


def test_rope_preserves_norm() -> None:
    torch.manual_seed(3)
    rope = RotaryEmbedding(16, max_seq_len=512)
    x = torch.randn(2, 4, 32, 16)
    out = rope(x, offset=400)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift", [1, 7, 100])
def test_rope_scores_depend_only_on_relative_offset(shift: int) -> None:
    torch.manual_seed(4)
    D = 8
    rope = RotaryEmbedding(D, max_seq_len=256)
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    rope = rope.double()
    for m, n in [(0, 0), (3, 1), (2, 9), (20, 5)]:
        base = rope_at(rope, q, m) @ rope_at(rope, k, n)
        shifted = rope_at(rope, q, m + shift) @ rope_at(rope, k, n + shift)
        assert shifted.item() == pytest.approx(base.item(), abs=1e-5)
    # ...and it does depend on the offset itself (otherwise the test above proves nothing).
    s01 = rope_at(rope, q, 0) @ rope_at(rope, k, 1)
    s05 = rope_at(rope, q, 0) @ rope_at(rope, k, 5)
    assert abs(s01.item() - s05.item()) > 1e-3


def test_rope_offset_equals_slicing_longer_sequence() -> None:
    torch.manual_seed(5)
    rope = RotaryEmbedding(8, max_seq_len=32)
    x = torch.randn(2, 2, 12, 8)
    full = rope(x)
    for start, stop in [(0, 4), (3, 7), (11, 12)]:
        part = rope(x[:, :, start:stop], offset=start)
        torch.testing.assert_close(part, full[:, :, start:stop], rtol=0, atol=0)


def test_rope_theta_changes_angles() -> None:
    D, p = 8, 5
    small, large = RotaryEmbedding(D, 16, theta=10000.0), RotaryEmbedding(D, 16, theta=500000.0)
    for i in range(D // 2):
        e = torch.zeros(D)
        e[i] = 1.0  # unit vector on the first element of pair i: rotation gives (cos a, sin a)
        for rope, theta in [(small, 10000.0), (large, 500000.0)]:
            out = rope_at(rope, e, p)
            angle = math.atan2(out[i + D // 2].item(), out[i].item())
            expected = p * theta ** (-2 * i / D)
            expected = math.atan2(math.sin(expected), math.cos(expected))  # wrap to (-π, π]
            assert angle == pytest.approx(expected, abs=1e-5)
    # Pair 0 turns at frequency 1 whatever theta; higher pairs turn slower with a larger theta.
    assert torch.allclose(small.cos[:, 0], large.cos[:, 0])
    assert not torch.allclose(small.cos[:, 1], large.cos[:, 1])


def test_rope_odd_head_dim_raises() -> None:
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


def test_rope_wrong_head_dim_or_range_raises() -> None:
    rope = RotaryEmbedding(8, max_seq_len=10)
    with pytest.raises(ValueError, match="head_dim"):
        rope(torch.randn(1, 1, 3, 6))
    with pytest.raises(ValueError, match="max_seq_len"):
        rope(torch.randn(1, 1, 3, 8), offset=8)


def test_rope_keeps_low_precision_dtype() -> None:
    rope = RotaryEmbedding(8, max_seq_len=16)
    x = torch.randn(1, 1, 4, 8)
    out = rope(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rope(x), rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_power_of_two() -> None:
    slopes = alibi_slopes(8)
    expected = torch.tensor([1 / 2**k for k in range(1, 9)])
    torch.testing.assert_close(slopes, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256]))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 12, 16, 24])
def test_alibi_slopes_match_paper_recipe(n: int) -> None:
    slopes = alibi_slopes(n)
    assert slopes.shape == (n,)
    torch.testing.assert_close(
        slopes.double(), torch.tensor(paper_alibi_slopes(n), dtype=torch.float64),
        rtol=1e-6, atol=0,
    )


def test_alibi_slopes_non_power_of_two_hand_values() -> None:
    # 6 heads: the 4-head slopes, then every other 8-head slope (1/2, 1/8).
    six = [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    torch.testing.assert_close(alibi_slopes(6).double(), torch.tensor(six, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    # 12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 from the 16-head ones.
    twelve = [2.0**-k for k in range(1, 9)] + [2 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(alibi_slopes(12).double(),
                               torch.tensor(twelve, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("T", "S"), [(5, 5), (3, 7), (1, 4)])
def test_alibi_bias_values(T: int, S: int) -> None:
    n = 4
    bias = ALiBi(n)(T, S)
    assert bias.shape == (1, n, T, S)
    slopes = paper_alibi_slopes(n)
    for h in range(n):
        for i in range(T):
            for j in range(S):
                expected = -slopes[h] * abs((S - T + i) - j)  # bottom-right aligned
                assert bias[0, h, i, j].item() == pytest.approx(expected, abs=1e-7)
    # Each query's own position (the diagonal, aligned bottom-right) has zero bias.
    for i in range(T):
        assert torch.equal(bias[0, :, i, S - T + i], torch.zeros(n))


def test_alibi_default_square() -> None:
    alibi = ALiBi(2)
    assert torch.equal(alibi(4), alibi(4, 4))


@pytest.mark.parametrize(("T", "S"), [(6, 6), (3, 8)])
def test_alibi_bias_through_every_backend(T: int, S: int, reference_attention) -> None:
    torch.manual_seed(6)
    B, H, D = 2, 4, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    bias = ALiBi(H)(T, S)
    expected, _ = reference_attention(q, k, v, bias=bias, is_causal=True)  # tests/conftest.py's
    outs = {}
    for backend in ("reference", "sdpa", "chunked"):
        outs[backend] = attention(q, k, v, is_causal=True, bias=bias, backend=backend).out
        torch.testing.assert_close(outs[backend].double(), expected, rtol=1e-5, atol=1e-5)
    # The bias matters: without it the result is different.
    plain = attention(q, k, v, is_causal=True, backend="reference").out
    assert (plain - outs["reference"]).abs().max() > 1e-2
