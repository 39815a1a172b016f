"""The saved decoding step (qkv.generation.aot) against the eager model it was exported from:
logits to float rounding and the same greedy tokens, a second process that loads it without
tracing or compiling anything, a changed key that finds nothing, a damaged package refused, a
cache folder that is not private or not writable. Reference: the eager forward pass (which
test_decode.py checks against the no-cache forward). Each build compiles C++ (~15-40 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import alone_then_joined, child_env, single_thread

from qkv.generation import aot, builds, generate
from qkv.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread", "compile_once")  # see tests/conftest.py
if aot.compiler() is None:
    pytest.skip("saved steps need a C++ compiler (apt-get install g++)", allow_module_level=True)

V = 48
LLAMA = dict(positions="rope", norm="rmsnorm", bias=False, mlp="swiglu")  # SmolLM2's kind of block
CFG = dict(vocab_size=V, max_seq_len=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, **LLAMA)


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(GPTConfig(**CFG))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:  # large weights: greedy decoding sees varied contexts
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def built(compile_once):
    m = model()
    with single_thread():  # the thread count the tests run with (it is part of the key)
        path = aot.build(m)
    return m, path


def test_the_saved_step_equals_eager_at_every_position(built):
    m, path = built
    step = aot.load(m)
    assert step is not None and step.path == path and step.cache_len == 40
    # a float output layer runs eagerly (qkv's Linear, every core): no head package was built
    assert not aot.compiled_head(m) and not (aot._heads() / aot.head_key(m)[0]).exists()
    x = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        c_eager, c_saved = m.make_cache(1, 40), step.make_cache(1)
        m(x, cache=c_eager)
        m(x, cache=c_saved)  # the prompt runs eagerly in both
        for i in range(34):  # positions 5..38: the last (39) is outside the exported range
            tok = torch.tensor([[(7 * i + 1) % V]])
            want = m(tok, cache=c_eager, last_only=True).logits
            got = step.step(tok, c_saved)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert c_saved.pos == c_eager.pos == 39
        torch.testing.assert_close(c_saved.k, c_eager.k, rtol=1e-5, atol=1e-5)  # the cache written in place


def test_groups_of_blocks_of_two_kinds_equal_eager_at_every_position(private_cache, monkeypatch):
    """The step is compiled per group of blocks, weights as inputs: six layers in groups of two
    (GROUP_MAX 2), the middle group in int8 (another signature: a package of its own), the outer
    two sharing one package with their own weights; ALiBi's bias (a table of the package). Every
    position's logits and the cache written in place equal the eager forward's. (A cache of its
    own: its head package has CFG's head's shapes, which the first test says no build made.)"""
    from qkv.layers.quant import quantize_linears

    monkeypatch.setattr(aot, "GROUP_MAX", 2)
    monkeypatch.setattr(aot, "compiled_head", lambda model: True)  # a float head, compiled all the same
    torch.manual_seed(6)
    m = GPT(GPTConfig(**{**CFG, "n_layers": 6, "positions": "alibi"})).eval()
    for b in m.stack.blocks[2:4]:
        quantize_linears(b, "int8")
    path = aot.build(m)
    meta = json.loads((path / aot.META).read_text())
    assert meta["group"] == 2 and meta["layout"] == [0, 1, 0] and len(meta["packages"]) == 2
    step = aot.load(m)
    x = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        c_eager, c_saved = m.make_cache(1, 40), step.make_cache(1)
        m(x, cache=c_eager)
        m(x, cache=c_saved)
        for i in range(35):  # positions 4..38
            tok = torch.tensor([[(5 * i + 2) % V]])
            want = m(tok, cache=c_eager, last_only=True).logits
            torch.testing.assert_close(step.step(tok, c_saved), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_saved.k, c_eager.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_saved.v, c_eager.v, rtol=1e-5, atol=1e-5)
    head = aot._heads() / aot.head_key(m)[0] / aot.HEAD_PACKAGE  # the head: one per shape, checked too
    good = head.read_bytes()
    head.write_bytes(good[:-4] + b"XXXX")
    assert aot.load(m) is None
    head.write_bytes(good)
    assert aot.load(m) is not None
    (path / aot.package_name(1)).write_bytes(b"damaged")  # the second package checked too
    assert aot.load(m) is None


def test_generate_uses_it_by_default_with_the_eager_tokens(built):
    m, _ = built
    x = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    want = [int(t[0]) for t in generate(m, x, 20, temperature=0.0, mode="eager")]
    got = [int(t[0]) for t in generate(m, x, 20, temperature=0.0)]  # mode="auto"
    assert got == want
    step = builds.status(m).step
    assert step is not None
    # weights changed in place are seen (the package reads the model's own storage)
    other = model(seed=9)
    m2 = model()
    aot.build(m2)  # the same shape: the same package
    m2.load_state_dict(other.state_dict())
    want = [int(t[0]) for t in generate(other, x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m2, x, 12, temperature=0.0)] == want
    # cast to another dtype: another key, so no saved step (eager, the same tokens as eager)
    m2.to(torch.float64)
    want = [int(t[0]) for t in generate(other.to(torch.float64), x, 12, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m2, x, 12, temperature=0.0)] == want
    st = builds.status(m2)
    assert st.step is None and st.state is builds.State.MISSING and st.why is builds.Why.NOT_BUILT


def test_requests_in_several_threads_share_one_loaded_step(built):
    """One load per model however many threads ask at once, and its one runner taken in turns
    (two threads inside it at once hung): every thread's tokens are the eager ones."""
    from concurrent.futures import ThreadPoolExecutor

    m = model()
    aot.build(m)  # already built: found
    xs = [torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 5, 7, 9)]
    want = [[int(t[0]) for t in generate(m, x, 25, temperature=0.0, mode="eager")] for x in xs]

    def decode(x):  # one torch thread, as the module runs (the thread count is part of the key)
        return [int(t[0]) for t in generate(m, x, 25, temperature=0.0)]

    for _ in range(2):  # first: the threads race to load it; then: they share the loaded one
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(decode, xs)) == want
    step = builds.status(m).step
    assert step is not None and step.requests == 8


LOAD_IN_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from safetensors.torch import load_file
from qkv.generation import aot
from qkv.models.gpt import GPT, GPTConfig
m = GPT(GPTConfig(**json.loads(sys.argv[1]))).eval()
m.load_state_dict(load_file(sys.argv[2]), strict=False)  # tied: lm_head is tok_emb
t1 = time.perf_counter()
step = aot.load(m)
t2 = time.perf_counter()
with torch.inference_mode():
    c = step.make_cache(1)
    m(torch.tensor([[1, 2, 3]]), cache=c)
    out = step.step(torch.tensor([[4]]), c)
print(json.dumps({"load_s": t2 - t1, "logits": out[0, -1].tolist(),
                  "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}))
"""


def test_a_row_alone_in_a_running_batch_steps_through_the_saved_step(built):
    """qkv serve's batch: a request alone decodes through the saved step (its keys copied into
    the step's cache), goes back to the batched eager step when another joins (copied back), and
    to the saved step when it is alone again; every row's tokens are the eager ones alone. A batch
    told not to stays eager; a row that asks for one layer's attention (as qkv serve's do) takes
    the saved step too, with that layer's rows equal to the eager reference backend's."""
    from qkv.generation.aot import SavedStep
    from qkv.generation.batch import Batch, Request

    m = model()
    run = alone_then_joined(m, V)
    assert run.solo_after_alone == 5 and run.solo_kind is SavedStep  # the first row, alone: the saved step
    assert run.solo_after_joined == 5  # two rows: the batched eager step
    assert run.batch.solo_steps > 5  # alone again: the saved step again
    assert run.rows == run.want
    prompts, want = run.prompts, run.want

    b = Batch(m, 2, 40, mode="eager")
    row, _ = b.join(Request(prompts[0], 8))
    while not row.done:
        b.step()
    assert b.solo_steps == 0 and row.new == want[0][:8]

    # attention asked for: the saved step, and the eager reference backend's rows for that layer
    eager = list(generate(m, torch.tensor([prompts[0]]), 30, temperature=0.0, mode="eager",
                          return_weights=True))
    ref = [[lw[0] for lw in w] for _, w in eager]  # per token: [layer] -> (H, S)
    for layers in ((1,), None):
        b = Batch(m, 2, 40)
        row, first = b.join(Request(prompts[0], 30, weights=True, layers=layers))
        toks = [first]
        while not row.done:
            toks += [t for _, t in b.step()]
        assert b.solo_steps == 29 and row.new == [int(t[0]) for t, _ in eager]
        for tok, w in zip(toks, ref, strict=True):
            for i in (1,) if layers else (0, 1):
                torch.testing.assert_close(tok.weights[i], w[i], rtol=1e-5, atol=1e-6)
        if layers:
            with pytest.raises(ValueError, match="layer 0's attention was not computed"):
                toks[5].weights[0]


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_a_running_batch_of_several_rows_steps_through_its_saved_step(positions, tmp_path, monkeypatch):
    """The step exported for a running batch of up to 4 rows (n rows a dynamic dimension, each
    at its own position): rows of different lengths joining and leaving, greedy and seeded
    sampling, a row that stops early, rows asking for one layer's attention or every layer's;
    every row's tokens are its request's decoded alone eagerly (generate, mode="eager"), its
    attention rows the eager reference backend's; the steps of several rows went through the
    package (its own count, not the batch's), and a batch past the exported span took the eager
    step. Llama-like (RoPE, GQA) and GPT-2-like (learned positions, the default of gpt runs)."""
    from qkv.generation.batch import Batch, Request

    # the session's cache folder: the 4-row step of CFG's shape (weights are inputs, not part of
    # the key) is built once, here or in test_generate_batch_builds_and_takes_the_batch_step
    m = model(seed=4)
    if positions == "learned":
        torch.manual_seed(4)
        m = GPT(GPTConfig(**{**CFG, "positions": "learned", "norm": "layernorm", "mlp": "gelu",
                             "bias": True, "n_kv_heads": None})).eval()
    aot.build(m, cache_len=40, batch=4)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(20 + n)).tolist()
               for n in (5, 3, 8, 2, 6)]
    reqs = [Request(prompts[0], 34, weights=True, layers=(1,)),
            Request(prompts[1], 12, temperature=1.0, seed=7),
            Request(prompts[2], 32, weights=True),  # to position 38: past the exported span (eager)
            Request(prompts[3], 14, temperature=0.8, top_k=5, seed=3),
            Request(prompts[4], 10, stop_ids=())]
    want = []
    for r in reqs:
        got = list(generate(m, torch.tensor([list(r.ids)]), r.max_new_tokens, temperature=r.temperature,
                            top_k=r.top_k, seed=r.seed, mode="eager", return_weights=True))
        want.append(([int(t[0]) for t, _ in got], [[w[0] for w in ws] for _, ws in got]))
    b = Batch(m, 4, 40)
    rows = {}
    toks: dict[int, list] = {i: [] for i in range(len(reqs))}
    waiting = list(range(len(reqs)))
    while waiting or len(b):
        while waiting and len(b) < 3 + (len(waiting) == 1):  # three at first, the fifth into a freed row
            i = waiting.pop(0)
            row, tok = b.join(reqs[i])
            rows[row] = i
            toks[i].append(tok)
        for row, tok in b.step():
            if tok is not None:
                toks[rows[row]].append(tok)
    step = builds.status(m, rows=4, cache_len=40).step
    assert step is not None and step.runs > 10 and b.rows_steps > step.runs  # the last span: eager
    for i, r in enumerate(reqs):
        ids, weights = want[i]
        assert [t.id for t in toks[i]] == ids, i
        if r.weights:
            for t, w in zip(toks[i], weights, strict=True):
                for layer in r.layers or range(len(w)):
                    torch.testing.assert_close(t.weights[layer], w[layer], rtol=1e-5, atol=1e-6)


def test_generate_batch_builds_and_takes_the_batch_step(tmp_path, monkeypatch):
    """generate_batch(mode="build"), what CausalLM.generate over a list runs: builds the lone
    row's step and the running batch's (4 rows, the cache length batch_cache_len rounds to),
    decodes through them, and gives every request's tokens decoded alone eagerly; a second call
    with mode="auto" finds both; mode="eager" takes neither."""
    from qkv.generation.batch import Request, batch_cache_len, generate_batch

    # the session's cache folder: its steps (CFG's shape: the lone row's, which `built` makes, and
    # the 4-row batch's) are built here only if no test of this module built them before
    m = model(seed=6)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(40 + n)).tolist()
               for n in (4, 7, 3)]
    reqs = [Request(p, 14) for p in prompts]
    want = [[int(t[0]) for t in generate(m, torch.tensor([p]), 14, temperature=0.0, mode="eager")]
            for p in prompts]
    assert batch_cache_len(m, 21) == 40  # the context (40) is below 256
    for mode in ("build", "auto", "eager"):
        got: list[list[int]] = [[] for _ in reqs]
        for i, tok in generate_batch(m, reqs, rows=4, mode=mode):
            got[i].append(tok.id)
        assert got == want, mode
        step = builds.status(m, rows=4, cache_len=40).step
        assert step is not None
        runs = step.runs
        if mode != "eager":
            assert runs > 5
        step.runs = 0
    assert runs == 0  # eager: the package was not run


def test_a_batch_of_two_rows_exports_with_a_fixed_row_count():
    """torch.export refuses a dynamic dimension with min == max: a 2-row batch's step fixes the
    row count (it once failed to build for `qkv serve --batch-rows 2`)."""
    ep = aot._export(model(), 40, 2)
    x = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x"]
    assert x and tuple(x[0].meta["val"].shape) == (2, 1, CFG["dim"])


def test_generate_with_attention_weights_takes_the_saved_step(built):
    """generate(return_weights=True) through the saved step: the same tokens and, per layer,
    the eager reference backend's weights; and the step was taken (its request count)."""
    m, _ = built
    x = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(8))
    want = list(generate(m, x, 30, temperature=0.0, mode="eager", return_weights=True))
    step = builds.status(m).step
    assert step is not None
    before = step.requests
    got = list(generate(m, x, 30, temperature=0.0, return_weights=True))
    assert step.requests == before + 1
    assert [int(t) for t, _ in got] == [int(t) for t, _ in want]
    for (_, gw), (_, ww) in zip(got, want, strict=True):
        for g, w in zip(gw, ww, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_second_process_loads_it_without_compiling(built, tmp_path):
    from safetensors.torch import save_file

    m, _ = built
    save_file({k: v.clone() for k, v in m.state_dict().items()}, tmp_path / "m.safetensors")
    argv = [sys.executable, "-c", LOAD_IN_CHILD, json.dumps(CFG), str(tmp_path / "m.safetensors")]
    r = subprocess.run(argv, capture_output=True, text=True, env={**child_env(), "OMP_NUM_THREADS": "1"},
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert not got["dynamo"] and not got["inductor"]  # nothing traced, nothing compiled
    assert got["load_s"] < 1.0
    with torch.inference_mode():
        c = m.make_cache(1, 40)
        m(torch.tensor([[1, 2, 3]]), cache=c)
        want = m(torch.tensor([[4]]), cache=c, last_only=True).logits[0, -1]
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=1e-5, atol=1e-5)


def test_another_key_finds_nothing_and_a_damaged_package_is_refused(built, monkeypatch):
    m, path = built
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # built for another thread count
        assert aot.load(m) is None
    finally:
        torch.set_num_threads(threads)
    other_shape = GPT(GPTConfig(**{**CFG, "max_seq_len": 48})).eval()
    assert aot.load(other_shape) is None
    assert aot.step_key(m, 40)[0] != aot.step_key(m, 40, batch=2)[0]
    monkeypatch.setattr(aot, "cpu_identity", lambda: {"vendor_id": "SomeoneElse"})  # another CPU
    assert aot.load(m) is None
    monkeypatch.undo()
    data = (path / aot.PACKAGE).read_bytes()
    try:
        (path / aot.PACKAGE).write_bytes(data[: len(data) // 2])  # truncated
        assert aot.load(m) is None
        (path / aot.PACKAGE).write_bytes(data[:-4] + b"XXXX")  # the same length, other bytes
        assert aot.load(m) is None
    finally:
        (path / aot.PACKAGE).write_bytes(data)
    assert aot.load(m) is not None


def test_a_cache_folder_that_is_not_private_or_not_writable_decodes_eagerly(tmp_path, monkeypatch):
    m = model(seed=2)
    shared = tmp_path / "shared"
    (shared / "steps").mkdir(parents=True)
    os.chmod(shared / "steps", 0o755)
    monkeypatch.setenv("QKV_CACHE_DIR", str(shared))
    with pytest.raises(aot.SavedStepError, match="not private"):
        aot.folder()
    st = builds.ensure(m)
    assert st.step is None and st.why is builds.Why.FOLDER and "not private" in st.message()
    x = torch.tensor([[1, 2, 3]])
    want = [int(t[0]) for t in generate(m, x, 6, temperature=0.0, mode="eager")]
    assert [int(t[0]) for t in generate(m, x, 6, temperature=0.0, mode="build")] == want
    if os.getuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        monkeypatch.setenv("QKV_CACHE_DIR", str(ro))
        with pytest.raises(aot.SavedStepError, match="cannot use"):
            aot.folder()
    # a full disk: the compile's write fails; eager, one line, nothing half-written left behind
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "full"))
    import torch._inductor as inductor

    monkeypatch.setattr(inductor, "aoti_compile_and_package", full)
    builds.forget(m)
    st = builds.ensure(m)
    assert st.step is None and st.state is builds.State.UNAVAILABLE and st.why is builds.Why.FAILED
    assert "No space left on device" in st.message() and "\n" not in st.message()
    assert [int(t[0]) for t in generate(m, x, 6, temperature=0.0, mode="build")] == want
    assert [p.name for p in (tmp_path / "full" / "steps").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setenv("QKV_SAVED_STEP", "off")
    assert aot.load(m) is None and not aot.enabled()


# int8 and bf16 (~17 s each) in `pytest -m slow`: benchmarks/saved_step.py --weights int8|bf16 builds
# and checks them on SmolLM2 itself.
@pytest.mark.parametrize("weights", ["q4", "q4 untied", "q4 on PyTorch's kernel",
                                     pytest.param("int8", marks=pytest.mark.slow),
                                     pytest.param("bf16", marks=pytest.mark.slow)])
def test_quantised_saved_steps_agree_with_eager(weights, monkeypatch):
    """SmolLM2's decoding formats on a tiny Llama-style model (q4 on qkv's 4-bit kernel, a
    custom op the package calls; on PyTorch's, the int4 products' group sizes are constants
    Inductor adds, recorded beside the package); logits agree to bf16 rounding and the greedy
    token is the same. "untied": an output layer of its own (TinyLlama's; its float matrix, kept
    for the exact top logits, must be found by the package by name, or the step cannot load)."""
    import qkv.layers.quant as quant
    from qkv.pipelines import CausalLM

    if weights == "q4 on PyTorch's kernel":
        monkeypatch.setattr(quant, "_qkv_int4_op", lambda: None)
    torch.manual_seed(11)
    m = GPT(GPTConfig(vocab_size=64, max_seq_len=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      mlp="swiglu", mlp_hidden=128, tie_embeddings="untied" not in weights,
                      **{k: v for k, v in LLAMA.items() if k != "mlp"})).eval()
    lm = CausalLM("tiny", m, tokenizer=None, stored_as=("Q4_1",)).quantize(weights.split()[0])
    kernels = {mod.kernel for mod in lm.model.modules() if isinstance(mod, quant.Int4Linear)}
    ours = "qkv" if quant._qkv_int4_op() is not None else "aten"  # qkv's where it builds
    assert kernels == ({"aten"} if "PyTorch" in weights else {ours} if weights.startswith("q4") else set())
    path = aot.build(lm.model)
    made = json.loads((path / aot.META).read_text())["packages"][0]["made"]
    assert bool(made) == (kernels == {"aten"})  # the group sizes of PyTorch's int4 products
    step = aot.load(lm.model)
    x = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        c_eager, c_saved = m.make_cache(1, 32), step.make_cache(1)
        m(x, cache=c_eager)
        m(x, cache=c_saved)
        for t in range(12):
            tok = torch.tensor([[(5 * t + 3) % 64]])
            want = m(tok, cache=c_eager, last_only=True).logits.float()
            got = step.step(tok, c_saved).float()
            assert (got - want).abs().max() <= 0.02 * want.abs().max()
            assert int(got.argmax()) == int(want.argmax())


def test_the_folder_holds_one_package_per_key(built):
    _, path = built
    assert Path(path).parent == aot.folder()
    assert oct(aot.folder().stat().st_mode & 0o777) == oct(0o700)
    meta = json.loads((path / aot.META).read_text())
    assert meta["key"] == path.name and meta["info"]["threads"] == torch.get_num_threads()


def test_qkv_generate_builds_then_loads_and_says_why_when_it_cannot(tiny_run, tmp_path, monkeypatch):
    """`qkv generate RUN --compile` builds the saved step and uses it; a later plain call loads
    it; without a compiler, or with a cache folder it cannot write, it decodes eagerly, the same
    text, and says why in the closing line (never a traceback)."""
    from helpers import call

    run = str(tiny_run("gpt"))
    argv = ["generate", run, "--prompt", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0"]
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    rc, eager, err = call([*argv, "--compile", "off"])
    assert rc == 0, err
    monkeypatch.setattr(aot, "compiler", lambda: None)
    rc, out, err = call([*argv, "--compile"])
    assert rc == 0 and out == eager and "no C++ compiler" in err and "Traceback" not in err
    monkeypatch.undo()
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    # the default with no step yet: eager, the reason as the closing line says it, the command
    # that builds one, and no process started (a build never runs behind the user's back)
    import qkv.native

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("started"))
    rc, out, err = call(argv)
    assert rc == 0 and out == eager and "eager: none built for this model on this machine" in err, err
    assert f"`qkv prepare {run}` builds one" in err and started == []
    monkeypatch.undo()
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    assert qkv.native.compiler() is not None
    rc, out, err = call(["prepare", run, "--batch-rows", "0"])  # the documented command
    assert rc == 0 and "saved step for one request: built in" in err, err
    rc, out, err = call(argv)  # the default: loaded, not built
    assert rc == 0 and out == eager and "saved step (loaded in" in err, err
    rc, out, err = call(["generate", "--compile", *argv[1:]])  # the flag before the model: still "on"
    assert rc == 0 and out == eager and "saved step (loaded in" in err, err
    rc, out, err = call(["prepare", run, "--batch-rows", "0"])
    assert rc == 0 and "saved step for one request: already built" in err, err
    with single_thread():  # (--threads changes this process's count: put back after)
        rc, out, err = call([*argv, "--threads", "2"])  # built for 1 thread: another key, said
    assert rc == 0 and out == eager and "eager: built for another threads" in err, err
    assert f"`qkv prepare {run} --threads 2` builds one" in err, err
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("QKV_CACHE_DIR", str(blocked))
    rc, out, err = call([*argv, "--compile"])
    assert rc == 0 and out == eager and "cannot use" in err and "Traceback" not in err


# The compile itself is the package `built` compiled (CFG's shape, one thread: the same key),
# copied after a second, so that the children's builds overlap without a third compile (~25 s on
# a Zen 3); `python -m qkv prepare` compiles in a child process in tests/test_processes.py.
BUILD_IN_CHILD = """
import shutil, sys, time
import torch
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from test_aot import model
from qkv.generation import aot

compiled = []

def compile_(ep, pkg):
    compiled.append(pkg)
    time.sleep(1.0)
    shutil.copyfile(sys.argv[4], pkg)

aot._compile = compile_
torch.set_num_threads(1)
print(aot.build(model(seed=int(sys.argv[1]))).name, len(compiled))
"""


def test_two_processes_building_at_once_leave_one_good_package(built, tmp_path):
    """Two processes build the same key at once: one builds (holding the key's lock), the other
    waits and finds its package; one folder, no half-built one, and it loads here."""
    _, path = built
    env = {**child_env(), "QKV_CACHE_DIR": str(tmp_path / "cache")}
    here, tests = str(Path(__file__).parent), str(Path(__file__).parent.parent)
    argv = [sys.executable, "-c", BUILD_IN_CHILD, "5", here, tests, str(path / aot.PACKAGE)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    last = [o.strip().splitlines()[-1].split() for o, _ in outs]
    names = {name for name, _ in last}
    assert len(names) == 1 and sorted(int(n) for _, n in last) == [0, 1]  # one compiled, one found it
    steps = tmp_path / "cache" / "steps"
    assert sorted(p.name for p in steps.iterdir() if p.is_dir()) == sorted(names)  # no half-built folder
    with single_thread(tmp_path / "cache"):
        assert aot.load(model(seed=5)) is not None


@pytest.mark.slow
def test_smollm2_saved_step_predicts_what_eager_predicts():
    """SmolLM2 q4 (the default weights) over 300 positions of a text fed token by token: the
    saved step's top-1 next token equals eager's at >= 99% of them (int4 kernels fuse the bf16
    casts differently, so near-ties may flip)."""
    import qkv

    lm = qkv.load("smollm2")
    aot.build(lm.model)
    step = aot.load(lm.model)
    assert step is not None
    text = 10 * ("The history of the city begins with a small settlement on an island in the river. Over "
                 "the centuries it grew into a centre of trade and learning, with markets and bridges. ")
    ids = lm.tokenizer.encode(text)[:302]
    agree = 0
    with torch.inference_mode():
        c_e, c_s = lm.model.make_cache(1, step.cache_len), step.make_cache(1)
        lm.model(torch.tensor([ids[:2]]), cache=c_e)
        lm.model(torch.tensor([ids[:2]]), cache=c_s)
        for t in ids[2:]:
            tok = torch.tensor([[t]])
            a = lm.model(tok, cache=c_e, last_only=True).logits[0, -1]
            b = step.step(tok, c_s)[0, -1]
            agree += int(a.argmax() == b.argmax())
    assert agree >= 0.99 * 300


def test_a_build_keeps_inductors_cache_in_qkvs_private_folder(tmp_path, monkeypatch):
    """AOTInductor compiles with its cache in <cache>/inductor (private, reused by the next build),
    not /tmp/torchinductor_<user>; the variable is back as it was afterwards."""
    import os
    import stat

    import torch._inductor as inductor
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "the user's"))
    seen = []
    monkeypatch.setattr(inductor, "aoti_compile_and_package", lambda ep, **kw: seen.append(cache_dir()))
    aot._compile(None, tmp_path / "package")
    assert seen == [str(tmp_path / "cache" / "inductor")]
    assert stat.S_IMODE((tmp_path / "cache" / "inductor").stat().st_mode) == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "the user's")
