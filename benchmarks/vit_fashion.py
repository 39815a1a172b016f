"""Vision Transformer on Fashion-MNIST (or MNIST) on a CPU: accuracy vs time, a CNN beside it,
and training / inference speed vs the same ViT in plain PyTorch.

Accuracy: the `fashion-cpu` preset trained by ``qkv.training.run.train_run`` of the ViT family (exactly what
`qkv train vit` runs), scored on the 10,000 test images: once alone on 2 threads (the time a user
sees), then over ``--seeds`` seeds as child processes on one thread each, two at a time. Beside
it, a small CNN with a similar parameter count (defined below, the lectures' CNN-vs-attention
question) trained by the same Trainer on the same batches (same augmentation, optimiser,
schedule shape) for the median ViT wall time (or ``--cnn-seconds``): its step count comes from
two short runs of that Trainer (40 and 160 steps), and its own wall time is recorded beside it.
The ablation (``--ablation KEY``, repeatable; ``--ablation-iters``) retrains the preset with one
choice undone at a time, in the same queue, so both cores stay busy with a run each.

Speed: images/s of a training step (forward, backward, AdamW) and of inference (batch 500) for
qkv's ViT as the preset runs it vs the same ViT written with ``torch.nn.TransformerEncoderLayer``
(pre-LN, GELU, fp32, eager: "plain PyTorch"), with the same widths and weights count, plus
qkv with PyTorch's SDPA backend. Contenders run round-robin; the ratio is the median over
rounds of the within-round ratio.

    python benchmarks/vit_fashion.py --skip ablation --skip speed   # ~60 minutes on 2 cores (Zen 4)
    python benchmarks/vit_fashion.py --skip alone --skip accuracy --skip speed \
        --ablation-iters 11000        # the full-length ablation: 12 runs of ~7-14 min on one core each
    python benchmarks/vit_fashion.py --dataset mnist     # the same recipe on MNIST
    python benchmarks/vit_fashion.py --quick             # smoke run (~7 minutes on a 2-core Zen 3)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import _common as C
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.data.images import ImageBatches
from qkv.families.vit import ImageDataConfig, ViTFamily, evaluate_split, fit_model_config, load_data
from qkv.models.vit import ViT, ViTConfig, conv_stem, patchify
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
    """The preset's ViT written with torch.nn only: the same convolutional stem (torch.nn layers,
    built by qkv's ``conv_stem``) or a linear patch embedding, class token, learned positions,
    ``nn.TransformerEncoder`` of pre-LN GELU layers, final LayerNorm, linear head."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stem = (conv_stem(cfg.channels, cfg.dim, cfg.patch_size, cfg.stem_width, cfg.stem_refine)
                     if cfg.stem == "conv" else None)
        self.patch_embed = nn.Linear(self.stem[-2].num_features if self.stem is not None  # its last width
                                     else cfg.channels * cfg.patch_size**2, cfg.dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos = nn.Parameter(torch.randn(1, cfg.n_patches + 1, cfg.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.n_heads, cfg.mlp_hidden or 4 * cfg.dim,
                                           dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True, layer_norm_eps=cfg.norm_eps)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> _Out:
        pixels = (self.stem(x).flatten(2).transpose(1, 2) if self.stem is not None
                  else patchify(x, self.cfg.patch_size))
        t = self.patch_embed(pixels)
        t = torch.cat([self.cls_token.expand(len(t), -1, -1), t], dim=1) + self.pos
        logits = self.head(self.norm(self.encoder(t))[:, 0])
        return _Out(logits, None if y is None else F.cross_entropy(logits, y))


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- accuracy
#
# Every training run is a child process of this script on one thread, two at a time, so each
# has one of the two cores and the other core is busy with a run like it (the same conditions
# for every ViT and CNN run). The ViT seeds go first; each CNN then trains for the median ViT
# wall time (its step count from two short runs of its own Trainer taken in those conditions).

# The ablation: the preset with one change undone at a time (and one added), on one seed, at
# --ablation-iters steps (ABLATION_ITERS by default, a quick look; the preset's own length is
# what BENCHMARKS.md reports): what each choice buys.
ABLATION_ITERS = 3000
_PRESET_ITERS = get_preset("vit", "fashion-cpu")["train"]["max_iters"]
_HALF = _PRESET_ITERS // 2
NO_STEM = {"stem": "linear", "stem_width": None, "stem_refine": 0}
LINEAR = {**NO_STEM, "patch_overlap": 1}  # the patch embedding of the preset before the conv stem
ABLATION: dict[str, tuple[str, dict]] = {  # --ablation KEY: (label, the change)
    "preset": ("preset", {}),
    "narrow-stem": ("the first conv stem: 16 -> 32 -> 64 channels, no stride-1 convolution",
                    {"model": {"stem_width": None, "stem_refine": 0}}),
    "no-refine": ("no stride-1 convolution in the stem (32 -> 64 -> 64)", {"model": {"stem_refine": 0}}),
    "linear-overlap": ("linear patches overlapping by 1 px (before the conv stem)", {"model": LINEAR}),
    "linear": ("plain linear patches", {"model": NO_STEM}),
    "no-smoothing": ("no label smoothing", {"model": {"label_smoothing": 0.0}}),
    "no-flips": ("no horizontal flips", {"data": {"flip": False}}),
    "no-shifts": ("no 1-pixel shifts", {"data": {"shift": 0}}),
    "half-schedule": (f"half the schedule ({_HALF:,} steps)", {"train": {"max_iters": _HALF}}),
    "mean": ("mean-pooled read-out", {"model": {"read_out": "mean"}}),
    "mean-sincos": ("mean read-out, 2-D sinusoidal positions", {"model": {"read_out": "mean",
                                                                         "positions": "sinusoidal"}}),
    "erase": ("+ random erasing (p = 0.25)", {"data": {"erase": 0.25}}),
}


def _vit_configs(dataset: str, max_iters: int | None, change: dict | None = None, seed: int | None = None):
    preset = get_preset("vit", "fashion-cpu")
    change = change or {}
    model = ViTConfig(**{**preset["model"], "image_size": preset["model"]["patch_size"],
                         **change.get("model", {})})
    train = TrainConfig(**{**preset["train"], **({"max_iters": max_iters} if max_iters else {}),
                           **({"seed": seed} if seed is not None else {}), **change.get("train", {})})
    data = ImageDataConfig(**{**preset["data"], "dataset": dataset, **change.get("data", {})})
    return model, train, data


def _quiet(*_: object) -> None:
    pass


def worker(args: argparse.Namespace) -> int:
    """One training run (``--worker vit|cnn``) on ``--threads`` threads; its result as JSON."""
    import json

    torch.set_num_threads(args.threads)
    change = json.loads(args.change) if args.change else {}
    model_cfg, train_cfg, data_cfg = _vit_configs(args.dataset, args.max_iters, change, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        if args.worker == "vit":
            t0 = time.perf_counter()
            done = train_run(ViTFamily(), model_cfg, TrainConfig(**{**train_cfg.__dict__, "out_dir": tmp}),
                             data_cfg, evaluate=False, on_log=_quiet, on_note=_quiet)
            train_s = time.perf_counter() - t0
            model, data, batches = done.model, done.prepared.state, done.prepared.batches
            acc = {split: evaluate_split(model, data, batches.mean, batches.std, split)["accuracy"]
                   for split in ("test", "val")}
            row = {"model": "ViT", "params": n_params(model), "steps": done.result.step,
                   "test_accuracy": acc["test"], "val_accuracy": acc["val"]}
        else:
            data = load_data(data_cfg)
            batches = ImageBatches(data, shift=data_cfg.shift, flip=data_cfg.flip, erase=data_cfg.erase)
            steps, fixed_s, step_s, settings, fallback = _cnn_steps(args.seconds, train_cfg, data, batches,
                                                                    Path(tmp))
            torch.manual_seed(train_cfg.seed)
            cnn = SmallCNN(*data.shape[:1], len(data.classes))
            t0 = time.perf_counter()
            Trainer(cnn, _cnn_config(train_cfg, steps, tmp, **settings), batches, Path(tmp)).fit()
            train_s = time.perf_counter() - t0
            cnn.eval()
            with torch.no_grad():
                preds = torch.cat([cnn(batches.normalize(data.test_x[i:i + 500])).logits.argmax(-1)
                                   for i in range(0, len(data.test_x), 500)])
            row = {"model": "CNN", "params": n_params(cnn), "steps": steps, "target_s": args.seconds,
                   "probe_step_s": round(step_s, 4), "probe_fixed_s": round(fixed_s, 1), **settings,
                   "probe_fallback": fallback,
                   "test_accuracy": float((preds == data.test_y).float().mean())}
    row.update({"seed": train_cfg.seed, "train_s": round(train_s, 1), "threads": args.threads,
                "change": change})
    Path(args.out).write_text(json.dumps(row))
    return 0


def _cnn_config(train_cfg: TrainConfig, steps: int, out_dir: str, **settings: object) -> TrainConfig:
    """The CNN's training config: the ViT's (batch, optimiser, schedule shape, seed) at its own
    step count and a peak learning rate suited to a CNN."""
    return TrainConfig(**{**train_cfg.__dict__, "max_iters": steps, "lr": 2e-3,
                          "warmup_iters": min(train_cfg.warmup_iters, steps // 10),
                          "eval_interval": max(steps // 4, 1), "out_dir": out_dir, **settings})


def _cnn_steps(seconds: float, train_cfg: TrainConfig, data, batches,
               tmp: Path) -> tuple[int, float, float, dict, bool]:
    """How many CNN steps fill ``seconds`` of training: the Trainer's own choice of precision and
    compiling for a run of about that length, then two short runs of the real Trainer with those
    settings (40 and 160 steps), whose difference is the time of a step (data, optimiser,
    logging) and whose rest the fixed cost (set-up, evaluation). (steps, fixed s, step s, settings,
    whether the 160-step run's mean step replaced a broken difference)."""
    # the Trainer chooses precision and compiling by a run's length: give it about the real one
    # (0.1 s a step: a CNN step on one Zen 4 core measured 0.12-0.15 s, vit_fashion_cnn_ablation.json)
    guess = Trainer(SmallCNN(*data.shape[:1], len(data.classes)),
                    _cnn_config(train_cfg, max(50, int(seconds / 0.1)), str(tmp / "p0")), batches, tmp / "p0")
    settings = {"dtype": guess.speed.dtype, "compile": guess.compiled}
    del guess
    took = {}
    for k in (40, 160):
        run = tmp / f"p{k}"
        cfg = TrainConfig(**{**_cnn_config(train_cfg, k, str(run), **settings).__dict__, "eval_interval": k})
        t0 = time.perf_counter()
        Trainer(SmallCNN(*data.shape[:1], len(data.classes)), cfg, batches, run).fit()
        took[k] = time.perf_counter() - t0
    step_s, fixed_s = (took[160] - took[40]) / 120, took[40] - 40 * (took[160] - took[40]) / 120
    fallback = step_s < 0.5 * took[160] / 160
    if fallback:
        # a one-off cost in one short run but not the other (a compile, a precision probe, a burst
        # of load) broke the difference: one run of 2026-12-04 got a step of ~0 s and a schedule of
        # millions of steps. A step is then at most the 160-step run's mean (a few % too long).
        step_s, fixed_s = took[160] / 160, 0.0
    fixed_s = max(fixed_s, 0.0)
    return max(50, int((seconds - fixed_s) / step_s)), fixed_s, step_s, settings, fallback


def _spawn(kind: str, seed: int, out: Path, args: argparse.Namespace, seconds: float | None = None,
           change: dict | None = None, max_iters: int | None = None, threads: int = 1):
    import json
    import os
    import subprocess

    cmd = [sys.executable, __file__, "--worker", kind, "--seed", str(seed), "--threads", str(threads),
           "--out", str(out), "--dataset", args.dataset]
    if seconds is not None:
        cmd += ["--seconds", f"{seconds:.1f}"]
    if change:
        cmd += ["--change", json.dumps(change)]
    if max_iters or args.max_iters:
        cmd += ["--max-iters", str(max_iters or args.max_iters)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, env=env)


def _run_two_at_a_time(jobs: list, tmp: Path, args: argparse.Namespace) -> list[dict]:
    """jobs: (label, kind, seed, change, max_iters) tuples; CNN jobs wait for a ViT result and
    train for the median ViT wall time so far. Results in job order."""
    import json

    pending, running, done = list(enumerate(jobs)), [], {}
    while pending or running:
        vit_times = [r["train_s"] for r in done.values() if r["label"] == VIT_LABEL]
        while len(running) < 2 and pending:
            i, (label, kind, seed, change, iters) = pending[0]
            if kind == "cnn" and not vit_times and not args.cnn_seconds:
                break
            pending.pop(0)
            out = tmp / f"job{i}.json"
            secs = (args.cnn_seconds or C.median(vit_times)) if kind == "cnn" else None
            print(f"  start {label} (seed {seed}{f', {secs:.0f} s' if secs else ''})", flush=True)
            running.append((i, label, out, _spawn(kind, seed, out, args, secs, change, iters)))
        time.sleep(2)
        for item in list(running):
            i, label, out, proc = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"{label} (seed {jobs[i][2]}) failed with exit code {proc.returncode}")
            row = json.loads(out.read_text())
            row["label"] = label
            done[i] = row
            print(f"  {label}, seed {row['seed']}: {row['test_accuracy']:.2%} test in {row['train_s']:.0f} s",
                  flush=True)
    return [done[i] for i in range(len(jobs))]


VIT_LABEL, CNN_LABEL = "ViT (fashion-cpu preset)", "CNN (equal time)"


def accuracy_jobs(args: argparse.Namespace) -> list[tuple]:
    """The ViT seeds (unless --cnn-seconds gives the CNNs' time), then the CNN seeds."""
    seeds = [1337 + k for k in range(args.seeds)]
    jobs = [] if args.cnn_seconds else [(VIT_LABEL, "vit", s, None, None) for s in seeds]
    if "cnn" not in args.skip:
        jobs += [(CNN_LABEL, "cnn", s, None, None) for s in seeds]
    return jobs


def bench_alone(args: argparse.Namespace) -> dict:
    """One preset run (the first seed) alone on the machine's two threads, as `qkv train vit`
    runs it: the wall time a user sees, run before anything else starts."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "alone.json"
        print("  start ViT alone on 2 threads (seed 1337)", flush=True)
        proc = _spawn("vit", 1337, out, args, threads=2)
        if proc.wait() != 0 or not out.exists():
            raise RuntimeError(f"the ViT run alone failed with exit code {proc.returncode}")
        row = json.loads(out.read_text())
    row["label"] = f"{VIT_LABEL}, alone on 2 threads"
    print(f"  {row['label']}: {row['test_accuracy']:.2%} test in {row['train_s']:.0f} s", flush=True)
    return row


QUICK_ABLATION = ("preset", "linear", "half-schedule")  # --quick: a smoke run of each kind of change


def ablation_jobs(args: argparse.Namespace) -> list[tuple]:
    """(label, kind, seed, change, max_iters) of each ablation run. ``--quick``: QUICK_ABLATION
    (unless --ablation names others) at 300 steps, a change of the schedule scaled to them (half
    the schedule: 150 steps; its own 5,500 had kept the smoke run going past 17 minutes)."""
    iters = 300 if args.quick else args.ablation_iters
    jobs = []
    for key in args.ablation or (QUICK_ABLATION if args.quick else ABLATION):
        label, change = ABLATION[key]
        own = change.get("train", {}).get("max_iters")
        if args.quick and own:  # the same fraction of this run's steps
            steps = max(1, own * iters // _PRESET_ITERS)
            label = label.replace(f"{own:,}", f"{steps:,}")
            change = {**change, "train": {**change["train"], "max_iters": steps}}
        jobs.append((label, "vit", 1337, change, iters))
    return jobs


def _summary(rows: list[dict], label: str) -> dict | None:
    accs = sorted(r["test_accuracy"] for r in rows if r["label"] == label)
    times = sorted(r["train_s"] for r in rows if r["label"] == label)
    if not accs:
        return None
    return {"label": label, "n": len(accs), "min": accs[0], "median": C.median(accs), "max": accs[-1],
            "train_s_min": times[0], "train_s_max": times[-1]}


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
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 300 steps, 1 timing round, three of the ablations")
    p.add_argument("--max-iters", type=int, default=None, help="ViT steps (default: the preset's)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds")
    p.add_argument("--seeds", type=int, default=3, help="training seeds of the ViT and of the CNN")
    p.add_argument("--skip", choices=("alone", "accuracy", "cnn", "ablation", "speed"), action="append",
                   default=[], help="(repeatable) alone: the preset timed alone on 2 threads")
    p.add_argument("--ablation-iters", type=int, default=ABLATION_ITERS,
                   help=f"steps of each ablation run (the preset's own: {_PRESET_ITERS:,})")
    p.add_argument("--ablation", choices=tuple(ABLATION), action="append", default=None,
                   help="(repeatable) run only these ablation rows (default: all)")
    p.add_argument("--cnn-seconds", type=float, default=None,
                   help="train the CNNs for this many seconds and do not rerun the ViT seeds (default: the "
                        "median ViT time of this run)")
    # a child run (used by this script itself)
    p.add_argument("--worker", choices=("vit", "cnn"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--change", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.max_iters, args.rounds, args.seeds = args.max_iters or 300, 1, min(args.seeds, 1)
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
    if "alone" not in args.skip:
        result["alone"] = bench_alone(args)
    # the accuracy and ablation runs share one queue, so both cores stay busy with a run each
    acc_jobs = accuracy_jobs(args) if "accuracy" not in args.skip else []
    abl_jobs = ablation_jobs(args) if "ablation" not in args.skip else []
    with tempfile.TemporaryDirectory() as tmp:
        done = _run_two_at_a_time(acc_jobs + abl_jobs, Path(tmp), args)
    if acc_jobs:
        rows = done[:len(acc_jobs)]
        result["accuracy"] = rows
        if args.cnn_seconds:
            result["cnn_seconds"] = args.cnn_seconds
        result["accuracy_summary"] = [x for x in (_summary(rows, lab) for lab in
                                                  (VIT_LABEL, CNN_LABEL)) if x]
        C.print_table(f"{args.dataset}: test accuracy and training time (one core each, two runs at a time)",
                      ["model", "seed", "parameters", "steps", "train time", "test accuracy"],
                      [[r["label"], str(r["seed"]), f"{r['params'] / 1e6:.2f}M", str(r["steps"]),
                        C.fmt_time(r["train_s"]), f"{r['test_accuracy']:.2%}"] for r in rows])
        for x in result["accuracy_summary"]:
            print(f"{x['label']}: min {x['min']:.2%}, median {x['median']:.2%}, max {x['max']:.2%} over "
                  f"{x['n']} seeds; training {x['train_s_min']:.0f}-{x['train_s_max']:.0f} s", flush=True)
    if abl_jobs:
        rows = done[len(acc_jobs):]
        result["ablation"] = rows
        base = next((r["test_accuracy"] for r in rows if r["label"] == "preset"), None)
        C.print_table("what each choice buys (seed 1337, one core each)",
                      ["variant", "steps", "train time", "test accuracy", "vs preset"],
                      [[r["label"], str(r["steps"]), C.fmt_time(r["train_s"]), f"{r['test_accuracy']:.2%}",
                        "" if base is None else f"{100 * (r['test_accuracy'] - base):+.2f} pt"]
                       for r in rows])
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
