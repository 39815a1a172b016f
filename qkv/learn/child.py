"""The child that runs a student's function, and nothing else: it computes, the grader judges.

The grader (:mod:`qkv.learn.judge`, through :mod:`qkv.learn.launch`) starts ``python -I -S -c
PROGRAM`` (:func:`qkv.learn.launch.program`: this file's child half after :mod:`qkv.learn.wire`'s
functions, so the child imports neither qkv nor anything beside the student's file) in an empty
private folder holding a copy of the student's file, with a clean environment and no submission
folder, user site or start-up hook on its import path. Over two pipes it then receives, as data
(:mod:`qkv.learn.wire`):

1. the set-up: the import path (the folders torch needs, never qkv's), the limits, the function's
   name, the names it may not call, and, when grading as root, the unprivileged user to become and
   the folders to hide;
2. requests ``{"op": "call", "args", "kwargs"}`` or ``{"op": "vjp", ..., "cotangents"}`` (the
   gradient of ``<outputs, cotangents>`` with respect to the tensor arguments the grader chose),

and answers each with the outputs (or the exception's type, text and line in the student's
file), the first lines the function printed, the arguments it changed in place and the forbidden
functions it called. Nothing in an answer is a verdict: the grader compares the outputs with its
own references, so nothing the child prints, writes, patches or forges can pass a check.

Before the student's file is read, the child (trusted code, still alone in the process) limits
itself (CPU time, address space, file size, no new processes or threads, open files), becomes
the unprivileged user when started as root (after hiding the grader's and the other students'
folders and leaving the network, where the kernel allows it), replaces every function the
exercise forbids, by whatever name it is reached, with one that records the call, and installs an
audit hook (PEP 578, which cannot be removed) that refuses files outside the private folder and
Python's own, sockets, new processes, signals, ctypes and importing qkv; under it, where the
kernel has Landlock, the kernel refuses the same files and every TCP connection to native code too
(torch's C++ readers and writers, anything the audit hook does not see).
"""

from __future__ import annotations

import os
import sys

from qkv.learn.launch import PRINT_LIMIT, PRINTS_SHOWN, program

__all__ = ["PRINTS_SHOWN", "PRINT_LIMIT", "program"]  # this file's child half as the child runs it


# --------------------------------------------------------------------------- child
# This half runs in the child, after wire.py's functions (encode, decode, WireError, MAX_BYTES);
# imported as qkv.learn.child (by the grader, the tests), it takes them from qkv.learn.wire.
import io
import struct

if "encode" not in globals():
    from qkv.learn.wire import MAX_BYTES, WireError, decode, encode, leaves

_ACTIVE = [False]  # the student's function is running: forbidden calls are recorded
_SEEN: set[str] = set()
_REFUSED: list[str] = []  # what the audit hook refused while the student's code ran


class _PrintStorm(BaseException):
    """Raised by a print past PRINT_LIMIT: stops the call (a BaseException, so that the
    student's ``except Exception`` does not swallow it)."""


class _Prints(io.TextIOBase):
    """The student's prints of one call: the first PRINTS_SHOWN characters kept, the rest counted."""

    def __init__(self) -> None:
        self.kept = ""
        self.size = 0

    def write(self, s: str) -> int:
        s = str(s)
        if len(self.kept) < PRINTS_SHOWN:
            self.kept += s[: PRINTS_SHOWN - len(self.kept)]
        self.size += len(s)
        if self.size > PRINT_LIMIT:
            raise _PrintStorm()
        return len(s)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv(fd: int, stub=None):
    (n,) = struct.unpack(">Q", _read_exact(fd, 8))
    if n > MAX_BYTES:
        raise WireError("a request too large")
    return decode(_read_exact(fd, n), stub)


class GraderFunctionError(Exception):
    """A function the grader passed in (called back in the grader) raised there."""


def _callbacks(requests: int, answers: int):
    """``stub(i)``: a function that stands for the grader's i-th function of a request (a part
    the exercise composes, such as a norm or an MLP): calling it sends the arguments back to the
    grader, which runs its function and answers with the result."""

    def stub(i: int):
        def call_back(*args, **kwargs):
            _send(answers, {"callback": i, "args": list(args), "kwargs": dict(kwargs)})
            reply = _recv(requests)
            if isinstance(reply, dict) and reply.get("ok"):
                return reply.get("out")
            raise GraderFunctionError(str(reply.get("text", "")) if isinstance(reply, dict) else "")

        return call_back

    return stub


def _send(fd: int, value) -> None:
    try:
        data = encode(value)
    except WireError as e:  # the student's value has no data form: say so instead
        data = encode({"ok": False, "error": {"type": "unsendable", "text": str(e), "line": 0},
                       "prints": value.get("prints", ""), "printed": value.get("printed", 0)})
    msg = struct.pack(">Q", len(data)) + data
    view = memoryview(msg)
    while view:
        view = view[os.write(fd, view):]


# ----------------------------------------------------------------- limits, user, hiding


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _hide(hide: list[str], keep: list[str]) -> list[str]:
    """As root: a mount namespace of our own in which every folder of ``hide`` is an empty
    read-only tmpfs, except the folders of ``keep`` inside them (Python, the private folder),
    bound back where they were. Returns what could not be done (said in the grade output)."""
    import ctypes

    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    ms_rdonly, ms_remount, ms_bind, ms_rec, ms_private = 1, 32, 4096, 16384, 1 << 18
    clone_newns = 0x00020000
    if libc.unshare(clone_newns) != 0:
        return [f"no mount namespace (errno {ctypes.get_errno()}): other folders stay visible"]
    libc.mount(None, b"/", None, ms_rec | ms_private, None)
    problems = []
    staged = []
    stage_root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    for i, k in enumerate(keep):  # bind each kept folder aside first: hiding may cover it
        stage = os.path.join(stage_root, f".qkv-keep-{os.getpid()}-{i}")
        os.makedirs(stage, exist_ok=True)
        if libc.mount(k.encode(), stage.encode(), None, ms_bind | ms_rec, None) == 0:
            staged.append((k, stage))
    def under(path: str, roots: list[str]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    covered = []

    def cover(h: str) -> None:
        if os.path.isdir(h):
            if libc.mount(b"tmpfs", h.encode(), b"tmpfs", 0, b"mode=0711,size=64k") != 0:
                problems.append(f"could not hide {h}")
            else:
                covered.append(h)

    outer = [h for h in hide if not under(h, keep)]  # folders inside a kept one: after it is back
    for h in outer:
        cover(h)
    for k, stage in staged:
        if under(k, outer):
            os.makedirs(k, exist_ok=True)
            libc.mount(stage.encode(), k.encode(), None, ms_bind | ms_rec, None)
        libc.umount2(stage.encode(), 2)  # MNT_DETACH
    for h in hide:
        if h not in outer:
            cover(h)  # e.g. qkv installed inside the site-packages that came back
    for h in covered:  # read-only once the kept folders' mount points are made
        libc.mount(b"tmpfs", h.encode(), b"tmpfs", ms_remount | ms_rdonly, b"mode=0711,size=64k")
    return problems


def _leave_network() -> str:
    import ctypes

    clone_newnet = 0x40000000
    if _libc().unshare(clone_newnet) != 0:
        return f"no network namespace (errno {ctypes.get_errno()}): sockets are refused in Python only"
    return ""


def _limit(limits: dict) -> None:
    import resource

    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    for name, value in (("RLIMIT_AS", used + int(limits["memory_bytes"])),
                        ("RLIMIT_CPU", int(limits["cpu_s"])),
                        ("RLIMIT_FSIZE", int(limits["file_bytes"])),
                        ("RLIMIT_NOFILE", int(limits["open_files"])),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def _no_new_processes() -> None:
    """RLIMIT_NPROC 0: fork, clone and new threads fail (the kernel counts the user's processes,
    and ignores the limit only for root, which the child no longer is when it was)."""
    import resource

    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


# ----------------------------------------------------------------- forbidden calls, audit hook


def _record(name: str, fn):
    def recorded(*args, **kwargs):
        if _ACTIVE[0]:
            _SEEN.add(name)
        return fn(*args, **kwargs)

    recorded.__name__ = getattr(fn, "__name__", name)
    recorded.__doc__ = getattr(fn, "__doc__", None)
    return recorded


def _forbid(names: list[str]) -> None:
    """Every function, method or class of torch named in ``names``, wherever it is reachable by
    that name, replaced by one that records the call (classes: their construction)."""
    import torch
    import torch.nn.functional
    import torch.utils.flop_counter

    spaces = [torch, torch.nn, torch.nn.functional, torch.special, torch.linalg, torch.fft, torch.autograd,
              torch.utils.flop_counter, torch.utils.flop_counter.FlopCounterMode, torch._C._nn,
              torch._C._linalg, torch._C._special, torch.Tensor]
    for name in names:
        for space in spaces:
            obj = getattr(space, name, None)
            if obj is None:
                continue
            try:
                if isinstance(obj, type):
                    init = obj.__init__

                    def new_init(self, *a, __init=init, __name=name, **k):
                        if _ACTIVE[0]:
                            _SEEN.add(__name)
                        __init(self, *a, **k)

                    obj.__init__ = new_init
                elif callable(obj):
                    setattr(space, name, _record(name, obj))
            except (TypeError, AttributeError):
                pass


def _refuse_files_from_c() -> None:
    """What opens a path in C++, where the audit hook does not see it, refused outright:
    torch.from_file and Storage.from_file, torch.save/torch.load's archive reader and writer,
    TorchScript's loader, and torch.distributed's stores (sockets and files)."""
    import torch

    def refused(*a, **k):
        raise PermissionError("not available here: your function gets its inputs as arguments "
                              "and returns its answer (no files, no network)")

    places = [(torch, "from_file"), (torch.UntypedStorage, "from_file"), (torch.TypedStorage, "from_file")]
    places += [(torch._C, name) for name in ("PyTorchFileWriter", "PyTorchFileReader", "import_ir_module",
                                             "import_ir_module_from_buffer")]
    for space in (getattr(torch._C, "_distributed_c10d", None), sys.modules.get("torch.distributed")):
        places += [(space, name) for name in ("TCPStore", "FileStore") if space is not None]
    for space, name in places:
        if hasattr(space, name):
            try:
                setattr(space, name, refused)
            except (TypeError, AttributeError):
                pass


# Linux Landlock (kernel 5.13+; TCP rules 6.7+, scopes 6.12+): the same syscall numbers on every
# architecture. Rights on files, then on TCP ports, then scopes (include/uapi/linux/landlock.h).
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1, 2, 4, 8
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | (1 << 14) | (1 << 15)  # + truncate, ioctl


def _landlock(private: str, readable: list[str]) -> str:
    """The kernel's own fence (Landlock), under the audit hook: from here on this process and
    anything it could start may read only ``readable`` and write only ``private``, whether the
    path is opened by Python or by native code, bind or connect no TCP port, and signal or reach
    by abstract socket nothing outside itself. Returns what could not be done ("" when all was)."""
    import ctypes

    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return "no Landlock in this kernel: files and sockets are refused in Python only"
    fs = (1 << 13) - 1  # ABI 1's rights; then refer (2), truncate (3), device ioctl (5)
    fs |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net = 3 if abi >= 4 else 0  # bind and connect, every TCP port
    scoped = 3 if abi >= 6 else 0  # abstract unix sockets and signals outside the sandbox
    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    in_python_only = "files and sockets are refused in Python only"
    if ruleset < 0:
        return f"Landlock refused a ruleset (errno {ctypes.get_errno()}): {in_python_only}"

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        reading = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
        for path, rights in [(private, fs)] + [(p, reading) for p in readable]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a readable root this machine lacks
            try:
                if not os.path.isdir(path):
                    rights &= _LL_FILE_RIGHTS
                rule = PathBeneath(rights & fs, fd)
                libc.syscall(_LL_ADD_RULE, ruleset, ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: required to fence oneself
            return f"no_new_privs refused: {in_python_only}"
        if libc.syscall(_LL_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
            return f"Landlock not applied (errno {ctypes.get_errno()}): {in_python_only}"
    finally:
        os.close(ruleset)
    return ""


_BLOCKED_EVENTS = ("socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty",
                   "os.posix_spawn", "os.spawn", "os.kill", "signal.pthread_kill", "ctypes.",
                   "os.chdir", "os.fchdir", "os.symlink", "os.link", "os.chown", "os.chroot", "pty.",
                   "os.startfile", "webbrowser.", "winreg.", "_posixsubprocess", "os.setuid", "os.setgid",
                   "resource.setrlimit", "resource.prlimit", "sys.remote_exec", "os.setns", "os.unshare")
_CHANGES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate", "os.utime",
            "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree")


def _audit(private: str, readable: list[str], refused_dirs: list[str]):
    """The audit hook (PEP 578): files outside ``private`` (write) and ``private`` + ``readable``
    (read, but never ``refused_dirs``) refused, and every event of ``_BLOCKED_EVENTS``."""
    realpath, fspath = os.path.realpath, os.fspath
    o_write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path: str, roots) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def where(p) -> str:
        if isinstance(p, bytes):
            p = p.decode(errors="replace")
        return realpath(fspath(p))

    def refuse(what: str):
        if _ACTIVE[0] or len(_REFUSED) < 20:
            _REFUSED.append(what)
        raise PermissionError(f"not allowed here: {what} (your function may only compute)")

    def hook(event: str, args: tuple) -> None:
        if event == "import":
            name = args[0] or ""
            if name == "qkv" or name.startswith("qkv."):
                _REFUSED.append("import qkv")
                raise ImportError("qkv cannot be imported here: the exercise is to write it yourself")
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            p = where(path)
            writing = bool(flags & o_write) or any(c in (mode or "") for c in "wax+")
            if writing and not inside(p, [private]):
                refuse(f"writing {path}")
            if not inside(p, [private, *readable]) or inside(p, refused_dirs):
                refuse(f"opening {path}")
            return
        if event in ("os.listdir", "os.scandir"):
            p = where(args[0] if args and args[0] is not None else ".")
            if not inside(p, [private, *readable]) or inside(p, refused_dirs):
                refuse(f"listing {args[0]}")
            return
        if event.startswith(_CHANGES):
            for a in args:
                if isinstance(a, str | bytes | os.PathLike) and not inside(where(a), [private]):
                    refuse(f"{event} {a}")
            return
        if event.startswith(_BLOCKED_EVENTS):
            refuse(event)

    return hook


# ----------------------------------------------------------------- calls


def _where_in(e: BaseException, filename: str) -> int:
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
    return frames[-1].lineno or 0 if frames else 0


def _error(e: BaseException, filename: str) -> dict:
    """An exception of the student's code as data: its type (and the names of its bases, so the
    grader can raise the same built-in type), its text, its line in the student's file."""
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
            "text": " ".join(str(e).split())[:400], "line": _where_in(e, filename)}


def _clone(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _changed(fn, args: list, kwargs: dict, before: tuple) -> list[str]:
    """The names of the arguments whose tensors the call changed in place."""
    import inspect

    import torch

    names = [f"argument {i + 1}" for i in range(len(args))] + list(kwargs)
    try:
        params = list(inspect.signature(fn).parameters)
        names[: len(args)] = [params[i] if i < len(params) else names[i] for i in range(len(args))]
    except (TypeError, ValueError):
        pass
    out = []
    values, originals = [*args, *kwargs.values()], [*before[0], *before[1].values()]
    for name, now, then in zip(names, values, originals, strict=False):
        a, b = leaves(now, torch.Tensor), leaves(then, torch.Tensor)
        if len(a) != len(b) or any(
                x.shape != y.shape or x.dtype != y.dtype
                or not torch.equal(x.detach().contiguous().view(torch.uint8).reshape(-1),
                                   y.contiguous().view(torch.uint8).reshape(-1))
                for x, y in zip(a, b, strict=True)):
            out.append(name)
    return out


def _run(fn, req: dict, filename: str) -> dict:
    import torch

    args, kwargs = list(req.get("args") or []), dict(req.get("kwargs") or {})
    before = (_clone(args), _clone(kwargs))
    wrt = []
    if req["op"] == "vjp":
        for i in req["wrt"]:
            args[i] = args[i].detach().clone().requires_grad_(True)
            wrt.append(args[i])
    prints = _Prints()
    out_stream, err_stream = sys.stdout, sys.stderr
    _SEEN.clear()
    del _REFUSED[:]
    answer: dict = {"ok": True}
    sys.stdout = sys.stderr = prints
    _ACTIVE[0] = True
    try:
        with torch.enable_grad() if wrt else torch.no_grad():
            out = fn(*args, **kwargs)
            if wrt:
                outs = leaves(out, torch.Tensor)
                cots = list(req["cotangents"])
                pairs = [(o, c) for o, c in zip(outs, cots, strict=False)
                         if c is not None and o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [c.to(o.dtype) for o, c in pairs],
                                            allow_unused=True) if pairs else [None] * len(wrt)
        answer["out"] = [None if g is None else g.detach() for g in grads] if wrt else out
    except _PrintStorm:
        answer = {"ok": False, "error": {"type": "prints", "text": "", "line": 0}}
    except BaseException as e:  # everything the student's code may raise, SystemExit included
        _ACTIVE[0] = False
        answer = {"ok": False, "error": _error(e, filename)}
    finally:
        _ACTIVE[0] = False
        sys.stdout, sys.stderr = out_stream, err_stream
    answer.update(prints=prints.kept, printed=prints.size, forbidden=sorted(_SEEN),
                  refused=list(_REFUSED[:5]), changed=[] if wrt else _changed(fn, args, kwargs, before),
                  generators=[g.get_state() for g in leaves([args, kwargs], torch.Generator)])
    return answer


def _main() -> None:
    requests, answers = 0, os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the answers have their own descriptor; what is written to 1 goes nowhere
    import torch  # before the set-up comes: a child started ahead imports it meanwhile

    torch.set_num_threads(1)
    setup = _recv(requests)
    for name in setup.get("preload", []):  # what torch imports lazily, while it can still be read
        try:
            __import__(name)
        except Exception:  # a module this torch lacks
            pass
    notes = []
    if setup.get("user"):
        notes += _hide(list(setup.get("hide", [])), list(setup.get("keep", [])))
        if setup.get("network") is False:
            note = _leave_network()
            if note:
                notes.append(note)
        uid, gid = setup["user"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _limit(setup["limits"])
    _forbid(list(setup.get("forbid", [])))
    _refuse_files_from_c()
    private = os.path.realpath(os.getcwd())
    readable = [os.path.realpath(p) for p in setup["readable"]]
    fence = _landlock(private, readable)
    if fence:
        notes.append(fence)
    _no_new_processes()
    sys.addaudithook(_audit(private, readable,
                            [os.path.realpath(p) for p in setup.get("refused", [])]))
    os.dup2(null, 2)  # from here on the student's code runs: its writes to the terminal go nowhere
    filename = os.path.join(private, setup["file"])
    prints = _Prints()
    sys.stdout = sys.stderr = prints
    loaded: dict = {"ok": True, "notes": notes}
    _ACTIVE[0] = True
    try:
        with open(filename, encoding="utf-8") as f:
            source = f.read()
        import types

        module = types.ModuleType("student")
        module.__file__ = filename
        sys.modules["student"] = module
        exec(compile(source, filename, "exec"), module.__dict__)  # the student's file, sandboxed
        fn = module.__dict__.get(setup["function"])
        if not callable(fn):
            raise TypeError(f"{setup['function']} is not a function")
    except _PrintStorm:
        loaded = {"ok": False, "error": {"type": "prints", "text": "", "line": 0}, "notes": notes}
    except BaseException as e:
        loaded = {"ok": False, "notes": notes, "error": _error(e, filename)}
    finally:
        _ACTIVE[0] = False
        sys.stdout = sys.__stdout__
    loaded.update(prints=prints.kept, printed=prints.size, refused=list(_REFUSED[:5]),
                  forbidden=sorted(_SEEN))
    _send(answers, loaded)
    if not loaded["ok"]:
        return
    stub = _callbacks(requests, answers)
    while True:
        try:
            req = _recv(requests, stub)
        except (EOFError, WireError):
            return
        if req.get("op") == "bye":
            return
        _send(answers, _run(fn, req, filename))


if __name__ == "__main__":
    _main()
