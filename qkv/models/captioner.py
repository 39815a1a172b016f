"""Show, Attend and Tell: a CNN turns the image into a grid of feature vectors, an LSTM writes
the caption, and at every word it attends over the grid (Xu et al. 2015).

    features  a_1..a_L = CNN(image)                    (B, L, D), L = grid cells
    h_0, c_0  = tanh(W_h mean(a)), tanh(W_c mean(a))
    word t    e_ti = score(h_{t-1}, a_i)                 additive (Bahdanau) or scaled dot product
              α_t = softmax(e_t)                         over the L locations
              soft:  z_t = β_t Σ_i α_ti a_i,   β_t = σ(w_β·h_{t-1})   (the paper's gating scalar)
              hard:  s_t ~ Categorical(α_t) in training, argmax at test;  z_t = β_t a_{s_t}
              uniform (the baseline): α_ti = 1/L, z_t = β_t mean_i a_i
              h_t, c_t = LSTM([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
              p(y_t) = softmax(L_o (E y_{t-1} + L_h h_t + L_z z_t))      (deep output, linear)

Soft attention's loss adds the doubly stochastic penalty λ Σ_i (1 - Σ_t α_ti)²: every
location should get attention about once over the caption. Hard attention is trained with
REINFORCE (:func:`reinforce_surrogate`): the log-likelihood of the caption is the reward for
the sampled locations, minus a moving-average baseline, plus an entropy bonus; as in the
paper (§4.1), half the captions of a batch read the expected value Σ_i α_ti a_i instead.

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
    attention: Literal["soft", "hard", "uniform"] = "soft"  # weighted average, one sampled location,
    # or the plain average of the grid (the baseline: attention that looks everywhere alike)
    scoring: Literal["additive", "dot"] = "additive"  # Bahdanau MLP or scaled dot product
    doubly_stochastic: float = 1.0  # λ of Σ_i (1 - Σ_t α_ti)² (soft attention)
    entropy_bonus: float = 0.01  # hard attention: weight of the attention's entropy
    baseline_decay: float = 0.9  # hard attention: moving-average baseline of the reward
    hard_expectation: float = 0.5  # hard attention, training: share of captions that read the
    # expected value Σ α_i a_i instead of a sampled location (Xu et al. 2015, §4.1)
    dropout: float = 0.0  # dropout on the deep output
    word_dropout: float = 0.0  # training: share of input words replaced by UNK (leans on the image)
    stage_convs: int = 2  # 3x3 convolutions per CNN stage (fewer: smaller receptive field)
    positions: bool = True  # add a learned embedding of each grid cell to its features (where)

    def __post_init__(self) -> None:
        if self.attention not in ("soft", "hard", "uniform"):
            raise ValueError(f"attention must be soft, hard or uniform, got {self.attention!r}")
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


class Captioner(nn.Module):
    """CNN encoder + LSTM decoder with soft or hard attention over the CNN's grid."""

    def __init__(self, cfg: CaptionerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w, D = cfg.width, cfg.feature_dim

        def stage(cin: int, cout: int) -> list[nn.Module]:
            layers: list[nn.Module] = []
            for k in range(cfg.stage_convs):
                layers += [nn.Conv2d(cin if k == 0 else cout, cout, 3, stride=2 if k == 0 else 1,
                                     padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            return layers

        self.cnn = nn.Sequential(*stage(cfg.channels, w), *stage(w, 2 * w), *stage(2 * w, D))
        self.pos = nn.Parameter(torch.zeros(cfg.grid * cfg.grid, D)) if cfg.positions else None
        self.init_h = nn.Linear(D, cfg.hidden)
        self.init_c = nn.Linear(D, cfg.hidden)
        if cfg.attention == "uniform":
            pass  # nothing scores the cells (and DDP wants no unused parameters)
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

    # ------------------------------------------------------------------ pieces

    def encode(self, images: Tensor) -> Tensor:
        """(B, C, H, W) normalised images -> features (B, L, D), row-major over the grid."""
        f = self.cnn(images).flatten(2).transpose(1, 2)  # (B, D, g, g) -> (B, L, D)
        return f if self.pos is None else f + self.pos

    def start(self, images: Tensor) -> CaptionerState:
        feats = self.encode(images)
        mean = feats.mean(1)
        scored = self.cfg.attention != "uniform" and self.cfg.scoring == "additive"
        keys = self.attn.project_keys(feats) if scored else None
        return CaptionerState(torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean)), feats, keys)

    def attention_weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        """α (B, L): softmax over locations of the scores of h against every feature vector."""
        if self.cfg.scoring == "additive":
            return self.attn(h, feats, projected_keys=keys).weights
        q = self.query(h)  # (B, D)
        scores = (feats @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(feats.shape[-1])
        return softmax(scores, dim=-1)

    def step(self, state: CaptionerState, prev: Tensor, sample: bool = False,
             generator: torch.Generator | None = None, expect: Tensor | None = None):
        """One word: (state, previous tokens (B,)) -> (logits (B, V), new state, α (B, L), β (B,),
        chosen locations (B,) or None for soft attention). Hard attention: ``expect`` (B,) bool
        marks the rows that read the expected value Σ α_i a_i instead of their location."""
        h, c, feats, keys = state
        if self.cfg.attention == "uniform":
            alpha = feats.new_full(feats.shape[:2], 1.0 / feats.shape[1])
        else:
            alpha = self.attention_weights(h, feats, keys)
        beta = torch.sigmoid(self.gate(h)).squeeze(-1)
        loc = None
        if self.cfg.attention != "hard":
            z = (alpha.unsqueeze(1) @ feats).squeeze(1)  # Σ_i α_i a_i
        else:
            loc = (torch.multinomial(alpha, 1, generator=generator).squeeze(-1) if sample
                   else alpha.argmax(-1))
            z = feats[torch.arange(len(feats)), loc]
            if expect is not None:
                z = torch.where(expect[:, None], (alpha.unsqueeze(1) @ feats).squeeze(1), z)
        z = beta.unsqueeze(-1) * z
        e = self.emb(prev)
        h, c = self.lstm(torch.cat([e, z], dim=-1), (h, c))
        logits = self.out(self.drop(e + self.out_h(h) + self.out_z(z)))  # linear, as in the paper
        return logits, CaptionerState(h, c, feats, keys), alpha, beta, loc

    # ------------------------------------------------------------------ training

    def forward(self, images: Tensor, captions: Tensor) -> CaptionerOutput:
        """Teacher forcing. captions (B, T+1) = [BOS, words..., EOS, PAD...]."""
        cfg = self.cfg
        inp, tgt = captions[:, :-1], captions[:, 1:]
        if self.training and cfg.word_dropout > 0:  # BOS and PAD stay; other words become UNK
            drop = (torch.rand(inp.shape, device=inp.device) < cfg.word_dropout) & (inp > EOS)
            inp = inp.masked_fill(drop, UNK)
        state = self.start(images)
        expect = None
        if cfg.attention == "hard" and self.training and cfg.hard_expectation > 0:
            expect = torch.rand(len(images), device=images.device) < cfg.hard_expectation
        logits, alphas, betas, log_locs, entropies = [], [], [], [], []
        for t in range(inp.shape[1]):
            lg, state, a, b, loc = self.step(state, inp[:, t], sample=self.training, expect=expect)
            logits.append(lg)
            alphas.append(a)
            betas.append(b)
            if loc is not None:
                log_locs.append(torch.log(a.gather(1, loc[:, None]).squeeze(1).clamp_min(1e-12)))
                entropies.append(-(a * torch.log(a.clamp_min(1e-12))).sum(-1))
        out = torch.stack(logits, 1)
        A = torch.stack(alphas, 1)  # (B, T, L)
        valid = (tgt != PAD).float()  # (B, T)
        nll = F.cross_entropy(out.float().transpose(1, 2), tgt, ignore_index=PAD, reduction="none")
        loss = (nll * valid).sum() / valid.sum().clamp_min(1)
        if cfg.attention == "soft" and cfg.doubly_stochastic > 0:
            coverage = (A * valid.unsqueeze(-1)).sum(1)  # (B, L): Σ_t α_ti over real words
            loss = loss + cfg.doubly_stochastic * ((1 - coverage) ** 2).sum(-1).mean() / A.shape[-1]
        if cfg.attention == "hard" and self.training:
            seq_logp = -(nll * valid).sum(1)  # log p(caption | sampled locations): the reward
            log_p_locs = (torch.stack(log_locs, 1) * valid).sum(1)
            sampled = torch.ones_like(seq_logp) if expect is None else (~expect).float()
            if sampled.any():  # REINFORCE on the captions that used their sampled locations
                loss = loss + reinforce_surrogate(log_p_locs * sampled, seq_logp, self.baseline) \
                    * len(sampled) / sampled.sum()
                with torch.no_grad():
                    mean = (seq_logp * sampled).sum() / sampled.sum()
                    self.baseline.mul_(cfg.baseline_decay).add_((1 - cfg.baseline_decay) * mean)
            loss = loss - cfg.entropy_bonus * (torch.stack(entropies, 1) * valid).sum() / valid.sum()
        return CaptionerOutput(out, loss, A, torch.stack(betas, 1))
