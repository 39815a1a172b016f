"""A trained captioner run ready to use: images in, captions and each word's attention out
(Show, Attend and Tell, Xu et al. 2015).

    cap = qkv.load("runs/captioner-shapes-cpu-...")
    x, notes = cap.read_image("scene.png")        # uint8 (C, size, size)
    captions, alphas = cap.caption(x[None])       # ["a red circle above a blue square"], [(len, L)]
    att = cap.attention(x)                        # one (g, g) map per word of the caption

Shapes: L = g·g grid cells.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from qkv.errors import InputError
from qkv.generation.decode import beam_search, greedy_decode
from qkv.models.captioner import Captioner, CaptionerState, HardDecode
from qkv.pipelines.images import ImageAttention, ImageInput, read_model_image
from qkv.pipelines.kinds import Kind
from qkv.tokenizers.vocab import WordVocab

MEAN, STD = 0.25, 0.3  # pixel normalisation of the generated scenes (x / 255 - MEAN) / STD


def normalize(images: Tensor) -> Tensor:
    """uint8 images -> the captioner's input, (x / 255 - MEAN) / STD."""
    return (images.float() / 255 - MEAN) / STD


class _DecodeState:
    """A captioner's decoding state with the ``reorder`` that beam search needs."""

    def __init__(self, state: CaptionerState) -> None:
        self.state = state

    def reorder(self, index: Tensor) -> None:
        self.state = CaptionerState(*(None if t is None else t.index_select(0, index) for t in self.state))


class _Decoding:
    """The captioner behind the encoder-decoder decoding interface of qkv.generation.decode:
    ``start(images)`` and ``step(state, prev) -> (logits, attention over the grid)``, a hard
    model reading the grid as ``hard_decode`` says (see :meth:`Captioner.step`)."""

    def __init__(self, model: Captioner, hard_decode: HardDecode = "argmax") -> None:
        self.model = model
        self.hard_decode = hard_decode

    def start(self, images: Tensor) -> _DecodeState:
        return _DecodeState(self.model.start(images))

    def step(self, state: _DecodeState, prev: Tensor) -> tuple[Tensor, Tensor]:
        out = self.model.step(state.state, prev, hard_decode=self.hard_decode)
        state.state = out.state
        return out.logits, out.alpha


@torch.no_grad()
def decode_captions(model: Captioner, images: Tensor, max_len: int, beam: int = 1,
                    batch_size: int = 256, *, hard_decode: HardDecode = "argmax"
                    ) -> tuple[list[list[int]], list[Tensor]]:
    """uint8 images (N, C, H, W) -> token ids (EOS excluded) and the attention over the grid of
    every emitted word (len, L), per image: greedy decoding, or beam search with ``beam`` > 1.
    Hard attention reads, at every word, the most attended location (``hard_decode="argmax"``)
    or the expected value Σ α_i a_i (``"expectation"``); other attention ignores it."""
    model.eval()
    dec = _Decoding(model, hard_decode)
    toks: list[list[int]] = []
    alphas: list[Tensor] = []
    device = next(model.parameters()).device
    for i in range(0, len(images), batch_size):
        x = normalize(images[i : i + batch_size]).to(device)
        out = (greedy_decode(dec, x, max_len + 1) if beam == 1
               else beam_search(dec, x, max_len + 1, beam=beam))
        toks += out.tokens
        alphas += out.weights
    return toks, alphas


def word_maps(caption: str, alphas: Tensor, grid: int) -> list[tuple[str, Tensor]]:
    """(word, its attention as a (grid, grid) map) for every word of a generated caption."""
    return [(w, a.reshape(grid, grid)) for w, a in zip(caption.split(), alphas, strict=False)]


@dataclass
class ImageCaptioner:
    """A trained captioner with its word vocabulary and the longest caption it was trained on."""

    name: str
    model: Captioner
    vocab: WordVocab
    max_len: int
    run_dir: Path
    kind: ClassVar[Kind] = "image"
    n_layers: ClassVar[int] = 1  # one attention per word, over the grid
    n_heads: ClassVar[int] = 1

    @property
    def context(self) -> int:
        """Grid cells read at once."""
        return self.model.cfg.grid ** 2

    def read_image(self, image: ImageInput, max_pixels: int | None = None,
                   size: int | None = None) -> tuple[Tensor, list[str]]:
        """A file or an upload's bytes -> uint8 (C, size, size) (default: the model's size) and notes."""
        cfg = self.model.cfg
        return read_model_image(image, size or cfg.image_size, cfg.channels, max_pixels)

    def caption(self, images: Tensor, beam: int = 1) -> tuple[list[str], list[Tensor]]:
        """uint8 (N, C, H, W) -> captions and each caption's attention over the grid (len, L):
        greedy decoding, or beam search with ``beam`` > 1."""
        toks, alphas = decode_captions(self.model, images, self.max_len, beam=beam)
        return [self.vocab.decode(t) for t in toks], alphas

    def attention(self, image: Tensor, layer: int | None = None, layer_name: str = "layer") -> ImageAttention:
        """uint8 (C, size, size) -> the greedy caption and each word's attention as a (g, g) map."""
        if layer is not None:
            raise InputError(f"a captioner has one attention per word (no layers); drop {layer_name}")
        [caption], [alphas] = self.caption(image[None])
        grid = image.shape[-1] // 8  # the model's grid, or a larger one for a larger image
        return ImageAttention(image, grid, word_maps(caption, alphas, grid), caption, [],
                              {"caption": caption})
