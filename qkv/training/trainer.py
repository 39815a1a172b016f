"""The one training loop every model family uses.

Per step: learning rate from the schedule -> ``grad_accum`` micro-batches forward/backward
(under bf16/fp16 autocast when enabled; DDP all-reduces only on the last one) -> gradient
clipping -> optimiser step (AdamW, or Muon + AdamW). Every ``eval_interval`` steps:
validation loss on fixed batches, ``metrics.jsonl``, and a checkpoint (the latest for
``--resume``, the best for use). ``--dtype auto`` and ``--compile auto`` are measured first
(:mod:`qkv.training.probe`).

Anything a model needs to train here: ``model(inputs, targets)`` returns an object with a
``.loss`` scalar, and a :class:`BatchSource` yields (inputs, targets) for "train" and "val".
Resuming restores step, weights, optimiser, global RNG and the data sampler's RNG, so a run
killed and resumed follows the uninterrupted run exactly (in deterministic settings).
"""

from __future__ import annotations

import contextlib
import copy
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
from qkv.training import probe
from qkv.training.config import (
    BatchSource,
    DType,
    TrainConfig,
    TrainingDivergedError,
    TrainingInterruptedError,
    TrainResult,
)
from qkv.training.distributed import DistInfo, broadcast_flag, mean_across, no_sync, wrap_model
from qkv.training.optim import lr_at, make_optimizers, muon_ns_dtype, resolve_optimizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_autocast_dtype(dtype: DType, device: str) -> torch.dtype:
    """The autocast dtype without measuring: explicit choices as given; auto = bf16 (or fp16 on
    GPUs without bf16) on a GPU, fp32 on a CPU. The Trainer measures auto on CPUs that have
    bf16 instructions instead (:mod:`qkv.training.probe`)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


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
    ) -> None:
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.dist = dist or DistInfo()
        self.device = self.dist.device
        self.model = model.to(self.device)
        self.on_log = on_log or (lambda rec: None)
        self.tokens_per_batch = tokens_per_batch
        dev_type = torch.device(self.device).type
        self._build_optimizers(resolve_optimizer(cfg.optimizer))
        self.speed = self._choose_speed(dev_type)
        self.dtype = _DTYPES[self.speed.dtype]
        self.autocast = self._autocast(self.dtype)
        self.scaler = torch.amp.GradScaler(dev_type, enabled=self.dtype == torch.float16)
        self.step = 0
        self.best_val = math.inf
        self.evaluated_at = -1  # the step of the last validation pass (logged and saved)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)  # the data stream's position
        self.compiled = False
        self.train_model: nn.Module = wrap_model(self._maybe_compile(self.model), self.dist)
        self._stop_requested = False

    # ------------------------------------------------------------------ setup

    def _build_optimizers(self, kind: Literal["adamw", "muon"]) -> None:
        cfg = self.cfg
        self.optimizer_kind = kind
        dev_type = torch.device(self.device).type
        self.ns_dtype = muon_ns_dtype(dev_type, cpu_has_native_bf16())
        self.optimizers = make_optimizers(
            self.model, kind, cfg.lr, cfg.muon_lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
            dev_type, ns_dtype=self.ns_dtype,
        )

    def _autocast(self, dtype: torch.dtype):
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=dtype)

    def _choose_speed(self, dev_type: str) -> probe.SpeedChoice:
        """--dtype and --compile: as given, or (auto) measured on this machine for this model."""
        cfg = self.cfg
        dtype = {v: k for k, v in _DTYPES.items()}[default_autocast_dtype(cfg.dtype, self.device)]
        if dev_type != "cpu":
            compile_ = dev_type == "cuda" if cfg.compile is None else cfg.compile
            return probe.SpeedChoice(dtype, compile_, f"{dtype} on {dev_type}")
        if cfg.dtype == "bf16" and not cpu_has_native_bf16():
            warnings.warn(f"--dtype bf16 on a CPU without bf16 instructions: {probe.emulated_bf16_cost()}; "
                          "--dtype auto picks fp32 here", stacklevel=3)
        if cfg.dtype != "auto" and cfg.compile is not None:
            return probe.SpeedChoice(dtype, cfg.compile, f"{dtype} and compile {cfg.compile} as asked")
        x, y = self.data.get_batch("train", cfg.batch_size, torch.Generator().manual_seed(cfg.seed + 2))
        key = probe.probe_key(model=type(self.model).__name__, batch=list(x.shape),
                              params=[list(p.shape) for p in self.model.parameters()],
                              optimizer=self.optimizer_kind, grad_clip=cfg.grad_clip > 0)
        entry = probe.read_cache(key) or {}
        reasons, cached = [], False
        if cfg.dtype == "auto" and cpu_has_native_bf16():
            if "dtype" in entry:
                dtype, cached = entry["dtype"], True
                reasons.append(entry["dtype_reason"] + " (cached)")
            else:
                ms = self._probe(x, y, ("fp32", "bf16"))
                dtype, why = probe.choose_dtype(ms)
                entry.update(dtype=dtype, dtype_reason=why, ms=ms)
                probe.write_cache(key, entry)
                reasons.append(why)
        elif cfg.dtype == "auto":
            reasons.append("no bf16 instructions on this CPU (bf16 products are emulated) -> fp32")
        compile_ = cfg.compile
        if compile_ is None:
            ms_step = (entry.get("ms") or {}).get(dtype) or self._probe(x, y, (dtype,), rounds=1)[dtype]
            compile_, why = probe.compile_worth_trying(ms_step * cfg.grad_accum, cfg.max_iters, entry)
            reasons.append(why)
        choice = probe.SpeedChoice(dtype, compile_, "; ".join(reasons) or f"{dtype}", cached)
        # Every DDP rank must train alike: rank 0's choice wins.
        choice.dtype = "bf16" if broadcast_flag(choice.dtype == "bf16", self.dist) else "fp32"
        choice.compile = broadcast_flag(choice.compile, self.dist)
        return choice

    def _probe(self, x: Tensor, y: Tensor, options: tuple[str, ...], rounds: int = 3) -> dict[str, float]:
        """ms per real training step (forward, backward, clip, optimiser) of a copy of the model
        in each autocast dtype; the run's model, optimiser and random state stay untouched."""
        rng = torch.get_rng_state()
        model = copy.deepcopy(self.model).train()
        opts = make_optimizers(model, self.optimizer_kind, self.cfg.lr, self.cfg.muon_lr,
                               self.cfg.weight_decay, (self.cfg.beta1, self.cfg.beta2), "cpu",
                               ns_dtype=self.ns_dtype)
        x, y = x.to(self.device), y.to(self.device)

        def step(option: str) -> None:
            with self._autocast(_DTYPES[option]):
                loss = model(x, y).loss
            loss.backward()
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)

        try:
            return probe.time_options(step, options, rounds=rounds)
        finally:
            torch.set_rng_state(rng)

    def _maybe_compile(self, model: nn.Module) -> nn.Module:
        # Auto (see _choose_speed): on GPUs always; on a CPU only when the run is long enough to
        # repay a cold compile (~40 s for a 4-layer GPT on 2 cores, ~10% saved per step).
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
        self.compiled = False
        self.train_model = wrap_model(self.model, self.dist)

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
        for micro in range(cfg.grad_accum):
            x, y = self._batch("train", self.data_gen)
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
        self._note(f"speed: {self.speed.reason}")
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
        finally:
            if self.dist.is_main:
                signal.signal(signal.SIGINT, prev_handler)
        seconds = time.perf_counter() - t0
        return TrainResult(self.step, self.best_val, loss, seconds, tokens / max(seconds, 1e-9))

    def _guarded_step(self) -> float:
        if not self.compiled:
            return self._train_step()
        try:
            return self._train_step()
        except Exception as e:  # compilation errors surface at the first call
            if self.step > 0 and not _is_compile_error(e):
                raise
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self._fall_back_to_eager(e)
            return self._train_step()

    def _log_progress(self, loss: float, tok_s: float) -> None:
        lr = self.optimizers[-1].param_groups[0]["lr"]  # AdamW's (the last one) is --lr
        self._log({"step": self.step, "train_loss": loss, "lr": lr, "tokens_per_s": round(tok_s, 1)})

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once


def _is_compile_error(e: Exception) -> bool:
    mod = type(e).__module__
    return mod.startswith(("torch._dynamo", "torch._inductor")) or "compile" in str(e).lower()
