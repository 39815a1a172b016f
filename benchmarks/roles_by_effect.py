"""Heads named by where they look vs by what they do (issue 54, item 5): a 2-layer GPT trained by
`qkv train gpt` on a corpus of repeated spans, then read with qkv's head tools.

The corpus (written here, seeded): lines of 36-60 symbols drawn uniformly from 40 (a-z, A-N), into
each of which two spans of 8-16 symbols of the same line are copied further on, at random
offsets; lines end with a newline (the 41st symbol). A symbol inside a copy after its first is a
*repeat* (predictable from the earlier occurrence); a symbol in no copy is a *first occurrence*
(ln 40 = 3.69 nats at best).

The model: `qkv train gpt --preset induction --positions learned --mlp gelu` (2 layers, 4 heads,
width 64, MLPs, learned positions: the preset's recipe, whose note says that with learned
positions the copying spreads over heads), 4000 steps, qkv's own trainer.

Then:
- on held-out lines (one a window, from its start): the loss on repeats and on first occurrences,
  and how much the loss on repeats rises when each head is zeroed;
- on repeated random tokens of several lengths R (``lens.repeated_tokens``): heads named by
  pattern (a previous-token / first-token / duplicate / induction score >= 0.5,
  ``HeadScores.named()``) and named by effect (a knock-out undoing >= 25% of what the repeat
  saves, ``lens.copy_effects``, ``HeadScores.copiers()``).

    python benchmarks/roles_by_effect.py       # ~3-4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import random
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import torch
import torch.nn.functional as F
from torch import Tensor

import qkv
from qkv import lens
from qkv.lens.hooks import Edits, hooked

NAME = "roles_by_effect"
ALPHABET = string.ascii_lowercase + "ABCDEFGHIJKLMN"  # 40 symbols
LINE, SPANS, SPAN = (36, 60), 2, (8, 16)


def corpus_line(rng: random.Random) -> tuple[str, list[int]]:
    """One line and a kind per symbol: 1 = a repeat (inside a copy, after its first symbol), 0 = a
    first occurrence (in no copy), -1 = a copy's first symbol (not predictable from the copy)."""
    n = rng.randint(*LINE)
    s = [rng.choice(ALPHABET) for _ in range(n)]
    kind = [0] * n
    for _ in range(SPANS):
        span = rng.randint(*SPAN)
        for _ in range(50):  # a copy lands where no other copy or source is
            src = rng.randint(0, n - 2 * span)
            dst = rng.randint(src + span, n - span)
            if not any(kind[dst:dst + span]) and not any(kind[src:src + span]):
                s[dst:dst + span] = s[src:src + span]
                kind[dst:dst + span] = [-1] + [1] * (span - 1)
                break
    return "".join(s), kind


def held_out(lm, lines: int, seed: int) -> tuple[Tensor, Tensor]:
    """ids (B, T) one window a line, from the line's start (later lines fill the rest), and the
    kind of each next-symbol target (B, T - 1): only the first line's symbols count (-1 beyond)."""
    rng = random.Random(seed)
    made = [corpus_line(rng) for _ in range(lines + 4)]
    T = lm.model.cfg.max_seq_len
    ids, kinds = [], []
    for i in range(lines):
        text = "\n".join(t for t, _ in made[i:i + 4])[:T]
        kind = (made[i][1] + [-1] * T)[:T]
        ids.append(lm.tokenizer.encode(text))
        kinds.append(kind[1:])
    return torch.tensor(ids), torch.tensor(kinds)


def split_losses(model, ids: Tensor, kind: Tensor, edits: Edits | None = None) -> tuple[float, float]:
    """(mean loss on the repeats, on first occurrences), nats a symbol."""
    with torch.no_grad(), hooked(model, edits=edits):
        logits = model(ids[:, :-1]).logits
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return float(ce[kind == 1].mean()), float(ce[kind == 0].mean())


def zeroed(layer: int, head: int) -> Edits:
    def edit(z: Tensor) -> Tensor:
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return Edits(z={layer: edit})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", default="4,8,12,16,24", help="repeat lengths R of the probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    meter = C.LoadMeter()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "spans.txt"
        corpus.write_text("".join(corpus_line(rng)[0] + "\n" for _ in range(20_000)), encoding="utf-8")
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "qkv", "train", "gpt", "--preset", "induction", "--positions", "learned",
               "--mlp", "gelu", "--data", str(corpus), "--out-dir", str(run), "--max-iters", str(args.steps),
               "--seed", str(args.seed)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"training failed: {done.stderr.strip().splitlines()[-1:]}")
        said = [line for line in done.stdout.splitlines() if line.startswith(("trained", "heads:"))]
        print("\n".join(said))
        lm = qkv.load(str(run))
    model = lm.model
    L, H = model.cfg.n_layers, model.cfg.n_heads
    held = held_out(lm, 512, args.seed + 1000)
    base_rep, base_first = split_losses(model, *held)
    rise = torch.zeros(L, H)  # the held-out loss on repeats with each head zeroed, minus unablated
    for layer in range(L):
        for h in range(H):
            rise[layer, h] = split_losses(model, *held, edits=zeroed(layer, h))[0] - base_rep
    probes = []
    rows = []
    for R in (int(r) for r in args.repeats.split(",")):
        tokens = lens.repeated_tokens(lm.tokenizer.vocab_size, R, batch=32, seed=args.seed)
        scores = lens.score_model(model, tokens)
        scores.copying = lens.copy_effects(model, tokens)
        named = [(layer, h, t, round(s, 3)) for layer, h, t, s in scores.named()]
        copiers = [(layer, h, round(v, 3)) for layer, h, v in scores.copiers()]
        best = {t: round(float(v.max()), 3) for t, v in scores.by_type().items()}
        probes.append({"repeat": R, "loss_first": round(scores.loss_first, 4),
                       "loss_second": round(scores.loss_second, 4), "saved": round(scores.saved, 4),
                       "best_score": best, "named_by_pattern": named, "named_by_effect": copiers,
                       "scores": {t: v.tolist() for t, v in scores.by_type().items()},
                       "copying": scores.copying.tolist()})
        rows.append([str(R), f"{scores.loss_first:.2f} -> {scores.loss_second:.2f}",
                     f"{best['previous']:.2f} / {best['induction']:.2f}",
                     ", ".join(f"{a}.{b} {t} {s:.2f}" for a, b, t, s in named) or "none",
                     ", ".join(f"{a}.{b} +{v:.2f}" for a, b, v in copiers) or "none"])
    load = meter.stop()
    C.print_table(f"2-layer GPT with MLPs and learned positions on repeated spans, {args.steps} steps "
                  f"({C.load_line(load)})",
                  ["R", "probe loss first -> repeat", "best prev / induction score",
                   "named by pattern (>= 0.5)", "named by effect (copiers, nats)"], rows)
    print(f"held-out lines: loss on repeats {base_rep:.2f} nats, on first occurrences {base_first:.2f} "
          f"(ln 40 = 3.69; training {seconds:.0f} s)")
    print("loss on the corpus's repeats with each head zeroed (rise, nats):")
    for layer in range(L):
        print("  " + "  ".join(f"{layer}.{h} {float(rise[layer, h]):+.3f}" for h in range(H)))
    out = C.write_json(NAME, {
        "machine": machine, "load": load, "threads": torch.get_num_threads(), "command": " ".join(cmd[1:]),
        "trainer_said": said, "model": {
            "n_layers": L, "n_heads": H, "dim": model.cfg.dim, "mlp": "gelu", "positions": "learned",
            "symbols": len(ALPHABET), "context": model.cfg.max_seq_len, "line_length": list(LINE),
            "spans_per_line": SPANS, "span_length": list(SPAN)},
        "steps": args.steps, "seed": args.seed, "train_seconds": round(seconds, 1),
        "held_loss_repeats": round(base_rep, 4), "held_loss_first": round(base_first, 4),
        "held_repeat_rise_per_head": rise.tolist(), "probes": probes}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
