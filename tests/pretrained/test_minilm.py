"""all-MiniLM-L6-v2 in qkv's own Encoder, compared live with the reference implementations.

transformers' ``BertModel`` (eager attention) is the reference for hidden states and attention
weights, ``SentenceTransformer`` for embeddings and truncation, transformers' tokenizer for
token ids. fp32 throughout; tolerance 1e-5 max abs. Without the references these tests skip
and ``test_fixture.py`` compares against stored reference values instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pretrained_cases import LONG, MINILM_BATCH, MINILM_TEXTS

TOL = 1e-5


def _hf_batch(hf_tok, texts):
    """The reference tokenizer's padded batch: (ids, mask) as qkv's Encoder takes them."""
    b = hf_tok(texts, padding=True, return_tensors="pt")
    return b["input_ids"], b["attention_mask"]


# --------------------------------------------------------------------------- tokenizer


def test_known_token_ids(minilm) -> None:
    assert minilm.tokenizer.encode("The cat sat on the mat.") == [
        101, 1996, 4937, 2938, 2006, 1996, 13523, 1012, 102
    ]


@pytest.mark.parametrize("text", MINILM_TEXTS, ids=range(len(MINILM_TEXTS)))
def test_token_ids_match_transformers(minilm, hf_minilm_tokenizer, text: str) -> None:
    assert minilm.tokenizer.encode(text) == hf_minilm_tokenizer(text, truncation=False)["input_ids"]


def test_truncation_matches_sentence_transformers(minilm, st_minilm) -> None:
    """Over-long sentences are cut the way sentence-transformers cuts them: the first 254
    word pieces, then [SEP], 256 ids in all."""
    assert minilm.max_tokens == st_minilm.max_seq_length == 256
    pre = getattr(st_minilm, "preprocess", None) or st_minilm.tokenize
    batch = pre(MINILM_TEXTS)
    ours, lengths = minilm.tokenizer.encode_batch(MINILM_TEXTS, minilm.max_tokens)
    for i, text in enumerate(MINILM_TEXTS):
        ref = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert ours[i][: lengths[i]] == ref, text[:40]
    long = MINILM_TEXTS.index(LONG)
    assert len(minilm.tokenizer.encode(LONG)) > 256 and lengths[long] == 256
    assert ours[long][-1] == 102  # [SEP] kept at the end


# --------------------------------------------------------------------------- hidden states


@pytest.mark.parametrize("backend", ["sdpa", "reference", "chunked"])
def test_hidden_states_match_transformers(minilm, hf_minilm, hf_minilm_tokenizer, backend: str) -> None:
    ids, mask = _hf_batch(hf_minilm_tokenizer, MINILM_BATCH)
    real = mask.bool()
    # The batch really is padded: lengths differ, so most rows end in [PAD] positions.
    lengths = real.sum(1)
    assert len(MINILM_BATCH) >= 5 and len(set(lengths.tolist())) == len(MINILM_BATCH)
    assert (~real).sum() > 0
    with torch.inference_mode():
        ref = hf_minilm(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = minilm.model(ids, mask, backend=backend).hidden
    assert ours.shape == ref.shape == (len(MINILM_BATCH), ids.shape[1], 384)
    # Compare at real tokens only. Padded positions still get states (BERT computes a row for
    # every position), but nothing reads them: mean pooling weights them by 0, [CLS] is
    # position 0, and real tokens never attend to padded keys. Their values are an artefact
    # of how a kernel treats padded query rows, not part of the model's output.
    diff = (ours[real] - ref[real]).abs().max().item()
    print(f"MiniLM last hidden state, {backend}: max abs diff {diff:.2e}")
    assert diff <= TOL


def test_real_token_states_do_not_depend_on_padding(minilm, hf_minilm_tokenizer) -> None:
    """Why padded positions may be ignored: each sentence's real-token states are the same
    whether it is run alone (no padding at all) or inside the padded batch."""
    ids, mask = _hf_batch(hf_minilm_tokenizer, MINILM_BATCH)
    with torch.inference_mode():
        batch = minilm.model(ids, mask).hidden
        for i, n in enumerate(mask.sum(1).tolist()):
            alone = minilm.model(ids[i : i + 1, :n], mask[i : i + 1, :n]).hidden[0]
            assert (alone - batch[i, :n]).abs().max().item() <= TOL


def test_attention_weights_are_distributions_over_real_keys(minilm, hf_minilm_tokenizer) -> None:
    ids, mask = _hf_batch(hf_minilm_tokenizer, MINILM_BATCH)
    with torch.inference_mode():
        weights = minilm.model(ids, mask, backend="reference", return_weights=True).weights
    assert len(weights) == 6
    pad_keys = ~mask.bool()[:, None, None, :].expand_as(weights[0])
    for w in weights:
        assert w.shape == (len(MINILM_BATCH), 12, ids.shape[1], ids.shape[1])
        assert (w.sum(-1) - 1).abs().max().item() <= 1e-5
        assert (w >= 0).all()
        assert torch.equal(w[pad_keys], torch.zeros_like(w[pad_keys]))  # exactly 0, not ~0


def test_attention_weights_match_transformers(minilm, hf_minilm, hf_minilm_tokenizer) -> None:
    ids, mask = _hf_batch(hf_minilm_tokenizer, MINILM_BATCH)
    with torch.inference_mode():
        ref = hf_minilm(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        ours = minilm.model(ids, mask, backend="reference", return_weights=True).weights
    rows = mask.bool()[:, None, :, None]  # real query rows (padded rows: see above)
    diff = max((o - r).abs().masked_fill(~rows, 0).max().item() for o, r in zip(ours, ref, strict=True))
    print(f"MiniLM attention weights: max abs diff {diff:.2e}")
    assert diff <= TOL


# --------------------------------------------------------------------------- embeddings


def test_embeddings_match_sentence_transformers(minilm, st_minilm) -> None:
    texts = [*MINILM_BATCH, LONG]  # the long one is truncated to 256 tokens by both
    # sentence-transformers' pipeline ends in a Normalize module: its output is already unit
    # length, whatever normalize_embeddings says.
    ref = st_minilm.encode(texts, convert_to_tensor=True, normalize_embeddings=False).cpu()
    assert torch.allclose(ref.norm(dim=1), torch.ones(len(texts)), atol=1e-6)
    ours = minilm.embed(texts)
    assert ours.shape == (len(texts), 384) and ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    print(f"MiniLM embeddings vs sentence-transformers: max abs diff {diff:.2e}")
    assert diff <= TOL
    ref_n = st_minilm.encode(texts, convert_to_tensor=True, normalize_embeddings=True).cpu()
    assert (ours - ref_n).abs().max().item() <= TOL


def test_unnormalised_embedding_is_the_mean_of_real_token_states(minilm, hf_minilm, hf_minilm_tokenizer):
    ids, mask = _hf_batch(hf_minilm_tokenizer, MINILM_BATCH)
    with torch.inference_mode():
        h = hf_minilm(input_ids=ids, attention_mask=mask).last_hidden_state
    ref = torch.stack([h[i, : int(n)].mean(0) for i, n in enumerate(mask.sum(1))])
    ours = minilm.embed(MINILM_BATCH, normalize=False)
    assert (ours - ref).abs().max().item() <= TOL
    assert (minilm.embed(MINILM_BATCH) - F.normalize(ref, dim=-1)).abs().max().item() <= TOL


def test_batch_size_and_order_do_not_change_embeddings(minilm) -> None:
    """embed() sorts by length and pads per batch; the result is in input order regardless."""
    full = minilm.embed(MINILM_BATCH, batch_size=32)
    assert (minilm.embed(MINILM_BATCH, batch_size=2) - full).abs().max().item() <= TOL
    assert (minilm.embed(MINILM_BATCH[::-1]).flip(0) - full).abs().max().item() <= TOL
    assert (minilm.embed(MINILM_BATCH[2]) - full[2]).abs().max().item() <= TOL  # one string


# --------------------------------------------------------------------------- ranking


QUERY = "How do I bake bread at home?"
DOCS = [
    "The stock market fell sharply on Monday.",
    "A simple recipe for baking a sourdough loaf in your own oven.",
    "The cat chased a mouse across the garden.",
    "Football season starts next week.",
]


def test_rank_puts_the_related_sentence_first(minilm) -> None:
    ranked = minilm.rank(QUERY, DOCS)
    assert ranked[0][0] == 1
    assert sorted(i for i, _ in ranked) == list(range(len(DOCS)))
    scores = [s for _, s in ranked]
    assert scores == sorted(scores, reverse=True)
    assert ranked[0][1] - ranked[1][1] > 0.2  # not a near tie


def test_rank_scores_are_reference_cosines(minilm, st_minilm) -> None:
    e = st_minilm.encode([QUERY, *DOCS], convert_to_tensor=True).cpu()
    ref = e[1:] @ e[0]
    for i, score in minilm.rank(QUERY, DOCS):
        assert abs(score - ref[i].item()) <= TOL


# --------------------------------------------------------------------------- the command line


def test_cli_embed_json_values_are_sentence_transformers_embeddings(minilm_cli, st_minilm) -> None:
    import json

    from helpers import call

    texts = DOCS[:3]
    rc, out, err = call(["embed", "minilm", "--json", *texts])
    assert rc == 0, err
    got = json.loads(out)
    assert [g["text"] for g in got] == texts
    ref = st_minilm.encode(texts, convert_to_tensor=True).cpu().double()
    vecs = torch.tensor([g["embedding"] for g in got], dtype=torch.float64)
    assert vecs.shape == (3, 384)
    assert (vecs - ref).abs().max().item() <= TOL  # printed to 7 decimals: rounding adds 5e-8


def test_cli_similarity_json_ranks_by_reference_cosine(minilm_cli, st_minilm) -> None:
    import json

    from helpers import call

    rc, out, err = call(["similarity", "minilm", QUERY, *DOCS, "--json", "--top", "3"])
    assert rc == 0, err
    got = json.loads(out)
    # The reference: sentence-transformers' vectors, cosine in float64, sorted by hand.
    e = st_minilm.encode([QUERY, *DOCS], convert_to_tensor=True).cpu().double()
    cos = [float(torch.dot(e[0], d) / (e[0].norm() * d.norm())) for d in e[1:]]
    order = sorted(range(len(DOCS)), key=lambda i: -cos[i])[:3]
    assert [g["rank"] for g in got] == [1, 2, 3]
    assert [g["index"] for g in got] == order and order[0] == 1  # the bread recipe first
    assert [g["text"] for g in got] == [DOCS[i] for i in order]
    assert [g["score"] for g in got] == pytest.approx([cos[i] for i in order], abs=TOL)
