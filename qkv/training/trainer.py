"""The one training loop every model family uses.

Per step: learning rate from the schedule -> ``grad_accum`` micro-batches forward/backward
(under bf16/fp16 autocast when enabled; DDP all-reduces only on the last one) -> gradient
clipping -> optimiser step (AdamW, or Muon + AdamW). Every ``eval_interval`` steps:
validation loss on fixed batches, ``metrics.jsonl``, and a checkpoint (the latest for
``--resume``, the best for use). ``--dtype auto`` and ``--compile auto`` are measured first
(:mod:`qkv.training.probe`), or taken from a resumed run's record; what the run trains with is
:meth:`Trainer.chosen` (config.json's ``chosen``), and a compiled run stops compiling when it
costs more than it can still save (:mod:`qkv.training.speed`).

Anything a model needs to train here: ``model(inputs, targets)`` returns an object with a
``.loss`` scalar, and a :class:`BatchSource` yields (inputs, targets) for "train" and "val".
Resuming restores step, weights, optimiser, global RNG and the data sampler's RNG, so a run
killed and resumed follows the uninterrupted run exactly (in deterministic settings).
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.device import cpu_has_native_bf16
from qkv.training import checkpoint as ckpt
from qkv.training import probe, speed
from qkv.training.config import (
    BatchSource,
    TrainConfig,
    TrainingDivergedError,
    TrainingInterruptedError,
    TrainResult,
)
from qkv.training.distributed import DistInfo, broadcast_flag, mean_across, no_sync, wrap_model
from qkv.training.optim import lr_at, make_optimizers, muon_ns_dtype, resolve_optimizer
from qkv.training.speed import Chosen


class Trainer:
    """Train ``model`` on ``data`` into ``run_dir``.

    Args:
        model: the raw module (what gets saved); compiled and DDP-wrapped internally.
        cfg: optimisation settings.
        data: where batches come from.
        run_dir: the run directory (rank 0 writes it).
        dist: process-group information from ``init_distributed``.
        on_log: called on rank 0 with each metrics record (the CLI's progress display).
        tokens_per_batch: tokens (or examples) per sequence, for throughput.
        recorded: what a resumed run chose at its start (its config.json's ``chosen``): used
            for every option still ``auto``, without measuring again.
        on_choice: called on rank 0 with :meth:`chosen` when the choice changes mid-run (the
            compile meter switched compiling off), so the run's record can follow.
        on_eval: called on rank 0 with the step and the raw model after each evaluation.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        data: BatchSource,
        run_dir: Path,
        dist: DistInfo | None = None,
        on_log: Callable[[dict], None] | None = None,
        tokens_per_batch: int = 1,
        recorded: Chosen | None = None,
        on_choice: Callable[[Chosen], None] | None = None,
        on_eval: Callable[[int, nn.Module], None] | None = None,
    ) -> None:
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.dist = dist or DistInfo()
        self.device = self.dist.device
        self.model = model.to(self.device)
        self.on_log = on_log or (lambda rec: None)
        self.on_choice = on_choice or (lambda chosen: None)
        self.tokens_per_batch = tokens_per_batch
        self.on_eval = on_eval
        self.native_bf16 = cpu_has_native_bf16()
        self.recorded = recorded
        dev_type = torch.device(self.device).type
        kind = resolve_optimizer(cfg.optimizer)
        if recorded is not None and cfg.optimizer == "auto":
            kind = recorded.optimizer  # what the run started with, on any machine
        self._build_optimizers(kind)
        self.speed, self._probe_key = speed.choose_speed(
            self.model, cfg, data, self.device, (self.optimizer_kind, self.ns_dtype), self.native_bf16,
            recorded, self.dist)
        self.dtype = speed.DTYPES[self.speed.dtype]
        self.autocast = speed.autocast(self.device, self.dtype)
        self.scaler = torch.amp.GradScaler(dev_type, enabled=self.dtype == torch.float16)
        self.step = 0
        self.best_val = math.inf
        self.evaluated_at = -1  # the step of the last validation pass (logged and saved)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)  # the data stream's position
        self.compiled = False
        self._shapes: list[tuple[int, ...]] = []  # the input shapes of the step being trained
        self.compile_stopped_at = recorded.compile_stopped_at if recorded and cfg.compile is None else None
        self.train_model: nn.Module = wrap_model(self._maybe_compile(self.model), self.dist)
        # Compiling is judged by what it costs in this run where auto chose it against a
        # measured eager step (a CPU); an explicit --compile true is kept whatever it costs.
        self.meter = (speed.CompileMeter(self.speed.step_ms / 1000, cfg.max_iters, self._saving_prior())
                      if self.compiled and cfg.compile is None and self.speed.step_ms else None)
        self._stop_requested = False

    # ------------------------------------------------------------------ setup

    def _build_optimizers(self, kind: Literal["adamw", "muon"]) -> None:
        cfg = self.cfg
        self.optimizer_kind = kind
        dev_type = torch.device(self.device).type
        self.ns_dtype = muon_ns_dtype(dev_type, self.native_bf16)
        rec = self.recorded.muon_ns_dtype if self.recorded else None
        # The recorded Newton–Schulz dtype, unless this machine would emulate it (~100x slower).
        if rec is not None and not (rec == "bf16" and self.ns_dtype == torch.float32):
            self.ns_dtype = speed.DTYPES[rec]
        self.optimizers = make_optimizers(
            self.model, kind, cfg.lr, cfg.muon_lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
            dev_type, ns_dtype=self.ns_dtype,
        )

    def _saving_prior(self) -> float:
        entry = (probe.read_cache(self._probe_key) if self._probe_key else None) or {}
        return float(entry.get("compile_saving", probe.COMPILE_SAVING))

    def chosen(self) -> Chosen:
        """What this run trains with, for its config.json (see :class:`Chosen`)."""
        dev = torch.device(self.device)
        return Chosen(
            dtype=self.speed.dtype, dtype_why=self.speed.dtype_why, compile=self.compiled,
            compile_why=self.speed.compile_why, step_ms=self.speed.step_ms,
            optimizer=self.optimizer_kind,
            muon_ns_dtype=speed.DTYPE_NAMES[self.ns_dtype] if self.optimizer_kind == "muon" else None,
            device=str(self.device), cpu=probe.machine(self.native_bf16),
            gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            compile_stopped_at=self.compile_stopped_at, cpu_share=self.speed.cpu_share,
            busy=bool(self.speed.busy),
        )

    def _maybe_compile(self, model: nn.Module) -> nn.Module:
        # Auto (see speed.choose_speed): on GPUs always; on a CPU only when the run is long enough
        # to repay compiling (measured here by an earlier run, else a typical 40 s cold compile).
        if not self.speed.compile:
            return model
        try:
            compiled = torch.compile(model)
        except Exception as e:  # e.g. an unsupported Python/platform
            warnings.warn(f"torch.compile unavailable ({e}); training eagerly", stacklevel=2)
            return model
        self.compiled = True
        return compiled

    def _fall_back_to_eager(self, err: Exception) -> None:
        warnings.warn(
            f"torch.compile failed ({type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}); "
            "continuing without it (--compile false silences this)",
            stacklevel=2,
        )
        self.compiled = self.speed.compile = False
        self.speed.compile_why = f"compile failed here ({type(err).__name__}) -> eager"
        self.train_model = wrap_model(self.model, self.dist)
        if self.dist.is_main:
            self.on_choice(self.chosen())

    def _stop_compiling(self, why: str | None, when: str) -> None:
        """Go on eagerly when the compile meter gives a reason (rank 0's verdict holds on every
        rank). The eager model is the compiled one's own module: weights and optimiser carry on."""
        if not broadcast_flag(why is not None, self.dist):
            return
        assert self.meter is not None
        self.compiled = self.speed.compile = False
        self.compile_stopped_at = done = self.step + (when == "after")  # steps trained compiled
        self.train_model = wrap_model(self.model, self.dist)
        self.speed.compile_why = f"compile stopped after step {done}: {self.meter.summary()}; {why}"
        fate = self._record_compile()
        self._note(f"{self.speed.compile_why}; training on eagerly (the same weights and optimiser)"
                   + (f"; compile time {fate}" if fate else ""))
        if self.dist.is_main:
            self.on_choice(self.chosen())

    def _record_compile(self) -> str:
        """What compiling cost and saved here, into the probe cache for the next run's choice
        unless the machine was busy meanwhile; what became of it, in words ("": nothing to keep)."""
        if self.meter is None or not self.meter.compile_steps or not self._probe_key or not self.dist.is_main:
            return ""
        entry, fate = self.meter.cache_entry()
        if entry is not None:
            probe.write_cache(self._probe_key, entry)
        return fate

    # ------------------------------------------------------------------ checkpoints

    def _state(self) -> dict:
        return {
            "optimizer": [opt.state_dict() for opt in self.optimizers],
            "optimizer_kind": self.optimizer_kind,
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "best_val": self.best_val,
            "evaluated_at": self.evaluated_at,
            "torch_rng": torch.get_rng_state(),
            "data_rng": self.data_gen.get_state(),
        }

    def save(self, is_best: bool, val: float | None = None) -> None:
        """If best, model.safetensors first (the weights before the loss that names them), then
        the resume set (checkpoint/, one transaction). A write that fails (a full disk) leaves
        the previous files as they were and says so in one line."""
        if not self.dist.is_main:
            return
        try:
            if is_best:
                ckpt.save_weights(self.model, self.run_dir / "model.safetensors",
                                  {"step": str(self.step), "val_loss": repr(val)})
            ckpt.save_resume(self.run_dir, self.model, self._state())
        except OSError as e:
            raise ckpt.CheckpointError(
                f"cannot save step {self.step} in {self.run_dir} ({e.strerror or e}); the previous "
                f"checkpoint is intact: free the space (or fix the folder), then --resume {self.run_dir}"
            ) from None

    def load_resume_state(self) -> None:
        """Restore everything ``save`` wrote; the next step to run is the saved ``step``."""
        state = ckpt.load_resume(self.run_dir, self.model)
        saved = state.get("optimizer")
        saved = [saved] if isinstance(saved, dict) else saved  # runs written before Muon: one AdamW
        kind = state.get("optimizer_kind", "adamw")
        if kind != self.optimizer_kind:
            if self.cfg.optimizer != "auto":
                raise ckpt.CheckpointError(
                    f"{self.run_dir} was trained with --optimizer {kind}; resume it with that optimizer"
                )
            self._build_optimizers(kind)  # auto picks what the run started with, on any machine
        try:
            if not isinstance(saved, list) or len(saved) != len(self.optimizers):
                raise ValueError("optimizer state has another number of optimizers")
            for opt, sd in zip(self.optimizers, saved, strict=True):
                opt.load_state_dict(sd)
            self.scaler.load_state_dict(state["scaler"])
            self.step, self.best_val = int(state["step"]), float(state["best_val"])
            self.evaluated_at = int(state.get("evaluated_at", -1))  # older runs: evaluate again
            torch.set_rng_state(state["torch_rng"])
            self.data_gen.set_state(state["data_rng"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise ckpt.CheckpointError(
                f"resume state in {self.run_dir} does not match this model/optimiser ({e})"
            ) from None

    # ------------------------------------------------------------------ loop pieces

    def _batch(self, split: str, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """This process's slice of a global batch: every rank draws the same global batch
        with the same generator and keeps its own rows, so N processes see exactly what
        one process with an N× batch would."""
        bs, r, w = self.cfg.batch_size, self.dist.rank, self.dist.world_size
        x, y = self.data.get_batch(split, bs * w, gen)
        x, y = x[r * bs : (r + 1) * bs], y[r * bs : (r + 1) * bs]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_iters`` validation batches, the same batches every time."""
        self.model.eval()
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        total = 0.0
        for _ in range(self.cfg.eval_iters):
            x, y = self._batch("val", gen)
            with self.autocast:
                total += float(self.model(x, y).loss)
        self.model.train()
        return mean_across(total / self.cfg.eval_iters, self.dist)

    def _train_step(self) -> float:
        """One optimiser step over ``grad_accum`` micro-batches; returns the mean loss."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters or cfg.max_iters)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
        total = 0.0
        batches = [self._batch("train", self.data_gen) for _ in range(cfg.grad_accum)]
        self._shapes = [(*x.shape, *y.shape) for x, y in batches]
        if self.meter is not None and self.compiled:
            self._stop_compiling(self.meter.skip(self.step, self._shapes), "before")
        for micro, (x, y) in enumerate(batches):
            with no_sync(self.train_model, micro == cfg.grad_accum - 1), self.autocast:
                loss = self.train_model(x, y).loss / cfg.grad_accum
            self.scaler.scale(loss).backward()
            total += float(loss.detach())
        if cfg.grad_clip > 0:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        for opt in self.optimizers:
            self.scaler.step(opt)
        self.scaler.update()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return total

    def _note(self, text: str) -> None:
        """A line for the user (not a metric): what auto chose and why."""
        if self.dist.is_main:
            self.on_log({"note": text})

    def _log(self, record: dict) -> None:
        if self.dist.is_main:
            ckpt.append_jsonl(self.run_dir / "metrics.jsonl", record)
            self.on_log(record)

    def _evaluate_and_save(self, train_loss: float | None) -> None:
        val = self.evaluate()
        is_best = val < self.best_val
        self.best_val = min(self.best_val, val)
        self.evaluated_at = self.step
        self._log({"step": self.step, "val_loss": val, "train_loss": train_loss, "best": is_best})
        if self.on_eval is not None and self.dist.is_main:
            self.on_eval(self.step, self.model)
        self.save(is_best, val)

    def evaluates_first(self) -> bool:
        """Whether :meth:`fit` starts with a validation pass (a fresh run, or a resume at an
        evaluation step whose pass the checkpoint does not already hold)."""
        return (self.step < self.cfg.max_iters and self.step % self.cfg.eval_interval == 0
                and self.evaluated_at != self.step)

    # ------------------------------------------------------------------ fit

    def fit(self) -> TrainResult:
        """Run from ``self.step`` to ``max_iters``; may raise TrainingDivergedError/InterruptedError."""
        cfg = self.cfg
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model.train()
        prev_handler = signal.getsignal(signal.SIGINT)
        if self.dist.is_main:
            signal.signal(signal.SIGINT, self._request_stop)
        self._note(f"speed: {self.speed.reason}")  # what the run trains with, why, and on what
        if self.speed.busy and not self.speed.recorded:
            self._note(f"speed: {self.speed.busy}")  # measured beside other programs: not cached
        self._note(f"using: {self.chosen().describe()}")
        t0 = time.perf_counter()
        tokens, loss = 0, math.nan
        done = self.step >= cfg.max_iters  # resumed after the last save: nothing to train or log
        try:
            while self.step < cfg.max_iters:
                if self.step % cfg.eval_interval == 0 and self.evaluated_at != self.step:
                    self._evaluate_and_save(None if math.isnan(loss) else loss)
                if broadcast_flag(self._stop_requested, self.dist):
                    self.save(is_best=False)
                    raise TrainingInterruptedError(
                        f"interrupted at step {self.step}; resume with --resume {self.run_dir}"
                    )
                loss = mean_across(self._guarded_step(), self.dist)  # the global batch's loss
                if not math.isfinite(loss):
                    raise TrainingDivergedError(
                        f"loss became {loss} at step {self.step}; the last good checkpoint "
                        f"(best val loss {self.best_val:.4f}) is kept in {self.run_dir}; "
                        "try a lower --lr"
                    )
                self.step += 1
                tokens += cfg.batch_size * cfg.grad_accum * self.dist.world_size * self.tokens_per_batch
                elapsed = time.perf_counter() - t0
                self._log_progress(loss, tokens / max(elapsed, 1e-9))
            if not done:
                self._evaluate_and_save(loss)
            if self.meter is not None and self.compiled:
                fate = self._record_compile()
                self._note(f"compile: {self.meter.summary()}" + (f" ({fate})" if fate else ""))
        finally:
            if self.dist.is_main:
                signal.signal(signal.SIGINT, prev_handler)
        seconds = time.perf_counter() - t0
        return TrainResult(self.step, self.best_val, loss, seconds, tokens / max(seconds, 1e-9))

    def _guarded_step(self) -> float:
        if not self.compiled:
            return self._train_step()
        frames, t0 = speed.compile_count(), speed.clock()
        try:
            loss = self._train_step()
        except Exception as e:  # compilation errors surface at the first call
            if self.step > 0 and not speed.is_compile_error(e):
                raise
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self._fall_back_to_eager(e)
            return self._train_step()
        if self.meter is not None and self.compiled:
            seconds, compiled = speed.clock() - t0, speed.compile_count() - frames
            self._stop_compiling(self.meter.observe(self.step, seconds, compiled, self._shapes), "after")
        return loss

    def _log_progress(self, loss: float, tok_s: float) -> None:
        lr = self.optimizers[-1].param_groups[0]["lr"]  # AdamW's (the last one) is --lr
        self._log({"step": self.step, "train_loss": loss, "lr": lr, "tokens_per_s": round(tok_s, 1)})

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once

