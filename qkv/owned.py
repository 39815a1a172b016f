"""Processes qkv starts and owns: each in a process group of its own, ended with its owner.

A compiler building a kernel (:mod:`qkv.native`) or the child that runs a student's function
(:mod:`qkv.learn.judge`) is started here, recorded, and ended here: its whole process group
killed and reaped with a bounded wait, when its caller is done with it, when a call times out,
and at the latest when this Python process exits. Only a group this process started is ever
signalled; this module is the one place in qkv that sends a signal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

WAIT_S = 5.0  # after SIGKILL, how long to wait for the process to be reaped

_RUNNING: set[subprocess.Popen] = set()  # processes this process started that are still running
_LOCK = threading.Lock()
_CLOSING = threading.Event()  # set at exit: nothing starts after it


class ExitingError(RuntimeError):
    """This process is exiting: a process started now would be orphaned."""


def start(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen)`` in a session (and process group) of its own, recorded
    so that it is ended at exit; :func:`end` ends it."""
    with _LOCK:  # started and recorded at once: an exit in between would miss it
        if _CLOSING.is_set():
            raise ExitingError("this process is exiting")
        proc = subprocess.Popen(cmd, start_new_session=True, **popen)
        _RUNNING.add(proc)
    return proc


@contextlib.contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block, then as it was; no process :func:`start`
    starts meanwhile (it would inherit the value). For a library that reads one variable at one
    call (AOTInductor's loader reads TMPDIR)."""
    with _LOCK:
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old


def end(proc: subprocess.Popen) -> int | None:
    """Kill ``proc``'s process group (started by :func:`start`) and reap it, waiting at most
    ``WAIT_S``; returns its exit status (None if it could not be reaped in time)."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: pgid == pid
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc.wait(WAIT_S)
    with _LOCK:
        if proc.returncode is not None:
            _RUNNING.discard(proc)
    return proc.returncode


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``cmd`` (a compiler) run to completion and its output captured, like ``subprocess.run``,
    but never outliving this process: its group (the compiler driver and what it starts: cc1plus,
    as, ld) is killed if this process exits first (a server stopped while a kernel compiles in
    the background, a Ctrl-C), if the call times out, or if the waiting thread is interrupted.
    ``env``: its environment (default: this process's)."""
    proc = start(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        end(proc)
        raise
    finally:
        with _LOCK:
            if proc.returncode is not None:
                _RUNNING.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@atexit.register
def _end_running() -> None:
    with _LOCK:
        _CLOSING.set()
        left = list(_RUNNING)
    for proc in left:
        end(proc)
