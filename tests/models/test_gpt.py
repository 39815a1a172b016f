"""GPT: shapes, loss against F.cross_entropy, gradients, tied embeddings, causality for every
position scheme, backend parity, cached vs uncached decoding, config validation, and an
overfit-one-batch check."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from qkv.models.gpt import GPT, GPTConfig

V, DIM, LAYERS, HEADS, CTX = 50, 32, 2, 4, 24
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=V, max_seq_len=CTX, dim=DIM, n_layers=LAYERS, n_heads=HEADS)
    base.update(kw)
    return GPTConfig(**base)


def model(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    m = GPT(cfg(**kw)).eval()
    # GPT-2's init leaves biases at 0 and norm gains at 1; randomise them so no term hides.
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- shapes and loss


@pytest.mark.parametrize("positions", POSITIONS)
def test_shapes(positions: str) -> None:
    m = model(positions=positions)
    x = tokens(3, 7)
    out = m(x)
    assert out.logits.shape == (3, 7, V)
    assert out.loss is None and out.weights is None
    assert m(x, last_only=True).logits.shape == (3, 1, V)
    w = m(x, backend="reference", return_weights=True).weights
    assert len(w) == LAYERS and all(t.shape == (3, HEADS, 7, 7) for t in w)


def test_loss_is_cross_entropy_of_the_logits() -> None:
    m = model()
    x, y = tokens(2, 9, seed=1), tokens(2, 9, seed=2)
    out = m(x, y)
    # Independent: log-softmax by hand in float64, mean negative log-likelihood of the targets.
    logp = out.logits.double().log_softmax(-1)
    expected = -logp.gather(-1, y.unsqueeze(-1)).mean()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-6)
    ce = F.cross_entropy(out.logits.reshape(-1, V), y.reshape(-1))
    torch.testing.assert_close(out.loss, ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.logits, m(x).logits)  # targets do not change the logits


def test_loss_ignores_minus_100() -> None:
    m = model()
    x, y = tokens(2, 9, seed=1), tokens(2, 9, seed=2)
    y_masked = y.clone()
    y_masked[0, :4] = -100
    y_masked[1, 7:] = -100
    keep = y_masked != -100
    logits = m(x).logits.double()
    nll = -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (B, T)
    expected = nll[keep].mean()
    torch.testing.assert_close(m(x, y_masked).loss.double(), expected, rtol=1e-6, atol=1e-6)
    ce = F.cross_entropy(logits[keep], y[keep])
    torch.testing.assert_close(m(x, y_masked).loss.double(), ce, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(expected, nll.mean())  # the masked positions do matter


@pytest.mark.parametrize("positions", POSITIONS)
def test_backward_gives_finite_grads_everywhere(positions: str) -> None:
    m = model(positions=positions, n_kv_heads=2, bias=True).train()
    loss = m(tokens(2, 10), tokens(2, 10, seed=3)).loss
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_tied_embeddings_share_storage() -> None:
    tied = GPT(cfg(tie_embeddings=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    with torch.no_grad():
        tied.tok_emb.weight[3, 5] = 7.0
    assert tied.lm_head.weight[3, 5] == 7.0
    untied = GPT(cfg(tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    with torch.no_grad():
        untied.tok_emb.weight[3, 5] = 7.0
    assert untied.lm_head.weight[3, 5] != 7.0
    n_tied = sum(p.numel() for p in tied.parameters())  # parameters() yields a tied one once
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == V * DIM


# --------------------------------------------------------------------------- causality


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_no_future_leak(positions: str, n_kv_heads: int | None) -> None:
    m = model(positions=positions, n_kv_heads=n_kv_heads)
    T = 12
    x = tokens(2, T)
    base = m(x).logits
    for t in (0, 5, T - 2):
        x2 = x.clone()
        x2[:, t + 1 :] = (x2[:, t + 1 :] + 1 + torch.arange(T - t - 1)) % V  # change every later token
        out = m(x2).logits
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-4)  # later ones see it


# --------------------------------------------------------------------------- backends


@pytest.mark.parametrize("positions", POSITIONS)
def test_backends_agree(positions: str) -> None:
    m = model(positions=positions, n_kv_heads=2)
    x = tokens(2, 11)
    ref = m(x, backend="reference").logits
    for backend in ("sdpa", "chunked"):
        torch.testing.assert_close(m(x, backend=backend).logits, ref, rtol=1e-5, atol=1e-5)
        # The configured backend is used when forward is not told otherwise.
        m_cfg = model(positions=positions, n_kv_heads=2, backend=backend)
        torch.testing.assert_close(m_cfg(x).logits, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_cached_decoding_equals_full_forward(positions: str, n_kv_heads: int | None) -> None:
    m = model(positions=positions, n_kv_heads=n_kv_heads)
    T, P = 16, 5
    x = tokens(2, T)
    full = m(x).logits
    cache = m.make_cache(2)
    assert cache.k.shape == (LAYERS, 2, n_kv_heads or HEADS, CTX, DIM // HEADS)
    steps = [m(x[:, :P], cache=cache).logits]
    assert cache.pos == P
    for t in range(P, T):
        steps.append(m(x[:, t : t + 1], cache=cache).logits)
    assert cache.pos == T
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_cached_last_only() -> None:
    m = model(positions="rope")
    x = tokens(2, 8)
    cache = m.make_cache(2)
    out = m(x[:, :6], cache=cache, last_only=True).logits
    torch.testing.assert_close(out, m(x[:, :6]).logits[:, -1:], rtol=0, atol=1e-5)
    out = m(x[:, 6:], cache=cache, last_only=True).logits
    torch.testing.assert_close(out, m(x).logits[:, -1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("positions", POSITIONS)
def test_last_only_is_last_row(positions: str) -> None:
    m = model(positions=positions)
    x = tokens(3, 10)
    torch.testing.assert_close(m(x, last_only=True).logits, m(x).logits[:, -1:], rtol=0, atol=1e-6)


def test_exceeding_max_seq_len_raises() -> None:
    m = model()
    m(tokens(1, CTX))  # exactly the context is fine
    with pytest.raises(ValueError, match="max_seq_len"):
        m(tokens(1, CTX + 1))
    cache = m.make_cache(1)
    m(tokens(1, CTX - 1), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(tokens(1, 2), cache=cache)  # offset + T > context
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        m(torch.zeros(5, dtype=torch.long))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(dim=30, n_heads=4), "dim"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(n_heads=4, n_kv_heads=0), "n_kv_heads"),
        (dict(positions="absolute"), "positions"),
        (dict(backend="flash"), "backend"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layers=0), "n_layers"),
        (dict(max_seq_len=0), "max_seq_len"),
    ],
)
def test_config_validation_names_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cfg(**kw)


def test_config_derived_fields() -> None:
    c = cfg(n_kv_heads=None)
    assert c.resolved_head_dim == DIM // HEADS and c.resolved_kv_heads == HEADS
    c = cfg(dim=30, n_heads=4, head_dim=8, n_kv_heads=2)  # explicit head_dim lifts dim % heads
    assert c.resolved_head_dim == 8 and c.resolved_kv_heads == 2
    assert GPTConfig(**c.to_dict()) == c


def test_num_params_excludes_learned_positions_only() -> None:
    learned, rope = GPT(cfg(positions="learned")), GPT(cfg(positions="rope"))
    total = sum(p.numel() for p in learned.parameters())
    assert learned.num_params(non_embedding=False) == total
    assert learned.num_params() == total - CTX * DIM
    assert rope.num_params() == rope.num_params(non_embedding=False)


# --------------------------------------------------------------------------- overfit


def test_overfits_one_batch() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        m = GPT(cfg(max_seq_len=16, bias=False)).train()
        x = tokens(4, 16, seed=5)
        y = tokens(4, 16, seed=6)  # arbitrary targets: only memorisation can fit them
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
        t0 = time.perf_counter()
        first = loss = m(x, y).loss
        for _ in range(300):
            loss = m(x, y).loss
            if loss.item() < 0.05:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        assert first.item() > 3.5  # about ln(50) at init
        assert loss.item() < 0.05
        assert time.perf_counter() - t0 < 10
    finally:
        torch.set_num_threads(threads)
