"""The lecture index (issue 28): every command it lists runs, it is printed by `qkv explain
--lectures` and served at /lectures; and the topics it added (cnn, architectures), each against a
computation written out here."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call

from qkv.explain.lectures import LECTURES

DEMOS = [d for lec in LECTURES for s in lec.sections for d in s.demos]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("demo", DEMOS, ids=[d.command[:60] for d in DEMOS])
def test_every_listed_command_runs(demo, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # runs/ and pictures land here
    rc, _, err = call([*demo.argv(), *demo.quick])
    assert rc == 0, f"{demo.command}: {err[-500:]}"


def test_the_index_names_real_benchmarks_and_says_why_a_section_has_none() -> None:
    for lec in LECTURES:
        assert lec.sections
        for s in lec.sections:
            assert bool(s.demos) != bool(s.missing), s.title  # a command, or the reason there is none
            if s.measured:
                assert (REPO / "benchmarks" / s.measured).is_file(), s.measured


def test_each_lecture_is_cited_by_course_lecture_and_title() -> None:
    """A reader finds the lecture without our files: the course, the term, the lecture and its
    title; never a file name of the notes (issue 41)."""
    cite = re.compile(r'^(UC Berkeley CS189, Spring 2026|Stanford CS231N, 2025), (Lecture|Discussion) \d+ ')
    for lec in LECTURES:
        assert cite.match(lec.notes), lec.notes
        assert not re.search(r"\w+\.(txt|md|pdf)\b", lec.notes), lec.notes
        number = re.search(r"(Lecture|Discussion) (\d+)", lec.name)
        assert number and f"{number.group(1)} {number.group(2)}" in lec.notes, (lec.name, lec.notes)
        for s in lec.sections:  # section titles in English words (no bare CJK chapter numerals)
            assert not re.search(r"[\u4e00-\u9fff]", s.title), s.title
            assert not re.search(r"\w+\.(txt|md)\b", s.missing or ""), s.missing


def test_lectures_cli_and_page() -> None:
    rc, out, err = call(["explain", "--lectures"])
    flat = " ".join(out.split())
    assert rc == 0 and "CS231N Lecture 8" in flat and "qkv explain positions" in flat, err
    assert "not shown:" in flat
    assert ".txt" not in flat and "UC Berkeley CS189, Spring 2026, Lecture 21" in flat
    rc, _, err = call(["explain", "--lectures", "softmax"])
    assert "--lectures takes no topic" in assert_one_line_error(rc, err)
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    with TestClient(create_app()) as client:
        r = client.get("/lectures")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<script" not in r.text and ".txt" not in r.text
    for lec in LECTURES:  # cited by course, lecture and title
        assert lec.notes.replace('"', "&quot;") in r.text
    for d in DEMOS:  # every command, HTML-escaped
        assert d.command.replace("&", "&amp;").replace('"', "&quot;").replace("'", "&#x27;") in r.text


def test_cnn_counts_and_receptive_fields_by_hand() -> None:
    from qkv.explain import explain_cnn

    r = explain_cnn(size=15, channels=8)
    for row in r.images:
        assert row.mlp_weights == row.pixels**2 and row.conv_weights == 9 * 8 * 8
    assert r.images[0].pixels == 784 and r.mlp_checked == 784 * 784 + 784
    for layers, width in r.receptive:  # each width-3 layer adds a pixel on either side
        assert width == min(2 * layers + 1, 15)
    assert r.layers_to_see_all == math.ceil((15 - 1) / 2)
    assert r.attention_sees == 15 * 15 and r.other_size_conv
    assert "shapes cannot be multiplied" in r.other_size_mlp


def test_architectures_paths_by_hand() -> None:
    from qkv.explain import explain_architectures

    r = explain_architectures(d=16, kernel=3, lengths=(8, 16), batch=1, repeats=1, path_n=20)
    rnn, cnn, attn = r.rows
    assert rnn.path_measured == 19 and cnn.path_measured == math.ceil(19 / 2) and attn.path_measured == 1
    r5 = explain_architectures(d=16, kernel=5, lengths=(8,), batch=1, repeats=1, path_n=20)
    assert r5.rows[1].path_measured == math.ceil(19 / 4)  # width k reaches k − 1 further per layer
    assert all(len(row.ms) == 2 and all(v > 0 for v in row.ms) for row in r.rows)
    rc, out, err = call(["explain", "architectures", "--lengths", "8", "16", "--d", "16"])
    assert rc == 0 and re.search(r"self-attention", out), err
    rc, _, err = call(["explain", "cnn", "--size", "3"])
    assert "size must be in 5..128" in assert_one_line_error(rc, err)


def test_attention_depends_on_every_input_in_one_layer() -> None:
    """The claim behind the path column, independently: one output's Jacobian row is dense."""
    from qkv.attention import MultiHeadAttention

    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 10, 8, dtype=torch.float64, requires_grad=True)
    attn(x).out[0, 0].sum().backward()
    assert (x.grad[0].abs().sum(-1) > 0).all()


def test_the_notes_two_by_two_soft_and_hard_attention() -> None:
    """CS189 Lec 21: z = 0.1a + 0.2b + 0.7c (soft) vs one sampled cell (hard), whose mean is z."""
    from qkv.explain import explain_hard_attention

    r = explain_hard_attention(trials=20_000, seed=3)
    a, b, c, _ = (torch.tensor(v, dtype=torch.float64) for v in r.grid_cells)
    torch.testing.assert_close(torch.tensor(r.grid_soft, dtype=torch.float64), 0.1 * a + 0.2 * b + 0.7 * c)
    for share, w in zip(r.grid_hard_share, (0.1, 0.2, 0.7, 0.0), strict=True):
        assert abs(share - w) < 4 * math.sqrt(w * (1 - w) / 20_000) + 1e-12  # binomial, 4 sigma
    assert r.grid_hard_share[3] == 0 and r.grid_hard_mean_error < 0.05


def test_what_the_kv_cache_saves_counted_step_by_step() -> None:
    """Discussion 11: generate T tokens one at a time, counting by a loop what each step computes."""
    from qkv.explain.cost import cache_savings, layer_flops
    from qkv.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=50, max_seq_len=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    one = layer_flops(cfg, 1)
    row, pair = one.proj + one.mlp, 4 * cfg.n_heads * cfg.resolved_head_dim
    for s in cache_savings(cfg, [1, 7, 40]):
        rows_c = rows_r = pairs_c = pairs_r = 0
        for t in range(1, s.t + 1):  # step t: the prefix holds t tokens
            rows_c, pairs_c = rows_c + 1, pairs_c + t  # the new token; its query against t keys
            rows_r, pairs_r = rows_r + t, pairs_r + t * (t + 1) // 2  # everything again, causally
        assert (s.rows_cached, s.rows_recomputed, s.pairs_cached, s.pairs_recomputed) == (rows_c, rows_r,
                                                                                          pairs_c, pairs_r)
        assert s.flops_cached == rows_c * row + pairs_c * pair
        assert s.flops_recomputed == rows_r * row + pairs_r * pair
    assert layer_flops(cfg, 3).proj == 3 * one.proj  # projections are per row: the counts above hold


def test_published_model_sizes() -> None:
    """CS231N Lec 8's scale: GPT-2 small has 124,439,808 parameters (Hugging Face's count, tied
    head); GPT-3 175B, 12·L·d² + 13·L·d + V·d + T·d + 2d with L = 96, d = 12288 by hand."""
    from qkv.explain.cost import model_cost

    assert model_cost("gpt2").params == 124_439_808
    L, d, V, T = 96, 12288, 50257, 2048
    gpt3 = model_cost("gpt3-175b")
    assert gpt3.params == L * (12 * d * d + 13 * d) + V * d + T * d + 2 * d
    assert abs(gpt3.params / 175e9 - 1) < 0.01
    mha = next(row for row in gpt3.kv if row.actual)
    assert mha.bytes == 2 * L * 96 * 128 * T * 2  # k and v, 96 heads of 128, bf16
