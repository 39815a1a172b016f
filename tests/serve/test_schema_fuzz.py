"""A property-based fuzz of the whole OpenAPI schema of `qkv serve` (schemathesis, in process
through ASGI: no network): valid and invalid requests for every operation, with the model, the
text, the layer and head and the image swapped some of the time for real ones (the tiny runs,
MiniLM if installed), so that the models do real work. No response may be a 5xx, and no stream
of /api/generate may end in an error event (a 5xx that came after the status line).

The requests are the same whatever ran before: Hypothesis seeds each operation from the test's
source (``derandomize``), keeps no database, and here draws none of the constants it otherwise
collects from every local module already imported (:func:`no_local_constants`). That every
operation answers, not only refuses, is checked on requests the test builds to succeed
(:data:`VALID`, the quiz's answer from a question it was asked), not hoped for from the draws.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter

import pytest
from helpers import png_bytes
from serve_helpers import asset_installed

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
pytest.importorskip("multipart", reason="uploads need python-multipart: pip install 'qkv[serve]'")
schemathesis = pytest.importorskip("schemathesis",
                                   reason="the fuzz needs schemathesis: pip install 'qkv[dev]'")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Per operation and generation mode (valid / invalid), the same cases every run;
# QKV_FUZZ_EXAMPLES=500 for a deeper run, with new random cases each time.
EXAMPLES = int(os.environ.get("QKV_FUZZ_EXAMPLES", "50"))
DERANDOMIZE = "QKV_FUZZ_EXAMPLES" not in os.environ
RUNS = ["runs/gpt-tiny", "runs/vit-tiny", "runs/seq2seq-tiny", "runs/captioner-tiny"]


@pytest.fixture(scope="module")
def fuzz_app(runs_dir):
    from qkv.serve import create_app

    # small limits keep each case fast; a deep queue, since the fuzz asks one request at a time
    return create_app(runs_dir=runs_dir, max_tokens=32, max_chars=2000, max_new_tokens=6,
                      max_upload_bytes=20_000, max_pixels=100_000)


KEEP = object()  # keep what schemathesis drew


def _real_parts(path: str) -> st.SearchStrategy[dict]:
    """Fields to put into a generated body for ``path``, each some of the time (KEEP: leave it);
    mostly models that this endpoint takes."""
    models = RUNS + ["runs/escape", "runs/notes"] + (["minilm"] if asset_installed("minilm") else [])
    takes = {"/api/generate": ["runs/gpt-tiny"] * 4, "/api/lens": ["runs/gpt-tiny"] * 4,
             "/api/qk": ["runs/gpt-tiny"] * 4, "/api/patch": ["runs/gpt-tiny"] * 6,
             "/api/history": ["runs/gpt-tiny"] * 4, "/api/quiz/question": ["runs/gpt-tiny"] * 4,
             "/api/quiz/answer": ["runs/gpt-tiny"] * 4,
             "/api/image-attention": ["runs/vit-tiny", "runs/captioner-tiny"] * 2}.get(path, [])
    images = [png_bytes((8, 8), "L", 128), png_bytes((32, 32), "RGB", 128), png_bytes((64, 64), "RGB", 128),
              b"\x89PNG\r\n\x1a\n broken", b"GIF89a"]

    def sometimes(values: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(values, values, values, st.just(KEEP))

    return st.fixed_dictionaries({
        "model": sometimes(st.sampled_from(takes + models)),
        "text": sometimes(st.sampled_from(["ROMEO: But soft", "8 août 1977", "the cat sat on the mat",
                                           " ", "é✓", "\ud800 lone surrogate", "R\x00O", "R" * 1999])),
        "layer": sometimes(st.integers(-3, 3) | st.none() | st.just(2**70)),
        "head": sometimes(st.integers(-5, 5) | st.none()),
        "image": sometimes(st.sampled_from(images)),
        "max_new_tokens": sometimes(st.integers(1, 40) | st.just(512)),
        "temperature": sometimes(st.sampled_from([0.0, 1e-300, 1e-45, 1e-6, 2e-6, 0.7, 5.0])),
        "top_k": sometimes(st.integers(1, 10**6) | st.none() | st.just(2**70)),
        "seed": sometimes(st.sampled_from([None, 0, -1, 2**64 - 1, 2**64, -2**63 - 1, 2**70])),
        "corrupt": sometimes(st.sampled_from(["ROMEO: But sift"] * 4 + ["ROMEO: But soft", "x", " "])),
        "answer": sometimes(st.sampled_from(["e", "e", "a", "ROM", None])),
        "wrong": sometimes(st.sampled_from(["o", "e", None])),
        "query": sometimes(st.integers(-20, 20)),
        "ablate": sometimes(st.sampled_from([[], [[0, 1]], [[1, 3], [0, 0]], [[-1, -1]], [[9, 9]],
                                             [[0, 2**70]]])),
    })


def _draw(op, mode) -> list:
    """``EXAMPLES`` generated requests of one operation (schemathesis cases, with some fields
    swapped for real ones), drawn before any is sent: what is drawn cannot depend on answers."""
    text_field = {"/api/attention": "text", "/api/generate": "prompt", "/api/lens": "text",
                  "/api/qk": "text", "/api/patch": "clean"}.get(op.path)
    cases = []

    @given(case=op.as_strategy(generation_mode=mode), real=_real_parts(op.path))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    def draw(case, real) -> None:
        if isinstance(case.body, dict):
            for name, value in real.items():
                if name == "text":
                    name = text_field
                if value is not KEEP and name is not None and (name in case.body or name in (
                        "model", text_field)):
                    case.body[name] = value
        cases.append(case)

    draw()
    return cases


def _all_cases(app, only: tuple[str, ...] = ()) -> dict[str, list]:
    """Every operation of ``app``'s schema ("METHOD /path"; those in ``only`` if given) -> its
    drawn cases, valid ones then (for operations that take input) invalid ones."""
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    out: dict[str, list] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if only and f"{op.method.upper()} {op.path}" not in only:
            continue
        has_input = (op.body is not None and len(op.body) > 0) or any(True for _ in op.iter_parameters())
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input else [])
        out[f"{op.method.upper()} {op.path}"] = [c for mode in modes for c in _draw(op, mode)]
    return out


def _described(case) -> str:
    """What a case sends, as text (the same text for the same request)."""
    body = case.body if isinstance(case.body, dict | list | str | bytes | int | float) else None
    return repr((case.method, case.path, case.query, body))


@pytest.fixture
def no_local_constants(monkeypatch):
    """Hypothesis (6.13x and later) sometimes draws a constant found in the source of a local
    module already imported (``providers._get_local_constants``, read again whenever
    ``sys.modules`` grows): the same seed then draws other requests after other tests have
    imported more of qkv and of tests/. The fuzz gets no such constants, only its own strategies'
    and Hypothesis's fixed ones. (If Hypothesis renames it, this fails rather than drift.)"""
    from hypothesis.internal.conjecture import providers

    empty = providers.Constants()
    monkeypatch.setattr(providers, "_get_local_constants", lambda: empty)
    providers.CONSTANTS_CACHE.cache.clear()  # pools cached from the constants seen so far
    yield
    providers.CONSTANTS_CACHE.cache.clear()


def test_the_fuzz_draws_the_same_requests_whatever_was_imported_before(fuzz_app, no_local_constants,
                                                                      tmp_path, monkeypatch) -> None:
    """Importing a module with constants of its own between two draws changes nothing (two
    operations, the one that failed in a full run and one with many fields)."""
    ops = ("POST /api/quiz/answer", "POST /api/patch")
    before = {op: [_described(c) for c in cases] for op, cases in _all_cases(fuzz_app, ops).items()}
    module = tmp_path / "fuzz_constants_elsewhere.py"
    module.write_text("A = 987654321\nB = 'runs/zz-unheard-of'\nC = -77.25\nD = b'zz'\nE = 'ROMEO: zz'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("fuzz_constants_elsewhere")
    after = {op: [_described(c) for c in cases] for op, cases in _all_cases(fuzz_app, ops).items()}
    assert after == before
    assert set(before) == set(ops) and all(len(cases) >= EXAMPLES for cases in before.values())


def _valid_requests(client) -> dict[str, list]:
    """For every operation, requests built to succeed (each must get a 200): the tiny runs' own
    inputs, and a quiz answer to a question the server was first asked."""
    image = png_bytes((8, 8), "L", 128)
    text = {"model": "runs/gpt-tiny", "text": "ROMEO: But soft"}
    answers = []
    for kind in ("next", "induction", "knockout", "lens"):
        q = client.post("/api/quiz/question", json={"model": "runs/gpt-tiny", "kind": kind, "seed": 7})
        assert q.status_code == 200, q.text
        for choice in (0, len(q.json()["choices"]) - 1):
            answers.append(lambda c=choice, k=kind: client.post("/api/quiz/answer", json={
                "model": "runs/gpt-tiny", "kind": k, "seed": 7, "choice": c}))
    return {
        "GET /api/models": [lambda: client.get("/api/models")],
        "POST /api/attention": [lambda: client.post("/api/attention", json=text),
                                lambda: client.post("/api/attention", json={**text, "layer": 0, "head": 1})],
        "POST /api/generate": [lambda: client.post("/api/generate", json={
            "model": "runs/gpt-tiny", "prompt": "ROMEO:", "max_new_tokens": 3, "seed": 1})],
        "POST /api/lens": [lambda: client.post("/api/lens", json=text),
                           lambda: client.post("/api/lens", json={**text, "ablate": [[0, 1]]})],
        "POST /api/history": [lambda: client.post("/api/history", json={"model": "runs/gpt-tiny"})],
        "POST /api/qk": [lambda: client.post("/api/qk", json={**text, "layer": 0, "head": 0})],
        "POST /api/patch": [lambda: client.post("/api/patch", json={
            "model": "runs/gpt-tiny", "clean": "ROMEO: But soft", "corrupt": "ROMEO: But sift",
            "answer": "e", "wrong": "o"})],
        "POST /api/image-attention": [
            lambda m=m: client.post("/api/image-attention", data={"model": m},
                                    files={"image": ("i.png", image, "image/png")})
            for m in ("runs/vit-tiny", "runs/captioner-tiny")],
        "POST /api/quiz/question": [
            lambda k=k: client.post("/api/quiz/question",
                                    json={"model": "runs/gpt-tiny", "kind": k, "seed": 3})
            for k in ("next", "induction", "knockout", "lens")],
        "POST /api/quiz/answer": answers,
    }


def test_no_request_to_the_schema_gets_a_5xx(fuzz_app, no_local_constants, capsys) -> None:
    from fastapi.testclient import TestClient

    cases = _all_cases(fuzz_app)
    statuses = {op: Counter() for op in cases}
    bad: list[str] = []
    for op, op_cases in cases.items():
        for case in op_cases:
            r = case.call(timeout=120)  # a first SmolLM2 request loads it: statuses are the point here
            statuses[op][r.status_code] += 1
            if r.status_code >= 500:
                bad.append(f"{op} {r.status_code}: {r.text[:300]} <- {case.body!r:.300}")
            elif r.status_code == 200 and case.path == "/api/generate":
                events = [json.loads(line) for line in r.text.splitlines()]
                if events[-1]["event"] != "done":
                    bad.append(f"{op} stream ended in {events[-1]} <- {case.body!r:.300}")
            elif r.status_code >= 400:
                body = r.json()
                assert set(body) == {"detail"} and "\n" not in body["detail"], r.text

    total = sum(sum(c.values()) for c in statuses.values())
    digest = hashlib.sha256("\n".join(_described(c) for cs in cases.values() for c in cs).encode())
    with capsys.disabled():  # the digest names the requests: the same in any run of the suite
        print(f"\nschema fuzz: {total} requests (digest {digest.hexdigest()[:12]}), {len(bad)} 5xx or "
              "failed streams; " + "; ".join(
            f"{op}: {dict(sorted(c.items()))}" for op, c in statuses.items()))
        for line in bad:
            print("  ", line)
    assert bad == []

    # every operation answers the requests built to succeed (and every operation has some)
    with TestClient(fuzz_app) as client:
        valid = _valid_requests(client)
        assert set(valid) == set(cases)
        for op, requests in valid.items():
            for send in requests:
                r = send()
                assert r.status_code == 200, (op, r.text[:300])
