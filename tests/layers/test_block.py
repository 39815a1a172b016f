"""Transformer blocks and stacks: the residual wiring, parity with torch.nn's Transformer
layers (copied weights), causality, attention maps, backend parity, and an overfit check."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import randomise
from torch import nn

from qkv.attention import ALiBi, KVCache, RotaryEmbedding
from qkv.layers import (
    BlockConfig,
    TransformerBlock,
    TransformerStack,
    decoder_stack,
    encoder_stack,
)

B, T, S, DIM, HEADS = 2, 6, 5, 16, 4


def rand(*shape: int, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def asdict(c: BlockConfig) -> dict:
    return dataclasses.asdict(c)


def cfg(**kw) -> BlockConfig:
    base = dict(dim=DIM, n_heads=HEADS, mlp_hidden=32)
    base.update(kw)
    return BlockConfig(**base)


# --------------------------------------------------------------------------- config


def test_config_defaults_and_validation() -> None:
    c = BlockConfig(dim=12, n_heads=3)
    assert c.mlp_hidden == 48  # 4·dim
    assert c.norm_position == "pre" and not c.causal and not c.cross_attention
    with pytest.raises(ValueError, match="norm_position"):
        BlockConfig(dim=8, n_heads=2, norm_position="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dropout"):
        BlockConfig(dim=8, n_heads=2, dropout=1.0)
    with pytest.raises(ValueError, match="attn_dropout"):
        BlockConfig(dim=8, n_heads=2, attn_dropout=-0.1)
    with pytest.raises(ValueError, match="n_layers"):
        TransformerStack(BlockConfig(dim=8, n_heads=2), 0)


# --------------------------------------------------------------------------- block wiring


@pytest.mark.parametrize(("norm", "mlp"), [("layernorm", "gelu"), ("rmsnorm", "swiglu")])
@pytest.mark.parametrize("causal", [False, True])
def test_pre_ln_block_is_manual_composition(norm: str, mlp: str, causal: bool) -> None:
    torch.manual_seed(0)
    blk = TransformerBlock(cfg(norm=norm, mlp=mlp, causal=causal, n_kv_heads=2)).eval()
    randomise(blk)
    x = rand(B, T, DIM)
    h = x + blk.attn(blk.norm1(x), is_causal=causal).out
    expected = h + blk.mlp(blk.norm2(h))
    out = blk(x)
    assert out.self_weights is None and out.cross_weights is None
    torch.testing.assert_close(out.x, expected, rtol=1e-6, atol=1e-6)


def test_post_ln_block_is_manual_composition() -> None:
    torch.manual_seed(0)
    blk = TransformerBlock(cfg(norm_position="post", mlp="relu")).eval()
    randomise(blk)
    x = rand(B, T, DIM)
    h = blk.norm1(x + blk.attn(x).out)
    expected = blk.norm2(h + blk.mlp(h))
    torch.testing.assert_close(blk(x).x, expected, rtol=1e-6, atol=1e-6)
    # ...and it is not the pre-LN composition.
    pre = x + blk.attn(blk.norm1(x)).out
    pre = pre + blk.mlp(blk.norm2(pre))
    assert (pre - expected).abs().max() > 1e-2


@pytest.mark.parametrize("position", ["pre", "post"])
def test_cross_attention_block_is_manual_composition(position: str) -> None:
    torch.manual_seed(0)
    blk = TransformerBlock(cfg(causal=True, cross_attention=True, kv_dim=10,
                               norm_position=position)).eval()
    randomise(blk)
    x, ctx = rand(B, T, DIM), rand(B, S, 10, seed=2)
    if position == "pre":
        h = x + blk.attn(blk.norm1(x), is_causal=True).out
        h = h + blk.cross_attn(blk.norm_cross(h), ctx).out
        expected = h + blk.mlp(blk.norm2(h))
    else:
        h = blk.norm1(x + blk.attn(x, is_causal=True).out)
        h = blk.norm_cross(h + blk.cross_attn(h, ctx).out)
        expected = blk.norm2(h + blk.mlp(h))
    torch.testing.assert_close(blk(x, ctx).x, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="context"):
        blk(x)


# --------------------------------------------------------------------------- torch.nn parity


def _copy_self_attn(mha: nn.MultiheadAttention, ours) -> None:
    mha.in_proj_weight.copy_(ours.qkv.weight)  # rows: q, k, v, the same order
    mha.in_proj_bias.copy_(ours.qkv.bias)
    mha.out_proj.weight.copy_(ours.out_proj.weight)
    mha.out_proj.bias.copy_(ours.out_proj.bias)


def _copy_linear_or_norm(dst: nn.Module, src: nn.Module) -> None:
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_equals_torch_encoder_layer(activation: str, norm_first: bool) -> None:
    torch.manual_seed(0)
    ours = TransformerBlock(cfg(mlp=activation, norm_position="pre" if norm_first else "post"))
    randomise(ours)
    ref = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=32, dropout=0.0,
                                     activation=activation, batch_first=True,
                                     norm_first=norm_first)
    with torch.no_grad():
        _copy_self_attn(ref.self_attn, ours.attn)
        _copy_linear_or_norm(ref.linear1, ours.mlp.fc_in)
        _copy_linear_or_norm(ref.linear2, ours.mlp.fc_out)
        _copy_linear_or_norm(ref.norm1, ours.norm1)
        _copy_linear_or_norm(ref.norm2, ours.norm2)
    ours, ref = ours.double().eval(), ref.double().eval()
    x = rand(B, T, DIM, dtype=torch.float64)
    torch.testing.assert_close(ours(x).x, ref(x), rtol=1e-10, atol=1e-10)
    # With a padding mask too (torch: True = ignore; qkv: True = may attend).
    pad = torch.tensor([[False] * T, [False] * (T - 2) + [True] * 2])
    got = ours(x, mask=~pad[:, None, None, :]).x
    torch.testing.assert_close(got, ref(x, src_key_padding_mask=pad), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_equals_torch_decoder_layer(norm_first: bool) -> None:
    torch.manual_seed(0)
    ours = TransformerBlock(cfg(mlp="relu", causal=True, cross_attention=True,
                                norm_position="pre" if norm_first else "post"))
    randomise(ours)
    ref = nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=32, dropout=0.0,
                                     activation="relu", batch_first=True, norm_first=norm_first)
    with torch.no_grad():
        _copy_self_attn(ref.self_attn, ours.attn)
        cross = ref.multihead_attn
        cross.in_proj_weight[:DIM].copy_(ours.cross_attn.q_proj.weight)
        cross.in_proj_weight[DIM:].copy_(ours.cross_attn.kv_proj.weight)
        cross.in_proj_bias[:DIM].copy_(ours.cross_attn.q_proj.bias)
        cross.in_proj_bias[DIM:].copy_(ours.cross_attn.kv_proj.bias)
        _copy_linear_or_norm(cross.out_proj, ours.cross_attn.out_proj)
        _copy_linear_or_norm(ref.linear1, ours.mlp.fc_in)
        _copy_linear_or_norm(ref.linear2, ours.mlp.fc_out)
        _copy_linear_or_norm(ref.norm1, ours.norm1)
        _copy_linear_or_norm(ref.norm2, ours.norm_cross)
        _copy_linear_or_norm(ref.norm3, ours.norm2)
    ours, ref = ours.double().eval(), ref.double().eval()
    x, memory = rand(B, T, DIM, dtype=torch.float64), rand(B, S, DIM, seed=2,
                                                           dtype=torch.float64)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    expected = ref(x, memory, tgt_mask=tgt_mask, tgt_is_causal=True)
    torch.testing.assert_close(ours(x, memory).x, expected, rtol=1e-10, atol=1e-10)
    # Source padding goes to cross-attention only.
    pad = torch.tensor([[False] * S, [False] * (S - 2) + [True] * 2])
    expected = ref(x, memory, tgt_mask=tgt_mask, memory_key_padding_mask=pad)
    got = ours(x, memory, context_mask=~pad[:, None, None, :]).x
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- stacks


def test_encoder_and_decoder_differ_only_in_causal_and_cross() -> None:
    base = cfg(norm="rmsnorm", mlp="swiglu", n_kv_heads=2, causal=True)  # encoder resets causal
    enc, dec = asdict(encoder_stack(base, 2).cfg), asdict(decoder_stack(base, 2).cfg)
    assert not enc["causal"] and not enc["cross_attention"]
    assert dec["causal"] and dec["cross_attention"]
    assert {k for k in enc if enc[k] != dec[k]} == {"causal", "cross_attention"}
    gpt = asdict(decoder_stack(base, 2, cross_attention=False).cfg)
    assert {k for k in enc if enc[k] != gpt[k]} == {"causal"}
    # Parameters: the decoder has the encoder's, plus cross-attention and its norm.
    enc_keys = set(encoder_stack(base, 2).state_dict())
    dec_keys = set(decoder_stack(base, 2).state_dict())
    assert enc_keys < dec_keys
    assert all(".cross_attn." in k or ".norm_cross." in k for k in dec_keys - enc_keys)
    assert enc_keys == set(decoder_stack(base, 2, cross_attention=False).state_dict())


@pytest.mark.parametrize("position", ["pre", "post"])
def test_stack_runs_blocks_then_final_norm(position: str) -> None:
    torch.manual_seed(0)
    stack = encoder_stack(cfg(norm_position=position), 2).eval()
    randomise(stack)
    x = rand(B, T, DIM)
    h = stack.blocks[1](stack.blocks[0](x).x).x
    if position == "pre":  # pre-LN leaves the stream unnormalised: one final norm
        h = stack.norm(h)
    else:
        assert stack.norm is None
    torch.testing.assert_close(stack(x).x, h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cross", [False, True])
def test_decoder_future_tokens_do_not_change_the_past(cross: bool) -> None:
    torch.manual_seed(0)
    stack = decoder_stack(cfg(), 2, cross_attention=cross).eval()
    randomise(stack)
    x, ctx = rand(B, T, DIM), (rand(B, S, DIM, seed=2) if cross else None)
    x2 = x.clone()
    x2[:, 3:] = rand(B, T - 3, DIM, seed=9)
    out, out2 = stack(x, ctx).x, stack(x2, ctx).x
    torch.testing.assert_close(out2[:, :3], out[:, :3], rtol=0, atol=1e-6)
    assert (out2[:, 3:] - out[:, 3:]).abs().max() > 1e-2


def test_encoder_future_tokens_change_the_past() -> None:
    torch.manual_seed(0)
    stack = encoder_stack(cfg(), 2).eval()
    randomise(stack)
    x = rand(B, T, DIM)
    x2 = x.clone()
    x2[:, 3:] = rand(B, T - 3, DIM, seed=9)
    assert (stack(x2).x[:, :3] - stack(x).x[:, :3]).abs().max() > 1e-2


def test_return_weights_per_layer() -> None:
    torch.manual_seed(0)
    n_layers = 3
    stack = decoder_stack(cfg(backend="reference", n_kv_heads=2), n_layers).eval()
    randomise(stack)
    x, ctx = rand(B, T, DIM), rand(B, S, DIM, seed=2)
    pad = torch.tensor([[True] * S, [True] * (S - 2) + [False] * 2])[:, None, None, :]
    out = stack(x, ctx, context_mask=pad, return_weights=True)
    assert len(out.self_weights) == n_layers and len(out.cross_weights) == n_layers
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for ws, wc in zip(out.self_weights, out.cross_weights, strict=True):
        assert ws.shape == (B, HEADS, T, T) and wc.shape == (B, HEADS, T, S)
        torch.testing.assert_close(ws.sum(-1), torch.ones(B, HEADS, T))
        torch.testing.assert_close(wc.sum(-1), torch.ones(B, HEADS, T))
        assert torch.equal(ws[..., future], torch.zeros_like(ws[..., future]))  # causal
        assert torch.equal(wc[1, ..., S - 2 :], torch.zeros(HEADS, T, 2))  # padded source
    # Layer 0's self-attention map is softmax(q kᵀ/√Dh) of the first block, written out.
    blk = stack.blocks[0]
    h = blk.norm1(x).double()
    Dh, K = DIM // HEADS, 2
    qkv = h @ blk.attn.qkv.weight.double().T + blk.attn.qkv.bias.double()
    q, k, _ = qkv.split([HEADS * Dh, K * Dh, K * Dh], dim=-1)
    q = q.view(B, T, HEADS, Dh).transpose(1, 2)
    k = k.view(B, T, K, Dh).transpose(1, 2).repeat_interleave(HEADS // K, dim=1)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(Dh)).masked_fill(future, float("-inf"))
    torch.testing.assert_close(out.self_weights[0].double(), scores.softmax(-1), rtol=1e-5,
                               atol=1e-6)
    # No weights unless asked, and no cross weights for a stack without cross-attention.
    assert stack(x, ctx).self_weights is None
    gpt = decoder_stack(cfg(backend="reference"), 2, cross_attention=False)
    got = gpt(x, return_weights=True)
    assert len(got.self_weights) == 2 and got.cross_weights is None


def test_return_weights_needs_reference_backend() -> None:
    stack = encoder_stack(cfg(backend="sdpa"), 1)
    with pytest.raises(ValueError, match="reference"):
        stack(rand(B, T, DIM), return_weights=True)
    assert stack(rand(B, T, DIM), backend="reference", return_weights=True).self_weights


@pytest.mark.parametrize("with_bias", [False, True])
def test_every_backend_gives_same_output_and_gradients(with_bias: bool) -> None:
    torch.manual_seed(0)
    stack = decoder_stack(cfg(n_kv_heads=2), 2)
    randomise(stack)
    x0, ctx0 = rand(B, T, DIM), rand(B, S, DIM, seed=2)
    pad = torch.tensor([[True] * S, [True] * (S - 1) + [False]])[:, None, None, :]
    bias = ALiBi(HEADS)(T) if with_bias else None
    results = {}
    for backend in ("reference", "sdpa", "chunked"):
        stack.zero_grad()
        x, ctx = x0.clone().requires_grad_(True), ctx0.clone().requires_grad_(True)
        out = stack(x, ctx, context_mask=pad, bias=bias, backend=backend).x
        (out * rand(B, T, DIM, seed=3)).sum().backward()
        grads = {n: p.grad.clone() for n, p in stack.named_parameters()}
        results[backend] = (out.detach(), x.grad, ctx.grad, grads)
    ref_out, ref_gx, ref_gc, ref_grads = results["reference"]
    for backend in ("sdpa", "chunked"):
        out, gx, gc, grads = results[backend]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=backend)
        torch.testing.assert_close(gx, ref_gx, rtol=1e-4, atol=1e-5, msg=backend)
        torch.testing.assert_close(gc, ref_gc, rtol=1e-4, atol=1e-5, msg=backend)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5,
                                       msg=f"{backend}: {name}")


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    noisy = decoder_stack(cfg(dropout=0.3, attn_dropout=0.3, backend="reference"), 2,
                          cross_attention=False)
    clean = decoder_stack(cfg(backend="reference"), 2, cross_attention=False)
    randomise(noisy)
    clean.load_state_dict(noisy.state_dict())
    x = rand(B, T, DIM)
    noisy.eval()
    a, b = noisy(x).x, noisy(x).x
    assert torch.equal(a, b)  # eval is deterministic...
    torch.testing.assert_close(a, clean.eval()(x).x, rtol=0, atol=0)  # ...and dropout-free
    noisy.train()
    torch.manual_seed(1)
    c = noisy(x).x
    torch.manual_seed(2)
    d = noisy(x).x
    assert (c - a).abs().max() > 1e-3 and (c - d).abs().max() > 1e-3


def test_cache_with_wrong_number_of_layers_raises() -> None:
    stack = decoder_stack(cfg(), 2, cross_attention=False)
    cache = KVCache(3, B, HEADS, 16, DIM // HEADS)
    with pytest.raises(ValueError, match="layers"):
        stack(rand(B, T, DIM), cache=cache)


def test_cached_decoding_equals_full_forward() -> None:
    torch.manual_seed(0)
    stack = decoder_stack(cfg(n_kv_heads=2), 2, cross_attention=False).eval()
    randomise(stack)
    rope = RotaryEmbedding(DIM // HEADS, max_seq_len=16)
    x = rand(B, T, DIM)
    full = stack(x, rope=rope).x
    cache = KVCache(2, B, 2, 16, DIM // HEADS)
    steps = [stack(x[:, :3], rope=rope, cache=cache).x]  # prefill 3 tokens
    for t in range(3, T):
        steps.append(stack(x[:, t : t + 1], rope=rope, cache=cache).x)
    assert cache.pos == T
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_overfit_shift_by_one() -> None:
    """A 2-layer decoder learns y_t = x_{t-1} on a fixed batch to near-zero loss."""
    torch.manual_seed(0)
    V, L, nb = 10, 8, 8
    tokens = torch.randint(0, V, (nb, L))
    emb = nn.Embedding(V, 32)
    stack = decoder_stack(BlockConfig(dim=32, n_heads=4, mlp_hidden=64), 2, cross_attention=False)
    head = nn.Linear(32, V)
    rope = RotaryEmbedding(8, max_seq_len=L)
    params = [*emb.parameters(), *stack.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)

    def loss_and_acc() -> tuple[torch.Tensor, float]:
        logits = head(stack(emb(tokens), rope=rope).x)[:, 1:]  # position 0 has no target
        target = tokens[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
        return loss, (logits.argmax(-1) == target).float().mean().item()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead (and stall under load)
    try:
        first, _ = loss_and_acc()
        for _ in range(200):
            loss, _ = loss_and_acc()
            opt.zero_grad()
            loss.backward()
            opt.step()
        final, acc = loss_and_acc()
    finally:
        torch.set_num_threads(threads)
    assert first.item() > 1.5  # about ln 10 at the start
    assert final.item() < 0.05
    assert acc == 1.0
