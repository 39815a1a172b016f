"""`qkv learn run`: a student's function inside qkv's models. A correct function (written here,
independently of qkv's code) gives qkv's own losses and greedy text; a wrong one is caught by
the verdict. The comparisons are with qkv's built-in modules (whose own tests compare them with
PyTorch and transformers), and the SmolLM2 reference decodes with no cache at all."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from qkv.learn.inside import run

pytestmark = pytest.mark.usefixtures("one_thread")


def softmax(x, dim=-1):
    e = (x - x.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True)


def softmax_over_queries(x, dim=-1):
    return softmax(x, dim=-2)


def scaled_dot_product_attention(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    w = softmax(s)
    return w @ v, w


def causal_mask(T):
    return torch.arange(T)[None, :] <= torch.arange(T)[:, None]


def mask_that_sees_the_future(T):
    return torch.ones(T, T, dtype=torch.bool)


def multi_head_attention(x, w_q, w_k, w_v, w_o, n_heads, causal=False):
    B, T, D = x.shape
    split = lambda t: t.view(B, T, n_heads, D // n_heads).transpose(1, 2)  # noqa: E731
    out, _ = scaled_dot_product_attention(split(x @ w_q), split(x @ w_k), split(x @ w_v),
                                          causal_mask(T) if causal else None)
    return out.transpose(1, 2).reshape(B, T, D) @ w_o


def layer_norm(x, weight, bias, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * weight + bias


def layer_norm_without_centering(x, weight, bias, eps=1e-5):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight + bias


def sinusoidal_positions(T, d):
    p = torch.arange(T, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.stack([torch.sin(p * freq), torch.cos(p * freq)], -1).reshape(T, d).float()


def rope(x, positions, theta=10000.0):
    d = x.shape[-1]
    ang = positions.double()[:, None] * theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def rope_interleaved(x, positions, theta=10000.0):  # GPT-NeoX vs GPT-J: the wrong pairing for Llama
    d = x.shape[-1]
    ang = positions.double()[:, None] * theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def kv_cache_step(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
    w = softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    return w @ v_cache, k_cache, v_cache


def kv_cache_step_forgetting(q, k, v, k_cache, v_cache):  # attends to the new token only
    w = softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    return w @ v, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)


def additive_attention(query, keys, w_q, w_k, v):
    scores = torch.einsum("bta,a->bt", torch.tanh((query @ w_q)[:, None] + keys @ w_k), v)
    w = softmax(scores, -1)
    return torch.einsum("bt,btd->bd", w, keys), w


def additive_attention_no_tanh(query, keys, w_q, w_k, v):
    scores = ((query @ w_q)[:, None] + keys @ w_k) @ v
    w = softmax(scores, -1)
    return torch.einsum("bt,btd->bd", w, keys), w


GPT_CASES = [
    ("softmax", softmax, softmax_over_queries),
    ("scaled_dot_product_attention", scaled_dot_product_attention, None),
    ("causal_mask", causal_mask, mask_that_sees_the_future),
    ("multi_head_attention", multi_head_attention, None),
    ("layer_norm", layer_norm, layer_norm_without_centering),
    ("sinusoidal_positions", sinusoidal_positions, None),
]


@pytest.mark.parametrize(("name", "right", "wrong"), GPT_CASES, ids=[c[0] for c in GPT_CASES])
def test_inside_the_gpt_a_right_function_trains_like_qkvs_and_a_wrong_one_does_not(name, right, wrong):
    r = run(name, right, steps=6)
    assert r.passed, r.verdict
    assert r.numbers["output_difference"] < 1e-5
    train = r.curves["yours"]["train"]
    assert len(train) == 6 and train[-1][1] < train[0][1]
    if wrong is not None:
        bad = run(name, wrong, steps=3)
        assert not bad.passed and "not the same function" in bad.verdict
        assert " first" in bad.verdict and "position" in bad.verdict, bad.verdict  # says where


def test_the_gpt_room_really_runs_the_students_function():
    calls = []

    def counting_softmax(x, dim=-1):
        calls.append(tuple(x.shape))
        return softmax(x, dim)

    run("softmax", counting_softmax, steps=2)
    assert calls and all(s[-2:] == (64, 64) for s in calls)  # (B, H, T, T) scores of the cpu GPT


def test_rope_inside_smollm2_gives_qkvs_greedy_text_and_the_wrong_pairing_does_not():
    r = run("rope", rope)
    assert r.passed and r.tokens["yours"] == r.tokens["qkv's"] and r.texts["yours"].strip()
    bad = run("rope", rope_interleaved)
    assert not bad.passed and "part at token" in bad.verdict


def test_kv_cache_step_inside_smollm2_decodes_the_tokens_of_decoding_without_a_cache():
    import qkv

    r = run("kv_cache_step", kv_cache_step)
    assert r.passed, r.verdict
    # the reference, independently: transformers-free greedy decoding by qkv's own generate
    lm = qkv.load("smollm2", weights="fp32")
    from qkv.learn.inside import PROMPT

    ids = lm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        seq = list(ids)
        for _ in range(len(r.tokens["yours"])):
            seq.append(int(lm.model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert r.tokens["yours"] == seq[len(ids):]
    bad = run("kv_cache_step", kv_cache_step_forgetting)
    assert not bad.passed


def test_additive_attention_inside_the_dates_rnn():
    r = run("additive_attention", additive_attention, steps=4)
    assert r.passed, r.verdict
    bad = run("additive_attention", additive_attention_no_tanh, steps=2)
    assert not bad.passed and "not the same function" in bad.verdict


@pytest.mark.slow  # ~40 s; benchmarks/learn_run.py runs `qkv learn run` on every exercise
def test_the_command_runs_a_right_file_to_the_end_and_writes_the_plot(tmp_path):
    good = tmp_path / "softmax.py"
    good.write_text(GOOD_SOFTMAX)
    p = subprocess.run([*BASE, str(good), "--steps", "3", "-o", str(tmp_path / "p.png"), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["passed"] and (tmp_path / "p.png").stat().st_size > 5000


GOOD_SOFTMAX = ("import torch\n\ndef softmax(x, dim=-1):\n    e = (x - x.amax(dim, keepdim=True)).exp()\n"
                "    return e / e.sum(dim, keepdim=True)\n")
BASE = [sys.executable, "-m", "qkv", "learn", "run", "softmax"]


def test_the_command_stops_a_wrong_file_before_training_and_says_where(tmp_path):
    """Softmax over the batch axis: the masked entries' columns are all -inf there, so the first
    block's attention is NaN. The run stops before any training step, names the first block
    and position (block 0, position 0: its first row has one key) and plots what it has."""
    bad = tmp_path / "bad.py"
    bad.write_text("def softmax(x, dim=-1):\n    return x.exp() / x.exp().sum(0, keepdim=True)\n")
    p = subprocess.run([*BASE, str(bad), "-o", str(tmp_path / "q.svg")], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "FAIL" in p.stdout and (tmp_path / "q.svg").is_file(), p.stdout + p.stderr
    assert "block 0's output has NaN or inf first at position 0" in p.stdout, p.stdout
    assert "no training" in p.stdout and "step 1/" not in p.stdout, p.stdout


def test_the_command_bounds_a_hanging_file_and_refuses_bad_arguments_in_one_line(tmp_path):
    good = tmp_path / "softmax.py"
    good.write_text(GOOD_SOFTMAX)
    hang = tmp_path / "hang.py"
    hang.write_text("def softmax(x, dim=-1):\n    while True:\n        pass\n")
    p = subprocess.run([*BASE, str(hang), "--steps", "2", "--timeout", "6", "-o", str(tmp_path / "h.png")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "did not finish in 6 s" in p.stdout, p.stdout + p.stderr
    for argv, says in (([*BASE, str(tmp_path / "none.py")], "is not a file"),
                       ([*BASE[:-1], "hardmax", str(good)], "has no model to run in"),
                       ([*BASE, str(good), "-o", str(tmp_path / "x.txt")], ".png or an .svg")):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
