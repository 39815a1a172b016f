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
    location; with hard_expectation=1 every caption does, and the training loss is the
    cross-entropy of the words read that way, step by step."""
    hard = _model(attention="hard", hard_expectation=1.0, entropy_bonus=0.0).train()
    images = torch.randn(4, 3, 32, 32)
    caps = torch.tensor([[BOS, 5, 6, 7, EOS]] * 4)
    torch.manual_seed(0)
    got = hard(images, caps)
    state = hard.start(images)  # training mode too: BatchNorm normalises this batch the same way
    every = torch.ones(4, dtype=torch.bool)
    logits = []
    for t in range(caps.shape[1] - 1):
        lg, state, _, _, _ = hard.step(state, caps[:, t], expect=every)
        logits.append(lg)
    want = torch.stack(logits, 1)
    torch.testing.assert_close(got.logits, want)
    ce = torch.nn.functional.cross_entropy(want.transpose(1, 2), caps[:, 1:])
    torch.testing.assert_close(got.loss, ce)


def _p_word_given_cell(m: Captioner, images: torch.Tensor, caps: torch.Tensor) -> tuple:
    """The hard model written out from its docstring in float64: α_t (B, T, L) and
    p(y_t | a_i) (B, T, L) for every cell i, from the model's own modules."""
    m = m.double().eval()
    with torch.no_grad():
        feats = m.encode(images.double())
        mean = feats.mean(1)
        h, c = torch.tanh(m.init_h(mean)), torch.tanh(m.init_c(mean))
        alphas, probs = [], []
        for t in range(caps.shape[1] - 1):
            alpha = m.attention_weights(h, feats, m.attn.project_keys(feats))
            beta = torch.sigmoid(m.gate(h))  # (B, 1)
            e = m.emb(caps[:, t])
            h, c = m.lstm(torch.cat([e, beta * mean], -1), (h, c))
            # (B, L, V): the word's logits had it read cell i
            per_cell = m.out(e[:, None] + m.out_h(h)[:, None] + m.out_z(beta[:, :, None] * feats))
            probs.append(per_cell.softmax(-1)[torch.arange(len(caps)), :, caps[:, t + 1]])
            alphas.append(alpha)
    return torch.stack(alphas, 1), torch.stack(probs, 1)


def test_exact_marginal_equals_the_enumerated_expectation() -> None:
    """hard-exact's loss is -log Σ_i α_ti p(y_t | a_i) per word; enumerating every sequence of
    locations (L^T of them) and averaging Π_t p(y_t | a_{s_t}) under Π_t α_{t,s_t} gives the
    same likelihood of the caption (float64, a 2x2 grid, 3 words)."""
    import itertools

    m = Captioner(CaptionerConfig(vocab_size=12, image_size=16, width=4, emb_dim=8, hidden=16,
                                  attn_dim=8, attention="hard-exact"))
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16)
    caps = torch.tensor([[BOS, 5, 6, 7, EOS], [BOS, 8, 4, 9, EOS]])[:, :4]  # 3 words each
    alpha, p = _p_word_given_cell(m, images, caps)
    B, T, L = alpha.shape
    assert L == 4
    enumerated = torch.zeros(B, dtype=torch.float64)
    for path in itertools.product(range(L), repeat=T):
        prob = torch.ones(B, dtype=torch.float64)
        for t, i in enumerate(path):
            prob = prob * alpha[:, t, i] * p[:, t, i]
        enumerated += prob
    m.eval()
    with torch.no_grad():
        loss = m(images.double(), caps).loss  # mean over the B*T words
    torch.testing.assert_close(loss, -enumerated.log().sum() / (B * T))


def test_hard_attention_reads_the_cell_or_the_expectation_when_decoding() -> None:
    m = _model(attention="hard").eval()
    state = m.start(torch.randn(2, 3, 32, 32))
    prev = torch.full((2,), BOS)
    lg_hard, _, alpha, beta, loc = m.step(state, prev, hard_decode="argmax")
    assert torch.equal(loc, alpha.argmax(-1))
    lg_soft, _, _, _, loc2 = m.step(state, prev, hard_decode="expectation")
    assert loc2 is None
    e = m.emb(prev)
    h, _ = m.lstm(torch.cat([e, beta[:, None] * state.features.mean(1)], -1), (state.h, state.c))
    for lg, z in ((lg_hard, state.features[torch.arange(2), loc]),
                  (lg_soft, torch.einsum("bl,bld->bd", alpha, state.features))):
        torch.testing.assert_close(lg, m.out(e + m.out_h(h) + m.out_z(beta[:, None] * z)))


def test_location_addressing_never_looks_at_the_cells() -> None:
    """Location-based: α = softmax(W h) over cell indices, so permuting the cells' content with
    the state fixed leaves α unchanged; content-based α follows the content."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(16, generator=g)
    for addressing in ("location", "content"):
        m = _model(addressing=addressing).eval()
        state = m.start(torch.randn(2, 3, 32, 32, generator=g))
        with torch.no_grad():
            a = m.attention_weights(state.h, state.features, state.keys)
            f = state.features[:, perm]
            keys = None if state.keys is None else state.keys[:, perm]
            b = m.attention_weights(state.h, f, keys)
        if addressing == "location":
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a, torch.softmax(m.locate(state.h), -1))
        else:
            torch.testing.assert_close(b, a[:, perm])  # the same scores, moved with the cells
            assert not torch.allclose(a, b)


def test_a_grid_of_another_size() -> None:
    """Content addressing scores any number of cells (without learned cell positions); location
    addressing, and learned positions, name why they cannot."""
    big = torch.randn(1, 3, 64, 64)  # an 8x8 grid for models trained on 4x4
    m = _model(positions=False).eval()
    with torch.no_grad():
        state = m.start(big)
        assert m.attention_weights(state.h, state.features, state.keys).shape == (1, 64)
    with pytest.raises(ValueError, match="location-based addressing outputs a distribution over the 16"):
        m = _model(addressing="location", positions=False).eval()
        state = m.start(big)
        m.step(state, torch.full((1,), BOS))
    with pytest.raises(ValueError, match="learned embedding to each of its 16 grid cells"):
        _model().start(big)


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


def test_leave_one_out_reinforce_is_unbiased_on_a_known_gradient() -> None:
    """K samples per draw, each against the mean reward of the other K-1 (it does not depend on
    that sample's action): the same exact gradient as above."""
    theta = torch.tensor([0.2, -0.5, 1.0, 0.1], dtype=torch.float64, requires_grad=True)
    f = torch.tensor([1.0, 3.0, -2.0, 0.5], dtype=torch.float64)
    p = torch.softmax(theta.detach(), 0)
    exact = p * (f - (p * f).sum())
    K = 4
    a = torch.multinomial(p, 100_000 * K, replacement=True,
                          generator=torch.Generator().manual_seed(0)).view(-1, K)
    r = f[a]
    loo = (r.sum(1, keepdim=True) - r) / (K - 1)
    loss = reinforce_surrogate(torch.log_softmax(theta, 0)[a], r, loo)
    (grad,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(-grad, exact, atol=0.02, rtol=0)


@pytest.mark.parametrize("attention", ["soft", "hard", "hard-exact"])
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
    assert nll.item() < (0.5 if attention == "hard" else 0.3) * first
    assert out.alphas.shape == (6, 4, 16) and out.betas.shape == (6, 4)


@pytest.mark.parametrize(("centred", "offset"), [(False, 0.0), (True, 3.5)])
@pytest.mark.parametrize("stage_convs", [1, 2])
def test_where_each_grid_feature_looks(centred: bool, offset: float, stage_convs: int) -> None:
    """The centre of a cell's receptive field, by hand: with 3x3 stride-2 convolutions (padding 1)
    output o reads inputs 2o-1..2o+1, so three stages centre cell (i, j) on pixel (8i, 8j), the
    cell's top-left corner; 4x4 ones read 2o-1..2o+2, centre 2o + 0.5, and three stages give
    8i + 3.5, the cell's centre. Measured as the centre of mass of |d feature / d pixel| of the
    linear convolution stack (weights all equal, so the field is symmetric about its centre)."""
    model = Captioner(CaptionerConfig(vocab_size=8, image_size=128, centred=centred, stage_convs=stage_convs))
    convs = torch.nn.Sequential(*[m for m in model.cnn if isinstance(m, torch.nn.Conv2d)]).double()
    for conv in convs:
        torch.nn.init.constant_(conv.weight, 1.0)
    x = torch.zeros(1, 3, 128, 128, dtype=torch.float64, requires_grad=True)
    i, j = 7, 8  # away from the borders, whose zero padding would pull the centre inwards
    convs(x)[0, :, i, j].sum().backward()
    g = x.grad.abs().sum((0, 1))
    rows, cols = torch.meshgrid(torch.arange(128.0, dtype=torch.float64),
                                torch.arange(128.0, dtype=torch.float64), indexing="ij")
    assert (g * rows).sum() / g.sum() == pytest.approx(8 * i + offset, abs=1e-9)
    assert (g * cols).sum() / g.sum() == pytest.approx(8 * j + offset, abs=1e-9)
