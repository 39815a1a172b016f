"""The catalog against the lecture index: every section that has a command has an exercise, at
least 40 in all, each complete (a section of the index, a stub with an example, two hints or
more, a command to see it), and `qkv learn list --json` says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from qkv.explain.lectures import LECTURES
from qkv.learn import EXERCISES


def test_every_section_with_a_command_has_an_exercise_and_there_are_forty():
    assert len(EXERCISES) >= 40
    titles = {s.title for lec in LECTURES for s in lec.sections}
    assert {e.section for e in EXERCISES.values()} <= titles
    shown = [s.title for lec in LECTURES for s in lec.sections if s.demos]
    bare = [t for t in shown if not any(e.section == t for e in EXERCISES.values())]
    assert not bare, f"sections with a command but no exercise: {bare}"


def test_every_exercise_is_complete():
    for e in EXERCISES.values():
        assert e.stub.strip() and "example" in e.stub.lower(), e.name
        assert len(e.hints) >= 2 and e.see.startswith("qkv "), e.name
        assert 1 <= e.difficulty <= 3 and e.checks and e.solution.strip(), e.name
        compile(e.stub_file(), f"{e.name}.py", "exec")


def test_list_json_names_every_exercise_with_its_section(tmp_path):
    env = {**os.environ, "QKV_CACHE_DIR": "off"}
    p = subprocess.run([sys.executable, "-m", "qkv", "learn", "list", "--json"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["name"] for r in rows] == list(EXERCISES)
    assert all(r["section"] == EXERCISES[r["name"]].section and r["status"] == "not started" for r in rows)


def _solution(name):
    import math

    import torch

    ns = {"torch": torch, "math": math}
    exec(EXERCISES[name].solution, ns)
    return ns[name]


def test_the_stubs_worked_examples_are_right():
    """The examples written into the stubs of the first exercises, recomputed by the solutions
    (which the exercises' own tests hold to independent references)."""
    import torch

    t, eye = torch.tensor, torch.eye(2)

    def near(got, want):
        got = got[0] if isinstance(got, tuple) else got
        assert torch.allclose(got.double(), t(want, dtype=torch.float64), atol=1e-4), (got, want)

    near(_solution("multi_head_attention")(t([[[1.0, 0], [0, 1]]]), eye, eye, eye, eye, 1, causal=True),
         [[[1, 0], [0.3302, 0.6698]]])
    near(_solution("sinusoidal_positions")(2, 4), [[0, 1, 0, 1], [0.8415, 0.5403, 0.0100, 0.9999]])
    near(_solution("rope")(t([[1.0, 0, 0, 0]]), t([1])), [[0.5403, 0, 0.8415, 0]])
    near(_solution("layer_norm")(t([1.0, 2, 3]), torch.ones(3), torch.zeros(3)), [-1.2247, 0, 1.2247])
    near(_solution("additive_attention")(t([[1.0, 0]]), t([[[1.0, 0], [0, 1]]]), eye, eye, torch.ones(2))[1],
         [[0.3637, 0.6363]])
    q, k, v = t([[[[1.0, 0]], [[0, 1.0]]]]), t([[[[1.0, 0], [0, 1]]]]), t([[[[1.0, 2], [3, 4]]]])
    near(_solution("grouped_query_attention")(q, k, v), [[[[1.6605, 2.6605]], [[2.3395, 3.3395]]]])
    online = _solution("online_softmax_attention")
    near(online(t([[1.0, 0]]), t([[1.0, 0], [0, 1]]), t([[1.0, 2], [3, 4]]), 1), [[1.6605, 2.6605]])
    block = _solution("transformer_block")
    args = (t([[[1.0]]]), lambda h: 2 * h, lambda h: h + 1, lambda h: h / 10, lambda h: h / 10)
    near(block(*args, pre_ln=True), [[[2.32]]])
    near(block(*args, pre_ln=False), [[[0.16]]])
    empty = torch.zeros(1, 1, 0, 2)
    step = _solution("kv_cache_step")
    out, kc, vc = step(t([[[[0.0, 1]]]]), t([[[[0.0, 1]]]]), t([[[[1.0, 0]]]]), empty, empty)
    near(out, [[[[1.0, 0]]]])
    out, _, _ = step(t([[[[1.0, 0]]]]), t([[[[1.0, 0]]]]), t([[[[3.0, 0]]]]), kc, vc)
    near(out[..., :1], [[[[2.3395]]]])
