"""Human-written dates -> ISO 8601: the sequence-to-sequence task of issue 6.

Sources are rendered by Babel (CLDR data) in many locales and the four CLDR styles:
"8 août 1977" (fr, long), "Donnerstag, 11. Juli 1996" (de, full), "jueves, 6 de noviembre de
1986" (es, full), "09.04.88" (de, short), "Dec 22, 2018" (en, medium) -> "2018-12-22".
Character level: every source and target character is a token.

Splits are deterministic by seed:
    train / val / test   random dates in the *seen* (locale, style) combinations; no test or
                         validation source string also occurs in train
    heldout              the (locale, style) combinations never shown in training: how far
                         the model generalises to a format it has not seen

Well-posed by construction: years are drawn from 1950-2049, so a two-digit year has one
reading, and a numeric source that two combinations would read as different dates
("3/4/77": 4 March in en_US, 3 April in es_ES) is dropped from every split
(:func:`ambiguous`). ``load_pairs`` reads any tab-separated source/target file instead.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

LOCALES: tuple[str, ...] = (
    "en_US", "en_GB", "fr_FR", "de_DE", "es_ES", "it_IT", "pt_BR", "nl_NL", "sv_SE", "da_DK",
    "fi_FI", "pl_PL", "cs_CZ", "ro_RO", "hu_HU", "tr_TR", "id_ID", "vi_VN", "ru_RU", "uk_UA",
    "el_GR", "ja_JP", "zh_CN", "ko_KR",
)
STYLES: tuple[str, ...] = ("short", "medium", "long", "full")
FIRST, LAST = dt.date(1950, 1, 1), dt.date(2049, 12, 31)


def _babel():
    try:
        from babel import Locale
        from babel.dates import format_date, get_date_format
    except ImportError as e:
        raise ImportError("the dates task needs Babel: pip install babel") from e
    return Locale, format_date, get_date_format


def normalize_source(text: str) -> str:
    """NFKC (narrow/no-break spaces -> spaces, full-width digits -> ASCII), whitespace runs
    collapsed, ends stripped. Applied to generated sources and to user input alike."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def render(date: dt.date, locale: str, style: str) -> str:
    """``date`` as ``locale`` writes it in CLDR ``style``, normalised."""
    _, format_date, _ = _babel()
    return normalize_source(format_date(date, format=style, locale=locale))


def iso(date: dt.date) -> str:
    return date.isoformat()


# --------------------------------------------------------------------------- ambiguity

_FIELD = re.compile(r"'[^']*'|([A-Za-z])\1*|.", re.DOTALL)


@cache
def numeric_parser(locale: str, style: str) -> re.Pattern[str] | None:
    """A regex that reads back the strings of an all-numeric CLDR pattern (fields d, dd, M,
    MM, y, yy, yyyy and literals), with groups named day / month / year / year2; None for
    patterns with month or weekday names."""
    _, _, get_date_format = _babel()
    pattern = get_date_format(style, locale=locale).pattern
    out = []
    for m in _FIELD.finditer(pattern):
        tok = m.group(0)
        if tok.startswith("'"):
            out.append(re.escape(tok[1:-1] or "'"))
        elif tok[0].isalpha():
            letter, n = tok[0], len(tok)
            if letter == "d" and n <= 2:
                out.append(r"(?P<day>[1-9]\d?)" if n == 1 else r"(?P<day>\d{2})")  # d: no zero
            elif letter in "ML" and n <= 2:
                out.append(r"(?P<month>[1-9]\d?)" if n == 1 else r"(?P<month>\d{2})")
            elif letter == "y":
                # CLDR y is the full year; every year here has four digits (1950-2049)
                out.append(r"(?P<year2>\d{2})" if n == 2 else r"(?P<year>\d{4})")
            else:
                return None  # a name (MMM, EEEE, ...): not numeric
        else:
            out.append(re.escape(tok))
    regex = normalize_source("".join(out).replace("\\ ", " "))  # as sources are normalised
    return re.compile(regex.replace(" ", r"\ "))


def parse_numeric(text: str, locale: str, style: str) -> dt.date | None:
    """The date ``text`` means in (locale, style) if that style is numeric and it fits."""
    rx = numeric_parser(locale, style)
    m = rx.fullmatch(text) if rx is not None else None
    if m is None:
        return None
    g = m.groupdict()
    year = int(g["year"]) if g.get("year") else None
    if g.get("year2"):
        y2 = int(g["year2"])
        year = 1900 + y2 if y2 >= 50 else 2000 + y2  # the 1950-2049 window
    try:
        date = dt.date(year, int(g["month"]), int(g["day"]))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return date if FIRST <= date <= LAST else None


def ambiguous(text: str, combos: Iterable[tuple[str, str]]) -> bool:
    """Whether two numeric (locale, style) combinations read ``text`` as different dates."""
    readings = {d for lc, st in combos if (d := parse_numeric(text, lc, st)) is not None}
    return len(readings) > 1


# --------------------------------------------------------------------------- splits


@dataclass
class DatePairs:
    """(source, target) string pairs per split, and where they came from."""

    train: list[tuple[str, str]]
    val: list[tuple[str, str]]
    test: list[tuple[str, str]]
    heldout: list[tuple[str, str]] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (locale, style) in training
    unseen: list[tuple[str, str]] = field(default_factory=list)  # held out
    dropped_ambiguous: int = 0
    name: str = "dates"
    heldout_what: str = "held-out locale/style"  # what the held-out split holds, for reports
    length_edges: tuple[int, ...] = (0, 10, 15, 20, 25, 30, 1000)  # per-length scores: (a, b] buckets

    def splits(self) -> dict[str, list[tuple[str, str]]]:
        out = {"train": self.train, "val": self.val, "test": self.test}
        if self.heldout:
            out["heldout"] = self.heldout
        return out


def _signature(locale: str, style: str) -> tuple[str, ...]:
    """Renderings of a few probe dates: two combinations with the same signature write every
    date the same way (e.g. fr_FR and en_GB short, both dd/MM/y)."""
    probes = (dt.date(1977, 8, 8), dt.date(2018, 12, 22), dt.date(1986, 11, 6), dt.date(2003, 2, 1))
    return tuple(render(d, locale, style) for d in probes)


def heldout_combos(seed: int = 0, n: int = 12) -> list[tuple[str, str]]:
    """``n`` (locale, style) combinations to hold out, chosen by seed among those whose format
    no other combination shares (so a held-out format is really unseen), such that every
    locale keeps at least three styles and every style at least 20 locales in training."""
    rng = random.Random(seed)
    combos = [(lc, st) for lc in LOCALES for st in STYLES]
    signatures: dict[tuple[str, ...], int] = {}
    for c in combos:
        sig = _signature(*c)
        signatures[sig] = signatures.get(sig, 0) + 1
    unique = [c for c in combos if signatures[_signature(*c)] == 1]
    rng.shuffle(unique)
    out: list[tuple[str, str]] = []
    per_locale: dict[str, int] = {}
    per_style: dict[str, int] = {}
    for lc, st in unique:
        if len(out) == n:
            break
        if per_locale.get(lc, 0) >= 1 or per_style.get(st, 0) >= len(LOCALES) - 20:
            continue
        out.append((lc, st))
        per_locale[lc] = per_locale.get(lc, 0) + 1
        per_style[st] = per_style.get(st, 0) + 1
    return sorted(out)


def _case_variant(text: str, rng: random.Random) -> str:
    """80% as written, 10% lower case, 10% upper case: people type dates all ways."""
    r = rng.random()
    return text.lower() if r < 0.1 else text.upper() if r < 0.2 else text


def make_date_pairs(n_train: int = 50_000, n_val: int = 2_000, n_test: int = 5_000,
                    n_heldout: int = 5_000, seed: int = 0) -> DatePairs:
    """Generate the splits (deterministic for a given seed and Babel/CLDR version)."""
    unseen = heldout_combos(seed)
    seen = [(lc, st) for lc in LOCALES for st in STYLES if (lc, st) not in unseen]
    all_combos = seen + unseen
    numeric = [c for c in all_combos if numeric_parser(*c) is not None]
    rng = random.Random(seed)
    span = (LAST - FIRST).days
    dropped = 0
    train_sources: set[str] = set()

    def draw(n: int, combos: Sequence[tuple[str, str]], exclude: set[str]) -> list[tuple[str, str]]:
        nonlocal dropped
        out: list[tuple[str, str]] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 20 * n + 1000:
                raise RuntimeError("could not draw enough unambiguous dates")
            d = FIRST + dt.timedelta(days=rng.randrange(span + 1))
            src = _case_variant(render(d, *rng.choice(combos)), rng)
            if src in exclude:
                continue
            if ambiguous(src, numeric):
                dropped += 1
                continue
            out.append((src, iso(d)))
        return out

    train = draw(n_train, seen, set())
    train_sources.update(s for s, _ in train)
    val = draw(n_val, seen, train_sources)
    test = draw(n_test, seen, train_sources)
    heldout = draw(n_heldout, unseen, train_sources) if n_heldout else []
    return DatePairs(train, val, test, heldout, seen, unseen, dropped)


def load_pairs(path: str | os.PathLike[str], val_fraction: float = 0.05, test_fraction: float = 0.1,
               seed: int = 0) -> DatePairs:
    """A UTF-8 file of ``source<TAB>target`` lines, shuffled by seed into train/val/test.

    Blank lines are skipped; a line without exactly one tab, or with an empty side, raises
    ValueError naming the line number.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pairs file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM is not part of line 1
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    pairs = []
    for i, line in enumerate(lines, start=1):
        if not line.strip(" \r"):  # blank (a lone tab is not blank: it is a malformed pair)
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"{path} line {i}: expected 'source<TAB>target', got {line[:60]!r}")
        pairs.append((normalize_source(parts[0]), parts[1].strip()))
    if len(pairs) < 10:
        raise ValueError(f"{path} has {len(pairs)} pairs; at least 10 are needed to train and test")
    random.Random(seed).shuffle(pairs)
    n_test = max(1, int(len(pairs) * test_fraction))
    n_val = max(1, int(len(pairs) * val_fraction))
    return DatePairs(pairs[n_test + n_val:], pairs[n_test:n_test + n_val], pairs[:n_test],
                     name=path.name)
