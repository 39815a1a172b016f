"""Helpers shared by the test files: tests/ is on sys.path through tests/conftest.py, so any test
file can ``from helpers import call``. A helper a second test file needs moves here, or to its
folder's own module (tests/attention/attention_cases.py, tests/pretrained/gguf_writing.py,
tests/serve/serve_helpers.py), never into a copy; tests/test_helpers_once.py keeps it so.

Sections: the command line in-process; the session's tiny runs (what tests/conftest.py's
``tiny_run`` trains); small values and waits; tiny Hugging Face checkpoints.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from qkv import cli

PNG = b"\x89PNG\r\n\x1a\n"


def dev_package(name: str):
    """``pytest.importorskip(name)`` for a package of qkv's [dev] extra, the skip naming the fix."""
    return pytest.importorskip(name, reason=f"package missing: {name} (pip install -e '.[dev]')")


# --------------------------------------------------------------------------- the command line


def call(argv: list[str]) -> tuple[int, str, str]:
    """cli.main with stdout/stderr captured; argparse's own exits become return codes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def single_thread(cache_dir: Path | None = None):
    """One torch thread for the block and, given ``cache_dir``, ``QKV_CACHE_DIR=cache_dir``
    (both restored after). Tiny matrices: one thread avoids contention on shared CPUs."""
    threads, cache = torch.get_num_threads(), os.environ.get("QKV_CACHE_DIR")
    torch.set_num_threads(1)
    if cache_dir is not None:
        os.environ["QKV_CACHE_DIR"] = str(cache_dir)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if cache_dir is not None:
            if cache is None:
                os.environ.pop("QKV_CACHE_DIR", None)
            else:
                os.environ["QKV_CACHE_DIR"] = cache


def call_one_thread(argv: list[str], cache_dir: Path | None = None) -> tuple[int, str, str]:
    """:func:`call` on one thread, with ``QKV_CACHE_DIR=cache_dir`` if given (both restored
    after): how module fixtures train their runs, and the session's tiny runs, so that they come
    out the same whoever trains them."""
    with single_thread(cache_dir):
        return call(argv)


def call_json(argv: list[str]):
    """:func:`call` of a command printing JSON (``--json``): it must succeed; its parsed output."""
    rc, out, err = call(argv)
    assert rc == 0, err
    return json.loads(out)


def word_ids(text: str) -> torch.Tensor:
    """(1, T) ids of a text of the tests' word-level vocabulary ("w7" <-> id 7)."""
    return torch.tensor([[int(w[1:]) for w in text.split()]])


def assert_one_line_error(rc: int, err: str) -> str:
    """The failure contract: exit code 2, one line on stderr starting 'qkv: error: ', no traceback."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Traceback" not in err
    return lines[0]


def child_env() -> dict[str, str]:
    """The environment for a child process (a torchrun launch): no inherited rank variables,
    one OpenMP thread, gloo on the loopback interface, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the session's tiny runs

TINY_LINES = ["ROMEO: But soft, what light through yonder window breaks?",
              "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
              "ROMEO: It is the east, and Juliet is the sun."]
TINY_TEXT = "\n".join(TINY_LINES * 25) + "\n"  # the GPT's text, ~3,900 characters
# What `qkv train FAMILY --preset tiny` is given for the session's tiny runs (tests/conftest.py's
# tiny_run), and what tests/families/test_every_family.py gives train_run for the same runs from
# Python: a few steps, and fixed choices (no measuring probe), so the two cannot choose differently.
TINY_TRAIN = {"max_iters": 8, "eval_interval": 4, "eval_iters": 1, "dtype": "fp32", "compile": False,
              "optimizer": "adamw", "device": "cpu"}
TINY_STEPS = {"captioner": {"max_iters": 60, "eval_interval": 30}}  # enough to say a few words
TINY_DATA = {"gpt": {"data": "{root}/text.txt"}, "vit": {},
             "seq2seq": {"n_train": 200, "n_val": 20, "n_test": 30, "n_heldout": 20},
             "captioner": {"n_train": 60, "n_val": 10, "n_test": 12, "n_heldout": 10}}


def tiny_train(family: str) -> dict:
    """The training settings of ``family``'s tiny run."""
    return {**TINY_TRAIN, **TINY_STEPS.get(family, {})}


def tiny_data(family: str, root: Path) -> dict:
    """The data settings of ``family``'s tiny run, its files under ``root``."""
    return {k: v.format(root=root) if isinstance(v, str) else v for k, v in TINY_DATA[family].items()}


def flags(settings: dict) -> list[str]:
    """``{"max_iters": 8, "compile": False}`` -> ``["--max_iters", "8", "--compile", "false"]``."""
    return [x for k, v in settings.items()
            for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per row."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (sub-folders too), by relative path: to check that something
    changed nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def forbid_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any timing of steps fails the test: the choice must come from the cache or the record."""
    from qkv.training import probe

    def fail(*args, **kwargs):
        raise AssertionError("the probe measured steps")

    monkeypatch.setattr(probe, "time_options", fail)


# --------------------------------------------------------------------------- small values and waits


def softmax64(logits: list[float], temperature: float = 1.0) -> list[float]:
    """softmax(logits / T) in plain Python floats (shares no code with torch)."""
    top = max(logits)
    e = [math.exp((x - top) / temperature) for x in logits]
    return [x / sum(e) for x in e]


def sampling_intervals(row: torch.Tensor, temperature: float, top_k: int | None = None,
                       top_p: float | None = None) -> tuple[list[int], list[float]]:
    """What sampling draws from a (V,) row of logits, in float64 from the definitions (no code of
    qkv's): ``z = row / T`` (a float32 division, as PyTorch divides); top-k keeps every z at or
    above the k-th largest; top-p goes through the kept tokens by descending z (ties: lower id
    first) and drops each one once those before it hold ``top_p`` of the kept mass, the first
    always staying; each kept id's share is exp(z - max z). Returns the ids with a positive share,
    ascending, and the upper ends of their intervals of [0, 1) (cumulative shares in id order,
    the last 1.0): u in [previous end, end) draws that id."""
    z = (row.float() / temperature).double().tolist()
    V = len(z)
    keep = list(range(V))
    if top_k is not None and 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [i for i in keep if z[i] >= kth]
    top = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - top) for i in keep}
    if top_p is not None and 0 < top_p < 1:
        total, acc, nucleus = sum(w.values()), 0.0, []
        for i in sorted(keep, key=lambda i: (-z[i], i)):
            if acc >= top_p * total:
                break
            nucleus.append(i)
            acc += w[i]
        keep = sorted(nucleus)
    ids = [i for i in keep if w[i] > 0]
    total = sum(w[i] for i in ids)
    ends, acc = [], 0.0
    for i in ids:
        acc += w[i]
        ends.append(acc / total)
    ends[-1] = 1.0
    return ids, ends


def randomise(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Random values in every parameter (a norm's γ and β included), so no term hides as 1 or 0:
    N(0, scale²), or N(1, scale²) for the weights of parameters named ``*norm*`` (γ near 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + torch.randn(p.shape, generator=g) * scale)


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (16, 16), mode: str = "L",
                colour: object = 200) -> bytes:
    """A one-colour image file of ``size`` in ``mode``, as bytes in format ``fmt`` (Pillow's)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format=fmt)
    return buf.getvalue()


def png_bytes(size: tuple[int, int] = (16, 16), mode: str = "L", colour: object = 200) -> bytes:
    """:func:`image_bytes` as a PNG."""
    return image_bytes("PNG", size, mode, colour)


# How long a computation that a test holds (to queue others behind it) waits for its gate: far
# longer than any slow, shared machine takes; the test opens the gate itself. A 10-s wait once
# expired in the full suite and let the queued calls run before the test had counted them.
HELD_S = 600.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Block until ``condition()`` holds (a synchronisation point, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def page_wait(page, expression: str) -> None:
    """Poll ``expression`` in a Playwright page until it is true (within 60 s). (page.wait_for_function
    compiles its predicate with eval, which the page's Content-Security-Policy rightly forbids.)"""
    wait_until(lambda: page.evaluate(expression), expression, timeout=60.0)


# --------------------------------------------------------------------------- tiny Hugging Face checkpoints

HF_VOCAB = 96  # vocabulary of the tiny checkpoints: ids 0..95 are the words "w0".."w95"
HF_PROMPT = torch.tensor([[3, 17, 42, 5, 88, 9, 1, 60]])  # token ids the parity tests decode from
HF_SIZES = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, initializer_range=0.1)
# kind -> (its transformers config class, the options it adds to HF_SIZES); GPT-2 names its
# sizes its own way, so it lists them all
HF_DECODERS = {
    "llama": ("LlamaConfig", {}),
    "llama_tied_gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 100000.0})),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=32)),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=32)),
    "gpt2": ("GPT2Config", dict(vocab_size=HF_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                initializer_range=0.1, bos_token_id=1, eos_token_id=2)),
}


def hf_decoder_config(kind: str, **overrides):
    """The transformers config of the tiny decoder ``kind`` (a key of HF_DECODERS), with ``overrides``."""
    import transformers

    cls, options = HF_DECODERS[kind]
    sizes = {} if kind == "gpt2" else HF_SIZES
    return getattr(transformers, cls)(**{**sizes, **options, **overrides})


def hf_bert_config():
    """The transformers config of the tiny BERT (the sizes of HF_SIZES)."""
    import transformers

    return transformers.BertConfig(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
                                   initializer_range=0.1)


def tiny_hf_decoder(kind: str, **overrides):
    """A tiny random transformers decoder (seed 0, float32, eval mode) of :func:`hf_decoder_config`."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_decoder_config(kind, **overrides)).float().eval()


def save_hf_folder(model, folder: Path, **save_kwargs) -> Path:
    """``model.save_pretrained(folder)`` beside a word-level tokenizer.json ("w7" <-> id 7, split
    on whitespace): a checkpoint folder as one ships."""
    import tokenizers

    model.save_pretrained(folder, **save_kwargs)
    vocab = {f"w{i}": i for i in range(HF_VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def hf_decoder_folder(kind: str, folder: Path, **save_kwargs):
    """:func:`tiny_hf_decoder` ``kind`` saved by :func:`save_hf_folder` in ``folder``; returns the model."""
    model = tiny_hf_decoder(kind)
    save_hf_folder(model, folder, **save_kwargs)
    return model


# --------------------------------------------------------------------------- decoding references

DECODER_VOCAB = 48
DECODER_LLAMA = dict(positions="rope", norm="rmsnorm", bias=False, mlp="swiglu", mlp_hidden=64)


def random_decoder(positions: str = "rope", seed: int = 3, **kw):
    """A random 2-layer GQA decoder (vocabulary 48, context 64) with weights large enough that
    greedy decoding varies its tokens; Llama-style blocks unless ``kw`` says otherwise."""
    from qkv.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = {**DECODER_LLAMA, "positions": positions, **kw}
    m = GPT(GPTConfig(vocab_size=DECODER_VOCAB, max_seq_len=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      **cfg))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def token_ids(n: int, seed: int, vocab: int = DECODER_VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_alone(m, req, weights: bool = False) -> list:
    """A :class:`qkv.generation.batch.Request` decoded alone by ``qkv.generation.generate`` (the
    batch-1 loop, eager): its ids, or with ``weights`` (id, per-layer (H, S) rows) per step."""
    from qkv.generation import generate
    from qkv.generation.sampling import make_generator

    gen = make_generator("cpu", req.seed)
    out = []
    for item in generate(m, torch.tensor([list(req.ids)]), req.max_new_tokens, temperature=req.temperature,
                         top_k=req.top_k, top_p=req.top_p, generator=gen, stop_ids=req.stop_ids,
                         return_weights=weights, mode="eager"):
        if weights:
            nxt, ws = item
            out.append((int(nxt[0]), [w[0] for w in ws]))
        else:
            out.append(int(item[0]))
    return out


def byte_lm(context: int = 16, dim: int = 16, n_layers: int = 1, seed: int = 0):
    """A CausalLM around a tiny random GPT and a byte tokenizer: one token per byte (a
    byte-level BPE with no merges), so prompt lengths are exact."""
    tk = pytest.importorskip("tokenizers")
    from qkv.models.gpt import GPT, GPTConfig
    from qkv.pipelines.text import CausalLM
    from qkv.tokenizers.hf import HFTokenizer

    alphabet = sorted(tk.pre_tokenizers.ByteLevel.alphabet())
    tok = tk.Tokenizer(tk.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    torch.manual_seed(seed)
    gpt = GPT(GPTConfig(vocab_size=256, max_seq_len=context, dim=dim, n_layers=n_layers, n_heads=2)).eval()
    return CausalLM("tiny", gpt, HFTokenizer(tok), chat_template=None, stop_ids=())


class AloneRun(NamedTuple):
    """What :func:`alone_then_joined` saw: the batch, its ``solo_steps`` after the first row's 5
    steps alone and after the second row's time beside it, the first row's step type while alone,
    each row's tokens, each request's eager tokens alone, and the two prompts."""

    batch: object
    solo_after_alone: int
    solo_after_joined: int
    solo_kind: type | None
    rows: list[list[int]]
    want: list[list[int]]
    prompts: list[list[int]]


def alone_then_joined(m, vocab: int) -> AloneRun:
    """qkv serve's batch with a lone row: a request alone for 5 steps, a second joining until it
    is done, the first alone again to its end; and each request decoded alone, eagerly."""
    from qkv.generation import generate
    from qkv.generation.batch import Batch, Request

    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 4)]
    want = [[int(t[0]) for t in generate(m, torch.tensor([p]), n, temperature=0.0, mode="eager")]
            for p, n in zip(prompts, (24, 6), strict=True)]
    b = Batch(m, 4, 40)
    first, _ = b.join(Request(prompts[0], 24))
    for _ in range(5):
        b.step()
    after_alone = b.solo_steps
    kind = type(b._solo[1]) if b._solo is not None else None
    second, _ = b.join(Request(prompts[1], 6))
    while not second.done:
        b.step()  # two rows: the batched step
    after_joined = b.solo_steps
    while not first.done:
        b.step()  # alone again
    return AloneRun(b, after_alone, after_joined, kind, [first.new, second.new], want, prompts)


def cpu_flags() -> set[str]:
    """This CPU's flags (/proc/cpuinfo)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def loaded_kernels() -> Path | None:
    """The build folder (``<cache>/kernels/<key>``: the library and its record) of the kernel
    library this process has loaded (found or compiled for real by K.int4_op(); in a whole run,
    tests/kernels/test_qmatmul.py's collection loads it), or None: nothing is built here."""
    import qkv.kernels as K

    if not K._loaded():
        return None
    libs = [Path(p) for p in torch.ops.loaded_libraries if Path(p).name == K.LIBRARY]
    return libs[0].parent if len(libs) == 1 and (libs[0].parent / K.META).is_file() else None


def seed_kernels(cache_dir: Path) -> None:
    """Copy the kernel library this process loaded into the cache ``cache_dir`` (mode 0700, as
    qkv makes it), so that a child process using that cache loads it instead of compiling it
    again (~25 s on a Zen 3). The child checks it as any build (its key and SHA-256); a test
    about the compile itself does not seed."""
    import shutil

    built = loaded_kernels()
    if built is None:
        return
    kernels = cache_dir / "kernels"
    kernels.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not (kernels / built.name).exists():
        shutil.copytree(built, kernels / built.name)
        os.chmod(kernels / built.name, 0o700)


def run_folder(factory: pytest.TempPathFactory, name: str) -> Path:
    """``name``, a folder shared by every worker of this pytest run (pytest-xdist gives each
    worker the base folder ``<the run's>/popen-gwN``), made if missing."""
    base = factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


def kernel_builds(folder: Path) -> dict[str, str]:
    """qkv's kernel library's other code paths (plain C++; AVX2, and AVX2 with AVX-VNNI, where this
    CPU runs them), each built into ``folder`` under a namespace of its own and loaded once per
    process: name -> namespace (``torch.ops.<namespace>``, ``torch.classes.<namespace>``).
    ``folder`` may be shared by the run's workers (:func:`run_folder`): each build is compiled
    once, under a lock, by the first worker that asks (~20 s each on a Zen 3), and loaded by all.

    Where this CPU's own library takes the AVX2 path (AVX2 without AVX-512 or AVX-VNNI: a Zen 3, a
    Haswell), it is the AVX2 build (the same preprocessor branches of qmatmul.cpp), so "avx2"
    names it (namespace ``qkv``) instead of compiling it again."""
    import fcntl

    import qkv.kernels as K

    builds = [("scalar", ("-march=x86-64",))]
    out = {}
    flags = cpu_flags()
    if {"avx2", "f16c", "fma"} <= flags:  # the AVX2 build would not run here otherwise
        if (K.int4_op() is not None and torch.ops.qkv.int4_path() == "avx2"
                and not {"avx512f", "avx_vnni"} & flags):
            out["avx2"] = "qkv"
        else:
            builds.append(("avx2", ("-march=haswell",)))
    if {"avx2", "f16c", "fma", "avx_vnni"} <= flags:  # AVX2 with AVX-VNNI (Alder Lake's cores)
        builds.append(("avx2_vnni", ("-march=haswell", "-mavxvnni")))
    for name, march in builds:
        ns = f"qkv_test_{name}"
        if not hasattr(getattr(torch.ops, ns), "int4_mm"):
            lib = folder / f"{name}.so"
            with open(folder / f"{name}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another worker compiling it: wait, then load its
                if not lib.exists():
                    part = folder / f".{name}-{os.getpid()}.so"
                    K.compile_library(part, march, namespace=ns)
                    os.replace(part, lib)
            torch.ops.load_library(str(lib))
        out[name] = ns
    return out


def program_digest(ep: torch.export.ExportedProgram, configs: dict) -> str:
    """What AOTInductor's package of ``ep`` depends on in one test run (the machine, torch and
    qkv's kernels being the same): the graph's code, every input's shape and dtype, the dynamic
    dimensions' ranges, its buffers' and constants' values (not its parameters': the package binds
    them at load, as qkv binds a model's weights), Inductor's settings and the thread count."""
    import hashlib

    h = hashlib.sha256()
    inputs = [(n.name, tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n in ep.graph.nodes
              if n.op == "placeholder" and hasattr(n.meta.get("val"), "shape")]
    h.update(repr((ep.graph_module.code, inputs, sorted(map(str, ep.range_constraints.values())),
                   sorted(configs.items()), torch.get_num_threads())).encode())
    buffers = {name: ep.state_dict[name] for name in ep.graph_signature.buffers if name in ep.state_dict}
    for name, t in sorted({**buffers, **ep.constants}.items()):
        if isinstance(t, torch.Tensor):
            h.update(name.encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def compiled_once(folder: Path) -> Callable[..., str]:
    """A stand-in for ``torch._inductor.aoti_compile_and_package`` that compiles each exported
    program once per test run: the package of a program whose :func:`program_digest` a test (of
    any worker) compiled before is copied from ``folder`` (:func:`run_folder`), under a lock; the
    first compiles it for real. qkv's own ``aot._compile`` still runs around it (its private
    Inductor cache, its errors); only a second AOTInductor compile of the same program is saved
    (20-30 s each on a Zen 3: test_builds.py builds test_aot.py's step, serve/test_build_steps.py
    the tiny GPT run's that test_aot.py's `qkv prepare` builds, and the 4-bit test's untied model
    the blocks of its tied one)."""
    import fcntl
    import shutil

    from torch._inductor import aoti_compile_and_package

    def compile_(ep, package_path: str, inductor_configs: dict | None = None, **kw) -> str:
        # (aoti_compile_and_package adds "aot_inductor.package" to the dict it is given: qkv's own)
        configs = {k: v for k, v in (inductor_configs or {}).items() if k != "aot_inductor.package"}
        digest = program_digest(ep, configs)
        stored = folder / f"{digest}.pt2"
        with open(folder / f"{digest}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not stored.exists():
                part = folder / f".{digest}-{os.getpid()}.pt2"
                aoti_compile_and_package(ep, package_path=str(part), inductor_configs=dict(configs), **kw)
                os.replace(part, stored)
        shutil.copyfile(stored, package_path)
        return package_path

    return compile_
