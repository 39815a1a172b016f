"""One run's lifecycle, the same for every model family: prepare the data -> build the model ->
(resume) -> fit -> load the best weights -> evaluate -> ``eval.json`` and the family's plots.

``train_run(family, model_cfg, train_cfg, data_cfg)`` is what `qkv train FAMILY` calls, so a
run started from Python leaves the same run directory as one started from the command line.
What a family must provide is :class:`RunFamily`; the families themselves live in
:mod:`qkv.families` (one file each), above this layer, and are passed in.

Run directory (see :mod:`qkv.training.checkpoint` for the checkpoint files)::

    config.json      {"family", "qkv_version", "model", "train", "chosen", "data", ...family's own fields}
    metrics.jsonl    one line per log / evaluation step
    model.safetensors, last.safetensors, optimizer.pt
    eval.json        the family's evaluation + steps, best_val_loss, train_seconds
    *.png            loss curve and the family's attention plots

``train`` is what was asked (``"dtype": "auto"``, ``"compile": null`` stay so); ``chosen`` is
what the run used and why (:class:`qkv.training.speed.Chosen`, plus the preset)::

    "chosen": {"dtype": "bf16",
               "dtype_why": "bf16 autocast 2445.4 ms/step vs fp32 4579.4 (1.87x) here -> bf16",
               "compile": false, "compile_why": "compile off as asked", "step_ms": null,
               "optimizer": "muon", "muon_ns_dtype": "bf16", "device": "cpu",
               "cpu": {"model": "AMD EPYC", "isa": "AVX512", "native_bf16": true, "threads": 2,
                       "torch": "2.13.0+cpu"},
               "gpu": null, "compile_stopped_at": null,
               "preset": "tiny", "preset_overlay": null, "preset_why": ""}

(``qkv train --preset tiny`` on a shared 2-core Zen 4 VM, hence the slow steps; ``step_ms``:
the eager step the compile decision and the compile meter use, measured when compile is auto;
``preset_overlay``: "train_adamw" / "train_fp32_ns" when :func:`qkv.presets.preset_train`
applied one, with ``preset_why``.)

``--resume`` trains on with ``chosen``'s dtype, compile and optimiser (no probe) for every option
still ``auto`` in ``train``; an option given again explicitly wins. Muon's recorded bf16
Newton–Schulz is kept unless this machine would emulate bf16 (then fp32, ~100x faster there).
``chosen`` is rewritten when the run's choice changes (a resumed session, a compile that failed
or that the compile meter switched off), so the last session's settings are the ones on file.
A run written before this record (no ``chosen``) resumes by measuring again, as it did when it
started.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from qkv.figures import Picture
from qkv.presets import PresetChoice
from qkv.training import checkpoint as ckpt
from qkv.training.distributed import DistInfo, pick_device
from qkv.training.speed import Chosen
from qkv.training.trainer import BatchSource, TrainConfig, Trainer, TrainResult
from qkv.version import __version__
from qkv.viz import draw


@dataclass
class Prepared:
    """A family's data, ready to train on.

    model_cfg: the model config with the fields the data decides (vocabulary size, image size...).
    batches: what the Trainer draws (inputs, targets) from, for "train" and "val".
    state: the family's own pieces (tokenizer, vocabularies, splits), read by its evaluate/pictures.
    record: extra top-level fields of ``config.json`` (e.g. vocabularies); data_record: fields
    added to its ``data`` section (corpus hash, class names, normalisation).
    save: writes files beside ``config.json`` (a tokenizer), or None.
    items_per_row: what one batch row counts as, for the items/s rate (tokens of a GPT window).
    history: what to record about the model at each evaluation besides its loss (a GPT: every
        head's scores, :mod:`qkv.lens.heads`), appended with the step to ``history.jsonl``; or None.
    """

    model_cfg: Any
    batches: BatchSource
    state: Any = None
    record: dict[str, Any] = field(default_factory=dict)
    data_record: dict[str, Any] = field(default_factory=dict)
    save: Callable[[Path], None] | None = None
    items_per_row: int = 1
    history: Callable[[nn.Module], dict[str, Any]] | None = None


class RunFamily(Protocol):
    """What the lifecycle asks of a model family (:class:`qkv.families.base.Family` adds loading,
    decoding and attention for everything after training)."""

    name: str

    def prepare(self, model_cfg: Any, data_cfg: Any, resume_dir: Path | None,
                on_note: Callable[[str], None]) -> Prepared:
        """Load/generate the data, fit ``model_cfg`` to it; ``resume_dir``: the run being resumed
        (read its saved tokenizer, say)."""
        ...

    def build(self, model_cfg: Any) -> nn.Module:
        """A freshly initialised model (``model(inputs, targets).loss`` trains it)."""
        ...

    def check_resume(self, saved: dict[str, Any], prepared: Prepared) -> None:
        """ValueError if the data changed since the run in ``saved`` (its config.json) began."""
        ...

    def evaluate(self, model: nn.Module, prepared: Prepared) -> dict[str, Any]:
        """The family's held-out scores, as JSON-ready values."""
        ...

    def pictures(self, run: Run) -> dict[str, Picture]:
        """What the run's pictures show, by name: :mod:`qkv.figures` values that the lifecycle
        draws into the run directory (the family itself draws nothing)."""
        ...


@dataclass
class Run:
    """A finished run: the model with its best weights (eval mode), what was prepared, the loop's
    result, the evaluation (None on ranks other than the main one) and the files written."""

    family: str
    run_dir: Path
    model: nn.Module
    prepared: Prepared
    result: TrainResult
    eval: dict[str, Any] | None = None
    files: dict[str, Path] = field(default_factory=dict)


HISTORY = "history.jsonl"  # what the family records at each evaluation (a GPT: its heads' scores)
HISTORY_ROWS = 400  # at most about this many rows: longer runs record every k-th evaluation


def history_writer(run_dir: Path, history: Callable[[nn.Module], dict[str, Any]] | None,
                   train_cfg: TrainConfig) -> Callable[[int, nn.Module], None] | None:
    """What the Trainer calls after each evaluation: append the family's ``history`` record (with
    the step) to ``history.jsonl``, at every evaluation or every k-th one in long runs (the last
    always), so the file stays near HISTORY_ROWS rows."""
    if history is None:
        return None
    stride = -(-(train_cfg.max_iters // train_cfg.eval_interval + 1) // HISTORY_ROWS)  # ceil

    def write(step: int, model: nn.Module) -> None:
        if (step // train_cfg.eval_interval) % stride and step < train_cfg.max_iters:
            return
        ckpt.append_jsonl(run_dir / HISTORY, {"step": step, **history(model)})

    return write


def run_config(family: RunFamily, prepared: Prepared, train_cfg: TrainConfig, data_cfg: Any,
               chosen: dict[str, Any] | None = None) -> dict:
    cfg = prepared.model_cfg
    model = cfg.to_dict() if hasattr(cfg, "to_dict") else dataclasses.asdict(cfg)
    return {"family": family.name, "qkv_version": __version__, "model": model,
            "train": dataclasses.asdict(train_cfg), "chosen": chosen,
            "data": {**dataclasses.asdict(data_cfg), **prepared.data_record}, **prepared.record}


def chosen_record(chosen: Chosen, preset: PresetChoice | None, before: dict[str, Any] | None = None,
                  ) -> dict[str, Any]:
    """config.json's ``chosen``: what the trainer uses, and the preset (kept from ``before``,
    the record on file, when this session was not started from one: a resume)."""
    kept = {k: (before or {}).get(k) for k in ("preset", "preset_overlay", "preset_why")}
    return {**dataclasses.asdict(chosen), **(preset.record() if preset else kept)}


def _rewrite_chosen(run_dir: Path, chosen: Chosen, preset: PresetChoice | None = None) -> None:
    path = run_dir / "config.json"
    saved = ckpt.read_json(path)
    saved["chosen"] = chosen_record(chosen, preset, saved.get("chosen"))
    ckpt.write_json(path, saved)


def _recorded_choice(run_dir: Path) -> tuple[dict[str, Any], Chosen | None]:
    """(a resumed run's config.json, what it recorded it chose; None: written before the record)."""
    saved = ckpt.read_json(run_dir / "config.json")
    if not isinstance(saved, dict):
        raise ckpt.CheckpointError(f"{run_dir}/config.json is not a qkv run configuration")
    try:
        return saved, Chosen.read(saved)
    except (TypeError, ValueError) as e:
        raise ckpt.damaged(run_dir, e) from None


DOUBLE_QUOTE_SPECIALS = frozenset('"$`\\!')  # what a shell still reads inside "..."


def command_line(words: Sequence[str]) -> str:
    """A command to suggest, written as a person types it: :func:`shlex.join`, except that a
    word whose only trouble is a single quote goes in double quotes (``--prompt "ALL'S"`` where
    shlex writes ``'ALL'"'"'S'``). :func:`shlex.split` reads it back as ``words``."""
    import shlex

    def quote(word: str) -> str:
        plain = shlex.quote(word)
        if plain == word or "'" not in word or DOUBLE_QUOTE_SPECIALS & set(word):
            return plain
        return f'"{word}"'

    return " ".join(quote(w) for w in words)


def _stderr_note(text: str) -> None:
    print(f"qkv: note: {text}", file=sys.stderr, flush=True)


def train_run(
    family: RunFamily,
    model_cfg: Any,
    train_cfg: TrainConfig,
    data_cfg: Any,
    *,
    resume: bool = False,
    dist: DistInfo | None = None,
    on_log: Callable[[dict], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    evaluate: bool = True,
    preset: PresetChoice | None = None,
) -> Run:
    """Train (or, with ``resume``, continue) a run of ``family`` into ``train_cfg.out_dir``.

    On the main process the returned model holds the best weights; then (``evaluate``) the
    family's evaluation is written to ``eval.json`` and its plots beside it. ``preset``: the
    preset the configs came from, recorded in config.json (None: none, or a resume).
    """
    dist = dist or DistInfo(device=pick_device(train_cfg.device))
    run_dir = Path(train_cfg.out_dir)
    if not resume and (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                         "or choose another --out_dir")
    note = on_note or (_stderr_note if dist.is_main else (lambda _t: None))
    saved, recorded = _recorded_choice(run_dir) if resume else ({}, None)
    prepared = family.prepare(model_cfg, data_cfg, run_dir if resume else None, note)
    torch.manual_seed(train_cfg.seed)
    model = family.build(prepared.model_cfg)
    trainer = Trainer(model, train_cfg, prepared.batches, run_dir, dist, on_log,
                      tokens_per_batch=prepared.items_per_row, recorded=recorded,
                      on_choice=lambda chosen: _rewrite_chosen(run_dir, chosen),
                      on_eval=history_writer(run_dir, prepared.history, train_cfg))
    if resume:
        family.check_resume(saved, prepared)
        trainer.load_resume_state()
        if trainer.step >= train_cfg.max_iters and (run_dir / "eval.json").is_file():
            raise ValueError(f"{run_dir} has finished ({trainer.step} of {train_cfg.max_iters} steps, "
                             f"evaluated): nothing to resume, nothing changed; to train on, resume with a "
                             f"larger --max_iters (e.g. --max_iters {2 * trainer.step})")
        if dist.is_main:
            ckpt.remove_leftovers(run_dir)
            ckpt.rewind_metrics(run_dir / "metrics.jsonl", trainer.step, trainer.evaluates_first())
            ckpt.rewind_metrics(run_dir / HISTORY, trainer.step, trainer.evaluates_first(),
                                every_row_evaluates=True)
            _rewrite_chosen(run_dir, trainer.chosen(), preset)  # this session's settings are on file
    elif dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if prepared.save is not None:
            prepared.save(run_dir)
        ckpt.write_json(run_dir / "config.json", run_config(family, prepared, train_cfg, data_cfg,
                                                            chosen_record(trainer.chosen(), preset)))
    result = trainer.fit()
    run = Run(family.name, run_dir, model, prepared, result)
    if not dist.is_main:
        return run
    ckpt.load_weights(model, run_dir / "model.safetensors")  # the best weights are what a user gets
    model.eval()
    if evaluate:
        ev = family.evaluate(model, prepared)
        ev.update(steps=result.step, best_val_loss=result.best_val_loss,
                  train_seconds=round(result.seconds, 1))
        ckpt.write_json(run_dir / "eval.json", ev)
        run.eval = ev
        run.files = {name: draw(p.figure, run_dir / p.file) for name, p in family.pictures(run).items()}
    return run
