"""The dates task: Babel renderings, the numeric read-back that finds ambiguous strings,
deterministic splits, held-out combinations, and the TSV reader's errors."""

from __future__ import annotations

import datetime as dt
import random

import pytest

pytest.importorskip("babel")

from qkv.data import dates as D


def test_examples_from_the_issue() -> None:
    assert D.render(dt.date(1977, 8, 8), "fr_FR", "long") == "8 août 1977"
    assert D.render(dt.date(2018, 12, 22), "en_US", "medium") == "Dec 22, 2018"
    assert D.render(dt.date(1986, 11, 6), "es_ES", "full") == "jueves, 6 de noviembre de 1986"
    assert D.render(dt.date(1988, 4, 9), "de_DE", "short") == "09.04.88"
    assert D.iso(dt.date(2018, 12, 22)) == "2018-12-22"


def test_normalize_source() -> None:
    assert D.normalize_source("  8\u202faoût\u00a0 1977 ") == "8 août 1977"
    assert D.normalize_source("１９７７") == "1977"  # full-width digits


def test_numeric_parsers_read_back_every_numeric_style() -> None:
    rng = random.Random(0)
    numeric = [(lc, st) for lc in D.LOCALES for st in D.STYLES if D.numeric_parser(lc, st)]
    assert len(numeric) >= 20
    assert D.numeric_parser("en_US", "long") is None  # month names
    for lc, st in numeric:
        for _ in range(30):
            d = D.FIRST + dt.timedelta(days=rng.randrange((D.LAST - D.FIRST).days + 1))
            assert D.parse_numeric(D.render(d, lc, st), lc, st) == d, (lc, st)


def test_ambiguity() -> None:
    us, es = ("en_US", "short"), ("es_ES", "short")
    assert D.render(dt.date(1977, 3, 4), *us) == D.render(dt.date(1977, 4, 3), *es) == "3/4/77"
    assert D.ambiguous("3/4/77", [us, es])
    assert not D.ambiguous("3/14/77", [us, es])  # only en_US can read it
    assert not D.ambiguous("4/4/77", [us, es])  # both read 4 April
    assert not D.ambiguous("3/4/77", [us])
    numeric = [(lc, st) for lc in D.LOCALES for st in D.STYLES if D.numeric_parser(lc, st)]
    assert not D.ambiguous("09.04.88", numeric)  # a 2-digit year is not a 4-digit one
    assert not D.ambiguous("08/08/77", numeric)  # en_US writes 8/8/77: no leading zeros


def test_only_true_ambiguity_is_dropped() -> None:
    """Formats no other combination can read differently keep every date."""
    numeric = [(lc, st) for lc in D.LOCALES for st in D.STYLES if D.numeric_parser(lc, st)]
    rng = random.Random(1)
    kept = {}
    for c in [("de_DE", "short"), ("ja_JP", "short"), ("fr_FR", "short"), ("es_ES", "short")]:
        dates = [D.FIRST + dt.timedelta(days=rng.randrange(36524)) for _ in range(60)]
        kept[c] = sum(not D.ambiguous(D.render(d, *c), numeric) for d in dates) / 60
    assert kept[("de_DE", "short")] == kept[("ja_JP", "short")] == kept[("fr_FR", "short")] == 1.0
    assert 0.4 < kept[("es_ES", "short")] < 0.9  # d/M/yy vs en_US M/d/yy: both numbers <= 12


@pytest.fixture(scope="module")
def pairs():
    return D.make_date_pairs(3000, 200, 400, 400, seed=0)


def test_splits_are_deterministic_and_clean(pairs) -> None:
    again = D.make_date_pairs(3000, 200, 400, 400, seed=0)
    assert again.train == pairs.train and again.heldout == pairs.heldout
    assert D.make_date_pairs(3000, 200, 400, 400, seed=1).train != pairs.train
    train_src = {s for s, _ in pairs.train}
    for split in (pairs.val, pairs.test, pairs.heldout):
        assert not train_src & {s for s, _ in split}
    numeric = [c for c in pairs.seen + pairs.unseen if D.numeric_parser(*c)]
    for name, split in pairs.splits().items():
        for s, t in split:
            d = dt.date.fromisoformat(t)
            assert D.FIRST <= d <= D.LAST and D.iso(d) == t
            assert not D.ambiguous(s, numeric), (name, s)
    assert pairs.dropped_ambiguous > 0


def test_heldout_combinations(pairs) -> None:
    assert set(pairs.unseen).isdisjoint(pairs.seen) and len(pairs.unseen) == 12
    probes = [dt.date(1999, 3, 14), dt.date(2024, 10, 5)]
    seen_formats = {tuple(D.render(d, *c) for d in probes) for c in pairs.seen}
    for c in pairs.unseen:  # no seen combination writes dates the same way
        assert tuple(D.render(d, *c) for d in probes) not in seen_formats, c
    for lc in D.LOCALES:
        assert sum(c[0] == lc for c in pairs.seen) >= 3
    # every held-out source is a rendering in some held-out combination (up to case)
    for s, t in pairs.heldout[:100]:
        d = dt.date.fromisoformat(t)
        assert any(D.render(d, *c).lower() == s.lower() for c in pairs.unseen), s


def test_load_pairs(tmp_path) -> None:
    good = tmp_path / "p.tsv"
    good.write_text("".join(f"src {i}\ttgt {i}\n" for i in range(20)) + "\n", encoding="utf-8")
    p = D.load_pairs(good)
    assert len(p.train) + len(p.val) + len(p.test) == 20 and p.heldout == []
    assert sorted(p.train + p.val + p.test) == sorted((f"src {i}", f"tgt {i}") for i in range(20))
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nc\td\nno tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 3: expected 'source<TAB>target'"):
        D.load_pairs(bad)
    bad.write_text("a\tb\n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        D.load_pairs(bad)
    bad.write_text("a\tb\n", encoding="utf-8")
    with pytest.raises(ValueError, match="at least 10"):
        D.load_pairs(bad)
    bad.write_bytes(b"\xff\xfe\tb\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        D.load_pairs(bad)
    with pytest.raises(ValueError, match="not found"):
        D.load_pairs(tmp_path / "nope.tsv")
