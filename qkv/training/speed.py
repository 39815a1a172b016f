"""How a run computes, and the record of it: ``--dtype`` / ``--compile`` resolved (measured by
:mod:`qkv.training.probe` when ``auto``, or taken from the run's own record on ``--resume``),
the :class:`Chosen` record that config.json keeps, and the :class:`CompileMeter` that stops
compiling when compiling costs more than it can still save.

Why a meter: the auto decision to compile rests on one number, the time of a cold compile. A
model whose graph depends on the batch's shape pays it again for every new shape: the RNN
seq2seq unrolls its decoder over the target length, and its batches are trimmed to their
longest row, so each new length recompiles (``torch.compile(dynamic=True)`` does not help:
the Python loop over the length is specialised whatever the shape marks say). So a compiled
run times each step, tells the steps that compiled (``torch._dynamo``'s frame counter rose)
from those that did not, and compares both with the eager step the probe measured: the
excess of compiling steps is compile time paid, the shortfall of the others is the saving.
When a recompile comes and the compile time paid exceeds what the measured saving can still
win over the remaining steps, the run goes on with the eager model (same weights, same
optimiser: the training is the same), says so, and writes both numbers into the probe cache
for the next run's decision. Like the probe's, those numbers are only written when the machine
was quiet while the meter measured (:class:`qkv.training.probe.Watch`, from the meter's start
to the write): other programs' time would count as compile time paid and as saving lost.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Literal

import torch
from torch import Tensor, nn

from qkv.training import probe
from qkv.training.config import BatchSource, TrainConfig
from qkv.training.distributed import DistInfo, broadcast_flag
from qkv.training.optim import make_optimizers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def default_autocast_dtype(dtype: str, device: str) -> torch.dtype:
    """The autocast dtype without measuring: explicit choices as given; auto = bf16 (or fp16 on
    GPUs without bf16) on a GPU, fp32 on a CPU. The Trainer measures auto on CPUs that have
    bf16 instructions instead (:mod:`qkv.training.probe`)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def autocast(device: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device`` (nothing for fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


@dataclass
class Chosen:
    """What a run trained with: config.json's ``"chosen"`` section (what was asked, ``"auto"``
    included, stays in its ``"train"`` section). ``--resume`` trains on with these unless an
    option is given again explicitly."""

    dtype: str  # autocast dtype used: fp32, bf16 or fp16
    dtype_why: str
    compile: bool  # whether steps run compiled now (false after the meter stopped compiling)
    compile_why: str
    step_ms: float | None  # the measured eager time of one optimiser step (None: not measured)
    optimizer: Literal["adamw", "muon"]
    muon_ns_dtype: str | None  # where Muon's Newton–Schulz products run (None: AdamW only)
    device: str  # what the run computed on: cpu, cuda:0, ...
    cpu: dict[str, Any] = field(default_factory=dict)  # probe.machine(): model, isa, native_bf16, threads...
    gpu: str | None = None  # the GPU's name when the device is one
    compile_stopped_at: int | None = None  # the step from which the meter trained eagerly
    cpu_share: float | None = None  # of the CPU its threads wanted while the probe measured, what they got
    busy: bool = False  # the machine was busy while the probe measured: the safe choice, not cached

    def describe(self) -> str:
        """'bf16, compile off, muon (Newton–Schulz in bf16) on cpu: AMD EPYC 9R14 (AVX512, bf16
        native), 2 threads, torch 2.13.0+cpu': the run's second line."""
        opt = self.optimizer + (f" (Newton–Schulz in {self.muon_ns_dtype})" if self.muon_ns_dtype else "")
        c = self.cpu
        bf16 = "native" if c.get("native_bf16") else "emulated"
        on = self.gpu or f"{c.get('model')} ({c.get('isa')}, bf16 {bf16}), {c.get('threads')} threads"
        return (f"{self.dtype}, compile {_on(self.compile)}, {opt} on {self.device}: {on}, "
                f"torch {c.get('torch')}")

    @classmethod
    def read(cls, saved: dict[str, Any]) -> Chosen | None:
        """The record in a run's config.json; None for a run written before runs recorded it;
        ValueError naming the field when it is damaged."""
        rec = saved.get("chosen")
        if rec is None:
            return None
        checks = {"dtype": lambda v: v in DTYPES, "compile": lambda v: isinstance(v, bool),
                  "optimizer": lambda v: v in ("adamw", "muon"),
                  "muon_ns_dtype": lambda v: v is None or v in ("fp32", "bf16"),
                  "step_ms": lambda v: v is None or isinstance(v, int | float)}
        optional = {"busy": lambda v: isinstance(v, bool),  # records from before issue 39 lack them
                    "cpu_share": lambda v: v is None or isinstance(v, int | float)}
        if not isinstance(rec, dict):
            raise ValueError("its \"chosen\" section is not an object")
        for name, ok in checks.items():
            if name not in rec or not ok(rec[name]):
                raise ValueError(f"chosen.{name} is {rec.get(name, 'missing')!r}")
        for name, ok in optional.items():
            if name in rec and not ok(rec[name]):
                raise ValueError(f"chosen.{name} is {rec[name]!r}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{"dtype_why": "", "compile_why": "", "device": "",
                      **{k: v for k, v in rec.items() if k in known}})


def choose_speed(model: nn.Module, cfg: TrainConfig, data: BatchSource, device: str,
                 optimizer: tuple[str, torch.dtype], native_bf16: bool, recorded: Chosen | None,
                 dist: DistInfo) -> tuple[probe.SpeedChoice, str | None]:
    """(--dtype and --compile resolved, the probe-cache key of this machine and shape or None).

    Explicit options win; on a resumed run ``auto`` means what the run recorded (no probe);
    else auto is measured on a CPU (``optimizer``: kind and Newton–Schulz dtype, as trained).
    Every DDP rank must train alike: rank 0's choice wins.
    """
    dev_type = torch.device(device).type
    dtype = DTYPE_NAMES[default_autocast_dtype(cfg.dtype, device)]
    asked_dtype, asked_compile = cfg.dtype != "auto", cfg.compile is not None
    key = x = y = None
    if dev_type == "cpu" and not (asked_dtype and asked_compile):
        x, y = probe_batch(data, cfg)
        key = cache_key(model, cfg, x, optimizer[0])
    if recorded is not None:
        choice = _recorded(recorded, cfg, dtype)
    elif dev_type != "cpu":
        compile_ = dev_type == "cuda" if cfg.compile is None else cfg.compile
        how = "as asked" if asked_compile else f"on {dev_type}"
        choice = probe.SpeedChoice(dtype, compile_, f"{dtype} on {dev_type}",
                                   f"compile {_on(compile_)} {how}")
    elif asked_dtype and asked_compile:
        choice = probe.SpeedChoice(dtype, bool(cfg.compile), f"{dtype} as asked",
                                   f"compile {_on(cfg.compile)} as asked")
    else:
        def measure(options: tuple[str, ...], rounds: int) -> dict[str, float]:
            assert x is not None and y is not None
            return measure_steps(model, cfg, optimizer, device, (x, y), options, rounds)

        choice = _measured(cfg, dtype, native_bf16, key, measure)
    if choice.dtype == "bf16" and dev_type == "cpu" and not native_bf16:  # asked, or recorded elsewhere
        said = "--dtype bf16" if asked_dtype else "bf16 (as this run recorded; --dtype fp32 changes it)"
        warnings.warn(f"{said} on a CPU without bf16 instructions: {probe.emulated_bf16_cost()}; "
                      "--dtype auto picks fp32 here", stacklevel=4)
    if dist.enabled:  # only a CPU's measured bf16-or-fp32 can differ between ranks
        choice.dtype = "bf16" if broadcast_flag(choice.dtype == "bf16", dist) else \
            ("fp32" if choice.dtype == "bf16" else choice.dtype)
    choice.compile = broadcast_flag(choice.compile, dist)
    return choice, key


def probe_batch(data: BatchSource, cfg: TrainConfig) -> tuple[Tensor, Tensor]:
    """The batch the probe times (the same one every time for the same config)."""
    return data.get_batch("train", cfg.batch_size, torch.Generator().manual_seed(cfg.seed + 2))


def cache_key(model: nn.Module, cfg: TrainConfig, x: Tensor, optimizer: str) -> str:
    """The probe cache's key of this machine, model shape, batch shape and optimiser."""
    return probe.probe_key(model=type(model).__name__, batch=list(x.shape),
                           params=[list(p.shape) for p in model.parameters()],
                           optimizer=optimizer, grad_clip=cfg.grad_clip > 0)


def _on(flag: bool | None) -> str:
    return "on" if flag else "off"


def _recorded(rec: Chosen, cfg: TrainConfig, dtype: str) -> probe.SpeedChoice:
    """A resumed run: what it recorded (with the reasons it gave then), except what is asked
    for again explicitly."""
    if cfg.dtype == "auto":
        dtype, dtype_why = rec.dtype, rec.dtype_why
    else:
        dtype_why = f"{dtype} as asked"
    if cfg.compile is None:
        compile_, compile_why = rec.compile, rec.compile_why
    else:
        compile_, compile_why = cfg.compile, f"compile {_on(cfg.compile)} as asked"
    return probe.SpeedChoice(dtype, compile_, dtype_why, compile_why, step_ms=rec.step_ms, recorded=True,
                             cpu_share=rec.cpu_share, busy="busy when the run measured" if rec.busy else "")


def _measured(cfg: TrainConfig, dtype: str, native_bf16: bool, key: str | None,
              measure: Callable[[tuple[str, ...], int], dict[str, float]]) -> probe.SpeedChoice:
    """Auto on a CPU: bf16 against fp32 by timing real steps (or the cache), then compile if
    the run is long enough to repay it. Timings taken on a busy machine are not cached, and the
    choice they would make is replaced by the safe one: fp32, compile off."""
    entry = (probe.read_cache(key) if key else None) or {}
    cached, seen = False, []  # seen: how the CPU was shared during each measurement

    def timed(options: tuple[str, ...], rounds: int) -> dict[str, float]:
        watch = probe.Watch()
        ms = measure(options, rounds)
        seen.append(watch.stop())
        return ms

    known: dict[str, float] = entry.get("ms") or {}
    if cfg.dtype == "auto" and native_bf16:
        if "dtype" in entry:
            dtype, cached = entry["dtype"], True
            dtype_why = entry["dtype_reason"] + " (cached)"
        else:
            known = timed(("fp32", "bf16"), 3)
            dtype, dtype_why = probe.choose_dtype(known, busy=seen[-1].busy)
            if key and not seen[-1].busy:
                probe.write_cache(key, {**entry, "dtype": dtype, "dtype_reason": dtype_why, "ms": known})
    elif cfg.dtype == "auto":
        dtype_why = "no bf16 instructions on this CPU (bf16 products are emulated) -> fp32"
    else:
        dtype_why = f"{dtype} as asked"
    if cfg.compile is not None:
        compile_, compile_why, step_ms = cfg.compile, f"compile {_on(cfg.compile)} as asked", None
    else:
        step_ms = round((known.get(dtype) or timed((dtype,), 1)[dtype]) * cfg.grad_accum, 2)
        if any(s.busy for s in seen):  # the step time is inflated, and by how much is not known
            compile_, compile_why = False, "compile off: the step was timed on a busy machine"
        else:
            compile_, compile_why = probe.compile_worth_trying(step_ms, cfg.max_iters, entry)
    shares = [s.share for s in seen if s.share is not None]
    return probe.SpeedChoice(dtype, compile_, dtype_why, compile_why, cached, step_ms,
                             cpu_share=round(min(shares), 2) if shares else None,
                             busy=next((s.note() for s in seen if s.busy), ""))


def measure_steps(model: nn.Module, cfg: TrainConfig, optimizer: tuple[str, torch.dtype], device: str,
                  batch: tuple[Tensor, Tensor], options: tuple[str, ...], rounds: int = 3,
                  ) -> dict[str, float]:
    """ms per real training step (forward, backward, clip, optimiser) of a copy of the model
    in each autocast dtype; the run's model, optimiser and random state stay untouched."""
    rng = torch.get_rng_state()
    model = copy.deepcopy(model).train()
    opts = make_optimizers(model, optimizer[0], cfg.lr, cfg.muon_lr, cfg.weight_decay,  # type: ignore[arg-type]
                           (cfg.beta1, cfg.beta2), "cpu", ns_dtype=optimizer[1])
    x, y = batch[0].to(device), batch[1].to(device)

    def step(option: str) -> None:
        with autocast(device, DTYPES[option]):
            loss = model(x, y).loss
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        return probe.time_options(step, options, rounds=rounds)
    finally:
        torch.set_rng_state(rng)


def compile_count() -> int:
    """Frames torch.compile has (re)compiled in this process so far (``torch._dynamo``'s own
    counter; 0 where it is missing, and then no step counts as compiling)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo cannot compile anyway
        return 0
    return int(counters["frames"]["total"])


clock = perf_counter  # what the meter times steps with (a test replaces it)

MIN_FAST_STEPS = 5  # compiled steps without a compile needed before their saving counts as measured


@dataclass
class CompileMeter:
    """Measures what compiling costs and saves in this run, against the eager step time.

    eager_s: seconds per eager optimiser step (the probe's); max_iters: the run's last step;
    saving_prior: the fraction of a step compiling is assumed to save until measured here;
    watch: how the CPU is shared from the meter's start (what it measures is kept only if quiet).
    """

    eager_s: float
    max_iters: int
    saving_prior: float = probe.COMPILE_SAVING
    spent_s: float = 0.0  # compile time paid: the excess over eager of steps that compiled
    compile_steps: int = 0  # steps during which something was (re)compiled
    fast: list[float] = field(default_factory=list)  # seconds of compiled steps that did not compile
    seen: set[tuple[int, ...]] = field(default_factory=set)  # input shapes compiled steps have run
    watch: probe.Watch = field(default_factory=lambda: probe.Watch())  # probe.Watch as it is then

    def saving(self) -> float:
        """Fraction of an eager step a compiled step saves: measured once there are enough
        compiled steps, else the prior."""
        if len(self.fast) < MIN_FAST_STEPS:
            return self.saving_prior
        return 1.0 - statistics.median(self.fast) / self.eager_s

    def measured_saving(self) -> float | None:
        return self.saving() if len(self.fast) >= MIN_FAST_STEPS else None

    def can_still_save(self, from_step: int) -> float:
        """Seconds compiling could still save over steps ``from_step`` .. the last."""
        return max(self.saving(), 0.0) * self.eager_s * max(self.max_iters - from_step, 0)

    def skip(self, step: int, shapes: list[tuple[int, ...]]) -> str | None:
        """Before compiled step ``step``: why to go on eagerly when its inputs have a shape no
        compiled step has run yet (a likely recompile) and one more compile, at the mean cost
        measured so far, would cost more than compiling can still save from here; else None."""
        if not self.compile_steps or all(s in self.seen for s in shapes):
            return None
        cost, left = self.spent_s / self.compile_steps, self.can_still_save(step)
        return (f"a new input shape would compile again (~{cost:.0f} s each here), more than the "
                f"~{left:.0f} s compiling can still save" if cost > left else None)

    def observe(self, step: int, seconds: float, compiled: int,
                shapes: list[tuple[int, ...]] | None = None) -> str | None:
        """Record step ``step`` (``seconds`` long, ``compiled`` frames compiled during it, on
        inputs of ``shapes``); why compiling should stop, else None: at a recompile whose cost,
        with all paid before, exceeds what compiling can still save, or once compiled steps
        prove no faster than eager."""
        self.seen.update(shapes or [])
        if compiled:
            self.compile_steps += 1
            self.spent_s += max(seconds - self.eager_s, 0.0)
            left = self.can_still_save(step + 1)
            return (f"more than the ~{left:.0f} s compiling can still save"
                    if self.compile_steps > 1 and self.spent_s > left else None)
        self.fast.append(seconds)
        measured = self.measured_saving()
        if measured is not None and len(self.fast) % MIN_FAST_STEPS == 0 and measured <= 0:
            return "compiled steps are no faster than eager here"
        return None

    def summary(self) -> str:
        """'compiling cost ~95 s (2 steps that compiled); compiled steps took 0.92x as long as eager
        (41 ms vs 45 ms, median of 12)': what was measured, whichever way it went."""
        saving = self.measured_saving()
        if saving is not None:
            fast_ms, eager_ms = 1000 * statistics.median(self.fast), 1000 * self.eager_s
            said = (f"compiled steps took {probe.step_ratio(fast_ms, eager_ms)} eager ({fast_ms:.0f} ms vs "
                    f"{eager_ms:.0f} ms per step, median of {len(self.fast)})")
        else:
            said = f"{100 * self.saving_prior:.0f}% faster assumed (too few compiled steps to measure)"
        n = self.compile_steps
        return f"compiling cost ~{self.spent_s:.0f} s ({n} step{'s' * (n != 1)} that compiled); {said}"

    def cache_entry(self) -> tuple[dict[str, float] | None, str]:
        """(what the probe cache keeps for the next run's decision, see probe.compile_worth_trying;
        None when the machine was busy since the meter started, with the line that says so)."""
        sharing = self.watch.stop()
        if sharing.busy:
            return None, f"not kept: the machine was busy ({sharing.describe()})"
        entry = {"compile_s": round(self.spent_s, 1)}
        if (saving := self.measured_saving()) is not None:
            entry["compile_saving"] = round(saving, 3)
        return entry, "kept for the next run's choice"


def is_compile_error(e: Exception) -> bool:
    """An error raised by torch.compile (Dynamo or Inductor), which the Trainer survives by
    training eagerly."""
    mod = type(e).__module__
    return mod.startswith(("torch._dynamo", "torch._inductor")) or "compile" in str(e).lower()
