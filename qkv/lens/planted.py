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

Besides the hand-set model, two small qkv GPTs are *trained* so that one mechanism makes the
answer, in heads chosen in advance (:class:`Recipe`, :func:`train`):

    :func:`copying`         sequences that repeat a random span of distinct symbols: the next
                            token is known only from the earlier occurrence (induction, Olsson et
                            al. 2022), planted in one head of layer 0 and one of layer 1
    :func:`previous_token`  i.i.d. random symbols, trained to name π(the token before the current
                            one) for a fixed permutation π: one previous-token head, planted in
                            layer 1

Planting by training: in every training step each head *outside* the circuit has its output
z replaced by its output on another sequence of the batch (resampling ablation; the batch
rolled by one), so only the circuit's heads ever carry information about the sequence whose
next token is scored. The other heads still attend and write (what they write is noise to the
circuit), and the model learns to read past them: they are the distractors. Which heads make
the answer is then checked, not assumed, by exact activation patching (:func:`check`): each
planted head restores most of the clean answer, no other head much, and keeping the planted
heads alone (every other head patched to its corrupt output) restores all of it. Inspired by
InterpBench's strict interchange-intervention training (Gupta et al. 2024), in its simplest form.

A trained model is cached in qkv's cache folder (:func:`qkv.paths.cache_root`) as a safetensors
file named by a hash of its recipe (written atomically; ``QKV_CACHE_DIR=off``: trained each time).
Training takes a few seconds on two cores, so tests train their own.

Shapes: V vocabulary, N context, D width, L = 2 layers, H heads a layer, Dh head width.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
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
    recipe: Recipe | None = None  # how a trained one was trained (None: set by hand)
    train_seconds: float | None = None  # its training time (as recorded when it was trained)

    def __post_init__(self) -> None:
        self.tokenizer = Symbols(self.model.cfg.vocab_size)


def attention_only_gpt(W_E: Tensor, W_pos: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor, W_O: Tensor,
                       W_U: Tensor) -> nn.Module:
    """A qkv GPT (attention only, no biases, learned positions, float64, eval mode) holding weights
    written as Elhage et al. 2021 write them: W_E (V, D), W_pos (N, D), W_Q, W_K, W_V (L, H, D, Dh),
    W_O (L, H, Dh, D), W_U (D, V). qkv's blocks always normalise; that model does not, so its norms
    are identities. The fused projection's rows are [q heads | k heads | v heads], head h's Dh rows
    W[h]ᵀ; W_O's input is the heads' outputs side by side."""
    from qkv.models.gpt import GPT, GPTConfig

    L, H, D, Dh = W_Q.shape
    V, N = W_E.shape[0], W_pos.shape[0]
    cfg = GPTConfig(vocab_size=V, max_seq_len=N, dim=D, n_layers=L, n_heads=H, head_dim=Dh, mlp="none",
                    bias=False, tie_embeddings=False, positions="learned", backend="reference")
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
    return model


def induction(vocab: int = 8, n_ctx: int = 12, heads: int = 3, distractor: float = 0.01,
              seed: int = 0) -> Planted:
    """The planted two-layer induction circuit with ``heads - 1`` distractor heads a layer (see the
    module's text); ``distractor``: the scale of what each distractor writes into the answer's
    columns (0: distractors with no effect at all)."""
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

    model = attention_only_gpt(W_E, W_pos, W_Q, W_K, W_V, W_O, W_U)
    # the prompt pair: [a b c X Y d e ... X] -> Y; corrupt: the earlier X replaced by a token not X
    order = torch.randperm(vocab, generator=g).tolist()
    x, y, z = order[0], order[1], order[2]
    filler = order[3:]  # vocab >= 4: never empty
    clean = [filler[i % len(filler)] for i in range(n_ctx - 1)] + [x]
    clean[1], clean[2] = x, y
    corrupt = list(clean)
    corrupt[1] = z
    return Planted(model, [(0, 0), (1, 0)], clean, corrupt, y, _top(model, corrupt))


def _top(model: nn.Module, ids: list[int], other_than: int | None = None) -> int:
    """The model's top prediction after ``ids`` (its best other than ``other_than``, if given)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
    if other_than is not None:
        logits[other_than] = -math.inf
    return int(logits.argmax())


Task = Literal["copy", "previous"]


@dataclass(frozen=True)
class Recipe:
    """Everything a trained planted model depends on (its cache key).

    task: "copy" (a random span of distinct symbols repeated: predict the repeat) or "previous"
    (i.i.d. symbols: at position i name π(token i - 1)); circuit: the heads (layer, head) that
    alone see their own sequence in training; the rest: an attention-only pre-LN qkv GPT
    (learned positions, no biases, untied unembedding) and its AdamW loop."""

    task: Task
    circuit: tuple[tuple[int, int], ...]
    vocab: int = 24
    n_ctx: int = 20
    n_layers: int = 2
    n_heads: int = 3
    dim: int = 48
    steps: int = 600
    batch: int = 64
    lr: float = 3e-3
    seed: int = 0
    version: int = 1  # bump when training changes what a recipe gives

    def key(self) -> str:
        """A short hash of the recipe: the name of its cache entry."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def config(self):  # -> GPTConfig (qkv.models is imported lazily, as induction() does)
        from qkv.models.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab, max_seq_len=self.n_ctx, dim=self.dim, n_layers=self.n_layers,
                         n_heads=self.n_heads, mlp="none", bias=False, tie_embeddings=False,
                         positions="learned", dropout=0.0)


def permutation(vocab: int, seed: int) -> list[int]:
    """The previous-token task's rule π: a fixed permutation of the symbols (from ``seed``)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(10_000 + seed)).tolist()


def task_batch(recipe: Recipe, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """One training batch: ids (B, N) and targets (B, N) for the logits at each position
    (-100: not scored). "copy": a span of R ∈ [3, N/2] distinct symbols repeated cyclically;
    the targets are the tokens of the repeats (the first R - 1 positions predict nothing: their
    next token is random). R varies, so no fixed offset finds the earlier occurrence: the model
    must find it by its content. "previous": i.i.d. symbols; position i's target is
    π(token i - 1)."""
    B, N, V = recipe.batch, recipe.n_ctx, recipe.vocab
    pos = torch.arange(N)
    if recipe.task == "copy":
        R = torch.randint(3, N // 2 + 1, (B, 1), generator=g)
        spans = torch.rand(B, V, generator=g).argsort(1)  # each row: the symbols in random order
        ids = spans.gather(1, pos[None] % R)  # (B, N)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        targets[pos[None].expand(B, -1) < R - 1] = -100
        return ids, targets
    ids = torch.randint(V, (B, N), generator=g)
    targets = torch.tensor(permutation(V, recipe.seed))[ids.roll(1, 1)]
    targets[:, 0] = -100
    return ids, targets


def _resampled(off: list[int]):
    """An edit of z (B, T, H, Dh): heads ``off`` get their output on the batch's next sequence."""
    def edit(z: Tensor) -> Tensor:
        z = z.clone()
        z[:, :, off] = z[:, :, off].roll(1, 0)
        return z
    return edit


def train(recipe: Recipe) -> tuple[nn.Module, float]:
    """Train ``recipe``'s model (float32, on one thread: deterministic under its seed) with every
    head outside its circuit resampled in every step (see the module's text); (the model in eval
    mode, the seconds it took)."""
    from qkv.lens.hooks import Edits, hooked
    from qkv.models.gpt import GPT

    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the caller's RNG does not move
        torch.manual_seed(recipe.seed)
        model = GPT(recipe.config())
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, recipe.lr, total_steps=recipe.steps, pct_start=0.1)
    circuit = set(recipe.circuit)
    edits = Edits(z={layer: _resampled([h for h in range(recipe.n_heads) if (layer, h) not in circuit])
                     for layer in range(recipe.n_layers)})
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and the same on any machine
    try:
        with hooked(model, edits=edits):
            for _ in range(recipe.steps):
                ids, targets = task_batch(recipe, g)
                logits = model(ids).logits
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), time.perf_counter() - t0


def _cache_file(recipe: Recipe) -> Path | None:
    from qkv.paths import cache_root

    root = cache_root()
    return None if root is None else root / "planted" / f"{recipe.task}-{recipe.key()}.safetensors"


def trained(recipe: Recipe) -> tuple[nn.Module, float]:
    """``recipe``'s model, float64, eval mode, from the cache when it is there (else trained and
    cached, atomically, as safetensors with the recipe and training time as metadata); (the
    model, its training time in seconds as recorded)."""
    from safetensors.torch import load_file, safe_open, save_file

    from qkv.fileio import atomic_write
    from qkv.models.gpt import GPT

    path = _cache_file(recipe)
    if path is not None and path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            with torch.random.fork_rng(devices=[]):
                model = GPT(recipe.config())
            model.load_state_dict(load_file(str(path)), strict=True)
            return model.double().eval(), float(meta.get("train_seconds", "nan"))
        except Exception:  # a damaged entry: train again and overwrite it
            pass
    model, seconds = train(recipe)
    if path is not None:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        meta = {"recipe": json.dumps(dataclasses.asdict(recipe)), "train_seconds": f"{seconds:.3f}"}
        atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata=meta))
    return model.double().eval(), seconds


def copying(seed: int = 0, steps: int = 500) -> Planted:
    """A 2-layer attention-only GPT (3 heads a layer, 24 symbols, context 20) trained to predict
    repeated spans, with its induction circuit planted in heads 0.1 and 1.2 (see the module's
    text). The prompt pair: ``clean`` = a span A of 8 distinct symbols, then A's first 5 again
    (the answer: A[5], after the earlier A[4]); ``corrupt`` = the same with the earlier A[4]
    replaced by a symbol not in A (no earlier occurrence to copy from); ``wrong``: the corrupt
    run's prediction.

    Verified by exact patching (:func:`check`; seeds 0-4 when written): 0.1 or 1.2 patched alone
    from clean into corrupt restores 0.97-1.0 of the logit difference, every other head at most
    0.01 of it; the two alone (the other four patched to their corrupt output) keep 0.996-1.001.
    By pattern (:func:`qkv.lens.head_scores`): 1.2 is an induction head (score ~0.9); 0.1 attends
    to the token before over the first span (weight 0.5-0.65, where the induction head's keys
    sit) and spreads out later, so its previous-token score stays ~0.3, below the 0.5 that names
    a head: a head needed for copying that pattern scores do not name."""
    recipe = Recipe("copy", ((0, 1), (1, 2)), seed=seed, steps=steps)
    model, seconds = trained(recipe)
    order = torch.randperm(recipe.vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    span, other = order[:8], order[8]
    clean = span + span[:5]
    corrupt = list(clean)
    corrupt[4] = other
    return Planted(model, list(recipe.circuit), clean, corrupt, span[5], _top(model, corrupt, span[5]),
                   name="planted copying", recipe=recipe, train_seconds=seconds)


def previous_token(seed: int = 0, steps: int = 300) -> Planted:
    """A 2-layer attention-only GPT (3 heads a layer, 24 symbols, context 20) trained on i.i.d.
    symbols to name π(the token before the current one) for a fixed permutation π
    (:func:`permutation`): one previous-token head, planted as head 1.1 (see the module's text).
    The prompt pair: ``clean`` = 12 random symbols (the answer: π(clean[-2])); ``corrupt`` = the
    same with clean[-2] replaced (``wrong`` = π of that).

    Verified by exact patching (:func:`check`; seeds 0-4 when written): 1.1 patched alone restores
    1.00 of the logit difference, every other head at most 0.002; 1.1 alone keeps 0.999-1.000.
    By pattern: 1.1's previous-token score is 0.99, every other head's below 0.2."""
    recipe = Recipe("previous", ((1, 1),), seed=seed, steps=steps)
    model, seconds = trained(recipe)
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(recipe.vocab, (12,), generator=g).tolist()
    corrupt = list(clean)
    corrupt[-2] = (clean[-2] + 1 + int(torch.randint(recipe.vocab - 1, (1,), generator=g))) % recipe.vocab
    pi = permutation(recipe.vocab, seed)
    return Planted(model, list(recipe.circuit), clean, corrupt, pi[clean[-2]], pi[corrupt[-2]],
                   name="planted previous token", recipe=recipe, train_seconds=seconds)


@dataclass
class CircuitCheck:
    """A planted circuit checked by exact activation patching (:func:`check`).

    patch: (L, H) each head patched alone from the clean run into the corrupt one
    (:func:`qkv.lens.patch`: 0 = as corrupt, 1 = as clean); kept: the faithfulness of the circuit
    alone, the clean run with every other head patched to its corrupt output
    (:func:`qkv.lens.faithful.circuit_faithfulness`: 1 = all of the answer). ``ok``: each planted
    head restores at least :data:`RESTORES` alone, every other at most :data:`STRAYS` in
    magnitude, and the circuit alone keeps between 1 - STRAYS and 1 + STRAYS of the answer."""

    circuit: list[tuple[int, int]]
    patch: Tensor
    kept: float

    @property
    def strongest_other(self) -> float:
        """The largest |patch value| of a head outside the circuit (0 when there is none)."""
        others = [abs(float(self.patch[layer, h])) for layer in range(self.patch.shape[0])
                  for h in range(self.patch.shape[1]) if (layer, h) not in self.circuit]
        return max(others, default=0.0)

    @property
    def ok(self) -> bool:
        return (min(float(self.patch[h]) for h in self.circuit) >= RESTORES
                and self.strongest_other <= STRAYS and abs(self.kept - 1) <= STRAYS)


RESTORES = 0.5  # a planted head, patched alone, restores at least this share of the clean answer
STRAYS = 0.1  # a head outside the circuit at most this share (either sign)


def check(p: Planted) -> CircuitCheck:
    """Verify ``p``'s circuit on its prompt pair by exact patching (see :class:`CircuitCheck`)."""
    from qkv.lens.causal import patch
    from qkv.lens.faithful import circuit_faithfulness

    exact = patch(p, p.clean, p.corrupt, site="head", answer=p.answer, wrong=p.wrong)
    kept = circuit_faithfulness(p, p.clean, p.corrupt, p.circuit, answer=p.answer, wrong=p.wrong)
    return CircuitCheck(list(p.circuit), exact.values, kept)


def recall(scores: Tensor, circuit: list[tuple[int, int]]) -> float:
    """The share of ``circuit``'s heads among the len(circuit) cells of ``scores`` (L, H) largest
    in magnitude: 1 = a method found exactly the planted heads."""
    k = len(circuit)
    H = scores.shape[1]
    top = {(int(i) // H, int(i) % H) for i in scores.flatten().abs().topk(k).indices}
    return len(top & set(circuit)) / k


__all__ = ["RESTORES", "STRAYS", "CircuitCheck", "Planted", "Recipe", "Symbols", "attention_only_gpt",
           "check", "copying", "induction", "permutation", "previous_token", "recall", "task_batch", "train",
           "trained"]
