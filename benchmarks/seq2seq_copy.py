"""The bottleneck that attention removes: copy random strings with and without attention.

The three encoder-decoders of `qkv train seq2seq` (RNN + Bahdanau attention, the same RNN with
one fixed context vector, the Transformer) are trained with the same preset, steps and data
(``--task copy``: random strings over 26 letters, lengths 5-60; ``--task substitute``: the same
strings through a fixed per-letter substitution), by ``qkv.training.run.train_run`` of the
seq2seq family: exactly what `qkv train seq2seq --task copy --arch A --preset copy-cpu` runs.
Scored: exact match and per-position accuracy by source length on the test split (lengths as
in training) and on strings longer than any in training (61-80). The RNN with and without
attention have the same parameters (the fixed-context model keeps the unused scorer); the plot
is the lectures' version of Bahdanau et al. 2015, Fig. 2.

    python benchmarks/seq2seq_copy.py            # ~25 minutes on 2 cores
    python benchmarks/seq2seq_copy.py --quick    # smoke run (~2 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import _common as C
import torch
from _seq2seq import train_and_score

from qkv.families.seq2seq import Seq2SeqDataConfig, Seq2SeqOptions
from qkv.presets import get_preset
from qkv.viz import plot_by_length

NAME = "seq2seq_copy"
ARCHS = ("rnn", "rnn-noattn", "transformer")
PLOT = C.REPO_DIR / "docs" / "bottleneck.png"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="150 steps, lengths 5-20, 3,000 pairs")
    p.add_argument("--task", choices=("copy", "substitute"), default="copy")
    p.add_argument("--arch", action="append", choices=ARCHS, default=None, help="(repeatable)")
    p.add_argument("--max-iters", type=int, default=None, help="steps (default: the preset's)")
    p.add_argument("--plot", default=None, help=f"where the plot goes (default {PLOT}; --quick: none)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    preset = get_preset("seq2seq", "copy-cpu")
    data = Seq2SeqDataConfig(**{**preset["data"], "task": args.task})
    train_over = dict(preset["train"])
    if args.quick:
        data = dataclasses.replace(data, n_train=3000, n_test=300, n_heldout=100, max_len=20, long_len=30)
        train_over["max_iters"] = 150
    if args.max_iters:
        train_over["max_iters"] = args.max_iters
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ARCHS:
            model_cfg = Seq2SeqOptions(**{**preset["model"], "arch": arch})
            row = {"arch": arch, **train_and_score(model_cfg, train_over, data, Path(tmp) / arch)}
            rows.append(row)
            print(f"{arch}: test {row['test_exact']:.2%} exact ({row['test_token_accuracy']:.2%} of "
                  f"positions), longer {row['longer_exact']:.2%}, {row['train_s']:.0f} s", flush=True)
    C.print_table(f"{args.task}: exact match (whole string right) and training time, "
                  f"{torch.get_num_threads()} threads",
                  ["arch", "params", "steps", "train time", f"test (5-{data.max_len})",
                   f"longer ({data.max_len + 1}-{data.long_len})"],
                  [[r["arch"], f"{r['params'] / 1e6:.2f}M", str(r["steps"]), C.fmt_time(r["train_s"]),
                    f"{r['test_exact']:.2%}", f"{r['longer_exact']:.2%}"] for r in rows])
    buckets = list(rows[0]["by_length"])
    for metric in ("exact", "token_accuracy"):
        C.print_table(f"{metric.replace('_', ' ')} by source length", ["arch", *buckets],
                      [[r["arch"], *(f"{r['by_length'][b][metric]:.1%}" for b in buckets)] for r in rows])
    plot = args.plot or (None if args.quick else str(PLOT))
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        label = {"rnn": "RNN + attention", "rnn-noattn": "RNN, fixed context", "transformer": "Transformer"}
        plot_by_length({label[r["arch"]]: r["by_length"] for r in rows}, Path(plot), train_max=data.max_len,
                       title=f"{args.task} of random strings: exact match by length "
                             f"({rows[0]['steps']} steps each)")
        print(f"wrote {plot}")
    result = {"machine": machine, "quick": args.quick, "task": args.task, "data": dataclasses.asdict(data),
              "train": train_over, "rows": rows, "threads": torch.get_num_threads(), "load": meter.stop()}
    print(C.load_line(result["load"]))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
