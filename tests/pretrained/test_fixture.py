"""qkv against ``reference_fixture.json``: what transformers and sentence-transformers computed
on the inputs of ``pretrained_cases.py`` (written by ``make_reference_fixture.py``).

These need only the assets, so the parity checks keep their meaning on a machine without the
reference packages. The last tests check, where the references are installed, that the
fixture still agrees with them (regenerate it if a reference or an asset changed).
"""

from __future__ import annotations

import pytest
import torch
from pretrained_cases import (
    FIXTURE,
    FIXTURE_MAX_BYTES,
    GREEDY_TOKENS,
    LOGIT_PROMPTS,
    MINILM_EMBED,
    MINILM_TEXTS,
    SMOLLM2_CHATS,
    SMOLLM2_PROMPTS,
    SMOLLM2_TEXTS,
    TOP_K,
    chat_ids,
)

EMBED_TOL = 1e-5
LOGIT_TOL = 1e-4
REGENERATE = "regenerate it: python tests/pretrained/make_reference_fixture.py"


def test_fixture_is_small_and_complete(reference_fixture) -> None:
    assert FIXTURE.stat().st_size < FIXTURE_MAX_BYTES
    m, s = reference_fixture["minilm"], reference_fixture["smollm2"]
    assert len(m["token_ids"]) == len(m["st_token_ids"]) == len(MINILM_TEXTS), REGENERATE
    assert len(m["embeddings"]) == len(MINILM_EMBED), REGENERATE
    assert all(len(e) == 384 for e in m["embeddings"])
    assert len(s["token_ids"]) == len(SMOLLM2_TEXTS), REGENERATE
    assert len(s["chat_ids"]) == len(SMOLLM2_CHATS), REGENERATE
    assert len(s["top_logits"]) == len(LOGIT_PROMPTS), REGENERATE
    assert all(len(t["ids"]) == len(t["values"]) == TOP_K for t in s["top_logits"])
    assert len(s["greedy"]) == len(SMOLLM2_PROMPTS), REGENERATE
    assert all(len(g) == GREEDY_TOKENS for g in s["greedy"])


def test_fixture_was_made_from_these_assets(reference_fixture, minilm_folder, smollm2_file) -> None:
    sizes = reference_fixture["asset_bytes"]
    assert sizes["minilm"] == (minilm_folder / "model.safetensors").stat().st_size, REGENERATE
    assert sizes["smollm2"] == smollm2_file.stat().st_size, REGENERATE


# --------------------------------------------------------------------------- MiniLM


def test_minilm_token_ids(minilm, reference_fixture) -> None:
    ref = reference_fixture["minilm"]
    for text, ids in zip(MINILM_TEXTS, ref["token_ids"], strict=True):
        assert minilm.tokenizer.encode(text) == ids, text[:40]
    ours, lengths = minilm.tokenizer.encode_batch(MINILM_TEXTS, minilm.max_tokens)
    assert minilm.max_tokens == ref["max_seq_length"]
    for row, n, ids in zip(ours, lengths, ref["st_token_ids"], strict=True):
        assert row[:n] == ids  # truncated as sentence-transformers truncates


def test_minilm_embeddings(minilm, reference_fixture) -> None:
    ref = torch.tensor(reference_fixture["minilm"]["embeddings"])
    diff = (minilm.embed(MINILM_EMBED) - ref).abs().max().item()
    print(f"MiniLM embeddings vs fixture: max abs diff {diff:.2e}")
    assert diff <= EMBED_TOL


# --------------------------------------------------------------------------- SmolLM2


def test_smollm2_token_ids(smollm2, reference_fixture) -> None:
    assert smollm2.tokenizer.encode("Once upon a time") == [6403, 1980, 253, 655]
    for text, ids in zip(SMOLLM2_TEXTS, reference_fixture["smollm2"]["token_ids"], strict=True):
        assert smollm2.tokenizer.encode(text) == ids, repr(text)


def test_smollm2_chat_template_ids(smollm2, reference_fixture) -> None:
    for messages, ids in zip(SMOLLM2_CHATS, reference_fixture["smollm2"]["chat_ids"], strict=True):
        assert smollm2.tokenizer.encode(smollm2.format_chat(messages)) == ids


@pytest.mark.parametrize("i", range(len(LOGIT_PROMPTS)), ids=LOGIT_PROMPTS)
def test_smollm2_top_logits(smollm2, reference_fixture, i: int) -> None:
    ref = reference_fixture["smollm2"]["top_logits"][i]
    ids = torch.tensor([smollm2.tokenizer.encode(LOGIT_PROMPTS[i])])
    with torch.inference_mode():
        last = smollm2.model(ids, last_only=True).logits[0, -1]
    diff = (last[ref["ids"]] - torch.tensor(ref["values"])).abs().max().item()
    print(f"SmolLM2 top-{TOP_K} logits vs fixture {LOGIT_PROMPTS[i]!r}: max abs diff {diff:.2e}")
    assert diff <= LOGIT_TOL
    # The stored ids are qkv's top 20 too: no other id comes within the tolerance of them.
    others = last.clone()
    others[ref["ids"]] = -torch.inf
    assert others.max() < min(ref["values"]) - LOGIT_TOL
    assert last.argmax().item() == ref["ids"][0]


@pytest.mark.parametrize("i", range(len(SMOLLM2_PROMPTS)), ids=SMOLLM2_PROMPTS)
def test_smollm2_greedy(smollm2, qkv_greedy, reference_fixture, i: int) -> None:
    """CausalLM.generate (KV cache, batch 1) vs the reference's 32-step greedy decode."""
    ref = reference_fixture["smollm2"]["greedy"][i]
    ids, text = qkv_greedy(SMOLLM2_PROMPTS[i])
    assert ids == ref
    assert text == smollm2.tokenizer.decode(ref)


# without the cache (~24 s) in `pytest -m slow`, as in test_smollm2.py
@pytest.mark.parametrize("use_cache", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["cache", "nocache"])
def test_smollm2_greedy_batched(qkv_greedy_batch, reference_fixture, use_cache: bool):
    assert qkv_greedy_batch(use_cache) == reference_fixture["smollm2"]["greedy"]


# --------------------------------------------------------------------------- the fixture is current


def test_fixture_agrees_with_live_minilm_references(reference_fixture, hf_minilm_tokenizer, st_minilm):
    ref = reference_fixture["minilm"]
    for text, ids in zip(MINILM_TEXTS, ref["token_ids"], strict=True):
        assert hf_minilm_tokenizer(text, truncation=False)["input_ids"] == ids, REGENERATE
    live = st_minilm.encode(MINILM_EMBED, convert_to_tensor=True).cpu()
    assert (live - torch.tensor(ref["embeddings"])).abs().max().item() <= 1e-6, REGENERATE


def test_fixture_agrees_with_live_smollm2_reference(reference_fixture, hf_smollm2, hf_smollm2_logits):
    ref = reference_fixture["smollm2"]
    tok = hf_smollm2[1]
    for text, ids in zip(SMOLLM2_TEXTS, ref["token_ids"], strict=True):
        assert tok(text)["input_ids"] == ids, REGENERATE
    for messages, ids in zip(SMOLLM2_CHATS, ref["chat_ids"], strict=True):
        assert chat_ids(tok, messages) == ids, REGENERATE
    for prompt, ids in zip(SMOLLM2_PROMPTS, ref["greedy"], strict=True):
        head = tok(prompt)["input_ids"]
        assert hf_smollm2_logits(head + ids)[len(head) - 1 : -1].argmax(-1).tolist() == ids, REGENERATE
