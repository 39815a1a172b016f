"""Vision Transformer on Fashion-MNIST (or MNIST) on a CPU: accuracy vs time, a CNN beside it,
and training / inference speed vs the same ViT in plain PyTorch.

Accuracy: the `fashion-cpu` preset trained by ``qkv.training.run.train_run`` of the ViT family (exactly what
`qkv train vit` runs), scored on the 10,000 test images. Beside it, a small CNN with a similar
parameter count (defined below, the lectures' CNN-vs-attention question) trained by the same
Trainer on the same batches (same augmentation, optimiser, schedule shape), once for the
number of steps that a 12-step timing probe projects to fit in the ViT's wall time ("equal
time", projected: the CNN's own wall time is recorded beside it and differs when the machine is
busy) and once for a fifth of those steps.

Speed: images/s of a training step (forward, backward, AdamW) and of inference (batch 500) for
qkv's ViT as the preset runs it vs the same ViT written with ``torch.nn.TransformerEncoderLayer``
(pre-LN, GELU, fp32, eager: "plain PyTorch"), with the same widths and weights count, plus
qkv with PyTorch's SDPA backend. Contenders run round-robin; the ratio is the median over
rounds of the within-round ratio.

    python benchmarks/vit_fashion.py                     # ~25 minutes on 2 cores
    python benchmarks/vit_fashion.py --dataset mnist     # the same recipe on MNIST
    python benchmarks/vit_fashion.py --quick             # smoke run (~2 minutes)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import _common as C
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.families.vit import ImageDataConfig, ViTFamily, evaluate_split, fit_model_config, load_data
from qkv.models.vit import ViT, ViTConfig, patchify
from qkv.presets import get_preset
from qkv.training.run import train_run
from qkv.training.trainer import TrainConfig, Trainer

NAME = "vit_fashion"


# ----------------------------------------------------------------------------- baselines


class _Out(NamedTuple):
    logits: Tensor
    loss: Tensor | None


class SmallCNN(nn.Module):
    """Three 3×3 conv stages (32, 64, 128 channels; BatchNorm, ReLU, 2×2 max-pool after the first
    two), global average pooling, a linear head: ~0.2M parameters, like the preset ViT."""

    def __init__(self, channels: int = 1, n_classes: int = 10, width: int = 32) -> None:
        super().__init__()

        def stage(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        w = width
        self.features = nn.Sequential(
            *stage(channels, w), *stage(w, w), nn.MaxPool2d(2),
            *stage(w, 2 * w), *stage(2 * w, 2 * w), nn.MaxPool2d(2),
            *stage(2 * w, 4 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(4 * w, n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> _Out:
        logits = self.head(self.features(x))
        return _Out(logits, None if y is None else F.cross_entropy(logits, y))


class TorchViT(nn.Module):
    """The preset's ViT written with torch.nn only: linear patch embedding, class token, learned
    positions, ``nn.TransformerEncoder`` of pre-LN GELU layers, final LayerNorm, linear head."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch_size**2, cfg.dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos = nn.Parameter(torch.randn(1, cfg.n_patches + 1, cfg.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.n_heads, cfg.mlp_hidden or 4 * cfg.dim,
                                           dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True, layer_norm_eps=cfg.norm_eps)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> _Out:
        t = self.patch_embed(patchify(x, self.cfg.patch_size))
        t = torch.cat([self.cls_token.expand(len(t), -1, -1), t], dim=1) + self.pos
        logits = self.head(self.norm(self.encoder(t))[:, 0])
        return _Out(logits, None if y is None else F.cross_entropy(logits, y))


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- accuracy


def _vit_configs(dataset: str, max_iters: int | None):
    preset = get_preset("vit", "fashion-cpu")
    model = ViTConfig(**{**preset["model"], "image_size": preset["model"]["patch_size"]})
    train = TrainConfig(**{**preset["train"], **({"max_iters": max_iters} if max_iters else {})})
    data = ImageDataConfig(**{**preset["data"], "dataset": dataset})
    return model, train, data


def bench_accuracy(args: argparse.Namespace) -> list[dict]:
    model_cfg, train_cfg, data_cfg = _vit_configs(args.dataset, args.max_iters)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "vit"
        t0 = time.perf_counter()
        done = train_run(ViTFamily(), model_cfg, train_cfg.__class__(
            **{**train_cfg.__dict__, "out_dir": str(run)}), data_cfg, evaluate=False)
        model, data, batches, result = done.model, done.prepared.state, done.prepared.batches, done.result
        vit_s = time.perf_counter() - t0
        ev = evaluate_split(model, data, batches.mean, batches.std, "test")
        rows.append({"model": "ViT (fashion-cpu preset)", "params": n_params(model),
                     "steps": result.step, "train_s": round(vit_s, 1), "test_accuracy": ev["accuracy"]})
        print(f"ViT: {ev['accuracy']:.2%} test accuracy after {vit_s:.0f} s", flush=True)

        # The CNN: same batches and Trainer; its step time calibrated so it trains for the same
        # wall time (and a fifth of it).
        probe = SmallCNN(*data.shape[:1], len(data.classes))
        opt = torch.optim.AdamW(probe.parameters(), 1e-3)
        gen = torch.Generator().manual_seed(0)
        times = []
        for _ in range(12):
            x, y = batches.get_batch("train", train_cfg.batch_size, gen)
            t = time.perf_counter()
            probe(x, y).loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        step_s = C.median(times[2:]) * 1.1  # + the data and logging work of a Trainer step
        for share, label in () if "cnn" in args.skip else ((1.0, "equal time"), (0.2, "a fifth of the time")):
            steps = max(50, int(vit_s * share / step_s))
            torch.manual_seed(train_cfg.seed)
            cnn = SmallCNN(*data.shape[:1], len(data.classes))
            cfg = TrainConfig(**{**train_cfg.__dict__, "max_iters": steps, "lr": 2e-3,
                                 "warmup_iters": min(train_cfg.warmup_iters, steps // 10),
                                 "eval_interval": max(steps // 4, 1),
                                 "out_dir": str(Path(tmp) / f"cnn{share}")})
            t0 = time.perf_counter()
            Trainer(cnn, cfg, batches, Path(cfg.out_dir)).fit()
            cnn_s = time.perf_counter() - t0
            cnn.eval()
            with torch.no_grad():
                preds = torch.cat([cnn(batches.normalize(data.test_x[i:i + 500])).logits.argmax(-1)
                                   for i in range(0, len(data.test_x), 500)])
            acc = float((preds == data.test_y).float().mean())
            rows.append({"model": f"CNN ({label}, projected)", "params": n_params(cnn), "steps": steps,
                         "train_s": round(cnn_s, 1), "projected_train_s": round(steps * step_s, 1),
                         "probe_step_s": round(step_s, 4), "test_accuracy": acc})
            print(f"CNN ({label}, projected {steps * step_s:.0f} s): {acc:.2%} after {cnn_s:.0f} s",
                  flush=True)
        shutil.rmtree(run, ignore_errors=True)
    return rows


# ----------------------------------------------------------------------------- speed


def bench_speed(args: argparse.Namespace) -> list[dict]:
    model_cfg, train_cfg, data_cfg = _vit_configs("fashion-mnist", None)
    data = load_data(data_cfg)
    cfg = fit_model_config(model_cfg, data)
    torch.manual_seed(0)
    contenders = {
        "plain PyTorch (nn.TransformerEncoder, fp32 eager)": TorchViT(cfg),
        f"qkv ViT ({cfg.backend} backend, as the preset)": ViT(cfg),
        "qkv ViT (sdpa backend)": ViT(cfg.__class__(**{**cfg.__dict__, "backend": "sdpa"})),
    }
    bs = train_cfg.batch_size
    x = (data.train_x[:bs].float() / 255 - 0.29) / 0.35
    y = data.train_y[:bs]
    xi = (data.test_x[:500].float() / 255 - 0.29) / 0.35
    opts = {k: torch.optim.AdamW(m.parameters(), 1e-3) for k, m in contenders.items()}

    def train_time(name: str, steps: int) -> float:
        m, opt = contenders[name], opts[name]
        m.train()
        t = time.perf_counter()
        for _ in range(steps):
            m(x, y).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) / steps

    def infer_time(name: str, reps: int) -> float:
        m = contenders[name].eval()
        t = time.perf_counter()
        with torch.inference_mode():
            for _ in range(reps):
                m(xi)
        return (time.perf_counter() - t) / reps

    steps, reps = (5, 2) if args.quick else (30, 10)
    for name in contenders:  # warm up
        train_time(name, 2)
        infer_time(name, 1)
    tr: dict[str, list[float]] = {k: [] for k in contenders}
    inf: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            tr[name].append(train_time(name, steps))
            inf[name].append(infer_time(name, reps))
    base = names[0]
    rows = []
    for name in names:
        rows.append({
            "contender": name, "params": n_params(contenders[name]),
            "train_images_per_s": bs / C.median(tr[name]),
            "train_ratio": C.median([b / t for b, t in zip(tr[base], tr[name], strict=True)]),
            "infer_images_per_s": 500 / C.median(inf[name]),
            "infer_ratio": C.median([b / t for b, t in zip(inf[base], inf[name], strict=True)]),
        })
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist", choices=("fashion-mnist", "mnist"))
    p.add_argument("--quick", action="store_true", help="300 steps and 1 timing round")
    p.add_argument("--max-iters", type=int, default=None, help="ViT steps (default: the preset's)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds")
    p.add_argument("--skip", choices=("accuracy", "cnn", "speed"), action="append", default=[])
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    if args.quick:
        args.max_iters, args.rounds = args.max_iters or 300, 1
    try:
        from qkv.assets import asset_path

        asset_path(args.dataset)
        if "speed" not in args.skip:
            asset_path("fashion-mnist")
    except Exception as e:
        print(f"{NAME}: {e}", file=sys.stderr)
        return 2
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    result: dict = {"machine": machine, "dataset": args.dataset, "quick": args.quick}
    if "accuracy" not in args.skip:
        rows = bench_accuracy(args)
        result["accuracy"] = rows
        C.print_table(f"{args.dataset}: test accuracy and training wall time (2 CPU cores)",
                      ["model", "parameters", "steps", "train time", "test accuracy"],
                      [[r["model"], f"{r['params'] / 1e6:.2f}M", str(r["steps"]),
                        C.fmt_time(r["train_s"]), f"{r['test_accuracy']:.2%}"] for r in rows])
    if "speed" not in args.skip:
        rows = bench_speed(args)
        result["speed"] = rows
        C.print_table("ViT training step (batch 128) and inference (batch 500), images/s",
                      ["contender", "params", "train img/s", "× plain", "infer img/s", "× plain"],
                      [[r["contender"], f"{r['params'] / 1e6:.3f}M", f"{r['train_images_per_s']:,.0f}",
                        f"{r['train_ratio']:.2f}", f"{r['infer_images_per_s']:,.0f}",
                        f"{r['infer_ratio']:.2f}"] for r in rows])
    result["load"] = meter.stop()
    print(C.load_line(result["load"]))
    suffix = "" if args.dataset == "fashion-mnist" else f"_{args.dataset.replace('-', '_')}"
    print(f"wrote {C.write_json(NAME + suffix + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
