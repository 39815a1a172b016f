"""The `qkv` command line: --help lists every subcommand, user errors are one line + exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_line_error, call

from qkv import __version__, cli
from qkv.commands import bench

COMMANDS = ("train", "generate", "embed", "similarity", "classify", "translate", "caption", "attend",
            "explain", "serve", "assets", "bench")


@pytest.fixture
def fake_benchmarks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A benchmarks/ folder of our own, so these tests never depend on the real scripts."""
    (tmp_path / "alpha.py").write_text(
        "import sys\nprint('alpha ran', sys.argv[1:], '--quick' in sys.argv)\n"
    )
    (tmp_path / "beta.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "_common.py").write_text("")  # helpers are not benchmarks
    (tmp_path / "notes.txt").write_text("not a script")
    monkeypatch.setattr(bench, "_benchmarks_dir", lambda: tmp_path)
    return tmp_path


def test_help_lists_every_subcommand() -> None:
    rc, out, _ = call(["--help"])
    assert rc == 0
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert listed >= set(COMMANDS)
    assert "planned" not in out  # every command works


def test_no_command_prints_help() -> None:
    rc, out, _ = call([])
    assert rc == 0
    assert all(name in out for name in COMMANDS)


def test_version() -> None:
    rc, out, _ = call(["--version"])
    assert rc == 0 and out.strip() == f"qkv {__version__}"


def test_bench_list(fake_benchmarks: Path) -> None:
    rc, out, err = call(["bench", "--list"])
    assert rc == 0 and err == ""
    assert out.splitlines() == ["alpha", "beta"]


def test_bench_list_real_folder() -> None:
    # The real folder may be empty or filling up: compare with what is there right now.
    expected = sorted(p.stem for p in bench._benchmarks_dir().glob("*.py")
                      if not p.stem.startswith("_"))
    rc, out, err = call(["bench", "--list"])
    if expected:
        assert rc == 0 and out.splitlines() == expected
    else:
        assert rc == 2
        assert_one_line_error(rc, err)


def test_bench_unknown_name(fake_benchmarks: Path) -> None:
    rc, out, err = call(["bench", "alpha", "nope"])
    assert rc == 2
    assert_one_line_error(rc, err)
    assert "'nope'" in err and "alpha, beta" in err
    assert "alpha ran" not in out  # nothing runs when any name is wrong


def test_bench_runs_a_script_with_quick(fake_benchmarks: Path, capfd) -> None:
    rc = cli.main(["bench", "alpha", "--quick"])
    out, _ = capfd.readouterr()
    assert rc == 0
    assert "alpha ran ['--quick']" in out


def test_bench_quick_leaves_out_scripts_without_a_quick_mode(fake_benchmarks: Path, capfd) -> None:
    """A script that never names --quick would die of argparse's error under it: with no names,
    --quick lists and skips it; named, it is refused in one line (exit 2) before anything runs."""
    (fake_benchmarks / "gamma.py").write_text("import sys\nprint('gamma ran', sys.argv[1:])\n")
    rc = cli.main(["bench", "--quick", "alpha", "gamma"])
    out, err = capfd.readouterr()
    assert rc == 2 and "gamma has no quick mode" in err and "ran" not in out
    (fake_benchmarks / "beta.py").write_text("import sys\nprint('beta ran', sys.argv[1:])  # '--quick'\n")
    assert cli.main(["bench", "--quick"]) == 0
    out, _ = capfd.readouterr()
    assert "alpha ran ['--quick']" in out and "beta ran ['--quick']" in out and "gamma ran" not in out
    assert "no quick mode; run each alone): gamma" in out
    assert cli.main(["bench", "gamma"]) == 0 and "gamma ran []" in capfd.readouterr().out


def test_bench_returns_the_failing_exit_code(fake_benchmarks: Path, capfd) -> None:
    assert cli.main(["bench", "beta"]) == 3
    # Running everything stops at the first failure (alpha runs, then beta fails).
    assert cli.main(["bench"]) == 3
    assert capfd.readouterr().out.count("alpha ran") == 1


def test_bench_without_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "_benchmarks_dir", lambda: tmp_path)
    rc, _, err = call(["bench", "--list"])
    assert rc == 2
    assert_one_line_error(rc, err)
    assert "no benchmark scripts" in err


def test_unknown_command_is_an_argparse_error() -> None:
    rc, _, err = call(["frobnicate"])
    assert rc == 2 and "Traceback" not in err and "frobnicate" in err


def test_python_dash_m_qkv() -> None:
    help_ = subprocess.run([sys.executable, "-m", "qkv", "--help"], capture_output=True,
                           text=True, timeout=60)
    assert help_.returncode == 0
    assert all(name in help_.stdout for name in COMMANDS)
    bad = subprocess.run([sys.executable, "-m", "qkv", "generate", "/nonexistent/run"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert_one_line_error(bad.returncode, bad.stderr)


def test_qkv_warnings_are_one_line_others_as_python_shows_them(capsys) -> None:
    """A warning raised in qkv's code prints as `qkv: warning: ...` on one line; a warning from
    another library keeps Python's own form (file:line: Category: message)."""
    import warnings

    from qkv import cli
    from qkv.pretrained import gguf_tokenizers

    shown = []  # what Python's own showwarning was handed
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, *_: shown.append(
            warnings.formatwarning(message, category, filename, lineno))
        cli._one_line_warnings()
        warnings.warn_explicit("split qkv does not know;\n  using GPT-2's", UserWarning,
                               gguf_tokenizers.__file__, 1)
        warnings.warn_explicit("not ours", UserWarning, "/elsewhere/lib.py", 7)
    assert capsys.readouterr().err == "qkv: warning: split qkv does not know; using GPT-2's\n"
    assert len(shown) == 1 and shown[0].startswith("/elsewhere/lib.py:7: UserWarning: not ours")
