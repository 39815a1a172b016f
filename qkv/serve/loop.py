"""The server's one compute loop: every model computation of ``qkv serve`` runs on one thread.

HTTP handlers only check a request, queue its computation here and wait for the answer (or, for
``/api/generate``, stream the tokens a running batch produces); they never run a model. The loop
owns all compute, as llama.cpp's server does (one loop over its slots) and nanochat's engine:

- each turn it steps every model's running batch once (:mod:`qkv.serve.batching`: each
  generation request is a row; a row joins by a prefill of its prompt between two steps), then
  runs one slice of a queued computation: an image or a model's loading whole, the others
  (attention, lens, q·k, patching) in pieces for at most :data:`SLICE_S` seconds (tokens
  first: a stream waits for one slice, not for a whole computation);
- a computation runs alone on the model: a hook or an edit one request installs (the lens's
  ablation and patching put hooks on the shared model object) exists only while one of its
  pieces runs, and no other forward pass runs on that model meanwhile;
- the queue is fair per client, not first come first served over requests: each client (the
  page's ``X-QKV-Client`` id, else its address; :data:`CLIENT`) has its own queue and the loop
  takes one computation from each in turn, interactive ones (lens, q·k, attention) before sweeps
  (patching: at most two interactive in a row while a sweep waits, so sweeps are slowed, never
  starved), so one student's burst or sweep never holds the others back more than one
  computation; it is bounded: at most ``max_queued`` computations wait (beyond:
  :class:`BusyError`, a 503 with ``Retry-After``), and one that waited ``max_wait_s`` without
  starting is answered 503 instead of being run late.

One thread for all models, not one per model: OpenMP (PyTorch's CPU kernels and the saved
steps) keeps a worker pool for every thread that computes, and with two pools alive on two cores
libgomp makes the workers sleep between parallel regions; a running batch then decoded at 50
instead of 108 tok/s (measured, BENCHMARKS.md). With one compute thread there is one pool, and
no thread needs to end to give its pool back.
"""

from __future__ import annotations

import atexit
import collections
import contextvars
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# Who is asking: set per request by the server (qkv.serve.app), read by ComputeLoop.call.
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("qkv_client", default="")


SLICE_S = 0.04  # the longest the loop runs a computation in pieces before its batches step again
# (a piece is not started when one as long as the slice's longest so far would overrun it; one
# piece always runs)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 12th, 13th, ... 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class BusyError(Exception):
    """Too many requests right now; retry after ``retry_after`` seconds (a 503)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Stepper(Protocol):
    """What the loop steps each turn: a model's running batch (:class:`~qkv.serve.batching.ModelBatch`)."""

    def busy(self) -> bool:
        """Whether it has rows decoding or waiting."""
        ...

    def tick(self) -> None:
        """Admit waiting rows and take one step (in the loop's thread); never raises."""
        ...

    def close(self) -> None:
        """End every row (the server stops)."""
        ...


class CancelledError(Exception):
    """Every client waiting for a computation went away before it finished (it was stopped)."""


class Job:
    """One queued computation and where its answer goes: ``future`` (its answer or exception),
    ``progress`` (the last (done, total) a computation in pieces reported, else None) and
    ``waiters`` (the requests waiting for it: one, or more when identical requests share it)."""

    def __init__(self, fn: Callable[[], Any], label: str, client: str, sweep: bool,
                 pieces: bool = False) -> None:
        self.fn, self.label, self.client, self.sweep, self.pieces = fn, label, client, sweep, pieces
        self.queued = time.monotonic()
        self.future: Future[Any] = Future()
        self.steps: Iterator[Any] | None = None  # a computation in pieces, once started
        self.progress: tuple[int, int] | None = None
        self.waiters = 1
        self.cancelled = False

    @classmethod
    def answered(cls, value: Any, label: str = "request") -> Job:
        """A job already done (an answer from a cache)."""
        job = cls(lambda: value, label, "", False)
        job.future.set_result(value)
        return job


def _cancelled(job: Job) -> CancelledError:
    return CancelledError(f"the {job.label} was cancelled: its client went away")


_LOOPS: weakref.WeakSet[ComputeLoop] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # a thread still inside a kernel when the interpreter goes aborts it
    for loop in list(_LOOPS):
        loop.close()


class ComputeLoop:
    """The thread that runs every computation and every running batch of a server.

    Args:
        max_queued: computations that may wait at once; beyond, :class:`BusyError`.
        max_wait_s: the longest a computation may wait to start; beyond, :class:`BusyError`.
    """

    def __init__(self, max_queued: int = 32, max_wait_s: float = 30.0) -> None:
        if max_queued < 1 or max_wait_s < 0:
            raise ValueError(f"max_queued must be >= 1 and max_wait_s >= 0, got {max_queued} and "
                             f"{max_wait_s}")
        self.max_queued, self.max_wait_s = max_queued, max_wait_s
        self._cond = threading.Condition()
        self._jobs = _FairQueue()
        self._batches: dict[Hashable, Stepper] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self._seconds = 0.5  # a running mean of a computation's time, for Retry-After
        self._current: Job | None = None  # an interactive computation in pieces, to go on first
        self._running: Job | None = None
        self.jobs_run = 0  # computations run (tests, benchmarks)
        self.cancelled = 0  # computations stopped because their clients went away
        self.turns = 0  # turns of the loop that stepped a batch
        _LOOPS.add(self)

    # ------------------------------------------------------------------ from request threads

    @property
    def thread(self) -> threading.Thread | None:
        """The loop's thread (None before the first request)."""
        return self._thread

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def waiting(self) -> int:
        """Computations queued and not started."""
        with self._cond:
            return len(self._jobs)

    def call(self, fn: Callable[..., T], *args: Any, label: str = "request", sweep: bool = False) -> T:
        """``fn(*args)`` run by the loop; its answer (or its exception) returned here, in the
        caller's thread, which waits. Called from the loop itself (a computation that needs
        another), it runs at once. Queued under the client of :data:`CLIENT`; ``sweep``: behind
        every interactive computation. BusyError when the queue is full, or when it waited
        ``max_wait_s`` without starting."""
        if self.in_loop():
            return fn(*args)
        return self.submit(fn, *args, label=label, sweep=sweep).future.result()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str = "request", sweep: bool = False,
               pieces: bool = False) -> Job:
        """Queue ``fn(*args)`` and return at once: its :class:`Job` (wait on ``job.future``; ask
        :meth:`position`; :meth:`leave` it). ``pieces``: ``fn(*args)`` is a generator run a
        slice at a time: the loop runs its pieces for at most :data:`SLICE_S` seconds, then steps
        every running batch (tokens first); an interactive computation then goes on before any
        other, a sweep goes behind the others' requests (interactive ones first). Between two
        pieces nothing of it may stay on a shared model (no hook). BusyError (a 503 that says
        the queue's length) when ``max_queued`` computations wait already."""
        job = Job(lambda: fn(*args), label, CLIENT.get(), sweep, pieces)
        with self._cond:
            if self._closing:
                raise BusyError("the server is stopping", 5)
            if len(self._jobs) >= self.max_queued:
                n = len(self._jobs)
                raise self._busy(f"{n} requests are waiting; yours would be the {ordinal(n + 1)}")
            self._jobs.append(job)
            self._start()
            self._cond.notify_all()
        return job

    def position(self, job: Job) -> int | None:
        """Where ``job`` stands: 0 running (started, or one piece done), n >= 1 the n-th to start
        if nothing else arrives (the fair queue's order), None done."""
        if job.future.done():
            return None
        with self._cond:
            if job.steps is not None or job is self._running:
                return 0
            order = self._jobs.order()
        try:
            return order.index(job) + 1
        except ValueError:
            return 0  # taken off the queue: starting now

    def leave(self, job: Job) -> None:
        """A request waiting for ``job`` went away (its stream was closed); when none waits any
        more and it has not finished, it is stopped: taken off the queue, or (in pieces) closed
        before its next piece, and answered :class:`CancelledError`."""
        with self._cond:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            job.cancelled = True
            # one started (pieces) is stopped by the loop, which closes it in its own thread
            removed = job.steps is None and self._jobs.remove(job)
            if removed:
                self.cancelled += 1
        if removed:  # outside the lock: the future's callbacks (qkv.serve.sharing) take their own
            job.future.set_exception(_cancelled(job))

    def add_batch(self, key: Hashable, make: Callable[[], Stepper]) -> Stepper:
        """The running batch under ``key`` (a loaded model), made by ``make`` the first time."""
        with self._cond:
            b = self._batches.get(key)
            if b is None:
                b = self._batches[key] = make()
            return b

    def drop_batch(self, key: Hashable) -> None:
        """Forget a model's running batch (its model was unloaded); its rows end."""
        with self._cond:
            b = self._batches.pop(key, None)
        if b is not None:
            b.close()

    def wake(self) -> None:
        """A batch has new work (a row waiting): take it at the next turn."""
        with self._cond:
            self._start()
            self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """End every row and every waiting computation (503), and stop the thread (waiting at
        most ``timeout`` s for the computation in progress)."""
        with self._cond:
            self._closing = True
            jobs, self._jobs = self._jobs.drain(), _FairQueue()
            if self._current is not None:
                jobs.append(self._current)
                self._current = None
            batches = list(self._batches.values())
            self._cond.notify_all()
            thread = self._thread
        for job in jobs:  # their finally blocks run: a model one holds is released
            self._stop(job, BusyError("the server is stopping", 5))
        for b in batches:
            b.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _busy(self, why: str) -> BusyError:
        after = max(1, min(60, math.ceil(self._seconds * (1 + len(self._jobs)))))
        return BusyError(f"the server is busy ({why}); try again in {after} s", after)

    def _start(self) -> None:
        """Under the lock: the thread, started on first use."""
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._run, name="qkv-compute", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the loop's thread

    def _next(self) -> tuple[Job | None, list[Stepper]] | None:
        """Wait for work: (a computation or None, the batches with rows); None: closing."""
        with self._cond:
            while True:
                if self._closing:
                    return None
                active = [b for b in self._batches.values() if b.busy()]
                if self._current is not None:
                    job, self._current = self._current, None
                    self._running = job
                    return job, active
                if self._jobs or active:
                    job = self._jobs.pop() if self._jobs else None
                    self._running = job
                    return job, active
                self._cond.wait()

    def _run(self) -> None:
        while (got := self._next()) is not None:
            job, active = got
            for b in active:  # one step of every running batch first (each catches its own errors)
                b.tick()
            if active:
                self.turns += 1
            if job is not None:
                self._do(job)
                self._running = None

    def _do(self, job: Job) -> None:
        waited = time.monotonic() - job.queued
        if job.cancelled:
            self._stop(job, _cancelled(job))
            self.cancelled += 1
            return
        if job.steps is None and waited > self.max_wait_s:  # too late to be useful: busy, not run
            after = max(1, min(60, math.ceil(self._seconds)))
            job.future.set_exception(BusyError(f"the server is busy (the {job.label} waited "
                                               f"{waited:.0f} s); try again in {after} s", after))
            return
        t0 = time.monotonic()
        try:
            if not job.pieces:
                job.future.set_result(job.fn())
                self.jobs_run += 1
                return
            if job.steps is None:
                job.steps = job.fn()
            longest = 0.0  # this slice's longest piece so far
            while True:  # pieces for at most one slice, then the running batches step again
                t = time.monotonic()
                got = next(job.steps)
                if got is not None:
                    job.progress = got
                now = time.monotonic()
                longest = max(longest, now - t)
                if now - t0 + longest > SLICE_S:  # another piece like the longest would overrun it
                    break
            with self._cond:
                if not self._closing:
                    if job.sweep:
                        self._jobs.append(job)  # behind the others' requests
                    else:
                        self._current = job  # on first, after the batches' next step
                    self._cond.notify_all()
                    return
            self._stop(job, BusyError("the server is stopping", 5))
        except StopIteration as done:
            job.future.set_result(done.value)
            self.jobs_run += 1
        except BaseException as e:  # the request hears of it, the loop goes on
            job.future.set_exception(e)
            self.jobs_run += 1
        finally:
            self._seconds = 0.8 * self._seconds + 0.2 * (time.monotonic() - t0)

    @staticmethod
    def _stop(job: Job, why: Exception) -> None:
        """End ``job`` unfinished: its pieces closed (their finally blocks release what they
        hold), its waiters told ``why``."""
        if job.steps is not None:
            close = getattr(job.steps, "close", None)
            if close is not None:
                close()
        if not job.future.done():
            job.future.set_exception(why)


class _FairQueue:
    """The waiting computations: a queue per (class, client), taken round robin over the
    clients of a class, interactive (class 0) before sweeps (class 1), but never more than
    :attr:`BURST` interactive ones in a row while a sweep waits (a sweep is slower, not starved)."""

    BURST = 2

    def __init__(self) -> None:
        self._in_a_row = 0
        self._queues: dict[tuple[int, str], collections.deque[Job]] = {}
        self._turns: tuple[collections.deque[str], collections.deque[str]] = (collections.deque(),
                                                                              collections.deque())
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, job: Job) -> None:
        key = (int(job.sweep), job.client)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = collections.deque()
            self._turns[key[0]].append(job.client)
        q.append(job)
        self._n += 1

    def pop(self) -> Job:
        """The next computation: the first of the next client's queue in the first class that
        has one; that client goes to the back of its class's turn."""
        order = (1, 0) if self._in_a_row >= self.BURST and self._turns[1] else (0, 1)
        for cls in order:
            turn = self._turns[cls]
            if turn:
                self._in_a_row = self._in_a_row + 1 if cls == 0 else 0
                client = turn.popleft()
                q = self._queues[(cls, client)]
                job = q.popleft()
                if q:
                    turn.append(client)
                else:
                    del self._queues[(cls, client)]
                self._n -= 1
                return job
        raise IndexError("no computation is waiting")

    def remove(self, job: Job) -> bool:
        """Take ``job`` off the queue (its client went away); False when it is not queued."""
        key = (int(job.sweep), job.client)
        q = self._queues.get(key)
        if q is None or job not in q:
            return False
        q.remove(job)
        self._n -= 1
        if not q:
            del self._queues[key]
            self._turns[key[0]].remove(job.client)
        return True

    def order(self) -> list[Job]:
        """The waiting computations in the order :meth:`pop` would give them, if nothing else
        arrived (what a waiting client is told of its place)."""
        copy = _FairQueue()
        copy._in_a_row, copy._n = self._in_a_row, self._n
        copy._queues = {k: collections.deque(q) for k, q in self._queues.items()}
        copy._turns = (collections.deque(self._turns[0]), collections.deque(self._turns[1]))
        return [copy.pop() for _ in range(len(copy))]

    def drain(self) -> list[Job]:
        jobs = [j for q in self._queues.values() for j in q]
        self._queues.clear()
        for turn in self._turns:
            turn.clear()
        self._n = 0
        return jobs
