"""The Transformer layer and stacks of them.

    pre-LN  (GPT-2, ViT, Llama):  x = x + Attn(Norm(x));   x = x + MLP(Norm(x))
    post-LN (Vaswani 2017, BERT): x = Norm(x + Attn(x));   x = Norm(x + MLP(x))

A decoder layer adds cross-attention between the two (queries from the decoder, keys and
values from the encoder's output). Encoder and decoder stacks are the same class and differ
only in ``causal`` and ``cross_attention`` (DESIGN.md).
Lectures: CS189 Lec 22 ("the Transformer layer": attention, MLP, residuals, LayerNorm),
CS231N Lec 8 (encoder-decoder Transformer, masked self-attention).

Shapes: B batch, T length, S context length, dim model width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, NamedTuple

from torch import Tensor, nn

from qkv.attention import Backend, KVCache, MultiHeadAttention, RotaryEmbedding
from qkv.layers.mlp import MLPKind, make_mlp
from qkv.layers.norm import NormKind, make_norm


@dataclass
class BlockConfig:
    """Everything one Transformer layer needs; models derive it from their own config.

    ``mlp_hidden`` defaults to 4·dim (the usual ratio). ``dropout`` is applied to each
    residual branch, ``attn_dropout`` to the attention weights.
    """

    dim: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_hidden: int | None = None
    mlp: MLPKind = "gelu"
    norm: NormKind = "layernorm"
    norm_position: Literal["pre", "post"] = "pre"
    norm_eps: float = 1e-5
    bias: bool = True
    qkv_bias: bool | None = None  # biases on the q/k/v projections only (default: bias)
    dropout: float = 0.0
    attn_dropout: float = 0.0
    backend: Backend = "sdpa"
    causal: bool = False
    cross_attention: bool = False
    kv_dim: int | None = None  # width of the cross-attention context (default dim)
    tie_qk: bool = False  # self-attention with W_Q = W_K (symmetric scores; CS189 Lec 21)

    def __post_init__(self) -> None:
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.dim


class BlockOutput(NamedTuple):
    """x (B, T, dim); attention weights (B, H, T, S) of each sublayer when asked for."""

    x: Tensor
    self_weights: Tensor | None = None
    cross_weights: Tensor | None = None


class TransformerBlock(nn.Module):
    """One Transformer layer: self-attention, optional cross-attention, MLP."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.cfg = cfg
        attn_kw = dict(head_dim=cfg.head_dim, bias=cfg.bias, qkv_bias=cfg.qkv_bias,
                       dropout=cfg.attn_dropout, backend=cfg.backend)
        self.norm1 = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.bias)
        self.attn = MultiHeadAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, tie_qk=cfg.tie_qk, **attn_kw)
        if cfg.cross_attention:
            self.norm_cross = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.bias)
            self.cross_attn = MultiHeadAttention(
                cfg.dim, cfg.n_heads, cfg.n_kv_heads, cross=True, kv_dim=cfg.kv_dim, **attn_kw
            )
        # --mlp none: no MLP and so no norm before (pre-LN) or after (post-LN) it
        none = cfg.mlp == "none"
        self.norm2 = nn.Identity() if none else make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.bias)
        self.mlp = make_mlp(cfg.mlp, cfg.dim, cfg.mlp_hidden, cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def _residual(self, x: Tensor, norm: nn.Module, sublayer) -> tuple[Tensor, Tensor | None]:
        """Apply ``sublayer`` with a residual connection, pre- or post-norm."""
        if self.cfg.norm_position == "pre":
            y, w = sublayer(norm(x))
            return x + self._dropout(y), w
        y, w = sublayer(x)
        return norm(x + self._dropout(y)), w

    def _dropout(self, y: Tensor) -> Tensor:
        # Skipping the no-op module call saves ~10 µs per sublayer when decoding one token.
        return self.drop(y) if self.training and self.cfg.dropout > 0 else y

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        context_mask: Tensor | None = None,
        bias: Tensor | None = None,
        rope: RotaryEmbedding | None = None,
        cache=None,
        backend: Backend | None = None,
        return_weights: bool = False,
    ) -> BlockOutput:
        """x (B, T, dim) [, context (B, S, kv_dim)] -> BlockOutput(x (B, T, dim), weights).

        ``mask`` (bool, True = may attend) and ``bias`` go to self-attention, whose
        causality comes from the config; ``context_mask`` (e.g. source padding,
        broadcastable to (B, H, T, S)) goes to cross-attention. ``cache`` is this layer's
        :class:`~qkv.attention.LayerKVCache`.
        """
        kw = dict(backend=backend, return_weights=return_weights)

        def self_attn(h: Tensor):
            return self.attn(h, mask=mask, is_causal=self.cfg.causal, bias=bias, rope=rope,
                             cache=cache, **kw)

        x, w_self = self._residual(x, self.norm1, self_attn)
        w_cross = None
        if self.cfg.cross_attention:
            if context is None:
                raise ValueError("this block has cross-attention: pass context= (B, S, kv_dim)")

            def cross_attn(h: Tensor):
                return self.cross_attn(h, context, mask=context_mask, **kw)

            x, w_cross = self._residual(x, self.norm_cross, cross_attn)
        x, _ = self._residual(x, self.norm2, lambda h: (self.mlp(h), None))
        return BlockOutput(x, w_self, w_cross)


class StackOutput(NamedTuple):
    """x (B, T, dim); per-layer attention weights (lists) when asked for."""

    x: Tensor
    self_weights: list[Tensor] | None = None
    cross_weights: list[Tensor] | None = None


class TransformerStack(nn.Module):
    """``n_layers`` identical blocks, plus a final norm for pre-LN stacks.

    An encoder is ``TransformerStack(BlockConfig(..., causal=False), n)``; a decoder sets
    ``causal=True`` and (for encoder-decoder models) ``cross_attention=True``. Nothing else
    differs. See :func:`encoder_stack` and :func:`decoder_stack`.
    """

    def __init__(self, cfg: BlockConfig, n_layers: int) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.cfg = cfg
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(n_layers))
        # Pre-LN leaves the residual stream unnormalised, so it gets one norm at the end.
        pre = cfg.norm_position == "pre"
        self.norm = make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.bias) if pre else None

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        context_mask: Tensor | None = None,
        bias: Tensor | None = None,
        rope: RotaryEmbedding | None = None,
        cache: KVCache | None = None,
        backend: Backend | None = None,
        return_weights: bool = False,
        weights_layers: Collection[int] | None = None,
    ) -> StackOutput:
        """Run every block. With a ``cache``, each block stores its new keys/values and,
        once all blocks have run, the cache is advanced by T (the stack is the one place
        that knows every layer is done). ``weights_layers``: with ``return_weights``, only these
        blocks compute their weights (with the explicit ``reference`` backend); the others run
        ``backend`` and give None in the weights list."""
        if cache is not None and cache.n_layers != len(self.blocks):
            raise ValueError(
                f"KVCache has {cache.n_layers} layers, this stack has {len(self.blocks)}"
            )
        ws, wc = [], []
        for i, block in enumerate(self.blocks):
            rw = return_weights and (weights_layers is None or i in weights_layers)
            x, w_self, w_cross = block(
                x, context, mask=mask, context_mask=context_mask, bias=bias, rope=rope,
                cache=None if cache is None else cache.layer(i),
                backend="reference" if rw and weights_layers is not None else backend,
                return_weights=rw,
            )
            ws.append(w_self)
            wc.append(w_cross)
        if self.norm is not None:
            x = self.norm(x)
        if cache is not None:
            cache.advance(x.shape[1])
        if not return_weights:
            return StackOutput(x)
        return StackOutput(x, ws, wc if self.cfg.cross_attention else None)


def encoder_stack(cfg: BlockConfig, n_layers: int) -> TransformerStack:
    """Bidirectional self-attention blocks (BERT, ViT, the Transformer's encoder)."""
    return TransformerStack(dataclasses.replace(cfg, causal=False, cross_attention=False), n_layers)


def decoder_stack(
    cfg: BlockConfig, n_layers: int, cross_attention: bool = True
) -> TransformerStack:
    """Causal blocks, with cross-attention to an encoder unless ``cross_attention=False`` (GPT)."""
    return TransformerStack(
        dataclasses.replace(cfg, causal=True, cross_attention=cross_attention), n_layers
    )
