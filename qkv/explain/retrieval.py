"""``qkv explain retrieval``: inner-product retrieval, from word counts to attention.

CS189 Lec 21-22 ("classic IR: inner-product retrieval"): turn each document into a key
vector and the question into a query vector, and rank the documents by qᵀk_i. Three ways to
make the vectors, as the lectures build them up:

- bag of words: one count per vocabulary word. Raw inner products reward common words
  ("a", "the") and long documents: vectors with large norms look similar to everything.
- TF-IDF: tf = count / document length, idf = log(N_docs / docs containing the word), so a
  word found everywhere weighs log(1) = 0. The lectures' example: a word 2 times in a
  100-word document, found in 300 of 1,000 documents: tf = 0.02, idf = log(1000/300).
  qkv uses the natural log (the lectures write "log" without a base; log10 only rescales every
  idf by the same factor, and the ranking is unchanged). Documents are ranked by cosine.
- sentence embeddings (MiniLM): learned vectors in which "puppy" is near "dog" though no
  letter is shared; ranked by cosine, i.e. the inner product of unit vectors.

Attention replaces the ranking by a softmax-weighted average: p = softmax(s · qᵀk),
z = Σ_i p_i v_i (here with :class:`qkv.attention.SoftLookup`, the documents' own vectors as
values), which is differentiable where "take the best document" is not.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv.attention import SoftLookup

if TYPE_CHECKING:
    from rich.console import Console

    from qkv.pipelines import SentenceEncoder

DOCUMENTS = (
    "A dog runs across the grass, chasing a ball.",
    "The park closes at sunset in the winter months.",
    "Kittens sleep most of the day in a warm spot.",
    "The bank raised its interest rates on savings accounts.",
    "We walked along the river bank and watched the boats.",
    "Training a neural network means minimising a loss with gradient descent.",
    "Attention lets every word in a sentence look at every other word.",
    "The recipe needs two eggs, flour, sugar and a pinch of salt.",
)
DEFAULT_QUERY = "a puppy playing in the park"
DEFAULT_SHARPNESS = 10.0  # cosines lie in [-1, 1]; s = 10 is a softmax temperature of 0.1


def tokenize(text: str) -> list[str]:
    """Lower-case words (letters, digits, apostrophes)."""
    return re.findall(r"[a-z0-9']+", text.lower())


@dataclass
class TfIdfExample:
    """The lectures' hand example (natural log; log10 shown for comparison)."""

    count: int
    length: int
    n_docs: int
    df: int
    tf: float
    idf: float
    tfidf: float
    idf_log10: float
    tfidf_log10: float


def tfidf_example(count: int = 2, length: int = 100, n_docs: int = 1000, df: int = 300) -> TfIdfExample:
    """tf = count/length, idf = ln(n_docs/df), tf-idf = tf·idf (CS189 Lec 21)."""
    if not (0 < count <= length and 0 < df <= n_docs):
        raise ValueError(f"need 0 < count <= length and 0 < df <= n_docs, got {count}, {length}, "
                         f"{n_docs}, {df}")
    tf = count / length
    idf, idf10 = math.log(n_docs / df), math.log10(n_docs / df)
    return TfIdfExample(count, length, n_docs, df, tf, idf, tf * idf, idf10, tf * idf10)


def bag_of_words(texts: Sequence[str], vocab: Sequence[str]) -> torch.Tensor:
    """(len(texts), len(vocab)) float64 word counts; words outside ``vocab`` are dropped."""
    index = {w: i for i, w in enumerate(vocab)}
    counts = torch.zeros(len(texts), len(vocab), dtype=torch.float64)
    for r, text in enumerate(texts):
        for w in tokenize(text):
            if w in index:
                counts[r, index[w]] += 1
    return counts


def tf_idf(counts: torch.Tensor, doc_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tf-idf rows, idf) from count rows and the documents' counts (which define idf)."""
    df = (doc_counts > 0).sum(dim=0).to(torch.float64)  # documents containing each word
    idf = torch.log(doc_counts.shape[0] / df)
    tf = counts / counts.sum(dim=1, keepdim=True).clamp_min(1)
    return tf * idf, idf


def _cosine(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(D,), (N, D) -> (N,) cosines; a zero vector has cosine 0 with everything."""
    qn = q / q.norm().clamp_min(1e-300)
    kn = keys / keys.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return kn @ qn


@dataclass
class RetrievalResult:
    """Scores of every document for the query, three ways, and the attention over them.

    bow: raw inner products of count vectors. tfidf: cosines of TF-IDF vectors. minilm:
    cosines of MiniLM embeddings (None when MiniLM is not installed). attention: softmax(s ·
    scores) of the best available scores (``attention_over`` names them); attention_nearest:
    the document whose vector is nearest (cosine) to the attention output z = Σ p_i k_i.
    """

    query: str
    documents: list[str]
    example: TfIdfExample
    query_words: list[str]
    unknown_words: list[str]  # query words no document contains (they cannot match)
    idf: dict[str, float]  # of the query's known words
    bow: list[float]
    tfidf: list[float]
    minilm: list[float] | None
    sharpness: float
    attention_over: str
    attention: list[float]
    attention_nearest: int
    note: str | None = None


def explain_retrieval(
    query: str = DEFAULT_QUERY,
    documents: Sequence[str] = DOCUMENTS,
    encoder: SentenceEncoder | None = None,
    sharpness: float = DEFAULT_SHARPNESS,
) -> RetrievalResult:
    """Rank ``documents`` for ``query`` by bag of words, TF-IDF and (with ``encoder``, a
    :class:`qkv.pretrained.SentenceEncoder`) MiniLM embeddings; then attend over them."""
    if not query.strip():
        raise ValueError("the query is empty; give some words to search for")
    documents = list(documents)
    if len(documents) < 2 or any(not tokenize(d) for d in documents):
        raise ValueError("give at least two documents, each with at least one word")
    if not (sharpness > 0 and math.isfinite(sharpness)):
        raise ValueError(f"sharpness must be finite and > 0, got {sharpness}")
    vocab = sorted({w for d in documents for w in tokenize(d)})
    docs = bag_of_words(documents, vocab)  # (N, V)
    q = bag_of_words([query], vocab)[0]  # (V,)
    doc_tfidf, idf = tf_idf(docs, docs)
    q_tfidf, _ = tf_idf(q[None], docs)
    words = tokenize(query)
    known = [w for w in dict.fromkeys(words) if w in set(vocab)]
    minilm = None
    keys, scores, over = doc_tfidf, _cosine(q_tfidf[0], doc_tfidf), "TF-IDF"
    query_vec = q_tfidf[0]
    if encoder is not None:
        emb = encoder.embed([query, *documents]).double()  # (1 + N, 384), unit rows
        query_vec, keys = emb[0], emb[1:]
        scores = keys @ query_vec  # cosines
        minilm, over = scores.tolist(), "MiniLM"
    # Attention over the documents: keys and values both the document vectors (unit length).
    unit = keys / keys.norm(dim=1, keepdim=True).clamp_min(1e-300)
    qn = query_vec / query_vec.norm().clamp_min(1e-300)
    out = SoftLookup(unit, unit, sharpness=sharpness)(qn)
    return RetrievalResult(
        query=query, documents=documents, example=tfidf_example(), query_words=words,
        unknown_words=[w for w in dict.fromkeys(words) if w not in set(vocab)],
        idf={w: float(idf[vocab.index(w)]) for w in known},
        bow=(docs @ q).tolist(), tfidf=_cosine(q_tfidf[0], doc_tfidf).tolist(), minilm=minilm,
        sharpness=float(sharpness), attention_over=over, attention=out.weights.tolist(),
        attention_nearest=int((unit @ out.out).argmax()),
    )


def _ranks(scores: Sequence[float]) -> list[int]:
    """1-based rank of each score (ties share the better rank)."""
    return [1 + sum(1 for t in scores if t > s) for s in scores]


def render_retrieval(r: RetrievalResult, console: Console) -> None:
    """Print the tables of ``qkv explain retrieval``."""
    from qkv.explain._render import add_row, num, say, table

    ex = r.example
    say(console, f"TF-IDF by hand (CS189 Lec 21): a word {ex.count} times in a {ex.length}-word "
        f"document, in {ex.df:,} of {ex.n_docs:,} documents:", "bold")
    say(console, f"  tf = {ex.count}/{ex.length} = {ex.tf:g};  idf = ln({ex.n_docs}/{ex.df}) = "
        f"{ex.idf:.5f};  tf-idf = {ex.tfidf:.5f}   (with log10: idf = {ex.idf_log10:.5f}, tf-idf = "
        f"{ex.tfidf_log10:.5f})")
    cols = ["document", "BoW qᵀk", "TF-IDF cos"]
    cols += ["MiniLM cos"] if r.minilm is not None else []
    cols += ["attention"]
    t = table(f"query: {r.query!r}, scored by each representation (rank in brackets)", cols, first_max=28)
    bow_r, tf_r = _ranks(r.bow), _ranks(r.tfidf)
    mini_r = _ranks(r.minilm) if r.minilm is not None else None
    for i, doc in enumerate(r.documents):
        cells = [f"{i + 1}. {doc}", f"{num(r.bow[i], 0)} ({bow_r[i]})", f"{r.tfidf[i]:.3f} ({tf_r[i]})"]
        if r.minilm is not None and mini_r is not None:
            cells.append(f"{r.minilm[i]:.3f} ({mini_r[i]})")
        cells.append(f"{r.attention[i]:.3f}")
        add_row(t, *cells)
    console.print(t)
    idf = ", ".join(f"{w} {v:.2f}" for w, v in r.idf.items())
    say(console, f"idf of the query's words over these {len(r.documents)} documents: {idf}"
        + (f"; not in any document: {', '.join(r.unknown_words)}" if r.unknown_words else ""), "dim")
    say(console, f"Attention: p = softmax({num(r.sharpness)} · cosine) over the {r.attention_over} vectors "
        f"(a temperature of {1 / r.sharpness:g}); the output Σ p_i k_i lies nearest to document "
        f"{r.attention_nearest + 1}: {r.documents[r.attention_nearest]!r}")
    if r.note:
        say(console, r.note, "yellow")
