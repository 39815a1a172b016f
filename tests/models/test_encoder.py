"""Encoder (BERT-style, post-LN) on tiny random configs: shapes, padding invariance, the post-LN
block against torch.nn.TransformerEncoderLayer in float64, bidirectionality, token types,
pooling, backend parity and input validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.models.encoder import Encoder, EncoderConfig, cls_pool, mean_pool

V, DIM, LAYERS, HEADS, FFN, CTX = 40, 16, 2, 4, 24, 20

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def cfg(**kw) -> EncoderConfig:
    base = dict(vocab_size=V, max_seq_len=CTX, dim=DIM, n_layers=LAYERS, n_heads=HEADS, mlp_hidden=FFN,
                norm_eps=1e-12)
    base.update(kw)
    return EncoderConfig(**base)


def model(seed: int = 0, dtype=torch.float64, **kw) -> Encoder:
    torch.manual_seed(seed)
    m = Encoder(cfg(**kw)).to(dtype).eval()
    # LayerNorm gains start at 1 and biases at 0: randomise them so that no term hides.
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return m


def batch(lengths=(7, 3, 5), T: int | None = None, seed: int = 1):
    """(ids, mask): random ids, mask 1 on the first lengths[b] positions; padding ids random too."""
    T = max(lengths) if T is None else T
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(lengths), T), generator=g)
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- shapes


def test_shapes() -> None:
    m = model()
    ids, mask = batch()
    out = m(ids, mask)
    assert out.hidden.shape == (3, 7, DIM) and out.hidden.dtype == torch.float64
    assert out.weights is None
    w = m(ids, mask, backend="reference", return_weights=True).weights
    assert len(w) == LAYERS and all(t.shape == (3, HEADS, 7, 7) for t in w)
    assert m.pool(out.hidden, mask).shape == (3, DIM)
    assert m(ids).hidden.shape == (3, 7, DIM)  # no mask: every token is real


def test_config_round_trip_and_defaults_are_minilm() -> None:
    c = EncoderConfig()
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.mlp_hidden, c.max_seq_len) == (
        30522, 384, 6, 12, 1536, 512)
    assert (c.norm_position, c.mlp, c.norm_eps, c.pooling) == ("post", "gelu", 1e-12, "mean")
    assert EncoderConfig(**cfg().to_dict()) == cfg()


# --------------------------------------------------------------------------- padding


def test_appending_padding_does_not_change_real_tokens() -> None:
    m = model()
    ids, mask = batch()
    base = m(ids, mask).hidden
    g = torch.Generator().manual_seed(5)
    extra = torch.randint(0, V, (3, 6), generator=g)  # arbitrary ids under the padding
    ids2 = torch.cat([ids, extra], dim=1)
    mask2 = torch.cat([mask, torch.zeros(3, 6, dtype=mask.dtype)], dim=1)
    longer = m(ids2, mask2).hidden
    real = mask.bool()
    assert max_diff(longer[:, :7][real], base[real]) < 1e-12
    # Each sequence alone, with no padding at all, gives the same states too.
    for b, n in enumerate(mask.sum(1).tolist()):
        alone = m(ids[b : b + 1, :n], mask[b : b + 1, :n]).hidden[0]
        assert max_diff(alone, base[b, :n]) < 1e-12


def test_padding_ids_do_not_matter() -> None:
    m = model()
    ids, mask = batch()
    other = torch.where(mask.bool(), ids, (ids + 7) % V)
    real = mask.bool()
    assert max_diff(m(other, mask).hidden[real], m(ids, mask).hidden[real]) < 1e-12


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_backends_agree_with_reference(backend: str) -> None:
    m = model()
    ids, mask = batch()
    ref = m(ids, mask, backend="reference").hidden
    real = mask.bool()
    assert max_diff(m(ids, mask, backend=backend).hidden[real], ref[real]) < 1e-10


def test_attention_weights_ignore_padded_keys() -> None:
    m = model()
    ids, mask = batch()
    for w in m(ids, mask, backend="reference", return_weights=True).weights:
        assert max_diff(w.sum(-1), torch.ones(())) < 1e-12
        assert (w.masked_select(~mask.bool()[:, None, None, :]) == 0).all()


def test_encoder_is_bidirectional() -> None:
    """No causal mask: changing the last token changes the first token's state."""
    m = model()
    ids, _ = batch((6,))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % V
    assert max_diff(m(ids).hidden[0, 0], m(changed).hidden[0, 0]) > 1e-6


def test_token_types() -> None:
    m = model()
    ids, mask = batch()
    zeros = torch.zeros_like(ids)
    assert torch.equal(m(ids, mask).hidden, m(ids, mask, zeros).hidden)  # default: all type 0
    assert max_diff(m(ids, mask, torch.ones_like(ids)).hidden, m(ids, mask).hidden) > 1e-6
    no_types = model(type_vocab_size=0)
    assert no_types.type_emb is None
    assert no_types(ids, mask).hidden.shape == (3, 7, DIM)


# --------------------------------------------------------------------------- post-LN block


def test_post_ln_block_equals_torch_transformer_encoder_layer() -> None:
    """One block, weights copied into torch.nn.TransformerEncoderLayer (post-LN, exact GELU):
    x -> LN(x + SelfAttn(x)) -> LN(x + FFN(x)), with a key-padding mask, in float64."""
    m = model()
    block = m.stack.blocks[0]
    ref = torch.nn.TransformerEncoderLayer(
        DIM, HEADS, FFN, dropout=0.0, activation="gelu", layer_norm_eps=1e-12,
        batch_first=True, norm_first=False, dtype=torch.float64,
    ).eval()
    with torch.no_grad():
        # qkv's fused projection is laid out [W_Q; W_K; W_V], as torch's in_proj_weight.
        ref.self_attn.in_proj_weight.copy_(block.attn.qkv.weight)
        ref.self_attn.in_proj_bias.copy_(block.attn.qkv.bias)
        ref.self_attn.out_proj.weight.copy_(block.attn.out_proj.weight)
        ref.self_attn.out_proj.bias.copy_(block.attn.out_proj.bias)
        ref.linear1.weight.copy_(block.mlp.fc_in.weight)
        ref.linear1.bias.copy_(block.mlp.fc_in.bias)
        ref.linear2.weight.copy_(block.mlp.fc_out.weight)
        ref.linear2.bias.copy_(block.mlp.fc_out.bias)
        for ours, theirs in ((block.norm1, ref.norm1), (block.norm2, ref.norm2)):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, DIM, generator=g, dtype=torch.float64)
    _, mask = batch()
    real = mask.bool()
    expected = ref(x, src_key_padding_mask=~real)  # torch: True = ignore this key
    for backend in ("reference", "sdpa", "chunked"):
        got = block(x, mask=real[:, None, None, :], backend=backend).x
        assert max_diff(got[real], expected[real]) < 1e-12, backend
    assert max_diff(block(x).x, ref(x)) < 1e-12  # no mask: every position


# --------------------------------------------------------------------------- pooling


def test_mean_pool_ignores_padding() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, DIM, generator=g, dtype=torch.float64)
    _, mask = batch()
    expected = torch.stack([h[b, :n].mean(0) for b, n in enumerate(mask.sum(1).tolist())])
    assert max_diff(mean_pool(h, mask), expected) < 1e-12
    noisy = torch.where(mask.bool()[..., None], h, torch.full_like(h, 1e6))  # junk under padding
    assert max_diff(mean_pool(noisy, mask), expected) < 1e-12
    assert max_diff(mean_pool(h), h.mean(1)) < 1e-12  # no mask: all tokens
    assert max_diff(mean_pool(h, mask.bool()), expected) < 1e-12  # a bool mask works too


def test_cls_pool_takes_token_zero() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, DIM, generator=g)
    _, mask = batch()
    assert torch.equal(cls_pool(h, mask), h[:, 0])
    m = model(pooling="cls")
    assert torch.equal(m.pool(h, mask), h[:, 0])
    assert max_diff(m.pool(h, mask, pooling="mean"), mean_pool(h, mask)) == 0
    assert max_diff(model().pool(h, mask), mean_pool(h, mask)) == 0  # the default is mean
    with pytest.raises(ValueError, match="pooling"):
        m.pool(h, mask, pooling="max")


# --------------------------------------------------------------------------- validation


def test_bad_shapes_raise_value_error() -> None:
    m = model()
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        m(ids[0])  # 1-D
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        m(ids[..., None])  # 3-D
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, CTX + 1, dtype=torch.long))
    assert m(torch.zeros(1, CTX, dtype=torch.long)).hidden.shape == (1, CTX, DIM)  # exactly full: fine
    with pytest.raises(ValueError, match="attention_mask"):
        m(ids, mask[:, :-1])
    with pytest.raises(ValueError, match="attention_mask"):
        m(ids, mask[0])


@pytest.mark.parametrize(("field", "value", "match"), [
    ("dim", 18, "divisible"),
    ("n_layers", 0, "n_layers"),
    ("vocab_size", 0, "vocab_size"),
    ("pooling", "max", "pooling"),
    ("backend", "flash", "backend"),
])
def test_bad_config_raises_value_error(field: str, value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg(**{field: value})


def test_gradients_reach_every_parameter() -> None:
    m = model(dtype=torch.float32).train()
    ids, mask = batch()
    out = m(ids, mask, torch.ones_like(ids) * (torch.arange(7) % 2))
    F.mse_loss(m.pool(out.hidden, mask), torch.zeros(3, DIM)).backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # Positions past the longest sequence get no gradient rows, but the table does.
    assert missing == []
