"""Dates -> ISO 8601 with three encoder-decoders on a CPU: accuracy, the bottleneck, speed.

Each architecture (RNN + Bahdanau attention, the same RNN with a fixed context, the
Transformer encoder-decoder) is trained with the `dates-cpu` preset by
``qkv.training.run.train_run`` of the seq2seq family (exactly what `qkv train seq2seq --arch A` runs) on
the same generated pairs, then scored by exact match (the whole date right) on the test split
(seen locale/style combinations) and on the held-out combinations, per input length.
Decoding throughput: sentences/s for greedy and beam-4 decoding of the test split, batch 256.

    python benchmarks/seq2seq_dates.py            # ~35 minutes on 2 cores
    python benchmarks/seq2seq_dates.py --quick    # smoke run (~2 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import torch

from qkv.families.seq2seq import Seq2SeqDataConfig, Seq2SeqFamily, Seq2SeqOptions, decode_texts, evaluate
from qkv.presets import get_preset
from qkv.training.run import train_run
from qkv.training.trainer import TrainConfig

NAME = "seq2seq_dates"
ARCHS = ("rnn", "transformer", "rnn-noattn")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200 steps, 5,000 pairs")
    p.add_argument("--arch", action="append", choices=ARCHS, default=None, help="(repeatable)")
    p.add_argument("--max-iters", type=int, default=None, help="steps (default: the preset's)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    try:
        import babel  # noqa: F401
    except ImportError:
        print(f"{NAME}: needs Babel: pip install babel", file=sys.stderr)
        return 2
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    preset = get_preset("seq2seq", "dates-cpu")
    data = Seq2SeqDataConfig(**preset["data"])
    train_over = dict(preset["train"])
    if args.quick:
        data = dataclasses.replace(data, n_train=5000, n_test=1000, n_heldout=1000)
        train_over["max_iters"] = 200
    if args.max_iters:
        train_over["max_iters"] = args.max_iters
    rows, speed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ARCHS:
            model_cfg = Seq2SeqOptions(**{**preset["model"], "arch": arch})
            train_cfg = TrainConfig(**{**train_over, "out_dir": str(Path(tmp) / arch)})
            t0 = time.perf_counter()
            run = train_run(Seq2SeqFamily(), model_cfg, train_cfg, data, evaluate=False)
            model, result, st = run.model, run.result, run.prepared.state
            cfg = run.prepared.model_cfg.model_config()
            src, tgt, pairs = st.src, st.tgt, st.pairs
            seconds = time.perf_counter() - t0
            ev = evaluate(model, cfg, src, tgt, pairs)
            row = {"arch": arch, "params": sum(q.numel() for q in model.parameters()),
                   "steps": result.step, "train_s": round(seconds, 1),
                   "test_exact": ev["test"]["exact"], "heldout_exact": ev["heldout"]["exact"],
                   "test_by_length": ev["test"]["by_length"],
                   "heldout_by_length": ev["heldout"]["by_length"],
                   "wrong_examples": ev["test"]["examples_wrong"][:5]}
            rows.append(row)
            print(f"{arch}: test {row['test_exact']:.2%}, held-out {row['heldout_exact']:.2%}, "
                  f"{seconds:.0f} s", flush=True)
            if arch != "rnn-noattn":
                texts = [s for s, _ in pairs.test[:2000]]
                for beam in (1, 4):
                    decode_texts(model, cfg, src, tgt, texts[:256], beam=beam)  # warm up
                    t = time.perf_counter()
                    outs, _ = decode_texts(model, cfg, src, tgt, texts, beam=beam)
                    dt = time.perf_counter() - t
                    exact = sum(o == y for o, (_, y) in zip(outs, pairs.test[:2000], strict=True))
                    speed.append({"arch": arch, "beam": beam, "sentences_per_s": len(texts) / dt,
                                  "exact": exact / len(texts)})
    C.print_table("dates -> ISO: exact match (whole date right) and training time, 2 CPU cores",
                  ["arch", "params", "steps", "train time", "test (seen combos)", "held-out combos"],
                  [[r["arch"], f"{r['params'] / 1e6:.2f}M", str(r["steps"]), C.fmt_time(r["train_s"]),
                    f"{r['test_exact']:.2%}", f"{r['heldout_exact']:.2%}"] for r in rows])
    buckets = list(rows[0]["test_by_length"])
    C.print_table("test exact match by input length (characters)", ["arch", *buckets],
                  [[r["arch"], *(f"{r['test_by_length'][b]['exact']:.1%}" if b in r["test_by_length"]
                                 else "-" for b in buckets)] for r in rows])
    C.print_table("held-out exact match by input length", ["arch", *buckets],
                  [[r["arch"], *(f"{r['heldout_by_length'][b]['exact']:.1%}"
                                 if b in r["heldout_by_length"] else "-" for b in buckets)] for r in rows])
    if speed:
        C.print_table("decoding 2,000 test dates, batch 256", ["arch", "beam", "sentences/s", "exact"],
                      [[s["arch"], str(s["beam"]), f"{s['sentences_per_s']:,.0f}", f"{s['exact']:.2%}"]
                       for s in speed])
    result = {"machine": machine, "quick": args.quick, "rows": rows, "decoding": speed,
              "threads": torch.get_num_threads(), "load": meter.stop()}
    print(C.load_line(result["load"]))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
