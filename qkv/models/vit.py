"""Vision Transformer: an image as a sequence of patch tokens.

    image (B, C, H, W) -> cut into P×P patches -> (B, N, C·P·P) -> linear -> (B, N, dim)
                          (or: a few stride-2 convolutions down to the patch grid, ``stem="conv"``)
    [+ a learnable class token] + positions -> pre-LN encoder blocks -> norm -> read-out -> logits

Dosovitskiy et al. 2021 ("An Image is Worth 16x16 Words"). Lectures: CS189 Lec 22 (images
as tokens; the three ways to read a class out of the token states: a class token, mean
pooling, concatenation + linear), CS231N Lec 8 (ViT).

Shapes: B batch, C channels, H×W image, P patch size, N = (H/P)·(W/P) patches, dim width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from qkv.attention import BACKENDS, Backend, LearnedPositionalEmbedding, sinusoidal_2d_table
from qkv.layers import BlockConfig, encoder_stack
from qkv.nn.linear import Linear

ReadOut = Literal["cls", "mean", "concat"]
ViTPositions = Literal["learned", "sinusoidal", "none"]
ViTStem = Literal["linear", "conv"]


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, N, C·P·P), patches in row-major order, each flattened (c, y, x)."""
    B, C, H, W = images.shape
    P = patch_size
    if H % P or W % P:
        raise ValueError(f"patch size {P} must divide the image size {H}x{W}")
    x = images.reshape(B, C, H // P, P, W // P, P)  # (B, C, h, P, w, P)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, P, P)
    return x.reshape(B, (H // P) * (W // P), C * P * P)


def overlapping_patches(images: Tensor, patch_size: int, overlap: int) -> Tensor:
    """(B, C, H, W) -> (B, N, C·K·K) with K = P + 2·overlap: the same N = (H/P)·(W/P) patches in
    the same order as :func:`patchify`, each widened by ``overlap`` pixels on every side (zeros
    past the border), so neighbouring tokens share pixels. ``overlap = 0`` is :func:`patchify`.
    An overlapping patch embedding is a convolution with kernel K and stride P, the "hybrid"
    input of Dosovitskiy et al. 2021 §3.1 at its smallest; it gives small-data ViTs some of a
    CNN's locality (Xiao et al. 2021, "Early convolutions help transformers see better")."""
    if overlap == 0:
        return patchify(images, patch_size)
    H, W = images.shape[-2:]
    if H % patch_size or W % patch_size:
        raise ValueError(f"patch size {patch_size} must divide the image size {H}x{W}")
    k = patch_size + 2 * overlap
    cols = nn.functional.unfold(images, kernel_size=k, stride=patch_size, padding=overlap)  # (B, C·K·K, N)
    return cols.transpose(1, 2)


def stem_convs(patch_size: int) -> int:
    """How many 3×3 stride-2 convolutions take an image down to its patch grid: ⌈log2 P⌉."""
    return max(1, (patch_size - 1).bit_length())


def stem_widths(dim: int, patch_size: int, width: int | None = None) -> list[int]:
    """Channels of the conv stem's ⌈log2 P⌉ stride-2 convolutions: from ``width`` doubling up to
    ``dim`` (or ``width``, if wider), or with none: ending at ``dim``, each half the next, at least 8.
    dim 64, P 7: [16, 32, 64]; with width 32: [32, 64, 64]."""
    k = stem_convs(patch_size)
    if width is None:
        return [max(8, dim >> (k - 1 - i)) for i in range(k)]
    return [min(max(dim, width), width << i) for i in range(k)]


def conv_stem(channels: int, dim: int, patch_size: int, width: int | None = None,
              refine: int = 0) -> nn.Sequential:
    """The convolutional stem of Xiao et al. 2021 ("Early convolutions help transformers see
    better"): ⌈log2 P⌉ 3×3 stride-2 convolutions (padding 1, BatchNorm, ReLU), widths from
    :func:`stem_widths`, so (B, C, H, W) -> (B, width_k, ⌈H/2^k⌉, ⌈W/2^k⌉): one feature vector per
    patch cell of the grid (28×28 with P = 7: 28 -> 14 -> 7 -> 4). ``refine`` 3×3 stride-1
    convolutions follow the first (at 14×14 for a 28×28 image, where strokes and edges are
    still resolved), as the stages of a small CNN do. Each token then sees a receptive field wider
    than its patch, with a CNN's locality and weight sharing; the ViT's linear map follows (their
    final 1×1 convolution)."""
    widths = stem_widths(dim, patch_size, width)
    layers: list[nn.Module] = []

    def conv(cin: int, cout: int, stride: int) -> None:
        layers.extend([nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU()])

    for i, (cin, cout) in enumerate(zip([channels, *widths[:-1]], widths, strict=True)):
        conv(cin, cout, 2)
        for _ in range(refine if i == 0 else 0):
            conv(cout, cout, 1)
    return nn.Sequential(*layers)


def unpatchify(patches: Tensor, patch_size: int, channels: int, height: int, width: int) -> Tensor:
    """Inverse of :func:`patchify`: (B, N, C·P·P) -> (B, C, H, W)."""
    B = patches.shape[0]
    P, h, w = patch_size, height // patch_size, width // patch_size
    x = patches.reshape(B, h, w, channels, P, P).permute(0, 3, 1, 4, 2, 5)  # (B, C, h, P, w, P)
    return x.reshape(B, channels, height, width)


@dataclass
class ViTConfig:
    """Everything needed to rebuild a ViT (saved as ``config.json`` in a run directory)."""

    image_size: int = 28  # height = width of the input images
    channels: int = 1  # 1 (grey) or 3 (RGB)
    patch_size: int = 4  # P: must divide image_size
    patch_overlap: int = 0  # pixels each patch reaches into its neighbours on every side (0 = plain patches)
    # linear: each patch's pixels -> one linear map (Dosovitskiy et al.); conv: ⌈log2 P⌉ 3×3
    # stride-2 convolutions down to the patch grid, then that map (Xiao et al. 2021)
    stem: ViTStem = "linear"  # how pixels become patch tokens: linear or conv
    # the next two shape the conv stem only (linear patches ignore them, so --stem linear works on the preset)
    stem_width: int | None = None  # conv stem: first conv's width, doubled up to dim (none: ends at dim)
    stem_refine: int = 0  # conv stem: 3x3 stride-1 convolutions after its first (at half the image's size)
    n_classes: int = 10  # output classes
    dim: int = 128  # model width
    n_layers: int = 6  # Transformer blocks
    n_heads: int = 4  # attention heads
    mlp_hidden: int | None = None  # MLP hidden width (none = 4 * dim)
    positions: ViTPositions = "learned"  # learned, 2-D sinusoidal, or none
    read_out: ReadOut = "cls"  # class token, mean of patch tokens, or concatenation + linear
    dropout: float = 0.0  # dropout on embeddings, attention weights and residual branches
    norm_eps: float = 1e-6  # LayerNorm epsilon
    backend: Backend = "sdpa"  # attention implementation
    label_smoothing: float = 0.0  # training loss: this share of each target spread over all classes

    def __post_init__(self) -> None:
        for name in ("image_size", "channels", "patch_size", "n_classes", "dim", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.positions not in ("learned", "sinusoidal", "none"):
            raise ValueError(f"positions must be learned, sinusoidal or none, got {self.positions!r}")
        if self.positions == "sinusoidal" and self.dim % 4:
            raise ValueError(f"2-D sinusoidal positions need dim divisible by 4, got {self.dim}")
        if self.read_out not in ("cls", "mean", "concat"):
            raise ValueError(f"read_out must be cls, mean or concat, got {self.read_out!r}")
        if not 0 <= self.patch_overlap < self.patch_size:
            raise ValueError(f"patch_overlap must be in [0, patch_size), got {self.patch_overlap}")
        if self.stem not in ("linear", "conv"):
            raise ValueError(f"stem must be linear or conv, got {self.stem!r}")
        if self.stem_width is not None and self.stem_width < 1:
            raise ValueError(f"stem_width must be >= 1 (or none), got {self.stem_width}")
        if self.stem_refine < 0:
            raise ValueError(f"stem_refine must be >= 0, got {self.stem_refine}")
        if self.stem == "conv":
            if self.patch_overlap:
                raise ValueError("patch_overlap is for the linear stem (a conv stem's tokens already "
                                 "see past their patch): set --patch_overlap 0 or --stem linear")
            side = self.image_size
            for _ in range(stem_convs(self.patch_size)):
                side = (side + 1) // 2
            if side != self.grid:
                raise ValueError(f"a conv stem halves the image {stem_convs(self.patch_size)} times "
                                 f"({self.image_size} -> {side}), not to the {self.grid}x{self.grid} "
                                 f"patch grid of patch_size {self.patch_size}: choose a power-of-two "
                                 "patch size or --stem linear")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid**2

    def block_config(self) -> BlockConfig:
        return BlockConfig(
            dim=self.dim, n_heads=self.n_heads, mlp_hidden=self.mlp_hidden, mlp="gelu",
            norm="layernorm", norm_position="pre", norm_eps=self.norm_eps, bias=True,
            dropout=self.dropout, attn_dropout=self.dropout, backend=self.backend,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ViTOutput(NamedTuple):
    """logits (B, n_classes); loss with labels; per-layer weights (B, H, T, T) if asked
    (T = N patches, plus 1 for the class token)."""

    logits: Tensor
    loss: Tensor | None = None
    weights: list[Tensor] | None = None


class ViT(nn.Module):
    """Vision Transformer built only from ``qkv.attention`` and ``qkv.layers``."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stem = (conv_stem(cfg.channels, cfg.dim, cfg.patch_size, cfg.stem_width, cfg.stem_refine)
                     if cfg.stem == "conv" else None)
        patch_in = (self.stem[-2].num_features if self.stem is not None  # the stem's last width
                    else cfg.channels * (cfg.patch_size + 2 * cfg.patch_overlap) ** 2)
        self.patch_embed = Linear(patch_in, cfg.dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.read_out == "cls" else None
        n_tokens = cfg.n_patches + (1 if cfg.read_out == "cls" else 0)
        self.pos_emb: LearnedPositionalEmbedding | None = None
        if cfg.positions == "learned":
            self.pos_emb = LearnedPositionalEmbedding(n_tokens, cfg.dim)
        elif cfg.positions == "sinusoidal":
            table = sinusoidal_2d_table(cfg.grid, cfg.grid, cfg.dim)  # (N, dim)
            if cfg.read_out == "cls":  # the class token sits at no place in the grid
                table = torch.cat([torch.zeros(1, cfg.dim), table])
            self.register_buffer("pos_table", table, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.stack = encoder_stack(cfg.block_config(), cfg.n_layers)  # pre-LN: ends with a norm
        head_in = cfg.dim * cfg.n_patches if cfg.read_out == "concat" else cfg.dim
        self.head = Linear(head_in, cfg.n_classes)
        nn.init.trunc_normal_(self.patch_embed.weight, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.zeros_(self.head.weight)  # start from uniform class probabilities
        nn.init.zeros_(self.head.bias)

    def forward_features(
        self, images: Tensor, *, backend: Backend | None = None, return_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None]:
        """(B, C, H, W) -> token states (B, T, dim) after the final norm, and weights."""
        cfg = self.cfg
        if images.ndim != 4 or images.shape[1:] != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"images must be (B, {cfg.channels}, {cfg.image_size}, "
                             f"{cfg.image_size}), got shape {tuple(images.shape)}")
        if self.stem is not None:
            pixels = self.stem(images).flatten(2).transpose(1, 2)  # (B, dim, g, g) -> (B, N, dim)
        else:
            pixels = overlapping_patches(images, cfg.patch_size, cfg.patch_overlap)  # (B, N, C·K·K)
        x = self.patch_embed(pixels)  # (B, N, dim)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1+N, dim)
        if self.pos_emb is not None:
            x = x + self.pos_emb(x.shape[1])
        elif cfg.positions == "sinusoidal":
            x = x + self.pos_table.to(x.dtype)
        x = self.drop(x)
        out = self.stack(x, backend=backend, return_weights=return_weights)
        return out.x, out.self_weights

    def forward_head(self, tokens: Tensor) -> Tensor:
        """Token states (B, T, dim) -> logits (B, n_classes) by the configured read-out."""
        if self.cfg.read_out == "cls":
            pooled = tokens[:, 0]  # the class token's state
        elif self.cfg.read_out == "mean":
            pooled = tokens.mean(dim=1)
        else:
            pooled = tokens.flatten(1)  # (B, N·dim): keeps where each patch was
        return self.head(pooled)

    def forward(
        self,
        images: Tensor,
        labels: Tensor | None = None,
        *,
        backend: Backend | None = None,
        return_weights: bool = False,
    ) -> ViTOutput:
        """images (B, C, H, W) [, labels (B,)] -> ViTOutput(logits, loss, weights)."""
        tokens, weights = self.forward_features(images, backend=backend, return_weights=return_weights)
        logits = self.forward_head(tokens)
        loss = None if labels is None else nn.functional.cross_entropy(
            logits.float(), labels, label_smoothing=self.cfg.label_smoothing)
        return ViTOutput(logits, loss, weights)
