"""`qkv train [FAMILY] --preset NAME [--field value ...]`: one parser per registered family
(:mod:`qkv.families`), then the one run lifecycle (:func:`qkv.training.run.train_run`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from qkv.commands.options import add_config_options, overrides
from qkv.families import Family, family_names, get_family
from qkv.presets import PRESET_RESULTS, PresetChoice, preset_overlay, preset_train
from qkv.training.trainer import TrainConfig


def add_train_parser(sub) -> None:
    names = family_names()
    p = sub.add_parser(
        "train",
        help=f"train a model: {', '.join(names)} (gpt is the default: Shakespeare in minutes on a CPU)",
        description="Train a model of one family: `qkv train gpt ...` (the default when no family "
        f"is named), or `qkv train {' | '.join(names[1:])} ...`. `qkv train FAMILY --help` "
        "lists every option of that family: every config field can be overridden; presets are "
        "in `qkv/presets.py`. Under torchrun it trains with DDP.",
    )
    fam = p.add_subparsers(dest="family", metavar="FAMILY")
    for name in names:
        f = get_family(name)
        measured = PRESET_RESULTS.get(name, {})
        epilog = " ".join(f"Preset {k}: {v}" for k, v in measured.items()) or None
        q = fam.add_parser(name, help=f.help, description=f.description + " The defaults shown are "
                           "the config classes' own, which the preset changes.", epilog=epilog,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        by_task = "".join(f"; with --task {t}, {p}" for t, p in f.task_presets.items())
        q.add_argument("--preset", default=None,
                       help=f"named config: {', '.join(f.presets)} (default: {f.default_preset}{by_task})")
        q.add_argument("--resume", metavar="RUN_DIR", default=None,
                       help="continue a run exactly where it stopped (step, optimiser, RNG, data position)")
        f.add_options(q)
        q.add_argument("--no-progress", action="store_true",
                       help="plain log lines instead of a progress bar")
        add_config_options(q, f.data_config, "data")
        add_config_options(q, f.model_config, f"model ({f.model_config.__name__})", skip=f.from_data)
        add_config_options(q, TrainConfig, "training (TrainConfig)")
        q.set_defaults(func=cmd_train)
    p.set_defaults(func=cmd_train, family=None)


def default_family(argv: list[str]) -> list[str]:
    """`qkv train [options]` means `qkv train gpt [options]`."""
    if argv and argv[0] == "train" and (len(argv) == 1 or argv[1] not in (*family_names(), "-h", "--help")):
        return ["train", "gpt", *argv[1:]]
    return argv


def default_run_dir(family: str, preset: str) -> str:
    return f"runs/{family}-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def _resumed_configs(f: Family, args: argparse.Namespace, train_over: dict,
                     ) -> tuple[Any, TrainConfig, Any, PresetChoice | None]:
    from qkv.training import checkpoint as ckpt

    if not Path(args.resume).is_dir():
        what = "not a directory" if Path(args.resume).exists() else "no such folder"
        raise ckpt.CheckpointError(f"--resume {args.resume}: {what}; give the run directory that "
                                   "`qkv train` wrote")
    saved = ckpt.read_json(Path(args.resume) / "config.json")
    if not isinstance(saved, dict) or not all(k in saved for k in ("model", "train", "data")):
        raise ckpt.CheckpointError(f"{args.resume}/config.json is not a qkv run configuration")
    if saved.get("family") != f.name:
        raise ckpt.CheckpointError(f"{args.resume} is a {saved.get('family')} run; resume it with "
                                   f"`qkv train {saved.get('family')} --resume {args.resume}`")
    given = {**overrides(args, f.model_config), **overrides(args, f.data_config)}
    if given:
        raise ValueError("--resume keeps the run's model and data settings; "
                         f"only training fields can change (got {', '.join(given)})")
    fields = {x.name for x in dataclasses.fields(f.data_config)}
    data = {k: v for k, v in saved["data"].items() if k in fields}
    rec = saved.get("chosen") if isinstance(saved.get("chosen"), dict) else {}
    preset = PresetChoice(rec["preset"], rec.get("preset_overlay"), rec.get("preset_why") or "") \
        if isinstance(rec.get("preset"), str) else None  # runs from Python, or before the record
    try:
        train = TrainConfig(**{**saved["train"], **train_over, "out_dir": args.resume})
        return f.model_config(**saved["model"]), train, f.data_config(**data), preset
    except TypeError as e:  # unknown or missing fields: written by another qkv version
        raise ckpt.CheckpointError(f"{args.resume}/config.json does not fit this version of "
                                   f"qkv ({e})") from None


def configs(f: Family, args: argparse.Namespace) -> tuple[Any, TrainConfig, Any, PresetChoice | None]:
    """(model, training, data) configs and the preset with the overlay that applied: the preset,
    then the options given; or, with --resume, the run's own (only training fields may change;
    the preset is in the run's record)."""
    from qkv.presets import get_preset
    from qkv.training.optim import fp32_newton_schulz, resolve_optimizer

    train_over = overrides(args, TrainConfig)
    if args.resume:
        return _resumed_configs(f, args, train_over)
    name = args.preset or f.preset_for(overrides(args, f.data_config))
    preset = get_preset(f.name, name, f.presets)
    model = f.model_config(**f.draft_model({**preset.get("model", {}), **overrides(args, f.model_config)}))
    merged = {**preset.get("train", {}), **train_over}
    asked = merged.get("optimizer", "auto")
    kind, fp32_ns = resolve_optimizer(asked), fp32_newton_schulz(merged.get("device", "auto"))
    train = {**preset_train(preset, kind, fp32_ns), **train_over}
    train.setdefault("out_dir", default_run_dir(f.name, name))  # a new folder per run
    data = f.data_config(**{**preset.get("data", {}), **overrides(args, f.data_config)})
    overlay, why = preset_overlay(preset, kind, fp32_ns)
    if why and asked == "auto" and kind == "adamw":
        why += " (--optimizer auto: this torch has no Muon)"
    return model, TrainConfig(**train), data, PresetChoice(name, overlay, why)


def _preset_words(preset: PresetChoice | None, resumed: bool) -> str:
    """'cpu + train_fp32_ns (why)' for the first line; a resume says so."""
    if preset is None:
        return "(resumed)" if resumed else "(none)"
    words = preset.name + (f" + {preset.overlay} ({preset.why})" if preset.overlay else "")
    return words + (" (resumed)" if resumed else "")


INPUT_FIELDS = ("data", "dataset")  # data config fields that may name a file or folder to read


def check_inputs(data_cfg: Any) -> None:
    """ValueError (one line) when the data config names a file or folder that is not there:
    checked before anything is announced or created. A field whose default is None (``--data``
    of gpt and seq2seq) holds a path when set; one with a named default (``shapes``,
    ``fashion-mnist``) holds a path when the value has a path separator in it."""
    for fld in dataclasses.fields(data_cfg):
        value = getattr(data_cfg, fld.name)
        if fld.name not in INPUT_FIELDS or not isinstance(value, str) or value == fld.default:
            continue
        path, is_file = Path(value), fld.default is None
        if not (is_file or "/" in value or os.sep in value):
            continue  # a name (digits, mnist): the family reads it
        if not path.exists():
            what = "file" if is_file else "folder"
            raise ValueError(f"--{fld.name} {value}: no such {what}; give one that exists, or leave "
                             f"--{fld.name} out for the built-in data")
        if is_file and path.is_dir():
            raise ValueError(f"--{fld.name} {value} is a directory, not a file; give the file to read")


def cmd_train(args: argparse.Namespace) -> int:
    from qkv.commands.progress import Display
    from qkv.training.distributed import barrier, cleanup, init_distributed
    from qkv.training.probe import busy_note
    from qkv.training.run import train_run

    f = get_family(args.family or "gpt")
    model_cfg, train_cfg, data_cfg, preset = configs(f, args)
    check_inputs(data_cfg)  # before the run directory is announced
    dist = init_distributed(train_cfg.device)  # config.json keeps the preference, not cuda:0
    if dist.is_main:
        print(f"qkv train {f.name}: preset {_preset_words(preset, bool(args.resume))}, "
              f"{f.headline(model_cfg, data_cfg)}, {train_cfg.max_iters} steps on {dist.device}"
              + (f" x {dist.world_size} processes" if dist.enabled else "") + f" -> {train_cfg.out_dir}",
              flush=True)
        if busy := busy_note():  # beside the announcement: stderr keeps one line for an error
            print(f"note: {busy}", flush=True)
    display = Display(train_cfg.max_iters, args.no_progress or not sys.stdout.isatty(), f.unit) \
        if dist.is_main else None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*TF32.*")
            run = train_run(f, model_cfg, train_cfg, data_cfg, resume=bool(args.resume), dist=dist,
                            on_log=display, preset=preset)
        barrier(dist)  # finished on every rank: only now tear down (not on an error, which could hang)
    finally:
        if display is not None:
            display.close()
        cleanup(dist)
    if dist.is_main:
        print(f.summary(run, args))
    return 0
