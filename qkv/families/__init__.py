"""The model families qkv trains, one file each, and the registry the CLI, ``viz``, ``serve`` and
``qkv attend`` read. A family is an object implementing :class:`qkv.families.base.Family`.

    from qkv.families import get_family
    gpt = get_family("gpt")
    run = train_run(gpt, GPTConfig(...), TrainConfig(...), gpt.data_config())   # qkv.training.run
    lm = gpt.load(run.run_dir)                                  # a CausalLM (qkv.pipelines)

A new family: write ``qkv/families/NAME.py`` (a :class:`~qkv.families.base.FamilyBase` subclass;
``captioner.py`` is the fullest example) and add its line to ``BUILTIN`` below (or call
:func:`register` from your own code).
"""

from __future__ import annotations

import importlib

from qkv.families.base import Family, FamilyBase
from qkv.pipelines import Kind, Loaded

BUILTIN: dict[str, str] = {  # name -> "module:class"; imported on first use
    "gpt": "qkv.families.gpt:GPTFamily",
    "vit": "qkv.families.vit:ViTFamily",
    "seq2seq": "qkv.families.seq2seq:Seq2SeqFamily",
    "captioner": "qkv.families.captioner:CaptionerFamily",
}
_registered: dict[str, Family] = {}


def register(family: Family) -> None:
    """Add (or replace) a family under its ``name``."""
    _registered[family.name] = family


def family_names() -> tuple[str, ...]:
    """Every family's name, built-in ones first (nothing is imported)."""
    return (*BUILTIN, *(n for n in _registered if n not in BUILTIN))


def get_family(name: str) -> Family:
    """The family ``name``; ValueError naming the known ones."""
    if name not in _registered:
        if name not in BUILTIN:
            raise ValueError(f"unknown model family {name!r}; choose from: {', '.join(family_names())}")
        module, cls = BUILTIN[name].split(":")
        _registered[name] = getattr(importlib.import_module(module), cls)()
    return _registered[name]


__all__ = ["BUILTIN", "Family", "FamilyBase", "Kind", "Loaded", "family_names", "get_family", "register"]
