"""Starting the child that runs a student's function (:mod:`qkv.learn.child`), without importing
torch here: ``qkv learn check`` starts its child first thing (:func:`ahead`), so that the child's
import of torch and the command's own run side by side on two cores instead of one after the
other (about 1.4 s of the ~5 s a student waits on a 2-core Zen 3).

The child is started in an empty private folder, with a clean environment, reading its set-up
from a pipe; until the set-up comes it only imports torch (it has not seen the student's file,
which is written into its folder later, by :class:`qkv.learn.judge.Child`).
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qkv import owned

PRINT_LIMIT = 20_000  # characters one call may print; past it the call is stopped
PRINTS_SHOWN = 1_500  # characters of them sent back
_CHILD_HALF = "# " + "-" * 75 + " child\n"


def program() -> str:
    """The child's source: :mod:`qkv.learn.wire`'s, then :mod:`qkv.learn.child`'s child half
    (below its ``# --- child`` line), run as ``__main__``."""
    here = Path(__file__).resolve().parent
    wire = (here / "wire.py").read_text(encoding="utf-8")
    mine = (here / "child.py").read_text(encoding="utf-8").split(_CHILD_HALF, 1)[1]
    head = f"\nimport os\nimport sys\nPRINT_LIMIT = {PRINT_LIMIT}\nPRINTS_SHOWN = {PRINTS_SHOWN}\n"
    path = "import sys\nsys.path += sys.argv[1:]  # torch's folders (from the grader: no secret)\n"
    return path + wire.replace("from __future__ import annotations\n", "") + head + mine


def site_folders() -> list[str]:
    """The folders the child imports from: torch's, NumPy's, the standard library's (found
    without importing them)."""
    out = []
    for mod in ("torch", "numpy", "typing_extensions", "sympy"):
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.origin:
            parent = str(Path(spec.origin).resolve().parent.parent)
            if parent not in out:
                out.append(parent)
    return out


@dataclass
class Launched:
    """A started child: its process (stdin: requests, stdout: answers), its private folder and
    the grader's file for its start-up errors (read back only to say why it ended)."""

    proc: subprocess.Popen
    folder: Path
    errors: IO[bytes]


def launch() -> Launched:
    """A child, started now (owned: ended when this process exits, if not before)."""
    folder = Path(tempfile.mkdtemp(prefix="qkv-child-"))
    folder.chmod(0o700)
    errors = tempfile.TemporaryFile()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(folder), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TMPDIR": str(folder)}
    try:
        proc = owned.start([sys.executable, "-I", "-S", "-c", program(), *site_folders()],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, cwd=str(folder),
                           env=env, close_fds=True)
    except BaseException:
        errors.close()
        folder.rmdir()
        raise
    return Launched(proc, folder, errors)


_AHEAD: list[Launched] = []


def ahead() -> None:
    """Start one child now for the next :class:`qkv.learn.judge.Child` to take (a command that
    will judge once: ``qkv learn check``). Unused, it is ended when this process exits."""
    if not _AHEAD:
        try:
            _AHEAD.append(launch())
        except (OSError, owned.ExitingError):
            return  # the judge starts its own
        atexit.register(_drop)


def _drop() -> None:
    """At exit: a child started ahead and never taken is ended and its folder removed."""
    while _AHEAD:
        got = _AHEAD.pop()
        owned.end(got.proc)
        got.errors.close()
        shutil.rmtree(got.folder, ignore_errors=True)


def take() -> Launched | None:
    """The child started :func:`ahead`, if one is still running (None otherwise)."""
    while _AHEAD:
        got = _AHEAD.pop()
        if got.proc.poll() is None:
            return got
        got.errors.close()
        shutil.rmtree(got.folder, ignore_errors=True)
    return None
