"""Named configurations as plain data: {"model": {...GPTConfig / ViTConfig fields}, "train": {...TrainConfig
fields}, "data": {...}}. Every field can still be overridden on the command line.

A preset may add "train_adamw": the training fields to use instead when the optimiser is AdamW
(``--optimizer adamw``, or ``auto`` with a torch older than 2.9, which has no Muon): a Muon
recipe's learning rate and step count do not suit AdamW. And "train_fp32_ns": fields for Muon
on a CPU without bf16 instructions, where its orthogonalisation runs in fp32 (slower).
Which overlay applied is recorded in the run's config.json (:class:`PresetChoice`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPT_PRESETS: dict[str, dict[str, Any]] = {
    # For tests and smoke runs: trains in seconds.
    "tiny": {
        "model": dict(max_seq_len=32, dim=32, n_layers=2, n_heads=4, bias=False),
        "train": dict(batch_size=8, max_iters=50, lr=3e-3, min_lr=3e-4, warmup_iters=5,
                      eval_interval=25, eval_iters=4, compile=False),
    },
    # The fast default of `qkv train`: ~15 s of training on 2 cores (avx512_bf16) to a validation
    # loss of ~1.80, past nanoGPT's CPU recipe's final loss in under a fifth of its wall time
    # (benchmarks/train_speed.py). Two wide layers beat four narrow ones per second here, and
    # Muon needs a third of AdamW's steps (on CPUs without bf16 instructions it orthogonalises
    # in fp32). "train_adamw": the recipe for --optimizer adamw (1,500 steps, ~1.78).
    "cpu": {
        "model": dict(max_seq_len=64, dim=192, n_layers=2, n_heads=4, bias=False),
        "train": dict(batch_size=16, max_iters=500, lr=5e-3, min_lr=3e-5, muon_lr=0.03,
                      warmup_iters=10, eval_interval=100, eval_iters=20),
        "train_adamw": dict(batch_size=12, max_iters=1500, lr=3e-3, min_lr=3e-4, warmup_iters=50,
                            eval_interval=250),
        # Without bf16 instructions Muon orthogonalises in fp32, ~25 ms of a ~65 ms step: larger
        # batches and fewer steps spread that cost (BENCHMARKS.md, AVX2 kernels).
        "train_fp32_ns": dict(batch_size=24, max_iters=340),
    },
    # Heads forming while you watch: a small 2-layer GPT on lines of random letters each written
    # twice, scored at every evaluation (history.jsonl, heads.png); the step its induction head
    # forms is printed at the end (BENCHMARKS.md: when, on which CPU). RoPE: with learned
    # positions the same model copies as well but spreads the previous-token and induction
    # attention over all four heads of each layer (~0.2-0.3 each); with rotations single heads
    # take the jobs (induction ~0.8), which is what there is to see.
    "induction": {
        "model": dict(max_seq_len=64, dim=64, n_layers=2, n_heads=4, bias=False, positions="rope"),
        "train": dict(batch_size=32, max_iters=1200, lr=3e-3, min_lr=3e-4, warmup_iters=20,
                      eval_interval=50, eval_iters=10),
        "data": dict(builtin="repeats"),
    },
    # nanoGPT's CPU recipe (README "I only have a macbook"): the speed baseline's model.
    "nanogpt-cpu": {
        "model": dict(max_seq_len=64, dim=128, n_layers=4, n_heads=4, bias=False, dropout=0.0),
        "train": dict(batch_size=12, max_iters=2000, lr=1e-3, min_lr=1e-4, warmup_iters=100,
                      lr_decay_iters=2000, beta2=0.99, weight_decay=0.1, eval_interval=250,
                      eval_iters=20, optimizer="adamw"),
    },
    # nanoGPT's config/train_shakespeare_char.py: 6 layers, 6 heads, 384 wide, context 256.
    "shakespeare-char": {
        "model": dict(max_seq_len=256, dim=384, n_layers=6, n_heads=6, bias=False, dropout=0.2),
        "train": dict(batch_size=64, max_iters=5000, lr=1e-3, min_lr=1e-4, warmup_iters=100,
                      lr_decay_iters=5000, beta2=0.99, eval_interval=250, eval_iters=200),
    },
}


VIT_PRESETS: dict[str, dict[str, Any]] = {
    # For tests and smoke runs (sized for the 8x8 digits; any 28x28 dataset also fits patch 4).
    "tiny": {
        "model": dict(patch_size=4, dim=32, n_layers=2, n_heads=4, read_out="cls", backend="reference"),
        "train": dict(batch_size=32, max_iters=200, lr=3e-3, min_lr=3e-4, warmup_iters=10,
                      eval_interval=100, eval_iters=4, weight_decay=0.05, compile=False),
        "data": dict(dataset="digits"),
    },
    # The fast default of `qkv train vit`: Fashion-MNIST in ~13-14 minutes on 2 CPU cores
    # (BENCHMARKS.md, benchmarks/vit_fashion.py). 7x7 patches (16 tokens + the class token) and a
    # narrow model keep a step cheap enough for ~28 epochs, which beat a 3x wider model given the
    # same time; the reference attention backend is faster than SDPA at this size on a CPU.
    # Against the small-data weakness of a ViT (no locality built in): a convolutional stem
    # (3x3 convolutions 32 wide, stride 2 down to the 4x4 grid with one stride-1 convolution at
    # 14x14, Xiao et al. 2021, instead of one linear map per patch), random flips and shifts,
    # label smoothing (what each buys: the ablation in BENCHMARKS.md).
    "fashion-cpu": {
        "model": dict(patch_size=7, stem="conv", stem_width=32, stem_refine=1, dim=64, n_layers=4, n_heads=4,
                      read_out="cls", backend="reference", label_smoothing=0.1),
        "train": dict(batch_size=128, max_iters=11000, lr=3e-3, min_lr=1e-5, warmup_iters=200,
                      eval_interval=1000, eval_iters=10, weight_decay=0.05),
        "data": dict(dataset="fashion-mnist", shift=1, flip=True),
    },
}

SEQ2SEQ_PRESETS: dict[str, dict[str, Any]] = {
    # For tests and smoke runs: 3,000 dates, small models, seconds.
    "tiny": {
        "model": dict(emb_dim=32, hidden=64, dec_hidden=64, attn_dim=64, dim=64, n_heads=4,
                      enc_layers=1, dec_layers=1),
        "train": dict(batch_size=64, max_iters=200, lr=3e-3, min_lr=3e-4, warmup_iters=20,
                      eval_interval=100, eval_iters=4, weight_decay=0.0, compile=False),
        "data": dict(n_train=3000, n_val=200, n_test=300, n_heldout=300),
    },
    # The default of `qkv train seq2seq` (any --arch): dates in under 10 minutes on 2 CPU cores.
    "dates-cpu": {
        "model": dict(),
        "train": dict(batch_size=128, max_iters=1500, lr=2e-3, min_lr=2e-5, warmup_iters=100,
                      eval_interval=500, eval_iters=8, weight_decay=0.0),
        "data": dict(),
    },
    # `qkv train seq2seq --task copy --preset copy-cpu`: random strings of 5-60 letters, where the
    # fixed context of --arch rnn-noattn cannot hold the source (benchmarks/seq2seq_copy.py).
    "copy-cpu": {
        "model": dict(),
        "train": dict(batch_size=64, max_iters=1200, lr=2e-3, min_lr=2e-5, warmup_iters=100,
                      eval_interval=400, eval_iters=4, weight_decay=0.0),
        "data": dict(task="copy", n_train=40_000, n_val=500, n_test=2_000, n_heldout=1_000),
    },
}

CAPTIONER_PRESETS: dict[str, dict[str, Any]] = {
    # For tests and smoke runs: 1,000 scenes, a small CNN and LSTM, seconds.
    "tiny": {
        "model": dict(width=8, emb_dim=16, hidden=64, attn_dim=32),
        "train": dict(batch_size=32, max_iters=100, lr=3e-3, min_lr=3e-4, warmup_iters=10,
                      eval_interval=50, eval_iters=2, weight_decay=0.0, compile=False),
        "data": dict(n_train=1000, n_val=50, n_test=100, n_heldout=100),
    },
    # The default of `qkv train captioner`: ~99% exact captions on seen colour/shape pairs in
    # ~2-5 minutes on 2 CPU cores (benchmarks/captioning.py). No doubly stochastic penalty: on
    # these short captions it spreads attention and costs pointing accuracy (measured there).
    # Where attention looks (issue 42): each cell's feature centred on its cell (4x4 stride-2
    # convolutions) with a receptive field about an object's size (one convolution per stage,
    # 22 px), and weight decay, put the most attended cell on the named object; the colour and
    # shape words are not read back by the decoder (read_back_names false), so a colour it wrote
    # cannot veto a shape never seen with it; and the encoder is split (a colour-blind CNN on the
    # silhouette beside a per-pixel colour stream), so a never-seen colour/shape pair has the
    # features of its colour and of its shape, each seen in training (BENCHMARKS.md: what each
    # bought).
    "shapes-cpu": {
        # hard attention: the expected-value share falls 1 -> 0 over the first 1,500 steps
        "model": dict(width=16, emb_dim=32, hidden=128, attn_dim=64, doubly_stochastic=0.0, dropout=0.3,
                      hard_anneal=1500, centred=True, stage_convs=1, read_back_names=False,
                      encoder="split"),
        "train": dict(batch_size=64, max_iters=2500, lr=3e-3, min_lr=3e-5, warmup_iters=100,
                      eval_interval=500, eval_iters=8, weight_decay=0.1),
        "data": dict(),
    },
}

PRESET_RESULTS: dict[str, dict[str, str]] = {
    "vit": {
        "fashion-cpu": ("93.0% Fashion-MNIST test in 771 s of training alone on 2 cores, 93.0-93.2% over "
                        "3 seeds in 844-852 s on one core beside another run (AMD EPYC Zen 4); a CNN "
                        "of its size in the same run: 93.1-93.3%, median equal (benchmarks/vit_fashion.py)."),
    },
    "captioner": {
        "shapes-cpu": ("soft: 99.5-99.9% exact on seen pairs, 99.4-99.7% on held-out pairs, pointing "
                       "95.6-99.4%; hard: 97.3-98.0%, 96.5-97.0%, 92.1-96.4% (3 seeds; 228-244 s soft, "
                       "258-269 s hard of training alone on 2 cores, AMD EPYC Zen 4; "
                       "benchmarks/captioning.py)."),
    },
}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {"gpt": GPT_PRESETS, "vit": VIT_PRESETS,
                                                 "seq2seq": SEQ2SEQ_PRESETS,
                                                 "captioner": CAPTIONER_PRESETS}


@dataclass(frozen=True)
class PresetChoice:
    """The preset a run started from and which of its training overlays applied, with why:
    recorded in the run's config.json (``chosen``), since the overlay depends on the machine."""

    name: str
    overlay: str | None  # "train_adamw", "train_fp32_ns" or None (the preset's own "train")
    why: str  # "" when the preset has no overlays (nothing depended on the machine)

    def record(self) -> dict[str, str | None]:
        return {"preset": self.name, "preset_overlay": self.overlay, "preset_why": self.why}


def preset_overlay(preset: dict[str, Any], optimizer: str, fp32_newton_schulz: bool = False,
                   ) -> tuple[str | None, str]:
    """(the overlay :func:`preset_train` applies, why) for the optimiser that will run."""
    if optimizer == "adamw" and "train_adamw" in preset:
        return "train_adamw", "the optimiser is AdamW, which needs its own learning rate and steps"
    if optimizer == "muon" and fp32_newton_schulz and "train_fp32_ns" in preset:
        return "train_fp32_ns", "Muon's Newton–Schulz runs in fp32 on this CPU (no bf16 instructions)"
    if "train_adamw" in preset or "train_fp32_ns" in preset:
        ns = "fp32" if fp32_newton_schulz else "bf16"
        return None, f"the {optimizer} recipe" + (f" (Newton–Schulz in {ns})" if optimizer == "muon" else "")
    return None, ""


def preset_train(preset: dict[str, Any], optimizer: str, fp32_newton_schulz: bool = False) -> dict[str, Any]:
    """The preset's training fields for the optimiser that will run ("adamw" or "muon"), and
    for Muon, for where its Newton–Schulz products run: ``fp32_newton_schulz`` (a CPU without
    bf16 instructions) adds the preset's "train_fp32_ns" fields. Which overlay that is:
    :func:`preset_overlay`."""
    train = dict(preset.get("train", {}))
    overlay, _ = preset_overlay(preset, optimizer, fp32_newton_schulz)
    if overlay is not None:
        train.update(preset[overlay])
    return train


def get_preset(family: str, name: str, table: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A copy of preset ``name`` of model ``family`` (from ``table``, default this module's);
    ValueError names the known presets."""
    table = PRESETS.get(family) if table is None else table
    if table is None:
        raise ValueError(f"no presets for model family {family!r}")
    if name not in table:
        raise ValueError(f"unknown preset {name!r} for {family}; choose from: {', '.join(table)}")
    return {k: dict(v) for k, v in table[name].items()}
