"""Show, Attend and Tell pieces: soft attention is a distribution over locations and the
context is the weighted sum of the features; the REINFORCE estimator is unbiased on a
problem with a known gradient; hard attention reads exactly one location; both variants
train on a tiny batch."""

from __future__ import annotations

import pytest
import torch

from qkv.models.captioner import Captioner, CaptionerConfig, reinforce_surrogate
from qkv.tokenizers.vocab import BOS, EOS

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw) -> Captioner:
    torch.manual_seed(0)
    return Captioner(CaptionerConfig(vocab_size=12, image_size=32, width=8, emb_dim=16, hidden=32,
                                     attn_dim=16, **kw))


@pytest.mark.parametrize("scoring", ["additive", "dot"])
def test_soft_attention_is_a_weighted_average_of_the_grid(scoring: str) -> None:
    m = _model(scoring=scoring).eval()
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        m.pos.normal_()  # learned positions start at zero; make them count here
    state = m.start(images)
    assert state.features.shape == (3, 16, 32)  # 4x4 grid of 4*8 channels
    with torch.no_grad():  # the features are the CNN's grid, row-major, plus each cell's position
        grid = m.cnn(images).flatten(2).transpose(1, 2)
        torch.testing.assert_close(state.features, grid + m.pos)
    prev = torch.full((3,), BOS)
    alpha = m.attention_weights(state.h, state.features, state.keys)
    torch.testing.assert_close(alpha.sum(-1), torch.ones(3))
    assert (alpha >= 0).all()
    # the step's context is β Σ_i α_i a_i: recompute it by hand in float64 and compare logits
    logits, _, a, beta, loc = m.step(state, prev)
    assert loc is None
    torch.testing.assert_close(a, alpha)
    z = beta[:, None].double() * torch.einsum("bl,bld->bd", alpha.double(), state.features.double())
    e = m.emb(prev).double()
    h, _ = m.lstm(torch.cat([e, z], -1).float(), (state.h, state.c))
    want = m.out((e + m.out_h(h).double() + m.out_z(z.float()).double()).float())
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_hard_attention_reads_one_location() -> None:
    m = _model(attention="hard").eval()
    state = m.start(torch.randn(2, 3, 32, 32))
    _, _, alpha, _, loc = m.step(state, torch.full((2,), BOS))
    assert torch.equal(loc, alpha.argmax(-1))  # at test time: the most attended location
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(16)
    for _ in range(2000):
        _, _, a, _, loc = m.step(state, torch.full((2,), BOS), sample=True, generator=g)
        counts[loc[0]] += 1
    torch.testing.assert_close(counts / 2000, a[0].detach(), atol=0.04, rtol=0)  # samples follow α


def test_uniform_attention_reads_the_mean_of_the_grid() -> None:
    """The baseline: α = 1/L everywhere, so the context is the plain average of the features."""
    m = _model(attention="uniform").eval()
    state = m.start(torch.randn(2, 3, 32, 32))
    prev = torch.full((2,), BOS)
    logits, _, alpha, beta, loc = m.step(state, prev)
    torch.testing.assert_close(alpha, torch.full((2, 16), 1 / 16))
    z = beta[:, None] * state.features.mean(1)
    e = m.emb(prev)
    h, _ = m.lstm(torch.cat([e, z], -1), (state.h, state.c))
    torch.testing.assert_close(logits, m.out(e + m.out_h(h) + m.out_z(z)))
    assert loc is None
    # training: every parameter gets a gradient (DDP fails on unused ones)
    m.train()
    m(torch.randn(2, 3, 32, 32), torch.tensor([[BOS, 5, 6, EOS]] * 2)).loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_hard_attention_can_read_the_expected_value() -> None:
    """Xu et al. §4.1: a caption that reads the expected value Σ α_i a_i instead of a sampled
    location is exactly soft attention; with hard_expectation=1 every caption does."""
    hard = _model(attention="hard", hard_expectation=1.0).train()
    soft = _model(attention="soft", doubly_stochastic=0.0).train()
    soft.load_state_dict(hard.state_dict())
    images = torch.randn(4, 3, 32, 32)
    caps = torch.tensor([[BOS, 5, 6, 7, EOS]] * 4)
    torch.manual_seed(0)
    want = soft(images, caps)
    torch.manual_seed(0)
    got = hard(images, caps)
    torch.testing.assert_close(got.logits, want.logits)


@pytest.mark.parametrize("baseline", [0.0, 2.5])
def test_reinforce_is_unbiased_on_a_known_gradient(baseline: float) -> None:
    """Policy softmax(θ) over 4 actions, reward f: ∇θ E[f] = p ⊙ (f - p·f) exactly."""
    theta = torch.tensor([0.2, -0.5, 1.0, 0.1], dtype=torch.float64, requires_grad=True)
    f = torch.tensor([1.0, 3.0, -2.0, 0.5], dtype=torch.float64)
    p = torch.softmax(theta.detach(), 0)
    exact = p * (f - (p * f).sum())
    g = torch.Generator().manual_seed(0)
    a = torch.multinomial(p, 400_000, replacement=True, generator=g)
    loss = reinforce_surrogate(torch.log_softmax(theta, 0)[a], f[a], baseline)
    (grad,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(-grad, exact, atol=0.02, rtol=0)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_both_variants_learn_a_tiny_batch(attention: str) -> None:
    m = _model(attention=attention).train()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(6, 3, 32, 32, generator=g)
    words = torch.randint(4, 12, (6, 3), generator=g)
    caps = torch.cat([torch.full((6, 1), BOS), words, torch.full((6, 1), EOS)], 1)
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    first = None
    for _ in range(120):
        out = m(images, caps)
        nll = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), caps[:, 1:])
        first = first if first is not None else nll.item()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    # hard attention learns through sampled locations: noisier, so a looser bar
    assert nll.item() < (0.3 if attention == "soft" else 0.5) * first
    assert out.alphas.shape == (6, 4, 16) and out.betas.shape == (6, 4)
