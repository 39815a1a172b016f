"""Small helpers shared by the topics' renderers: rich tables with a house style."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def table(title: str, columns: Sequence[str], *, first_left: bool = True,
          first_max: int | None = None) -> Any:
    """A rich Table with ``columns`` (the first left-aligned, the rest right-aligned).

    ``first_max``: cut the first column's cells to one line of at most this width ("…").
    """
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title), title_justify="left", title_style="bold")
    for i, c in enumerate(columns):
        cut: dict[str, Any] = {}
        if i == 0 and first_max:
            cut = dict(no_wrap=True, overflow="ellipsis", max_width=first_max)
        elif i > 0 and first_max:  # the numbers stay on one line; the first column gives way
            cut = dict(no_wrap=True)
        t.add_column(escape(c), justify="left" if i == 0 and first_left else "right", **cut)
    return t


def add_row(t: Any, *cells: str, style: str | None = None) -> None:
    """Add a row of plain text: brackets such as [CLS] or E[qᵀk] are not rich markup."""
    from rich.markup import escape

    t.add_row(*(escape(c) for c in cells), style=style)


def say(console: Any, text: str, style: str | None = None) -> None:
    """Print plain text (no markup, no highlighting), optionally in one style (e.g. "dim")."""
    console.print(text, style=style, markup=False, highlight=False)


def num(x: float, digits: int = 4) -> str:
    """A number for a table: fixed point, integers without decimals, tiny values readable."""
    if not math.isfinite(x):
        return str(x)  # nan, inf: shown, not a crash
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    if x != 0 and abs(x) < 10 ** -digits:
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def vec(xs: Iterable[float], digits: int = 4) -> str:
    """[a, b, c] with :func:`num` formatting."""
    return "[" + ", ".join(num(float(x), digits) for x in xs) + "]"


def human_bytes(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB), as memory is usually counted."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    """1.77M, 22.66G: a large count with an SI suffix."""
    for unit, size in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"
