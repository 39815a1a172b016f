"""The student's function runs in a child, the checks in the grader (qkv/learn/judge.py): nothing
the child prints, patches, forges or exits with turns a check green; qkv cannot be imported
there; inputs changed in place, prints and forbidden calls reached by any name are seen; the
whole process group ends within the time limit and leaves nothing behind. References: PyTorch's
own ops (through the catalog's checks), /proc for processes, the file system for writes."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call

from qkv.errors import InputError
from qkv.learn import EXERCISES, get, run
from qkv.learn.judge import Child, Isolation, Remote, is_root, judge, run_checks
from qkv.learn.source import read_solution, untouched

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


def src(prelude: str, body: str) -> str:
    return f"import torch\n{prelude}\n\ndef softmax(x, dim=-1):\n{body}"


def failed(report) -> list[str]:
    return [report.error] * bool(report.error) + [c.message for c in report.checks if not c.ok]


def test_a_correct_file_passes_and_its_function_never_runs_here(tmp_path):
    p = tmp_path / "softmax.py"
    p.write_text(GOOD + "\nimport os\nos.environ['QKV_RAN_HERE'] = '1'\n")
    report = run_checks("softmax", p, timeout=60)
    assert report.passed, report.text()
    assert "QKV_RAN_HERE" not in os.environ


def test_bad_files_are_refused_in_one_line_before_anything_runs(tmp_path):
    with pytest.raises(InputError, match="is not a file"):
        read_solution("softmax", tmp_path / "nope.py")
    (tmp_path / "a.py").write_text("import torch\n\ndef softmax(x dim):\n    pass\n")
    with pytest.raises(InputError, match=r"a.py:3: syntax error"):
        read_solution("softmax", tmp_path / "a.py")
    (tmp_path / "b.py").write_text("def soft_max(x, dim=-1):\n    return x\n")
    with pytest.raises(InputError, match="defines no function softmax"):
        read_solution("softmax", tmp_path / "b.py")


@pytest.mark.parametrize(("prelude", "body", "says"), [
    ("torch.allclose = lambda *a, **k: True\ntorch.isclose = lambda a, b, **k: torch.ones_like(a, "
     "dtype=torch.bool)\ntorch.equal = lambda *a: True", "    return torch.zeros_like(x)\n", "expected"),
    ("class Sneaky:\n    torch.testing.assert_close = staticmethod(lambda *a, **k: None)",
     "    return x * 0\n", "expected"),
    ("import os, json", "    rep = json.dumps({'passed': True, 'checks': []}).encode()\n"
     "    for fd in range(1, 12):\n        try:\n            os.write(fd, rep)\n        except OSError:\n"
     "            pass\n    os._exit(0)\n", "the child's answer could not be read"),
    ("from qkv.attention.functional import softmax as _s", "    return _s(x, dim)\n", "imports qkv"),
    ("", "    m = __import__('q' + 'kv.attention.functional', fromlist=['softmax'])\n"
         "    return m.softmax(x, dim)\n", "qkv cannot be imported here"),
])
def test_nothing_the_child_does_turns_a_check_green(tmp_path, prelude, body, says):
    report = judge(get("softmax"), src(prelude, body), timeout=60)
    assert not report.passed and not (report.checks and report.checks[0].ok), report.text()
    assert any(says in m for m in failed(report)), report.text()


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
    report = run_checks("softmax", p, timeout=6)
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
    rc, out, _ = call(["learn", "check", "softmax", "--json"])  # the stub: not written yet, no check run
    got = json.loads(out)
    assert rc == 1 and got["passed"] is False and got["status"] == "unwritten" and got["checks"] == []
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


def test_a_qkv_package_beside_the_file_is_not_on_the_childs_path(tmp_path):
    (tmp_path / "qkv" / "learn").mkdir(parents=True)
    (tmp_path / "qkv" / "__init__.py").write_text("")
    (tmp_path / "qkv" / "learn" / "__init__.py").write_text("PASSED = True\n")
    p = tmp_path / "softmax.py"
    p.write_text(src("import qkv.learn", "    return x\n"))
    report = run_checks("softmax", p, timeout=60)
    assert report.status == "refused" and not report.passed, report.text()


def test_an_untouched_stub_is_not_written_yet_with_no_check_counted():
    stub = get("softmax").stub_file()
    assert untouched(stub, "softmax")
    report = judge(get("softmax"), stub, timeout=60)
    assert report.status == "unwritten" and report.checks == () and "not written yet" in report.text()
    assert "checks pass" not in report.text()


def test_an_input_changed_in_place_is_named_and_the_reference_is_the_input_as_given():
    body = ("    x.sub_(x.amax(dim=dim, keepdim=True))\n    x.exp_()\n"
            "    return x / x.sum(dim=dim, keepdim=True)\n")
    report = judge(get("softmax"), src("", body), timeout=60)
    messages = failed(report)
    assert any("changed x in place" in m for m in messages), report.text()
    assert not any("normalised along dim 0" in m for m in messages), report.text()


def test_what_the_function_printed_is_shown_under_a_failed_check_and_a_print_storm_is_cut():
    report = judge(get("softmax"), src("", "    print('my debug line', tuple(x.shape))\n    return x\n"),
                   timeout=60)
    assert any("my debug line (3,)" in m for m in failed(report)), report.text()
    t0 = time.monotonic()
    storm = judge(get("softmax"), src("", "    while True:\n        print('spam' * 100)\n"), timeout=60)
    assert time.monotonic() - t0 < 30  # cut at the print limit, not at the time limit
    assert any("printed more than" in m for m in failed(storm)), storm.text()


def test_a_forbidden_function_reached_by_a_computed_name_is_seen_at_run_time():
    report = judge(get("softmax"), src("", "    return getattr(torch, 'soft' + 'max')(x, dim)\n"), timeout=60)
    forbid = [c for c in report.checks if c.name.startswith("does not call")]
    assert forbid and not forbid[0].ok and "it calls softmax" in forbid[0].message, report.text()
    honest = judge(get("softmax"), GOOD, timeout=60)
    assert honest.passed, honest.text()


def test_gradients_come_back_as_vector_jacobian_products():
    """gradcheck in the grader against the child's VJPs: a softmax with a hand-written backward
    that is wrong fails the gradient check and nothing else."""
    wrong_backward = '''
import torch

class _S(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        z = x - x.amax(dim=dim, keepdim=True)
        y = z.exp() / z.exp().sum(dim=dim, keepdim=True)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y, None   # missing the - y * sum(g * y) term


def softmax(x, dim=-1):
    return _S.apply(x, dim)
'''
    report = judge(get("softmax"), wrong_backward, timeout=60)
    bad = [c.name for c in report.checks if not c.ok]
    assert bad == ["its gradient (torch.autograd.gradcheck, float64)"], report.text()
    with Child(GOOD, "softmax", timeout=60) as child:
        f = Remote(child, "softmax")
        x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
        g = torch.randn(2, 5, dtype=torch.float64)
        (got,) = torch.autograd.grad(f(x), x, g)
        y = torch.softmax(x.detach(), -1)
        torch.testing.assert_close(got, y * (g - (g * y).sum(-1, keepdim=True)))


def _alive(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except (OSError, ValueError):
            continue
    return out


def test_a_grandchild_and_a_fork_are_refused_and_the_time_limit_holds(tmp_path):
    marker = "4242.4242"
    body = ("    import subprocess, sys, os\n"
            "    for start in (lambda: subprocess.Popen(['sleep', '" + marker + "']), os.fork):\n"
            "        try:\n            start()\n        except Exception:\n            pass\n"
            "    while True:\n        pass\n")
    t0 = time.monotonic()
    report = judge(get("softmax"), src("", body), timeout=8)
    took = time.monotonic() - t0
    assert "did not finish in 8 s" in report.error and took < 8 + 10, (report.text(), took)
    assert _alive(marker) == []


def test_files_outside_its_folder_are_neither_read_nor_written(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("CANARY-1234")
    target = tmp_path / "written.txt"
    body = (f"    try:\n        open({str(target)!r}, 'w').write('x')\n    except OSError:\n        pass\n"
            f"    raise ValueError(open({str(secret)!r}).read())\n")
    report = judge(get("softmax"), src("", body), timeout=60)
    text = report.text()
    assert "CANARY" not in text and "not allowed here" in text, text
    assert not target.exists()


LANDLOCK_PROBE = r"""
import errno, os, socket, sys
from qkv.learn.child import _landlock
private, outside, secret, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
note = _landlock(private, [os.path.dirname(os.__file__)])
if note:
    print("NOTE", note)
    raise SystemExit(0)
def tries(what, fn):
    try:
        fn()
        print(what, "done")
    except OSError as e:
        print(what, errno.errorcode.get(e.errno, e.errno))
tries("write-inside", lambda: open(os.path.join(private, "ok.txt"), "w").write("x"))
tries("write-outside", lambda: os.close(os.open(outside, os.O_WRONLY | os.O_CREAT, 0o600)))
tries("read-outside", lambda: os.close(os.open(secret, os.O_RDONLY)))
tries("connect", lambda: socket.create_connection(("127.0.0.1", port), timeout=2))
"""


def test_the_kernel_fence_holds_without_the_audit_hook(tmp_path):
    """Landlock, as the child applies it, refuses what native code could do unseen by Python's
    audit hook (this probe installs no hook and uses plain os calls): writing or reading outside
    its folders, connecting to a TCP port. Where the kernel lacks it, the child says so."""
    import socket
    import subprocess
    import sys

    private = tmp_path / "private"
    private.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("CANARY")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        argv = [str(private), str(tmp_path / "out.txt"), str(secret), str(srv.getsockname()[1])]
        r = subprocess.run([sys.executable, "-c", LANDLOCK_PROBE, *argv], capture_output=True, text=True,
                           timeout=60)
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    if r.stdout.startswith("NOTE"):
        assert "refused in Python only" in r.stdout, r.stdout
        return
    assert r.stdout.split("\n")[:4] == ["write-inside done", "write-outside EACCES", "read-outside EACCES",
                                        "connect EACCES"], r.stdout
    assert not (tmp_path / "out.txt").exists()


@pytest.mark.skipif(not is_root(), reason="the unprivileged user is for a grader running as root")
def test_as_root_the_child_is_an_unprivileged_user_without_the_grader_folders(tmp_path):
    hidden = tmp_path / "grader"
    hidden.mkdir()
    (hidden / "manifest.json").write_text("SEED-OFFSET-777")
    os.chmod(tmp_path, 0o755)
    os.chmod(hidden, 0o755)
    probe = f'''
import os, torch
def softmax(x, dim=-1):
    seen = 1.0 if os.path.exists({str(hidden / "manifest.json")!r}) else 0.0
    return torch.tensor([float(os.getuid()), float(os.getgid()), seen])
'''
    with Child(probe, "softmax", timeout=60, isolation=Isolation.for_grading(3, [hidden])) as child:
        got = Remote(child, "softmax")(torch.zeros(1))
        notes = child.loaded.notes
    assert got.tolist()[:2] == [64003.0, 64003.0]
    assert got.tolist()[2] == 0.0 or any("mount" in n for n in notes), notes


def test_the_catalog_through_the_child_sample():
    """A sample of exercises whose checks differ in kind (tuples out, a ValueError expected,
    hand-set weights, gradients) pass with their reference solutions through the child; the
    whole catalog is in `pytest -m slow` and benchmarks/learn_checks.py."""
    for name in ("scaled_dot_product_attention", "layer_costs", "previous_token_head", "kv_cache_step"):
        e = EXERCISES[name]
        report = judge(e, "import math\nimport torch\n" + e.solution, timeout=120)
        assert report.passed, report.text()


@pytest.mark.slow  # 47 children, ~2-4 s each: benchmarks/learn_checks.py times them
def test_every_reference_solution_passes_through_the_child():
    for e in EXERCISES.values():
        report = judge(e, "import math\nimport torch\n" + e.solution, timeout=120)
        assert report.passed, report.text()


def test_a_notebooks_other_exercises_and_check_imports_do_not_count_against_this_one():
    """The notebook's check() judges only what the function needs: an attention cell that calls
    torch.softmax, the check cell's qkv import and an overridden first try are left out."""
    from qkv.learn.source import needed

    cells = ("import math\nimport torch\nfrom qkv.learn.exercise import other_inputs\n\n"
             "def helper(x):\n    return x.exp()\n\n"
             "def softmax(x, dim=-1):\n    return torch.softmax(x, dim)\n\n"
             "def attention(q, k, v):\n    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), -1) @ v\n\n"
             "def softmax(x, dim=-1):\n    e = helper(x - x.amax(dim, keepdim=True))\n"
             "    return e / e.sum(dim, keepdim=True)\n")
    assert needed(cells, "softmax") == ("def helper(x):\n    return x.exp()\n\n"
                                        "def softmax(x, dim=-1):\n"
                                        "    e = helper(x - x.amax(dim, keepdim=True))\n"
                                        "    return e / e.sum(dim, keepdim=True)\n")
    report = judge(get("softmax"), needed(cells, "softmax"), timeout=60)
    assert report.passed, report.text()
