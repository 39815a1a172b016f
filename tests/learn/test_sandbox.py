"""A student's file runs in a process of its own: bad files are one line (exit 2: a missing file,
a syntax error with file:line, no function of the exercise's name) before anything runs; an
infinite loop, a huge allocation, sys.exit, a print storm or an exception are one clear failed
check, never a hang or qkv's traceback; a seed offset moves every check's inputs (a function that
only reproduces the public outputs fails there); and the command's exit codes and JSON."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call

from qkv.errors import InputError
from qkv.learn import run
from qkv.learn.sandbox import read_solution, run_checks

GOOD = '''
import torch
def softmax(x, dim=-1):
    z = x - x.amax(dim=dim, keepdim=True)
    return z.exp() / z.exp().sum(dim=dim, keepdim=True)
'''


def write(tmp_path: Path, text: str, name: str = "softmax.py") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_bad_files_are_refused_in_one_line_before_anything_runs(tmp_path):
    with pytest.raises(InputError, match="is not a file"):
        read_solution("softmax", tmp_path / "nope.py")
    with pytest.raises(InputError, match=r"softmax.py:3: syntax error"):
        read_solution("softmax", write(tmp_path, "import torch\n\ndef softmax(x dim):\n    pass\n"))
    with pytest.raises(InputError, match="defines no function softmax"):
        read_solution("softmax", write(tmp_path, "def soft_max(x, dim=-1):\n    return x\n"))


@pytest.mark.parametrize(("body", "says"), [
    ("    while True:\n        pass\n", "did not finish in"),
    ("    return torch.empty(2**34, dtype=torch.float64)\n", "out of memory"),
    ("    import sys\n    sys.exit(3)\n", "called sys.exit(3)"),
    ("    for i in range(10**5):\n        print('debug', i)\n    z = x - x.amax(dim, keepdim=True)\n"
     "    return z.exp() / z.exp().sum(dim, keepdim=True)\n", "printed"),
    ("    return undefined_name * 2\n", "raised NameError"),
])
def test_a_misbehaving_solution_is_a_failed_check_not_a_hang(tmp_path, body, says):
    p = write(tmp_path, f"import torch\n\ndef softmax(x, dim=-1):\n{body}")
    report = run_checks("softmax", p, timeout=20)
    assert not report.passed
    said = [report.error] + [c.message for c in report.checks if not c.ok]
    assert any(says in m for m in said), said


def test_a_file_that_raises_while_imported_names_its_line(tmp_path):
    p = write(tmp_path, "import torch\nx = 1 / 0\n\ndef softmax(x, dim=-1):\n    return x\n")
    report = run_checks("softmax", p)
    assert not report.passed and "ZeroDivisionError" in report.error and "softmax.py:2" in report.error


def test_a_seed_offset_fails_a_solution_that_only_reproduces_the_public_outputs(tmp_path):
    """The public checks' inputs are recorded (by digest) with softmax's true outputs, taken from
    torch.softmax in float64; the file returns those and a wrong (smooth) softmax elsewhere."""
    seen = {}

    def digest(x, dim):
        return hashlib.sha256(f"{tuple(x.shape)} {dim} {x.dtype}".encode()
                              + x.detach().double().contiguous().numpy().tobytes()).hexdigest()

    def recorder(x, dim=-1):
        if not x.requires_grad:
            seen[digest(x, dim)] = torch.softmax(x.double(), dim=dim).flatten().tolist()
        return torch.softmax(x, dim=dim)

    run("softmax", recorder)  # fails only its "does not call softmax" check
    assert len(seen) >= 5
    p = write(tmp_path, f'''import hashlib
import torch

SEEN = {seen!r}


def softmax(x, dim=-1):
    key = hashlib.sha256(f"{{tuple(x.shape)}} {{dim}} {{x.dtype}}".encode()
                         + x.detach().double().contiguous().numpy().tobytes()).hexdigest()
    if not x.requires_grad and key in SEEN:
        return torch.tensor(SEEN[key], dtype=torch.float64).to(x.dtype).reshape(x.shape)
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / (e.sum(dim=dim, keepdim=True) + 1.0)
''')
    public = run_checks("softmax", p, timeout=60)
    assert public.passed, public.text()
    unseen = run_checks("softmax", p, timeout=60, seed_offset=1234)
    failed = [c.message for c in unseen.checks if not c.ok]
    assert not unseen.error and failed and any("expected" in m for m in failed), unseen.text()
    right = run_checks("softmax", write(tmp_path, GOOD, "good.py"), timeout=60, seed_offset=1234)
    assert right.passed, right.text()


def test_the_command_exit_codes_json_start_and_progress(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = call(["learn", "start", "softmax"])
    assert rc == 0 and (tmp_path / "qkv-exercises" / "softmax.py").is_file(), err
    stub = (tmp_path / "qkv-exercises" / "softmax.py").read_text()
    assert "def softmax(x, dim=-1):" in stub and "NotImplementedError" in stub
    rc, out, _ = call(["learn", "start", "softmax"])  # never overwrites
    assert rc == 0 and "exists" in out and (tmp_path / "qkv-exercises" / "softmax.py").read_text() == stub
    rc, out, _ = call(["learn", "check", "softmax", "--json"])  # the stub: every check fails
    got = json.loads(out)
    assert rc == 1 and got["passed"] is False and "not written yet" in got["checks"][0]["message"]
    (tmp_path / "qkv-exercises" / "softmax.py").write_text(GOOD)
    rc, out, _ = call(["learn", "check", "softmax", "--json"])
    assert rc == 0 and json.loads(out)["passed"] is True, out
    assert set(json.loads(out)["checks"][0]) == {"name", "ok", "message"}
    rc, out, _ = call(["learn", "list", "--json"])
    rows = {r["name"]: r for r in json.loads(out)}
    assert rc == 0 and rows["softmax"]["status"] == "passed"
    assert {"name", "section", "status"} <= set(rows["rope"])
    rc, out, _ = call(["learn", "progress"])
    from qkv.learn import EXERCISES

    assert rc == 0 and f"1 of {len(EXERCISES)} exercises pass" in out
    rc, out, _ = call(["learn", "hint", "rope"])
    assert rc == 0 and out.startswith("hint 1/") and "hint 2/" not in out
    rc, out, _ = call(["learn", "hint", "rope"])
    assert "hint 2/" in out
    assert_one_line_error(*call(["learn", "check", "softmax", str(tmp_path / "nope.py")])[::2])
    write(tmp_path, "def softmax(:\n", "bad.py")
    rc, _, err = call(["learn", "check", "softmax", str(tmp_path / "bad.py")])
    assert "bad.py:1: syntax error" in assert_one_line_error(rc, err)
    rc, _, err = call(["learn", "check", "sofmax"])
    assert "did you mean softmax?" in assert_one_line_error(rc, err)
