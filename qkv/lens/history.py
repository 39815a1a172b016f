"""Heads forming during training: the head scores of :mod:`qkv.lens.heads`, measured at every
evaluation of a run on one fixed probe, kept in the run's ``history.jsonl`` and drawn as
``heads.png`` beside the loss on repeated tokens.

Olsson et al. (2022) saw induction heads appear in a sudden "phase change", together with a
drop in the loss on the repeated half of a sequence; a run of ``qkv train gpt`` shows both on
a model trained in a minute. Rows: {"step", "previous", "first", "duplicate", "induction":
(L, H) lists, "loss_first", "loss_second"}.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.figures import HeadHistory
from qkv.lens.heads import HEAD_TYPES, NAMED_AT, repeated_tokens, score_model

FORMED = NAMED_AT  # a head type has formed once its best head is named (scores NAMED_AT on the probe)
COPYING = 0.5  # in-context copying: the repeat's loss this many nats below the first copy's
PROBE_SEED = 1234
NAMES = {"previous": "previous-token", "first": "first-token", "duplicate": "duplicate-token",
         "induction": "induction"}


def history_probe(vocab_size: int, context: int, avoid: tuple[int, ...] = (), repeat: int = 24,
                  batch: int = 8) -> Callable[[nn.Module], dict[str, Any]]:
    """The function a run calls at each evaluation: the model's head scores on the same
    ``batch`` sequences of ``repeat`` random tokens repeated twice, rounded for the file."""
    repeat = max(2, min(repeat, context // 2))
    tokens = repeated_tokens(vocab_size, repeat, batch, PROBE_SEED, avoid)

    def probe(model: nn.Module) -> dict[str, Any]:
        s = score_model(model, tokens)
        row: dict[str, Any] = {t: [[round(float(x), 4) for x in r] for r in v]
                               for t, v in s.by_type().items()}
        row.update(loss_first=round(s.loss_first, 4), loss_second=round(s.loss_second, 4))
        return row

    return probe


@dataclass
class History:
    """A run's recorded head scores: steps (N,), scores type -> (N, L, H), the two losses (N,)."""

    steps: list[int]
    scores: dict[str, torch.Tensor]
    loss_first: list[float]
    loss_second: list[float]

    def formed(self, threshold: float = FORMED) -> dict[str, int | None]:
        """Per type, the first recorded step whose best head reaches ``threshold`` (None: never)."""
        out: dict[str, int | None] = {}
        for t, s in self.scores.items():
            best = s.flatten(1).max(1).values
            hit = (best >= threshold).nonzero()
            out[t] = self.steps[int(hit[0])] if len(hit) else None
        return out

    def copying_from(self, margin: float = COPYING) -> int | None:
        """The first recorded step where the loss on the repeated half is ``margin`` nats below
        the loss on the first half (the model copies from context), or None."""
        for step, first, second in zip(self.steps, self.loss_first, self.loss_second, strict=True):
            if first - second >= margin:
                return step
        return None

    def best_head(self, head_type: str, index: int = -1) -> tuple[int, int, float]:
        """(layer, head, score) of the best head of ``head_type`` at row ``index``."""
        s = self.scores[head_type][index]
        i = int(s.argmax())
        return i // s.shape[1], i % s.shape[1], float(s.flatten()[i])

    def figure(self, title: str = "heads during training") -> HeadHistory:
        return HeadHistory(self.steps, self.scores, self.loss_first, self.loss_second, self.formed(), title,
                           self.copying_from())


def read_history(path: Path) -> History | None:
    """The history a run wrote (rows cut short by a crash skipped), or None without one."""
    path = Path(path)
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and all(t in row for t in HEAD_TYPES):
            rows.append(row)
    if not rows:
        return None
    return History([int(r["step"]) for r in rows],
                   {t: torch.tensor([r[t] for r in rows]) for t in HEAD_TYPES},
                   [float(r["loss_first"]) for r in rows], [float(r["loss_second"]) for r in rows])


def formed_lines(history: History) -> list[str]:
    """What formed and when, as lines for the end of training."""
    first, second = history.loss_first[-1], history.loss_second[-1]
    step = history.copying_from()
    lines = [f"in-context copying: loss {second:.2f} on the repeated half vs {first:.2f} on the first"
             + (f"; {COPYING} nats lower from step {step} on" if step is not None else "")]
    for t, step in history.formed().items():
        layer, head, score = history.best_head(t)
        best = f"best now: layer {layer} head {head}, {score:.2f}"
        name = NAMES[t]
        lines.append(f"{name} head formed at step {step} ({best})" if step is not None
                     else f"{name} heads: none reached {FORMED} ({best})")
    return [f"heads: {line}" for line in lines]
