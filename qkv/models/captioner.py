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

The model is composition: a CNN, a scorer (additive, dot, location or uniform:
:mod:`qkv.models.captioner_attention`) and a read-out (soft, hard-exact, hard by REINFORCE:
:mod:`qkv.models.captioner_readout`), chosen by the config in :func:`make_scorer` and
:func:`make_read`. What a hard model reads when decoding is an argument of
:meth:`Captioner.step` (``hard_decode``), not a toggled attribute.

Lectures: CS189 Lec 21 (image captioning with soft attention), CS231N Lec 8.
Shapes: B batch, T caption length, L = g·g locations, D feature width, H LSTM width, E word
embedding width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from qkv.models.captioner_attention import AdditiveScorer, DotScorer, LocationScorer, Scorer, UniformScorer
from qkv.models.captioner_readout import (
    CaptionReinforce,
    DeepOutput,
    Grid,
    HardDecode,
    HardExact,
    ReadLoss,
    ReadOut,
    SoftRead,
    Word,
    WordReinforce,
    leave_one_out_baseline,
    reinforce_surrogate,
    soft_path_baseline,
)
from qkv.models.config_checks import check_choices, check_range
from qkv.tokenizers.vocab import EOS, PAD, UNK

__all__ = ["HARD", "Captioner", "CaptionerConfig", "CaptionerOutput", "CaptionerState", "CaptionerStep",
           "HardDecode", "make_read", "make_scorer", "reinforce_surrogate"]


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
    # ε: the loss's target keeps ε of its mass for the other words, so a word never seen after
    # another (a held-out colour/shape pair) is not ruled out by the words before it
    label_smoothing: float = 0.0  # training: share of each target spread over all words
    # The decoder reads back every word it wrote, and learns which names follow which: a colour
    # never seen before a shape in training then vetoes that shape whatever the image shows.
    # false: the words that name what is seen (colours and shapes of the generated scenes) are
    # read back as UNK, in training and decoding alike, so the image alone says which they are
    read_back_names: bool = True  # false: names of colours/shapes are fed back as UNK
    unread_words: list[int] = field(default_factory=list)  # set from the data: the ids fed back as UNK
    stage_convs: int = 2  # 3x3 convolutions per CNN stage (fewer: smaller receptive field)
    positions: bool = True  # add a learned embedding of each grid cell to its features (where)
    # 3x3 stride-2 convolutions centre cell (i, j)'s feature on pixel (8i, 8j), the cell's corner;
    # 4x4 ones (padding 1) on its centre (8i + 3.5, 8j + 3.5), where attention maps draw it
    centred: bool = False  # 4x4 stride-2 convolutions: each feature centred on its grid cell
    # joint: one CNN reads the RGB image, and its features mix colour with shape, so a pair never
    # seen in training looks unlike any seen one. split: the CNN reads max over the colour
    # channels (a colour-blind silhouette: shape, size, place), and a colour stream reads each
    # pixel alone (1x1 convolutions, colour only), max-pooled over each grid cell; a cell's
    # features are both, side by side (an encoder whose shape features cannot see colour)
    encoder: Literal["joint", "split"] = "joint"  # joint RGB CNN, or colour-blind shape + colour streams

    def __post_init__(self) -> None:
        check_choices(self)  # attention, addressing, scoring, hard_baseline: their Literal choices
        least = 2 if self.hard_baseline == "loo" else 1
        if self.hard_samples < least:
            raise ValueError(f"hard_samples must be >= {least} with hard_baseline {self.hard_baseline}, "
                             f"got {self.hard_samples}")
        check_range(self, "hard_anneal", 0)
        check_range(self, "hard_expectation", 0, 1)
        check_range(self, "word_dropout", 0, 1, high_open=True)
        check_range(self, "label_smoothing", 0, 1, high_open=True)
        check_range(self, "stage_convs", 1, 3)
        if self.image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 (three stride-2 stages), got "
                             f"{self.image_size}")

    @property
    def grid(self) -> int:
        return self.image_size // 8

    @property
    def feature_dim(self) -> int:
        """D: the CNN's 4·width channels, plus the colour stream's width (split encoder)."""
        return 4 * self.width + (self.width if self.encoder == "split" else 0)


HARD = ("hard", "hard-exact")


def make_scorer(cfg: CaptionerConfig) -> Scorer:
    """The scorer the config names: uniform attention has none that learns; location-based
    addressing scores cell indices; content-based, each cell's features (additive or dot)."""
    if cfg.attention == "uniform":
        return UniformScorer()
    if cfg.addressing == "location":
        return LocationScorer(cfg.hidden, cfg.grid * cfg.grid, cfg.image_size)
    if cfg.scoring == "additive":
        return AdditiveScorer(cfg.hidden, cfg.feature_dim, cfg.attn_dim)
    return DotScorer(cfg.hidden, cfg.feature_dim)


def make_read(cfg: CaptionerConfig) -> ReadOut:
    """The read-out the config names (uniform attention reads as soft, without the penalty),
    with the config's label smoothing in its loss."""
    read: ReadOut
    if cfg.attention in ("soft", "uniform"):
        read = SoftRead(cfg.doubly_stochastic if cfg.attention == "soft" else 0.0)
    elif cfg.attention == "hard-exact":
        read = HardExact()
    elif cfg.hard_baseline == "average":
        read = CaptionReinforce(cfg.hard_samples, cfg.entropy_bonus)
    else:
        baseline = soft_path_baseline if cfg.hard_baseline == "soft" else leave_one_out_baseline
        read = WordReinforce(cfg.hard_samples, cfg.entropy_bonus, baseline)
    read.label_smoothing = cfg.label_smoothing
    return read


class CaptionerOutput(NamedTuple):
    """logits (B, T, V); loss; attention α (B, T, L); gates β (B, T)."""

    logits: Tensor
    loss: Tensor | None
    alphas: Tensor
    betas: Tensor


class CaptionerState(NamedTuple):
    """The decoder's state between words: LSTM h, c (B, H), the features (B, L, D) and what
    the scorer computed from them once (additive: W_k a (B, L, A); else None)."""

    h: Tensor
    c: Tensor
    features: Tensor
    keys: Tensor | None


class CaptionerStep(NamedTuple):
    """One decoded word: logits (B, V), the new state, α (B, L), β (B,), and the location read
    (B,), or None where the word read Σ α_i a_i."""

    logits: Tensor
    state: CaptionerState
    alpha: Tensor
    beta: Tensor
    loc: Tensor | None


def _cnn(cfg: CaptionerConfig) -> nn.Sequential:
    """Three stride-2 stages of ``stage_convs`` convolutions + BatchNorm + ReLU: (B, C, H, W) ->
    (B, 4·width, H/8, W/8); one input channel (the silhouette) for the split encoder."""
    def stage(cin: int, cout: int) -> list[nn.Module]:
        layers: list[nn.Module] = []
        for k in range(cfg.stage_convs):
            size = 4 if k == 0 and cfg.centred else 3  # 4: stride 2 centred on the cell
            layers += [nn.Conv2d(cin if k == 0 else cout, cout, size, stride=2 if k == 0 else 1,
                                 padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        return layers

    w = cfg.width
    cin = 1 if cfg.encoder == "split" else cfg.channels
    return nn.Sequential(*stage(cin, w), *stage(w, 2 * w), *stage(2 * w, 4 * w))


def _colour_stream(cfg: CaptionerConfig) -> nn.Sequential:
    """The split encoder's colour stream: two 1x1 convolutions (each pixel's colour alone, so no
    shape), max-pooled over each 8x8 grid cell: (B, C, H, W) -> (B, width, H/8, W/8)."""
    w = cfg.width
    return nn.Sequential(nn.Conv2d(cfg.channels, w, 1), nn.ReLU(), nn.Conv2d(w, w, 1), nn.ReLU(),
                         nn.MaxPool2d(8))


class Captioner(nn.Module):
    """CNN encoder + LSTM decoder with soft, hard or uniform attention over the CNN's grid.

    Composition: ``cnn``; a scorer (:func:`make_scorer`), registered under the name its
    parameters have always had in checkpoints (``attn``, ``locate``, ``query``; ``uniform`` has
    none); ``read``, the read-out (:func:`make_read`); the LSTM and the deep output layer.

    Buffers, updated in ``forward`` in training only, like BatchNorm's running statistics:
    ``baseline``, the moving average of the caption reward (hard attention, ``hard_baseline``
    average; decay ``baseline_decay``), and with ``hard_anneal``, ``steps``, the number of
    training forwards of a hard model (like BatchNorm's ``num_batches_tracked``), which sets the
    annealed expected-value share. Both are saved, so a resumed run continues exactly.
    """

    def __init__(self, cfg: CaptionerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.feature_dim
        # parameters are created in this order (the seed's draws), with these names (checkpoints)
        self.cnn = _cnn(cfg)
        self.colour = _colour_stream(cfg) if cfg.encoder == "split" else None
        self.pos = nn.Parameter(torch.zeros(cfg.grid * cfg.grid, D)) if cfg.positions else None
        self.init_h = nn.Linear(D, cfg.hidden)
        self.init_c = nn.Linear(D, cfg.hidden)
        scorer = make_scorer(cfg)
        self.add_module(scorer.state_name, scorer)
        self._scorer_name = scorer.state_name
        self.gate = nn.Linear(cfg.hidden, 1)
        self.emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=PAD)
        self.lstm = nn.LSTMCell(cfg.emb_dim + D, cfg.hidden)
        self.out_h = nn.Linear(cfg.hidden, cfg.emb_dim)
        self.out_z = nn.Linear(D, cfg.emb_dim, bias=False)
        self.out = nn.Linear(cfg.emb_dim, cfg.vocab_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.read = make_read(cfg)
        self.register_buffer("baseline", torch.zeros(()))
        if cfg.hard_anneal:
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    @property
    def scorer(self) -> Scorer:
        """The module that turns the LSTM state into α over the grid."""
        return getattr(self, self._scorer_name)

    # ------------------------------------------------------------------ pieces

    def encode(self, images: Tensor) -> Tensor:
        """(B, C, H, W) normalised images -> features (B, L, D), row-major over the grid."""
        if self.colour is None:
            grid = self.cnn(images)  # (B, D, g, g)
        else:  # shape from the colour-blind silhouette, colour from each pixel alone
            grid = torch.cat([self.cnn(images.amax(1, keepdim=True)), self.colour(images)], 1)
        f = grid.flatten(2).transpose(1, 2)  # (B, D, g, g) -> (B, L, D)
        if self.pos is None:
            return f
        if f.shape[1] != self.pos.shape[0]:
            raise ValueError(f"this captioner adds a learned embedding to each of its {self.pos.shape[0]} "
                             f"grid cells; a {images.shape[-1]}x{images.shape[-2]} image has {f.shape[1]}: "
                             f"give {self.cfg.image_size}x{self.cfg.image_size} images (or train with "
                             "--positions false)")
        return f + self.pos

    def start(self, images: Tensor) -> CaptionerState:
        """The state before the first word: h_0, c_0 = tanh(W_h mean(a)), tanh(W_c mean(a))."""
        feats = self.encode(images)
        mean = feats.mean(1)
        keys = self.scorer.keys(feats)
        return CaptionerState(torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean)), feats, keys)

    def attention_weights(self, h: Tensor, feats: Tensor, keys: Tensor | None) -> Tensor:
        """α (B, L): the scorer's distribution over the locations, from h (B, H), the features
        (B, L, D) and ``keys`` (:attr:`CaptionerState.keys`)."""
        return self.scorer.weights(h, feats, keys)

    def _logits(self, x: Tensor) -> Tensor:
        """The deep output's last layer: (..., E) -> (..., V), linear, as in the paper."""
        return self.out(self.drop(x))

    def _word(self, state: CaptionerState, prev: Tensor, grid: Grid) -> tuple[Word, CaptionerState]:
        """One LSTM step: α and β from h_{t-1}; the LSTM reads the word and the read-out's memory."""
        h, c, feats, keys = state
        alpha = self.attention_weights(h, feats, keys)
        beta = torch.sigmoid(self.gate(h)).squeeze(-1)
        e = self.emb(self._read_back(prev))
        memory = self.read.memory(alpha, beta, grid)
        h, c = self.lstm(torch.cat([e, memory], dim=-1), (h, c))
        return Word(alpha, beta, memory, e + self.out_h(h)), CaptionerState(h, c, feats, keys)

    def _read_back(self, prev: Tensor) -> Tensor:
        """The previous words (B,) as the decoder reads them: ``unread_words`` become UNK."""
        if not self.cfg.unread_words:
            return prev
        names = torch.tensor(self.cfg.unread_words, device=prev.device)
        return prev.masked_fill(torch.isin(prev, names), UNK)

    def step(self, state: CaptionerState, prev: Tensor, sample: bool = False,
             generator: torch.Generator | None = None, expect: Tensor | None = None,
             hard_decode: HardDecode = "argmax") -> CaptionerStep:
        """One word from the previous tokens (B,). Hard attention: ``sample`` draws the location
        from α (with ``generator``); otherwise ``hard_decode`` says what it reads: ``"argmax"``,
        the most attended cell (truly hard), or ``"expectation"``, Σ α_i a_i. ``expect`` (B,)
        bool marks rows that read Σ α_i a_i anyway. Soft and uniform attention ignore all three."""
        word, state = self._word(state, prev, self.read.grid(state.features))
        z, loc = self.read.context(word, state.features, sample=sample, generator=generator,
                                   expect=expect, decode=hard_decode)
        logits = self._logits(word.base + self.out_z(z))
        return CaptionerStep(logits, state, word.alpha, word.beta, loc)

    # ------------------------------------------------------------------ training

    def _teacher_inputs(self, captions: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) (B, T) from captions (B, T+1); in training with ``word_dropout``,
        a share of the input words becomes UNK (BOS and PAD stay)."""
        inp, tgt = captions[:, :-1], captions[:, 1:]
        if self.training and self.cfg.word_dropout > 0:
            drop = (torch.rand(inp.shape, device=inp.device) < self.cfg.word_dropout) & (inp > EOS)
            inp = inp.masked_fill(drop, UNK)
        return inp, tgt

    def _expectation_rows(self, n: int, device: torch.device) -> Tensor | None:
        """Hard attention, training: which captions read Σ α_i a_i (the share, annealed by
        ``steps``, which this advances)."""
        cfg = self.cfg
        share = cfg.hard_expectation
        if cfg.hard_anneal:
            share = max(0.0, 1.0 - float(self.steps) / cfg.hard_anneal)
            self.steps += 1
        return torch.rand(n, device=device) < share if share > 0 else None

    def forward(self, images: Tensor, captions: Tensor) -> CaptionerOutput:
        """Teacher forcing. captions (B, T+1) = [BOS, words..., EOS, PAD...]. The loss is the
        read-out's: soft/uniform NLL (+ penalty); hard-exact, and hard in eval mode, the exact
        NLL; hard in training, REINFORCE (which updates the running statistics, see the class)."""
        inp, tgt = self._teacher_inputs(captions)
        state = self.start(images)
        grid = self.read.grid(state.features, self.out_z)
        words = []
        for t in range(inp.shape[1]):
            word, state = self._word(state, inp[:, t], grid)
            words.append(word)
        out = self._loss(words, grid, tgt)
        return CaptionerOutput(out.logits, out.loss, torch.stack([w.alpha for w in words], 1),
                               torch.stack([w.beta for w in words], 1))

    def _loss(self, words: list[Word], grid: Grid, tgt: Tensor) -> ReadLoss:
        output = DeepOutput(self.out_z, self._logits)
        if not (self.training and self.read.samples):
            return self.read.loss(words, grid, tgt, output)
        expect = self._expectation_rows(len(tgt), grid.feats.device)
        out = self.read.sampled_loss(words, grid, tgt, output, expect, self.baseline)
        if out.reward is not None:  # the running statistic: a moving average of the reward
            with torch.no_grad():
                decay = self.cfg.baseline_decay
                self.baseline.mul_(decay).add_((1 - decay) * out.reward)
        return out
