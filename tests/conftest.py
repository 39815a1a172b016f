"""Fixtures shared across the test folders: a seeded RNG, an independent float64 attention
reference, the session's tiny runs of each family and its MiniLM. (Plain helpers live in
tests/helpers.py.)

The reference below is written from the formula (softmax(QKᵀ·scale + bias)·V, Vaswani et al.
2017 eq. 1) without calling anything in qkv, so that qkv's three backends are checked against
math that shares none of their code.
"""

import math
import os
from pathlib import Path

# Before torch loads its OpenMP runtime (read once, at load; children inherit it): a thread that
# waits at a parallel region's end sleeps instead of spinning. The suite runs one worker per core,
# so a two-thread test (tests/pretrained) shares its cores with the other worker; spinning there,
# each waited for a thread the other worker had descheduled. SmolLM2's parity file beside a core
# kept busy: 97 s spinning, 61 s sleeping (62 s alone).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from helpers import TINY_TEXT, call_one_thread, flags, single_thread, tiny_data, tiny_train


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker's torch takes its share of the cores, so that N
    workers do not each start a thread per core (OpenMP threads that wait on each other).

    Tiny test models decode eagerly (no saved step in the tests' private cache): their
    EagerDecodingWarning is ignored; the tests about it catch it with ``pytest.warns``. (The
    filter is added here, not in pyproject.toml, where naming the class would import torch before
    OMP_WAIT_POLICY above is set.)"""
    config.addinivalue_line("filterwarnings", "ignore::qkv.generation.builds.EagerDecodingWarning")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The files that took longest (seconds on 2 workers of a Zen 3, `pytest --durations=0`, summed per
# file; 2026-12-07), handed out first: pytest-xdist gives each worker a whole file at a time
# (--dist loadfile), so a long file left for last would keep one worker busy while the other
# waits. Only the speed depends on it.
LONGEST_FILES = ("generation/test_aot.py", "pretrained/test_smollm2.py", "learn/test_runner.py",
                 "learn/test_judge.py", "pretrained/test_fixture.py", "test_processes.py",
                 "training/test_faults.py", "pretrained/test_quantized.py", "generation/test_native_step.py",
                 "explain/test_lectures.py", "test_bad_inputs.py", "learn/test_notebook.py",
                 "serve/test_schema_fuzz.py", "generation/test_builds.py", "learn/test_course.py",
                 "generation/test_compiled.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-random-order, which then shuffles what this sorted
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, LONGEST_FILES first (a run in one process, or with QKV_KEEP_ORDER=1,
    keeps the order it was given)."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1 or os.environ.get("QKV_KEEP_ORDER") == "1":
        return
    here = Path(__file__).parent
    rank = {str(here / f): i for i, f in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """``QKV_FAIL_ON_SKIP=1`` (set by .ci/run, which installs every asset, package and the
    browser): a skipped test fails, naming its reason, since CI could have provided what it
    missed. Deselected (slow) tests are not skips."""
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("QKV_FAIL_ON_SKIP") == "1" and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[-1] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped in CI, which installs everything a test needs: {reason}"


def _reference_attention(q, k, v, mask=None, is_causal=False, scale=None, bias=None):
    """Float64 attention: q (B, H, T, D), k/v (B, K, S, D/Dv) -> (out, weights).

    A query with no allowed key gets all-zero weights (and so a zero output).
    """
    q, k, v = q.double(), k.double(), v.double()
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    heads = [h // (H // K) for h in range(H)]  # query head h reads key/value head h // G
    k, v = k[:, heads], v[:, heads]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * scale
    if bias is not None:
        scores = scores + bias.double()
    allowed = torch.ones(B, H, T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:  # query i sits at absolute position S - T + i
        i = torch.arange(T).unsqueeze(1) + (S - T)
        allowed = allowed & (torch.arange(S).unsqueeze(0) <= i)
    scores = scores.masked_fill(~allowed, -math.inf)
    top = scores.detach().amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top)
    total = e.sum(dim=-1, keepdim=True)
    weights = e / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("bhts,bhsd->bhtd", weights, v), weights


def _attention_inputs(B, H, K, T, S, D, Dv=None, *, mask=None, bias=False,
                      dtype=torch.float64, seed=0):
    """Random (q, k, v, mask, bias) for one case; ``mask`` is None, "random", "padding" or "both".

    "random" masks drop ~30% of the pairs (so short rows may be empty); "padding" masks keep
    the first lengths[b] keys, lengths drawn from 0..S (0 = a sequence with nothing to see).
    """
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, S, Dv, generator=g, dtype=torch.float64)
    allowed = None
    if mask in ("random", "both"):
        shape = [(T, S), (B, 1, T, S), (B, H, T, S)][seed % 3]
        allowed = torch.rand(shape, generator=g) > 0.3
    if mask in ("padding", "both"):
        lengths = torch.randint(0, S + 1, (B,), generator=g)
        pad = (torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    b = torch.randn(1, H, T, S, generator=g, dtype=torch.float64) if bias else None
    cast = [t.to(dtype) for t in (q, k, v)]
    return (*cast, allowed, None if b is None else b.to(dtype))


@pytest.fixture(scope="session")
def attention_inputs():
    """Factory of random attention inputs (see ``_attention_inputs``)."""
    return _attention_inputs


@pytest.fixture(scope="session")
def reference_attention():
    """The independent float64 attention function (session scope: usable with hypothesis)."""
    return _reference_attention


@pytest.fixture
def rng():
    """A torch.Generator with a fixed seed, so each test draws the same numbers every run."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """qkv's cache folder (QKV_CACHE_DIR) in this test's temporary folder."""
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread avoids contention on shared CPUs (and is faster).

    Test files with small training loops opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    with single_thread():
        yield


@pytest.fixture(scope="module")
def compile_once(tmp_path_factory):
    """AOTInductor compiles each exported program once per test run (:func:`helpers.compiled_once`):
    a test that builds a saved step whose program another test compiled gets a copy of that
    package; qkv's own code around the compile runs as ever. The test files that build steps use it
    for the whole module (``pytestmark``, and their module fixtures that build); a test that
    replaces the compile itself (a full disk, the cache's folder) patches over it."""
    import torch._inductor
    from helpers import compiled_once, run_folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._inductor, "aoti_compile_and_package",
                   compiled_once(run_folder(tmp_path_factory, "compiled")))
        yield


# --------------------------------------------------------------------------- tiny runs


class TinyRuns:
    """``tiny_run(family) -> Path``: ``ROOT/runs/FAMILY-tiny``, a run of ``qkv train FAMILY
    --preset tiny`` cut to a few steps with fixed choices (helpers.TINY_TRAIN, TINY_DATA: seconds
    each, one thread), trained once per session on first use. ``ROOT/runs`` holds only such runs
    (a runs directory for ``qkv serve``); ``tiny_run.stdout(family)`` is what the command printed,
    ``tiny_run.root`` the folder of the GPT's text (``ROOT/text.txt``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "text.txt").write_text(TINY_TEXT, encoding="utf-8")
        self._made: dict[str, tuple[Path, str]] = {}

    def __call__(self, family: str) -> Path:
        if family not in self._made:
            if family == "vit":
                pytest.importorskip("sklearn", reason="the tiny ViT trains on scikit-learn's digits")
            run = self.root / "runs" / f"{family}-tiny"
            argv = ["train", family, "--preset", "tiny", "--out_dir", str(run), "--no-progress",
                    *flags(tiny_train(family)), *flags(tiny_data(family, self.root))]
            rc, out, err = call_one_thread(argv, self.root / "cache")
            assert rc == 0, out + err
            self._made[family] = (run, out)
        return self._made[family][0]

    def stdout(self, family: str) -> str:
        """What ``qkv train`` printed while training ``family``'s tiny run."""
        self(family)
        return self._made[family][1]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRuns:
    """The session's tiny runs, one per family, trained on first use (see :class:`TinyRuns`)."""
    return TinyRuns(tmp_path_factory.mktemp("tiny-runs"))


# --------------------------------------------------------------------------- MiniLM


@pytest.fixture(scope="session")
def minilm():
    """qkv's MiniLM SentenceEncoder (fp32), loaded once per session; skips, naming the fix,
    without its asset or packages."""
    from pretrained.asset_skip import require_asset

    require_asset("minilm")
    for module in ("safetensors", "tokenizers"):
        pytest.importorskip(module, reason=f"{module} not installed: pip install 'qkv[pretrained]'")
    import qkv

    return qkv.load("minilm")


@pytest.fixture
def minilm_cli(minilm, monkeypatch):
    """CLI runs (`qkv embed`, `qkv explain retrieval`, ...) read the session's MiniLM instead of
    loading it again (~3 s each)."""
    import qkv.inference.loading

    monkeypatch.setattr(qkv.inference.loading, "_read", lambda ref, device, cache: minilm)
    return minilm


@pytest.fixture(autouse=True, scope="session")
def _qkv_cache(tmp_path_factory):
    """Everything qkv caches under $QKV_CACHE_DIR goes to a temporary folder for the session,
    not ~/.cache: the trainer's dtype/compile probe answers (the user's must not steer the
    tests) and converted checkpoints (the first SmolLM2 load converts and stores it there,
    later loads, e.g. tests/pretrained/test_cache.py, read it back), and the saved decoding
    steps (none is there until a test builds one: tests/generation/test_aot.py). The kernel
    library this process loaded is copied in (helpers.seed_kernels): without it the first child
    process that decodes a 4-bit model compiled it again in each worker (~25 s on a Zen 3)."""
    import os

    from helpers import seed_kernels

    old = os.environ.get("QKV_CACHE_DIR")
    os.environ["QKV_CACHE_DIR"] = str(tmp_path_factory.mktemp("qkv-cache"))
    seed_kernels(Path(os.environ["QKV_CACHE_DIR"]))  # children load the kernels, not compile them
    yield
    if old is None:
        os.environ.pop("QKV_CACHE_DIR", None)
    else:
        os.environ["QKV_CACHE_DIR"] = old
