"""Do positional encodings extrapolate? The copy task's Transformer with sinusoidal, learned, RoPE,
ALiBi and no positions, trained on short strings and tested on longer ones, beside the RNN with
Bahdanau attention.

The notes say sinusoids "can extrapolate to sequences longer than any seen in training" (CS189
Lec 22) and that RoPE "supports extrapolation to longer sequences" (CS231N Lec 8). What the
encodings allow (``qkv explain positions``: each can be computed for any length, except a learned
table) is not what a trained model does. Here every model is `qkv train seq2seq --task copy
--arch transformer --positions P` (the RNN: ``--arch rnn``) on the same generated strings of
``--min-len``..``--max-len`` letters, the same steps and seed; scored on the test split (lengths as
in training) and on strings of ``--max-len`` + 1 .. ``--long-len`` letters, never seen. (A learned
table is sized from every split, so its rows past the training lengths exist but were never
trained; RoPE and ALiBi act inside the self-attention of both stacks, so cross-attention finds
the source position by content alone.)

    python benchmarks/length_extrapolation.py            # 6 models, ~10 minutes on 2 cores
    python benchmarks/length_extrapolation.py --quick    # smoke run (~1 minute)
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

NAME = "length_extrapolation"
PLOT = C.REPO_DIR / "docs" / "length_extrapolation.png"
MODELS = {  # label -> model options
    "sinusoidal": {"arch": "transformer", "positions": "sinusoidal"},
    "learned": {"arch": "transformer", "positions": "learned"},
    "RoPE": {"arch": "transformer", "positions": "rope"},
    "ALiBi": {"arch": "transformer", "positions": "alibi"},
    "no positions": {"arch": "transformer", "positions": "none"},
    "RNN + attention": {"arch": "rnn"},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100 steps, lengths 5-12 -> 24, 2,000 pairs")
    p.add_argument("--min-len", type=int, default=5)
    p.add_argument("--max-len", type=int, default=30, help="longest training string")
    p.add_argument("--long-len", type=int, default=60, help="longest test string")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--model", action="append", choices=list(MODELS), default=None, help="(repeatable)")
    p.add_argument("--plot", default=None, help=f"where the plot goes (default {PLOT}; --quick: none)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    preset = get_preset("seq2seq", "copy-cpu")
    data = Seq2SeqDataConfig(**{**preset["data"], "min_len": args.min_len, "max_len": args.max_len,
                                "long_len": args.long_len, "n_train": 20_000, "n_test": 1_000,
                                "n_heldout": 1_000})
    train_over = {**preset["train"], "max_iters": args.steps, "eval_interval": args.steps,
                  "dtype": "fp32", "compile": False, "seed": 0}
    if args.quick:
        data = dataclasses.replace(data, n_train=2000, n_test=200, n_heldout=200, max_len=12, long_len=24)
        train_over["max_iters"] = train_over["eval_interval"] = 100
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.model or MODELS:
            model_cfg = Seq2SeqOptions(**{**preset["model"], **MODELS[label]})
            out = Path(tmp) / label.replace(" ", "_")
            row = {"model": label, "options": MODELS[label],
                   **train_and_score(model_cfg, train_over, data, out)}
            rows.append(row)
            print(f"{label}: trained lengths {row['test_exact']:.1%} exact, longer {row['longer_exact']:.1%} "
                  f"({row['longer_token_accuracy']:.1%} of positions), {row['train_s']:.0f} s", flush=True)
    C.print_table(f"copy: exact match within and beyond the training lengths ({data.min_len}-"
                  f"{data.max_len}), {train_over['max_iters']} steps each",
                  ["model", "params", "train time", f"{data.min_len}-{data.max_len}",
                   f"{data.max_len + 1}-{data.long_len}", "positions right, longer"],
                  [[r["model"], f"{r['params'] / 1e6:.2f}M", C.fmt_time(r["train_s"]),
                    f"{r['test_exact']:.1%}", f"{r['longer_exact']:.1%}", f"{r['longer_token_accuracy']:.1%}"]
                   for r in rows])
    buckets = list(rows[0]["by_length"])
    C.print_table("exact match by source length", ["model", *buckets],
                  [[r["model"], *(f"{r['by_length'][b]['exact']:.0%}" for b in buckets)] for r in rows])
    plot = args.plot or (None if args.quick else str(PLOT))
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        plot_by_length({r["model"]: r["by_length"] for r in rows}, Path(plot), train_max=data.max_len,
                       title=f"copy: exact match by length, trained on {data.min_len}-{data.max_len} "
                             f"letters ({rows[0]['steps']} steps each)")
        print(f"wrote {plot}")
    result = {"machine": machine, "quick": args.quick, "data": dataclasses.asdict(data),
              "train": train_over, "rows": rows, "threads": torch.get_num_threads(), "load": meter.stop()}
    print(C.load_line(result["load"]))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
