"""The terminal a student reads (issue 41, item 5, and the busy-machine line of item 3), each
asserted on what the commands print: whitespace tokens as ␣ ↵ ⇥ in every table, -k in every
`qkv lens` view, "did you mean" for a misspelt model, one rule for texts longer than the
context, input files checked before a run is announced, suggested commands quoted readably,
the compile note as measured, one threshold for naming heads, heads.png's probe caption, and
the line a long command prints on a busy machine.

The expectations are computed here from first principles (a plain replace table, difflib,
shlex.split, the scores in --json), not copied from qkv's output.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call

pytestmark = pytest.mark.usefixtures("one_thread")

MARKS = {" ": "␣", "\n": "↵", "\t": "⇥"}  # what the issue asks for, written out independently


def shown(token: str) -> str:
    return "".join(MARKS.get(c, c) for c in token)


def table_rows(out: str) -> list[list[str]]:
    """The data rows of every rich table in ``out``: the cells of each line between │ bars."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()
            if line.lstrip().startswith("│")]


@pytest.fixture
def wide(monkeypatch):
    """Rich tables as wide as they need (no wrapped cells) when stdout is not a terminal."""
    monkeypatch.setenv("COLUMNS", "240")


@pytest.fixture(scope="module")
def gpt(tiny_run) -> str:
    return str(tiny_run("gpt"))


# --------------------------------------------------------------------------- ␣ ↵ ⇥


def test_one_mapping_for_tokens_in_tables_and_pictures() -> None:
    from qkv.viz import show_token
    from qkv.viz.plots import _label

    for token in [" ", "\n", "\t", " the", "\n\n", "a\tb", "ROMEO", " \n "]:
        assert show_token(token) == shown(token)
        assert _label(token) == shown(token)  # the PNGs' axis labels: the same function
    assert show_token("") == "∅" and show_token("\x00") == "\\x00" and show_token("\r") == "␍"


def test_lens_tables_show_whitespace_tokens(gpt, wide) -> None:
    # every token of the character vocabulary (-k 100 > vocabulary): ' ' and '\n' among them
    rc, out, err = call(["lens", gpt, "--prompt", "ROMEO: But soft", "-k", "100"])
    assert rc == 0, err
    rc, js, err = call(["lens", gpt, "--prompt", "ROMEO: But soft", "-k", "100", "--json"])
    tokens = [t["token"] for t in json.loads(js)["top"]]
    assert " " in tokens and "\n" in tokens
    assert sorted(r[0] for r in table_rows(out)) == sorted(shown(t) for t in tokens)
    assert all(r[0] for r in table_rows(out))  # no blank cell

    rc, out, err = call(["lens", gpt, "--prompt", "ROMEO: But soft", "--qk", "0.0", "-k", "20"])
    assert rc == 0, err
    keys = sorted(r[0] for r in table_rows(out))
    assert keys == sorted(shown(c) for c in "ROMEO: But soft")  # 15 keys, two of them ␣


def test_explain_masking_table_uses_the_mapping() -> None:
    from rich.console import Console

    from qkv.explain.masking import explain_masking, render_masking

    r = explain_masking()
    r.tokens[1] = " \n"  # a whitespace token, as a model's tokenizer may give
    console = Console(record=True, width=200)
    render_masking(r, console)
    assert "␣↵" in console.export_text()


# --------------------------------------------------------------------------- -k in every view

VIEWS = [["--probs"], ["--ablate", "0.0"], ["--effects"],
         ["--patch", "--corrupt", "JULIE: But soft", "--answer", "s", "--wrong", "a"], ["--attribute", "a"],
         ["--qk", "1.2"], ["--rollout"]]


@pytest.mark.parametrize("view", VIEWS, ids=[v[0] for v in VIEWS])
def test_k_rows_in_every_view(gpt, wide, view) -> None:
    rc, out, err = call(["lens", gpt, "--prompt", "ROMEO: But soft", *view, "-k", "3"])
    assert rc == 0, err
    assert len(table_rows(out)) == 3, out


def test_k_columns_in_the_logit_lens(gpt, wide) -> None:
    rc, out, err = call(["lens", gpt, "--prompt", "ROMEO: But soft", "--logit-lens", "-k", "5"])
    assert rc == 0, err
    rows = table_rows(out)
    assert len(rows) == 3 and all(len(r) == 1 + 5 for r in rows)  # embeddings + 2 layers; 5 positions
    header = next(line for line in out.splitlines() if line.lstrip().startswith("┃"))
    assert [c.strip() for c in header.strip().strip("┃").split("┃")][1:] == ["␣", "s", "o", "f", "t"]


def test_k_rows_of_heads_and_the_threshold(gpt, wide, monkeypatch) -> None:
    import qkv.lens
    from qkv.lens import HeadScores

    rc, js, err = call(["lens", gpt, "--heads", "--json"])
    assert rc == 0, err
    assert json.loads(js)["threshold"] == 0.5
    # scores set by hand (2 layers x 4 heads): 0.9, 0.6 and 0.5 name a head, 0.49 does not
    prev = torch.tensor([[0.9, 0.49, 0.1, 0.0], [0.0, 0.6, 0.2, 0.3]])
    first = torch.tensor([[0.0, 0.1, 0.5, 0.0], [0.2, 0.0, 0.0, 0.1]])
    zero = torch.zeros(2, 4)
    monkeypatch.setattr(qkv.lens, "head_scores", lambda lm: HeadScores(prev, first, zero, zero, 3.0, 2.0))
    named = int((torch.maximum(prev, first) >= 0.5).sum())
    assert named == 3
    for k in (1, 2, 8):
        rc, out, err = call(["lens", gpt, "--heads", "-k", str(k)])
        assert rc == 0, err
        rows = table_rows(out)
        assert [r[0] for r in rows] == ["0.0", "1.1", "0.2"][:k]  # the strongest first
        said = " ".join(out.split())
        assert f"score >= 0.5 on repeated random tokens); {named} of 8 named" in said
        assert ("the 2 strongest shown (-k)" in said) == (k == 2)


def test_smollm2_heads_k8_prints_8_rows(wide) -> None:
    from pretrained.asset_skip import require_asset

    require_asset("smollm2")
    pytest.importorskip("gguf", reason="gguf not installed: pip install 'qkv[pretrained]'")
    rc, out, err = call(["lens", "smollm2", "--heads", "-k", "8"])
    assert rc == 0, err
    rows = table_rows(out)
    assert len(rows) == 8 and all(float(r[2]) >= 0.5 for r in rows)


def test_one_threshold_names_and_counts_heads() -> None:
    from qkv.lens import NAMED_AT, HeadScores
    from qkv.lens.history import FORMED, History

    assert NAMED_AT == 0.5 and FORMED == NAMED_AT
    z = torch.zeros(1, 2)
    sc = HeadScores(torch.tensor([[0.45, 0.55]]), z, z, z, 1.0, 1.0)
    assert sc.labels == [["", "previous"]]
    hist = History([0, 10], {"previous": torch.tensor([[[0.45, 0.1]], [[0.5, 0.1]]]),
                             "first": torch.zeros(2, 1, 2), "duplicate": torch.zeros(2, 1, 2),
                             "induction": torch.zeros(2, 1, 2)}, [3.0, 3.0], [3.0, 3.0])
    assert hist.formed()["previous"] == 10


# --------------------------------------------------------------------------- did you mean


@pytest.mark.parametrize("argv", [["lens", "smolm2", "--prompt", "hi"],
                                  ["generate", "smolm2", "--prompt", "hi"], ["attend", "smolm2", "hi"],
                                  ["prepare", "smolm2"]])
def test_misspelt_model_did_you_mean(argv) -> None:
    rc, _out, err = call(argv)
    line = assert_one_line_error(rc, err)
    want = difflib.get_close_matches("smolm2", ["minilm", "smollm2"])
    assert want == ["smollm2"] and "did you mean smollm2?" in line


def test_misspelt_run_folder_did_you_mean(gpt) -> None:
    runs = sorted(p.name for p in Path(gpt).parent.iterdir())
    typo = gpt[:-1] + gpt[-1] * 2  # runs/gpt-tiny -> runs/gpt-tinyy
    assert difflib.get_close_matches("gpt-tinyy", runs, n=1) == ["gpt-tiny"]
    rc, _out, err = call(["lens", typo, "--prompt", "hi"])
    assert f"did you mean {gpt}? (bundled" in assert_one_line_error(rc, err)
    rc, _out, err = call(["lens", str(Path(gpt) / "config.json"), "--prompt", "hi"])  # there: no guess
    assert "did you mean" not in assert_one_line_error(rc, err)
    rc, _out, err = call(["lens", "nothing-like-it", "--prompt", "hi"])  # no close name: no guess
    assert "did you mean" not in assert_one_line_error(rc, err)


def test_misspelt_asset_did_you_mean() -> None:
    rc, _out, err = call(["assets", "install", "smolm2"])
    assert "did you mean smollm2?" in assert_one_line_error(rc, err)


# --------------------------------------------------------------------------- longer than the context


def test_one_rule_for_texts_longer_than_the_context(gpt) -> None:
    context = json.loads((Path(gpt) / "config.json").read_text())["model"]["max_seq_len"]
    text = "ROMEO: " * 10  # a character model: one token per character
    assert len(text) > context
    for argv in (["attend", gpt, text, "-o", "x.png"], ["lens", gpt, "--prompt", text]):
        line = assert_one_line_error(*call(argv)[::2])
        assert f"the text is {len(text)} tokens, more than" in line and f"context of {context}" in line
    for command in ("attend", "lens"):
        _rc, out, _err = call([command, "--help"])
        assert "longer than the model's context is refused, naming the limit" in " ".join(out.split())


# --------------------------------------------------------------------------- training


def test_missing_data_file_is_said_before_the_run_is_announced(tmp_path) -> None:
    run = tmp_path / "run"
    rc, out, err = call(["train", "--preset", "tiny", "--data", str(tmp_path / "my.txt"),
                         "--out_dir", str(run)])
    line = assert_one_line_error(rc, err)
    assert "my.txt: no such file" in line
    assert out == "" and not run.exists()  # nothing announced, nothing made


def test_suggested_commands_quoted_readably() -> None:
    from qkv.training.run import command_line

    cases = [["qkv", "generate", "runs/a b", "--prompt", "ALL'S"],
             ["qkv", "generate", "r", "--prompt", "ROMEO"], ["x", "it's $HOME"], ["x", 'say "hi"'],
             ["x", "don't!"], ["x", ""]]
    for words in cases:
        assert shlex.split(command_line(words)) == words
    assert command_line(cases[0]) == "qkv generate 'runs/a b' --prompt \"ALL'S\""
    assert command_line(cases[1]) == "qkv generate r --prompt ROMEO"


def test_compile_note_says_what_was_measured() -> None:
    from qkv.training.speed import CompileMeter

    slower = CompileMeter(eager_s=0.1, max_iters=100, fast=[0.28] * 5)
    assert slower.summary().endswith(f"compiled steps took {0.28 / 0.1:.2g}× as long as eager "
                                     "(280 ms vs 100 ms per step, median of 5)")
    faster = CompileMeter(eager_s=0.1, max_iters=100, fast=[0.092] * 6)
    assert "compiled steps took 0.92× as long as eager" in faster.summary()
    assert "-" not in faster.summary().split(";")[1] and "-" not in slower.summary().split(";")[1]


def test_heads_png_explains_its_probe(monkeypatch, tmp_path) -> None:
    import qkv.viz.lens as vl
    from qkv.figures import HeadHistory

    figures = []
    monkeypatch.setattr(vl, "save_figure", lambda fig, path: figures.append(fig))
    s = torch.rand(3, 2, 2)
    vl.plot_head_history(HeadHistory([0, 5, 10], dict.fromkeys(("previous", "induction"), s),
                                     [3.3, 3.6, 3.8], [3.3, 3.5, 3.2]), tmp_path / "h.png")
    caption = " ".join(t.get_text() for t in figures[0].texts).replace("\n", " ")
    assert "repeated twice" in caption and "above that guess" in caption
    assert "not getting worse" in caption and "induction heads" in caption


# --------------------------------------------------------------------------- a busy machine


@pytest.fixture
def load(monkeypatch):
    """Set the one-minute load average os.getloadavg reports, on a 2-core machine."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def set_load(x: float) -> None:
        monkeypatch.setattr(os, "getloadavg", lambda: (x, x, x))

    return set_load


def test_busy_note_only_when_the_load_exceeds_the_cores(load) -> None:
    from qkv.training.probe import busy_note

    load(2.0)
    assert busy_note() is None
    load(5.5)
    assert busy_note("1-3 minutes") == ("the machine is busy (load 5.5 on 2 cores): this will take longer "
                                        "than 1-3 minutes")


def test_training_says_when_the_machine_is_busy(tiny_run, tmp_path, load) -> None:
    from helpers import TINY_TRAIN, flags

    argv = ["train", "--preset", "tiny", "--data", str(tiny_run.root / "text.txt"), "--no-progress",
            *flags({**TINY_TRAIN, "max_iters": 2, "eval_interval": 2})]
    load(6.0)
    rc, out, err = call([*argv, "--out_dir", str(tmp_path / "busy")])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("qkv train gpt: preset tiny")  # the announcement, then the note
    assert lines[1] == ("note: the machine is busy (load 6.0 on 2 cores): this will take longer than the "
                        "times the documentation gives (measured on quiet machines)")
    assert "busy" not in err
    load(0.5)
    rc, out, err = call([*argv, "--out_dir", str(tmp_path / "quiet")])
    assert rc == 0 and "machine is busy" not in out + err
    load(6.0)  # a user error on a busy machine is still one line on stderr
    rc, out, err = call([*argv, "--out_dir", str(tmp_path / "quiet")])
    assert "already holds a run" in assert_one_line_error(rc, err)


def test_prepare_says_when_the_machine_is_busy(monkeypatch, load) -> None:
    import qkv.generation.builds as builds
    from qkv.commands.prepare import prepare

    class Step:
        ready, seconds = True, 3.0

    class LM:
        context, model = 64, None

        def prepare(self, rows, tokens, on_stage):
            return [Step()]

    monkeypatch.setattr(builds, "status", lambda *a: type("S", (), {"ready": False})())
    lines: list[str] = []
    load(9.0)
    prepare("m", LM(), batch_rows=0, out=lines.append)
    assert sum(bool(re.search(r"busy \(load 9\.0 on 2 cores\).*~40 s above", x)) for x in lines) == 1
    lines.clear()
    load(1.0)
    prepare("m", LM(), batch_rows=0, out=lines.append)
    assert not any("busy" in x for x in lines)
