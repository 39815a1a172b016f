"""Training and generation speed of qkv vs the baseline everyone knows: nanoGPT's CPU recipe.

Baseline: nanoGPT's model (learned positions, pre-LN blocks without biases, GELU MLP, tied
embeddings, PyTorch SDPA attention), written out below independently of qkv, trained the way
nanoGPT trains on a CPU: fp32, eager, torch.optim.AdamW, char-level, block 64, batch 12,
4 layers, 4 heads, dim 128, dropout 0, lr 1e-3 cosine to 1e-4 over 2000 iterations, warmup 100,
β2 0.99, weight decay 0.1, gradient clipping 1.0.

qkv: the same recipe through qkv's Trainer with its defaults (torch.compile, fused AdamW,
bf16 autocast where the CPU has native bf16 — otherwise fp32), and the `cpu` preset of
`qkv train`. Both read the same tokens (the Shakespeare corpus, char-level) and are scored
on the same validation batches.

Reported: ms/iter and tokens/s (interleaved timing blocks, medians), val loss at the end,
wall time, achieved FLOP/s as a fraction of this machine's measured matmul peak (fp32 and
bf16), the wall time the `cpu` preset needs to reach the baseline's final val loss, KV-cache
vs no-cache generation speed (500 new tokens, `shakespeare-char` preset model), and peak RSS.

    python benchmarks/train_speed.py            # full run (~10 minutes on 2 cores)
    python benchmarks/train_speed.py --quick    # smoke run (~1 minute)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qkv.models.gpt import GPT, GPTConfig
from qkv.presets import get_preset
from qkv.training.lm import LMDataConfig, prepare_data
from qkv.training.optim import lr_at
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


def run_to_end(step_fn, max_iters: int, eval_fn, eval_every: int, target: float | None = None):
    """Train to ``max_iters``; returns (final val loss, wall s, s to reach ``target`` or None)."""
    t0 = time.perf_counter()
    hit = None
    for i in range(max_iters):
        step_fn()
        if target is not None and hit is None and ((i + 1) % eval_every == 0 or i + 1 == max_iters):
            pause = time.perf_counter()
            if eval_fn() <= target:
                hit = pause - t0
            t0 += time.perf_counter() - pause  # evaluation time is not training time
    wall = time.perf_counter() - t0
    return eval_fn(), wall, hit


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200 iterations instead of 2000")
    ap.add_argument("--out", default="benchmarks/results/train_speed.json", help="JSON results file")
    args = ap.parse_args(argv)

    iters = 200 if args.quick else 2000
    recipe = get_preset("gpt", "nanogpt-cpu")
    base_train = TrainConfig(
        **{**recipe["train"], "max_iters": iters, "lr_decay_iters": iters, "out_dir": "/tmp/qkv-bench-unused"}
    )
    _, tok, batches = prepare_data(LMDataConfig(), recipe["model"]["max_seq_len"])
    V, T = tok.vocab_size, recipe["model"]["max_seq_len"]
    mcfg = GPTConfig(**{**recipe["model"], "vocab_size": V})
    eval_n = 20 if args.quick else 100

    info = {
        "machine": {
            "cpu": _cpu_name(),
            "cores": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "peak_fp32_gflops": round(matmul_peak(torch.float32) / 1e9, 1),
        "peak_bf16_gflops": round(matmul_peak(torch.bfloat16, n=1024, reps=1) / 1e9, 1),
    }
    print(json.dumps(info, indent=1), flush=True)

    # 1. ms/iter, interleaved: baseline vs qkv (same recipe).
    torch.manual_seed(1337)
    base_model = NanoGPTBaseline(V, T, mcfg.dim, mcfg.n_layers, mcfg.n_heads)
    base = BaselineTrainer(base_model, base_train, batches, seed=1337)
    torch.manual_seed(1337)
    qkv_model = GPT(mcfg)
    qkv_cfg = TrainConfig(**{**base_train.__dict__})
    trainer = Trainer(qkv_model, qkv_cfg, batches, Path("/tmp/qkv-bench-unused"), tokens_per_batch=T)
    torch.manual_seed(1337)
    compiled = Trainer(GPT(mcfg), TrainConfig(**{**base_train.__dict__, "compile": True}), batches,
                       Path("/tmp/qkv-bench-unused"), tokens_per_batch=T)
    t0 = time.perf_counter()
    compiled._guarded_step()  # the cold torch.compile happens here
    compile_s = time.perf_counter() - t0

    def stepper(tr):
        def step():
            tr._guarded_step()
            tr.step += 1

        return step

    for _ in range(5):  # warm-up
        base.train_step()
        stepper(trainer)()
        stepper(compiled)()
    ms = timed_blocks(
        {"baseline": base.train_step, "qkv": stepper(trainer), "qkv_compiled": stepper(compiled)},
        steps=10 if args.quick else 25,
        rounds=3 if args.quick else 6,
    )
    n_params = sum(p.numel() for p in qkv_model.parameters())
    fpt = flops_per_token(n_params, mcfg.n_layers, mcfg.dim, T)
    tok_per_iter = base_train.batch_size * T
    speed = {
        k: {
            "ms_per_iter": round(v, 2),
            "tokens_per_s": round(tok_per_iter / v * 1000),
            "mfu_fp32": round(fpt * tok_per_iter / (v / 1000) / (info["peak_fp32_gflops"] * 1e9), 3),
        }
        for k, v in ms.items()
    }
    speed["ratio_baseline_over_qkv"] = round(ms["baseline"] / ms["qkv"], 2)
    speed["qkv_compute_dtype"] = str(trainer.dtype)
    speed["qkv_default_compiles"] = trainer.compiled
    speed["ratio_baseline_over_qkv_compiled"] = round(ms["baseline"] / ms["qkv_compiled"], 2)
    speed["cold_compile_s"] = round(compile_s, 1)
    print(json.dumps(speed, indent=1), flush=True)

    # 2. Full runs from scratch: val loss at the end and wall time.
    torch.manual_seed(1337)
    base = BaselineTrainer(
        NanoGPTBaseline(V, T, mcfg.dim, mcfg.n_layers, mcfg.n_heads), base_train, batches, 1337
    )
    b_loss, b_wall, _ = run_to_end(
        base.train_step, iters, lambda: val_loss(base.model, batches, 12, eval_n), 10**9
    )
    torch.manual_seed(1337)
    trainer = Trainer(GPT(mcfg), qkv_cfg, batches, Path("/tmp/qkv-bench-unused"), tokens_per_batch=T)

    def qkv_step():
        trainer._guarded_step()
        trainer.step += 1

    q_loss, q_wall, _ = run_to_end(
        qkv_step, iters, lambda: val_loss(lambda x, y: trainer.model(x, y).loss, batches, 12, eval_n), 10**9
    )
    full = {
        "baseline": {"val_loss": round(b_loss, 4), "wall_s": round(b_wall, 1)},
        "qkv_same_recipe": {"val_loss": round(q_loss, 4), "wall_s": round(q_wall, 1)},
        "wall_ratio": round(b_wall / q_wall, 2),
    }
    print(json.dumps(full, indent=1), flush=True)

    # 3. The `cpu` preset: wall time to reach the baseline's final val loss.
    cpu = get_preset("gpt", "cpu")
    c_iters = 300 if args.quick else cpu["train"]["max_iters"]
    c_model = GPTConfig(**{**cpu["model"], "vocab_size": V})
    _, _, c_batches = prepare_data(LMDataConfig(), c_model.max_seq_len, tok)
    c_cfg = TrainConfig(**{**cpu["train"], "max_iters": c_iters, "out_dir": "/tmp/qkv-bench-unused"})
    torch.manual_seed(1337)
    c_trainer = Trainer(
        GPT(c_model), c_cfg, c_batches, Path("/tmp/qkv-bench-unused"), tokens_per_batch=c_model.max_seq_len
    )

    def c_step():
        c_trainer._guarded_step()
        c_trainer.step += 1

    # Scored on the baseline's validation windows (block 64) so the losses are comparable.
    c_loss, c_wall, c_hit = run_to_end(
        c_step,
        c_iters,
        lambda: val_loss(lambda x, y: c_trainer.model(x, y).loss, batches, 12, eval_n),
        eval_every=50,
        target=b_loss,
    )
    preset_res = {
        "preset": cpu,
        "val_loss": round(c_loss, 4),
        "wall_s": round(c_wall, 1),
        "s_to_baseline_loss": None if c_hit is None else round(c_hit, 1),
        "fraction_of_baseline_wall": None if c_hit is None else round(c_hit / b_wall, 3),
    }
    print(json.dumps(preset_res, indent=1), flush=True)

    # 4. Generation with and without the KV cache.
    gen = generation_speed(args.quick)
    print(json.dumps(gen, indent=1), flush=True)

    results = {
        **info,
        "iters": iters,
        "speed": speed,
        "full_runs": full,
        "cpu_preset": preset_res,
        "generation": gen,
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
