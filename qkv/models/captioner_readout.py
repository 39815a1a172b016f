"""The captioner's read-outs: what the decoder reads from the grid with the attention α, and its
loss (Xu et al. 2015, "Show, Attend and Tell"; Deng et al. 2018, "Latent Alignment and
Variational Attention"). One small module per kind, chosen by the config
(:func:`qkv.models.captioner.make_read`):

    soft         z_t = β_t Σ_i α_ti a_i feeds the LSTM and the word; NLL + the doubly
                 stochastic penalty λ Σ_i (1 - Σ_t α_ti)² (Xu et al. §4.2.1)
    hard-exact   the location is a latent variable of its word (Deng et al.): the LSTM reads
                 β_t mean_i a_i, the word one cell β_t a_s; loss -log Σ_i α_ti p(y_t | a_i)
    hard         as hard-exact, trained by sampling K cells per word and REINFORCE on α
                 (:func:`reinforce_surrogate`) against a per-word baseline (the soft path, or
                 leave-one-out) or a moving average of the caption's reward (Xu et al. §4.1)
    uniform      the soft read-out without the penalty (α = 1/L is constant)

Read-outs hold no parameters and no state: the moving average of the reward is the model's
running statistic, passed in and returned.

Shapes: B batch, T caption length, L = g·g locations, D feature width, E embedding width,
V vocabulary, K locations sampled per word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from qkv.tokenizers.vocab import PAD

HardDecode = Literal["argmax", "expectation"]  # what hard attention reads when not sampling


def reinforce_surrogate(log_prob: Tensor, reward: Tensor, baseline: float | Tensor = 0.0,
                        dim: int | None = None, mask: Tensor | None = None) -> Tensor:
    """A loss whose gradient is the REINFORCE estimate of -∇ E[reward]:

        -(reward - baseline) · ∇ log p(action)        (Williams 1992)

    log_prob: log-probabilities of the sampled actions (any shape, summed over the last dims by
    the caller); reward: same leading shape, treated as a constant. A baseline that does not
    depend on the action leaves the estimate unbiased and lowers its variance.
    dim: average over this dimension only (e.g. the K samples of one word) and return one term
    per row, instead of the mean over everything; mask: bool, the shape of that result: rows
    where it is False give 0 (no gradient).
    """
    terms = (reward - baseline).detach() * log_prob
    out = -terms.mean() if dim is None else -terms.mean(dim)
    return out if mask is None else torch.where(mask, out, torch.zeros_like(out))


class Word(NamedTuple):
    """One decoder step up to the output layer: α (B, L), β (B,), what the LSTM read besides the
    word (B, D), and ``base`` = E y_{t-1} + L_h h_t (B, E), the output's view of all but the grid."""

    alpha: Tensor
    beta: Tensor
    memory: Tensor
    base: Tensor


class DeepOutput(NamedTuple):
    """The model's deep output layer p(y) = softmax(L_o(E y + L_h h + L_z z)), in two halves:
    ``project`` L_z (..., D) -> (..., E) and ``logits`` (..., E) -> (..., V), dropout included."""

    project: Callable[[Tensor], Tensor]
    logits: Callable[[Tensor], Tensor]


class Grid(NamedTuple):
    """The image's grid as a read-out uses it, computed once per caption (:meth:`ReadOut.grid`):
    the features a (B, L, D), their mean (B, D) and the output layer's view of each cell,
    L_z a (B, L, E); the last two None where the read-out does not use them."""

    feats: Tensor
    mean: Tensor | None = None
    projected: Tensor | None = None


class ReadLoss(NamedTuple):
    """logits (B, T, V); the loss; the batch's mean caption reward (moving-average baseline) or None."""

    logits: Tensor
    loss: Tensor
    reward: Tensor | None = None


def smoothed_nll(log_probs: Tensor, y: Tensor, smoothing: float) -> Tensor:
    """The word's loss against a label-smoothed target (Szegedy et al. 2016): (1 - ε) of the
    mass on y, ε spread evenly over the V words: -(1 - ε) log p(y) - ε mean_v log p(v).
    log_probs (..., V), y (...) -> (...). ε = 0 is the plain NLL.

    Why the captioner uses it: under the plain NLL a word never seen after another (a held-out
    colour/shape pair) is pushed towards probability 0 without bound, through the paths that
    see the previous word, and ends up overruling the image; with ε the push stops at ε/V, the
    same floor as for every other wrong word, so what the image shows decides."""
    nll = -log_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    if smoothing == 0:
        return nll
    return (1 - smoothing) * nll - smoothing * log_probs.mean(-1)


def _word_sum(per_word: list[Tensor], valid: Tensor) -> Tensor:
    """Σ over the real words (``valid`` (B, T)) of per-word values, each (B,)."""
    return (torch.stack(per_word, 1) * valid).sum()


class ReadOut(nn.Module):
    """What the decoder reads from the grid, and its loss. No parameters, no state."""

    samples: ClassVar[bool] = False  # trains on sampled locations (then ``sampled_loss``)
    label_smoothing: float = 0.0  # ε of :func:`smoothed_nll` in the loss (set by make_read)

    def grid(self, feats: Tensor, project: Callable[[Tensor], Tensor] | None = None) -> Grid:
        """What to compute from the features once per caption (``project``: L_z, for a loss)."""
        return Grid(feats)

    def memory(self, alpha: Tensor, beta: Tensor, grid: Grid) -> Tensor:
        """What the LSTM reads besides the word (B, D)."""
        raise NotImplementedError

    def context(self, word: Word, feats: Tensor, *, sample: bool = False,
                generator: torch.Generator | None = None, expect: Tensor | None = None,
                decode: HardDecode = "argmax") -> tuple[Tensor, Tensor | None]:
        """What the word's output reads (B, D), and the location read (B,) or None."""
        raise NotImplementedError

    def loss(self, words: list[Word], grid: Grid, tgt: Tensor, output: DeepOutput) -> ReadLoss:
        """Teacher forcing's loss over the targets tgt (B, T), PAD ignored."""
        raise NotImplementedError

    def sampled_loss(self, words: list[Word], grid: Grid, tgt: Tensor, output: DeepOutput,
                     expect: Tensor | None, average: Tensor) -> ReadLoss:
        raise NotImplementedError(f"{type(self).__name__} does not sample locations")


class SoftRead(ReadOut):
    """Soft attention (Xu et al. §3.1.2): z_t = β_t Σ_i α_ti a_i, β_t = σ(w_β·h_{t-1}), feeds the
    LSTM and the word. ``doubly_stochastic`` λ > 0 adds λ/L Σ_i (1 - Σ_t α_ti)², averaged over
    the batch: every location should get attention about once over the caption."""

    def __init__(self, doubly_stochastic: float = 0.0) -> None:
        super().__init__()
        self.doubly_stochastic = doubly_stochastic

    def extra_repr(self) -> str:
        return f"doubly_stochastic={self.doubly_stochastic}"

    def memory(self, alpha: Tensor, beta: Tensor, grid: Grid) -> Tensor:
        return beta.unsqueeze(-1) * (alpha.unsqueeze(1) @ grid.feats).squeeze(1)  # β Σ_i α_i a_i

    def context(self, word: Word, feats: Tensor, **how: object) -> tuple[Tensor, None]:
        return word.memory, None  # one way to read: sample, expect and decode change nothing

    def loss(self, words: list[Word], grid: Grid, tgt: Tensor, output: DeepOutput) -> ReadLoss:
        logits = torch.stack([output.logits(w.base + output.project(w.memory)) for w in words], 1)
        valid = (tgt != PAD).float()  # (B, T)
        nll = nn.functional.cross_entropy(logits.float().transpose(1, 2), tgt, ignore_index=PAD,
                                          reduction="none", label_smoothing=self.label_smoothing)
        loss = (nll * valid).sum() / valid.sum().clamp_min(1)
        if self.doubly_stochastic > 0:
            A = torch.stack([w.alpha for w in words], 1)  # (B, T, L)
            coverage = (A * valid.unsqueeze(-1)).sum(1)  # (B, L): Σ_t α_ti over real words
            loss = loss + self.doubly_stochastic * ((1 - coverage) ** 2).sum(-1).mean() / A.shape[-1]
        return ReadLoss(logits, loss)


def _loss_dtype(feats: Tensor) -> torch.dtype:
    return torch.promote_types(feats.dtype, torch.float32)  # fp32 under bf16 autocast; float64 stays


def _log_alpha(alpha: Tensor, fp: torch.dtype) -> Tensor:
    return torch.log(alpha.to(fp).clamp_min(1e-12))


def _log_prob(logits: Tensor, y: Tensor, fp: torch.dtype) -> Tensor:
    """log p(y) (B, N) from logits (B, N, V) of N readings of the word y (B,)."""
    return logits.to(fp).log_softmax(-1).gather(2, y[:, None, None].expand(-1, logits.shape[1], 1)).squeeze(2)


def _expected_logits(w: Word, Z: Tensor, output: DeepOutput) -> Tensor:
    """(B, V): the word reading β Σ_i α_i a_i, from the cells' projections Z = L_z a (B, L, E)."""
    return output.logits(w.base + w.beta.unsqueeze(-1) * (w.alpha.unsqueeze(1) @ Z).squeeze(1))


class HardExact(ReadOut):
    """Hard attention with its exact likelihood (Deng et al. 2018, "Latent Alignment and
    Variational Attention"): the LSTM reads β_t mean_i a_i, what every location has in common,
    and word t reads one location s_t, so a location changes one word's probability and nothing
    after it: p(y_t) = Σ_i α_ti p(y_t | a_i), L output layers per word, zero variance.
    ``logits`` of the loss are the expected-context path's, reading Σ_i α_ti a_i."""

    def grid(self, feats: Tensor, project: Callable[[Tensor], Tensor] | None = None) -> Grid:
        # computed once, not per word: the gradient then reaches the features summed as it was
        Z = None if project is None else project(feats)  # (B, L, E) (linear: β factors out)
        return Grid(feats, feats.mean(1), Z)

    def memory(self, alpha: Tensor, beta: Tensor, grid: Grid) -> Tensor:
        return beta.unsqueeze(-1) * grid.mean

    def context(self, word: Word, feats: Tensor, *, sample: bool = False,
                generator: torch.Generator | None = None, expect: Tensor | None = None,
                decode: HardDecode = "argmax") -> tuple[Tensor, Tensor | None]:
        """β a_s: ``sample`` draws s from α, else ``decode`` says: the most attended cell
        (``"argmax"``, truly hard) or Σ α_i a_i (``"expectation"``, s None); ``expect`` (B,)
        bool marks rows that read Σ α_i a_i anyway (Xu et al. §4.1)."""
        alpha = word.alpha
        if decode not in ("argmax", "expectation"):
            raise ValueError(f"hard attention decodes reading argmax or expectation, got {decode!r}")
        if sample:
            loc = torch.multinomial(alpha, 1, generator=generator).squeeze(-1)
        else:
            loc = alpha.argmax(-1) if decode == "argmax" else None
        expected = (alpha.unsqueeze(1) @ feats).squeeze(1)  # Σ_i α_i a_i
        z = expected if loc is None else feats[torch.arange(len(feats)), loc]
        if expect is not None:
            z = torch.where(expect[:, None], expected, z)
        return word.beta.unsqueeze(-1) * z, loc

    def loss(self, words: list[Word], grid: Grid, tgt: Tensor, output: DeepOutput) -> ReadLoss:
        fp, Z = _loss_dtype(grid.feats), grid.projected
        logits, nlls = [], []
        for w, y in zip(words, tgt.unbind(1), strict=True):
            logits.append(_expected_logits(w, Z, output))
            every = output.logits(w.base.unsqueeze(1) + w.beta[:, None, None] * Z)  # (B, L, V)
            if self.label_smoothing:  # log p(v) = log Σ_i α_i p(v | a_i) for every word v
                every_lp = every.to(fp).log_softmax(-1)  # (B, L, V)
                mix = torch.logsumexp(_log_alpha(w.alpha, fp)[..., None] + every_lp, dim=1)  # (B, V)
                nlls.append(smoothed_nll(mix, y, self.label_smoothing))
            else:
                nlls.append(-torch.logsumexp(_log_alpha(w.alpha, fp) + _log_prob(every, y, fp), dim=-1))
        valid = (tgt != PAD).to(fp)
        return ReadLoss(torch.stack(logits, 1), _word_sum(nlls, valid) / valid.sum().clamp_min(1))


class Sampled(NamedTuple):
    """One word read at K locations s drawn from α: the expected-context logits (B, V), the
    word's NLL (B,), rewards log p(y | a_s) (B, K, constant), log α_s (B, K), the soft path's
    log p(y | Σ α a) (B,) and the entropy of α (B,)."""

    logits: Tensor
    nll: Tensor
    reward: Tensor
    log_alpha: Tensor
    soft_lp: Tensor
    entropy: Tensor


def soft_path_baseline(d: Sampled) -> Tensor:
    """Deng et al.'s control variate: the soft path's log p(y_t | Σ_i α_ti a_i) (B, 1)."""
    return d.soft_lp.detach()[:, None]


def leave_one_out_baseline(d: Sampled) -> Tensor:
    """Each sample against the mean reward of the word's other K - 1 samples (B, K)."""
    return (d.reward.sum(1, keepdim=True) - d.reward) / (d.reward.shape[1] - 1)


class HardReinforce(HardExact):
    """Hard attention trained by sampling (Xu et al. §3.1.1, with Deng et al.'s per-word
    reward): each word reads ``n_samples`` locations s ~ α_t, the decoder learns from
    log p(y_t | a_s), α from REINFORCE on that reward (:meth:`_policy`: which baseline), plus
    ``entropy_bonus`` × the entropy of α so it does not collapse early. Rows of ``expect`` (B,)
    read Σ α_i a_i instead and learn through it (Xu et al. §4.1). Evaluation: the exact loss."""

    samples = True

    def __init__(self, n_samples: int, entropy_bonus: float) -> None:
        super().__init__()
        self.n_samples = n_samples
        self.entropy_bonus = entropy_bonus

    def extra_repr(self) -> str:
        return f"n_samples={self.n_samples}, entropy_bonus={self.entropy_bonus}"

    def _sample(self, w: Word, y: Tensor, Z: Tensor, output: DeepOutput, expect: Tensor | None,
                fp: torch.dtype) -> Sampled:
        """One word read at K sampled locations (dropout and the draw in this order)."""
        soft = _expected_logits(w, Z, output)
        soft_all = soft.to(fp).log_softmax(-1)
        soft_lp = soft_all.gather(1, y[:, None]).squeeze(1)  # log p(y | Σ α a)
        log_alpha = _log_alpha(w.alpha, fp)
        s = torch.multinomial(w.alpha.detach().to(fp), self.n_samples, replacement=True)  # (B, K)
        zk = w.beta[:, None, None] * Z[torch.arange(len(Z), device=Z.device)[:, None], s]  # (B, K, E)
        read = output.logits(w.base.unsqueeze(1) + zk).to(fp).log_softmax(-1)  # (B, K, V)
        lk = read.gather(2, y[:, None, None].expand(-1, read.shape[1], 1)).squeeze(2)  # (B, K) the rewards
        eps = self.label_smoothing
        nll = smoothed_nll(read, y[:, None].expand_as(lk), eps).mean(1)
        if expect is not None:
            nll = torch.where(expect, smoothed_nll(soft_all, y, eps), nll)
        entropy = -(w.alpha.to(fp) * log_alpha).sum(-1)
        return Sampled(soft, nll, lk.detach(), log_alpha.gather(1, s), soft_lp, entropy)

    def sampled_loss(self, words: list[Word], grid: Grid, tgt: Tensor, output: DeepOutput,
                     expect: Tensor | None, average: Tensor) -> ReadLoss:
        """Training's loss: mean NLL of the sampled readings + REINFORCE - entropy bonus.
        ``average``: the moving average of the caption reward (the model's running statistic)."""
        fp, Z = _loss_dtype(grid.feats), grid.projected
        drawn = [self._sample(w, y, Z, output, expect, fp) for w, y in zip(words, tgt.unbind(1), strict=True)]
        valid = (tgt != PAD).to(fp)
        n = valid.sum().clamp_min(1)
        loss = _word_sum([d.nll for d in drawn], valid) / n
        policy, reward = self._policy(drawn, valid, n, expect, average)
        loss = loss + policy
        loss = loss - self.entropy_bonus * _word_sum([d.entropy for d in drawn], valid) / n
        return ReadLoss(torch.stack([d.logits for d in drawn], 1), loss, reward)

    def _policy(self, drawn: list[Sampled], valid: Tensor, n: Tensor, expect: Tensor | None,
                average: Tensor) -> tuple[Tensor, Tensor | None]:
        """REINFORCE's loss term, and the mean caption reward if the baseline tracks it."""
        raise NotImplementedError


class WordReinforce(HardReinforce):
    """REINFORCE per word: reward r_t = log p(y_t | a_s), against ``baseline_of`` a word's
    samples (:func:`soft_path_baseline` or :func:`leave_one_out_baseline`)."""

    def __init__(self, n_samples: int, entropy_bonus: float,
                 baseline_of: Callable[[Sampled], Tensor]) -> None:
        super().__init__(n_samples, entropy_bonus)
        self.baseline_of = baseline_of

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, baseline={self.baseline_of.__name__}"

    def _policy(self, drawn: list[Sampled], valid: Tensor, n: Tensor, expect: Tensor | None,
                average: Tensor) -> tuple[Tensor, None]:
        keep = None if expect is None else ~expect
        terms = [reinforce_surrogate(d.log_alpha, d.reward, self.baseline_of(d), dim=1, mask=keep)
                 for d in drawn]  # each (B,)
        return _word_sum(terms, valid) / n, None


class CaptionReinforce(HardReinforce):
    """REINFORCE per caption (Xu et al. §4.1): the caption's reward Σ_t r_t for every location it
    read, against ``average``, a moving average of that reward over past batches."""

    def _policy(self, drawn: list[Sampled], valid: Tensor, n: Tensor, expect: Tensor | None,
                average: Tensor) -> tuple[Tensor, Tensor | None]:
        real = valid[..., None]  # (B, T, 1)
        R = (torch.stack([d.reward for d in drawn], 1) * real).sum(1)  # (B, K)
        log_p = (torch.stack([d.log_alpha for d in drawn], 1) * real).sum(1)  # (B, K) log p(s_1..s_T)
        keep = None if expect is None else ~expect
        term = reinforce_surrogate(log_p, R, average, dim=1, mask=keep)  # (B,)
        with torch.no_grad():  # the batch's mean reward over the rows that sampled, for the average
            rows = torch.ones(len(R), device=R.device) if keep is None else keep.to(R.dtype)
            reward = (R.mean(1) * rows).sum() / rows.sum() if rows.any() else None
        return term.sum() / n, reward
