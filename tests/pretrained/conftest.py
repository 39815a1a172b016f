"""Session fixtures for the pretrained-model tests.

qkv's SmolLM2 is loaded once per session (and MiniLM, by tests/conftest.py's ``minilm``), and
so are the references they are compared with (transformers, sentence-transformers): the
transformers GGUF load alone takes ~20 s on two cores. Greedy continuations are memoised, so the
live-parity tests and the fixture tests share them.

A fixture skips, naming the fix, only when its asset (``qkv assets install ...``) or its
reference package (``pip install 'qkv[reference]'``) is absent; in CI both are installed and
nothing skips.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from asset_skip import require_asset
from pretrained_cases import GREEDY_TOKENS, PROMPT_TOKENS, SMOLLM2_PROMPTS, load_fixture

# Before anything imports transformers (only the fixtures below do): never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

THREADS = 2


@contextlib.contextmanager
def threads(n: int = THREADS):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _two_threads():
    """Every test here runs on two threads (other test files may have set one)."""
    with threads():
        yield


def _reference(module: str):
    return pytest.importorskip(
        module, reason=f"reference package {module} not installed: pip install 'qkv[reference]'"
    )


def _qkv_dependency(module: str):
    return pytest.importorskip(
        module, reason=f"{module} not installed: pip install 'qkv[pretrained]'"
    )


# --------------------------------------------------------------------------- assets


@pytest.fixture(scope="session")
def minilm_folder():
    return require_asset("minilm")  # skips with "asset missing: NAME (qkv assets install NAME)"


@pytest.fixture(scope="session")
def smollm2_file():
    return require_asset("smollm2")


@pytest.fixture(scope="session")
def reference_fixture() -> dict:
    return load_fixture()


# --------------------------------------------------------------------------- qkv's models


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """qkv's CausalLM (fp32). Tests that change its dtype must work on a copy."""
    for m in ("gguf", "tokenizers", "jinja2"):
        _qkv_dependency(m)
    import qkv

    with threads():
        return qkv.load("smollm2", weights="fp32")  # the parity mode


@pytest.fixture(scope="session")
def qkv_greedy(smollm2):
    """``run(prompt) -> (ids, text)``: ``CausalLM.generate`` greedy, GREEDY_TOKENS tokens, in
    its default mode (KV cache; batch 1, so every projection takes the two-core one-row path
    of ``qkv.nn.linear.Linear``), memoised.

    The text is what ``generate`` returns (``stop_at_eos=False``); the ids are read with a
    forward hook as the argmax of each step's last logits, i.e. the tokens a greedy decoder
    must have picked. Tests compare both, so the sampling step is checked too.
    """
    memo: dict = {}

    def run(prompt: str):
        if prompt in memo:
            return memo[prompt]
        ids: list[int] = []

        def hook(module, args, output):
            ids.append(int(output.logits[0, -1].argmax()))

        handle = smollm2.model.register_forward_hook(hook)
        try:
            with threads():
                text = smollm2.generate(prompt, GREEDY_TOKENS, stop_at_eos=False)
        finally:
            handle.remove()
        memo[prompt] = (ids, text)
        return memo[prompt]

    return run


@pytest.fixture(scope="session")
def qkv_greedy_batch(smollm2):
    """``run(use_cache) -> [ids for each of SMOLLM2_PROMPTS]``: greedy decoding of all the
    prompts as one batch with ``qkv.generation.generate`` (batch 3: plain ``F.linear``),
    memoised."""
    from qkv.generation import generate

    memo: dict = {}

    def run(use_cache: bool) -> list[list[int]]:
        if use_cache in memo:
            return memo[use_cache]
        prompts = [smollm2.tokenizer.encode(p) for p in SMOLLM2_PROMPTS]
        assert {len(p) for p in prompts} == {PROMPT_TOKENS}, "batched prompts must have one length"
        with threads():
            steps = list(generate(smollm2.model, torch.tensor(prompts), GREEDY_TOKENS,
                                  temperature=0.0, use_cache=use_cache))
        memo[use_cache] = torch.stack(steps, dim=1).tolist()
        return memo[use_cache]

    return run


# --------------------------------------------------------------------------- references


@pytest.fixture(scope="session")
def hf_minilm(minilm_folder):
    """transformers' BertModel with eager (explicit softmax) attention, so that it can also
    return attention weights."""
    transformers = _reference("transformers")
    with threads():
        return transformers.AutoModel.from_pretrained(
            str(minilm_folder), attn_implementation="eager"
        ).eval()


@pytest.fixture(scope="session")
def hf_minilm_tokenizer(minilm_folder):
    transformers = _reference("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(minilm_folder))


@pytest.fixture(scope="session")
def st_minilm(minilm_folder):
    st = _reference("sentence_transformers")
    with threads():
        return st.SentenceTransformer(str(minilm_folder), device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_file):
    """(model, tokenizer) from transformers, both read from the same GGUF file (~25 s)."""
    transformers = _reference("transformers")
    _reference("gguf")
    _reference("accelerate")
    folder, name = str(smollm2_file.parent), smollm2_file.name
    with threads():
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
    return model, tok


@pytest.fixture(scope="session")
def hf_smollm2_logits(hf_smollm2):
    """``run(ids) -> (T, V)``: the reference's logits over a token sequence, memoised.

    Over prompt + continuation, ``logits[t].argmax()`` is the token the reference's greedy
    decoder picks after position t (causal attention: position t sees only tokens <= t), so one
    pass checks a whole greedy continuation; ``reference_fixture.json`` holds the reference's
    step-by-step greedy decode of the same prompts as well.
    """
    model, _ = hf_smollm2
    memo: dict = {}

    def run(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            with threads(), torch.inference_mode():
                memo[key] = model(torch.tensor([ids])).logits[0]
        return memo[key]

    return run
