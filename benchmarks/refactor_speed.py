"""Did a change make qkv slower? Training-step and decoding speed of two checkouts, side by side.

Round-robin A/B: each round runs a fresh process of the *before* checkout and of the *after*
one (the working tree), in alternating order so that a machine drifting warmer or busier
counts against both. Each process measures, on the same data:

- ``train_ms_per_step``: the `cpu` preset's GPT (fp32, AdamW, eager) through qkv's Trainer on
  Shakespeare, median step time of 60 steps after 10 of warm-up;
- ``gpt_decode_tok_s``: that model decoding 200 tokens with the KV cache (median of 7);
- ``smollm2_q4_tok_s``: SmolLM2-135M in the default q4 weights, 64 tokens after a warm-up
  (skipped when the asset is not installed).

Reported: each side's median over rounds, and after / before per round (min–max). Ratios
inside the rounds' spread mean "unchanged".

    python benchmarks/refactor_speed.py --before HEAD~5 --rounds 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

METRICS = ("train_ms_per_step", "gpt_decode_tok_s", "smollm2_q4_tok_s")


def child() -> None:
    """One measurement, with whatever qkv is first on the path (PYTHONPATH)."""
    import torch

    import qkv
    from qkv.generation import generate
    from qkv.models.gpt import GPT, GPTConfig
    from qkv.presets import get_preset
    from qkv.training.trainer import TrainConfig, Trainer

    try:
        from qkv.families.gpt import LMDataConfig, prepare_data
    except ImportError:  # checkouts from before qkv/families/
        from qkv.training.lm import LMDataConfig, prepare_data

    torch.manual_seed(0)
    p = get_preset("gpt", "cpu")
    _, tok, batches = prepare_data(LMDataConfig(), p["model"]["max_seq_len"])
    model = GPT(GPTConfig(**{**p["model"], "vocab_size": tok.vocab_size}))
    out: dict = {"qkv": qkv.__file__}
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig(**{**p["train"], "max_iters": 70, "eval_interval": 1000, "eval_iters": 1,
                             "dtype": "fp32", "compile": False, "optimizer": "adamw", "out_dir": d,
                             "device": "cpu"})
        Trainer(model, cfg, batches, Path(d),
                on_log=lambda r: stamps.append(time.perf_counter()) if "train_loss" in r else None).fit()
    steps = sorted(b - a for a, b in itertools.pairwise(stamps[10:]))
    out["train_ms_per_step"] = 1000 * steps[len(steps) // 2]
    model.eval()
    x = torch.tensor([tok.encode("ROMEO:")])
    rates = []
    for _ in range(7):
        t0 = time.perf_counter()
        n = sum(1 for _ in generate(model, x, 200, temperature=0.0))
        rates.append(n / (time.perf_counter() - t0))
    out["gpt_decode_tok_s"] = sorted(rates)[3]
    try:
        lm = qkv.load("smollm2")
    except Exception as e:  # not installed: say so, measure the rest
        out["smollm2_note"] = f"{type(e).__name__}: {e}"
    else:
        lm.generate("Once upon a time", 8)
        lm.generate("Once upon a time", 64, stop_at_eos=False)
        st = lm.last_stats  # a dict before issue 25, a StreamStats after
        stats = st if isinstance(st, dict) else {"new_tokens": st.new_tokens, "seconds": st.seconds}
        out["smollm2_q4_tok_s"] = stats["new_tokens"] / stats["seconds"]
    print("RESULT " + json.dumps(out))


def measure(checkout: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run([sys.executable, str(HERE), "--child"], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"measuring {checkout} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    if "--child" in sys.argv:
        child()
        return
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--before", default="HEAD~1", help="git revision to compare the working tree with")
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds (alternating order)")
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--json", default=None, help="results file (default benchmarks/results/)")
    args = p.parse_args()
    rounds = 2 if args.quick else args.rounds
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    rev = subprocess.run(["git", "-C", str(C.REPO_DIR), "rev-parse", args.before], capture_output=True,
                         text=True, check=True).stdout.strip()
    meter = C.LoadMeter()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(C.REPO_DIR), "worktree", "add", "--detach", "-q", str(before), rev],
                       check=True)
        try:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for r in range(rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for side in order:
                    runs[side].append(measure(before if side == "before" else C.REPO_DIR))
                    print(f"round {r + 1} {side}: " + ", ".join(
                        f"{k} {runs[side][-1][k]:.1f}" for k in METRICS if k in runs[side][-1]), flush=True)
        finally:
            subprocess.run(["git", "-C", str(C.REPO_DIR), "worktree", "remove", "--force", str(before)],
                           check=False)
    load = meter.stop()
    rows, summary = [], {}
    for k in METRICS:
        if not all(k in x for side in runs.values() for x in side):
            continue
        b = [x[k] for x in runs["before"]]
        a = [x[k] for x in runs["after"]]
        ratios = [y / x for x, y in zip(b, a, strict=True)]
        summary[k] = {"before_median": C.median(b), "after_median": C.median(a),
                      "ratio_median": C.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        s = summary[k]
        rows.append([k, f"{s['before_median']:.1f}", f"{s['after_median']:.1f}",
                     f"{s['ratio_median']:.3f} ({s['ratio_min']:.3f}–{s['ratio_max']:.3f})"])
    C.print_table(f"after (working tree) vs before ({args.before} = {rev[:10]}), {rounds} rounds",
                  ["metric", "before", "after", "after / before per round"], rows)
    print(C.load_line(load))
    payload = {"machine": machine, "load": load, "before": rev, "rounds": rounds, "summary": summary,
               "runs": runs}
    C.write_json("refactor_speed" + ("_quick" if args.quick else ""), payload, args.json)


if __name__ == "__main__":
    main()
