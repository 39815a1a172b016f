"""Run directories and checkpoints: atomic writes, no pickle from files.

A run directory (DESIGN.md) holds:
    config.json        everything needed to rebuild the model and tokenizer (+ training config)
    model.safetensors  the best weights so far (by validation loss): what ``qkv generate`` loads
    checkpoint/        what ``--resume`` needs, one step's set:
      last.safetensors   the latest weights, and
      optimizer.pt       optimiser state, step, best loss, RNG states
    tokenizer.json     the tokenizer
    metrics.jsonl      one JSON object per logged step / evaluation

Every file is written to a temporary name in the same directory and renamed into place
(``os.replace`` is atomic on POSIX), so a crash or Ctrl-C mid-write never leaves a truncated
file where a good one was. The resume set is a transaction: a step's two files are written
into ``.checkpoint.new/``, which is renamed ``.checkpoint.ready/`` once complete and then
swapped in for ``checkpoint/`` by two renames; whatever instant a crash hits, one complete set
is found (:func:`resume_dir`), never last weights beside another step's optimiser. Both files
carry the same save id, checked on resume. The best weights are written before the best loss
that names them. ``optimizer.pt`` is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.fileio import atomic_write, fsync_dir

RESUME_DIR = "checkpoint"
_NEW, _READY, _OLD = ".checkpoint.new", ".checkpoint.ready", ".checkpoint.old"
RESUME_FILES = ("last.safetensors", "optimizer.pt")


class CheckpointError(Exception):
    """A run directory that cannot be loaded; the message says why and what to do."""


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8"))


def read_run_config(run_dir: Path, family: str, kind: str) -> dict:
    """``run_dir/config.json`` of a run of ``family``; CheckpointError naming what the folder is
    instead (a missing folder, a run of another family, not a qkv run). ``kind`` names the
    model for the message ("an image classifier")."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a directory; pass a run directory from "
                              f"`qkv train {family}`")
    cfg = read_json(run_dir / "config.json")
    found = cfg.get("family") if isinstance(cfg, dict) else None
    if found != family:
        what = f"a {found} run" if isinstance(found, str) else "not a qkv run configuration"
        raise CheckpointError(f"{run_dir} is {what}, not {kind}; pass a run directory from "
                              f"`qkv train {family}`")
    return cfg


def damaged(run_dir: Path, error: Exception) -> CheckpointError:
    """The error for a config.json whose fields do not build the run's model or vocabulary."""
    return CheckpointError(f"{run_dir}/config.json is damaged ({type(error).__name__}: {error})")


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: is {Path(path).parent} a qkv run directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the run directory is damaged") from None


def save_weights(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Weights as safetensors (tied tensors stored once), atomically; ``metadata`` goes in the
    file's header (strings only)."""
    from safetensors.torch import save_model

    atomic_write(path, lambda p: save_model(model, str(p), metadata=metadata))


def weights_metadata(path: Path) -> dict[str, str]:
    """The header metadata of a safetensors file ({} if none); CheckpointError if unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({(str(e).splitlines() or [type(e).__name__])[0][:200]}); "
                              "the file is damaged") from None


def load_weights(model: nn.Module, path: Path) -> None:
    """Load safetensors weights into ``model``; a damaged or mismatched file -> CheckpointError."""
    from safetensors.torch import load_model

    if not Path(path).is_file():
        raise CheckpointError(f"{path} is missing: is {Path(path).parent} a qkv run directory?")
    try:
        load_model(model, str(path), strict=True)
    except Exception as e:  # safetensors raises several types for truncated/mismatched files
        raise CheckpointError(
            f"cannot load {path}: {(str(e).splitlines() or [type(e).__name__])[0][:200]} "
            "(the file is truncated or from a different model config)"
        ) from None


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Optimiser state + counters + RNG states (tensors, numbers, dicts only), atomically."""
    atomic_write(path, lambda p: torch.save(state, p))


def load_state(path: Path) -> dict[str, Any]:
    """Read what :func:`save_state` wrote, without unpickling arbitrary objects."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: this run cannot be resumed") from None
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({(str(e).splitlines() or [type(e).__name__])[0][:200]}); "
                              "the resume state is damaged") from None


def save_resume(run_dir: Path, model: nn.Module, state: dict[str, Any]) -> None:
    """Publish one step's resume set (``checkpoint/last.safetensors`` + ``optimizer.pt``, both
    tagged with one save id) as a transaction; see the module docstring. ``state["step"]`` is
    the step it resumes at."""
    run_dir = Path(run_dir)
    resume_dir(run_dir, required=False)  # finish a swap a crash interrupted, before touching it
    new, ready, cur, old = run_dir / _NEW, run_dir / _READY, run_dir / RESUME_DIR, run_dir / _OLD
    for stale in (new, ready, old):
        shutil.rmtree(stale, ignore_errors=True)
    new.mkdir(parents=True)
    save_id = uuid.uuid4().hex
    try:
        save_weights(model, new / "last.safetensors", {"step": str(state["step"]), "save_id": save_id})
        save_state(new / "optimizer.pt", {**state, "save_id": save_id})
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)  # a full disk: give back what the half set took
        raise
    os.rename(new, ready)  # complete from here on
    fsync_dir(run_dir)
    if cur.is_dir():
        os.rename(cur, old)
    os.rename(ready, cur)
    fsync_dir(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    for name in RESUME_FILES:  # the layout of runs before the transaction: loose files on top
        (run_dir / name).unlink(missing_ok=True)


def resume_dir(run_dir: Path, required: bool = True) -> Path | None:
    """The folder of the run's last complete resume set: ``checkpoint/``, or, after a crash
    mid-swap, the complete set waiting beside it (moved into place), or the run folder itself
    for runs written before the transaction. None (``required=False``) or CheckpointError when
    there is none."""
    run_dir = Path(run_dir)
    cur = run_dir / RESUME_DIR
    if not cur.is_dir():
        for waiting in (run_dir / _READY, run_dir / _OLD):  # ready is newer than old
            if waiting.is_dir():
                os.rename(waiting, cur)
                fsync_dir(run_dir)
                break
    if cur.is_dir():
        return cur
    if all((run_dir / name).is_file() for name in RESUME_FILES):
        return run_dir
    if required:
        raise CheckpointError(f"{run_dir} has no resume checkpoint ({RESUME_DIR}/): it stopped before "
                              f"its first save; delete {run_dir} and start the run again")
    return None


def remove_leftovers(run_dir: Path) -> list[str]:
    """Delete what a killed process left half-written in the run folder (temporary files of
    atomic writes, a resume set never completed); the names deleted."""
    run_dir = Path(run_dir)
    gone = []
    for p in [*run_dir.glob(".*.tmp"), run_dir / _NEW]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file():
            p.unlink(missing_ok=True)
        else:
            continue
        gone.append(p.name)
    return gone


def load_resume(run_dir: Path, model: nn.Module) -> dict[str, Any]:
    """Load the last complete resume set into ``model``; its state (optimiser, step, RNG...).
    CheckpointError if the two files are not one save's (a set mixed by hand)."""
    folder = resume_dir(run_dir)
    load_weights(model, folder / "last.safetensors")
    state = load_state(folder / "optimizer.pt")
    meta = weights_metadata(folder / "last.safetensors")
    if meta.get("save_id") != state.get("save_id"):
        raise CheckpointError(f"{folder}: last.safetensors (step {meta.get('step', '?')}) and optimizer.pt "
                              f"(step {state.get('step', '?')}) are not from the same save; the run "
                              "cannot resume exactly: start it again")
    return state


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (metrics are append-only, so no temp file is needed). Non-finite
    numbers become null: NaN and Infinity are not JSON."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(clean, allow_nan=False) + "\n")


def rewind_metrics(path: Path, step: int, evaluates_first: bool, every_row_evaluates: bool = False) -> None:
    """Drop the rows a resumed run will write again: rows after ``step`` (logged after the
    checkpoint it resumes from), the evaluation row at ``step`` itself if the resumed run
    ``evaluates_first``, and a last line cut short by a crash. Written atomically; a missing
    file is left missing. ``every_row_evaluates``: a file written only at evaluations (the
    history), whose rows have no ``val_loss``."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a crash mid-append
        s = row.get("step") if isinstance(row, dict) else None
        at_eval = every_row_evaluates or "val_loss" in row
        if isinstance(s, int) and (s > step or (s == step and evaluates_first and at_eval)):
            continue
        keep.append(line)
    text = "".join(f"{line}\n" for line in keep)
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
