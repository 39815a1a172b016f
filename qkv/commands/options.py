"""Command-line options generated from config dataclasses, so every field is overridable.

Each field becomes ``--field_name`` (also ``--field-name``), typed from its annotation
(int, float, str, bool, Literal choices, ``X | None``), documented by the comment written
after it in the dataclass source. Options default to "not given", so only what the user
types overrides the preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from typing import Any, Literal

# The one rule for a text longer than the model's context, in qkv attend and qkv lens alike (both
# --help texts say it; the check is qkv.lens.cache.check_context).
LONG_TEXT_RULE = ("A text longer than the model's context is refused, naming the limit; it is never cut "
                  "(the answer would be about another text), in qkv attend and qkv lens alike.")


def _field_docs(cls: type) -> dict[str, str]:
    """The ``# comment`` after each field in the class source, and in its base classes' for the
    fields it inherits (a class's own comment wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for m in re.finditer(r"^\s+(\w+):[^\n#]*#\s*(.+)$", src, flags=re.MULTILINE):
            docs[m.group(1)] = m.group(2).strip()
    return docs


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _converter(tp: Any) -> tuple[Any, list[str] | None, str]:
    """(type function, choices, metavar) for an annotation."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        fn, choices, metavar = _converter(inner)

        def optional(text: str):
            return None if text.lower() in ("none", "null") else fn(text)

        return optional, None if choices is None else [*choices, "none"], metavar
    if origin is Literal:
        return str, [str(a) for a in args], "{" + ",".join(str(a) for a in args) + "}"
    if tp is bool:
        return _parse_bool, None, "{true,false}"
    if tp in (int, float, str):
        return tp, None, tp.__name__.upper()
    return str, None, "VALUE"


def add_config_options(parser: argparse.ArgumentParser, cls: type, title: str,
                       skip: tuple[str, ...] = ()) -> None:
    """Add one option per field of dataclass ``cls`` in an argument group."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        fn, choices, metavar = _converter(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        group.add_argument(*flags, dest=f"{cls.__name__}.{f.name}", type=fn, choices=choices,
                           metavar=metavar if choices is None else None,
                           default=argparse.SUPPRESS, help=help_text)


def overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that the user gave on the command line."""
    prefix = f"{cls.__name__}."
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}


PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


def check_picture_out(path: str, flag: str, suffixes: tuple[str, ...] = PICTURE_SUFFIXES):
    """The Path of a picture the command will write (PNG, or SVG/PDF for slides and papers);
    ValueError (one line) if ``path`` has another suffix or its folder does not exist."""
    from pathlib import Path

    out = Path(path)
    if out.suffix.lower() not in suffixes:
        names = ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
        raise ValueError(f"{flag} must name a {names} file, got {out}")
    if out.parent.exists() and not out.parent.is_dir():
        raise ValueError(f"{out.parent} is a file, not a folder: choose another {flag}")
    if not out.parent.is_dir():
        raise ValueError(f"folder {out.parent} does not exist; create it or choose another {flag}")
    return out
