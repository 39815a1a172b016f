"""CS189 Lecture 21's exercises, from CNNs to attention: a convolution by hand and the receptive
field of a stack of them, TF-IDF, one step of an RNN, Show, Attend and Tell's doubly stochastic
penalty, the REINFORCE gradient of hard attention, and location-based addressing.

Same rules as :mod:`qkv.learn.catalog`: every check compares with an independent reference
written here (PyTorch's own ops such as ``F.conv1d`` and ``nn.RNNCell``, autograd in float64, a
receptive field measured by a gradient through real ``nn.Conv1d`` layers, the lecture's numbers),
runs the smallest input first, and names the likely cause of a recognisable mistake.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.learn.exercise import CheckError, Exercise, check, close, forbid, gen, gradcheck, pair, randn, show


def _pair(got: Any, what: str) -> tuple[Any, Any]:
    return pair(got, what, "(context, weights)")


# --------------------------------------------------------------------------- conv1d

S_CNN = "Why not an MLP on pixels; CNNs see locally, only the top layer sees everything"


def _conv_inputs(
    B: int, C_in: int, C_out: int, L: int, k: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        randn(B, C_in, L, seed=seed, dtype=dtype),
        randn(C_out, C_in, k, seed=seed + 1, dtype=dtype),
        randn(C_out, seed=seed + 2, dtype=dtype),
    )


@check("against F.conv1d (valid padding, stride 1; float64, random), from one channel up")
def _conv_values(f) -> None:
    # (B, C_in, C_out, L, k): one channel first, then k = 1, many channels, a kernel as long as x
    for dims, seed in (
        ((1, 1, 1, 4, 3), 0),
        ((1, 1, 1, 5, 1), 10),
        ((2, 3, 4, 7, 3), 20),
        ((2, 2, 3, 6, 6), 30),
    ):
        x, w, b = _conv_inputs(*dims, seed=seed)
        L, k = dims[3], dims[4]
        inputs = f"x {tuple(x.shape)}, w {tuple(w.shape)}, b {tuple(b.shape)}"
        got = f(x, w, b)
        if isinstance(got, Tensor) and got.ndim == 3 and k > 1 and got.shape[-1] in (L, L + k - 1):
            raise CheckError(
                f"conv1d for {inputs} has length {got.shape[-1]}, expected L − k + 1 = {L - k + 1}: "
                "that is zero padding ('same' or 'full'); valid padding places the kernel only where "
                "it fits inside x"
            )
        close(
            got,
            F.conv1d(x, w, b),
            "conv1d(x, w, b)",
            inputs,
            causes=[
                (
                    F.conv1d(x, w.flip(-1), b),
                    "the kernel is flipped (the textbook convolution); a CNN's 'convolution' is a "
                    "cross-correlation: y[n, o, t] = b[o] + Σ_c Σ_j w[o, c, j] x[n, c, t + j]",
                ),
                (F.conv1d(x, w), "the bias is missing: add b[o] to every position of output channel o"),
            ],
        )


@check("b=None (no bias); float32 in, float32 out")
def _conv_no_bias(f) -> None:
    x, w, _ = _conv_inputs(2, 3, 2, 8, 3, seed=40, dtype=torch.float32)
    close(
        f(x, w, None),
        F.conv1d(x, w),
        "conv1d(x, w, None)",
        "float32 x (2, 3, 8), w (2, 3, 3)",
        rtol=1e-5,
        atol=1e-6,
    )


@check("its gradients with respect to x, w and b (gradcheck, float64)")
def _conv_grad(f) -> None:
    gradcheck(f, _conv_inputs(1, 2, 2, 5, 3, seed=50), "conv1d")


CONV_FORBIDDEN = ("conv1d", "conv2d", "conv_transpose1d", "convolution", "Conv1d", "Conv2d", "unfold")

CONV1D = Exercise(
    name="conv1d",
    section=S_CNN,
    difficulty=2,
    signature="(x, w, b=None)",
    stub="""
A 1-D convolution layer by hand, as a CNN computes it (a cross-correlation: the kernel is not
flipped):

    y[n, o, t] = b[o] + Σ_c Σ_j w[o, c, j] · x[n, c, t + j]     (c over C_in, j over 0..k-1)

Args: x (B, C_in, L), w (C_out, C_in, k), b (C_out,) or None (no bias). Valid padding and stride 1:
the kernel is placed only where it fits, so y is (B, C_out, L − k + 1). Keep x's dtype.
Do not call F.conv1d, F.conv2d, nn.Conv1d or unfold: write the sum (a loop over the k taps of
the kernel is fine).

Example: x = [[[1, 2, 3, 4]]], w = [[[1, 0, -1]]], b = [0] -> [[[-2, -2]]]
(a flipped kernel would give [2, 2]).
(CS189 Lec 21: a convolution shares one small kernel over every position, C_out·C_in·k weights
whatever L, where an MLP on P pixels needs P²; but each output sees only k neighbours.)
""",
    checks=(_conv_values, _conv_no_bias, _conv_grad, forbid(*CONV_FORBIDDEN)),
    hints=(
        "The output has L_out = L − k + 1 positions; output t reads x[..., t : t + k].",
        "Loop over the k taps: y += torch.einsum('oc,nct->not', w[:, :, j], x[:, :, j : j + L_out]) "
        "for j in range(k).",
        "Add the bias last, broadcast over batch and positions: b[None, :, None].",
    ),
    see="qkv explain cnn",
    forbidden=CONV_FORBIDDEN,
    solution="""
def conv1d(x, w, b=None):
    k = w.shape[-1]
    L_out = x.shape[-1] - k + 1
    y = sum(torch.einsum("oc,nct->not", w[:, :, j], x[:, :, j:j + L_out]) for j in range(k))
    if b is not None:
        y = y + b[None, :, None]
    return y
""",
)


# --------------------------------------------------------------------------- receptive field


def _measured_receptive_field(n_layers: int, k: int) -> int:
    """Input positions with a non-zero gradient at output 0 of ``n_layers`` stacked
    nn.Conv1d(1, 1, k) (stride 1, weights all 1 so that nothing cancels): measured, not assumed."""
    net = nn.Sequential(*[nn.Conv1d(1, 1, k, bias=False) for _ in range(n_layers)]).double()
    for conv in net:
        nn.init.constant_(conv.weight, 1.0)
    net.requires_grad_(False)  # only the input's gradient is wanted
    x = torch.zeros(1, 1, n_layers * k + 8, dtype=torch.float64, requires_grad=True)  # long enough
    net(x)[0, 0, 0].backward()
    return int((x.grad != 0).sum())


def _as_int(got: Any, call: str) -> int:
    try:
        value = float(got)
    except (TypeError, ValueError, RuntimeError):
        raise CheckError(f"{call} should return a number (an int), got {type(got).__name__}") from None
    if not math.isfinite(value) or value != int(value):
        raise CheckError(f"{call} = {value}: a number of input positions is a whole number")
    return int(value)


_RF_MISTAKES: tuple[tuple[Callable[[int, int], int], str], ...] = (
    (
        lambda n, k: n * k,
        "each layer adds k − 1 new positions, not k: neighbouring windows overlap "
        "(one layer sees k, two see k + (k − 1))",
    ),
    (lambda n, k: k**n, "it grows linearly with the layers at stride 1; k^n would need stride k"),
    (lambda n, k: 2 * n + 1, "2n + 1 holds for the lecture's width 3 only; a width-k layer adds k − 1"),
    (
        lambda n, k: n * (k - 1),
        "off by one: zero layers see 1 position (the output is its input), so "
        "count the one position you start from",
    ),
)


def _rf_check(f, pairs: list[tuple[int, int]], title: str) -> None:
    got = {(n, k): _as_int(f(n, k), f"receptive_field({n}, {k})") for n, k in pairs}
    want = {(n, k): _measured_receptive_field(n, k) for n, k in pairs}
    wrong = [p for p in pairs if got[p] != want[p]]
    if not wrong:
        return
    n, k = wrong[0]
    why = next((why for mistake, why in _RF_MISTAKES if all(got[p] == mistake(*p) for p in pairs)), "")
    stack = f"{n} stacked nn.Conv1d(1, 1, {k})" if n else "no layer (the output is the input itself)"
    positions = f"{want[(n, k)]} input position" + ("s have" if want[(n, k)] != 1 else " has")
    raise CheckError(
        f"receptive_field({n}, {k}) = {got[(n, k)]}, but {positions} a non-zero gradient at one output "
        f"of {stack} ({title})" + (f": {why}" if why else "")
    )


@check("the lecture's width-3 stacks: 1, 2, 3 layers; 14 layers to see a 28-pixel side (Fashion-MNIST)")
def _rf_lecture(f) -> None:
    _rf_check(f, [(1, 3), (2, 3), (3, 3), (4, 3)], "width 3, the lecture's")
    small, enough = _as_int(f(13, 3), "receptive_field(13, 3)"), _as_int(f(14, 3), "receptive_field(14, 3)")
    if not small < 28 <= enough:
        raise CheckError(
            f"receptive_field(13, 3) = {small} and receptive_field(14, 3) = {enough}: `qkv explain cnn` "
            "measures that a 28-pixel side (Fashion-MNIST) is first seen whole after 14 width-3 layers"
        )


@check("against the receptive field measured by a gradient through stacked nn.Conv1d (0-5 layers, k = 1-7)")
def _rf_measured(f) -> None:
    pairs = sorted(((n, k) for n in range(6) for k in (1, 2, 3, 5, 7)), key=lambda p: (p[0] * p[1], p))
    _rf_check(f, pairs, "measured")


RECEPTIVE_FIELD = Exercise(
    name="receptive_field",
    section=S_CNN,
    difficulty=1,
    signature="(n_layers, kernel_size)",
    stub="""
The receptive field of a stack of convolutions: how many input positions ONE output of
``n_layers`` stacked convolutions of width ``kernel_size`` (stride 1, no dilation, 1-D) depends on.

One layer's output sees kernel_size neighbouring inputs; a second layer's output sees
kernel_size outputs of the first, whose windows overlap. Returns an int. Zero layers: the
output is the input itself, 1 position.

Example: width-3 convolutions (the lecture's): 1 layer sees 3 positions, 2 layers see 5.
(CS189 Lec 21: CNNs see locally; only the top of a deep stack sees the whole image, and
`qkv explain cnn` measures it with a gradient.)
""",
    checks=(_rf_lecture, _rf_measured),
    hints=(
        "Draw it: 2 layers of width 3. The top output reads 3 middle positions; the outer two each "
        "add one new input on their side.",
        "Each extra layer widens the field by kernel_size − 1.",
    ),
    see="qkv explain cnn",
    solution="""
def receptive_field(n_layers, kernel_size):
    return n_layers * (kernel_size - 1) + 1
""",
)


# --------------------------------------------------------------------------- TF-IDF

S_TFIDF = "Documents as vectors: bag of words, TF-IDF (tf 2/100, idf log(1000/300))"


def ref_tf_idf(counts: Tensor) -> Tensor:
    c = counts.double()
    n_docs = c.shape[0]
    df = (c > 0).sum(0).double()
    idf = torch.where(df > 0, torch.log(n_docs / df.clamp_min(1)), torch.zeros_like(df))
    length = c.sum(1, keepdim=True)
    tf = c / length.where(length > 0, torch.ones_like(length))  # an empty document: 0 / 1
    return (tf * idf).to(counts.dtype)


def _tfidf_variants(counts: Tensor) -> dict[str, Tensor]:
    """What the common mistakes give (float64): log10, raw counts, df counting occurrences, the
    idf upside down, scikit-learn's smoothed idf."""
    c = counts.double()
    n_docs, length = c.shape[0], c.sum(1, keepdim=True).clamp_min(1)
    df_seen = (c > 0).sum(0).double()
    df = df_seen.clamp_min(1)
    occurrences = c.sum(0).clamp_min(1)
    return {
        "log10": c / length * torch.log10(n_docs / df),
        "raw": c * torch.log(n_docs / df),
        "occurrences": c / length * torch.log(n_docs / occurrences),
        "inverted": c / length * torch.log(df / n_docs),
        "smoothed": c / length * (torch.log((1 + n_docs) / (1 + df_seen)) + 1),
    }


_TFIDF_WHY = {
    "log10": "the idf uses log10; the lecture's log is the natural log (torch.log)",
    "raw": "tf is the raw count; it is the count divided by the document's number of words",
    "occurrences": "df counts occurrences of the word; it counts the documents that contain it "
    "(counts > 0), however often",
    "inverted": "the idf is log(df / N); it is log(N / df), large for rare words",
    "smoothed": "the idf is smoothed (scikit-learn's ln((1 + N) / (1 + df)) + 1); the lecture's is "
    "ln(N / df), 0 for a word in every document",
}


def _football_counts() -> Tensor:
    """The lecture's corpus: 1000 documents over (football, the, goal); document 0 has 100 words
    with football twice; football is in 300 documents (3 times in each of the other 299)."""
    i = torch.arange(1000, dtype=torch.float64)
    football = torch.where(i < 300, 3.0, 0.0)
    football[0] = 2.0
    the = 5.0 + i % 7  # in every document
    goal = torch.where(i % 4 == 0, 1.0 + i % 3, 0.0)
    goal[0] = 98.0 - the[0]
    return torch.stack([football, the, goal], 1)


@check("the lecture's example: football twice in a 100-word document, in 300 of 1000 documents")
def _tfidf_lecture(f) -> None:
    counts = _football_counts()
    got = torch.as_tensor(f(counts))
    want = 0.02 * math.log(1000 / 300)
    value = float(got[0, 0]) if got.shape == counts.shape else float("nan")
    if not abs(value - want) < 1e-9:
        mistakes = {k: float(v[0, 0]) for k, v in _tfidf_variants(counts).items()}
        why = next((_TFIDF_WHY[k] for k, v in mistakes.items() if abs(value - v) < 1e-9), "")
        raise CheckError(
            f"tf-idf of football in document 0 = {value:.6g}, expected tf · idf = 2/100 · ln(1000/300) "
            f"= 0.02 · {math.log(1000 / 300):.5f} = {want:.6f}" + (f": {why}" if why else "")
        )
    close(got, ref_tf_idf(counts), "tf_idf(counts)", "the lecture's 1000 documents (football, the, goal)")


@check("random counts (float64 and float32) against tf · ln(N / df)")
def _tfidf_random(f) -> None:
    for shape, seed, dtype in (
        ((3, 4), 1, torch.float64),
        ((6, 9), 2, torch.float64),
        ((5, 7), 3, torch.float32),
    ):
        counts = torch.randint(0, 4, shape, generator=gen(seed)).to(dtype)
        counts[:, 0] += 1  # no empty document here (see the next check)
        causes = [(v.to(dtype), _TFIDF_WHY[k]) for k, v in _tfidf_variants(counts).items()]
        close(
            f(counts),
            ref_tf_idf(counts),
            "tf_idf(counts)",
            f"counts = {show(counts)} ({dtype})",
            rtol=1e-5 if dtype == torch.float32 else 1e-7,
            atol=1e-7,
            causes=causes,
        )


@check("a word in no document and an empty document give 0, not NaN; a word in every document, 0")
def _tfidf_edges(f) -> None:
    counts = torch.tensor(
        [[2.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 3.0, 0.0]], dtype=torch.float64
    )
    got = f(counts)
    if isinstance(got, Tensor) and got.shape == counts.shape and torch.isnan(got).any():
        if torch.isnan(got[:, 1]).any():
            raise CheckError(
                f"counts = {show(counts)}: word 1 is in no document, so df = 0 and idf = ln(N / 0) = inf; "
                "its tf is 0 and 0 · inf = NaN. The convention: such a word gets 0 (torch.where(df > 0, ...))"
            )
        raise CheckError(
            f"counts = {show(counts)}: document 1 has no words, so tf = 0 / 0 = NaN; the convention: an "
            "empty document's row is 0"
        )
    close(got, ref_tf_idf(counts), "tf_idf(counts)", f"counts = {show(counts)}")
    common = torch.tensor([[1.0, 2.0], [3.0, 0.0], [2.0, 1.0]], dtype=torch.float64)  # word 0 everywhere
    close(
        f(common),
        ref_tf_idf(common),
        "tf_idf(counts)",
        f"counts = {show(common)} (word 0, like 'the', is in every document: idf = ln(3/3) = 0)",
        causes=[(_tfidf_variants(common)["smoothed"], _TFIDF_WHY["smoothed"])],
    )


TF_IDF = Exercise(
    name="tf_idf",
    section=S_TFIDF,
    difficulty=1,
    signature="(counts)",
    stub="""
TF-IDF vectors of documents from their word counts (CS189 Lec 21): a word's weight in a document
is how much of the document it is (tf) times how rare it is across documents (idf), so that
common words (the, and) do not dominate.

    tf[d, w]  = counts[d, w] / Σ_w' counts[d, w']        (the share of document d's words that are w)
    idf[w]    = ln(N / df[w]),  df[w] = the number of documents d with counts[d, w] > 0
    out[d, w] = tf[d, w] · idf[w]

Args: counts (N, V) float: one bag of words per row (N documents, V words). Returns (N, V),
counts' dtype. The natural log, as the lecture. Conventions: a word in no document (df = 0) gets
0, not NaN; an empty document gets a row of 0; a word in every document gets idf = ln 1 = 0.

Example (the lecture's): football twice in a 100-word document, and in 300 of 1000 documents:
tf = 2/100 = 0.02, idf = ln(1000/300) = 1.2040, tf · idf = 0.02408.
""",
    checks=(_tfidf_lecture, _tfidf_random, _tfidf_edges),
    hints=(
        "tf: divide each row by its sum (sum(1, keepdim=True)); df: (counts > 0).sum(0).",
        "idf = torch.log(N / df) with N = counts.shape[0] (natural log).",
        "Guard the zeros: torch.where(df > 0, idf, 0) and a row sum of 0 replaced by 1 before dividing.",
    ),
    see="qkv explain retrieval --no-minilm",
    solution="""
def tf_idf(counts):
    n_docs = counts.shape[0]
    df = (counts > 0).sum(0).to(counts.dtype)
    idf = torch.where(df > 0, torch.log(n_docs / df.clamp_min(1)), torch.zeros_like(df))
    length = counts.sum(1, keepdim=True)
    tf = counts / torch.where(length > 0, length, torch.ones_like(length))
    return tf * idf
""",
)


# --------------------------------------------------------------------------- RNN step

S_RNN = "RNNs; captioning as CNN features -> RNN, word by word"


def _rnn_weights(
    D: int, H: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        randn(D, H, seed=seed, dtype=dtype) * 0.6,
        randn(H, H, seed=seed + 1, dtype=dtype) * 0.6,
        randn(H, seed=seed + 2, dtype=dtype) * 0.5,
    )


def _torch_rnn(w_xh: Tensor, w_hh: Tensor, b: Tensor) -> nn.RNN:
    """PyTorch's own RNN with our weights: weight_ih = W_xhᵀ (it computes x W_ihᵀ), one bias."""
    D, H = w_xh.shape
    rnn = nn.RNN(D, H, nonlinearity="tanh", batch_first=True).to(w_xh.dtype)
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(w_xh.T)
        rnn.weight_hh_l0.copy_(w_hh.T)
        rnn.bias_ih_l0.copy_(b)
        rnn.bias_hh_l0.zero_()
    return rnn


def ref_rnn_cell(x: Tensor, h: Tensor, w_xh: Tensor, w_hh: Tensor, b: Tensor) -> Tensor:
    D, H = w_xh.shape
    cell = nn.RNNCell(D, H, nonlinearity="tanh").double()
    with torch.no_grad():
        cell.weight_ih.copy_(w_xh.T)
        cell.weight_hh.copy_(w_hh.T)
        cell.bias_ih.copy_(b)
        cell.bias_hh.zero_()
        return cell(x.double(), h.double()).to(x.dtype)


@check("against nn.RNNCell (weight_ih = W_xhᵀ, weight_hh = W_hhᵀ; float64, random)")
def _rnn_values(f) -> None:
    # (B, D, H): D = H first, so that a swapped or transposed weight still runs and can be named
    for (B, D, H), seed in (((1, 2, 2), 0), ((3, 4, 4), 10), ((2, 3, 5), 20)):
        x, h = randn(B, D, seed=seed + 5), randn(B, H, seed=seed + 6) * 0.5
        w_xh, w_hh, b = _rnn_weights(D, H, seed)
        pre = x @ w_xh + h @ w_hh + b
        causes = [
            (
                pre,
                "the tanh is missing: h' = tanh(x W_xh + h W_hh + b); without it the steps compose "
                "into one linear map, and h can grow without bound",
            ),
            (torch.sigmoid(pre), "the non-linearity is a sigmoid; a vanilla RNN (and nn.RNNCell) uses tanh"),
        ]
        if D == H:
            causes += [
                (
                    torch.tanh(x @ w_hh + h @ w_xh + b),
                    "the weights are swapped: the input x is multiplied by W_xh, the previous state h "
                    "by W_hh",
                ),
                (
                    torch.tanh(x @ w_xh.T + h @ w_hh.T + b),
                    "the weights are transposed: with W_xh of shape (D, H) the product is x @ w_xh "
                    "(nn.RNNCell stores Wᵀ and computes x @ weight_ih.T)",
                ),
            ]
        close(
            f(x, h, w_xh, w_hh, b),
            ref_rnn_cell(x, h, w_xh, w_hh, b),
            "rnn_step(x, h, w_xh, w_hh, b)",
            f"B, D, H = {B}, {D}, {H}",
            causes=causes,
        )


@check("word by word: 6 steps from h₀ = 0 equal nn.RNN's states at every step (float64 and float32)")
def _rnn_unrolled(f) -> None:
    for dtype, seed in ((torch.float64, 30), (torch.float32, 40)):
        B, T, D, H = 2, 6, 3, 4
        xs = randn(B, T, D, seed=seed, dtype=dtype)
        w_xh, w_hh, b = _rnn_weights(D, H, seed + 1, dtype)
        with torch.no_grad():
            want, _ = _torch_rnn(w_xh, w_hh, b)(xs)  # (B, T, H)
        h = torch.zeros(B, H, dtype=dtype)
        for t in range(T):
            h = f(xs[:, t], h, w_xh, w_hh, b)
            close(
                h,
                want[:, t],
                f"the state after word {t + 1}",
                f"a {dtype} sequence of {T} inputs, h₀ = 0",
                rtol=1e-5 if dtype == torch.float32 else 1e-7,
                atol=1e-6 if dtype == torch.float32 else 1e-9,
            )


@check("its gradients with respect to x, h and the weights (gradcheck, float64)")
def _rnn_grad(f) -> None:
    gradcheck(f, (randn(2, 3, seed=50), randn(2, 4, seed=51), *_rnn_weights(3, 4, seed=52)), "rnn_step")


RNN_FORBIDDEN = ("RNNCell", "RNN", "rnn_tanh_cell", "rnn_tanh")

RNN_STEP = Exercise(
    name="rnn_step",
    section=S_RNN,
    difficulty=1,
    signature="(x, h, w_xh, w_hh, b)",
    stub="""
One step of a vanilla (Elman) RNN: the new hidden state from this step's input and the previous
state,

    h' = tanh(x W_xh + h W_hh + b)

Args: x (B, D) this step's input (a word's embedding; in the lecture's captioner the CNN's image
features start the sequence), h (B, H) the previous state, w_xh (D, H), w_hh (H, H), b (H,).
Returns h' (B, H) in x's dtype. A sentence is read (or written) word by word:
h_1 = rnn_step(x_1, h_0, ...), h_2 = rnn_step(x_2, h_1, ...), the same weights at every step.
Do not call nn.RNN or nn.RNNCell (they compute the same with weight_ih = W_xhᵀ, weight_hh = W_hhᵀ).

Example: x = [[1, 0]], h = [[0, 0]], w_xh = w_hh = I, b = 0 -> [[tanh 1, 0]] = [[0.7616, 0]]
(CS189 Lec 21: an RNN feeds its state back in as it iterates; Elman 1990.)
""",
    checks=(_rnn_values, _rnn_unrolled, _rnn_grad, forbid(*RNN_FORBIDDEN)),
    hints=(
        "Two matrix products, both (B, H): x @ w_xh and h @ w_hh; the bias broadcasts over B.",
        "Then torch.tanh of the sum: without it the state is a linear function of all past inputs.",
    ),
    see="qkv train captioner --attention uniform",
    forbidden=RNN_FORBIDDEN,
    solution="""
def rnn_step(x, h, w_xh, w_hh, b):
    return torch.tanh(x @ w_xh + h @ w_hh + b)
""",
)


# --------------------------------------------------------------------------- doubly stochastic penalty

S_SOFT = "Soft attention for captioning (Show, Attend and Tell): one distribution per word"


def ref_penalty(alphas: Tensor, valid: Tensor | None = None) -> Tensor:
    a = alphas.double()
    if valid is not None:
        a = a * valid.double()[..., None]
    return ((1 - a.sum(1)) ** 2).sum(-1).mean().to(alphas.dtype)


def _alphas(B: int, T: int, L: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.softmax(randn(B, T, L, seed=seed) * 2, -1).to(dtype)  # one distribution per word


def _penalty_causes(a: Tensor) -> list[tuple[Tensor, str]]:
    cover = a.double().sum(1)  # (B, L): Σ_t α_ti
    per_caption = ((1 - cover) ** 2).sum(-1)
    causes = [
        (
            ((1 - a.double().sum(-1)) ** 2).sum(-1).mean(),
            "it sums α over the cells for each word, which is 1 by construction (the softmax); the penalty "
            "sums over the WORDS for each cell, Σ_t α_ti, and asks that to be near 1",
        ),
        (((1 - cover) ** 2).mean(-1).mean(), "it averages over the cells; Xu et al. sum over them: Σ_i"),
        (per_caption.sum(), "it sums over the batch; the convention here is the mean over the B captions"),
        (
            (1 - cover).sum(-1).mean(),
            "the square is missing: (1 − Σ_t α_ti)²; without it the sum is L − T whatever the attention does",
        ),
        ((1 - cover).abs().sum(-1).mean(), "it takes |1 − Σ_t α_ti|; the penalty squares it"),
    ]
    # Two mistakes that give the same number here (both 0 when T = L) are named together.
    merged: list[tuple[Tensor, str]] = []
    for value, why in causes:
        same = next((i for i, (v, _) in enumerate(merged) if torch.allclose(v, value, atol=1e-9)), None)
        if same is None:
            merged.append((value, why))
        else:
            merged[same] = (value, f"{merged[same][1]}; or else {why}")
    return merged


@check("hand examples: α = [[0.9, 0.1], [0.8, 0.2]] gives 0.98; each cell once gives 0")
def _penalty_hand(f) -> None:
    for rows, want in (
        ([[0.9, 0.1], [0.8, 0.2]], 0.98),
        ([[1.0, 0.0], [0.0, 1.0]], 0.0),
        ([[0.5, 0.5], [0.5, 0.5]], 0.0),
        ([[1.0, 0.0], [1.0, 0.0]], 2.0),
    ):
        a = torch.tensor([rows], dtype=torch.float64)
        close(
            f(a),
            torch.tensor(want, dtype=torch.float64),
            "doubly_stochastic_penalty(alphas)",
            f"one caption of 2 words over 2 cells, alphas = {rows}",
            causes=_penalty_causes(a),
        )


@check("random attention (float64 and float32) against mean over captions of Σ_i (1 − Σ_t α_ti)²")
def _penalty_values(f) -> None:
    for (B, T, L), seed, dtype in (
        ((1, 3, 4), 1, torch.float64),
        ((2, 5, 3), 2, torch.float64),
        ((4, 6, 9), 3, torch.float32),
    ):
        a = _alphas(B, T, L, seed, dtype)
        close(
            f(a),
            ref_penalty(a),
            "doubly_stochastic_penalty(alphas)",
            f"alphas (B, T, L) = {(B, T, L)}, {dtype}",
            rtol=1e-5 if dtype == torch.float32 else 1e-7,
            causes=[(c.to(dtype), w) for c, w in _penalty_causes(a)],
        )


@check("valid: the padded words after a caption's end do not count")
def _penalty_valid(f) -> None:
    a = _alphas(3, 5, 4, seed=4)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False], [True, False, False, False, False]])
    close(
        f(a, valid),
        ref_penalty(a, valid),
        "doubly_stochastic_penalty(alphas, valid)",
        f"3 captions of 5, 3 and 1 words (valid = {show(valid)})",
        causes=[
            (
                ref_penalty(a),
                "valid is ignored: a padded word's α must not count in Σ_t α_ti "
                "(multiply α by valid[..., None] first)",
            )
        ],
    )
    close(
        f(a, None), ref_penalty(a), "doubly_stochastic_penalty(alphas, None)", "valid=None: every word counts"
    )


@check("its gradient (gradcheck, float64)")
def _penalty_grad(f) -> None:
    gradcheck(f, (_alphas(2, 3, 4, seed=5),), "doubly_stochastic_penalty")


DOUBLY_STOCHASTIC = Exercise(
    name="doubly_stochastic_penalty",
    section=S_SOFT,
    difficulty=2,
    signature="(alphas, valid=None)",
    stub="""
Show, Attend and Tell's doubly stochastic regulariser (Xu et al. 2015, §4.2.1, eq. 14 without its λ).

At each word t the captioner outputs a distribution α_t over the L cells of the CNN's feature
map (Σ_i α_ti = 1: one distribution per word). The penalty asks the other sum to be about 1 too,
so that over a caption every cell is looked at about once in all:

    P = Σ_i (1 − Σ_t α_ti)²        (for one caption: summed over the cells i)

Args: alphas (B, T, L): B captions, T words, L cells; each alphas[n, t] sums to 1 over the cells.
valid: optional (B, T) bool, True for the real words of a caption and False for the padding after
its end: a padded word's α does not count in Σ_t. Returns a 0-dim tensor: P averaged over the B
captions (the mean over the batch), in alphas' dtype.

Example: one caption of T = 2 words over L = 2 cells, α = [[0.9, 0.1], [0.8, 0.2]]:
Σ_t α = [1.7, 0.3] and P = 0.7² + 0.7² = 0.98; α = [[1, 0], [0, 1]] (each cell once): P = 0.
(CS189 Lec 21; qkv's captioner adds λ/L times it to its loss: --doubly_stochastic.)
""",
    checks=(_penalty_hand, _penalty_values, _penalty_valid, _penalty_grad),
    hints=(
        "Σ_t α_ti is a sum over the words, dim 1: (B, T, L) -> (B, L), one total per cell.",
        "((1 - total) ** 2).sum(-1) is P per caption (B,); .mean() over the batch.",
        "With valid: alphas * valid[..., None] zeroes the padded words before the sum.",
    ),
    see="qkv train captioner",
    solution="""
def doubly_stochastic_penalty(alphas, valid=None):
    if valid is not None:
        alphas = alphas * valid[..., None].to(alphas.dtype)
    return ((1 - alphas.sum(1)) ** 2).sum(-1).mean()
""",
)


# --------------------------------------------------------------------------- REINFORCE

S_HARD = "Soft vs hard attention: z = 0.1a + 0.2b + 0.7c vs a sampled cell; REINFORCE"


def ref_reinforce(logits: Tensor, sampled: Tensor, reward: Tensor, baseline: float | Tensor) -> Tensor:
    """∂/∂logits of (r − b) · log softmax(logits)[s], by autograd in float64."""
    lg = logits.detach().double().requires_grad_()
    log_p = torch.log_softmax(lg, -1).gather(-1, sampled[:, None]).squeeze(-1)
    r = torch.as_tensor(reward, dtype=torch.float64)
    b = torch.as_tensor(baseline, dtype=torch.float64)
    ((r - b) * log_p).sum().backward()
    assert lg.grad is not None
    return lg.grad.to(logits.dtype)


def _reinforce_causes(
    logits: Tensor, sampled: Tensor, reward: Tensor, baseline: float | Tensor
) -> list[tuple[Tensor, str]]:
    p = torch.softmax(logits.double(), -1)
    onehot = F.one_hot(sampled, logits.shape[-1]).double()
    scale = (reward.double() - torch.as_tensor(baseline, dtype=torch.float64))[:, None]
    out = [
        (scale * (p - onehot), "the sign is flipped: ∂ log p_s / ∂ logits = onehot(s) − softmax(logits)"),
        (
            scale * onehot,
            "only the sampled logit moves; every logit is in the softmax's normaliser, so "
            "∂ log p_s / ∂ logits = onehot(s) − softmax(logits)",
        ),
        (
            scale * onehot / p,
            "that is the gradient with respect to the probabilities (onehot(s) / p_s); the "
            "logits' is onehot(s) − softmax(logits)",
        ),
    ]
    if float(torch.as_tensor(baseline).abs().max()) > 0:
        out.append((reward.double()[:, None] * (onehot - p), "the baseline is not subtracted: (r − b)"))
    return out


@check("the lecture's cells: p = (0.1, 0.2, 0.7) over a, b, c; c drawn gives [−0.1, −0.2, 0.3] for r = 1")
def _reinforce_lecture(f) -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.1, 0.2, 0.7]], dtype=torch.float64))
    sampled, reward = torch.tensor([2, 0]), torch.tensor([1.0, 1.0], dtype=torch.float64)
    close(
        f(logits, sampled, reward, 0.0),
        ref_reinforce(logits, sampled, reward, 0.0),
        "reinforce_gradient(logits, sampled, reward)",
        "logits = log [0.1, 0.2, 0.7] (cells a, b, c), c drawn in row 0 and a in row 1, r = 1, b = 0",
        causes=_reinforce_causes(logits, sampled, reward, 0.0),
    )


@check(
    "against autograd of (r − b) · log softmax(logits)[s] (random; a float and a per-row baseline; float32)"
)
def _reinforce_values(f) -> None:
    for (B, L), seed, baseline, dtype in (
        ((1, 2), 1, 0.0, torch.float64),
        ((5, 6), 2, 0.5, torch.float64),
        ((4, 3), 3, None, torch.float64),
        ((6, 5), 4, 0.25, torch.float32),
    ):
        logits = randn(B, L, seed=seed, dtype=dtype)
        sampled = torch.randint(0, L, (B,), generator=gen(seed + 10))
        reward = randn(B, seed=seed + 20, dtype=dtype) + 1
        b: float | Tensor = randn(B, seed=seed + 30, dtype=dtype) if baseline is None else baseline
        what = "a per-row baseline (B,)" if baseline is None else f"baseline {baseline}"
        close(
            f(logits, sampled, reward, b),
            ref_reinforce(logits, sampled, reward, b),
            "reinforce_gradient(logits, sampled, reward, baseline)",
            f"B, L = {B}, {L}, {what}, {dtype}",
            rtol=1e-5 if dtype == torch.float32 else 1e-7,
            atol=1e-7,
            causes=[(c.to(dtype), w) for c, w in _reinforce_causes(logits, sampled, reward, b)],
        )


@check(
    "unbiased: its mean over 20,000 draws ≈ the exact ∂/∂logits Σ_i p_i r_i; a baseline b = Σ p r "
    "keeps the mean and shrinks the spread"
)
def _reinforce_unbiased(f) -> None:
    N = 20_000
    logits = randn(1, 4, seed=5)
    # a reward per cell in [4, 6]: far from 0, so that subtracting b = Σ p r shrinks the spread for
    # certain (it does whenever b < 2 Σ_s w_s r_s for any weights w; here b <= 6 < 8)
    r_cell = 5.0 + 2 * torch.rand(4, generator=gen(6), dtype=torch.float64) - 1
    lg = logits.clone().requires_grad_()
    (torch.softmax(lg, -1)[0] * r_cell).sum().backward()  # the exact gradient of E[r], float64
    assert lg.grad is not None
    exact = lg.grad[0]
    p = torch.softmax(logits[0], -1)
    s = torch.multinomial(p, N, replacement=True, generator=gen(7))
    expected = float(p @ r_cell)
    spreads = []
    for b in (0.0, expected):
        est = torch.as_tensor(f(logits.expand(N, 4), s, r_cell[s], b)).double()
        ref = ref_reinforce(logits.expand(N, 4), s, r_cell[s], b)
        if est.shape != (N, 4):
            raise CheckError(
                f"reinforce_gradient on {N} rows of 4 cells has shape {tuple(est.shape)}, expected {(N, 4)}"
            )
        tol = 5 * torch.maximum(ref.std(0), est.std(0)) / math.sqrt(N) + 1e-9  # a z-test at 5σ
        if ((est.mean(0) - exact).abs() > tol).any():
            raise CheckError(
                f"with baseline {b:.3f}, the mean of your estimates over {N:,} draws is {show(est.mean(0))}, "
                f"the exact gradient of Σ p_i r_i is {show(exact)} (to ±{float(tol.max()):.3f}): the "
                "estimate must be unbiased, E[(r − b)(onehot(s) − p)] = ∂ E[r] / ∂ logits"
            )
        spreads.append(float(est.std(0).mean()))
    if not spreads[1] < spreads[0]:
        raise CheckError(
            f"the spread of the estimates is {spreads[0]:.3f} without a baseline and {spreads[1]:.3f} "
            f"with b = Σ p r = {expected:.3f}: it should shrink (subtract the baseline from r)"
        )


REINFORCE = Exercise(
    name="reinforce_gradient",
    section=S_HARD,
    difficulty=2,
    signature="(logits, sampled, reward, baseline=0.0)",
    stub="""
Hard attention (CS189 Lec 21): instead of the soft average z = 0.1a + 0.2b + 0.7c of the cells,
draw ONE cell s ~ p = softmax(logits) and read it. Sampling has no gradient, so REINFORCE
(Williams 1992) estimates the gradient of the expected reward E_s[r] = Σ_i p_i r_i from the draw:

    ĝ = (r − b) · ∂ log p_s / ∂ logits = (r − b) · (onehot(s) − softmax(logits))

Its mean over draws is the exact gradient (unbiased) for any baseline b that does not depend on
s; a good b (such as the expected reward) makes it vary less.

Args: logits (B, L): one row per word (or per draw) over L cells; sampled (B,) int64: the cell
drawn in each row; reward (B,): that row's reward r; baseline b: a float or a (B,) tensor.
Returns ĝ (B, L) in logits' dtype. Do not call backward or torch.autograd.grad: write the formula.

Example: the lecture's weights p = (0.1, 0.2, 0.7) over cells (a, b, c), logits = log p; c drawn,
r = 1, b = 0: ĝ = [-0.1, -0.2, 0.3] (c pushed up, a and b down); a drawn: [0.9, -0.2, -0.7].
""",
    checks=(_reinforce_lecture, _reinforce_values, _reinforce_unbiased, forbid("backward", "grad")),
    hints=(
        "log p_s = logits_s − log Σ_j exp(logits_j): its derivative is 1 at s minus softmax(logits).",
        "F.one_hot(sampled, L) gives onehot(s) (B, L) as int64: cast it to logits' dtype.",
        "The factor (reward − baseline) is one number per row: shape (B, 1) to broadcast over the cells.",
    ),
    see="qkv explain hard-attention",
    forbidden=("backward", "grad"),
    solution="""
def reinforce_gradient(logits, sampled, reward, baseline=0.0):
    p = torch.softmax(logits, dim=-1)
    onehot = torch.nn.functional.one_hot(sampled, logits.shape[-1]).to(logits.dtype)
    return (reward - baseline)[:, None] * (onehot - p)
""",
)


# --------------------------------------------------------------------------- location-based addressing

S_ADDR = "Location-based vs content-based addressing"


def ref_location(h: Tensor, w: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
    a = torch.softmax(h.double() @ w.double().T, -1)  # (B, L): row i of W scores cell i
    return (a[:, None] @ features.double()).squeeze(1).to(h.dtype), a.to(h.dtype)


@check("context and weights against softmax(W h) over the cells (float64 and float32, random)")
def _loc_values(f) -> None:
    # (B, H, L, D): H = L = D first, so that a missing transpose or content-based weights still run
    for (B, H, L, D), seed, dtype in (
        ((1, 3, 3, 3), 0, torch.float64),
        ((2, 4, 5, 3), 10, torch.float64),
        ((3, 6, 7, 6), 20, torch.float32),
    ):
        h, w, feats = (
            randn(B, H, seed=seed, dtype=dtype),
            randn(L, H, seed=seed + 1, dtype=dtype),
            randn(B, L, D, seed=seed + 2, dtype=dtype),
        )
        ctx, weights = _pair(f(h, w, feats), "location_attention(h, w, features)")
        want_ctx, want_w = ref_location(h, w, feats)
        causes = [
            (torch.softmax(h @ w.T, 0), "the softmax runs over the batch; it is over the L cells (dim -1)")
        ]
        if H == L:
            causes.append(
                (
                    torch.softmax(h @ w, -1),
                    "w is not transposed: W h scores cell i with row i of w, h @ w.T (B, L)",
                )
            )
        if D == H:
            causes.append(
                (
                    torch.softmax((feats @ h[:, :, None]).squeeze(-1), -1),
                    "these are content-based weights softmax(hᵀa_i), computed from the cells' "
                    "content; location-based weights are softmax(W h) and never read the features",
                )
            )
        inputs = f"B, H, L, D = {B}, {H}, {L}, {D} ({dtype})"
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
        close(weights, want_w, "weights", inputs, causes=causes, **tol)
        close(ctx, want_ctx, "context", inputs, **tol)


@check(
    "the weights never read the cells: shuffled or replaced content, the same weights; the context follows"
)
def _loc_content_free(f) -> None:
    B, H, L, D = 2, 4, 4, 4
    h, w, feats = randn(B, H, seed=30), randn(L, H, seed=31), randn(B, L, D, seed=32)
    perm = torch.tensor([2, 0, 3, 1])
    _, before = _pair(f(h, w, feats), "location_attention(h, w, features)")
    for name, other in (
        ("shuffled along the cells", feats[:, perm]),
        ("replaced by others", randn(B, L, D, seed=33)),
    ):
        ctx, after = _pair(f(h, w, other), "location_attention(h, w, features)")
        if isinstance(after, Tensor) and isinstance(before, Tensor) and not torch.allclose(after, before):
            raise CheckError(
                f"with the cells' content {name}, the weights changed from {show(before)} to {show(after)}: "
                "weights that follow the content are content-based addressing (softmax(qᵀa_i), Lecture 22); "
                "location-based ones are softmax(W h) over fixed positions and never read the features"
            )
        want_ctx, _ = ref_location(h, w, other)
        close(ctx, want_ctx, "context", f"the features {name} (the same weights, the new content)")


@check("its gradients with respect to h, w and the features (gradcheck, float64)")
def _loc_grad(f) -> None:
    gradcheck(
        lambda *a: f(*a)[0], (randn(2, 3, seed=40), randn(5, 3, seed=41), randn(2, 5, 4, seed=42)), "context"
    )


LOCATION = Exercise(
    name="location_attention",
    section=S_ADDR,
    difficulty=1,
    signature="(h, w, features)",
    stub="""
Location-based addressing (CS189 Lec 21, its last slide): the RNN's state h outputs a distribution
over a FIXED number L of locations, without looking at what is in them:

    α = softmax(W h)     (row w_i of W scores cell i: α_i ∝ exp(w_iᵀ h)),     context = Σ_i α_i a_i

Args: h (B, H) the decoder's state; w (L, H), one row per cell; features (B, L, D), the cells a_i.
Returns (context (B, D), weights (B, L)); each row of weights sums to 1 over the cells; h's dtype.
The weights never read the features: shuffle the cells' content and they stay where they were.
Content-based addressing (where Lecture 22 starts) scores each cell's content instead,
α_i ∝ exp(qᵀa_i), and so works for any number of cells; this one only for the L it was built for.

Example: w = [[1, 0], [0, 1], [0, 0]], h = [[2, 0]] -> weights softmax([2, 0, 0]) = [0.7870, 0.1065, 0.1065]
""",
    checks=(_loc_values, _loc_content_free, _loc_grad),
    hints=(
        "The scores W h for the whole batch: h @ w.T, (B, H) @ (H, L) -> (B, L); softmax over the "
        "cells (dim -1).",
        "context = (weights[:, :, None] * features).sum(1), or weights[:, None] @ features squeezed: (B, D).",
    ),
    see="qkv explain addressing",
    solution="""
def location_attention(h, w, features):
    weights = torch.softmax(h @ w.T, dim=-1)
    context = (weights[:, :, None] * features).sum(1)
    return context, weights
""",
)


LEC21: tuple[Exercise, ...] = (
    CONV1D,
    RECEPTIVE_FIELD,
    TF_IDF,
    RNN_STEP,
    DOUBLY_STOCHASTIC,
    REINFORCE,
    LOCATION,
)
