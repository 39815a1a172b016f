"""POST /api/lens through FastAPI's TestClient, against qkv.lens and the model's own forward pass:
the logits, the logit lens, the thumbnails, ablation; bad requests answered with a 4xx message."""

from __future__ import annotations

import json

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


PATCH = {"model": "runs/gpt-tiny", "clean": TEXT, "corrupt": "ROMEO: But sift", "site": "head",
         "answer": "e", "wrong": "o"}


def test_patch_equals_the_library(client, runs_dir) -> None:
    body = client.post("/api/patch", json={**PATCH, "method": "exact"}).json()
    lm = open_model(runs_dir / "gpt-tiny")
    p = lens.patch(lm, TEXT, "ROMEO: But sift", site="head", answer="e", wrong="o")
    assert torch.allclose(torch.tensor(body["values"]), p.values, atol=1e-6)
    assert (body["method"], body["answer"], body["wrong"], body["columns"]) == ("exact", "e", "o",
                                                                                ["0", "1", "2", "3"])
    assert body["estimate"] is None and body["agreement"] is None and body["estimate_seconds"] is None
    short, vit = {**PATCH, "corrupt": "ROMEO"}, {**PATCH, "model": "runs/vit-tiny"}
    assert "same number of tokens" in detail(client.post("/api/patch", json=short), 422)
    assert "reads text models" in detail(client.post("/api/patch", json=vit), 422)


@pytest.mark.parametrize("site", ["head", "resid"])
def test_the_estimate_is_attribution_patching_and_answers_by_default(client, runs_dir, site) -> None:
    """No method: the estimate, equal to qkv.lens.attribution_patch on the same model (to 1e-6:
    the values go out unrounded), with the seconds it took."""
    body = client.post("/api/patch", json={**PATCH, "site": site}).json()
    lm = open_model(runs_dir / "gpt-tiny")
    est = lens.attribution_patch(lm, TEXT, "ROMEO: But sift", site=site, answer="e", wrong="o")
    assert body["method"] == "estimate" and body["site"] == site
    assert torch.allclose(torch.tensor(body["values"]), est.values, atol=1e-6, rtol=0)
    assert (body["clean_diff"], body["corrupt_diff"]) == pytest.approx((est.clean_diff, est.corrupt_diff),
                                                                        abs=1e-6)
    assert len(body["rows"]) == lm.n_layers and len(body["columns"]) == est.values.shape[1]
    assert 0 < body["estimate_seconds"] <= body["seconds"] and body["estimate"] is None
    assert body["saturated"] == [list(c) for c in est.saturated()]  # the flag the page shows


def test_compare_holds_the_estimate_the_sweep_and_their_agreement(client, runs_dir) -> None:
    body = client.post("/api/patch", json={**PATCH, "method": "exact", "compare": True}).json()
    lm = open_model(runs_dir / "gpt-tiny")
    est = lens.attribution_patch(lm, TEXT, "ROMEO: But sift", site="head", answer="e", wrong="o")
    exact = lens.patch(lm, TEXT, "ROMEO: But sift", site="head", answer="e", wrong="o")
    assert body["method"] == "exact"
    assert torch.allclose(torch.tensor(body["values"]), exact.values, atol=1e-6, rtol=0)
    assert torch.allclose(torch.tensor(body["estimate"]), est.values, atol=1e-6, rtol=0)
    # the agreement the server computed is qkv.lens.agreement of the two tables it sent
    want = lens.agreement(torch.tensor(body["estimate"]), torch.tensor(body["values"]), k=10)
    assert body["agreement"] == {"spearman": pytest.approx(want.spearman, abs=1e-12), "recall": want.recall,
                                 "k": want.k}
    direct = lens.agreement(est.values, exact.values, k=10)
    assert body["agreement"]["spearman"] == pytest.approx(direct.spearman, abs=1e-9)
    assert want.k == 8 and body["estimate_seconds"] > 0  # 2 layers x 4 heads: k is every cell
    # the estimate alone is the same table (and is not the cached exact answer: the cache keys on method)
    alone = client.post("/api/patch", json=PATCH).json()
    assert alone["method"] == "estimate" and alone["values"] == body["estimate"]
    assert "compare puts the exact sweep beside the estimate" in detail(
        client.post("/api/patch", json={**PATCH, "compare": True}), 422)


def test_shared_answers_key_on_the_method(client) -> None:
    """An identical estimate is answered from the cache; the exact sweep of the same prompts is
    not the estimate's answer (the key is the whole request, method included)."""
    shared = client.app.state.explorer.shared
    body = {**PATCH, "wrong": "a"}
    computed, hits = shared.computed, shared.hits
    first, again = (client.post("/api/patch", json=body).json() for _ in range(2))
    assert first == again and (shared.computed, shared.hits) == (computed + 1, hits + 1)
    exact = client.post("/api/patch", json={**body, "method": "exact"}).json()
    assert (first["method"], exact["method"]) == ("estimate", "exact") and shared.computed == computed + 2


def test_a_quantised_model_answers_the_estimate_with_one_line_and_the_sweep_still_runs(runs_dir) -> None:
    """The registry serves a model as it loads it; one held in int8 has no gradients: the
    estimate (and compare, which needs it) is a one-line 422 naming what works; the exact sweep
    answers."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    app = create_app(runs_dir=runs_dir, max_tokens=64)
    with TestClient(app) as c:
        app.state.registry.get("runs/gpt-tiny").quantize("int8")  # as `auto` holds a 4-bit GGUF (q4)
        for extra in ({}, {"method": "exact", "compare": True}):
            message = detail(c.post("/api/patch", json={**PATCH, **extra}), 422)
            assert "runs/gpt-tiny is served with int8 weights" in message and 'method "exact"' in message
        r = c.post("/api/patch", json={**PATCH, "method": "exact"})
        assert r.status_code == 200 and r.json()["method"] == "exact", r.text
        streamed = c.post("/api/patch", json=PATCH, headers={"Accept": "application/x-ndjson"})
        last = json.loads(streamed.text.splitlines()[-1])
        assert (last["event"], last["status"]) == ("error", 422) and "int8 weights" in last["detail"]


def test_smollm2_as_the_server_loads_it_answers_the_estimate_with_one_line(client) -> None:
    """The bundled SmolLM2 is its 4-bit file, held as q4 where PyTorch has the int4 kernels (no
    gradients): a 422 naming the sweep."""
    from serve_helpers import asset_installed

    if not asset_installed("smollm2"):
        pytest.skip("needs the SmolLM2 asset: qkv assets install smollm2")
    held = client.app.state.registry.get("smollm2").weights
    if held != "q4":
        pytest.skip(f"this machine holds SmolLM2 as {held} (no int4 kernels): it has gradients")
    body = {"model": "smollm2", "clean": "The capital of France is", "corrupt": "The capital of Italy is"}
    message = detail(client.post("/api/patch", json=body), 422)
    assert message.startswith("smollm2 is served with q4 weights") and 'method "exact"' in message
    assert "--weights fp32" in message


def test_the_eager_notice_names_the_weights_the_saved_step_needs(runs_dir, capsys) -> None:
    """A server holding decoders in fp32 decodes eagerly until a saved step of *those* weights
    exists: its one-line notice says how to build that one (--weights fp32 in qkv prepare)."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    with TestClient(create_app(runs_dir=runs_dir, max_tokens=64, weights="fp32")) as c:
        r = c.post("/api/generate", json={"model": "runs/gpt-tiny", "prompt": "ROMEO", "max_new_tokens": 2})
        assert r.status_code == 200, r.text
    err = capsys.readouterr().err
    assert "decoding eagerly" in err and "qkv prepare runs/gpt-tiny" in err and "--weights fp32" in err


def test_the_server_holds_decoders_as_its_weights_option_says(runs_dir) -> None:
    """`qkv serve --weights int8` holds every decoder in int8 (the estimate: a 422 naming
    --weights fp32); a weights name it does not know is refused."""
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    app = create_app(runs_dir=runs_dir, max_tokens=64, weights="int8")
    with TestClient(app) as c:
        message = detail(c.post("/api/patch", json=PATCH), 422)
        assert app.state.registry.get("runs/gpt-tiny").weights == "int8" and "--weights fp32" in message
    with pytest.raises(ValueError, match="weights must be"):
        create_app(runs_dir=runs_dir, weights="fp16")


def test_smollm2_held_in_fp32_answers_the_library_s_estimate(runs_dir) -> None:
    """With --weights fp32 the bundled SmolLM2 is float and the estimate answers: the library's
    own, on the model the server holds."""
    from fastapi.testclient import TestClient
    from serve_helpers import asset_installed

    from qkv.serve import create_app

    if not asset_installed("smollm2"):
        pytest.skip("needs the SmolLM2 asset: qkv assets install smollm2")
    app = create_app(runs_dir=runs_dir, max_tokens=64, weights="fp32")
    body = {"model": "smollm2", "clean": "The capital of France is", "corrupt": "The capital of Italy is",
            "site": "head"}
    with TestClient(app) as c:
        r = c.post("/api/patch", json=body)
        assert r.status_code == 200, r.text
        lm = app.state.registry.get("smollm2")
        assert lm.weights == "fp32"
        want = lens.attribution_patch(lm, body["clean"], body["corrupt"], site="head")
        assert torch.allclose(torch.tensor(r.json()["values"]).float(), want.values, atol=1e-5)


def _events(client, body: dict) -> list[dict]:
    r = client.post("/api/patch", json=body, headers={"Accept": "application/x-ndjson"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson"), r.text
    return [json.loads(line) for line in r.text.splitlines()]


def test_the_estimate_streams_at_once_and_the_sweep_streams_its_progress(runs_dir, monkeypatch) -> None:
    """Streamed: the estimate's answer comes without sweep progress (one piece); the exact
    sweep's stream reports done of total forward passes, and with compare its first piece is the
    estimate: computed before the sweep's first forward pass (the order recorded in the loop)."""
    from fastapi.testclient import TestClient

    from qkv.lens import atp, causal
    from qkv.serve import create_app, lens_api
    from qkv.serve import loop as loop_module

    monkeypatch.setattr(loop_module, "SLICE_S", 0.0)  # a piece per slice: every step is seen
    order: list[str] = []
    real_est, real_cells = atp.attribution_patch, causal.tail_steps
    monkeypatch.setattr(lens_api.lens, "attribution_patch",
                        lambda *a, **k: order.append("estimate") or real_est(*a, **k))
    monkeypatch.setattr(causal, "tail_steps", lambda *a, **k: order.append("cell") or real_cells(*a, **k))
    with TestClient(create_app(runs_dir=runs_dir, max_tokens=64)) as c:
        est = _events(c, PATCH)
        assert est[-1]["event"] == "result" and est[-1]["result"]["method"] == "estimate"
        assert all(e.get("total") is None for e in est[:-1]) and order == ["estimate"]
        order.clear()
        both = _events(c, {**PATCH, "method": "exact", "compare": True})
        assert order[0] == "estimate" and order[1:] == ["cell"] * 2 and len(order) == 3  # 2 layers x 1 chunk
        assert both[-1]["event"] == "result"
        result = both[-1]["result"]
        assert result["estimate"] == est[-1]["result"]["values"] and result["agreement"]["k"] == 8
        progress = [(e["done"], e["total"]) for e in both if e.get("total")]
        assert progress == sorted(progress) and all(t == 2 for _, t in progress)


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
