"""Checks a model config runs in ``__post_init__``: one message format for every config.

A ``Literal[...]`` field is checked against its own annotation (the same choices the command
line offers), so adding a choice is one edit; a numeric field against its range.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal


@functools.cache
def _choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The choices of every ``Literal`` field of dataclass ``cls``, by field name."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


def _one_of(choices: tuple[Any, ...]) -> str:
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_choices(cfg: Any) -> None:
    """ValueError naming the field and its choices if a ``Literal`` field of dataclass ``cfg``
    holds another value (e.g. ``attention must be soft, hard, hard-exact or uniform, got 'x'``)."""
    for name, choices in _choices(type(cfg)).items():
        value = getattr(cfg, name)
        if value not in choices:
            raise ValueError(f"{name} must be {_one_of(choices)}, got {value!r}")


def check_range(cfg: Any, name: str, low: float | None = None, high: float | None = None, *,
                high_open: bool = False) -> None:
    """ValueError unless ``low <= cfg.name <= high`` (``< high`` with ``high_open``); a bound of
    None is no bound."""
    value = getattr(cfg, name)
    too_low = low is not None and value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high):
        return
    if high is None:
        want = f">= {low}"
    elif low is None:
        want = f"< {high}" if high_open else f"<= {high}"
    else:
        want = f"in [{low}, {high}{')' if high_open else ']'}"
    raise ValueError(f"{name} must be {want}, got {value}")
