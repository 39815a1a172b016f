"""POST /api/lens through FastAPI's TestClient, against qkv.lens and the model's own forward pass:
the logits, the logit lens, the thumbnails, ablation; bad requests answered with a 4xx message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from serve_helpers import detail

from qkv import lens
from qkv.inference import open_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
for _module in ("fastapi", "httpx"):
    pytest.importorskip(_module, reason="the API tests need FastAPI and httpx: pip install 'qkv[dev]'")

TEXT = "ROMEO: But soft"


@pytest.fixture(scope="module")
def client(runs_dir):
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    with TestClient(create_app(runs_dir=runs_dir, max_tokens=64, max_chars=2000)) as c:
        yield c


def test_lens_answers_with_the_models_own_numbers(client, runs_dir) -> None:
    r = client.post("/api/lens", json={"model": "runs/gpt-tiny", "text": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    lm = open_model(runs_dir / "gpt-tiny")
    ids = lm.tokenizer.encode(TEXT)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(torch.tensor(body["logits"]), logits, atol=1e-5)
    assert [c["id"] for c in body["candidates"]] == logits.topk(20).indices.tolist()
    assert body["tokens"] == [lm.tokenizer.decode([i]) for i in ids]
    ll = lens.logit_lens(lm, TEXT)
    first = max(0, len(ids) - 16)
    assert body["lens"]["positions"] == list(range(first, len(ids)))
    want = ll.logprobs[:, first:].max(-1).values.exp()
    assert torch.allclose(torch.tensor(body["lens"]["prob"]), want, atol=1e-4)
    L, H, T = lm.n_layers, lm.n_heads, len(ids)
    assert len(body["thumbs"]) == L * H and len(body["thumbs"][0]) == min(T, 16)
    with torch.no_grad():  # thumbnails: the patterns average-pooled
        w = lm.model(torch.tensor([ids]), backend="reference", return_weights=True).weights
    want = F.adaptive_avg_pool2d(w[1][0, 2][None], min(T, 16))[0] if T > 16 else w[1][0, 2]
    assert torch.allclose(torch.tensor(body["thumbs"][1 * H + 2]), want, atol=1e-4)
    assert torch.allclose(torch.tensor(body["scores"]["previous"]), lens.head_scores(lm).previous, atol=1e-6)
    # one threshold for naming a head, the page's and the terminal's: named iff its best score reaches 0.5
    assert body["threshold"] == 0.5
    for layer, row in enumerate(body["labels"]):
        for head, label in enumerate(row):
            best = max(body["scores"][t][layer][head] for t in body["scores"])
            assert bool(label) == (best >= 0.5), (layer, head, label, best)
    assert body["base_logits"] is None
    # the rollout, by hand in float64: A_l = (mean of heads + I) / 2, rows renormalised, multiplied up
    roll = torch.eye(T, dtype=torch.float64)
    for layer_w in w:
        a = 0.5 * layer_w[0].double().mean(0) + 0.5 * torch.eye(T, dtype=torch.float64)
        roll = (a / a.sum(-1, keepdim=True)) @ roll
    rows = list(range(max(0, T - 32), T))
    assert body["rollout"]["positions"] == rows
    assert torch.allclose(torch.tensor(body["rollout"]["values"], dtype=torch.float64), roll[rows], atol=1e-4)


def test_lens_with_heads_knocked_out(client, runs_dir) -> None:
    body = client.post("/api/lens", json={"model": "runs/gpt-tiny", "text": TEXT, "ablate": [[0, 1], [1, 3]],
                                          "thumbs": False}).json()
    lm = open_model(runs_dir / "gpt-tiny")
    want = lens.ablate(lm, TEXT, [(0, 1), (1, 3)])[-1]
    assert torch.allclose(torch.tensor(body["logits"]), want, atol=1e-5)
    assert body["ablated"] == [[0, 1], [1, 3]] and body["thumbs"] is None
    base = lens.run_with_cache(lm, TEXT).logits[-1]
    assert torch.allclose(torch.tensor(body["base_logits"]), base, atol=1e-5)


@pytest.mark.parametrize("body, status, message", [
    ({"model": "runs/gpt-tiny", "text": TEXT, "ablate": [[5, 0]]}, 422, "head 5.0 is not in"),
    ({"model": "runs/gpt-tiny", "text": "   "}, 422, "the text is empty"),
    ({"model": "runs/vit-tiny", "text": TEXT}, 422, "the lens reads text models"),
    ({"model": "runs/nope", "text": TEXT}, 404, "nope"),
])
def test_bad_lens_requests_are_4xx(client, body, status, message) -> None:
    assert message in detail(client.post("/api/lens", json=body), status)


def test_qk_is_the_heads_attention_row(client, runs_dir) -> None:
    body = client.post("/api/qk", json={"model": "runs/gpt-tiny", "text": TEXT, "layer": 1, "head": 2,
                                        "query": 9}).json()
    lm = open_model(runs_dir / "gpt-tiny")
    with torch.no_grad():
        ids = torch.tensor([lm.tokenizer.encode(TEXT)])
        w = lm.model(ids, backend="reference", return_weights=True).weights
    assert torch.allclose(torch.tensor(body["weights"]), w[1][0, 2, 9, :10], atol=1e-5)
    assert body["query_token"] == "t" and len(body["keys"]) == 10  # causal: keys up to the query
    assert torch.allclose(torch.tensor(body["scaled"]), torch.tensor(body["dots"]) / body["head_dim"] ** 0.5,
                          atol=1e-5)
    assert "query must be a token position" in detail(client.post("/api/qk", json={
        "model": "runs/gpt-tiny", "text": TEXT, "layer": 0, "head": 0, "query": 40}), 422)


def test_patch_equals_the_library(client, runs_dir) -> None:
    req = {"model": "runs/gpt-tiny", "clean": TEXT, "corrupt": "ROMEO: But sift", "site": "head",
           "answer": "e", "wrong": "o"}
    body = client.post("/api/patch", json=req).json()
    lm = open_model(runs_dir / "gpt-tiny")
    p = lens.patch(lm, TEXT, "ROMEO: But sift", site="head", answer="e", wrong="o")
    assert torch.allclose(torch.tensor(body["values"]), p.values, atol=1e-4)
    assert (body["answer"], body["wrong"], body["columns"]) == ("e", "o", ["0", "1", "2", "3"])
    short, vit = {**req, "corrupt": "ROMEO"}, {**req, "model": "runs/vit-tiny"}
    assert "same number of tokens" in detail(client.post("/api/patch", json=short), 422)
    assert "reads text models" in detail(client.post("/api/patch", json=vit), 422)


def test_history_is_the_runs_file(client, runs_dir) -> None:
    from qkv.lens.history import read_history

    body = client.post("/api/history", json={"model": "runs/gpt-tiny"}).json()
    h = read_history(runs_dir / "gpt-tiny" / "history.jsonl")
    assert body["steps"] == h.steps and len(body["steps"]) >= 2
    assert torch.allclose(torch.tensor(body["scores"]["induction"]), h.scores["induction"], atol=1e-6)
    assert body["loss_second"] == pytest.approx(h.loss_second)
    vit = client.post("/api/history", json={"model": "runs/vit-tiny"})
    assert "has no training history" in detail(vit, 422)
    assert "nope" in detail(client.post("/api/history", json={"model": "runs/nope"}), 404)
