"""Show, Attend and Tell on generated scenes: soft vs hard vs uniform attention, scored on the
captions and on where the model looks.

Each variant is trained with the `shapes-cpu` preset by
``qkv.training.run.train_run`` of the captioner family (exactly what `qkv train captioner --attention A`
runs) on the same generated scenes, then scored on the test split (seen colour/shape pairs)
and on the held-out split (every scene has an object of a colour/shape pair never seen in
training): exact match (the whole caption right), corpus BLEU-4, and pointing accuracy: for
every generated colour or shape word, is the most attended grid cell's centre inside an
object of that colour/shape? ("overlap": does that cell hold any of the object's pixels?)
Beside it: the expected pointing of uniform attention (a cell drawn at random), and a model
trained with uniform attention (the plain average of the grid); soft attention with the
paper's doubly stochastic penalty (λ = 1); soft with location-based addressing; hard attention
trained with REINFORCE (per-word reward with the soft control variate, leave-one-out, and the
paper's caption-level reward) and with the exact sum over cells, each hard model decoded both
reading its most attended cell and reading the expected context; the preset's fixes of where
attention looks undone (the old corner-centred 43-px features; the decoder reading back the
colour and shape words); soft and hard again with other training seeds (``--seeds``, min /
median / max); beam-3 decoding of the soft model; and the wall time of every part.

    python benchmarks/captioning.py            # every variant (not timed with the issue-42 preset;
                                               # soft + hard over 3 seeds took 3,088 s on a Zen 4)
    python benchmarks/captioning.py --quick    # smoke run (~3 minutes)
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

from qkv.data.captions import make_splits
from qkv.families.captioner import CaptionDataConfig, CaptionerFamily, evaluate
from qkv.models.captioner import CaptionerConfig
from qkv.presets import get_preset
from qkv.training.run import train_run
from qkv.training.trainer import TrainConfig

NAME = "captioning"
# name -> model overrides of the preset
VARIANTS: dict[str, dict] = {
    "soft": {"attention": "soft"},
    "soft-ds": {"attention": "soft", "doubly_stochastic": 1.0},  # the paper's penalty, λ = 1
    "soft-location": {"attention": "soft", "addressing": "location"},  # one score per cell index
    "hard": {"attention": "hard"},  # REINFORCE, per-word reward, the soft control variate
    "hard-loo": {"attention": "hard", "hard_baseline": "loo"},  # leave-one-out over 4 samples
    "hard-caption": {"attention": "hard", "hard_baseline": "average", "hard_samples": 1},  # the
    # paper's estimator: the caption's log-likelihood against a moving average
    "hard-exact": {"attention": "hard-exact"},  # the exact sum over locations (no sampling)
    "uniform": {"attention": "uniform"},
    # what the preset's where-fixes (issue 42) changed, undone one group at a time: features at
    # the cells' corners with a 43-px field (3x3 convolutions, two per stage: the old encoder),
    # and the decoder reading back the colour and shape words it wrote
    "soft-corner-rf43": {"attention": "soft", "centred": False, "stage_convs": 2},
    "soft-read-back": {"attention": "soft", "read_back_names": True},
    "hard-read-back": {"attention": "hard", "read_back_names": True},
    # the split encoder undone: one CNN reads the RGB image, its features mix colour with shape
    "soft-joint": {"attention": "soft", "encoder": "joint"},
    "hard-joint": {"attention": "hard", "encoder": "joint"},
}
SEEDED = ("soft", "hard")  # variants trained with --seeds seeds


def seed_spread(rows: list[dict]) -> list[dict]:
    """Per variant trained with more than one seed: (min, median, max) over the seeds of exact
    match and pointing on the test and held-out splits (hard attention: the argmax cell)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["attention"].split(" (seed")[0], []).append(r["eval"])
    out = []
    for variant, evs in by.items():
        if len(evs) < 2:
            continue
        row: dict = {"variant": variant, "seeds": len(evs)}
        for split in ("test", "heldout"):
            for metric in ("exact", "pointing"):
                xs = sorted(e[split][metric] for e in evs)
                row[f"{split}_{metric}"] = (xs[0], C.median(xs), xs[-1])
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200 steps, 2,000 scenes")
    p.add_argument("--variant", action="append", choices=VARIANTS, default=None,
                   help="(repeatable) soft-ds: soft with the doubly stochastic penalty, λ = 1")
    p.add_argument("--seeds", type=int, default=3, help="training seeds of soft and hard (spread)")
    p.add_argument("--max-iters", type=int, default=None, help="steps (default: the preset's)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    preset = get_preset("captioner", "shapes-cpu")
    data = CaptionDataConfig(**preset["data"])
    train_over = dict(preset["train"])
    if args.quick:
        data = dataclasses.replace(data, n_train=2000, n_val=100, n_test=300, n_heldout=300)
        train_over["max_iters"] = 200
    if args.max_iters:
        train_over["max_iters"] = args.max_iters
    t = time.perf_counter()
    make_splits(data)
    scenes_s = time.perf_counter() - t
    print(f"generating {data.n_train + data.n_val + data.n_test + data.n_heldout:,} scenes: "
          f"{scenes_s:.0f} s (part of every run's total)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        seed0 = TrainConfig().seed  # what `qkv train captioner` uses
        runs = [(v, seed0) for v in args.variant or VARIANTS]
        runs += [(v, seed0 + i) for v in SEEDED if v in (args.variant or VARIANTS)
                 for i in range(1, args.seeds)]
        for variant, seed in runs:
            attention = variant + (f" (seed {seed})" if seed != seed0 else "")
            model_cfg = CaptionerConfig(**{**preset["model"], **VARIANTS[variant]})
            train_cfg = TrainConfig(**{**train_over, "seed": seed,
                                       "out_dir": str(Path(tmp) / f"{variant}-{seed}")})
            t0 = time.perf_counter()
            run = train_run(CaptionerFamily(), model_cfg, train_cfg, data, evaluate=False)
            model, result, st = run.model, run.result, run.prepared.state
            vocab, splits, max_len = st.vocab, st.splits, st.max_len
            total = time.perf_counter() - t0
            t1 = time.perf_counter()
            ev = evaluate(model, vocab, splits, max_len)
            eval_s = time.perf_counter() - t1
            row = {"attention": attention, "params": sum(q.numel() for q in model.parameters()),
                   "steps": result.step, "train_s": round(result.seconds, 1), "total_s": round(total, 1),
                   "eval_s": round(eval_s, 1), "eval": ev}
            if variant == "soft" and seed == seed0:
                t1 = time.perf_counter()
                row["beam3"] = evaluate(model, vocab, splits, max_len, beam=3)
                row["beam3_eval_s"] = round(time.perf_counter() - t1, 1)
            rows.append(row)
            print(f"{attention}: test exact {ev['test']['exact']:.1%}, held-out exact "
                  f"{ev['heldout']['exact']:.1%}, pointing {ev['test']['pointing']:.1%}; "
                  f"training {result.seconds:.0f} s (total {total:.0f} s)", flush=True)

    def decodings(r: dict) -> list[tuple[str, dict]]:
        """A hard model decoded both ways: reading the most attended cell, and Σ α_i a_i."""
        if "expectation" not in r["eval"]:
            return [(r["attention"], r["eval"])]
        return [(r["attention"] + ", argmax cell", r["eval"]),
                (r["attention"] + ", expected context", r["eval"]["expectation"])]

    def cells(e: dict) -> list[str]:
        return [f"{e['exact']:.1%}", f"{e['bleu4']:.3f}", f"{e['pointing']:.1%}",
                f"{e['pointing_overlap']:.1%}"]

    C.print_table("captions and pointing, greedy decoding (test: seen colour/shape pairs; held-out: "
                  "a never-seen pair in every scene)",
                  ["variant", "params", "steps", "training", "total", "test exact", "test BLEU-4",
                   "test pointing", "test overlap", "held-out exact", "held-out BLEU-4",
                   "held-out pointing", "held-out overlap"],
                  [[name, f"{r['params'] / 1e6:.2f}M", str(r["steps"]), C.fmt_time(r["train_s"]),
                    C.fmt_time(r["total_s"]), *cells(ev["test"]), *cells(ev["heldout"])]
                   for r in rows for name, ev in decodings(r)])
    first = rows[0]["eval"]
    print(f"uniform attention's expected pointing (a random cell) under the first model's captions: "
          f"test {first['test']['pointing_uniform']:.1%}, "
          f"held-out {first['heldout']['pointing_uniform']:.1%}")
    C.print_table("exact match by number of objects in the scene", ["variant", "split", "1", "2", "3"],
                  [[r["attention"], split,
                    *(f"{v:.1%}" for v in r["eval"][split]["exact_by_objects"].values())]
                   for r in rows for split in ("test", "heldout")])
    for r in rows:
        if "beam3" in r:
            b = r["beam3"]
            print(f"soft, beam 3: test exact {b['test']['exact']:.1%} (BLEU-4 {b['test']['bleu4']:.3f}), "
                  f"held-out {b['heldout']['exact']:.1%} (BLEU-4 {b['heldout']['bleu4']:.3f}); "
                  f"{r['beam3_eval_s']:.0f} s for all splits vs {r['eval_s']:.0f} s greedy")
    spread = seed_spread(rows)
    if spread:
        C.print_table("over the training seeds (min / median / max; argmax cell for hard attention)",
                      ["variant", "seeds", "test exact", "held-out exact", "test pointing",
                       "held-out pointing"],
                      [[v["variant"], str(v["seeds"]),
                        *(" / ".join(f"{x:.1%}" for x in v[k]) for k in
                          ("test_exact", "heldout_exact", "test_pointing", "heldout_pointing"))]
                       for v in spread])
    for r in rows:
        wrong = [f"{ref!r} -> {hyp!r}" for ref, hyp in r["eval"]["heldout"]["examples"] if ref != hyp][:3]
        if wrong:
            print(f"{r['attention']}, held-out mistakes: " + "; ".join(wrong))
    result = {"machine": machine, "quick": args.quick, "scenes_s": round(scenes_s, 1), "rows": rows,
              "seed_spread": spread,
              "threads": torch.get_num_threads(), "load": meter.stop()}
    print(C.load_line(result["load"]))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
