"""Three claims of the lectures, shown live: the bottleneck attention removes, location- vs
content-based addressing, and why hard attention needs REINFORCE (and a baseline).

``qkv explain bottleneck``: two small RNN encoder-decoders (:class:`qkv.models.rnn_seq2seq.
RNNSeq2Seq`), one squeezing the source into one fixed context vector, one attending over every
source position (Bahdanau et al. 2015), trained for the same steps to copy random strings;
exact match by length: the fixed context falls as strings grow, attention does not (the
lectures' motivation for attention; Bahdanau et al. Fig. 2).

``qkv explain addressing``: Lecture 21 ends on it. A captioner's RNN can output a distribution
over a *fixed number of locations* (location-based: α = softmax(W h), never looking at the
cells), or compare a query with each location's *content* (content-based: α_i ∝ exp(qᵀk_i),
any number of locations) — where Lecture 22's self-attention starts. Shuffle the cells: the
content-based weights follow their content, the location-based ones stay where they were; add
cells: only content-based addressing can score them.

``qkv explain hard-attention``: hard attention reads one sampled location, s ~ α; sampling is
not differentiable, so the gradient of E_s[log p(y | a_s)] is estimated by REINFORCE,
(r − b) ∇ log α_s (Williams 1992). On one attention step with a known answer, the exact
gradient against the estimate's mean and spread: without a baseline, with the expected
likelihood Σ_i α_i p(y | a_i) as a fixed baseline (the role the soft path's log-likelihood plays
in training, Deng et al. 2018), and leave-one-out over K samples.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rich.console import Console


# --------------------------------------------------------------------------- bottleneck


@dataclass
class BottleneckResult:
    """exact[arch][bucket]: share of test strings copied exactly, by source length."""

    min_len: int
    max_len: int
    steps: int
    seconds: float
    params: dict[str, int]
    exact: dict[str, dict[str, float]]
    examples: dict[str, tuple[str, str]] = field(default_factory=dict)


def explain_bottleneck(min_len: int = 4, max_len: int = 24, steps: int = 400, seed: int = 0
                       ) -> BottleneckResult:
    """Train both RNNs (same size, data, steps and seed) to copy strings of ``min_len``..``max_len``
    random letters and score them on 300 unseen strings."""
    from qkv.data.copy import length_edges, make_copy_pairs
    from qkv.families.seq2seq import PairBatches, build_model, decode_texts, encode_split, evaluate
    from qkv.models.rnn_seq2seq import RNNSeq2SeqConfig
    from qkv.tokenizers.vocab import CharVocab

    if not 1 <= min_len < max_len <= 60:
        raise ValueError(f"lengths must satisfy 1 <= min_len < max_len <= 60, got {min_len}, {max_len}")
    if not 10 <= steps <= 5000:
        raise ValueError(f"steps must be in [10, 5000], got {steps}")
    t0 = time.perf_counter()
    pairs = make_copy_pairs("copy", 6000, 10, 300, 0, min_len, max_len, max_len, seed=seed)
    pairs = dataclasses.replace(pairs, length_edges=length_edges(min_len, max_len, max_len, width=4))
    vocab = CharVocab.build([s for s, _ in pairs.train])
    splits = {k: encode_split(v, vocab, vocab, max_len, max_len + 1) for k, v in pairs.splits().items()}
    batches = PairBatches(splits)
    longest = max(pairs.test, key=lambda p: len(p[0]))[0]
    exact, params, examples = {}, {}, {}
    for arch in ("rnn-noattn", "rnn"):
        cfg = RNNSeq2SeqConfig(arch=arch, emb_dim=32, hidden=64, dec_hidden=128, attn_dim=64,
                               src_vocab=len(vocab), tgt_vocab=len(vocab), max_src_len=max_len,
                               max_tgt_len=max_len + 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_model(cfg)
            opt = torch.optim.Adam(model.parameters(), 3e-3)
            g = torch.Generator().manual_seed(seed)
            model.train()
            for _ in range(steps):
                x, y = batches.get_batch("train", 64, g)
                loss = model(x, y).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
        ev = evaluate(model, cfg, vocab, vocab, dataclasses.replace(pairs, val=[]))["test"]
        exact[arch] = {b: v["exact"] for b, v in ev["by_length"].items()}
        params[arch] = sum(p.numel() for p in model.parameters())
        examples[arch] = (longest, decode_texts(model, cfg, vocab, vocab, [longest])[0][0])
    return BottleneckResult(min_len, max_len, steps, time.perf_counter() - t0, params, exact, examples)


def render_bottleneck(r: BottleneckResult, console: Console) -> None:
    from qkv.explain._render import add_row, say, table

    buckets = list(r.exact["rnn"])
    t = table(f"copy random strings of {r.min_len}-{r.max_len} letters: exact match by length, "
              f"{r.steps} steps each  (Bahdanau et al. 2015, Fig. 2)", ["model", *buckets])
    names = {"rnn-noattn": "RNN, one fixed context vector", "rnn": "RNN + attention (Bahdanau)"}
    for arch, row in r.exact.items():
        add_row(t, names[arch], *(f"{row[b]:.0%}" for b in buckets))
    console.print(t)
    for arch, (src, out) in r.examples.items():
        say(console, f"{names[arch]}, longest test string:\n  in  {src}\n  out {out}")
    say(console, f"Same size ({r.params['rnn']:,} parameters each: the fixed-context model keeps the "
        f"unused scorer), same data, steps and seed; {r.seconds:.0f} s. A string of n letters is "
        f"n·log2(26) ≈ {math.log2(26):.1f}n bits, all of it in one vector without attention; with "
        "attention the decoder reads every input position again at every step.", "dim")


# --------------------------------------------------------------------------- addressing


@dataclass
class AddressingResult:
    """Weights over L cells before and after shuffling their content, for both kinds, and
    what each does with more cells than it was built for."""

    cells: int
    permutation: list[int]
    content_before: list[float]
    content_after: list[float]
    location_before: list[float]
    location_after: list[float]
    content_more: int  # how many cells content addressing scored when given 2L
    location_more: str  # location addressing's error for 2L


def explain_addressing(cells: int = 6, dim: int = 8, seed: int = 0) -> AddressingResult:
    """One decoder state h, ``cells`` cell vectors a_i; α from each kind of addressing."""
    if not 2 <= cells <= 16:
        raise ValueError(f"cells must be in [2, 16], got {cells}")
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(dim, generator=g, dtype=torch.float64)
    a = torch.randn(cells, dim, generator=g, dtype=torch.float64)
    W_q = torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)  # content: q = W_q h
    W_loc = torch.randn(cells, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)  # one row per cell

    def content(feats: torch.Tensor) -> torch.Tensor:
        return torch.softmax(feats @ (W_q @ h) / math.sqrt(dim), 0)

    def location(feats: torch.Tensor) -> torch.Tensor:
        if len(feats) != W_loc.shape[0]:
            raise ValueError(f"location-based addressing outputs a distribution over the {W_loc.shape[0]} "
                             f"cells it was built for and cannot address {len(feats)}")
        return torch.softmax(W_loc @ h, 0)  # the cells' content is never read

    perm = torch.randperm(cells, generator=g)
    while torch.equal(perm, torch.arange(cells)):
        perm = torch.randperm(cells, generator=g)
    more = torch.cat([a, torch.randn(cells, dim, generator=g, dtype=torch.float64)])
    try:
        location(more)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return AddressingResult(cells, perm.tolist(), content(a).tolist(), content(a[perm]).tolist(),
                            location(a).tolist(), location(a[perm]).tolist(), len(content(more)), refused)


def render_addressing(r: AddressingResult, console: Console) -> None:
    from qkv.explain._render import add_row, say, table

    cols = [f"cell {i}" for i in range(r.cells)]
    t = table(f"α over {r.cells} cells; then the cells' content shuffled, a'_i = a_{{P(i)}}, "
              f"P = {r.permutation}  (CS189 Lec 21)", ["addressing", *cols])
    add_row(t, "content: softmax(qᵀa_i/√d)", *(f"{x:.3f}" for x in r.content_before))
    add_row(t, "  after shuffling", *(f"{x:.3f}" for x in r.content_after))
    add_row(t, "location: softmax(W h)", *(f"{x:.3f}" for x in r.location_before))
    add_row(t, "  after shuffling", *(f"{x:.3f}" for x in r.location_after))
    console.print(t)
    say(console, "Content-based weights move with the content (each cell keeps its score); "
        "location-based weights stay on the cell indices, whatever is there: they never read a_i.")
    say(console, f"Given {2 * r.cells} cells: content-based addressing scores all {r.content_more}; "
        f"location-based: {r.location_more}.", "dim")


# --------------------------------------------------------------------------- hard attention


@dataclass
class HardAttentionResult:
    """The exact gradient of E_s[log p(y | a_s)] w.r.t. the attention scores, and each
    estimator's mean and standard deviation over ``trials`` estimates of ``samples`` draws."""

    alpha: list[float]
    log_p: list[float]
    exact: list[float]
    trials: int
    samples: int
    estimates: dict[str, tuple[list[float], float]]  # name -> (mean gradient, mean std per entry)
    # The notes' 2x2 feature map a, b, c, d with weights 0.1, 0.2, 0.7, 0 (CS189 Lec 21): the soft
    # z = 0.1a + 0.2b + 0.7c, how often ``trials`` hard draws pick each cell, and the largest
    # |mean of the drawn vectors − soft z| (the hard z's expectation is the soft z).
    grid_weights: tuple[float, ...] = (0.1, 0.2, 0.7, 0.0)
    grid_cells: list[list[float]] | None = None  # a, b, c, d
    grid_soft: list[float] | None = None
    grid_hard_share: list[float] | None = None
    grid_hard_mean_error: float = 0.0


def explain_hard_attention(cells: int = 5, samples: int = 4, trials: int = 2000, seed: int = 0
                           ) -> HardAttentionResult:
    """One word, ``cells`` locations with scores e (α = softmax(e)) and log p(y | a_i): the
    REINFORCE estimates of ∇_e E_s[log p(y | a_s)], s ~ α, against the exact gradient
    Σ_i ∇α_i log p(y | a_i)."""
    if not 2 <= cells <= 32 or not 2 <= samples <= 64 or not 10 <= trials <= 100_000:
        raise ValueError("cells in [2, 32], samples in [2, 64] and trials in [10, 100000], please")
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(cells, generator=g, dtype=torch.float64)
    alpha = torch.softmax(e, 0)
    logp = -torch.rand(cells, generator=g, dtype=torch.float64) * 4 - 0.1  # log p(y | a_i) < 0
    exact = alpha * (logp - (alpha * logp).sum())  # ∇_e Σ α_i f_i
    marginal = float(torch.log((alpha * logp.exp()).sum()))  # log Σ_i α_i p(y | a_i): fixed per word
    s = torch.multinomial(alpha.expand(trials, -1), samples, replacement=True, generator=g)  # (N, K)
    r = logp[s]
    onehot = torch.nn.functional.one_hot(s, cells).double()  # ∇_e log α_s = onehot - α
    score = onehot - alpha
    baselines = {"no baseline": torch.zeros_like(r),
                 "expected likelihood log Σ α p (fixed, as the soft path's)": torch.full_like(r, marginal),
                 f"leave-one-out over {samples} samples": (r.sum(1, keepdim=True) - r) / (samples - 1)}
    out = {}
    for name, b in baselines.items():
        est = ((r - b)[..., None] * score).mean(1)  # (N, cells): one estimate per trial
        out[name] = (est.mean(0).tolist(), float(est.std(0).mean()))
    w = torch.tensor(HardAttentionResult.grid_weights, dtype=torch.float64)
    cells_abcd = torch.randn(4, 3, generator=g, dtype=torch.float64)  # a, b, c, d: one feature vector each
    soft = w @ cells_abcd
    drawn = torch.multinomial(w, trials, replacement=True, generator=g)
    share = torch.bincount(drawn, minlength=4).double() / trials
    error = float((cells_abcd[drawn].mean(0) - soft).abs().max())
    return HardAttentionResult(alpha.tolist(), logp.tolist(), exact.tolist(), trials, samples, out,
                               grid_cells=cells_abcd.tolist(), grid_soft=soft.tolist(),
                               grid_hard_share=share.tolist(),
                               grid_hard_mean_error=error)


def render_hard_attention(r: HardAttentionResult, console: Console) -> None:
    from qkv.explain._render import add_row, say, table

    if r.grid_soft is not None and r.grid_hard_share is not None:
        t = table("the notes' 2x2 feature map (CS189 Lec 21): soft z = 0.1a + 0.2b + 0.7c vs hard draws",
                  ["", "a", "b", "c", "d"])
        add_row(t, "attention weight", *(f"{x:.1f}" for x in r.grid_weights))
        add_row(t, f"hard: share of {r.trials:,} draws", *(f"{x:.3f}" for x in r.grid_hard_share))
        console.print(t)
        soft = ", ".join(f"{x:.3f}" for x in r.grid_soft)
        say(console, f"Soft attention passes z = 0.1a + 0.2b + 0.7c = [{soft}] (random 3-wide a..d) and is "
            "differentiable; hard attention passes one cell, c seven times in ten, and its average over "
            f"the draws is the soft z (largest difference {r.grid_hard_mean_error:.3f}, shrinking like "
            "1/√draws). Sampling has no gradient: hence REINFORCE below.", "dim")

    cols = [f"e_{i}" for i in range(len(r.alpha))]
    t = table("one word, hard attention: ∇ of E_s[log p(y | a_s)] w.r.t. the scores e, s ~ softmax(e)",
              ["", *cols, "spread (std)"])
    add_row(t, "α", *(f"{x:.3f}" for x in r.alpha), "")
    add_row(t, "log p(y | a_i)", *(f"{x:.2f}" for x in r.log_p), "")
    add_row(t, "exact gradient", *(f"{x:+.3f}" for x in r.exact), "0")
    for name, (mean, std) in r.estimates.items():
        add_row(t, f"REINFORCE, {name}", *(f"{x:+.3f}" for x in mean), f"{std:.3f}")
    console.print(t)
    say(console, f"Each estimate averages {r.samples} sampled locations; means over {r.trials:,} "
        "estimates. Every baseline that does not depend on the sampled location keeps the mean at "
        "the exact gradient (unbiased); a good one shrinks the spread, which is what lets hard "
        "attention learn (`qkv train captioner --attention hard --hard_baseline soft|loo|average`).",
        "dim")
