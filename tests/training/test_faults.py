"""Fault injection: `qkv train` killed with SIGKILL (no handler runs, no finally, nothing
flushed) at chosen instants, then `--resume`d, again and again in one chain of crashes.

Every time the resume either continues exactly (the finished run's losses, weights and
evaluation equal an uninterrupted run's to 1e-6) or refuses with one line; never a silent
inexact resume, never a lost best checkpoint. Each process runs `qkv.cli.main` in a fresh
interpreter with one hook patched in (tests/training/_fault_driver.py): it kills the process
half-way through the n-th write of a file, between the two renames of a checkpoint swap, in
the middle of a training step, half-way through a metrics line, or during an evaluation.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import metrics
from safetensors.torch import load_file

DRIVER = Path(__file__).with_name("_fault_driver.py")
TEXT = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)) + "\n"
MAX_ITERS, EVAL_EVERY = 12, 4  # checkpoints at steps 0, 4, 8 and 12


def run(run_dir: Path, text: Path, kill: dict | None = None,
        resume: bool = False) -> subprocess.CompletedProcess:
    argv = (["train", "--resume", str(run_dir)] if resume else
            ["train", "--preset", "tiny", "--data", str(text), "--out_dir", str(run_dir),
             "--max_iters", str(MAX_ITERS), "--eval_interval", str(EVAL_EVERY), "--optimizer", "adamw"])
    argv += ["--device", "cpu", "--dtype", "fp32", "--compile", "false", "--no-progress",
             "--sample-tokens", "8"]
    env = {**os.environ, "QKV_CACHE_DIR": str(text.parent / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(DRIVER), json.dumps(kill or {}), *argv], env=env,
                          capture_output=True, text=True, timeout=300)


def killed(p: subprocess.CompletedProcess) -> bool:
    return p.returncode == -9


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the text, an uninterrupted run of it)."""
    root = tmp_path_factory.mktemp("faults")
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    p = run(root / "reference", text)
    assert p.returncode == 0, p.stderr
    return text, root / "reference"


def assert_same_run(run_dir: Path, ref: Path) -> None:
    """Losses of every step, the best weights, the last checkpoint and eval.json: as if the
    run had never stopped (1e-6); metrics.jsonl has the same rows in the same order."""
    got, want = metrics(run_dir), metrics(ref)
    assert [(r["step"], "val_loss" in r) for r in got] == [(r["step"], "val_loss" in r) for r in want]
    for a, b in zip(got, want, strict=True):
        for key in ("train_loss", "val_loss"):
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (a, b)
    for name in ("model.safetensors", "checkpoint/last.safetensors"):
        x, y = load_file(str(run_dir / name)), load_file(str(ref / name))
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=1e-6, msg=f"{name}: {k}")
    ev, ev_ref = (json.loads((d / "eval.json").read_text()) for d in (run_dir, ref))
    assert ev["val_loss"] == pytest.approx(ev_ref["val_loss"], rel=0, abs=1e-6)
    assert ev["steps"] == ev_ref["steps"] == MAX_ITERS
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # no half-done folders
    from qkv.lens.history import read_history

    hist, hist_ref = (read_history(d / "history.jsonl") for d in (run_dir, ref))
    assert hist.steps == hist_ref.steps  # one row of head scores per evaluation, none twice
    for t in hist.scores:
        torch.testing.assert_close(hist.scores[t], hist_ref.scores[t], rtol=0, atol=2e-4, msg=t)


def test_killed_before_the_first_checkpoint_refuses_in_one_line(reference, tmp_path: Path) -> None:
    text, _ = reference
    p = run(tmp_path / "run", text, {"kind": "write", "file": "last.safetensors", "nth": 1})
    assert killed(p), p.stderr
    before = {q: q.read_bytes() for q in (tmp_path / "run").rglob("*") if q.is_file()}
    again = run(tmp_path / "run", text, resume=True)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1 and "stopped before its first save" in lines[0]
    assert "Traceback" not in again.stderr
    assert {q: q.read_bytes() for q in (tmp_path / "run").rglob("*") if q.is_file()} == before


def test_a_chain_of_kills_resumes_exactly(reference, tmp_path: Path) -> None:
    """Seven kills in a row, one of each kind of moment (the step and the metrics line drawn
    with a fixed seed), each followed by a --resume that is killed in turn; the eighth
    process finishes the run."""
    text, ref = reference
    rng = random.Random(17)
    kills = [  # (checkpoints at 0, 4, 8, 12; what each kill leaves for the next resume)
        {"kind": "step", "nth": rng.randint(5, 7)},  # mid-step 6-8 (updated, not counted): resumes at 4
        {"kind": "append", "nth": rng.randint(1, 3)},  # half a metrics line of step 5-7: at 4
        {"kind": "write", "file": "model.safetensors", "nth": 1},  # half of step 8's best weights: at 4
        {"kind": "write", "file": "optimizer.pt", "nth": 1},  # step 8's best weights whole, its set
        # half-written: at 4 (and step 8 is best again, rewritten the same)
        {"kind": "rename", "nth": 1},  # step 8's set complete, the old one moved aside: at 8
        {"kind": "evaluate", "nth": 1},  # in step 12's validation pass: at 8
        {"kind": "final-eval", "nth": 1},  # trained to 12, killed scoring the test set: no eval.json
    ]
    run_dir = tmp_path / "run"
    for i, kill in enumerate(kills):
        p = run(run_dir, text, kill, resume=i > 0)
        assert killed(p), f"kill {kill} never happened: rc {p.returncode}\n{p.stderr[-2000:]}"
    p = run(run_dir, text, resume=True)
    assert p.returncode == 0, p.stderr
    assert_same_run(run_dir, ref)


def test_the_best_checkpoint_survives_a_kill_while_it_is_replaced(reference, tmp_path: Path) -> None:
    """Killed half-way through writing a new model.safetensors: the previous best weights are
    still there, whole, and load."""
    text, _ = reference
    run_dir = tmp_path / "run"
    p = run(run_dir, text, {"kind": "write", "file": "model.safetensors", "nth": 2})
    assert killed(p), p.stderr
    weights = load_file(str(run_dir / "model.safetensors"))  # the step-0 best, complete
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
