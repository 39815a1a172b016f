"""Positional information: attention itself is permutation equivariant, so order must be added.

- Learned absolute embeddings (GPT-2, BERT, ViT): a trainable (max_seq_len, dim) table.
- Sinusoidal (Vaswani et al. 2017, §3.5): PE(p, 2i) = sin(p / 10000^(2i/d)),
  PE(p, 2i+1) = cos(p / 10000^(2i/d)); and the 2-D version for image patches (half the
  channels encode the row, half the column; as in MAE, He et al. 2022).
- RoPE (Su et al. 2021, "RoFormer"): rotate each (x_i, x_{i+D/2}) pair of q and k by an angle
  p·θ^(-2i/D), so qᵀk depends only on the relative offset. "Rotate-half" layout (GPT-NeoX,
  HF Llama).
- ALiBi (Press et al. 2022): add -m_h·|i - j| to the scores, a fixed slope m_h per head.

Shapes: B batch, H heads, T length, D head dim, dim model width.
Lectures: CS189 Lec 22 (attention has no notion of order; positional encodings), CS231N Lec 8.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def _check_range(kind: str, offset: int | Tensor, T: int, limit: int) -> None:
    if isinstance(offset, Tensor):  # one offset per row (a running batch): check the extremes
        if torch.compiler.is_exporting() or not len(offset):  # exported: its caller checks
            return
        lo, hi = int(offset.min()), int(offset.max())
        if lo < 0 or hi + T > limit:
            raise ValueError(f"{kind}: positions up to {hi + T - 1} exceed max_seq_len {limit}; "
                             "build it with a larger max_seq_len")
        return
    if offset < 0 or offset + T > limit:
        raise ValueError(
            f"{kind}: positions {offset}..{offset + T - 1} exceed max_seq_len {limit}; "
            "build it with a larger max_seq_len"
        )


class LearnedPositionalEmbedding(nn.Module):
    """A trainable vector per absolute position: forward(T, offset) -> (T, dim)."""

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.weight = nn.Parameter(torch.randn(max_seq_len, dim) * 0.02)

    def forward(self, T: int, offset: int | Tensor = 0) -> Tensor:
        """(T, dim) rows from ``offset``; with a (B,) tensor of offsets, (B, T, dim)."""
        _check_range("LearnedPositionalEmbedding", offset, T, self.max_seq_len)
        if isinstance(offset, Tensor):
            return self.weight[positions(offset, T)]
        return self.weight[offset : offset + T]


def sinusoidal_table(n_positions: int, dim: int, base: float = 10000.0) -> Tensor:
    """(n_positions, dim) fixed sinusoids, sin in even channels and cos in odd ones."""
    if dim % 2:
        raise ValueError(f"sinusoidal positions need an even dim, got {dim}")
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table.float()


def sinusoidal_2d_table(height: int, width: int, dim: int, base: float = 10000.0) -> Tensor:
    """(height·width, dim) for a grid of patches in row-major order.

    The first dim/2 channels are the 1-D table of the row index, the last dim/2 of the
    column index, so nearby patches in either direction get similar codes.
    """
    if dim % 4:
        raise ValueError(f"2-D sinusoidal positions need dim divisible by 4, got {dim}")
    rows = sinusoidal_table(height, dim // 2, base)  # (h, dim/2)
    cols = sinusoidal_table(width, dim // 2, base)  # (w, dim/2)
    grid_r = rows.unsqueeze(1).expand(height, width, dim // 2)
    grid_c = cols.unsqueeze(0).expand(height, width, dim // 2)
    return torch.cat([grid_r, grid_c], dim=-1).reshape(height * width, dim)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoidal table as a buffer: forward(T, offset) -> (T, dim)."""

    def __init__(self, max_seq_len: int, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.register_buffer("table", sinusoidal_table(max_seq_len, dim, base), persistent=False)

    def forward(self, T: int, offset: int | Tensor = 0) -> Tensor:
        """(T, dim) rows from ``offset``; with a (B,) tensor of offsets, (B, T, dim)."""
        _check_range("SinusoidalPositionalEmbedding", offset, T, self.max_seq_len)
        if isinstance(offset, Tensor):
            return self.table[positions(offset, T)]
        return self.table[offset : offset + T]


def positions(offset: Tensor, T: int) -> Tensor:
    """(B,) first positions -> (B, T) absolute positions ``offset[b] + t`` (a running batch,
    whose rows sit at different positions)."""
    return offset.view(-1, 1) + torch.arange(T, device=offset.device)


def rotate_half(x: Tensor) -> Tensor:
    """(..., D) -> (..., D): [x1, x2] -> [-x2, x1], the 90° turn of every (x_i, x_{i+D/2}) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), applied to queries and keys inside attention.

    Args:
        head_dim: D (even). max_seq_len: positions precomputed. theta: base of the angles
            (10000 in RoFormer; 100000 in SmolLM2; 500000 in Llama 3).
    """

    def __init__(self, head_dim: int, max_seq_len: int = 4096, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_seq_len, dtype=torch.float64).unsqueeze(1) * inv_freq  # (P, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (P, D): pair i and i + D/2 share an angle
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self._memo: tuple | None = None  # the last per-row gather (see _rows)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """Rotate x (B, H, T, D) whose first token sits at absolute position ``offset`` (an int,
        or a (B,) tensor: one per row of a running batch)."""
        T, D = x.shape[-2], x.shape[-1]
        if D != self.head_dim:
            raise ValueError(f"RoPE built for head_dim {self.head_dim}, got tensor with D={D}")
        _check_range("RotaryEmbedding", offset, T, self.max_seq_len)
        if isinstance(offset, Tensor):
            cos, sin = self._rows(offset, T)  # (B, 1, T, D)
        else:
            cos, sin = self.cos[offset : offset + T], self.sin[offset : offset + T]  # (T, D)
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def _rows(self, offset: Tensor, T: int) -> tuple[Tensor, Tensor]:
        """cos and sin (B, 1, T, D) at each row's positions. Every layer of one decoding step
        asks for the same positions: the gather is done once per step (the last one is kept,
        with a copy of the positions it was made for)."""
        exporting = torch.compiler.is_exporting()  # no state kept inside an exported program
        memo = None if exporting else self._memo
        if (memo is not None and memo[1] == T and memo[0].shape == offset.shape
                and memo[0].device == offset.device and torch.equal(memo[0], offset)):
            return memo[2], memo[3]
        at = positions(offset, T)  # (B, T)
        cos, sin = self.cos[at].unsqueeze(1), self.sin[at].unsqueeze(1)
        if not exporting:
            self._memo = (offset.clone(), T, cos, sin)
        return cos, sin


def alibi_slopes(n_heads: int) -> Tensor:
    """(H,) ALiBi slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... (Press et al. 2022).

    For H not a power of two, the paper's recipe: the slopes of the nearest lower power of
    two, then every other slope of the next power of two.
    """
    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(powers(n_heads))
    low = 2 ** math.floor(math.log2(n_heads))
    extra = powers(2 * low)[0::2][: n_heads - low]
    return torch.tensor(powers(low) + extra)


class ALiBi(nn.Module):
    """Attention with Linear Biases: forward(T, S) -> (1, H, T, S) bias = -m_h·|i - j|.

    Queries are aligned to the end of the keys (query i at absolute position S - T + i),
    as with a KV cache. Pass the result as ``bias=`` to any attention backend.
    """

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def forward(self, T: int, S: int | None = None) -> Tensor:
        S = T if S is None else S
        i = torch.arange(T, device=self.slopes.device).unsqueeze(1) + (S - T)
        j = torch.arange(S, device=self.slopes.device).unsqueeze(0)
        dist = (i - j).abs().to(self.slopes.dtype)  # (T, S)
        return -(self.slopes[:, None, None] * dist).unsqueeze(0)

    def rows(self, offset: Tensor, T: int, S: int) -> Tensor:
        """(B, H, T, S) bias for a running batch: row b's query i sits at ``offset[b] + i``."""
        i = positions(offset, T)[:, None, :, None]  # (B, 1, T, 1)
        j = torch.arange(S, device=offset.device)  # (S,)
        dist = (i - j).abs().to(self.slopes.dtype)  # (B, 1, T, S)
        return -(self.slopes[None, :, None, None] * dist)
