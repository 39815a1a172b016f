"""Run directories and checkpoints: atomic writes, no pickle from files.

A run directory (DESIGN.md) holds:
    config.json        everything needed to rebuild the model and tokenizer (+ training config)
    model.safetensors  the best weights so far (by validation loss): what ``qkv generate`` loads
    last.safetensors   the latest weights, with
    optimizer.pt       optimiser state, step, RNG states: what ``--resume`` needs
    tokenizer.json     the tokenizer
    metrics.jsonl      one JSON object per logged step / evaluation

Every file is written to a temporary name in the same directory and renamed into place
(``os.replace`` is atomic on POSIX), so a crash or Ctrl-C mid-write never leaves a truncated
file where a good one was. ``optimizer.pt`` is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.fileio import atomic_write


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


def save_weights(model: nn.Module, path: Path) -> None:
    """Weights as safetensors (tied tensors stored once), atomically."""
    from safetensors.torch import save_model

    atomic_write(path, lambda p: save_model(model, str(p)))


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


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (metrics are append-only, so no temp file is needed)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
