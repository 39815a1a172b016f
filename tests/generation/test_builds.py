"""The saved step's life in one place (qkv.generation.builds): its status as a typed value (ready,
missing, building, unavailable, with the reason as data and, for a key that changed, which fields
differ), building it in the foreground, the one rule that decides whether a request decodes
through it, saying once why decoding is eager; the sources that key a step, derived from the
imports and checked against a trace of what a decoding step runs; and no process signalling
anywhere in qkv. References: the eager model's tokens, a trace of the executed files, grep."""

from __future__ import annotations

import fcntl
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import single_thread

from qkv.generation import aot, builds, generate
from qkv.generation.builds import State, Why
from qkv.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread", "compile_once")  # see tests/conftest.py

# test_aot.py's shape: its step is compiled once per run for both files (conftest's compile_once)
CFG = dict(vocab_size=48, max_seq_len=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64,
           positions="rope", norm="rmsnorm", bias=False, mlp="swiglu")


def model(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG, **kw})).eval()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache folder for this module's steps (one build of one model: test_aot.py's
    program, compiled once per run, copied here where that file compiled it first)."""
    return tmp_path_factory.mktemp("builds-cache")


def test_status_ensure_and_the_key_that_changed(cache, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(cache))
    m = model()
    st = builds.status(m)
    assert (st.state, st.why, st.step, st.rows, st.cache_len) == (State.MISSING, Why.NOT_BUILT, None, 1, 40)
    assert st.message() == "no saved step: none built for this model on this machine"
    stages = []
    built = builds.ensure(m, on_stage=stages.append)
    assert built.ready and built.step is not None and built.seconds > 0 and built.why is None
    assert stages == ["exporting", "compiling", "loading"]
    again = builds.status(m)
    assert again.ready and again.step is built.step and again.seconds == 0.0  # found, not built
    assert builds.ensure(m).seconds == 0.0  # nothing built twice
    x = torch.tensor([[1, 2, 3]])
    want = [int(t[0]) for t in generate(m, x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m, x, 12, temperature=0.0)] == want
    assert built.step.requests == 1
    with single_thread():
        torch.set_num_threads(2)  # the same model in a process with another thread count
        other = builds.status(m)
    assert (other.state, other.why, other.differs) == (State.MISSING, Why.OTHER_KEY, ("threads",))
    assert other.message() == "no saved step: built for another threads, not for this process"
    # the model changed (cast): another key, so another status, never the old step
    m.to(torch.float64)
    assert builds.status(m).why is Why.NOT_BUILT


def test_building_unavailable_and_off(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "c"))
    m = model(seed=1)
    key, _ = aot.step_key(m, 40)
    with open(aot.folder() / f"{key}.lock", "a") as held:  # another process building this key
        fcntl.flock(held, fcntl.LOCK_EX)
        st = builds.status(m)
        assert (st.state, st.why) == (State.BUILDING, Why.BUILDING)
        assert builds.decide(m, "auto").kind == "eager"
    builds.forget(m)
    assert builds.status(m).why is Why.NOT_BUILT  # the lock let go
    builds.forget(m)
    monkeypatch.setattr(builds, "compiler", lambda: None)
    st = builds.ensure(m)  # nothing to build with: a status, not an exception
    assert (st.state, st.why) == (State.UNAVAILABLE, Why.NO_COMPILER)
    monkeypatch.undo()
    monkeypatch.setenv("QKV_SAVED_STEP", "off")
    assert builds.status(m).why is Why.OFF and builds.ensure(m).why is Why.OFF
    monkeypatch.delenv("QKV_SAVED_STEP")
    assert builds.status(model(max_seq_len=6)).why is Why.SHORT_CONTEXT


def test_the_one_rule_that_decides_the_decoder(cache, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(cache))
    m = model()  # built by the first test (the same shape and weights' format: the same key)
    builds.ensure(m)
    assert builds.decide(m, "auto").kind == "saved"
    for mode in ("eager", "jit"):
        d = builds.decide(m, mode)
        assert (d.kind, d.why, d.step) == (mode, Why.NOT_ASKED, None)
    d = builds.decide(m, "auto", need=41)  # longer than the step's 40 positions
    assert (d.kind, d.why) == ("eager", Why.TOO_LONG)
    chosen = builds.decoder_for(m, "auto", need=10)
    assert chosen.kind == "saved" and chosen.decoder is chosen.step
    assert chosen.says().startswith("saved step (loaded in ")
    two = builds.decoder_for(m, "auto", batch=2, need=10)  # the one-row step cannot take two rows
    assert (two.kind, two.why, two.decoder.kind) == ("eager", Why.ROWS, "eager")
    with pytest.raises(ValueError, match=r"the torch\.compile step returns no attention weights"):
        builds.decoder_for(m, "jit", need=10, weights=True)
    with pytest.raises(ValueError, match="mode must be one of 'auto', 'build', 'jit', 'eager', got True"):
        builds.decide(m, True)  # the old four-state option is refused, not guessed


def test_eager_decoding_is_said_once_per_reason_with_the_fix(tmp_path, monkeypatch):
    from helpers import byte_lm

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "c"))
    lm = byte_lm(context=48, dim=32, n_layers=2, seed=5)
    lm.name = "said-once-model"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lm.generate("ROMEO", 4)
        lm.generate("JULIET", 4)
    said = [str(w.message) for w in seen if w.category is builds.EagerDecodingWarning]
    assert said == ["said-once-model decodes eagerly (about half the speed): none built for this model on "
                    "this machine; `qkv prepare said-once-model` (or lm.prepare()) builds one, once per "
                    "machine"]
    d = lm.last_stats.decision
    assert (d.kind, d.why) == ("eager", Why.NOT_BUILT)
    monkeypatch.setenv("QKV_SAVED_STEP", "off")  # the user's own choice: nothing said
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lm.generate("ROMEO", 4)
    assert not [w for w in seen if w.category is builds.EagerDecodingWarning]
    assert lm.last_stats.decision.why is Why.OFF


def _traced_files(fn) -> set[Path]:
    """The qkv source files whose Python ran while ``fn()`` ran (a profile hook on every call)."""
    root = Path(aot.__file__).resolve().parents[1]
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {Path(f).resolve() for f in seen if Path(f).resolve().is_relative_to(root)}


@pytest.mark.parametrize("weights", ["fp32", "q4", "int8"])
def test_every_module_a_decoding_step_runs_keys_the_step(weights):
    """The sources that key a saved step are derived from the imports (aot.step_sources); here a
    decoding step of a quantised Llama-style model and of a GPT-2-style one is traced, and every
    qkv file whose code ran must be among them: a module missing from the key would let a
    changed module run an old compiled step."""
    from qkv.pipelines import CausalLM

    sources = set(aot.step_sources())
    assert any(p.name == "qmatmul.cpp" for p in sources)  # the kernels' C++ too
    for m in (model(seed=3, tie_embeddings=False),
              model(seed=4, positions="learned", norm="layernorm", mlp="gelu", bias=True, n_kv_heads=None)):
        if weights != "fp32" and m.cfg.positions == "rope":
            m = CausalLM("t", m, tokenizer=None, stored_as=("Q4_1",)).quantize(weights).model

        def step(m=m):
            with torch.inference_mode():
                cache = m.make_cache(1, 32)
                aot.keep_queries(m, cache)
                m(torch.tensor([[1, 2, 3]]), cache=cache)
                m(torch.tensor([[4]]), cache=cache, last_only=True)
                G = aot.group_size(m.cfg.n_layers)  # what the package runs: a group of blocks
                weights = [t for b in m.stack.blocks[:G] for t in aot._tensors(b).values()]
                aot._Group(m, 0, G)(m.embed(torch.tensor([[5]]), 4), cache.k[:G], cache.v[:G],
                                    cache.queries[:G], torch.zeros(4), weights)

        ran = _traced_files(step)
        assert ran, "nothing traced"
        missing = sorted(str(p) for p in ran - sources)
        assert not missing, f"the step ran these but they do not key it: {missing}"


def test_a_change_to_the_lens_or_the_server_rebuilds_no_saved_step():
    """The package's own functions (qkv.load, qkv.show) import the whole library lazily; they
    do not key the step, so editing the lens, the pipelines or the server keeps every saved
    step (each rebuild costs minutes on two cores)."""
    root = Path(aot.__file__).resolve().parents[2]
    parts = {p.relative_to(root).parts[1] for p in aot.step_sources() if len(p.relative_to(root).parts) > 2}
    assert not parts & {"lens", "serve", "pipelines", "learn", "commands", "notebook"}, parts
    assert {"models", "layers", "attention", "generation"} <= parts


def test_no_process_signalling_anywhere_in_qkv():
    """qkv never stops or continues a process by signal, and the one place that kills one kills
    only the process group of a process it started itself (qkv/owned.py: a compiler, the child
    that runs a student's function)."""
    root = Path(aot.__file__).resolve().parents[1]
    stop = re.compile(r"SIGSTOP|SIGCONT|setpriority|sched_setscheduler")
    kill = re.compile(r"killpg|os\.kill\(|send_signal\(|start_new_session|SIGKILL")
    found = {"stop": [], "kill": []}
    for p in root.rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if stop.search(line):
                found["stop"].append(f"{p.relative_to(root)}:{i}")
            if kill.search(line) and p.name != "owned.py":
                found["kill"].append(f"{p.relative_to(root)}:{i}")
    assert found == {"stop": [], "kill": []}
