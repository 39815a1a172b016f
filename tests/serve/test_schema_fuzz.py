"""A property-based fuzz of the whole OpenAPI schema of `qkv serve` (schemathesis, in process
through ASGI: no network): valid and invalid requests for every operation, with the model, the
text, the layer and head and the image swapped some of the time for real ones (the tiny runs,
MiniLM if installed), so that the models do real work. No response may be a 5xx, and no stream
of /api/generate may end in an error event (a 5xx that came after the status line)."""

from __future__ import annotations

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


def _fuzz(op, mode, statuses: Counter, bad: list[str]) -> None:
    """Run ``EXAMPLES`` generated requests of one operation, counting the statuses."""
    label = f"{op.method.upper()} {op.path}"

    @given(case=op.as_strategy(generation_mode=mode), real=_real_parts(op.path))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    def fuzz(case, real) -> None:
        if isinstance(case.body, dict):
            text_field = {"/api/attention": "text", "/api/generate": "prompt", "/api/lens": "text",
                          "/api/qk": "text", "/api/patch": "clean"}.get(op.path)
            for name, value in real.items():
                if name == "text":
                    name = text_field
                if value is not KEEP and name is not None and (name in case.body or name in (
                        "model", text_field)):
                    case.body[name] = value
        r = case.call(timeout=120)  # a first SmolLM2 request loads it: statuses are the point here
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            bad.append(f"{label} {r.status_code}: {r.text[:300]} <- {case.body!r:.300}")
        elif r.status_code == 200 and op.path == "/api/generate":
            events = [json.loads(line) for line in r.text.splitlines()]
            if events[-1]["event"] != "done":
                bad.append(f"{label} stream ended in {events[-1]} <- {case.body!r:.300}")
        elif r.status_code >= 400:
            body = r.json()
            assert set(body) == {"detail"} and "\n" not in body["detail"], r.text

    fuzz()


def test_no_request_to_the_schema_gets_a_5xx(fuzz_app, capsys) -> None:
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    statuses: dict[str, Counter] = {}
    bad: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        counts = statuses.setdefault(f"{op.method.upper()} {op.path}", Counter())
        has_input = (op.body is not None and len(op.body) > 0) or any(True for _ in op.iter_parameters())
        for mode in [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input else []):
            _fuzz(op, mode, counts, bad)

    total = sum(sum(c.values()) for c in statuses.values())
    with capsys.disabled():
        print(f"\nschema fuzz: {total} requests, {len(bad)} 5xx or failed streams; " + "; ".join(
            f"{op}: {dict(sorted(c.items()))}" for op, c in statuses.items()))
        for line in bad:
            print("  ", line)
    assert bad == []
    # the substitutions reached the models: every operation answered some requests with 200
    for op, counts in statuses.items():
        assert counts[200] > 0, (op, counts)
