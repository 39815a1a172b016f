"""Training and generation speed of qkv vs the baseline everyone knows: nanoGPT's CPU recipe.

Baseline: nanoGPT's model (learned positions, pre-LN blocks without biases, GELU MLP, tied
embeddings, PyTorch SDPA attention), written out below independently of qkv, trained the way
nanoGPT trains on a CPU: fp32, eager, torch.optim.AdamW, char-level, block 64, batch 12,
4 layers, 4 heads, dim 128, dropout 0, lr 1e-3 cosine to 1e-4 over 2000 iterations, warmup 100,
β2 0.99, weight decay 0.1, gradient clipping 1.0.

qkv: (a) the same recipe, qkv's `nanogpt-cpu` preset, through qkv's Trainer (fused AdamW,
`--dtype auto` measured by the probe, eager; and once compiled, for speed only); (b) the
default `qkv train`: the `cpu` preset with `--optimizer auto` (Muon where its bf16
orthogonalisation is fast, else the preset's AdamW recipe), `--dtype auto` and
`--compile auto`, the probe counted as wall time (a fresh probe cache). All read the same tokens
(the Shakespeare corpus, char-level) and are scored on the same validation windows (block 64).

Reported: ms/iter and tokens/s (interleaved timing blocks, medians); per seed: val loss at the
end and wall time of each run, the wall time the default run needs to reach that seed's
baseline final loss (evaluated every 5% of its steps), the baseline's loss at the default
run's finishing time, the default run's tokens/s and MFU against the measured matmul peak of
the dtype it chose; KV-cache vs no-cache generation speed (500 new tokens,
`shakespeare-char` preset model), and peak RSS.

    python benchmarks/train_speed.py            # full run (~12 minutes on 2 cores)
    python benchmarks/train_speed.py --quick    # smoke run (~1 minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import RESULTS_DIR, LoadMeter, load_line, machine_info, machine_line
from torch import nn

from qkv.device import cpu_has_native_bf16
from qkv.families.gpt import LMDataConfig, prepare_data
from qkv.models.gpt import GPT, GPTConfig
from qkv.presets import get_preset, preset_train
from qkv.training.optim import fp32_newton_schulz, lr_at, resolve_optimizer
from qkv.training.trainer import TrainConfig, Trainer

# ----------------------------------------------------------------------------- the baseline


class _Block(nn.Module):
    """nanoGPT's Block: x + attn(ln_1(x)); x + mlp(ln_2(x)); LayerNorm without bias."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(dim, bias=False)
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.ln_2 = nn.LayerNorm(dim, bias=False)
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPTBaseline(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(_Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim, bias=False)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * n_layers)
                    if name.endswith(("c_proj.weight", "mlp_proj.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class BaselineTrainer:
    """nanoGPT's loop on a CPU: eager fp32, AdamW(foreach default), decay groups, clip 1.0."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, batches, seed: int) -> None:
        self.model, self.cfg, self.batches = model, cfg, batches
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
        )
        self.gen = torch.Generator().manual_seed(seed)
        self.step = 0

    def train_step(self) -> float:
        c = self.cfg
        lr = lr_at(self.step, c.lr, c.min_lr, c.warmup_iters, c.lr_decay_iters or c.max_iters)
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y = self.batches.get_batch("train", c.batch_size, self.gen)
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()


@torch.no_grad()
def val_loss(forward, batches, batch_size: int, n: int, seed: int = 2024) -> float:
    """Mean loss over the same ``n`` validation batches for every contender."""
    g = torch.Generator().manual_seed(seed)
    return statistics.fmean(float(forward(*batches.get_batch("val", batch_size, g))) for _ in range(n))


# ----------------------------------------------------------------------------- measurements


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of a large square matmul: the machine's practical ceiling for this dtype."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def flops_per_token(n_params: int, n_layers: int, dim: int, T: int) -> float:
    """6N for the weights (forward + backward) + 12·L·dim·T for attention (PaLM appendix B)."""
    return 6 * n_params + 12 * n_layers * dim * T


def timed_blocks(fns: dict, steps: int, rounds: int) -> dict[str, float]:
    """Median ms/iter per contender, alternating blocks of ``steps`` so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t0) / steps * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_to_end(step_fn, max_iters: int, eval_fn, eval_every: int, target: float | None = None,
               curve: list | None = None, start_s: float = 0.0):
    """Train to ``max_iters``; returns (final val loss, wall s, s to reach ``target`` or None).

    Evaluations (every ``eval_every`` steps) are not counted as training time; ``start_s``
    (set-up already spent, e.g. the dtype probe) is. Each evaluation is appended to ``curve``
    as (seconds, loss).
    """
    t0 = time.perf_counter() - start_s
    hit = None
    loss = math.nan
    for i in range(max_iters):
        step_fn()
        if (i + 1) % eval_every == 0 or i + 1 == max_iters:
            pause = time.perf_counter()
            loss = eval_fn()
            if curve is not None:
                curve.append((round(pause - t0, 2), round(loss, 4)))
            if target is not None and hit is None and loss <= target:
                hit = pause - t0
            t0 += time.perf_counter() - pause  # evaluation time is not training time
    return loss, time.perf_counter() - t0, hit


def generation_speed(quick: bool) -> dict:
    from qkv.generation import generate

    preset = get_preset("gpt", "shakespeare-char")["model"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**preset, "vocab_size": 65, "dropout": 0.0})).eval()
    n_new = 100 if quick else 500
    prompt = torch.randint(0, 65, (1, 1))
    out: dict = {"params_M": round(model.num_params() / 1e6, 2), "new_tokens": n_new}
    tokens = {}
    for use_cache in (True, False):
        name = "cache" if use_cache else "no_cache"
        rss0 = peak_rss_mb()
        t0 = time.perf_counter()
        tokens[name] = [int(t) for t in generate(model, prompt, n_new, temperature=0, use_cache=use_cache)]
        dt = time.perf_counter() - t0
        out[name] = {
            "tokens_per_s": round(n_new / dt, 1),
            "seconds": round(dt, 2),
            "peak_rss_growth_mb": round(peak_rss_mb() - rss0, 1),
        }
    out["same_greedy_tokens"] = tokens["cache"] == tokens["no_cache"]
    out["speedup"] = round(out["cache"]["tokens_per_s"] / out["no_cache"]["tokens_per_s"], 2)
    return out


# ----------------------------------------------------------------------------- main


def _step_fn(trainer: Trainer):
    def step():
        trainer._guarded_step()
        trainer.step += 1

    return step


def default_recipe(V: int) -> tuple[GPTConfig, TrainConfig, str]:
    """What `qkv train` (no options) runs on this machine: the `cpu` preset, with the training
    fields of the optimiser that `--optimizer auto` picks here."""
    cpu = get_preset("gpt", "cpu")
    kind = resolve_optimizer("auto")
    train = {**preset_train(cpu, kind, fp32_newton_schulz("auto")), "out_dir": "/tmp/qkv-bench-unused"}
    return GPTConfig(**{**cpu["model"], "vocab_size": V}), TrainConfig(**train), kind


def baseline_curve(batches, recipe_train: TrainConfig, dims, iters: int, seed: int, eval_n: int,
                   eval_every: int) -> dict:
    """nanoGPT's recipe from scratch: the final val loss, wall time, and the loss curve."""
    V, T, dim, n_layers, n_heads = dims
    torch.manual_seed(seed)
    base = BaselineTrainer(NanoGPTBaseline(V, T, dim, n_layers, n_heads), recipe_train, batches, seed)
    curve: list[tuple[float, float]] = []
    loss, wall, _ = run_to_end(base.train_step, iters, lambda: val_loss(base.model, batches, 12, eval_n),
                               eval_every, curve=curve)
    return {"val_loss": round(loss, 4), "wall_s": round(wall, 1), "curve": curve}


def qkv_run(mcfg: GPTConfig, tcfg: TrainConfig, batches, val_batches, seed: int, eval_n: int,
            eval_every: int, target: float | None) -> dict:
    """A qkv Trainer run from scratch, as the CLI builds it (including the dtype/compile
    probe, which counts as wall time), scored on the baseline's validation windows."""
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    trainer = Trainer(GPT(mcfg), dataclasses.replace(tcfg, seed=seed), batches, Path("/tmp/qkv-bench-unused"),
                      tokens_per_batch=mcfg.max_seq_len)
    setup_s = time.perf_counter() - t0
    curve: list[tuple[float, float]] = []
    loss, wall, hit = run_to_end(
        _step_fn(trainer), tcfg.max_iters,
        lambda: val_loss(lambda x, y: trainer.model(x, y).loss, val_batches, 12, eval_n),
        eval_every, target=target, curve=curve, start_s=setup_s,
    )
    return {"val_loss": round(loss, 4), "wall_s": round(wall, 1), "setup_s": round(setup_s, 2),
            "s_to_target": None if hit is None else round(hit, 1), "curve": curve,
            "dtype": trainer.speed.dtype, "compile": trainer.speed.compile,
            "optimizer": trainer.optimizer_kind, "speed_reason": trainer.speed.reason}


def loss_at(curve: list[tuple[float, float]], t: float) -> float | None:
    """The last evaluated loss of a (seconds, loss) curve at or before time ``t``."""
    seen = [loss for s, loss in curve if s <= t]
    return seen[-1] if seen else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200 iterations, one seed, small evaluations")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each full run (baseline, same recipe, "
                    "default run); losses differ by ~0.01-0.03 between seeds")
    ap.add_argument("--out", default=None,
                    help="JSON results file (default benchmarks/results/train_speed.json, "
                    "train_speed_quick.json with --quick)")
    args = ap.parse_args(argv)
    # A fresh probe cache: the default run pays for its dtype/compile probe as a first run would.
    os.environ["QKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="qkv-bench-cache-")
    meter = LoadMeter()

    iters = 200 if args.quick else 2000
    seeds = [1337 + i for i in range(1 if args.quick else args.seeds)]
    recipe = get_preset("gpt", "nanogpt-cpu")
    base_train = TrainConfig(
        **{**recipe["train"], "max_iters": iters, "lr_decay_iters": iters, "out_dir": "/tmp/qkv-bench-unused"}
    )
    _, tok, batches = prepare_data(LMDataConfig(), recipe["model"]["max_seq_len"])
    V, T = tok.vocab_size, recipe["model"]["max_seq_len"]
    mcfg = GPTConfig(**{**recipe["model"], "vocab_size": V})
    eval_n = 20 if args.quick else 100
    native = cpu_has_native_bf16()
    info = {
        "machine": machine_info(),
        "peak_fp32_gflops": round(matmul_peak(torch.float32) / 1e9, 1),
        # An emulated bf16 GEMM of 2048² takes minutes: measure a smaller one there.
        "peak_bf16_gflops": round(matmul_peak(torch.bfloat16, *(2048, 5) if native else (1024, 1)) / 1e9, 1),
    }
    print(machine_line(info["machine"]), flush=True)
    print(json.dumps({k: v for k, v in info.items() if k != "machine"}), flush=True)

    # 1. ms/iter, interleaved: baseline vs qkv's nanogpt-cpu preset (same recipe) vs compiled.
    torch.manual_seed(1337)
    dims = (V, T, mcfg.dim, mcfg.n_layers, mcfg.n_heads)
    base = BaselineTrainer(NanoGPTBaseline(*dims), base_train, batches, 1337)
    torch.manual_seed(1337)
    qkv_cfg = TrainConfig(**{**base_train.__dict__})
    trainer = Trainer(GPT(mcfg), qkv_cfg, batches, Path("/tmp/qkv-bench-unused"), tokens_per_batch=T)
    torch.manual_seed(1337)
    compiled = Trainer(GPT(mcfg), dataclasses.replace(qkv_cfg, compile=True), batches,
                       Path("/tmp/qkv-bench-unused"), tokens_per_batch=T)
    t0 = time.perf_counter()
    compiled._guarded_step()  # the cold torch.compile happens here
    compile_s = time.perf_counter() - t0
    for _ in range(5):  # warm-up
        base.train_step()
        _step_fn(trainer)()
        _step_fn(compiled)()
    ms = timed_blocks(
        {"baseline": base.train_step, "qkv": _step_fn(trainer), "qkv_compiled": _step_fn(compiled)},
        steps=10 if args.quick else 25, rounds=3 if args.quick else 6,
    )
    n_params = sum(p.numel() for p in trainer.model.parameters())
    fpt = flops_per_token(n_params, mcfg.n_layers, mcfg.dim, T)
    tok_per_iter = base_train.batch_size * T
    speed = {
        k: {"ms_per_iter": round(v, 2), "tokens_per_s": round(tok_per_iter / v * 1000),
            "mfu_fp32": round(fpt * tok_per_iter / (v / 1000) / (info["peak_fp32_gflops"] * 1e9), 3)}
        for k, v in ms.items()
    }
    speed["iters_per_s_ratio_qkv_over_baseline"] = round(ms["baseline"] / ms["qkv"], 2)
    speed["iters_per_s_ratio_compiled_over_baseline"] = round(ms["baseline"] / ms["qkv_compiled"], 2)
    speed["qkv_dtype"], speed["qkv_reason"] = trainer.speed.dtype, trainer.speed.reason
    speed["cold_compile_s"] = round(compile_s, 1)
    print(json.dumps(speed, indent=1), flush=True)
    del base, trainer, compiled

    # 2. Full runs from scratch, per seed: the baseline, qkv's same recipe, and the default run.
    dcfg, dtrain, dkind = default_recipe(V)
    _, _, d_batches = prepare_data(LMDataConfig(), dcfg.max_seq_len, tok)
    if args.quick:
        dtrain = dataclasses.replace(dtrain, max_iters=min(dtrain.max_iters, 150))
    d_eval_every = max(10, dtrain.max_iters // 20)
    runs = []
    for seed in seeds:
        b = baseline_curve(batches, base_train, dims, iters, seed, eval_n, eval_every=iters // 10)
        same = qkv_run(mcfg, qkv_cfg, batches, batches, seed, eval_n, iters // 10, None)
        default = qkv_run(dcfg, dtrain, d_batches, batches, seed, eval_n, d_eval_every, b["val_loss"])
        default["fraction_of_baseline_wall"] = (None if default["s_to_target"] is None
                                                else round(default["s_to_target"] / b["wall_s"], 3))
        default["baseline_loss_at_same_wall"] = loss_at(b["curve"], default["wall_s"])
        default["tokens_per_s"] = round(dtrain.batch_size * dcfg.max_seq_len * dtrain.max_iters
                                        / (default["wall_s"] - default["setup_s"]))
        d_params = sum(p.numel() for p in GPT(dcfg).parameters())
        peak = info["peak_bf16_gflops"] if default["dtype"] == "bf16" else info["peak_fp32_gflops"]
        default["mfu_of_chosen_dtype_peak"] = round(
            flops_per_token(d_params, dcfg.n_layers, dcfg.dim, dcfg.max_seq_len) * default["tokens_per_s"]
            / (peak * 1e9), 3)
        runs.append({"seed": seed, "baseline": b, "qkv_same_recipe": same, "qkv_default": default})
        print(json.dumps({"seed": seed, "baseline": {k: v for k, v in b.items() if k != "curve"},
                          "same": {k: v for k, v in same.items() if k != "curve"},
                          "default": {k: v for k, v in default.items() if k != "curve"}}), flush=True)
    summary = summarise(runs)
    print(json.dumps(summary, indent=1), flush=True)

    # 3. Generation with and without the KV cache.
    gen = generation_speed(args.quick)
    print(json.dumps(gen, indent=1), flush=True)

    results = {
        **info, "iters": iters, "seeds": seeds, "speed": speed,
        "default_recipe": {"model": dcfg.to_dict(), "train": dataclasses.asdict(dtrain), "optimizer": dkind},
        "runs": runs, "summary": summary, "generation": gen, "peak_rss_mb": round(peak_rss_mb(), 1),
        "load": meter.stop(),
    }
    print(load_line(results["load"]))
    out = Path(args.out or RESULTS_DIR / f"train_speed{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {out}")
    return 0


def summarise(runs: list[dict]) -> dict:
    """Means over seeds, and the per-seed numbers the tables quote."""
    def col(part: str, key: str) -> list:
        return [r[part][key] for r in runs]

    fr = [f for f in col("qkv_default", "fraction_of_baseline_wall") if f is not None]
    return {
        "baseline_val_loss": col("baseline", "val_loss"),
        "baseline_wall_s": col("baseline", "wall_s"),
        "same_recipe_val_loss": col("qkv_same_recipe", "val_loss"),
        "same_recipe_wall_s": col("qkv_same_recipe", "wall_s"),
        "same_recipe_minus_baseline_mean": round(statistics.fmean(col("qkv_same_recipe", "val_loss"))
                                                 - statistics.fmean(col("baseline", "val_loss")), 4),
        "default_val_loss": col("qkv_default", "val_loss"),
        "default_wall_s": col("qkv_default", "wall_s"),
        "default_s_to_baseline_loss": col("qkv_default", "s_to_target"),
        "default_fraction_of_baseline_wall": col("qkv_default", "fraction_of_baseline_wall"),
        "default_reached_target_in_every_seed": len(fr) == len(runs),
        "default_fraction_median": round(statistics.median(fr), 3) if fr else None,
    }


if __name__ == "__main__":
    sys.exit(main())
