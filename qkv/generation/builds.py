"""The saved decoding step's life, in one place: whether a model has one here (:func:`status`),
building it (:func:`ensure`), and whether a request decodes through it (:func:`decide`,
:func:`decoder_for`), for every caller alike: ``qkv generate``, ``qkv prepare``, ``qkv serve``,
:class:`~qkv.pipelines.CausalLM` and the running batch.

A saved step (:mod:`qkv.generation.aot`) is built once per model shape x weight format x thread
count x machine, in the foreground of the process that asks for it: ``qkv prepare MODEL`` (and
``qkv assets install smollm2``, which prepares the bundled model), ``lm.prepare()`` in Python,
``qkv generate --compile on``, ``qkv serve --build-steps``. Nothing is built behind the user's
back and no process is left running: a build is a function call that returns when it is done.
Without one, decoding runs eagerly (about half the speed) and says so once per process, with
the command that builds it.

Every answer is a typed value: :class:`StepStatus` (ready / missing / building / unavailable,
the reason as a :class:`Why`, for a key that changed the fields that differ), and
:class:`Decision` (which decoder runs a request's steps and why not the saved step).
"""

from __future__ import annotations

import json
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from qkv.generation import aot, native_step
from qkv.generation.decoders import DecodeMode, EagerDecoder, StepDecoder
from qkv.models.gpt import GPT
from qkv.native import NativeError, compiler


class State(str, Enum):
    """Where a model's saved step stands on this machine."""

    READY = "ready"  # built for exactly this key, and loaded
    MISSING = "missing"  # can be built here (qkv prepare MODEL)
    BUILDING = "building"  # another process (or thread) is building it now
    UNAVAILABLE = "unavailable"  # cannot be built or used here (see Why)


class Why(str, Enum):
    """Why a request does not decode through the saved step."""

    OFF = "off"  # QKV_SAVED_STEP=off or QKV_CACHE_DIR=off
    NO_COMPILER = "no-compiler"  # no C++ compiler on this machine
    SHORT_CONTEXT = "short-context"  # a context under 8 tokens
    FOLDER = "folder"  # the cache folder is not private or not writable
    NOT_BUILT = "not-built"  # never built for this model here
    OTHER_KEY = "other-key"  # built, but for another thread count, CPU, torch or qkv version
    BUILDING = "building"  # being built by another process
    FAILED = "failed"  # building it failed in this process
    TOO_LONG = "too-long"  # the request is longer than the step's fixed cache
    ROWS = "rows"  # a batch of several prompts in one call (the running batch has its own step)
    NOT_ASKED = "not-asked"  # mode jit or eager


SAID_ALWAYS = {Why.OFF, Why.NOT_ASKED}  # the user's own choice: nothing to say


@dataclass(frozen=True)
class StepStatus:
    """A model's saved step on this machine, for ``rows`` rows (1: one request; more: a running
    batch) and ``cache_len`` positions. ``why`` is None when ready; ``differs``: for
    :attr:`Why.OTHER_KEY`, what differs from the nearest step built (``"threads"``, ``"cpu"``,
    ``"torch"``, ``"code"``, ...); ``detail``: the words behind a failure; ``seconds``: how long
    :func:`ensure` took to build it (0 when it was there)."""

    state: State
    why: Why | None
    rows: int
    cache_len: int
    step: aot.SavedStep | None = None
    differs: tuple[str, ...] = ()
    detail: str = ""
    seconds: float = 0.0

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    def message(self) -> str:
        """One line for people: what the state is and what to do about it."""
        what = "saved step" if self.rows == 1 else \
            f"saved step for {self.rows} rows x {self.cache_len} positions"
        if self.ready:
            return f"{what} ready" + (f" (built in {self.seconds:.0f} s)" if self.seconds else "")
        return f"no {what}: {explain(self.why, self.differs, self.detail)}"


def explain(why: Why | None, differs: tuple[str, ...] = (), detail: str = "") -> str:
    """Why not the saved step, in words (the reason comes as data; this is its one wording)."""
    words = {
        Why.OFF: "saved steps are off (QKV_SAVED_STEP=off or QKV_CACHE_DIR=off)",
        Why.NO_COMPILER: "no C++ compiler here (apt-get install g++)",
        Why.SHORT_CONTEXT: "the model's context is too short for one",
        Why.FOLDER: f"qkv's cache folder cannot hold one ({detail})",
        Why.NOT_BUILT: "none built for this model on this machine",
        Why.OTHER_KEY: f"built for another {', '.join(differs) or 'machine'}, not for this process",
        Why.BUILDING: "another process is building it now",
        Why.FAILED: f"building it failed ({detail})",
        Why.TOO_LONG: f"prompt + new tokens exceed {detail or 'its cache'}",
        Why.ROWS: "several prompts in one call decode as a running batch",
        Why.NOT_ASKED: "not asked for",
    }
    return words.get(why, "unknown") if why is not None else "ready"


# --------------------------------------------------------------------------- status


RECHECK_S = 30.0  # how long "missing" is believed before the folder is read again
_MEMO: weakref.WeakKeyDictionary[GPT, dict[tuple[int, int], tuple[StepStatus, str, float]]] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.RLock()  # one load per model and key, however many threads ask


def _key_fields(info: dict) -> dict[str, object]:
    """The fields of a step's key a user can change, by the name a message gives them."""
    return {"threads": info.get("threads"), "CPU": info.get("cpu"), "torch": (info.get("torch"),
            info.get("torch_git")), "compiler": info.get("compiler"), "qkv code": info.get("code"),
            "step format": info.get("step_version")}


def _differs(model: GPT, S: int, rows: int, info: dict) -> tuple[str, ...]:
    """What differs between this key and the nearest step built for the same model shape, rows
    and cache length (empty when there is none)."""
    try:
        root = aot.folder()
    except aot.SavedStepError:
        return ()
    want = _key_fields(info)
    best: tuple[str, ...] | None = None
    for meta in root.glob(f"*/{aot.META}"):
        try:
            other = json.loads(meta.read_text()).get("info", {})
        except (OSError, ValueError):
            continue
        if (other.get("model"), other.get("batch"), other.get("cache_len")) != (info["model"], rows, S):
            continue
        have = _key_fields(other)
        diff = tuple(k for k in want if json.dumps(want[k], sort_keys=True) != json.dumps(have[k],
                                                                                       sort_keys=True))
        if diff and (best is None or len(diff) < len(best)):
            best = diff
    return best or ()


def status(model: GPT, rows: int = 1, cache_len: int | None = None) -> StepStatus:
    """The saved step of ``model`` for ``rows`` rows and ``cache_len`` positions (default
    :func:`qkv.generation.aot.cache_len_for`) on this machine, loaded if it is there (once per
    model and key; milliseconds). Builds nothing."""
    S = aot.cache_len_for(model, cache_len)
    if not aot.enabled():
        return StepStatus(State.UNAVAILABLE, Why.OFF, rows, S)
    if S < 8:
        return StepStatus(State.UNAVAILABLE, Why.SHORT_CONTEXT, rows, S)
    with _LOCK:
        key, info = aot.step_key(model, S, rows)
        memo = _MEMO.setdefault(model, {})
        got = memo.get((rows, S))
        if got is not None and got[1] == key:
            st, _, when = got
            if st.ready or st.why is Why.FAILED or time.monotonic() - when < RECHECK_S:
                return st
        st = _look(model, S, rows, key, info)
        memo[(rows, S)] = (st, key, time.monotonic())
        return st


def _look(model: GPT, S: int, rows: int, key: str, info: dict) -> StepStatus:
    try:
        aot.folder()  # private and writable, or no step can be kept here
        step = aot.load(model, S, rows)
    except (aot.SavedStepError, NativeError) as e:
        return StepStatus(State.UNAVAILABLE, Why.FOLDER, rows, S, detail=_short(e))
    if step is not None:
        return StepStatus(State.READY, None, rows, S, step=step)
    if compiler() is None:
        return StepStatus(State.UNAVAILABLE, Why.NO_COMPILER, rows, S)
    if aot.building(key):
        return StepStatus(State.BUILDING, Why.BUILDING, rows, S)
    differs = _differs(model, S, rows, info)
    if differs:
        return StepStatus(State.MISSING, Why.OTHER_KEY, rows, S, differs=differs)
    return StepStatus(State.MISSING, Why.NOT_BUILT, rows, S)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


Stage = Literal["exporting", "compiling", "loading"]


def ensure(model: GPT, rows: int = 1, cache_len: int | None = None,
           on_stage: Callable[[Stage], object] | None = None) -> StepStatus:
    """The saved step of ``model`` (see :func:`status`), built here and now if it is missing:
    export, compile (tens of seconds to minutes, once per model and machine), load. Waits for a
    build of the same key in another process instead of building it twice. ``on_stage`` is
    told each stage as it begins (a progress display). A failure is a status (UNAVAILABLE,
    FAILED, with the words), never an exception: decoding stays eager."""
    st = status(model, rows, cache_len)
    if st.state not in (State.MISSING, State.BUILDING):
        return st
    S = st.cache_len
    t0 = time.perf_counter()
    with _LOCK:
        key, _ = aot.step_key(model, S, rows)
        try:
            aot.build(model, S, rows, on_stage=on_stage)
            if on_stage is not None:
                on_stage("loading")
            step = aot.load(model, S, rows)
            if step is None:
                raise aot.SavedStepError("the step built does not load")
            st = StepStatus(State.READY, None, rows, S, step=step, seconds=time.perf_counter() - t0)
        except Exception as e:  # a compiler error is not one exception type: any failure decodes eagerly
            st = StepStatus(State.UNAVAILABLE, Why.FAILED, rows, S, detail=_short(e))
        # remembered as found, not as built: a later status says "ready", not "built in ..."
        _MEMO.setdefault(model, {})[(rows, S)] = (replace(st, seconds=0.0), key, time.monotonic())
    return st


def forget(model: GPT) -> None:
    """Drop what this process remembers of ``model``'s steps (the next status reads the folder)."""
    with _LOCK:
        _MEMO.pop(model, None)


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Decision:
    """Which decoder runs a request's 1-token steps, and why not the saved step.

    ``kind``: "native" (:mod:`qkv.generation.native_step`), "saved", "jit" or "eager". ``step``:
    the saved step when kind is "saved".
    ``status``: the saved step's status where one was looked for. ``why``: why the saved step
    is not used (None when it is). ``decoder``: what :func:`decoder_for` chose (None from
    :func:`decide`, which the running batch asks)."""

    kind: Literal["native", "saved", "jit", "eager"]
    why: Why | None = None
    status: StepStatus | None = None
    decoder: StepDecoder | None = field(default=None, compare=False)

    @property
    def step(self) -> aot.SavedStep | None:
        return None if self.status is None else self.status.step

    def says(self) -> str:
        """'saved step (loaded in 14 ms)', 'eager (no saved step: none built ...)', 'jit'."""
        if self.kind == "saved":
            st = self.status
            assert st is not None and st.step is not None
            built = f"built in {st.seconds:.0f} s, " if st.seconds else ""
            return f"saved step ({built}loaded in {st.step.load_seconds * 1000:.0f} ms)"
        if self.kind == "jit":
            return "torch.compile step"
        if self.kind == "native":
            return "native step"
        if self.why in (None, Why.NOT_ASKED):
            return "eager"
        st = self.status
        return f"eager: {explain(self.why, st.differs if st else (), st.detail if st else '')}"


def decide(model: GPT, mode: DecodeMode | str, rows: int = 1, cache_len: int | None = None,
           need: int | None = None) -> Decision:
    """The one rule for whether decoding goes through the saved step: in mode ``auto`` when one
    is ready, in mode ``build`` after building it if missing (:func:`ensure`), never in ``jit``
    or ``eager``; never for a request of ``need`` tokens (prompt + new) longer than its cache.
    ``rows``, ``cache_len``: which step (one request, or a running batch's)."""
    mode = DecodeMode.of(mode)
    if mode in (DecodeMode.JIT, DecodeMode.EAGER):
        return Decision("jit" if mode is DecodeMode.JIT else "eager", Why.NOT_ASKED)
    S = aot.cache_len_for(model, cache_len)
    if need is not None and need > S:
        return Decision("eager", Why.TOO_LONG, StepStatus(State.UNAVAILABLE, Why.TOO_LONG, rows, S,
                                                          detail=f"the saved step's {S}-token cache"))
    st = ensure(model, rows, S) if mode is DecodeMode.BUILD else status(model, rows, S)
    return Decision("saved", None, st) if st.ready else Decision("eager", st.why, st)


def decoder_for(model: GPT, mode: DecodeMode | str, *, batch: int = 1, need: int,
                weights: bool = False) -> Decision:
    """The decoder of one :func:`qkv.generation.generate` call: ``batch`` rows, ``need`` tokens
    (prompt + new), ``weights``: its attention rows wanted. ``torch.compile``'s step in mode
    ``jit`` (ValueError with ``weights``: it returns none); in modes ``auto`` and ``build``, one
    row of a model the native step runs (:func:`qkv.generation.native_step.unsupported`) through
    it (no set-up; faster than the saved step), else the saved step where :func:`decide` says so;
    else the eager model over a cache sized to the request."""
    mode = DecodeMode.of(mode)
    context = model.cfg.max_seq_len
    eager = EagerDecoder(model, min(context, max(need, 2)), weights)
    if mode is DecodeMode.JIT:
        if weights:
            raise ValueError("the torch.compile step returns no attention weights; use mode 'auto' or "
                             "'eager'")
        from qkv.generation.compiled import compiled_decoder

        jit = compiled_decoder(model)
        if jit.fits(need):
            return Decision("jit", None, decoder=jit)
        why = f"the compiled step's {jit.cache_len}-token cache"
        return Decision("eager", Why.TOO_LONG, StepStatus(State.UNAVAILABLE, Why.TOO_LONG, 1, jit.cache_len,
                                                          detail=why), decoder=eager)
    if batch != 1 and mode is not DecodeMode.EAGER:
        return Decision("eager", Why.ROWS, decoder=eager)
    native = native_for(model, mode, eager.cache_len)
    if native is not None:
        return Decision("native", decoder=native)
    d = decide(model, mode, need=need)
    return replace(d, decoder=d.step if d.step is not None else eager)


def native_for(model: GPT, mode: DecodeMode | str, cache_len: int) -> native_step.NativeStep | None:
    """The one rule whether one row decodes through the native step: in modes ``auto`` and
    ``build``, a model it runs (:func:`qkv.generation.native_step.unsupported`) whose tensors the
    kernel accepts (no set-up, and faster than the saved step: BENCHMARKS.md), over a cache of
    ``cache_len`` positions; else None (the request and the rows of a running batch decode as
    before). Read by :func:`decoder_for` and the running batch (whose rows it takes together,
    :meth:`~qkv.generation.native_step.NativeStep.step_rows`)."""
    if DecodeMode.of(mode) in (DecodeMode.JIT, DecodeMode.EAGER):
        return None
    try:
        return native_step.NativeStep(model, cache_len)
    except (RuntimeError, ValueError):  # one it does not run (ValueError), or tensors the kernel refuses
        return None


def saved_steps_wanted(model: object) -> bool:
    """Whether ``model`` decodes through saved steps (so ``qkv prepare``, ``qkv serve
    --build-steps`` and :meth:`~qkv.pipelines.text.CausalLM.prepare` build them): not where the
    native step runs it (:func:`native_for`: a model it takes, whose tensors the kernel accepts),
    which takes one request and every row of a running batch alike."""
    # the cache length only sizes a request's cache (NativeStep.fits): any will do here
    return not (isinstance(model, GPT) and native_for(model, DecodeMode.AUTO, 2) is not None)


# --------------------------------------------------------------------------- saying it once


class EagerDecodingWarning(UserWarning):
    """Decoding runs eagerly (about half the speed) where a saved step could make it faster."""


_SAID: set[tuple[str, Why]] = set()
_SAID_LOCK = threading.Lock()


def say_once(name: str, model: GPT, decision: Decision) -> str | None:
    """The one line to tell a user why ``name`` decodes eagerly, the first time this process
    meets that reason for that model (None after, and for the user's own choices)."""
    why = decision.why
    if why is None or why in SAID_ALWAYS:
        return None
    key = (name, why)
    with _SAID_LOCK:
        if key in _SAID:
            return None
        _SAID.add(key)
    fix = {Why.NOT_BUILT: f"`qkv prepare {name}` (or lm.prepare()) builds one, once per machine",
           Why.OTHER_KEY: f"`qkv prepare {name}` builds one for this process"
                          + (f" (--threads {_threads()})" if "threads" in (decision.status.differs
                                                                         if decision.status else ()) else ""),
           Why.FAILED: "decoding stays eager",
           Why.BUILDING: "later runs load it once it is done",
           Why.TOO_LONG: "it serves up to " + str(aot.cache_len_for(model)) + " tokens"}.get(why, "")
    st = decision.status
    line = f"{name} decodes eagerly (about half the speed): " \
           f"{explain(why, st.differs if st else (), st.detail if st else '')}"
    return line + (f"; {fix}" if fix else "")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def warn_once(name: str, model: GPT, decision: Decision) -> None:
    """:func:`say_once` as an :class:`EagerDecodingWarning` (what the Python API shows)."""
    line = say_once(name, model, decision)
    if line is not None:
        warnings.warn(line, EagerDecodingWarning, stacklevel=3)


__all__ = ["Decision", "EagerDecodingWarning", "State", "StepStatus", "Why", "decide", "decoder_for",
           "ensure", "explain", "forget", "native_for", "saved_steps_wanted", "say_once", "status",
           "warn_once"]
