"""Show, Attend and Tell: a CNN turns the image into a grid of feature vectors, an LSTM writes
the caption, and at every word it attends over the grid (Xu et al. 2015).

    features  a_1..a_L = CNN(image)                    (B, L, D), L = grid cells
    h_0, c_0  = tanh(W_h mean(a)), tanh(W_c mean(a))
    word t    e_ti = score(h_{t-1}, a_i)                 content-based: additive (Bahdanau) or
                                                         scaled dot product of h with each cell
              (location-based: e_t = W h_{t-1}, one score per cell index, never looking at a_i)
              α_t = softmax(e_t)                         over the L locations
              soft:  z_t = β_t Σ_i α_ti a_i,   β_t = σ(w_β·h_{t-1})   (the paper's gating scalar)
                     h_t, c_t = LSTM([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
                     p(y_t) = softmax(L_o (E y_{t-1} + L_h h_t + L_z z_t))   (deep output, linear)
              uniform (the baseline): α_ti = 1/L, otherwise as soft
              hard:  s_t ~ Categorical(α_t) in training (argmax at test), the word reads one cell:
                     h_t, c_t = LSTM([E y_{t-1}; β_t mean_i a_i], ...)
                     p(y_t | s_t) = softmax(L_o (E y_{t-1} + L_h h_t + L_z β_t a_{s_t}))

Soft attention's loss adds the doubly stochastic penalty λ Σ_i (1 - Σ_t α_ti)²: every
location should get attention about once over the caption.

Hard attention: the sampled location is a latent variable of the word it emits (Deng et al.
2018, "Latent Alignment and Variational Attention"): it feeds that word's output, while the
LSTM reads what every location has in common (their mean), so a location changes one word's
probability and nothing after it. Then (a) the exact likelihood is tractable,
p(y_t) = Σ_i α_ti p(y_t | a_i), L output layers per word (``attention="hard-exact"``, zero
variance: the reference REINFORCE must approach), and (b) REINFORCE needs only a per-word
reward r_t = log p(y_t | a_{s_t}) (:func:`reinforce_surrogate`), with a baseline that does not
depend on s_t: ``hard_baseline="soft"`` is the soft path's log p(y_t | Σ_i α_ti a_i) (Deng et
al.'s control variate), ``"loo"`` the mean reward of the other ``hard_samples`` samples of the
same word (leave-one-out), ``"average"`` a moving average of the caption's reward with the
paper's sequence-level reward (Xu et al. 2015, §4.1). An entropy bonus keeps α from collapsing
early; a share of the captions reads the expected value Σ_i α_ti a_i instead of a location
(Xu et al. §4.1: ``hard_expectation``), annealed from 1 to 0 over ``hard_anneal`` steps when
that is set (a warm start from soft attention).

Lectures: CS189 Lec 21 (image captioning with soft attention), CS231N Lec 8.
Shapes: B batch, T caption length, L = g·g locations, D feature width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.additive import AdditiveAttention
from qkv.attention.functional import softmax
from qkv.tokenizers.vocab import EOS, PAD, UNK


def reinforce_surrogate(log_prob: Tensor, reward: Tensor, baseline: float | Tensor = 0.0) -> Tensor:
    """A loss whose gradient is the REINFORCE estimate of -∇ E[reward]:

        -(reward - baseline) · ∇ log p(action)        (Williams 1992)

    log_prob: log-probabilities of the sampled actions (any shape, summed over the last dims by
    the caller); reward: same leading shape, treated as a constant. A baseline that does not
    depend on the action leaves the estimate unbiased and lowers its variance.
    """
    return -((reward - baseline).detach() * log_prob).mean()


@dataclass
class CaptionerConfig:
    """Everything needed to rebuild a captioner (saved in a run's config.json)."""

    vocab_size: int = 0  # set from the captions
    image_size: int = 64  # input images are image_size x image_size
    channels: int = 3  # 3 (RGB) or 1
    width: int = 32  # CNN channels of the first stage (doubled at each of 3 stride-2 stages)
    emb_dim: int = 64  # word embedding width
    hidden: int = 256  # LSTM width
    attn_dim: int = 128  # additive attention's scoring width
    # soft: weighted average; hard: one sampled location per word (REINFORCE); hard-exact: the exact
    # sum over locations; uniform: the plain average of the grid (the baseline)
    attention: Literal["soft", "hard", "hard-exact", "uniform"] = "soft"  # average/sampled cell/exact/mean
    # content: score each cell's features against the state; location: one score per cell index
    addressing: Literal["content", "location"] = "content"  # content (any grid) or location (fixed L)
    scoring: Literal["additive", "dot"] = "additive"  # Bahdanau MLP or scaled dot product
    doubly_stochastic: float = 1.0  # λ of Σ_i (1 - Σ_t α_ti)² (soft attention)
    entropy_bonus: float = 0.01  # hard attention: weight of the attention's entropy
    baseline_decay: float = 0.9  # hard attention, hard_baseline average: decay of the moving average
    hard_baseline: Literal["soft", "loo", "average"] = "soft"  # REINFORCE baseline: soft path, loo, caption
    hard_samples: int = 4  # hard attention: locations sampled per word (loo needs >= 2)
    # Xu et al. 2015, §4.1: some captions read the expected value Σ α_i a_i instead of a location
    hard_expectation: float = 0.5  # hard attention, training: share of captions reading Σ α_i a_i
    hard_anneal: int = 0  # hard attention: steps over which that share falls from 1 to 0 (0 = fixed)
    dropout: float = 0.0  # dropout on the deep output
    word_dropout: float = 0.0  # training: share of input words replaced by UNK (leans on the image)
    stage_convs: int = 2  # 3x3 convolutions per CNN stage (fewer: smaller receptive field)
    positions: bool = True  # add a learned embedding of each grid cell to its features (where)
    # 3x3 stride-2 convolutions centre cell (i, j)'s feature on pixel (8i, 8j), the cell's corner;
    # 4x4 ones (padding 1) on its centre (8i + 3.5, 8j + 3.5), where attention maps draw it
    centred: bool = False  # 4x4 stride-2 convolutions: each feature centred on its grid cell

    def __post_init__(self) -> None:
        if self.attention not in ("soft", "hard", "hard-exact", "uniform"):
            raise ValueError(f"attention must be soft, hard, hard-exact or uniform, got {self.attention!r}")
        if self.addressing not in ("content", "location"):
            raise ValueError(f"addressing must be content or location, got {self.addressing!r}")
        if self.hard_baseline not in ("soft", "loo", "average"):
            raise ValueError(f"hard_baseline must be soft, loo or average, got {self.hard_baseline!r}")
        if self.hard_samples < (2 if self.hard_baseline == "loo" else 1):
            raise ValueError(f"hard_samples must be >= {2 if self.hard_baseline == 'loo' else 1} with "
                             f"hard_baseline {self.hard_baseline}, got {self.hard_samples}")
        if self.hard_anneal < 0:
            raise ValueError(f"hard_anneal must be >= 0, got {self.hard_anneal}")
        if self.scoring not in ("additive", "dot"):
            raise ValueError(f"scoring must be additive or dot, got {self.scoring!r}")
        if not 0 <= self.hard_expectation <= 1:
            raise ValueError(f"hard_expectation must be in [0, 1], got {self.hard_expectation}")
        if not 0 <= self.word_dropout < 1:
            raise ValueError(f"word_dropout must be in [0, 1), got {self.word_dropout}")
        if self.stage_convs not in (1, 2, 3):
            raise ValueError(f"stage_convs must be 1, 2 or 3, got {self.stage_convs}")
        if self.image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 (three stride-2 stages), got "
                             f"{self.image_size}")

    @property
    def grid(self) -> int:
        return self.image_size // 8

    @property
    def feature_dim(self) -> int:
        return 4 * self.width


class CaptionerOutput(NamedTuple):
    """logits (B, T, V); loss; attention α (B, T, L); gates β (B, T)."""

    logits: Tensor
    loss: Tensor | None
    alphas: Tensor
    betas: Tensor


class CaptionerState(NamedTuple):
    h: Tensor
    c: Tensor
    features: Tensor
    keys: Tensor | None


HARD = ("hard", "hard-exact")


class Captioner(nn.Module):
    """CNN encoder + LSTM decoder with soft, hard or uniform attention over the CNN's grid.

    ``hard_decode`` (an attribute, not saved): how a hard model reads the grid when it is not
    sampling: ``"argmax"``, the most attended cell (truly hard), or ``"expectation"``, Σ α_i a_i.
    """

    def __init__(self, cfg: CaptionerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w, D = cfg.width, cfg.feature_dim
        self.hard_decode: Literal["argmax", "expectation"] = "argmax"

        def stage(cin: int, cout: int) -> list[nn.Module]:
            layers: list[nn.Module] = []
            for k in range(cfg.stage_convs):
                size = 4 if k == 0 and cfg.centred else 3  # 4: stride 2 centred on the cell
                layers += [nn.Conv2d(cin if k == 0 else cout, cout, size, stride=2 if k == 0 else 1,
                                     padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            return layers

        self.cnn = nn.Sequential(*stage(cfg.channels, w), *stage(w, 2 * w), *stage(2 * w, D))
        self.pos = nn.Parameter(torch.zeros(cfg.grid * cfg.grid, D)) if cfg.positions else None
        self.init_h = nn.Linear(D, cfg.hidden)
        self.init_c = nn.Linear(D, cfg.hidden)
        if cfg.attention == "uniform":
            pass  # nothing scores the cells (and DDP wants no unused parameters)
        elif cfg.addressing == "location":
            self.locate = nn.Linear(cfg.hidden, cfg.grid * cfg.grid)  # one score per cell index
        elif cfg.scoring == "additive":
            self.attn = AdditiveAttention(cfg.hidden, D, cfg.attn_dim)
        else:
            self.query = nn.Linear(cfg.hidden, D, bias=False)
        self.gate = nn.Linear(cfg.hidden, 1)
        self.emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=PAD)
        self.lstm = nn.LSTMCell(cfg.emb_dim + D, cfg.hidden)
        self.out_h = nn.Linear(cfg.hidden, cfg.emb_dim)
        self.out_z = nn.Linear(D, cfg.emb_dim, bias=False)
        self.out = nn.Linear(cfg.emb_dim, cfg.vocab_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.register_buffer("baseline", torch.zeros(()))
        if cfg.hard_anneal:
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # training forwards

    # ------------------------------------------------------------------ pieces

    def encode(self, images: Tensor) -> Tensor:
        """(B, C, H, W) normalised images -> features (B, L, D), row-major over the grid."""
        f = self.cnn(images).flatten(2).transpose(1, 2)  # (B, D, g, g) -> (B, L, D)
        if self.pos is None:
            return f
        if f.shape[1] != self.pos.shape[0]:
            raise ValueError(f"this captioner adds a learned embedding to each of its {self.pos.shape[0]} "
                             f"grid cells; a {images.shape[-1]}x{images.shape[-2]} image has {f.shape[1]}: "
                             f"give {self.cfg.image_size}x{self.cfg.image_size} images (or train with "
                             "--positions false)")
        return f + self.pos

    def start(self, images: Tensor) -> CaptionerState:
        feats = self.encode(images)
        mean = feats.mean(1)
        scored = (self.cfg.attention != "uniform" and self.cfg.addressing == "content"
                  and self.cfg.scoring == "additive")
        keys = self.attn.project_keys(feats) if scored else None
        return CaptionerState(torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean)), feats, keys)

    def attention_weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        """α (B, L): softmax over locations of the scores of h against every feature vector
        (content-based), or of h mapped to one score per cell index (location-based)."""
        if self.cfg.attention == "uniform":
            return feats.new_full(feats.shape[:2], 1.0 / feats.shape[1])
        if self.cfg.addressing == "location":
            L = self.locate.out_features
            if feats.shape[1] != L:
                raise ValueError(f"location-based addressing outputs a distribution over the {L} cells "
                                 f"it was trained on and cannot address {feats.shape[1]}; give "
                                 f"{self.cfg.image_size}x{self.cfg.image_size} images (content-based "
                                 "addressing scores any number of cells)")
            return softmax(self.locate(h), dim=-1)
        if self.cfg.scoring == "additive":
            return self.attn(h, feats, projected_keys=keys).weights
        q = self.query(h)  # (B, D)
        scores = (feats @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(feats.shape[-1])
        return softmax(scores, dim=-1)

    def step(self, state: CaptionerState, prev: Tensor, sample: bool = False,
             generator: torch.Generator | None = None, expect: Tensor | None = None):
        """One word: (state, previous tokens (B,)) -> (logits (B, V), new state, α (B, L), β (B,),
        the location read (B,), or None where the word read Σ α_i a_i). Hard attention:
        ``sample`` draws the location from α (else :attr:`hard_decode`); ``expect`` (B,) bool
        marks rows that read the expected value Σ α_i a_i instead."""
        h, c, feats, keys = state
        alpha = self.attention_weights(h, feats, keys)
        beta = torch.sigmoid(self.gate(h)).squeeze(-1)
        e = self.emb(prev)
        expected = (alpha.unsqueeze(1) @ feats).squeeze(1)  # Σ_i α_i a_i
        loc = None
        if self.cfg.attention in HARD:
            h, c = self.lstm(torch.cat([e, beta.unsqueeze(-1) * feats.mean(1)], dim=-1), (h, c))
            if sample:
                loc = torch.multinomial(alpha, 1, generator=generator).squeeze(-1)
            elif self.hard_decode == "argmax":
                loc = alpha.argmax(-1)
            z = expected if loc is None else feats[torch.arange(len(feats)), loc]
            if expect is not None:
                z = torch.where(expect[:, None], expected, z)
            z = beta.unsqueeze(-1) * z
        else:
            z = beta.unsqueeze(-1) * expected
            h, c = self.lstm(torch.cat([e, z], dim=-1), (h, c))
        logits = self.out(self.drop(e + self.out_h(h) + self.out_z(z)))  # linear, as in the paper
        return logits, CaptionerState(h, c, feats, keys), alpha, beta, loc

    # ------------------------------------------------------------------ training

    def _expectation_rows(self, n: int, device: torch.device) -> Tensor | None:
        """Hard attention, training: which captions read Σ α_i a_i (the share, annealed)."""
        cfg = self.cfg
        share = cfg.hard_expectation
        if cfg.hard_anneal:
            share = max(0.0, 1.0 - float(self.steps) / cfg.hard_anneal)
            self.steps += 1
        return torch.rand(n, device=device) < share if share > 0 else None

    def forward(self, images: Tensor, captions: Tensor) -> CaptionerOutput:
        """Teacher forcing. captions (B, T+1) = [BOS, words..., EOS, PAD...]."""
        cfg = self.cfg
        inp, tgt = captions[:, :-1], captions[:, 1:]
        if self.training and cfg.word_dropout > 0:  # BOS and PAD stay; other words become UNK
            drop = (torch.rand(inp.shape, device=inp.device) < cfg.word_dropout) & (inp > EOS)
            inp = inp.masked_fill(drop, UNK)
        if cfg.attention in HARD:
            return self._forward_hard(images, inp, tgt)
        state = self.start(images)
        logits, alphas, betas = [], [], []
        for t in range(inp.shape[1]):
            lg, state, a, b, _ = self.step(state, inp[:, t])
            logits.append(lg)
            alphas.append(a)
            betas.append(b)
        out = torch.stack(logits, 1)
        A = torch.stack(alphas, 1)  # (B, T, L)
        valid = (tgt != PAD).float()  # (B, T)
        nll = F.cross_entropy(out.float().transpose(1, 2), tgt, ignore_index=PAD, reduction="none")
        loss = (nll * valid).sum() / valid.sum().clamp_min(1)
        if cfg.attention == "soft" and cfg.doubly_stochastic > 0:
            coverage = (A * valid.unsqueeze(-1)).sum(1)  # (B, L): Σ_t α_ti over real words
            loss = loss + cfg.doubly_stochastic * ((1 - coverage) ** 2).sum(-1).mean() / A.shape[-1]
        return CaptionerOutput(out, loss, A, torch.stack(betas, 1))

    def _forward_hard(self, images: Tensor, inp: Tensor, tgt: Tensor) -> CaptionerOutput:
        """Hard attention's loss (see the module docstring). In eval mode, and always for
        hard-exact: the exact negative log-likelihood -log Σ_i α_ti p(y_t | a_i). Training with
        REINFORCE: each word's ``hard_samples`` sampled locations are scored by
        log p(y_t | a_s) (the decoder learns from them), and α by REINFORCE against the
        chosen baseline; rows in the expected-value share learn through Σ α_i a_i instead.
        ``logits`` are the expected-context path's."""
        cfg = self.cfg
        state = self.start(images)
        feats = state.features
        fp = torch.promote_types(feats.dtype, torch.float32)  # fp32 under bf16 autocast; float64 stays
        B, L, _ = feats.shape
        Z = self.out_z(feats)  # (B, L, E): the output's view of each cell (linear: β factors out)
        mean = feats.mean(1)
        reinforce = self.training and cfg.attention == "hard"
        expect = self._expectation_rows(B, images.device) if reinforce else None
        h, c = state.h, state.c
        rows = torch.arange(B, device=images.device)
        logits, alphas, betas, nlls, pg, ent, seq_r, seq_logp = [], [], [], [], [], [], [], []
        for t in range(inp.shape[1]):
            alpha = self.attention_weights(h, feats, state.keys)
            beta = torch.sigmoid(self.gate(h)).squeeze(-1)
            e = self.emb(inp[:, t])
            h, c = self.lstm(torch.cat([e, beta.unsqueeze(-1) * mean], dim=-1), (h, c))
            base = e + self.out_h(h)  # (B, E)
            soft = self.out(self.drop(base + beta.unsqueeze(-1) * (alpha.unsqueeze(1) @ Z).squeeze(1)))
            y = tgt[:, t]
            soft_lp = soft.to(fp).log_softmax(-1).gather(1, y[:, None]).squeeze(1)  # log p(y | Σ α a)
            log_alpha = torch.log(alpha.to(fp).clamp_min(1e-12))
            if not reinforce:  # exact marginal over the L cells
                every = self.out(self.drop(base.unsqueeze(1) + beta[:, None, None] * Z))  # (B, L, V)
                lp = every.to(fp).log_softmax(-1).gather(2, y[:, None, None].expand(B, L, 1)).squeeze(2)
                nll = -torch.logsumexp(log_alpha + lp, dim=-1)
            else:
                s = torch.multinomial(alpha.detach().to(fp), cfg.hard_samples, replacement=True)  # (B, K)
                zk = beta[:, None, None] * Z[rows[:, None], s]  # (B, K, E)
                lk = self.out(self.drop(base.unsqueeze(1) + zk)).to(fp).log_softmax(-1)
                lk = lk.gather(2, y[:, None, None].expand(-1, cfg.hard_samples, 1)).squeeze(2)  # (B, K)
                la = log_alpha.gather(1, s)  # (B, K)
                r = lk.detach()
                if cfg.hard_baseline == "average":  # scored once the caption is complete
                    seq_r.append(r)
                    seq_logp.append(la)
                else:
                    b = (soft_lp.detach()[:, None] if cfg.hard_baseline == "soft"
                         else (r.sum(1, keepdim=True) - r) / (cfg.hard_samples - 1))
                    term = -((r - b) * la).mean(1)
                    pg.append(term if expect is None else torch.where(expect, torch.zeros_like(term), term))
                nll = -lk.mean(1)
                if expect is not None:
                    nll = torch.where(expect, -soft_lp, nll)
                ent.append(-(alpha.to(fp) * log_alpha).sum(-1))
            logits.append(soft)
            alphas.append(alpha)
            betas.append(beta)
            nlls.append(nll)
        valid = (tgt != PAD).to(fp)
        n = valid.sum().clamp_min(1)
        loss = (torch.stack(nlls, 1) * valid).sum() / n
        if reinforce:
            if cfg.hard_baseline == "average":  # the caption's reward for all its locations
                R = (torch.stack(seq_r, 1) * valid[..., None]).sum(1)  # (B, K)
                logp = (torch.stack(seq_logp, 1) * valid[..., None]).sum(1)
                keep = torch.ones(B, device=R.device) if expect is None else (~expect).to(fp)
                loss = loss + (-((R - self.baseline) * logp).mean(1) * keep).sum() / n
                with torch.no_grad():
                    if keep.any():
                        mean_r = (R.mean(1) * keep).sum() / keep.sum()
                        self.baseline.mul_(cfg.baseline_decay).add_((1 - cfg.baseline_decay) * mean_r)
            else:
                loss = loss + (torch.stack(pg, 1) * valid).sum() / n
            loss = loss - cfg.entropy_bonus * (torch.stack(ent, 1) * valid).sum() / n
        return CaptionerOutput(torch.stack(logits, 1), loss, torch.stack(alphas, 1), torch.stack(betas, 1))
