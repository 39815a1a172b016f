"""Models whose circuit is known because qkv planted it: ground truth for the lens's methods.

:func:`induction` sets by hand the two-layer induction circuit of Elhage et al. 2021 / Olsson et
al. 2022 (the ``induction_head`` exercise of ``qkv learn``) in a real qkv GPT (attention only, no
norms, float64), beside distractor heads that attend and write where the answer is read:

    layer 0, head 0   previous-token head: writes "the token before me" into its own columns
    layer 1, head 0   induction head: a query for token X finds the key whose previous token was
                      X (K-composition with head 0.0) and copies that key's token to the answer
    every other head  a distractor: random queries and keys, writing a small random amount into
                      the answer's columns (an effect, but a small one)

and a prompt pair on which the circuit decides the answer: ``clean`` = [... X Y ... X] (the
model predicts Y), ``corrupt`` = the same with the earlier X replaced (no earlier X: the
induction head has nothing to find). Patching head 0.0 or head 1.0 from clean into corrupt
restores Y; the distractors restore next to nothing. A method that claims to find the heads
that make the answer must find {0.0, 1.0}.

Shapes: V vocabulary, N context, D width, L = 2 layers, H heads a layer, Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

BIG = 30.0  # a score gap (after / √Dh) that makes a softmax a hardmax at these lengths


class Symbols:
    """A tokenizer for ids 0..V-1 written as s0, s1, ...: what the lens needs of one."""

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab

    def encode(self, text: str) -> list[int]:
        try:
            return [int(w.removeprefix("s")) for w in text.split()]
        except ValueError:
            raise ValueError(f"the planted model reads s0..s{self.vocab_size - 1}, got {text!r}") from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"s{i}" for i in ids)


@dataclass
class Planted:
    """A model with its planted circuit and a prompt pair the circuit decides.

    model: a qkv GPT (float64, eval). circuit: the planted heads as (layer, head). clean /
    corrupt: token ids of the same length; answer / wrong: the clean and corrupt predictions.
    ``name``, ``tokenizer`` and ``kind`` make it a :class:`~qkv.lens.hooks.TextModel`."""

    model: nn.Module
    circuit: list[tuple[int, int]]
    clean: list[int]
    corrupt: list[int]
    answer: int
    wrong: int
    name: str = "planted induction"
    kind: str = "decoder"

    def __post_init__(self) -> None:
        self.tokenizer = Symbols(self.model.cfg.vocab_size)


def induction(vocab: int = 8, n_ctx: int = 12, heads: int = 3, distractor: float = 0.01,
              seed: int = 0) -> Planted:
    """The planted two-layer induction circuit with ``heads - 1`` distractor heads a layer (see the
    module's text); ``distractor``: the scale of what each distractor writes into the answer's
    columns (0: distractors with no effect at all)."""
    from qkv.models.gpt import GPT, GPTConfig

    if vocab < 4 or n_ctx < 6 or heads < 1:
        raise ValueError("the planted model needs vocab >= 4, n_ctx >= 6 and heads >= 1")
    g = torch.Generator().manual_seed(seed)
    pos0, tok0 = 0, n_ctx
    prev0, ans0 = n_ctx + vocab, n_ctx + 2 * vocab  # columns: positions, tokens, previous token, answer
    D = n_ctx + 3 * vocab
    Dh = max(n_ctx, vocab)
    L, H = 2, heads
    W_Q, W_K, W_V = (torch.zeros(L, H, D, Dh, dtype=torch.float64) for _ in range(3))
    W_O = torch.zeros(L, H, Dh, D, dtype=torch.float64)
    s = BIG * math.sqrt(Dh)
    for p in range(1, n_ctx):  # head 0.0: position p attends to p - 1 and writes its token
        W_Q[0, 0, pos0 + p, p] = s
        W_K[0, 0, pos0 + p - 1, p] = 1.0
    for t in range(vocab):
        W_V[0, 0, tok0 + t, t] = 1.0
        W_O[0, 0, t, prev0 + t] = 1.0
        W_Q[1, 0, tok0 + t, t] = s  # head 1.0: token t looks for "my previous token was t"
        W_K[1, 0, prev0 + t, t] = 1.0
        W_V[1, 0, tok0 + t, t] = 1.0  # and copies that position's own token to the answer
        W_O[1, 0, t, ans0 + t] = 1.0
    for layer in range(L):
        for h in range(1, H):  # distractors: attend at random, write a little into the answer
            W_Q[layer, h] = torch.randn(D, Dh, generator=g, dtype=torch.float64)
            W_K[layer, h] = torch.randn(D, Dh, generator=g, dtype=torch.float64)
            W_V[layer, h] = torch.randn(D, Dh, generator=g, dtype=torch.float64)
            W_O[layer, h, :, ans0:ans0 + vocab] = distractor * torch.randn(Dh, vocab, generator=g,
                                                                           dtype=torch.float64)
    W_E = torch.zeros(vocab, D, dtype=torch.float64)
    W_E[torch.arange(vocab), tok0 + torch.arange(vocab)] = 1.0
    W_pos = torch.zeros(n_ctx, D, dtype=torch.float64)
    W_pos[torch.arange(n_ctx), pos0 + torch.arange(n_ctx)] = 1.0
    W_U = torch.zeros(D, vocab, dtype=torch.float64)
    W_U[ans0:ans0 + vocab] = 8.0 * torch.eye(vocab, dtype=torch.float64)

    cfg = GPTConfig(vocab_size=vocab, max_seq_len=n_ctx, dim=D, n_layers=L, n_heads=H, head_dim=Dh,
                    mlp="none", bias=False, tie_embeddings=False, positions="learned", backend="reference")
    with torch.random.fork_rng(devices=[]):  # GPT's own init must not move the caller's RNG
        model = GPT(cfg).double().eval()
    with torch.no_grad():
        model.tok_emb.weight.copy_(W_E)
        model.pos_emb.weight.copy_(W_pos)  # type: ignore[union-attr]
        for layer, block in enumerate(model.stack.blocks):
            block.norm1 = nn.Identity()
            rows = [m[layer].transpose(1, 2).reshape(H * Dh, D) for m in (W_Q, W_K, W_V)]
            block.attn.qkv.weight.copy_(torch.cat(rows))
            block.attn.out_proj.weight.copy_(W_O[layer].reshape(H * Dh, D).T)
        model.stack.norm = nn.Identity()
        model.lm_head.weight.copy_(W_U.T)
    # the prompt pair: [a b c X Y d e ... X] -> Y; corrupt: the earlier X replaced by a token not X
    order = torch.randperm(vocab, generator=g).tolist()
    x, y, z = order[0], order[1], order[2]
    filler = order[3:]  # vocab >= 4: never empty
    clean = [filler[i % len(filler)] for i in range(n_ctx - 1)] + [x]
    clean[1], clean[2] = x, y
    corrupt = list(clean)
    corrupt[1] = z
    return Planted(model, [(0, 0), (1, 0)], clean, corrupt, y, _top(model, corrupt))


def _top(model: nn.Module, ids: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


def recall(scores: Tensor, circuit: list[tuple[int, int]]) -> float:
    """The share of ``circuit``'s heads among the len(circuit) cells of ``scores`` (L, H) largest
    in magnitude: 1 = a method found exactly the planted heads."""
    k = len(circuit)
    H = scores.shape[1]
    top = {(int(i) // H, int(i) % H) for i in scores.flatten().abs().topk(k).indices}
    return len(top & set(circuit)) / k


__all__ = ["Planted", "Symbols", "induction", "recall"]
