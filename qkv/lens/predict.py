"""What a decoder predicts: the next-token distribution, and what each layer would predict if
the model stopped there (the logit lens).

    nt = next_token(lm, "The capital of France is", temperature=1.0, k=10)
    nt.top            # [TokenProb(id, token, prob, logit), ...], most likely first
    nt.probs(0.5)     # (V,) softmax(logits / 0.5): the same logits, another temperature

    lens = logit_lens(lm, "The capital of France is")
    lens.logprobs     # (L + 1, T, V): row 0 the embeddings, row i the stream after block i

The logit lens (nostalgebraist 2020) reads the residual stream after each block through the
model's own final norm and output head. The norm is **recomputed on each row's own stream**
(its own mean and scale): reusing the last layer's scale for every row (TransformerLens #1076)
makes the early rows near-uniform. After the last block the row is the model's own output,
so the last row equals the model's log-probabilities (the check TransformerLens #523 asked for).
Temperature: CS189 Lec 22 and the softmax lecture (softmax(z/T): T → 0 is the hardmax).

Shapes: L layers, T tokens, V vocabulary, k top tokens.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv.errors import InputError
from qkv.layers.quant import TopKRefinedLinear
from qkv.lens.cache import ActivationCache, encode, labels
from qkv.lens.hooks import (
    Recorded,
    TextModel,
    device_of,
    finish,
    forward,
    hooked,
    is_decoder,
    normed_streams,
    shape,
)
from qkv.nn.linear import Linear as QLinear


def check_decoder(lm: TextModel, what: str) -> None:
    """InputError unless ``lm`` predicts tokens."""
    if not is_decoder(lm.model):
        raise InputError(f"{lm.name} is an {lm.kind}: it has no output head over a vocabulary, "
                         f"so {what} does not apply (ablation and head scores do)")


def check_temperature(temperature: float) -> float:
    if not temperature > 0 or temperature != temperature or temperature == float("inf"):
        raise InputError(f"temperature must be a number > 0, got {temperature}")
    return float(temperature)


@dataclass
class TokenProb:
    """One candidate next token: its id, its text, its probability at the asked temperature
    and its logit (temperature 1)."""

    id: int
    token: str
    prob: float
    logit: float


@dataclass
class NextToken:
    """The next-token distribution after ``tokens``: the raw ``logits`` (V,) float32 and the
    ``top`` k at ``temperature``."""

    tokens: list[str]
    logits: Tensor
    temperature: float
    top: list[TokenProb]

    def probs(self, temperature: float | None = None) -> Tensor:
        """(V,) softmax(logits / T), computed in float64 and returned as float32."""
        t = check_temperature(self.temperature if temperature is None else temperature)
        return torch.softmax(self.logits.double() / t, dim=-1).float()


def top_tokens(lm: TextModel, logits: Tensor, temperature: float, k: int) -> list[TokenProb]:
    """The k most likely tokens of logits (V,) at ``temperature``."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    p, i = probs.topk(min(k, probs.numel()))
    return [TokenProb(int(t), lm.tokenizer.decode([int(t)]), float(q), float(logits[t]))
            for q, t in zip(p.tolist(), i.tolist(), strict=True)]


@torch.inference_mode()
def next_token(lm: TextModel, text: str | list[int] | ActivationCache, temperature: float = 1.0,
               k: int = 10) -> NextToken:
    """The distribution of the token after ``text``: softmax(logits / temperature), its top ``k``.
    ``text`` may be a :class:`ActivationCache` of it (no second forward pass)."""
    check_decoder(lm, "a next-token distribution")
    temperature = check_temperature(temperature)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    if isinstance(text, ActivationCache):
        tokens, logits = text.tokens, text.logits[-1]
    else:
        ids = encode(lm, text)
        out = lm.model(torch.tensor([ids], device=device_of(lm.model)), last_only=True)
        tokens, logits = labels(lm, ids), out.logits[0, -1].float().cpu()
    return NextToken(tokens, logits, temperature, top_tokens(lm, logits, temperature, k))


ROWS = 2048  # (row, position) cells read out per matrix product: 2048 x V floats at most at once
PIECE_ROWS = 64  # cells per piece of top_steps through a head that is not a float matrix
EXACT_FROM = 128  # from this many cells, one float32 product beats a quantised head's (int8) kernel
PIECE_LOGITS = 3_000_000  # logits per piece of top_steps over a float matrix (~27 ms on a Zen 3's 2 cores)


def _float_matrix(head: nn.Module) -> Tensor | None:
    """The (V, dim) float32 matrix of an output head without bias that multiplies by it exactly
    (a plain linear layer), or whose quantised kernel approximates it (:class:`TopKRefinedLinear`:
    the tied embedding); None for any other head."""
    w = getattr(head, "weight", None)
    if not isinstance(w, Tensor) or w.dtype != torch.float32:
        return None
    if type(head) in (nn.Linear, QLinear) and head.bias is None:
        return w
    if isinstance(head, TopKRefinedLinear) and getattr(head.approx, "bias", None) is None:
        return w
    return None


def top_by_vocabulary(x: Tensor, w: Tensor, k: int, logits: int = PIECE_LOGITS
                      ) -> Generator[None, None, tuple[Tensor, Tensor]]:
    """The k most likely tokens of each row of ``x`` (N, dim) under softmax(x wᵀ), w (V, dim),
    and their probabilities, (N, k) each, reading the vocabulary a slice of about ``logits`` / N
    tokens per ``next``: an online softmax (Milakov & Gimelshein 2018; FlashAttention does the
    same over keys, the efficient-attention lecture): a running maximum m and sum of exponentials
    s, rescaled by exp(m_old − m_new) whenever the maximum grows, so that no (N, V) matrix is ever
    held and each slice of w is multiplied by every row at once (one pass over w's 113 MB for
    SmolLM2, not one per chunk of rows: 465 cells 0.39 -> 0.22 s on a Zen 3's 2 cores,
    benchmarks/lens_batching.py)."""
    N, V = x.shape[0], w.shape[0]
    step = max(1, min(V, logits // max(N, 1)))
    m = torch.full((N,), -math.inf, device=x.device)
    s = torch.zeros(N, device=x.device)
    top_v = torch.empty(N, 0, device=x.device)
    top_i = torch.empty(N, 0, dtype=torch.long, device=x.device)
    for j in range(0, V, step):
        yield
        with torch.inference_mode():
            z = x @ w[j : j + step].t()  # (N, n) logits of this slice
            v, i = z.topk(min(k, z.shape[1]), dim=-1)
            top_v, order = torch.cat([top_v, v], 1).topk(min(k, top_v.shape[1] + v.shape[1]), dim=-1)
            top_i = torch.cat([top_i, i + j], 1).gather(1, order)
            new = torch.maximum(m, v[:, 0])
            s = s * torch.exp(m - new) + z.sub_(new[:, None]).exp_().sum(-1)
            m = new
    return (top_v - (m + s.log())[:, None]).exp().cpu(), top_i.cpu()


@dataclass
class LogitLens:
    """What each layer predicts at each position.

    ``normed`` (L + 1, T, dim): row 0 the embeddings, row i the stream after block i, each through
    the final norm computed on its own stream; ``head`` the model's output layer. ``logprobs``
    (L + 1, T, V) float32 reads them all out (the last row: the model's own log-probabilities);
    :meth:`top` reads out only what it returns, a slice of the vocabulary (or a chunk of cells)
    at a time (SmolLM2 at 64 tokens: 31 x 64 x 49,152 log-probabilities are 390 MB). ``rows`` names the rows
    ("embed", "1", ... "L").
    """

    tokens: list[str]
    ids: list[int]
    normed: Tensor
    head: nn.Module = field(repr=False)
    _all: Tensor | None = field(default=None, repr=False)

    @property
    def rows(self) -> list[str]:
        return ["embed", *(str(i) for i in range(1, self.normed.shape[0]))]

    @property
    def logprobs(self) -> Tensor:
        """(L + 1, T, V) float32 log-probabilities of every cell (computed once, then kept)."""
        if self._all is None:  # written in place, chunk by chunk (no second 390 MB copy)
            R, T, D = self.normed.shape
            flat = self.normed.reshape(R * T, D)
            out = None
            with torch.inference_mode():
                w = _float_matrix(self.head)
                plain = w is not None and flat.dtype == torch.float32
                for i in range(0, R * T, ROWS):
                    if plain:  # the logits straight into the output, then normalised in place
                        if out is None:
                            out = torch.empty(R * T, w.shape[0], dtype=torch.float32, device=w.device)
                        part = torch.mm(flat[i:i + ROWS], w.t(), out=out[i:i + ROWS])
                        part.sub_(part.logsumexp(-1, keepdim=True))
                        continue
                    z = self.head(flat[i:i + ROWS]).float()
                    if out is None:
                        out = torch.empty(R * T, z.shape[-1], dtype=torch.float32, device=z.device)
                    torch.sub(z, z.logsumexp(-1, keepdim=True), out=out[i:i + ROWS])
            assert out is not None
            self._all = out.cpu().view(R, T, -1)
        return self._all

    def top(self, k: int = 1, positions: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """(probabilities, ids), each (L + 1, P, k): the k most likely tokens of every cell (of
        ``positions`` only, when given)."""
        if self._all is not None:
            lp = self._all if positions is None else self._all[:, positions]
            v, i = lp.topk(k, dim=-1)
            return v.exp(), i
        return finish(self.top_steps(k, positions, ROWS))

    def top_steps(self, k: int = 1, positions: list[int] | None = None, rows: int = PIECE_ROWS,
                  logits: int = PIECE_LOGITS) -> Generator[None, None, tuple[Tensor, Tensor]]:
        """:meth:`top` in pieces (a server's token streams move between them); the same answer.
        From :data:`EXACT_FROM` cells, a head that is (or approximates) a float matrix reads out
        every cell at once, a slice of the vocabulary per piece (:func:`top_by_vocabulary`, about
        ``logits`` logits a piece: exact everywhere, SmolLM2's int8 head included); else
        ``rows`` cells per piece through the head itself."""
        h = self.normed if positions is None else self.normed[:, positions]
        R, P, D = h.shape
        flat = h.reshape(R * P, D)
        w = _float_matrix(self.head)
        if w is not None and R * P >= EXACT_FROM and flat.dtype == torch.float32:
            v, i = yield from top_by_vocabulary(flat, w, k, logits)
            return v.view(R, P, -1), i.view(R, P, -1)
        vals, ids = [], []
        for i in range(0, R * P, rows):
            yield
            with torch.inference_mode():
                lp = torch.log_softmax(self.head(flat[i:i + rows]).float(), dim=-1)
                v, j = lp.topk(k, dim=-1)
            vals.append(v.exp().cpu())
            ids.append(j.cpu())
        return torch.cat(vals).view(R, P, k), torch.cat(ids).view(R, P, k)

    def prob_of(self, token_ids: Tensor | list[int]) -> Tensor:
        """(L + 1, T): the probability each cell gives the token at that position's column
        (e.g. the model's final prediction, or the text's actual next token)."""
        idx = torch.as_tensor(token_ids).view(-1, 1)
        n = len(idx)
        cells = self.logprobs[:, :n]
        return cells.gather(-1, idx.view(1, n, 1).expand(cells.shape[0], n, 1))[..., 0].exp()


@torch.inference_mode()
def logit_lens(lm: TextModel, text: str | list[int] | ActivationCache) -> LogitLens:
    """Every layer's prediction at every position of ``text`` (see :class:`LogitLens`); ``text``
    may be a :class:`ActivationCache` of it (no second forward pass)."""
    check_decoder(lm, "the logit lens")
    model = lm.model
    L = shape(model)[0]
    if isinstance(text, ActivationCache):
        ids, tokens = text.ids, text.tokens
        streams = torch.stack([text.resid_pre[0], *text.resid_post]).to(device_of(model))
    else:
        ids = encode(lm, text)
        rec = Recorded()
        with hooked(model, record=rec):
            forward(model, torch.tensor([ids], device=device_of(model)))
        tokens = labels(lm, ids)
        streams = torch.cat([rec.resid_pre[0], *(rec.resid_post[i] for i in range(L))])  # (L + 1, T, dim)
    return LogitLens(tokens, ids, normed_streams(model, streams), model.lm_head)
