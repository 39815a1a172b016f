"""The page's quiz mode (POST /api/quiz/question, /api/quiz/answer; qkv/serve/quiz_api.py): the
truth it reveals equals the model's own forward pass computed here, the same (model, kind, seed)
is the same question, bad requests are one-line 4xx, and in Debian's Chromium (headless,
Playwright, never a downloaded browser) a question is asked, answered, revealed with the lens's
numbers and scored."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from helpers import page_wait
from serve_helpers import asset_installed

import qkv

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
MODEL = "runs/gpt-tiny"


def post(server: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(q: dict) -> dict:
    """What names a question: send it back with the answer."""
    return {"model": q["model"], "kind": q["kind"], "seed": q["seed"]}


def test_the_revealed_next_token_is_the_forward_pass_argmax(tiny_gpt_server, tiny_run) -> None:
    lm = qkv.load(tiny_run("gpt"))
    for seed in (1, 2):
        body = {"model": MODEL, "kind": "next", "seed": seed}
        status, q = post(tiny_gpt_server, "/api/quiz/question", body)
        assert status == 200, q
        assert "truth" not in q and "reveal" not in q  # the answer computes the truth again
        ids = lm.tokenizer.encode(q["text"])
        with torch.no_grad():
            best = int(lm.model(torch.tensor([ids])).logits[0, -1].argmax())
        want = q["choices"].index(json.dumps(lm.tokenizer.decode([best]), ensure_ascii=False))
        status, r = post(tiny_gpt_server, "/api/quiz/answer", {**ask(q), "choice": want})
        assert status == 200, r
        assert r["correct"] and r["truth"] == want and r["reveal"]["bars"][0]["id"] == best
        again = post(tiny_gpt_server, "/api/quiz/question", {"model": MODEL, "kind": "next", "seed": seed})[1]
        assert again["choices"] == q["choices"] and again["question"] == q["question"]


def test_every_kind_is_asked_and_a_wrong_answer_is_told(tiny_gpt_server) -> None:
    for kind in ("next", "induction", "knockout", "lens"):
        status, q = post(tiny_gpt_server, "/api/quiz/question", {"model": MODEL, "kind": kind, "seed": 5})
        assert status == 200 and q["kind"] == kind and len(q["choices"]) >= 2, q
        status, r = post(tiny_gpt_server, "/api/quiz/answer", {**ask(q), "choice": 0})
        assert status == 200 and r["correct"] == (r["truth"] == 0) and r["explain"]
        if not r["correct"]:
            assert r["choice"] == 0


def test_bad_requests_are_one_line_4xx(tiny_gpt_server) -> None:
    cases = [
        ("/api/quiz/question", {"model": MODEL, "kind": "poetry"}, 422),
        ("/api/quiz/question", {"model": MODEL, "seed": -1}, 422),
        ("/api/quiz/question", {"model": "runs/no-such-run"}, 404),
        ("/api/quiz/question", {"model": "../etc"}, 400),
        ("/api/quiz/question", {}, 422),
        ("/api/quiz/answer", {"model": MODEL, "kind": "next", "seed": 1}, 422),
        ("/api/quiz/answer", {"model": MODEL, "kind": "next", "seed": 1, "choice": -1}, 422),
        ("/api/quiz/answer", {"model": MODEL, "kind": "next", "seed": 2**31, "choice": 0}, 422),
        ("/api/quiz/answer", {"model": "runs/nope", "kind": "lens", "seed": 1, "choice": 0}, 404),
        ("/api/quiz/answer", {"model": MODEL, "kind": "knockout", "seed": 1, "choice": 2}, 422),  # yes or no
    ]
    if asset_installed("minilm"):
        cases.append(("/api/quiz/question", {"model": "minilm"}, 422))
    for path, body, code in cases:
        status, r = post(tiny_gpt_server, path, body)
        assert status == code, (body, r)
        assert isinstance(r["detail"], str) and "\n" not in r["detail"] and r["detail"], r


# ------------------------------------------------------------------ in the browser


def test_the_page_asks_reveals_and_scores(browser, tiny_gpt_server, tiny_run) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if r.url.startswith(tiny_gpt_server)
            else errors.append(f"request to {r.url}"))
    page.goto(tiny_gpt_server + "/")
    page.wait_for_selector("body[data-state=ready]")
    page.select_option("#model", MODEL)
    assert page.is_visible("#quiz-go") and page.is_hidden("#quiz")
    page.click("#quiz-go")
    page.wait_for_selector("#quiz-choices .quiz-choice")
    q = page.evaluate("window.qkvQuiz.question")
    assert page.locator("#quiz-choices .quiz-choice").count() == len(q["choices"])
    assert page.inner_text("#quiz-question") == q["question"] and page.is_hidden("#quiz-verdict")
    assert page.inner_text("#quiz-score") == "score 0/0"
    page.click("#quiz-choices .quiz-choice >> nth=0")
    page_wait(page, "window.qkvQuiz.answered === 1 && document.body.dataset.state === 'ready'")
    r = page.evaluate("window.qkvQuiz.reveal")
    assert page.is_visible("#quiz-verdict") and page.is_visible("#quiz-figure")
    assert page.inner_text("#quiz-score") == f"score {1 if r['correct'] else 0}/1"
    assert page.get_attribute(f"#quiz-choices .quiz-choice >> nth={r['truth']}", "class").endswith("truth")
    assert r["explain"] in page.inner_text("#quiz-verdict")
    L, H = 2, 4  # the tiny GPT's layers and heads
    top = {b["id"] for b in r["reveal"].get("bars", [])}
    extra = [c for c in r["reveal"].get("choices", []) if c["id"] not in top]
    drawn = {"next": ("#quiz-reveal rect.bar", len(r["reveal"].get("bars", [])) + len(extra)),
             "knockout": ("#quiz-reveal rect.bar", 2), "lens": ("#quiz-reveal rect.bar", L + 1),
             "induction": ("#quiz-reveal rect.quiz-cell", L * H)}[r["kind"]]
    assert page.locator(drawn[0]).count() == drawn[1]
    # the next question: asked again, the score kept
    page.click("#quiz-next")
    page_wait(page, "window.qkvQuiz.reveal === null && document.body.dataset.state === 'ready'")
    assert page.is_hidden("#quiz-verdict") and page.inner_text("#quiz-score").endswith("/1")
    page.close()
    assert errors == []


def test_the_page_reveals_the_argmax_and_scores_a_right_answer(browser, tiny_gpt_server, tiny_run) -> None:
    lm = qkv.load(tiny_run("gpt"))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(tiny_gpt_server + "/")
    page.wait_for_selector("body[data-state=ready]")
    page.select_option("#model", MODEL)
    page.select_option("#quiz-kind", "next")
    page.click("#quiz-go")
    page.wait_for_selector("#quiz-choices .quiz-choice")
    q = page.evaluate("window.qkvQuiz.question")
    assert q["kind"] == "next"
    with torch.no_grad():
        best = int(lm.model(torch.tensor([lm.tokenizer.encode(q["text"])])).logits[0, -1].argmax())
    right = q["choices"].index(json.dumps(lm.tokenizer.decode([best]), ensure_ascii=False))
    page.click(f"#quiz-choices .quiz-choice >> nth={right}")
    page_wait(page, "window.qkvQuiz.answered === 1 && document.body.dataset.state === 'ready'")
    assert page.inner_text("#quiz-score") == "score 1/1"
    assert page.inner_text("#quiz-verdict").startswith("Right")
    bars = page.locator("#quiz-reveal rect.bar")
    assert bars.first.get_attribute("data-id") == str(best)  # the likeliest first, outlined
    assert bars.first.get_attribute("stroke") is not None
    page.close()
