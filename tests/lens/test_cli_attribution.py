"""`qkv lens --patch` with attribution patching's refinements and edges: the command's numbers are
the library's (whose own tests check them against transformers and finite differences), its
flags say where the estimate is known to fail, and bad combinations are one line."""

from __future__ import annotations

import pytest
import torch
from helpers import PNG, assert_one_line_error, call, call_json, hf_decoder_folder

import qkv
from qkv import lens

TEXT = "w3 w17 w42 w5 w88 w9 w1 w60 w17 w42"
CORRUPT = TEXT.replace("w60", "w61")
PAIR = ["--patch", "--corrupt", CORRUPT, "--answer", "w7", "--wrong", "w8"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    hf_decoder_folder("gpt2", folder)
    return str(folder)




@pytest.mark.parametrize("extra, kw", [
    (["--site", "key", "--qk-fix", "--metric", "prob"], dict(site="key", qk_fix=True, metric="prob")),
    (["--site", "head", "--ig-steps", "3", "--metric", "loss"], dict(site="head", ig_steps=3, metric="loss")),
    (["--site", "query"], dict(site="query")),
])
def test_cli_estimates_are_the_librarys(gpt2, extra, kw):
    got = call_json(["lens", gpt2, TEXT, *PAIR, "--estimate", *extra, "--json"])
    est = lens.attribution_patch(qkv.load(gpt2), TEXT, CORRUPT, answer="w7", wrong="w8", **kw)
    assert got["metric"] == est.metric and got["site"] == est.site
    assert torch.allclose(torch.tensor(got["values"]), est.values, atol=1e-6)
    assert got["saturated"] == [list(c) for c in est.saturated()]


def test_cli_exact_query_patch_and_grad_drop_are_the_librarys(gpt2):
    lm = qkv.load(gpt2)
    got = call_json(["lens", gpt2, TEXT, *PAIR, "--site", "value", "--metric", "prob", "--json"])
    exact = lens.patch(lm, TEXT, CORRUPT, site="value", answer="w7", wrong="w8", metric="prob")
    assert got["method"] == "exact" and torch.allclose(torch.tensor(got["values"]), exact.values, atol=1e-6)
    got = call_json(["lens", gpt2, TEXT, *PAIR, "--site", "head", "--estimate", "--grad-drop", "--json"])
    est = lens.attribution_patch(lm, TEXT, CORRUPT, site="head", answer="w7", wrong="w8", grad_drop=True)
    assert torch.allclose(torch.tensor(got["grad_drop"]), est.grad_drop, atol=1e-6)
    assert got["cancelling"] == [list(c) for c in est.cancelling()]
    rc, out, err = call(["lens", gpt2, TEXT, *PAIR, "--site", "head", "--estimate", "--grad-drop"])
    assert rc == 0, err
    assert "GradDrop" in out and "logit['w7'] - logit['w8']" in out


def test_cli_edges_are_the_librarys_as_a_table_and_a_graph(gpt2, tmp_path):
    got = call_json(["lens", gpt2, TEXT, *PAIR, "--edges", "--ig-steps", "2", "-k", "6", "--json"])
    e = lens.edge_attribution(qkv.load(gpt2), TEXT, CORRUPT, answer="w7", wrong="w8", ig_steps=2)
    want = e.top(6)
    assert got["method"] == "EAP-IG (2 steps)"
    assert [(d["sender"], d["receiver"]) for d in got["edges"]] == [(t.sender, t.receiver) for t in want]
    assert [d["value"] for d in got["edges"]] == pytest.approx([t.value for t in want], abs=1e-6)
    rc, out, err = call(["lens", gpt2, TEXT, *PAIR, "--edges", "-k", "6", "-o", str(tmp_path / "edges.png")])
    assert rc == 0, err
    assert (tmp_path / "edges.png").read_bytes().startswith(PNG)
    assert "EAP:" in out and want[0].sender in out


def test_cli_flags_a_saturated_head_on_the_planted_circuit(tmp_path):
    """The planted induction circuit saved as a run would need a tokenizer; its flag is read
    through the same view function the command calls, on the library's estimate."""
    from qkv.commands.lens_views import _flags
    from qkv.lens import planted

    p = planted.induction(seed=0, distractor=0.0)
    est = lens.attribution_patch(p, p.clean, p.corrupt, site="key", answer=p.answer, wrong=p.wrong)
    assert (0, 0) in est.saturated()
    from qkv.commands import lens_views

    seen: list[str] = []

    class Console:
        def print(self, line, highlight=False):
            seen.append(line)

    old = lens_views.console
    lens_views.console = lambda: Console()
    try:
        _flags(est)
    finally:
        lens_views.console = old
    assert len(seen) == 1 and "--qk-fix" in seen[0] and "0.0" in seen[0]


@pytest.mark.parametrize("extra, message", [
    (["--patch", "--corrupt", CORRUPT, "--qk-fix"], "add --estimate"),
    (["--patch", "--corrupt", CORRUPT, "--estimate", "--qk-fix", "--site", "head"], "add --site query"),
    (["--edges"], "--edges is for --patch"),
    (["--patch", "--corrupt", CORRUPT, "--edges", "--estimate"], "takes no --estimate"),
    (["--patch", "--corrupt", CORRUPT, "--estimate", "--ig-steps", "-1"], "--ig-steps must be >= 0"),
    (["--patch", "--corrupt", CORRUPT, "--ig-steps", "2"], "--ig-steps is for --estimate or --edges"),
])
def test_cli_bad_combinations_are_one_line(gpt2, extra, message):
    rc, _, err = call(["lens", gpt2, TEXT, *extra])
    assert message in assert_one_line_error(rc, err)
