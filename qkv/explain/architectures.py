"""``qkv explain cnn`` and ``qkv explain architectures``: why a new architecture, and how the three
ways of mixing a sequence compare.

cnn (CS189 Lec 21, its opening): an MLP on an image's P pixels needs P² weights per layer and a
fixed input size; a convolution shares a small kernel over every position (weights independent of
P, any size), but its features are local: with width-3 convolutions the top centre sees 2L + 1
pixels per side after L layers, so only the top of a deep stack "sees everything". Self-
attention's every output depends on every input after one layer. The receptive fields here are
measured, not assumed: the pixels whose gradient at the top centre is non-zero.

architectures (CS231N Lec 8, "three primitives for sequences"): per layer over n tokens of width
d, an RNN costs O(n·d²) in n sequential steps and connects the first and last token through a
path of n steps; a convolution of width k costs O(k·n·d²), runs in parallel, and needs
⌈(n − 1)/(k − 1)⌉ stacked layers to connect them; self-attention costs O(n²·d) (+ O(n·d²) for
its projections), runs in parallel, and connects every pair in one step. The table is computed by
formula, the path lengths by gradients (causal convolutions: output t reads t − k + 1 .. t), and the
times are measured here (torch's GRU, Conv1d and qkv's MultiHeadAttention, one layer each).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from qkv.attention import MultiHeadAttention

if TYPE_CHECKING:
    from rich.console import Console

IMAGES = ((28, 28, 1, "Fashion-MNIST"), (32, 32, 3, "CIFAR"), (224, 224, 3, "ImageNet"))


@dataclass
class ImageRow:
    """An MLP layer on an image (P inputs -> P outputs) against a 3x3 convolution with C -> C
    channels: weights of each (the MLP's: P², checked on a built layer where it is small)."""

    name: str
    pixels: int
    mlp_weights: int
    conv_weights: int


@dataclass
class CNNResult:
    size: int  # side of the square test image
    images: list[ImageRow]
    mlp_checked: int  # weights of a built nn.Linear(P, P) for the smallest image, = P² + P (bias)
    receptive: list[tuple[int, int]]  # (layers L, measured width of what the top centre sees)
    layers_to_see_all: int  # width-3 layers until the top centre sees the whole image side
    attention_sees: int  # inputs one self-attention output depends on (of size² tokens)
    other_size_conv: bool  # the convolution runs on another image size
    other_size_mlp: str  # what the MLP says to another size


def _receptive_width(layers: int, size: int) -> int:
    """Width of the square of pixels whose gradient at the top centre is non-zero, measured on
    ``layers`` stacked width-3 convolutions (weights all positive, so nothing cancels)."""
    net = nn.Sequential(*[nn.Conv2d(1, 1, 3, padding=1, bias=False) for _ in range(layers)]).double()
    for conv in net:
        nn.init.constant_(conv.weight, 1.0)
    x = torch.zeros(1, 1, size, size, dtype=torch.float64, requires_grad=True)
    net(x)[0, 0, size // 2, size // 2].backward()
    seen = x.grad[0, 0] != 0
    return int(seen.any(0).sum())


def explain_cnn(size: int = 28, channels: int = 64, seed: int = 0) -> CNNResult:
    """The counts and receptive fields of the cnn topic, on a ``size`` x ``size`` test image."""
    if not 5 <= size <= 128:
        raise ValueError(f"size must be in 5..128, got {size}")
    images = [ImageRow(name, h * w * c, (h * w * c) ** 2, 9 * channels * channels)
              for h, w, c, name in IMAGES]
    p = IMAGES[0][0] * IMAGES[0][1] * IMAGES[0][2]
    mlp_checked = sum(q.numel() for q in nn.Linear(p, p).parameters())
    receptive = [(L, _receptive_width(L, size)) for L in (1, 2, 3, 4, 6, 8)]
    L = 1
    while _receptive_width(L, size) < size:
        L += 1
    torch.manual_seed(seed)
    attn = MultiHeadAttention(8, 2, backend="reference").double()
    x = torch.randn(1, size * size, 8, dtype=torch.float64, requires_grad=True)
    attn(x).out[0, (size * size) // 2].sum().backward()
    sees = int((x.grad[0].abs().sum(-1) > 0).sum())
    conv = nn.Conv2d(1, 4, 3, padding=1)
    ok = conv(torch.zeros(1, 1, size + 7, size + 3)).shape[-2:] == (size + 7, size + 3)
    try:
        nn.Linear(size * size, 16)(torch.zeros(1, (size + 1) * (size + 1)))
        said = "ran (unexpected)"
    except RuntimeError as e:
        said = str(e).splitlines()[0]
    return CNNResult(size, images, mlp_checked, receptive, L, sees, bool(ok), said)


def render_cnn(r: CNNResult, console: Console) -> None:
    """Print the tables of ``qkv explain cnn``."""
    from qkv.explain._render import add_row, human_count, say, table

    t = table("one layer on an image: an MLP (P inputs -> P outputs) vs a 3x3 convolution, 64 -> 64 channels",
              ["image", "pixels P", "MLP weights P²", "3x3 conv weights"])
    for row in r.images:
        add_row(t, row.name, f"{row.pixels:,}", human_count(row.mlp_weights), f"{row.conv_weights:,}")
    console.print(t)
    say(console, f"A built nn.Linear({r.images[0].pixels}, {r.images[0].pixels}) has {r.mlp_checked:,} "
        f"parameters = P² + P (biases). The MLP is also tied to its size: on a {r.size + 1}x{r.size + 1} "
        "image "
        f"it says '{r.other_size_mlp}'; the convolution runs on any size "
        f"({'yes' if r.other_size_conv else 'no'}). (CS189 Lec 21)", "dim")
    t = table(f"what the top centre of L stacked width-3 convolutions sees ({r.size}x{r.size} image)",
              ["layers L", "measured width (pixels)", "2L + 1"])
    for layers, width in r.receptive:
        add_row(t, str(layers), str(width), str(min(2 * layers + 1, r.size)))
    console.print(t)
    say(console, "Measured by the gradient of the top centre with respect to every pixel. It takes "
        f"{r.layers_to_see_all} "
        f"layers before the top centre sees the whole {r.size}-pixel side: features are local, only the top "
        f"layer 'sees everything'. One self-attention layer over the {r.size * r.size} pixels as tokens: one "
        f"output depends on {_sees(r)}.", "dim")


def _sees(r: CNNResult) -> str:
    n = r.size * r.size
    return f"{r.attention_sees:,} of {n:,} inputs" + (" (all)" if r.attention_sees == n else "")


@dataclass
class ArchRow:
    """One way of mixing n tokens: FLOPs per layer by formula, sequential steps, the path between
    the first and last token (in steps or layers), and measured milliseconds per layer by n."""

    name: str
    flops: str
    sequential: str
    path: str
    path_measured: int  # at n = ``path_n``
    ms: list[float]


@dataclass
class ArchitecturesResult:
    d: int
    kernel: int
    lengths: list[int]
    path_n: int
    rows: list[ArchRow]
    batch: int


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _conv_path(n: int, k: int) -> int:
    """Stacked causal width-k convolutions (output t reads inputs t − k + 1 .. t, as an RNN reads
    the past) until the last output depends on the first input, found by its gradient."""
    kernel = torch.ones(1, 1, k, dtype=torch.float64)
    layers = 0
    while True:
        layers += 1
        x = torch.zeros(1, 1, n, dtype=torch.float64, requires_grad=True)
        h = x
        for _ in range(layers):
            h = nn.functional.conv1d(nn.functional.pad(h, (k - 1, 0)), kernel)
        h[0, 0, -1].backward()
        if x.grad[0, 0, 0] != 0:
            return layers


def explain_architectures(d: int = 64, kernel: int = 3, lengths: tuple[int, ...] = (64, 256, 1024),
                          batch: int = 4, repeats: int = 5, path_n: int = 32) -> ArchitecturesResult:
    """The table, the measured path lengths at ``path_n`` tokens and one layer's time at each length."""
    if d < 2 or d % 2 or kernel < 2 or not lengths or min(lengths) < 2 or max(lengths) > 8192:
        raise ValueError("d must be even, kernel >= 2, lengths in 2..8192")
    torch.manual_seed(0)
    gru = nn.GRU(d, d, batch_first=True)
    conv = nn.Conv1d(d, d, kernel, padding=kernel // 2)
    attn = MultiHeadAttention(d, 4)
    # RNN path: the last hidden state's dependence on the first input passes n − 1 recurrent steps.
    rnn_steps = path_n - 1
    ms: dict[str, list[float]] = {"rnn": [], "cnn": [], "attn": []}
    with torch.inference_mode():
        for n in lengths:
            x = torch.randn(batch, n, d)
            xc = x.transpose(1, 2).contiguous()
            ms["rnn"].append(_time(lambda x=x: gru(x), repeats))
            ms["cnn"].append(_time(lambda xc=xc: conv(xc), repeats))
            ms["attn"].append(_time(lambda x=x: attn(x), repeats))
    rows = [
        ArchRow("RNN (GRU)", "O(n·d²)", "O(n): one step per token", "O(n) steps", rnn_steps, ms["rnn"]),
        ArchRow(f"CNN (width {kernel})", f"O({kernel}·n·d²)", "O(1)", f"O(n/{kernel - 1}) layers",
                _conv_path(path_n, kernel), ms["cnn"]),
        ArchRow("self-attention", "O(n²·d) + O(n·d²)", "O(1)", "O(1): one layer", 1, ms["attn"]),
    ]
    return ArchitecturesResult(d, kernel, list(lengths), path_n, rows, batch)


def render_architectures(r: ArchitecturesResult, console: Console) -> None:
    """Print the table of ``qkv explain architectures``."""
    from qkv.explain._render import add_row, say, table

    t = table(f"three ways to mix n tokens of width d = {r.d} (CS231N Lec 8); ms per layer measured here, "
              f"batch {r.batch}, {torch.get_num_threads()} threads",
              ["layer", "FLOPs", "sequential steps", "first↔last path", f"path at n = {r.path_n}",
               *(f"ms, n = {n:,}" for n in r.lengths)])
    for row in r.rows:
        add_row(t, row.name, row.flops, row.sequential, row.path, str(row.path_measured),
                *(f"{v:.2f}" for v in row.ms))
    console.print(t)
    grow = [(row.name, row.ms[-1] / row.ms[0]) for row in r.rows]
    factor = r.lengths[-1] / r.lengths[0]
    say(console, f"From n = {r.lengths[0]:,} to {r.lengths[-1]:,} (x{factor:g}): " + ", ".join(
        f"{name} x{g:.0f}" for name, g in grow)
        + f" (linear would be x{factor:g}, quadratic x{factor ** 2:g}; "
        "small n is dominated by fixed costs). The RNN's steps cannot run in parallel; attention's n² "
        "pairs can, and any two tokens are one step apart.", "dim")
    say(console, "At this repository's scale the RNN with attention can still win: it copies strings "
        "longer than any in training where the Transformer fails, and it learns the dates with less data "
        "(benchmarks/seq2seq_copy.py, seq2seq_dates.py, length_extrapolation.py). The Transformer's edge "
        "is parallel training on long sequences and scale, which these 2-core runs do not reach.", "yellow")
