"""`qkv train [FAMILY] --preset NAME [--field value ...]` and `qkv generate RUN_DIR ...`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.commands.options import add_config_options, overrides
from qkv.models.gpt import GPTConfig
from qkv.presets import PRESETS, get_preset, preset_train
from qkv.training.lm import LMDataConfig
from qkv.training.optim import fp32_newton_schulz, resolve_optimizer
from qkv.training.trainer import TrainConfig

FAMILIES = ("gpt", "vit", "seq2seq", "captioner")


@dataclasses.dataclass(frozen=True)
class _Family:
    model_cls: type
    data_cls: type
    from_data: tuple[str, ...]  # model fields set from the data, not options
    default_preset: str
    help: str
    description: str


def _families() -> dict[str, _Family]:
    from qkv.models.captioner import CaptionerConfig
    from qkv.models.vit import ViTConfig
    from qkv.training.captioning import CaptionDataConfig
    from qkv.training.seq2seq import Seq2SeqConfig, Seq2SeqDataConfig
    from qkv.training.vision import ImageDataConfig

    return {
        "gpt": _Family(
            GPTConfig, LMDataConfig, ("vocab_size",), "cpu",
            "a character- or BPE-level GPT on text (default: Shakespeare)",
            "Train a GPT. With no options: the `cpu` preset of a character-level GPT on the 42 "
            "Shakespeare works (install them with `qkv assets install shakespeare`), then print a "
            "sample and write the run directory, a loss plot and an attention heatmap.",
        ),
        "vit": _Family(
            ViTConfig, ImageDataConfig, ("image_size", "channels", "n_classes"), "fashion-cpu",
            "a Vision Transformer on images (default: Fashion-MNIST)",
            "Train a Vision Transformer. With no options: the `fashion-cpu` preset on Fashion-MNIST "
            "(`qkv assets install fashion-mnist`); --dataset mnist|digits|FOLDER picks other images "
            "(a folder holds one sub-folder of images per class). At the end: test accuracy, a "
            "confusion matrix, and the attention of the last layer and its rollout over a test image.",
        ),
        "seq2seq": _Family(
            Seq2SeqConfig, Seq2SeqDataConfig, ("max_src_len", "max_tgt_len", "src_vocab", "tgt_vocab"),
            "dates-cpu", "an encoder-decoder on human-written dates -> ISO 8601 (RNN or Transformer)",
            "Train a sequence-to-sequence model: --arch rnn (bidirectional GRU encoder, GRU decoder "
            "with Bahdanau attention), rnn-noattn (the same with a fixed context: the bottleneck) or "
            "transformer (encoder-decoder with cross-attention). With no options: dates generated "
            "with Babel in 24 locales and 4 styles ('8 août 1977' -> 1977-08-08); --data FILE.tsv "
            "takes source<TAB>target lines instead. At the end: exact-match accuracy on the test "
            "split and on held-out locale/style combinations, by input length, and an alignment plot.",
        ),
        "captioner": _Family(
            CaptionerConfig, CaptionDataConfig, ("vocab_size",), "shapes-cpu",
            "an image captioner with soft, hard or uniform attention (Show, Attend and Tell)",
            "Train a captioner: a CNN grid encoder and an LSTM decoder that attends over the grid at "
            "every word, --attention soft (weighted average, doubly stochastic penalty) or hard "
            "(one sampled location, REINFORCE) or uniform (the plain average of the grid: the "
            "baseline). Data: generated scenes of coloured shapes with "
            "captions and boxes, some colour/shape pairs held out, or --data FOLDER with a captions.tsv "
            "(image<TAB>caption per line). At the end: exact match, BLEU-4 "
            "and pointing accuracy (is the most attended location inside the named object?) next "
            "to uniform attention's.",
        ),
    }


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model: gpt (default; Shakespeare in minutes on a CPU), vit (Fashion-MNIST) "
        "or seq2seq (dates -> ISO 8601)",
        description="Train a model of one family: `qkv train gpt ...` (the default when no family "
        "is named), `qkv train vit ...` or `qkv train seq2seq ...`. `qkv train FAMILY --help` "
        "lists every option of that family: every config field can be overridden; presets are "
        "in `qkv/presets.py`. Under torchrun it trains with DDP.",
    )
    fam = p.add_subparsers(dest="family", metavar="FAMILY")
    for name, f in _families().items():
        presets = PRESETS[name]
        q = fam.add_parser(name, help=f.help, description=f.description + " The defaults shown are "
                           "the config classes' own, which the preset changes.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        q.add_argument("--preset", default=f.default_preset,
                       help=f"named config: {', '.join(presets)}")
        q.add_argument("--resume", metavar="RUN_DIR", default=None,
                       help="continue a run exactly where it stopped (step, optimiser, RNG, data position)")
        if name == "gpt":
            q.add_argument("--sample-tokens", type=int, default=300,
                           help="length of the sample printed at the end")
        q.add_argument("--no-progress", action="store_true",
                       help="plain log lines instead of a progress bar")
        add_config_options(q, f.data_cls, "data")
        add_config_options(q, f.model_cls, f"model ({f.model_cls.__name__})", skip=f.from_data)
        add_config_options(q, TrainConfig, "training (TrainConfig)")
        q.set_defaults(func=cmd_train)
    p.set_defaults(func=cmd_train, family=None)


def default_family(argv: list[str]) -> list[str]:
    """`qkv train [options]` means `qkv train gpt [options]`."""
    if argv and argv[0] == "train" and (len(argv) == 1 or argv[1] not in (*FAMILIES, "-h", "--help")):
        return ["train", "gpt", *argv[1:]]
    return argv


def _configs(args: argparse.Namespace, family: str) -> tuple[Any, TrainConfig, Any]:
    from qkv.training import checkpoint as ckpt
    from qkv.training.lm import default_run_dir

    f = _families()[family]
    model_over, train_over = overrides(args, f.model_cls), overrides(args, TrainConfig)
    data_over = overrides(args, f.data_cls)
    data_fields = {x.name for x in dataclasses.fields(f.data_cls)}
    if args.resume:
        saved = ckpt.read_json(Path(args.resume) / "config.json")
        if not isinstance(saved, dict) or not all(k in saved for k in ("model", "train", "data")):
            raise ckpt.CheckpointError(f"{args.resume}/config.json is not a qkv run configuration")
        if saved.get("family") != family:
            raise ckpt.CheckpointError(f"{args.resume} is a {saved.get('family')} run; resume it with "
                                       f"`qkv train {saved.get('family')} --resume {args.resume}`")
        if model_over or data_over:
            given = ", ".join({**model_over, **data_over})
            raise ValueError("--resume keeps the run's model and data settings; "
                             f"only training fields can change (got {given})")
        train = {**saved["train"], **train_over, "out_dir": args.resume}
        data = {k: v for k, v in saved["data"].items() if k in data_fields}
        try:
            return f.model_cls(**saved["model"]), TrainConfig(**train), f.data_cls(**data)
        except TypeError as e:  # unknown or missing fields: written by another qkv version
            raise ckpt.CheckpointError(f"{args.resume}/config.json does not fit this version of "
                                       f"qkv ({e})") from None
    preset = get_preset(family, args.preset)
    model_args = {**preset.get("model", {}), **model_over}
    if family == "vit":  # size, channels and classes come from the data (fit_model_config);
        # until the data is loaded, a size the patch divides lets every other field be checked
        model_args["image_size"] = model_args.get("patch_size", 4)
    model = f.model_cls(**model_args)
    merged = {**preset.get("train", {}), **train_over}
    kind = resolve_optimizer(merged.get("optimizer", "auto"))
    train = {**preset_train(preset, kind, fp32_newton_schulz(merged.get("device", "auto"))), **train_over}
    train.setdefault("out_dir", default_run_dir(family, args.preset))  # a new folder per run
    data = f.data_cls(**{**preset.get("data", {}), **data_over})
    return model, TrainConfig(**train), data


class _Display:
    """Progress bar (rich) or plain lines; eval results always printed as a line."""

    def __init__(self, total: int, plain: bool, unit: str = "tok") -> None:
        self.total, self.plain, self.unit = total, plain, unit
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
                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} " + unit + "/s"),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                )
                self.task = self.progress.add_task("train", total=total, completed=0,
                                                   loss="-", tok_s="-")
                self.progress.start()

    def __call__(self, rec: dict) -> None:
        if "note" in rec:
            if self.progress is not None:
                self.progress.console.print(rec["note"])
            else:
                print(rec["note"], flush=True)
            return
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
                  f"{rec['tokens_per_s']:,.0f} {self.unit}/s  lr {rec['lr']:.2e}", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def cmd_train(args: argparse.Namespace) -> int:
    from qkv.training.distributed import barrier, cleanup, init_distributed

    family = args.family or "gpt"
    model_cfg, train_cfg, data_cfg = _configs(args, family)
    dist = init_distributed(train_cfg.device)
    train_cfg = dataclasses.replace(train_cfg, device=dist.device)
    run_dir = Path(train_cfg.out_dir)
    if dist.is_main:
        shape = (f"{model_cfg.n_layers} layers x {model_cfg.dim} wide, context {model_cfg.max_seq_len}"
                 if family == "gpt" else
                 f"{model_cfg.n_layers} layers x {model_cfg.dim} wide, {model_cfg.patch_size}x"
                 f"{model_cfg.patch_size} patches, {data_cfg.dataset}" if family == "vit" else
                 f"arch {model_cfg.arch}, {data_cfg.data or 'generated dates'}" if family == "seq2seq" else
                 f"{model_cfg.attention} attention, {data_cfg.n_train:,} generated scenes")
        print(f"qkv train {family}: preset {args.preset if not args.resume else '(resumed)'}, {shape}, "
              f"{train_cfg.max_iters} steps on {dist.device}"
              + (f" x {dist.world_size} processes" if dist.enabled else "") + f" -> {run_dir}", flush=True)
    display = _Display(train_cfg.max_iters, args.no_progress or not sys.stdout.isatty(),
                       {"gpt": "tok", "vit": "img", "seq2seq": "pair", "captioner": "img"}[family]) \
        if dist.is_main else None
    run = {"gpt": _train_gpt, "vit": _train_vit, "seq2seq": _train_seq2seq,
           "captioner": _train_captioner}[family]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*TF32.*")
            finish = run(args, model_cfg, train_cfg, data_cfg, dist, display)
        barrier(dist)  # finished on every rank: only now tear down (not on an error, which could hang)
    finally:
        if display is not None:
            display.close()
        cleanup(dist)
    if dist.is_main:
        finish()
    return 0


def _train_gpt(args, model_cfg, train_cfg, data_cfg, dist, display) -> Callable[[], None]:
    from qkv.training.lm import sample_text, train_lm
    from qkv.viz import plot_loss_curve

    model, tok, result = train_lm(model_cfg, train_cfg, data_cfg, resume=bool(args.resume),
                                  dist=dist, on_log=display)
    run_dir = Path(train_cfg.out_dir)

    def finish() -> None:
        print(f"\ntrained {result.step} steps in {result.seconds:.0f} s ({result.tokens_per_s:,.0f} "
              f"tok/s); best val loss {result.best_val_loss:.4f}; {model.num_params() / 1e6:.2f}M parameters")
        sample = sample_text(model, tok, "\n", args.sample_tokens)
        print("\n--- sample (temperature 0.8, top-k 200) ---" + sample + "\n---")
        loss_png = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
        attn_png = _attention_map(model, tok, sample.lstrip("\n"), run_dir / "attention.png")
        print(f"run directory: {run_dir}\n  weights: {run_dir / 'model.safetensors'}\n"
              f"  loss plot: {loss_png}\n  attention map (last layer): {attn_png}\n"
              f"generate more: qkv generate {run_dir} --prompt 'ROMEO:'")

    return finish


def _train_vit(args, model_cfg, train_cfg, data_cfg, dist, display) -> Callable[[], None]:
    from qkv.training import checkpoint as ckpt
    from qkv.training.vision import attention_maps, evaluate_split, train_vit
    from qkv.viz import plot_confusion, plot_image_attention, plot_loss_curve

    def note(text: str) -> None:
        if dist.is_main:
            print(f"qkv: note: {text}", file=sys.stderr, flush=True)

    model, data, batches, result = train_vit(model_cfg, train_cfg, data_cfg, resume=bool(args.resume),
                                             dist=dist, on_log=display, on_note=note)
    run_dir = Path(train_cfg.out_dir)

    def finish() -> None:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\ntrained {result.step} steps in {result.seconds:.0f} s ({result.tokens_per_s:,.0f} "
              f"images/s); best val loss {result.best_val_loss:.4f}; {n_params / 1e6:.2f}M parameters")
        ev = evaluate_split(model, data, batches.mean, batches.std, "test")
        ev["val_accuracy"] = evaluate_split(model, data, batches.mean, batches.std, "val")["accuracy"]
        ev["train_seconds"] = round(result.seconds, 1)
        ckpt.write_json(run_dir / "eval.json", ev)
        print(f"test accuracy {ev['accuracy']:.2%} on {ev['n']:,} {data.name} images "
              f"(validation {ev['val_accuracy']:.2%})")
        cm_png = plot_confusion(ev["confusion"], data.classes, run_dir / "confusion.png",
                                title=f"{data.name} test: accuracy {ev['accuracy']:.2%}")
        loss_png = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
        image, label = data.test_x[0], int(data.test_y[0])
        probs, heads, rollout = attention_maps(model, image, batches.mean, batches.std)
        maps = [(f"head {h}", heads[h]) for h in range(len(heads))] + [("rollout", rollout)]
        pred = int(probs.argmax())
        attn_png = plot_image_attention(
            image, maps, run_dir / "attention.png",
            title=f"true {data.classes[label]}, predicted {data.classes[pred]} ({probs[pred]:.0%})")
        print(f"run directory: {run_dir}\n  weights: {run_dir / 'model.safetensors'}\n"
              f"  confusion matrix: {cm_png}\n  loss plot: {loss_png}\n"
              f"  attention on a test image: {attn_png}\n"
              f"classify an image: qkv classify {run_dir} IMAGE.png\n"
              f"see where it looks: qkv attend {run_dir} IMAGE.png")

    return finish


def _train_seq2seq(args, model_cfg, train_cfg, data_cfg, dist, display) -> Callable[[], None]:
    from qkv.training import checkpoint as ckpt
    from qkv.training.seq2seq import decode_texts, evaluate, train_seq2seq
    from qkv.viz import plot_alignment, plot_loss_curve

    model, cfg, src, tgt, pairs, result = train_seq2seq(model_cfg, train_cfg, data_cfg,
                                                        resume=bool(args.resume), dist=dist,
                                                        on_log=display)
    run_dir = Path(train_cfg.out_dir)

    def finish() -> None:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\ntrained {result.step} steps in {result.seconds:.0f} s ({result.tokens_per_s:,.0f} "
              f"pairs/s); best val loss {result.best_val_loss:.4f}; {n_params / 1e6:.2f}M parameters")
        ev = evaluate(model, cfg, src, tgt, pairs)
        ev["train_seconds"] = round(result.seconds, 1)
        ckpt.write_json(run_dir / "eval.json", ev)
        for name in ("test", "heldout"):
            if name in ev:
                by_len = "  ".join(f"{k}: {v['exact']:.1%}" for k, v in ev[name]["by_length"].items())
                what = "held-out locale/style" if name == "heldout" else "test"
                print(f"{what} exact match {ev[name]['exact']:.2%} of {ev[name]['n']:,}  "
                      f"(by input length {by_len})")
        example = pairs.test[0][0][: cfg.max_src_len]
        [out], [w] = decode_texts(model, cfg, src, tgt, [example])
        print(f"example: {example!r} -> {out!r}")
        loss_png = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
        extra = ""
        if w is not None and len(out):
            png = plot_alignment(w, list(example), list(out), run_dir / "alignment.png")
            extra = f"\n  alignment of the example: {png}"
        print(f"run directory: {run_dir}\n  weights: {run_dir / 'model.safetensors'}\n"
              f"  loss plot: {loss_png}{extra}\n"
              f"translate: qkv translate {run_dir} '8 août 1977' --plot alignment.png")

    return finish


def _train_captioner(args, model_cfg, train_cfg, data_cfg, dist, display) -> Callable[[], None]:
    from qkv.training import checkpoint as ckpt
    from qkv.training.captioning import evaluate, train_captioner
    from qkv.viz import plot_loss_curve

    model, vocab, splits, max_len, result = train_captioner(
        model_cfg, train_cfg, data_cfg, resume=bool(args.resume), dist=dist, on_log=display)
    run_dir = Path(train_cfg.out_dir)

    def finish() -> None:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\ntrained {result.step} steps in {result.seconds:.0f} s; best val loss "
              f"{result.best_val_loss:.4f}; {n_params / 1e6:.2f}M parameters")
        ev = evaluate(model, vocab, splits, max_len)
        ev["train_seconds"] = round(result.seconds, 1)
        ckpt.write_json(run_dir / "eval.json", ev)
        for name in ("test", "heldout"):
            if name in ev:
                e = ev[name]
                where = ("" if e["pointing"] is None else f", pointing {e['pointing']:.1%} (uniform "
                         f"attention {e['pointing_uniform']:.1%})")
                print(f"{name}: exact match {e['exact']:.1%}, BLEU-4 {e['bleu4']:.3f}{where} on {e['n']:,}")
        loss_png = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
        print(f"run directory: {run_dir}\n  loss plot: {loss_png}\n  evaluation: {run_dir / 'eval.json'}")

    return finish


def _attention_map(model, tok, text: str, out_path: Path, max_tokens: int = 32) -> Path:
    """Heatmaps of the last layer's heads on the first ``max_tokens`` tokens of ``text``."""
    import torch

    from qkv.viz import plot_attention_heads

    ids = tok.encode(text)[:max_tokens]
    x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    model.eval()
    with torch.no_grad():
        out = model(x, backend="reference", return_weights=True)
    labels = [tok.decode([i]) for i in ids]
    title = f"last layer attention ({len(ids)} tokens)"
    return plot_attention_heads(out.weights[-1][0], labels, out_path, title=title)
