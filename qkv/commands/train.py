"""`qkv train [FAMILY] --preset NAME [--field value ...]` and `qkv generate RUN_DIR ...`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

from qkv.commands.options import add_config_options, overrides
from qkv.models.gpt import GPTConfig
from qkv.presets import GPT_PRESETS, get_preset
from qkv.training.lm import LMDataConfig
from qkv.training.trainer import TrainConfig

FAMILIES = ("gpt",)


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (default: a GPT on the bundled Shakespeare corpus, in minutes on a CPU)",
        description="Train a model. With no arguments: the `cpu` preset of a character-level GPT "
        "on the 42 Shakespeare works (install them with `qkv assets install shakespeare`), then "
        "print a sample and write the run directory, a loss plot and an attention heatmap. "
        "Every config field below can be overridden; the defaults shown are the config classes' "
        "own, which the preset changes (see `qkv/presets.py`). Under torchrun it trains with DDP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("family", nargs="?", default="gpt", choices=FAMILIES, help="model family")
    p.add_argument("--preset", default="cpu",
                   help=f"named config; gpt presets: {', '.join(GPT_PRESETS)}")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue a run exactly where it stopped (step, optimiser, RNG, data position)")
    p.add_argument("--sample-tokens", type=int, default=300, help="length of the sample printed at the end")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    add_config_options(p, LMDataConfig, "data")
    add_config_options(p, GPTConfig, "model (GPTConfig)", skip=("vocab_size",))
    add_config_options(p, TrainConfig, "training (TrainConfig)")
    p.set_defaults(func=cmd_train)


def _configs(args: argparse.Namespace) -> tuple[GPTConfig, TrainConfig, LMDataConfig]:
    from qkv.training import checkpoint as ckpt
    from qkv.training.lm import default_run_dir

    model_over, train_over = overrides(args, GPTConfig), overrides(args, TrainConfig)
    data_over = overrides(args, LMDataConfig)
    if args.resume:
        saved = ckpt.read_json(Path(args.resume) / "config.json")
        if not isinstance(saved, dict) or saved.get("family") != "gpt" or not all(
            k in saved for k in ("model", "train", "data")
        ):
            raise ckpt.CheckpointError(f"{args.resume}/config.json is not a qkv GPT run configuration")
        if model_over or data_over:
            given = ", ".join({**model_over, **data_over})
            raise ValueError("--resume keeps the run's model and data settings; "
                             f"only training fields can change (got {given})")
        train = {**saved["train"], **train_over, "out_dir": args.resume}
        return GPTConfig(**saved["model"]), TrainConfig(**train), LMDataConfig(**{
            k: v for k, v in saved["data"].items() if k in {f.name for f in dataclasses.fields(LMDataConfig)}
        })
    preset = get_preset("gpt", args.preset)
    model = GPTConfig(**{**preset.get("model", {}), **model_over})
    train = {**preset.get("train", {}), **train_over}
    train.setdefault("out_dir", default_run_dir("gpt", args.preset))  # a new folder per run
    data = LMDataConfig(**{**preset.get("data", {}), **data_over})
    return model, TrainConfig(**train), data


class _Display:
    """Progress bar (rich) or plain lines; eval results always printed as a line."""

    def __init__(self, total: int, plain: bool) -> None:
        self.total, self.plain = total, plain
        self.t0 = time.perf_counter()
        self.progress = None
        if not plain:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
            except ImportError:
                self.plain = True
            else:
                self.progress = Progress(
                    TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} tok/s"),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                )
                self.task = self.progress.add_task("train", total=total, completed=0,
                                                   loss="-", tok_s="-")
                self.progress.start()

    def __call__(self, rec: dict) -> None:
        if rec.get("val_loss") is not None:
            best = " (best, saved)" if rec.get("best") else ""
            line = f"step {rec['step']:>6}  val loss {rec['val_loss']:.4f}{best}"
            if self.progress is not None:
                self.progress.console.print(line)
            else:
                print(line, flush=True)
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"], loss=f"{rec['train_loss']:.4f}",
                                 tok_s=f"{rec['tokens_per_s']:,.0f}")
        elif rec["step"] % 50 == 0:
            print(f"step {rec['step']:>6}  loss {rec['train_loss']:.4f}  "
                  f"{rec['tokens_per_s']:,.0f} tok/s  lr {rec['lr']:.2e}", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def cmd_train(args: argparse.Namespace) -> int:
    from qkv.training.distributed import cleanup, init_distributed
    from qkv.training.lm import attention_map, sample_text, train_lm
    from qkv.viz import plot_loss_curve

    model_cfg, train_cfg, data_cfg = _configs(args)
    dist = init_distributed(train_cfg.device)
    train_cfg = dataclasses.replace(train_cfg, device=dist.device)
    run_dir = Path(train_cfg.out_dir)
    if dist.is_main:
        print(f"qkv train gpt: preset {args.preset if not args.resume else '(resumed)'}, "
              f"{model_cfg.n_layers} layers x {model_cfg.dim} wide, context {model_cfg.max_seq_len}, "
              f"{train_cfg.max_iters} steps on {dist.device}"
              + (f" x {dist.world_size} processes" if dist.enabled else "") + f" -> {run_dir}", flush=True)
    display = _Display(train_cfg.max_iters, args.no_progress or not sys.stdout.isatty()) \
        if dist.is_main else None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*TF32.*")
            model, tok, result = train_lm(model_cfg, train_cfg, data_cfg, resume=bool(args.resume),
                                          dist=dist, on_log=display)
    finally:
        if display is not None:
            display.close()
        cleanup(dist)
    if not dist.is_main:
        return 0
    print(f"\ntrained {result.step} steps in {result.seconds:.0f} s ({result.tokens_per_s:,.0f} tok/s); "
          f"best val loss {result.best_val_loss:.4f}; {model.num_params() / 1e6:.2f}M parameters")
    sample = sample_text(model, tok, "\n", args.sample_tokens)
    print("\n--- sample (temperature 0.8, top-k 200) ---" + sample + "\n---")
    loss_png = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
    attn_png = attention_map(model, tok, sample.lstrip("\n"), run_dir / "attention.png")
    print(f"run directory: {run_dir}\n  weights: {run_dir / 'model.safetensors'}\n"
          f"  loss plot: {loss_png}\n  attention map (last layer): {attn_png}\n"
          f"generate more: qkv generate {run_dir} --prompt 'ROMEO:'")
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a trained run or from SmolLM2, with a KV cache",
        description="Sample a continuation of --prompt from a run directory written by `qkv train`, "
        "or from the pretrained SmolLM2-135M-Instruct (`qkv generate smollm2 --prompt ... [--chat]`; "
        "needs `qkv assets install smollm2`). Tokens stream to the terminal as they are generated.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_OR_MODEL",
                   help="a run directory from `qkv train`, a pretrained model (smollm2), or a "
                   "llama-architecture .gguf file")
    p.add_argument("--prompt", default="\n", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=300, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; <1 sharper, >1 more random")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with this mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible samples")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step (slow)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--chat", action="store_true",
                   help="(pretrained) wrap the prompt in the model's chat template and print the reply")
    p.add_argument("--system", default=None, help="(pretrained, --chat) a system message")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="weights' precision (default %(default)s: as loaded, i.e. float32, "
                   "exact to the reference)")
    p.set_defaults(func=cmd_generate)


def check_device(device: str) -> None:
    """ValueError naming the fix for a device this machine does not have."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA GPU (or torch is a CPU "
                         "build); use --device cpu")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from qkv.commands.pretrained import DECODERS, cmd_generate_pretrained
    from qkv.generation import generate, text_pieces
    from qkv.generation.decode import crop_prompt
    from qkv.training.lm import load_lm_run

    check_device(args.device)
    if (args.run in DECODERS and not Path(args.run).is_dir()) or args.run.lower().endswith(".gguf"):
        return cmd_generate_pretrained(args)
    if args.chat or args.system:
        raise ValueError("--chat and --system need a chat model (smollm2), not a trained run")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    model, tok, _ = load_lm_run(Path(args.run), args.device)
    if args.dtype:
        model.to(getattr(torch, args.dtype))
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    x, cropped = crop_prompt(x, model.cfg.max_seq_len)
    if cropped:
        print(f"qkv: warning: prompt has {len(ids)} tokens, more than the context; "
              f"keeping the last {x.shape[1]}", file=sys.stderr)
    gen = torch.Generator(device=args.device)
    if args.seed is not None:
        gen.manual_seed(args.seed)
    else:
        gen.seed()
    sys.stdout.write(args.prompt)
    out: list[int] = []

    def new_ids():
        for t in generate(model, x, args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k or None, top_p=args.top_p, use_cache=not args.no_cache,
                          generator=gen):
            out.append(int(t[0]))
            yield out[-1]

    t0 = time.perf_counter()
    for piece in text_pieces(tok.decode, new_ids()):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    dt = time.perf_counter() - t0
    print(f"[{len(out)} tokens in {dt:.2f} s, {len(out) / max(dt, 1e-9):.1f} tok/s, "
          f"{'no cache' if args.no_cache else 'KV cache'}]", file=sys.stderr)
    return 0
