"""The grader's side: the student's function runs in a child (:mod:`qkv.learn.child`), and every
check, reference and comparison runs here, in a process the student's code cannot reach.

A check is still written as a function of the student's function (the catalogs), but the function
it receives is a :class:`Remote`: calling it sends the arguments to the child as data
(:mod:`qkv.learn.wire`) and returns the outputs the child computed, as data. A check that needs
gradients gets them the same way: when an argument requires grad, the call goes through
:class:`_RemoteGrad`, whose backward asks the child for the vector-Jacobian product with the
cotangents autograd chose here (so ``torch.autograd.gradcheck`` runs here, on numbers). Whatever
the student's code prints, patches, writes or forges in its own process, the comparisons it would
have to fool are not there.

:class:`Child` owns the process: a private empty folder with a copy of the student's file, a clean
environment, an isolated interpreter (``-I -S``: no user site, no start-up hooks, no submission
folder on the path), a session of its own, pipes read with a deadline, and at the end the whole
process group killed and reaped with a bounded wait, so that ``timeout`` bounds an exercise
whatever the child leaves behind. When the grader runs as root, the child becomes an unprivileged
user of its own, hides the folders it must not read and leaves the network (where the kernel
allows it; :attr:`Child.notes` says what it could not do).
"""

from __future__ import annotations

import builtins
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkv import owned
from qkv.learn import launch
from qkv.learn.wire import MAX_BYTES, WireError, decode, encode, leaves

if TYPE_CHECKING:
    from qkv.learn.exercise import Exercise, Report

TIMEOUT_S = 60.0  # every check of one exercise, the child's start included (each check takes <= 5 s)
MEMORY_BYTES = 2 << 30  # what the student's code may allocate above what torch took to import
FILE_BYTES = 16 << 20  # the largest file it may write (in its own folder)
OPEN_FILES = 64
UNPRIVILEGED_UID = 64_000  # + a slot: the users student code runs as when the grader is root

# What torch imports lazily and an unprivileged user may be unable to read once the child has
# dropped root (a Python installed under /root): imported while the child is still root.
PRELOAD = ("torch.fx.experimental.symbolic_shapes", "torch._refs", "torch._prims_common", "torch._decomp",
           "torch.nn.attention", "torch.utils.flop_counter", "torch.autograd.gradcheck", "torch.special",
           "torch.linalg", "torch.fft", "torch.distributions", "numpy", "math", "cmath", "itertools",
           "functools", "collections", "random", "statistics", "fractions", "decimal", "typing",
           "dataclasses", "einops", "torch.nn.modules.activation", "torch.testing")


class ChildGoneError(Exception):
    """The child did not answer: it ran past the time limit, exited, or broke the protocol."""


class StudentRaisedError(Exception):
    """Mixed into the exception a :class:`Remote` call raises when the student's function raised:
    the same built-in type, so a check that expects a ValueError sees one."""

    kind: str = ""
    line: int = 0
    prints: str = ""


def _raised(error: dict[str, Any], prints: str) -> BaseException:
    """An exception of the first built-in type in the child's exception's MRO, carrying its text."""
    names = error.get("mro") or [error.get("type", "Exception")]
    base: type[BaseException] = Exception
    for name in names:
        cls = getattr(builtins, str(name), None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            base = cls
            break
    cls = type(f"Student{base.__name__}", (StudentRaisedError, base), {})
    e = cls(str(error.get("text", "")))
    e.kind, e.line, e.prints = str(error.get("type", "Exception")), int(error.get("line") or 0), prints
    return e


@dataclass
class Answer:
    """One call's answer from the child (data only: nothing here is a verdict)."""

    ok: bool
    out: Any = None
    error: dict[str, Any] = field(default_factory=dict)
    prints: str = ""
    printed: int = 0
    changed: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, value: Any) -> Answer:
        if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
            raise ChildGoneError("the child's answer was not one")

        def strings(key: str) -> list[str]:
            v = value.get(key) or []
            return [str(s)[:200] for s in v][:20] if isinstance(v, list) else []

        error = value.get("error") if isinstance(value.get("error"), dict) else {}
        printed = value.get("printed")
        return cls(value["ok"], value.get("out"), error, str(value.get("prints") or "")[:4000],
                   printed if isinstance(printed, int) else 0, strings("changed"), strings("forbidden"),
                   strings("refused"), strings("notes"))


_site_folders = launch.site_folders


def _qkv_folder() -> str:
    return str(Path(__file__).resolve().parents[1])


def _readable() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], *_site_folders(), "/dev/null", "/dev/urandom",
             "/proc/self/statm", "/sys/devices/system/cpu", "/proc/cpuinfo"}
    return sorted(roots)


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@dataclass(frozen=True)
class Isolation:
    """What the grader asks of every child: ``user`` (as root: an unprivileged uid and gid, None:
    run as the grader's user), ``hide`` (folders no child may see: the grader's, the
    submissions', the output), whether to leave the network."""

    user: tuple[int, int] | None = None
    hide: tuple[str, ...] = ()
    network: bool = False

    @classmethod
    def for_grading(cls, slot: int = 0, hide: Sequence[Path] = ()) -> Isolation:
        """As root: uid ``UNPRIVILEGED_UID + slot`` (one per concurrent job, so no two students'
        code share a user at once), every folder of ``hide`` and the home folders hidden."""
        if not is_root():
            return cls()
        folders = {str(Path(h).resolve()) for h in hide} | {"/root", "/home", _qkv_folder()}
        return cls((UNPRIVILEGED_UID + slot, UNPRIVILEGED_UID + slot), tuple(sorted(folders)))


class Child:
    """One student's function in a child process of its own (see the module doc).

    ``source``: the student's file (copied; the original is never opened by the child);
    ``function``: its name; ``forbid``: the names it may not call (replaced in the child by
    recorders); ``timeout``: seconds for everything, start-up included.
    """

    def __init__(self, source: str, function: str, forbid: Sequence[str] = (), timeout: float = TIMEOUT_S,
                 isolation: Isolation | None = None, filename: str | None = None) -> None:
        self.function = function
        self.timeout = float(timeout)
        self.deadline = time.monotonic() + self.timeout
        self.isolation = isolation or Isolation()
        self.proc: subprocess.Popen[bytes] | None = None
        self.filename = filename or f"{function}.py"
        self.loaded = Answer(False, error={"type": "start", "text": "not started"})
        try:
            started = launch.take() or launch.launch()
        except owned.ExitingError as e:
            raise ChildGoneError(str(e)) from None
        self.proc, self.folder, self._errors = started.proc, started.folder, started.errors
        try:
            (self.folder / self.filename).write_text(source, encoding="utf-8")
            self._start(forbid)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the process

    def _start(self, forbid: Sequence[str]) -> None:
        """The set-up, sent to the child started for this one (its file now in its folder)."""
        iso = self.isolation
        if iso.user is not None:
            uid, gid = iso.user
            os.chown(self.folder, uid, gid)
            os.chown(self.folder / self.filename, uid, gid)
        keep = sorted({sys.prefix, sys.base_prefix, *_site_folders(), str(self.folder)})
        setup = {
            "file": self.filename, "function": self.function, "forbid": list(forbid),
            "limits": {"memory_bytes": MEMORY_BYTES, "cpu_s": int(self.timeout) + 5, "file_bytes": FILE_BYTES,
                       "open_files": OPEN_FILES},
            "readable": _readable(), "refused": [_qkv_folder()],
            "preload": list(PRELOAD) if iso.user is not None else [],
            "user": list(iso.user) if iso.user is not None else None,
            "hide": list(iso.hide), "keep": keep, "network": iso.network,
        }
        self._send(setup)
        self.loaded = Answer.read(self._recv())

    def _send(self, value: Any, functions: list | None = None) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = encode(value, functions)
        try:
            self.proc.stdin.write(struct.pack(">Q", len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise ChildGoneError(self._why_gone()) from None

    def _read(self, n: int) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise ChildGoneError(f"it did not finish in {self.timeout:g} s (an infinite loop, or far too "
                                     "much work for these small inputs?)")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise ChildGoneError(self._why_gone())
            buf += chunk
        return bytes(buf)

    def _recv(self) -> Any:
        (n,) = struct.unpack(">Q", self._read(8))
        if n > MAX_BYTES:
            self.kill()
            raise ChildGoneError("the child's answer could not be read: did the code write to a file "
                                 "descriptor it was not given?")
        try:
            return decode(self._read(n))
        except WireError as e:
            self.kill()
            raise ChildGoneError(f"the child's answer could not be read ({e}): did the code write to a file "
                                 "descriptor it was not given?") from None

    def _why_gone(self) -> str:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=owned.WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return "the process stopped answering"
        if rc < 0:
            sig = -rc
            what = signal.strsignal(sig) or "?"  # "CPU time limit exceeded", "File size limit exceeded"
            return f"the process was killed by signal {sig} ({what})"
        if not self.loaded.ok and self.loaded.error.get("type") == "start":
            self._errors.seek(0)
            last = self._errors.read(4096).decode(errors="replace").strip().splitlines()[-1:]
            return f"the checking process could not start (exit code {rc}): {last[0] if last else ''}"[:300]
        return f"the process exited (code {rc}) during the call: os._exit or a crash ends it, not a return"

    def kill(self) -> None:
        """The child's whole process group killed and reaped, with a bounded wait (:mod:`qkv.owned`)."""
        if self.proc is not None:
            owned.end(self.proc)

    def close(self) -> None:
        """End the child (a polite goodbye, then its process group killed) and remove its folder."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self._send({"op": "bye"})
                except ChildGoneError:
                    pass
            self.kill()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        if hasattr(self, "_errors"):
            self._errors.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def call(self, args: Sequence[Any], kwargs: dict[str, Any], wrt: Sequence[int] = (),
             cotangents: Sequence[Any] = ()) -> Answer:
        """The student's function on ``args``/``kwargs`` in the child; with ``wrt``, the gradients
        of ``<outputs, cotangents>`` with respect to those positional tensor arguments."""
        if self.proc is None or self.proc.poll() is not None:
            raise ChildGoneError(self._why_gone() if self.proc is not None else "no child")
        req: dict[str, Any] = {"op": "vjp" if wrt else "call", "args": list(args), "kwargs": dict(kwargs)}
        if wrt:
            req.update(wrt=list(wrt), cotangents=list(cotangents))
        functions: list = []
        try:
            self._send(req, functions)
        except WireError as e:
            raise TypeError(f"this check cannot send {e}") from None
        verdict: BaseException | None = None
        while True:
            raw = self._recv()
            if not (isinstance(raw, dict) and "callback" in raw):
                break
            verdict = self._call_back(raw, functions) or verdict
        ans = Answer.read(raw)
        states = raw.get("generators") if isinstance(raw, dict) else None
        mine = leaves([list(args), dict(kwargs)], torch.Generator)
        if isinstance(states, list) and len(states) == len(mine):
            for g, state in zip(mine, states, strict=True):
                if isinstance(state, torch.Tensor) and state.dtype == torch.uint8:
                    g.set_state(state)  # the generator advanced in the child: so it does here
        if verdict is not None:
            raise verdict  # a check's own function (called back) failed the check
        return ans

    def _call_back(self, raw: dict[str, Any], functions: list) -> BaseException | None:
        """Run the grader's function the child called (a part the exercise composes) on the
        child's arguments, here; send its result back. A CheckError it raises is the check's
        verdict: kept, and raised once the call has answered."""
        from qkv.learn.exercise import CheckError

        i, args, kwargs = raw.get("callback"), raw.get("args") or [], raw.get("kwargs") or {}
        kept: BaseException | None = None
        if not (isinstance(i, int) and 0 <= i < len(functions)):
            reply: dict[str, Any] = {"ok": False, "text": "no such function"}
        else:
            try:
                reply = {"ok": True, "out": functions[i](*args, **kwargs)}
            except CheckError as e:
                kept, reply = e, {"ok": False, "text": "the check stopped here"}
            except Exception as e:
                reply = {"ok": False, "text": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
        try:
            self._send(reply)
        except WireError as e:
            self._send({"ok": False, "text": f"its result cannot be sent ({e})"})
        return kept


# ---------------------------------------------------------------------- the function the checks see


class _RemoteGrad(torch.autograd.Function):
    """A call whose tensor arguments require grad: forward runs in the child, backward asks the
    child for the vector-Jacobian product with the cotangents autograd gives here."""

    @staticmethod
    def forward(ctx, remote: Remote, layout: Any, *flat: torch.Tensor):  # type: ignore[override]
        args, kwargs = _fill(layout, list(flat))
        ctx.remote, ctx.args, ctx.kwargs = remote, args, kwargs
        tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.wrt = [i for j, i in enumerate(tensor_positions) if ctx.needs_input_grad[2 + j]]
        out = remote._answer(args, kwargs)
        outs = _tensor_leaves(out)
        ctx.n_out = len(outs)
        ctx.structure = out
        return tuple(o.clone() for o in outs) if outs else (torch.zeros(()),)

    @staticmethod
    def backward(ctx, *cots: torch.Tensor):  # type: ignore[override]
        plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in ctx.args]
        ans = ctx.remote.child.call(plain, ctx.kwargs, ctx.wrt, list(cots[: ctx.n_out]))
        ctx.remote._note(ans)
        if not ans.ok:
            raise _raised(ans.error, ans.prints)
        grads = ans.out if isinstance(ans.out, list) else []
        by_arg = dict(zip(ctx.wrt, grads, strict=False))
        flat_grads = [by_arg.get(i) if isinstance(a, torch.Tensor) else None
                      for i, a in enumerate(ctx.args) if isinstance(a, torch.Tensor)]
        return (None, None, *flat_grads)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensor_leaves(v)]
    return []


def _rebuild(value: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return leaves.pop(0)
    if isinstance(value, list):
        return [_rebuild(v, leaves) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, leaves) for v in value)
    return value


def _fill(layout: tuple[list[Any], dict[str, Any]], flat: list[torch.Tensor]) -> tuple[list[Any], dict]:
    args, kwargs = layout
    flat = list(flat)
    return [flat.pop(0) if a is _SLOT else a for a in args], kwargs


_SLOT = object()


class Remote:
    """The student's function as a check sees it (see the module doc). ``log``: every answer, for
    the diagnosis after a failed check (what was printed, which argument was changed in place)."""

    def __init__(self, child: Child, name: str) -> None:
        self.child = child
        self.__name__ = name
        self.log: list[Answer] = []

    def _note(self, ans: Answer) -> None:
        self.log.append(ans)

    def _answer(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        ans = self.child.call(args, kwargs)
        self._note(ans)
        if not ans.ok:
            raise _raised(ans.error, ans.prints)
        return ans.out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if not grad:
            return self._answer([a.detach() if isinstance(a, torch.Tensor) else a for a in args], kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        layout = ([_SLOT if isinstance(a, torch.Tensor) else a for a in args], kwargs)
        flat = _RemoteGrad.apply(self, layout, *tensors)
        out = self.log[-1].out if self.log else None
        return _rebuild(out, list(flat)) if _tensor_leaves(out) else out


# ---------------------------------------------------------------------- judging an exercise


def _said(e: BaseException, name: str, filename: str) -> str:
    """What a student reads when their function raised inside a check."""
    if isinstance(e, StudentRaisedError):
        if e.kind == "NotImplementedError":
            return f"{name} is not written yet (it raises NotImplementedError)"
        if e.kind == "prints":
            return (f"it printed more than {launch.PRINT_LIMIT:,} characters, so the call was "
                    "stopped there: remove the prints in loops")
        if e.kind == "SystemExit":
            return f"your function called sys.exit({e})"
        text = str(e)
        if e.kind == "MemoryError" or (isinstance(e, RuntimeError) and ("alloc" in text.lower() or
                                                                          "memory" in text.lower())):
            return f"your function ran out of memory (more than 2 GiB for small inputs): {text[:160]}"
        if e.kind == "unsendable":
            return f"your function returned {e}, which a check cannot read: return tensors or numbers"
        where = f" ({filename}:{e.line})" if e.line else ""
        return f"your function raised {e.kind}: {e}{where}"
    return f"the check could not run: {type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _feedback(remote: Remote, start: int) -> str:
    """What to add under a failed check: the inputs the function changed in place, and the first
    lines it printed during the check."""
    log = remote.log[start:]
    extra = []
    changed = sorted({c for a in log for c in a.changed})
    if changed:
        extra.append(f"your function changed {', '.join(changed)} in place: compute a new tensor instead "
                     "(x = x - m, not x -= m or x.sub_(m)); the check compared against the input as given")
    printed = "".join(a.prints for a in log)
    total = sum(a.printed for a in log)
    if printed.strip():
        lines = printed.rstrip("\n").splitlines()
        shown = "\n".join("          | " + ln[:160] for ln in lines[:8])
        more = f" (first 8 lines of {total:,} characters)" if len(lines) > 8 or total > len(printed) else ""
        extra.append(f"what it printed{more}:\n{shown}")
    return "".join("\n        " + x for x in extra)


def _forbid_verdict(check_forbids: tuple[str, ...], seen: set[str], source: str) -> str | None:
    """A "does not call X" check, judged here: the names the child saw called at run time, the
    names the source mentions, and constructs that could reach a function without naming it."""
    from qkv.learn.source import read_calls

    used = sorted(set(check_forbids) & seen)
    if used:
        return f"it calls {', '.join(used)}: the exercise is to write that yourself"
    reading = read_calls(source, check_forbids)
    if reading.named:
        return f"it uses {', '.join(reading.named[:3])}: the exercise is to write that yourself"
    if reading.reaching:
        return (f"it reaches past the exercise ({', '.join(reading.reaching[:3])}), so whether it calls "
                f"{', '.join(check_forbids)} cannot be told: write it with plain torch operations")
    return None


def judge(exercise: Exercise, source: str, timeout: float = TIMEOUT_S, seed_offset: int = 0,
          isolation: Isolation | None = None, filename: str | None = None) -> Report:
    """Every check of ``exercise`` on the function of that name in ``source``: the function runs
    in a :class:`Child`, the checks here (on inputs moved by ``seed_offset``; 0: the public
    ones). ``timeout`` bounds everything, the child's start included."""
    from qkv.learn.exercise import CheckResult, Report, Shown, other_inputs
    from qkv.learn.source import read_calls, untouched

    name = exercise.name
    shown = filename or f"{name}.py"
    if untouched(source, name):
        return Report(name, (), f"{name} is not written yet (it raises NotImplementedError)",
                      status="unwritten")
    if any(r.startswith(("import qkv", "from qkv")) for r in read_calls(source, ()).reaching):
        return Report(name, (), "the file imports qkv: the exercise is to write it yourself, so it scores 0",
                      status="refused")
    forbid = sorted({n for c in exercise.checks for n in c.forbids} | set(exercise.forbidden))
    try:
        child = Child(source, name, forbid, timeout, isolation, filename=shown)
    except ChildGoneError as e:
        return Report(name, (), str(e), status="error")
    with child:
        loaded = child.loaded
        if "import qkv" in loaded.refused:
            return Report(name, (), "the file imports qkv: the exercise is to write it yourself, so it "
                                    "scores 0", status="refused", notes=tuple(loaded.notes))
        if not loaded.ok:
            err = loaded.error
            kind = err.get("type")
            if kind == "prints":
                why = (f"the file printed more than {launch.PRINT_LIMIT:,} characters while it was "
                       "imported")
            elif kind == "SystemExit":
                why = "the file called sys.exit while it was imported"
            else:
                line = f" ({shown}:{err.get('line')})" if err.get("line") else ""
                why = f"importing the file raised {kind}: {err.get('text', '')}{line}"
            return Report(name, (), why, status="error", notes=tuple(loaded.notes))
        remote = Remote(child, name)
        results: list[CheckResult] = []
        gone, stubbed = "", 0  # stubbed: checks failed because the function raised NotImplementedError
        with other_inputs(int(seed_offset)):
            for c in exercise.checks:
                if c.forbids:
                    continue  # judged after every other check has called the function
                start = len(remote.log)
                try:
                    message = c.run(remote)
                except ChildGoneError as e:
                    gone = str(e)
                    break
                except Exception as e:
                    message = _said(e, name, shown)
                    stubbed += isinstance(e, StudentRaisedError) and e.kind == "NotImplementedError"
                if message is not None and not isinstance(message, Shown):
                    message += _feedback(remote, start)
                results.append(CheckResult.of(c.name, message))
        if gone:
            return Report(name, tuple(results), gone, status="error", notes=tuple(loaded.notes))
        seen = {f for a in remote.log for f in a.forbidden}
        for c in exercise.checks:
            if c.forbids:
                message = _forbid_verdict(c.forbids, seen, source)
                results.append(CheckResult(c.name, message is None, message or ""))
        ran = [r for r in results if r.name not in {c.name for c in exercise.checks if c.forbids}]
        if ran and stubbed == len(ran):
            return Report(name, (), f"{name} is not written yet (it raises NotImplementedError)",
                          status="unwritten", notes=tuple(loaded.notes))
        return Report(name, tuple(results), notes=tuple(loaded.notes))


def run_checks(name: str, path: Path, timeout: float = TIMEOUT_S, seed_offset: int = 0,
               isolation: Isolation | None = None) -> Report:
    """:func:`judge` on the file ``path`` (read and parsed here first: a syntax error or a
    missing function is an InputError, exit 2)."""
    from qkv.learn.catalog import get
    from qkv.learn.source import read_solution

    source = read_solution(name, path)
    return judge(get(name), source, timeout, seed_offset, isolation, filename=path.name)
