"""The copy / substitution task: deterministic, the held-out split longer than training, test
strings unseen in training, bad settings refused in one line; and an easy run learns it."""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error, call

from qkv.data.copy import SYMBOLS, length_edges, make_copy_pairs, substitution

pytestmark = pytest.mark.usefixtures("one_thread")


def test_generator_is_deterministic_and_splits_are_as_documented() -> None:
    a = make_copy_pairs("copy", 500, 20, 50, 30, min_len=5, max_len=12, long_len=16, seed=3)
    b = make_copy_pairs("copy", 500, 20, 50, 30, min_len=5, max_len=12, long_len=16, seed=3)
    assert a.splits() == b.splits()
    assert a.splits() != make_copy_pairs("copy", 500, 20, 50, 30, 5, 12, 16, seed=4).splits()
    assert all(s == t and 5 <= len(s) <= 12 and set(s) <= set(SYMBOLS) for s, t in a.train)
    assert {len(s) for s, _ in a.heldout} <= set(range(13, 17)) and len(a.heldout) == 30
    train = {s for s, _ in a.train}
    assert not train & {s for s, _ in a.test} and not train & {s for s, _ in a.heldout}
    assert a.length_edges == (4, 10, 12, 16)


def test_substitution_is_a_fixed_permutation_without_fixed_points() -> None:
    sub = substitution(0)
    assert sorted(sub) == sorted(sub.values()) == list(SYMBOLS)
    assert all(k != v for k, v in sub.items())
    p = make_copy_pairs("substitute", 50, 5, 5, 0, 5, 9, 9, seed=0)
    assert all(t == "".join(sub[c] for c in s) for s, t in p.train)


def test_length_buckets_follow_bahdanau_s_plot() -> None:
    assert length_edges(5, 60, 80) == (4, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 70, 80)


@pytest.mark.parametrize(("args", "match"), [
    (["--task", "copy", "--data", "pairs.tsv"], "generates its own strings; drop --data"),
    (["--task", "copy", "--min_len", "9", "--max_len", "5"], "min_len <= max_len <= long_len"),
    (["--task", "copy", "--max_len", "20", "--long_len", "20"], "held-out strings are longer than max_len"),
    (["--task", "reverse"], "invalid choice"),
])
def test_bad_copy_settings_are_one_line(args, match, tmp_path) -> None:
    rc, _, err = call(["train", "seq2seq", "--preset", "tiny", "--out_dir", str(tmp_path / "r"), *args])
    if match == "invalid choice":  # argparse's own message: usage line, then the error, exit 2
        assert rc == 2 and match in err
    else:
        assert match in assert_one_line_error(rc, err)
    assert not (tmp_path / "r").exists()


def test_an_easy_copy_run_learns_short_strings(tmp_path) -> None:
    """RNN + attention, strings of 3-8 letters, 300 steps: >= 90% copied exactly."""
    import json

    run = tmp_path / "copy"
    rc, out, err = call(["train", "seq2seq", "--preset", "tiny", "--task", "copy", "--min_len", "3",
                         "--max_len", "8", "--long_len", "10", "--n_train", "3000", "--n_test", "200",
                         "--n_heldout", "50", "--max_iters", "300", "--eval_interval", "300",
                         "--dtype", "fp32", "--compile", "false", "--out_dir", str(run), "--no-progress"])
    assert rc == 0, err
    ev = json.loads((run / "eval.json").read_text())
    assert ev["test"]["exact"] >= 0.9, ev["test"]
    assert set(ev["heldout"]["by_length"]) == {"9-10"}  # the longer strings, scored apart
    assert "longer than training (9-10) exact match" in out
