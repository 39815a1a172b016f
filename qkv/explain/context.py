"""``qkv explain context``: what self-attention does to a word, in a real pretrained model.

CS189 Lec 22 ("contextualization"): after self-attention a token's vector is no longer the
generic vector of its word. "I swam across the river to get to the other bank": bank starts
as a mix of river bank and money bank and ends "about 0.9 river bank + 0.1 bank". And in
"The animal didn't cross the street because it was too tired" "it" should look at "animal",
with "...too wide" at "street"; the attention matrix A shows where it looks.

Both are measured in all-MiniLM-L6-v2 loaded into qkv's own Encoder (6 layers x 12 heads):
the vector of "bank" after each layer (forward hooks on the blocks; layer 0 = the embeddings),
and the attention weights of "it" (``return_weights=True`` with the reference backend).
MiniLM is a small model trained for sentence similarity, not for resolving pronouns: the
numbers show what it does, which is weaker than the lecture's idealised picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from rich.console import Console

    from qkv.pipelines import SentenceEncoder

BANK_SENTENCES = (
    ("river", "I swam across the river to get to the other bank."),
    ("river", "We sat on the bank of the river and watched the water."),
    ("money", "I deposited my paycheck at the bank."),
    ("money", "The bank approved my loan application."),
)
IT_SENTENCES = (
    "The animal didn't cross the street because it was too tired.",
    "The animal didn't cross the street because it was too wide.",
)
SPECIAL = ("[CLS]", "[SEP]")


@dataclass
class WordVectors:
    """The vector of ``word`` in each sentence after each layer, compared by cosine.

    cosine[l][i][j]: between sentences i and j after layer l (0 = embeddings). With sense
    labels, within[l]/across[l] average the pairs of the same/different senses.
    """

    word: str
    sentences: list[str]
    senses: list[str] | None
    positions: list[int]  # the word's token index in each sentence
    cosine: list[list[list[float]]]
    within: list[float] | None
    across: list[float] | None
    # The notes' "about 0.9 river bank + 0.1 money bank": with two senses of >= 2 sentences each,
    # share[l][i] is the w in [0, 1] that brings w·A + (1 − w)·B closest to sentence i's vector after
    # layer l, A and B the mean vectors of each sense's other sentences (i left out), A the first sense.
    share: list[list[float]] | None = None
    sense_names: tuple[str, str] | None = None


@dataclass
class ItAttention:
    """Where the pronoun looks, in one sentence: weights[l][h][j] from "it" to token j."""

    sentence: str
    tokens: list[str]
    it: int
    weights: list[list[list[float]]]  # (layers, heads, tokens)

    def mean_over_heads(self, layer: int) -> list[float]:
        row = torch.tensor(self.weights[layer])
        return row.mean(dim=0).tolist()


@dataclass
class ContextResult:
    bank: WordVectors
    it: list[ItAttention]
    candidates: tuple[str, str]  # the two nouns "it" may refer to


def _word_position(tokens: Sequence[str], word: str, sentence: str) -> int:
    if word not in tokens:
        raise ValueError(f"{sentence!r} does not contain {word!r} as one token (MiniLM reads it as: "
                         f"{' '.join(tokens[1:-1])}); use sentences with the word, and a word MiniLM "
                         "keeps whole")
    return list(tokens).index(word)


def _layer_states(encoder: SentenceEncoder, ids: list[int]) -> list[torch.Tensor]:
    """The (T, dim) states after the embeddings and after every block of the encoder."""
    model = encoder.model
    states: list[torch.Tensor] = []

    def keep(_module, _args, output) -> None:
        states.append((output[0] if isinstance(output, tuple) else output)[0].detach().double())

    hooks = [model.emb_norm.register_forward_hook(keep)]
    hooks += [b.register_forward_hook(keep) for b in model.stack.blocks]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return states


def word_vectors(encoder: SentenceEncoder, word: str = "bank",
                 sentences: Sequence[tuple[str | None, str]] = BANK_SENTENCES) -> WordVectors:
    """Cosines between the vectors of ``word`` in ``sentences`` ((sense or None, text) pairs)."""
    if len(sentences) < 2:
        raise ValueError("give at least two sentences to compare the word's vectors")
    word = word.lower()  # MiniLM's WordPiece vocabulary is uncased
    per_sentence, positions = [], []
    for _, text in sentences:
        enc = encoder.tokenizer.tokenizer.encode(text)
        j = _word_position(enc.tokens, word, text)
        positions.append(j)
        per_sentence.append(torch.stack([s[j] for s in _layer_states(encoder, enc.ids)]))  # (L+1, dim)
    v = F.normalize(torch.stack(per_sentence), dim=-1)  # (S, L+1, dim)
    cos = torch.einsum("ild,jld->lij", v, v)  # (L+1, S, S)
    senses = [s for s, _ in sentences]
    within = across = None
    if all(s is not None for s in senses) and len(set(senses)) > 1:
        same = torch.tensor([[a == b for b in senses] for a in senses])
        off = ~torch.eye(len(senses), dtype=torch.bool)
        if (same & off).any():
            within = cos[:, same & off].mean(dim=1).tolist()
        across = cos[:, ~same].mean(dim=1).tolist()
    share, names = _sense_shares(torch.stack(per_sentence), senses)
    return WordVectors(word, [t for _, t in sentences], senses if within is not None else None,
                       positions, cos.tolist(), within, across, share, names)


def _sense_shares(states: torch.Tensor, senses: list[str | None]
                  ) -> tuple[list[list[float]] | None, tuple[str, str] | None]:
    """states (S, L+1, dim): each sentence's vector as a mix of the two senses' mean vectors (leaving
    the sentence itself out): w = clip(((v − B)·(A − B)) / ‖A − B‖², 0, 1), per layer."""
    names = list(dict.fromkeys(senses))
    if len(names) != 2 or None in names or any(senses.count(n) < 2 for n in names):
        return None, None
    out = []
    for i in range(len(senses)):
        others = [[j for j, t in enumerate(senses) if t == n and j != i] for n in names]
        a, b = (states[idx].mean(0) for idx in others)  # (L+1, dim)
        d = a - b
        w = ((states[i] - b) * d).sum(-1) / (d * d).sum(-1).clamp_min(1e-12)
        out.append(w.clamp(0, 1).tolist())
    shares = [[out[i][layer] for i in range(len(senses))] for layer in range(states.shape[1])]
    return shares, (str(names[0]), str(names[1]))


def it_attention(encoder: SentenceEncoder, sentence: str, pronoun: str = "it") -> ItAttention:
    """All layers' and heads' attention weights from ``pronoun`` to every token."""
    enc = encoder.tokenizer.tokenizer.encode(sentence)
    j = _word_position(enc.tokens, pronoun, sentence)
    with torch.inference_mode():
        out = encoder.model(torch.tensor([enc.ids]), backend="reference", return_weights=True)
    w = torch.stack([layer[0, :, j].double() for layer in out.weights])  # (L, H, T)
    return ItAttention(sentence, list(enc.tokens), j, w.tolist())


def explain_context(encoder: SentenceEncoder, word: str = "bank",
                    sentences: Sequence[tuple[str | None, str]] = BANK_SENTENCES) -> ContextResult:
    """The word-vector comparison and the attention of "it" in the lecture's two sentences.

    Args:
        encoder: MiniLM, ``qkv.load("minilm")``.
    """
    return ContextResult(word_vectors(encoder, word, sentences),
                         [it_attention(encoder, s) for s in IT_SENTENCES], ("animal", "street"))


def strongest_head(it: ItAttention, target: str) -> tuple[int, int, float]:
    """(layer, head, weight) where "it" puts the most weight on ``target``."""
    w = torch.tensor(it.weights)[:, :, it.tokens.index(target)]  # (L, H)
    flat = int(w.argmax())
    return flat // w.shape[1], flat % w.shape[1], float(w.max())


def top_tokens(it: ItAttention, layer: int, k: int = 3) -> list[tuple[str, float]]:
    """The k tokens "it" weighs most in ``layer`` (mean over heads), leaving out [CLS], [SEP]
    and "it" itself, where BERT-style models park much of their attention."""
    mean = it.mean_over_heads(layer)
    keep = [j for j, t in enumerate(it.tokens) if t not in SPECIAL and j != it.it]
    keep.sort(key=lambda j: -mean[j])
    return [(it.tokens[j], mean[j]) for j in keep[:k]]


def render_context(r: ContextResult, console: Console) -> None:
    """Print the tables of ``qkv explain context``."""
    from qkv.explain._render import add_row, say, table
    from qkv.viz.tokens import show_token

    b = r.bank
    n_layers = len(b.cosine) - 1
    say(console, f"The vector of {b.word!r} in {len(b.sentences)} sentences (MiniLM; CS189 Lec 22, "
        "contextualization)", "bold")
    for i, s in enumerate(b.sentences):
        sense = f" [{b.senses[i]}]" if b.senses else ""
        say(console, f"  {i + 1}.{sense} {s}")
    senses = b.within is not None and b.across is not None
    t = table(f"cosine between the {b.word!r} vectors after each layer",
              ["layer", "all pairs", *(["same sense", "other sense", "gap"] if senses else [])])
    n = len(b.sentences)
    for layer in range(n_layers + 1):
        pairs = [b.cosine[layer][i][j] for i in range(n) for j in range(i + 1, n)]
        cells = ["0 (embeddings)" if layer == 0 else str(layer), f"{sum(pairs) / len(pairs):.3f}"]
        if b.within is not None and b.across is not None:
            cells += [f"{b.within[layer]:.3f}", f"{b.across[layer]:.3f}",
                      f"{b.within[layer] - b.across[layer]:+.3f}"]
        add_row(t, *cells)
    console.print(t)
    if b.share is not None and b.sense_names is not None:
        first, second = b.sense_names
        t = table(f"each {b.word!r} as w·({first} sense) + (1 − w)·({second} sense), the senses' means from "
                  "the other sentences", ["sentence", "after the embeddings", f"after layer {n_layers}"])
        for i, s in enumerate(b.sentences):
            w0, w1 = b.share[0][i], b.share[-1][i]
            add_row(t, f"{i + 1}. {s[:48]}", f"{w0:.2f} {first} + {1 - w0:.2f} {second}",
                    f"{w1:.2f} {first} + {1 - w1:.2f} {second}")
        console.print(t)
        w0, w1 = b.share[0][0], b.share[-1][0]
        say(console, "The notes: after attention, 'bank' in the river sentence is 'about 0.9 river bank + "
            "0.1 bank' (CS189 Lec 22). Measured in MiniLM for sentence 1 (the closest point on the line "
            f"between the two senses' mean vectors): {w0:.2f} {first} after the embeddings, {w1:.2f} after "
            f"layer {n_layers}. Context moves it towards its sense; the notes' 0.9 is an illustration, not "
            "this model's number.", "yellow")
    last = table(f"cosines after layer {n_layers}", ["", *(str(i + 1) for i in range(len(b.sentences)))])
    for i, row in enumerate(b.cosine[-1]):
        add_row(last, str(i + 1), *(f"{c:.3f}" for c in row))
    console.print(last)
    a, s = r.candidates
    for it in r.it:
        t = table(f'{it.sentence!r}: where "it" looks (mean over the heads)',
                  ["layer", f"on {a!r}", f"on {s!r}", "top tokens besides [CLS], [SEP], it"])
        for layer in range(len(it.weights)):
            mean = it.mean_over_heads(layer)
            top = ", ".join(f"{show_token(tok)} {w:.2f}" for tok, w in top_tokens(it, layer))
            add_row(t, str(layer + 1), f"{mean[it.tokens.index(a)]:.3f}", f"{mean[it.tokens.index(s)]:.3f}",
                      top)
        console.print(t)
    ends = [it.sentence.rstrip(".").split()[-1] for it in r.it]
    heads = table(f"single heads: the one looking hardest at {a!r} in '...{ends[0]}' and at {s!r} in "
                  f"'...{ends[1]}'", ["head", *(f"{e}: {n}" for e in ends for n in (a, s))])
    for it, target in zip(r.it, (a, s), strict=True):  # tired -> animal, wide -> street
        layer, head, _ = strongest_head(it, target)
        cells = [f"layer {layer + 1} head {head + 1}"]
        for other in r.it:
            cells += [f"{other.weights[layer][head][other.tokens.index(n)]:.3f}" for n in (a, s)]
        add_row(heads, *cells)
    console.print(heads)
    say(console, "Much of every row goes to [CLS], [SEP] and punctuation, as in BERT; the "
        "candidates' weights are the signal to compare.", "dim")
