"""What a model family is: the :class:`Family` protocol every family file implements, and the
defaults most of them share (:class:`FamilyBase`).

A family ties a model of :mod:`qkv.models` to its data, its evaluation and its pictures:

    training     prepare -> build -> check_resume -> evaluate -> pictures  (qkv.training.run)
    the CLI      help, description, presets, headline, summary             (qkv train FAMILY)
    afterwards   load -> a model ready to use (qkv.pipelines)              (qkv.load, every command)

A family says what its pictures show (:mod:`qkv.figures`, values) and never draws, prints or
reads what a user typed: everything after training goes through the typed value ``load``
returns (its ``kind``, shape, inference and attention), opened by :mod:`qkv.inference`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from torch import nn

from qkv.figures import LossCurve, Picture
from qkv.pipelines import Kind, Loaded
from qkv.training.run import Prepared, Run, RunFamily


class Family(RunFamily, Protocol):
    """One model family, end to end. ``name`` is the ``family`` of its runs' config.json."""

    name: str
    kind: Kind
    unit: str  # what one batch row is, for the progress bar: "tok", "img", "pair"
    help: str  # one line for `qkv train --help`
    description: str  # the paragraph of `qkv train FAMILY --help`
    model_config: type  # its model's config dataclass
    data_config: type  # its data's config dataclass
    from_data: tuple[str, ...]  # model fields set from the data, not options
    default_preset: str
    task_presets: dict[str, str]  # data task -> the preset it brings when none is named
    presets: dict[str, dict[str, dict[str, Any]]]  # name -> {"model": .., "train": .., "data": ..}

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        """Options of `qkv train FAMILY` beyond the config fields (none for most)."""
        ...

    def preset_for(self, data_args: dict[str, Any]) -> str:
        """The preset when none is named, given the data options asked for: the asked ``task``'s
        in :attr:`task_presets` (`qkv train seq2seq --task copy` means copy-cpu), else the default."""
        ...

    def draft_model(self, model_args: dict[str, Any]) -> dict[str, Any]:
        """Model arguments valid before the data is seen (fields the data sets get placeholders)."""
        ...

    def headline(self, model_cfg: Any, data_cfg: Any) -> str:
        """The run's shape in a few words, for the first line of `qkv train`."""
        ...

    def summary(self, run: Run, args: argparse.Namespace | None = None) -> str:
        """What `qkv train` prints when the run is done (scores, files, what to try next)."""
        ...

    def load(self, run_dir: Path, device: str = "cpu") -> Loaded:
        """A trained run as a model ready to use (best weights, eval mode; its ``kind`` is the
        family's); CheckpointError (one line) for a damaged one."""
        ...


class FamilyBase:
    """Defaults: presets from :mod:`qkv.presets`, no extra options, placeholders-free configs,
    a loss plot as the only picture."""

    name: ClassVar[str]
    kind: ClassVar[Kind]
    task_presets: ClassVar[dict[str, str]] = {}
    unit: ClassVar[str] = "item"
    from_data: ClassVar[tuple[str, ...]] = ()

    @property
    def presets(self) -> dict[str, dict[str, dict[str, Any]]]:
        from qkv.presets import PRESETS

        return PRESETS.get(self.name, {})

    def preset_for(self, data_args: dict[str, Any]) -> str:
        return self.task_presets.get(data_args.get("task"), self.default_preset)  # type: ignore[attr-defined]

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        return None

    def draft_model(self, model_args: dict[str, Any]) -> dict[str, Any]:
        return model_args

    def check_resume(self, saved: dict[str, Any], prepared: Prepared) -> None:
        return None

    def pictures(self, run: Run) -> dict[str, Picture]:
        return {"loss plot": loss_curve(run)}

    def read_run(self, run_dir: Path, what: str, parse: Callable[[dict], tuple[Any, Any]],
                 device: str = "cpu") -> tuple[dict, nn.Module, Any]:
        """(config.json, the model with the run's best weights on ``device`` in eval mode, the rest
        ``parse`` read). ``parse(config) -> (model config, anything else: vocabularies...)``; its
        TypeError/ValueError/KeyError, like the model's, mean a damaged config.json (one line).
        ``what`` names the model for a folder of another kind ("an image classifier")."""
        from qkv.training import checkpoint as ckpt

        run_dir = Path(run_dir)
        saved = ckpt.read_run_config(run_dir, self.name, what)
        try:
            model_cfg, rest = parse(saved)
            model = self.build(model_cfg)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ckpt.damaged(run_dir, e) from None
        ckpt.load_weights(model, run_dir / "model.safetensors")
        return saved, model.to(device).eval(), rest


def loss_curve(run: Run) -> Picture:
    """The run's loss curve, as ``loss.png``."""
    return Picture("loss.png", LossCurve(run.run_dir / "metrics.jsonl"))


def trained_line(run: Run, unit: str | None) -> str:
    """'trained 300 steps in 12 s (4,000 tok/s); best val loss 1.2345; 0.80M parameters'."""
    r = run.result
    n = sum(p.numel() for p in run.model.parameters())
    rate = f" ({r.tokens_per_s:,.0f} {unit}/s)" if unit else ""
    return (f"trained {r.step} steps in {r.seconds:.0f} s{rate}; best val loss {r.best_val_loss:.4f}; "
            f"{n / 1e6:.2f}M parameters")


def files_lines(run: Run, first: dict[str, Path] | None = None) -> str:
    """The run directory and the files in it worth opening, one per line."""
    items = {**(first or {}), **run.files}
    return f"run directory: {run.run_dir}\n" + "".join(f"  {k}: {v}\n" for k, v in items.items())
