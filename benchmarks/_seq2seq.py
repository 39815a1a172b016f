"""One seq2seq model trained and scored the way `qkv train seq2seq` does it, shared by
``seq2seq_copy.py`` and ``length_extrapolation.py`` (not a benchmark itself)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from qkv.families.seq2seq import Seq2SeqDataConfig, Seq2SeqFamily, Seq2SeqOptions, evaluate
from qkv.training.run import train_run
from qkv.training.trainer import TrainConfig


def train_and_score(model_cfg: Seq2SeqOptions, train: dict[str, Any], data: Seq2SeqDataConfig,
                    out_dir: Path) -> dict[str, Any]:
    """Train ``model_cfg`` with the ``train`` settings on ``data`` (by ``train_run`` of the seq2seq
    family, into ``out_dir``), then score it: exact match and per-position accuracy on the test
    split (the training lengths) and on the held-out split (longer strings), by source length."""
    t0 = time.perf_counter()
    run = train_run(Seq2SeqFamily(), model_cfg, TrainConfig(**{**train, "out_dir": str(out_dir)}), data,
                    evaluate=False)
    seconds = time.perf_counter() - t0
    st = run.prepared.state
    ev = evaluate(run.model, run.prepared.model_cfg.model_config(), st.src, st.tgt, st.pairs)
    test, longer = ev["test"], ev["heldout"]
    return {"params": sum(q.numel() for q in run.model.parameters()), "steps": run.result.step,
            "train_s": round(seconds, 1), "test_exact": test["exact"],
            "test_token_accuracy": test["token_accuracy"], "longer_exact": longer["exact"],
            "longer_token_accuracy": longer["token_accuracy"],
            "by_length": {**test["by_length"], **longer["by_length"]},
            "wrong_examples": test["examples_wrong"][:3]}
