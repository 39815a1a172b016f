"""Show, Attend and Tell pieces: soft attention is a distribution over locations and the
context is the weighted sum of the features; the REINFORCE estimator is unbiased on a
problem with a known gradient, and it is the one the model's gradient is made of; hard
attention reads exactly one location; each read-out's loss equals the formula written out in
float64; checkpoints keep their names; both variants train on a tiny batch."""

from __future__ import annotations

import pytest
import torch

from qkv.models import captioner_readout
from qkv.models.captioner import Captioner, CaptionerConfig, reinforce_surrogate
from qkv.tokenizers.vocab import BOS, EOS, PAD

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


# ---------------------------------------------------------------------------- composition

_CAPS = torch.tensor([[BOS, 5, 6, 7, EOS], [BOS, 8, 4, EOS, PAD], [BOS, 9, EOS, PAD, PAD]])  # PAD ignored


def _additive_alpha(m: Captioner, h: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Bahdanau's α from the scorer's three matrices: softmax_i(w_vᵀ tanh(W_q h + W_k a_i))."""
    a = m.attn
    return torch.softmax(a.w_v(torch.tanh(a.w_q(h)[:, None] + a.w_k(feats))).squeeze(-1), -1)


@pytest.mark.parametrize(("kw", "names"), [
    ({}, ["pos", "baseline", "attn.w_q.weight", "attn.w_k.weight", "attn.w_k.bias", "attn.w_v.weight"]),
    ({"scoring": "dot"}, ["pos", "baseline", "query.weight"]),
    ({"addressing": "location", "hard_anneal": 5},
     ["pos", "baseline", "steps", "locate.weight", "locate.bias"]),
    ({"attention": "uniform", "positions": False}, ["baseline"]),
    ({"attention": "hard", "hard_baseline": "average"},
     ["pos", "baseline", "attn.w_q.weight", "attn.w_k.weight", "attn.w_k.bias", "attn.w_v.weight"]),
])
def test_checkpoint_names_stay_what_runs_saved(kw: dict, names: list[str]) -> None:
    """Runs saved before the scorers and read-outs became modules load as they are: the same
    state-dict keys in the same order (the read-out holds none)."""
    tail = ["gate.weight", "gate.bias", "emb.weight", "lstm.weight_ih", "lstm.weight_hh", "lstm.bias_ih",
            "lstm.bias_hh", "out_h.weight", "out_h.bias", "out_z.weight", "out.weight", "out.bias"]
    keys = [k for k in _model(**kw).state_dict() if not k.startswith("cnn.")]
    init = ["init_h.weight", "init_h.bias", "init_c.weight", "init_c.bias"]
    own = [n for n in names if "." not in n]  # the model's own parameter and buffers come first
    assert keys == own + init + [n for n in names if "." in n] + tail


def test_soft_loss_is_the_formula_in_float64() -> None:
    """The soft read-out's loss: the mean NLL of the real words with z_t = β_t Σ_i α_ti a_i, plus
    λ/L Σ_i (1 - Σ_t α_ti)² averaged over the captions (padding counts in neither)."""
    m = _model(doubly_stochastic=0.7).double().eval()
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        m.pos.normal_()
        got = m(images, _CAPS).loss
        feats = m.encode(images)
        mean = feats.mean(1)
        h, c = torch.tanh(m.init_h(mean)), torch.tanh(m.init_c(mean))
        nll, coverage = [], torch.zeros(3, 16, dtype=torch.float64)
        for t in range(_CAPS.shape[1] - 1):
            alpha = _additive_alpha(m, h, feats)
            z = torch.sigmoid(m.gate(h)) * torch.einsum("bl,bld->bd", alpha, feats)
            e = m.emb(_CAPS[:, t])
            h, c = m.lstm(torch.cat([e, z], -1), (h, c))
            logp = torch.log_softmax(m.out(e + m.out_h(h) + m.out_z(z)), -1)
            real = _CAPS[:, t + 1] != PAD
            nll += [-logp[b, _CAPS[b, t + 1]] for b in range(3) if real[b]]
            coverage += alpha * real[:, None]
        want = torch.stack(nll).mean() + 0.7 * ((1 - coverage) ** 2).sum(-1).mean() / 16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # the soft NLL is taken in float32


def test_uniform_attention_has_no_penalty() -> None:
    """Uniform attention reads as soft attention with α = 1/L, which no penalty could move: its
    loss is the plain NLL, even with doubly_stochastic set."""
    m = _model(attention="uniform", doubly_stochastic=1.0).eval()
    with torch.no_grad():
        out = m(torch.randn(3, 3, 32, 32), _CAPS)
    torch.testing.assert_close(out.alphas, torch.full((3, 4, 16), 1 / 16))
    nll = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), _CAPS[:, 1:], ignore_index=PAD)
    torch.testing.assert_close(out.loss, nll)


def test_hard_attention_evaluates_with_the_exact_likelihood() -> None:
    """Out of training a hard model's loss is hard-exact's: the same parameters (the same seed
    draws them in the same order) give the same loss, and no sample is drawn."""
    images = torch.randn(3, 3, 32, 32)
    hard, exact = _model(attention="hard").eval(), _model(attention="hard-exact").eval()
    with torch.no_grad():
        torch.manual_seed(5)
        a = hard(images, _CAPS)
        after = torch.rand(1)
        torch.manual_seed(5)
        b = exact(images, _CAPS)
        assert torch.equal(torch.rand(1), after)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("baseline", ["soft", "loo", "average"])
def test_reinforce_gradient_is_the_estimator_by_hand(baseline: str, monkeypatch) -> None:
    """Hard attention in training, every caption sampling (hard_expectation 0): α gets gradient
    only from REINFORCE and the entropy bonus. Written out in float64 from the locations the
    model drew: ∇ of -1/n Σ_bt (1/K) Σ_k (r_btk - b) log α_bt(s_btk) - λ/n Σ_bt H(α_bt), with
    r = log p(y_t | a_s) and b the soft path's log p(y_t | Σ α a), the mean of the other K-1
    rewards, or, per caption, R_bk = Σ_t r_btk against the moving average (which then moves)."""
    m = _model(attention="hard", hard_baseline=baseline, hard_expectation=0.0, entropy_bonus=0.05)
    m = m.double().train()
    with torch.no_grad():
        m.baseline.fill_(-4.0)
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    drawn, multinomial = [], torch.multinomial

    def spy(*args, **kwargs):
        drawn.append(multinomial(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(torch, "multinomial", spy)
    torch.manual_seed(0)
    m(images, _CAPS).loss.backward()
    got = [p.grad for p in m.attn.parameters()]
    assert len(drawn) == 4 and drawn[0].shape == (3, 4)

    feats = m.encode(images).detach()
    mean, rows, K = feats.mean(1), torch.arange(3), 4
    h, c = torch.tanh(m.init_h(mean)), torch.tanh(m.init_c(mean))
    valid = (_CAPS[:, 1:] != PAD).double()
    pg = entropy = R = log_p = 0.0
    for t, s in enumerate(drawn):
        alpha = _additive_alpha(m, h, feats)
        beta, e, y = torch.sigmoid(m.gate(h)), m.emb(_CAPS[:, t]), _CAPS[:, t + 1]
        h, c = m.lstm(torch.cat([e, beta * mean], -1), (h, c))

        def log_p_reading(z: torch.Tensor) -> torch.Tensor:  # log p(y | the word reads z (B, D))
            return torch.log_softmax(m.out(e + m.out_h(h) + m.out_z(beta * z)), -1)[rows, y]  # noqa: B023

        r = torch.stack([log_p_reading(feats[rows, s[:, k]]) for k in range(K)], 1).detach()  # (B, K)
        log_alpha_s = torch.log(alpha.gather(1, s))
        if baseline == "soft":
            b = log_p_reading(torch.einsum("bl,bld->bd", alpha, feats)).detach()[:, None]
        else:
            b = (r.sum(1, keepdim=True) - r) / (K - 1)
        if baseline == "average":
            R, log_p = R + valid[:, t, None] * r, log_p + valid[:, t, None] * log_alpha_s
        else:
            pg = pg + (valid[:, t] * ((r - b) * log_alpha_s).mean(1)).sum()
        entropy = entropy + (valid[:, t] * -(alpha * alpha.log()).sum(-1)).sum()
    if baseline == "average":
        pg = ((R - (-4.0)) * log_p).mean(1).sum()
    n = valid.sum()
    want = torch.autograd.grad(-pg / n - 0.05 * entropy / n, list(m.attn.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    moved = 0.9 * -4.0 + 0.1 * R.mean() if baseline == "average" else -4.0
    assert float(m.baseline) == pytest.approx(float(moved), rel=1e-12)


@pytest.mark.parametrize("baseline", ["soft", "loo", "average"])
def test_the_model_learns_alpha_through_reinforce_surrogate(baseline: str, monkeypatch) -> None:
    """The surrogate the tests above prove unbiased is the one the model calls: scaling what it
    returns scales the REINFORCE part of the gradient that reaches the scorer (the rest comes
    from the captions that read Σ α a); it is called once per word, or once per caption."""
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    grads = []
    calls = []
    original = captioner_readout.reinforce_surrogate
    for scale in (0.0, 1.0, 3.0):
        def scaled(*args, scale=scale, **kwargs):
            calls.append(kwargs)
            return scale * original(*args, **kwargs)

        monkeypatch.setattr(captioner_readout, "reinforce_surrogate", scaled)
        m = _model(attention="hard", hard_baseline=baseline, hard_expectation=0.5, entropy_bonus=0.0).train()
        torch.manual_seed(0)
        m(images, _CAPS).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.attn.parameters()]))
    assert len(calls) == 3 * (1 if baseline == "average" else 4)
    assert all(c["dim"] == 1 and c["mask"] is not None for c in calls)  # the expected-value rows out
    reinforce = grads[1] - grads[0]
    assert reinforce.abs().max() > 1e-4
    torch.testing.assert_close(grads[2] - grads[0], 3 * reinforce, rtol=1e-4, atol=1e-7)


def test_reinforce_surrogate_per_row_with_a_mask() -> None:
    """``dim``: one term -mean_k (r - b) log p per row; ``mask``: rows left out give 0 and no
    gradient; without either, the mean over everything (the rows' mean when none is masked)."""
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    r, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
    rows = reinforce_surrogate(logp, r, b, dim=1)
    torch.testing.assert_close(rows, -((r - b) * logp).mean(1))
    torch.testing.assert_close(rows.mean(), reinforce_surrogate(logp, r, b))
    keep = torch.tensor([True, False, True])
    masked = reinforce_surrogate(logp, r, b, dim=1, mask=keep)
    assert masked[1] == 0 and torch.equal(masked[keep], rows[keep])
    (grad,) = torch.autograd.grad(masked.sum(), logp)
    assert (grad[1] == 0).all()
    torch.testing.assert_close(grad[keep], -(r - b)[keep] / 4)


def test_forward_changes_only_the_running_statistics() -> None:
    """Evaluation changes no buffer. Training changes BatchNorm's statistics and, for a hard
    model, ``steps`` (one per forward: the annealed expected-value share) and, with the
    average baseline, ``baseline`` (the moving average of the reward); a soft model neither.
    With hard_anneal 1 the first training forward reads Σ α a everywhere, the second samples."""
    images = torch.randn(3, 3, 32, 32)
    for kw, moves in (({}, set()), ({"attention": "hard", "hard_baseline": "soft"}, {"steps"}),
                      ({"attention": "hard", "hard_baseline": "average"}, {"steps", "baseline"})):
        m = _model(hard_anneal=1, **kw)
        before = {k: v.clone() for k, v in m.named_buffers()}
        with torch.no_grad():
            m.eval()(images, _CAPS)
        assert all(torch.equal(v, before[k]) for k, v in m.named_buffers())
        m.train()(images, _CAPS)
        m(images, _CAPS)
        changed = {k for k, v in m.named_buffers()
                   if not torch.equal(v, before[k]) and not k.startswith("cnn.")}
        assert changed == moves, kw
        assert int(m.steps) == (2 if "steps" in moves else 0)


def test_hard_decoding_mode_is_an_argument() -> None:
    """How a hard model reads the grid when decoding is an argument of every call, never model
    state: decode_captions with each mode gives the greedy loop over ``step(hard_decode=...)``
    (the most likely word that may appear, up to EOS) with its attention, the two modes differ,
    and a mode that does not exist says so."""
    from qkv.pipelines.captioning import decode_captions, normalize

    m = _model(attention="hard").eval()
    with torch.no_grad():  # untrained, it would say EOS at once: make what it reads count
        m.out_z.weight.normal_(0, 2)
        m.out.bias[EOS] = -1.0
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(4))
    logits, captions = {}, {}
    for mode in ("argmax", "expectation"):
        toks, alphas = decode_captions(m, images, 5, hard_decode=mode)
        with torch.no_grad():
            state, prev = m.start(normalize(images)), torch.full((4,), BOS)
            want, seen, first = [[] for _ in range(4)], [[] for _ in range(4)], None
            for _ in range(6):
                step = m.step(state, prev, hard_decode=mode)
                first = step.logits if first is None else first
                prev = step.logits.index_fill(1, torch.tensor([PAD, BOS, 3]), float("-inf")).argmax(-1)
                for b in range(4):
                    if EOS not in want[b]:
                        want[b].append(int(prev[b]))
                        seen[b].append(step.alpha[b])
                state = step.state
        assert toks == [w[: w.index(EOS)] if EOS in w else w for w in want]
        for b in range(4):
            torch.testing.assert_close(alphas[b], torch.stack(seen[b])[: len(toks[b])])
        logits[mode], captions[mode] = first, toks
    assert not torch.allclose(logits["argmax"], logits["expectation"])
    assert captions["argmax"] != captions["expectation"] and min(map(len, captions["argmax"])) >= 3
    assert not hasattr(m, "hard_decode")
    with pytest.raises(ValueError, match="argmax or expectation, got 'mean'"):
        m.step(m.start(normalize(images)), torch.full((4,), BOS), hard_decode="mean")


def test_config_names_the_choices() -> None:
    """A Literal field is checked against its own choices; ranges name the bound."""
    with pytest.raises(ValueError, match="attention must be soft, hard, hard-exact or uniform, got 'sofft'"):
        CaptionerConfig(attention="sofft")
    with pytest.raises(ValueError, match="hard_baseline must be soft, loo or average, got 'mean'"):
        CaptionerConfig(hard_baseline="mean")
    with pytest.raises(ValueError, match="hard_samples must be >= 2 with hard_baseline loo, got 1"):
        CaptionerConfig(hard_baseline="loo", hard_samples=1)
    with pytest.raises(ValueError, match=r"word_dropout must be in \[0, 1\), got 1"):
        CaptionerConfig(word_dropout=1)
    with pytest.raises(ValueError, match=r"stage_convs must be in \[1, 3\], got 4"):
        CaptionerConfig(stage_convs=4)
    with pytest.raises(ValueError, match="hard_anneal must be >= 0, got -1"):
        CaptionerConfig(hard_anneal=-1)


def test_label_smoothing_matches_torch_and_the_formula() -> None:
    """smoothed_nll against PyTorch's own label-smoothed cross entropy, and by hand in float64:
    -(1 - ε) log p(y) - ε/V Σ_v log p(v)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, dtype=torch.float64, generator=g)
    y = torch.randint(0, 7, (5,), generator=g)
    lp = logits.log_softmax(-1)
    got = captioner_readout.smoothed_nll(lp, y, 0.2)
    want = torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.2, reduction="none")
    torch.testing.assert_close(got, want)
    by_hand = torch.stack([-(0.8 * lp[b, y[b]] + 0.2 / 7 * lp[b].sum()) for b in range(5)])
    torch.testing.assert_close(got, by_hand)
    assert torch.equal(captioner_readout.smoothed_nll(lp, y, 0.0), -lp.gather(1, y[:, None]).squeeze(1))


def test_soft_loss_with_label_smoothing_is_torch_cross_entropy() -> None:
    """Soft attention with ε: the loss is PyTorch's label-smoothed cross entropy of the same
    logits over the real words (padding ignored)."""
    m = _model(label_smoothing=0.1, doubly_stochastic=0.0).eval()
    with torch.no_grad():
        out = m(torch.randn(3, 3, 32, 32), _CAPS)
    want = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), _CAPS[:, 1:], ignore_index=PAD,
                                             label_smoothing=0.1)
    torch.testing.assert_close(out.loss, want)


def test_hard_exact_label_smoothing_smooths_the_marginal() -> None:
    """Hard-exact with ε smooths the word's marginal p(v) = Σ_i α_i p(v | a_i), enumerated here
    by hand in float64 from the model's own pieces; ε = 0 keeps the exact NLL bit for bit."""
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    plain = _model(attention="hard-exact").double().eval()
    smooth = _model(attention="hard-exact", label_smoothing=0.3).double().eval()
    with torch.no_grad():
        base = plain(images, _CAPS).loss
        got = smooth(images, _CAPS).loss
        feats = smooth.encode(images)
        mean = feats.mean(1)
        h, c = torch.tanh(smooth.init_h(mean)), torch.tanh(smooth.init_c(mean))
        terms, plain_terms = [], []
        for t in range(_CAPS.shape[1] - 1):
            alpha = _additive_alpha(smooth, h, feats)
            beta = torch.sigmoid(smooth.gate(h))
            e = smooth.emb(_CAPS[:, t])
            h, c = smooth.lstm(torch.cat([e, beta * mean], -1), (h, c))
            per_cell = torch.softmax(smooth.out((e + smooth.out_h(h))[:, None] + beta[:, None]
                                                * smooth.out_z(feats)), -1)  # (B, L, V)
            marginal = torch.log(torch.einsum("bl,blv->bv", alpha, per_cell))
            for b in range(3):
                y = _CAPS[b, t + 1]
                if y != PAD:
                    terms.append(-(0.7 * marginal[b, y] + 0.3 * marginal[b].mean()))
                    plain_terms.append(-marginal[b, y])
    torch.testing.assert_close(got, torch.stack(terms).mean())
    torch.testing.assert_close(base, torch.stack(plain_terms).mean())


def test_label_smoothing_is_checked() -> None:
    with pytest.raises(ValueError, match="label_smoothing"):
        CaptionerConfig(label_smoothing=1.0)


def test_unread_words_are_fed_back_as_unk() -> None:
    """With unread_words, the decoder reads those previous words as UNK, in teacher forcing and
    in step-by-step decoding alike: captions that differ only in them give the same outputs,
    while the same captions differ for a model that reads them back."""
    from qkv.models.captioner import UNK

    images = torch.randn(3, 3, 32, 32)
    caps = _CAPS.clone()
    other = caps.clone()
    other[0, 1], other[1, 1] = 10, 11  # another name in place of word 5 and word 8
    blind = _model(unread_words=[5, 8, 10, 11]).eval()
    seeing = _model().eval()
    with torch.no_grad():
        a, b = blind(images, caps), blind(images, other)
        torch.testing.assert_close(a.logits[:, 1:], b.logits[:, 1:])
        unk = caps.clone()
        unk[0, 1], unk[1, 1] = UNK, UNK
        torch.testing.assert_close(a.logits, blind(images, unk).logits)
        s, t = seeing(images, caps), seeing(images, other)
        assert not torch.allclose(s.logits[:, 1:], t.logits[:, 1:])
        state = blind.start(images)
        one = blind.step(state, torch.tensor([5, 8, 9])).logits
        two = blind.step(state, torch.tensor([UNK, UNK, 9])).logits
        torch.testing.assert_close(one, two)


def test_the_family_names_the_colour_and_shape_words() -> None:
    from qkv.data.shapes import COLOURS, SHAPES
    from qkv.families.captioner import names_in
    from qkv.tokenizers.vocab import WordVocab

    vocab = WordVocab.build(["a small red circle above a large blue square", "a white triangle"])
    ids = names_in(vocab)
    want = ["red", "circle", "blue", "square", "white", "triangle"]
    assert sorted(vocab.itos[i] for i in ids) == sorted(want)
    assert all(vocab.itos[i] in (*COLOURS, *SHAPES) for i in ids)


def test_split_encoder_shape_features_are_colour_blind_and_colour_features_shape_blind() -> None:
    """encoder="split": the CNN's channels depend on the image only through max over its colour
    channels (so permuting R, G, B, which keeps that max, leaves them unchanged, while the joint
    CNN's change); the colour stream's depend on each cell's pixels only as a set (shuffling the
    pixels inside every 8x8 cell leaves them unchanged)."""
    split = _model(encoder="split").eval()
    joint = _model().eval()
    assert split.cfg.feature_dim == 4 * 8 + 8
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        f = split.encode(x)
        assert f.shape == (2, 16, 40)
        perm = split.encode(x[:, [2, 0, 1]])
        torch.testing.assert_close(perm[..., :32], f[..., :32], rtol=0, atol=0)
        assert (perm[..., 32:] - f[..., 32:]).abs().max() > 1e-3  # the colours did change
        assert (joint.encode(x[:, [2, 0, 1]]) - joint.encode(x)).abs().max() > 1e-3
        # shuffle the 64 pixels of every 8x8 cell (the same permutation in every cell and channel)
        idx = torch.randperm(64, generator=torch.Generator().manual_seed(0))
        cells = x.reshape(2, 3, 4, 8, 4, 8).permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 4, 4, 64)[..., idx]
        shuffled = cells.reshape(2, 3, 4, 4, 8, 8).permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 32, 32)
        assert not torch.equal(shuffled, x)
        torch.testing.assert_close(split.encode(shuffled)[..., 32:], f[..., 32:], rtol=0, atol=0)
