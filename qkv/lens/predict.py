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

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import InputError
from qkv.lens.cache import encode, labels
from qkv.lens.hooks import Recorded, TextModel, device_of, forward, hooked, is_decoder, shape, unembed


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
def next_token(lm: TextModel, text: str | list[int], temperature: float = 1.0, k: int = 10) -> NextToken:
    """The distribution of the token after ``text``: softmax(logits / temperature), its top ``k``."""
    check_decoder(lm, "a next-token distribution")
    temperature = check_temperature(temperature)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    ids = encode(lm, text)
    out = lm.model(torch.tensor([ids], device=device_of(lm.model)), last_only=True)
    logits = out.logits[0, -1].float().cpu()
    return NextToken(labels(lm, ids), logits, temperature, top_tokens(lm, logits, temperature, k))


@dataclass
class LogitLens:
    """What each layer predicts: ``logprobs`` (L + 1, T, V) float32, row 0 the embeddings read
    out, row i the stream after block i read out (the last row: the model's own output).
    ``rows`` names them ("embed", "1", ... "L")."""

    tokens: list[str]
    ids: list[int]
    logprobs: Tensor

    @property
    def rows(self) -> list[str]:
        return ["embed", *(str(i) for i in range(1, self.logprobs.shape[0]))]

    def top(self, k: int = 1) -> tuple[Tensor, Tensor]:
        """(probabilities, ids), each (L + 1, T, k): the k most likely tokens of every cell."""
        lp, i = self.logprobs.topk(k, dim=-1)
        return lp.exp(), i

    def prob_of(self, token_ids: Tensor | list[int]) -> Tensor:
        """(L + 1, T): the probability each cell gives the token at that position's column
        (e.g. the model's final prediction, or the text's actual next token)."""
        idx = torch.as_tensor(token_ids).view(1, -1, 1).expand(self.logprobs.shape[0], -1, 1)
        return self.logprobs.gather(-1, idx)[..., 0].exp()


@torch.inference_mode()
def logit_lens(lm: TextModel, text: str | list[int]) -> LogitLens:
    """Every layer's prediction at every position of ``text`` (see :class:`LogitLens`)."""
    check_decoder(lm, "the logit lens")
    ids = encode(lm, text)
    model = lm.model
    rec = Recorded()
    with hooked(model, record=rec):
        forward(model, torch.tensor([ids], device=device_of(model)))
    L = shape(model)[0]
    streams = [rec.resid_pre[0], *(rec.resid_post[i] for i in range(L))]  # each (1, T, dim)
    rows = [unembed(model, s) for s in streams]  # post-LN (no final norm): the head alone
    logprobs = torch.log_softmax(torch.cat(rows).float(), dim=-1).cpu()  # (L + 1, T, V)
    return LogitLens(labels(lm, ids), ids, logprobs)
