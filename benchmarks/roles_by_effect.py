"""Heads named by where they look vs by what they do (issue 54, item 5): a 2-layer GPT with MLPs
trained here on a corpus of repeated spans, then read with qkv's head tools.

The corpus: sequences of 48 symbols out of 40, i.i.d. uniform, into which 3 spans of 5-8 symbols
of the first half are copied, each into its own third of the second half (a span reappears
later). A token inside a
copied span after its first is a *repeat* (predictable from the earlier occurrence); a token in
no copied span is a *first occurrence* (predictable by nothing: ln 40 = 3.69 nats at best).

The model: qkv's GPT, 2 layers, 4 heads of 16, width 64, GELU MLPs, pre-LN, learned positions,
trained by a plain AdamW loop (seeded; one thread) on fresh batches until it copies (the loss on
the repeats falls well below the loss on first occurrences; both reported, on held-out batches).

Then, on repeated random tokens of several lengths R (``lens.repeated_tokens``):
- named by pattern: heads whose previous-token / first-token / duplicate / induction score
  reaches 0.5 (``lens.score_model``, ``HeadScores.named()``);
- named by effect: heads whose knock-out undoes at least 25% of what the repeat saves
  (``lens.copy_effects``, ``HeadScores.copiers()``);
and on the corpus itself: how much the loss on the repeats rises when each head is zeroed.

    python benchmarks/roles_by_effect.py       # ~2-4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _common as C
import torch
import torch.nn.functional as F
from torch import Tensor

from qkv import lens
from qkv.lens.hooks import Edits, hooked
from qkv.models.gpt import GPT, GPTConfig

NAME = "roles_by_effect"
VOCAB, N, SPANS, SPAN = 40, 48, 3, (5, 8)


def corpus_batch(batch: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """ids (B, N) and a kind per next-token target (B, N - 1): 1 = a repeat (inside a copied span,
    after its first token), 0 = a first occurrence (in no copied span), -1 = the first token of a
    copied span (its earlier occurrence is not known until it is seen)."""
    ids = torch.randint(VOCAB, (batch, N), generator=g)
    kind = torch.zeros(batch, N, dtype=torch.long)  # per position of ids
    half, slot = N // 2, N // 2 // SPANS
    for b in range(batch):
        for j in range(SPANS):  # span j lands in its own slot of the second half: no overlaps
            n = int(torch.randint(SPAN[0], SPAN[1] + 1, (1,), generator=g))
            src = int(torch.randint(0, half - n + 1, (1,), generator=g))
            dst = half + j * slot + int(torch.randint(0, slot - n + 1, (1,), generator=g))
            ids[b, dst:dst + n] = ids[b, src:src + n]
            kind[b, dst] = -1
            kind[b, dst + 1:dst + n] = 1
    return ids, kind[:, 1:]


def split_losses(model: GPT, ids: Tensor, kind: Tensor, edits: Edits | None = None) -> tuple[float, float]:
    """(mean loss on the repeats, on first occurrences), nats a token."""
    with torch.no_grad(), hooked(model, edits=edits):
        logits = model(ids[:, :-1]).logits
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return float(ce[kind == 1].mean()), float(ce[kind == 0].mean())


def train(steps: int, seed: int, log_every: int) -> tuple[GPT, list[dict], float]:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=N, dim=64, n_layers=2, n_heads=4, mlp="gelu", dropout=0.0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed)
    held = corpus_batch(256, torch.Generator().manual_seed(seed + 1000))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=steps, pct_start=0.05)
    history = []
    t0 = time.perf_counter()
    for step in range(steps + 1):
        if step % log_every == 0 or step == steps:
            model.eval()
            rep, first = split_losses(model, *held)
            history.append({"step": step, "loss_repeats": round(rep, 4), "loss_first": round(first, 4),
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step}: repeats {rep:.3f}, first occurrences {first:.3f} nats", flush=True)
            model.train()
        if step == steps:
            break
        ids, _ = corpus_batch(32, g)
        loss = model(ids[:, :-1], ids[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), history, time.perf_counter() - t0


def zeroed(layer: int, head: int) -> Edits:
    def edit(z: Tensor) -> Tensor:
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return Edits(z={layer: edit})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", default="4,8,12,16,24", help="repeat lengths R of the probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    meter = C.LoadMeter()
    model, history, seconds = train(args.steps, args.seed, max(1, args.steps // 10))
    L, H = 2, 4
    held = corpus_batch(256, torch.Generator().manual_seed(args.seed + 1000))
    base_rep, base_first = split_losses(model, *held)
    rise = torch.zeros(L, H)  # the corpus's loss on repeats with each head zeroed, minus unablated
    for layer in range(L):
        for h in range(H):
            rise[layer, h] = split_losses(model, *held, edits=zeroed(layer, h))[0] - base_rep
    probes = []
    rows = []
    for R in (int(r) for r in args.repeats.split(",")):
        tokens = lens.repeated_tokens(VOCAB, R, batch=32, seed=args.seed)
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
    C.print_table(f"2-layer GPT with MLPs on repeated spans, {args.steps} steps ({C.load_line(load)})",
                  ["R", "probe loss first -> repeat", "best prev / induction score",
                   "named by pattern (>= 0.5)", "named by effect (copiers, nats)"], rows)
    print(f"corpus held out: loss on repeats {history[0]['loss_repeats']:.2f} -> {base_rep:.2f} nats, "
          f"on first occurrences {history[0]['loss_first']:.2f} -> {base_first:.2f} "
          f"(training {seconds:.0f} s)")
    print("loss on the corpus's repeats with each head zeroed (rise, nats):")
    for layer in range(L):
        print("  " + "  ".join(f"{layer}.{h} {float(rise[layer, h]):+.3f}" for h in range(H)))
    out = C.write_json(NAME, {
        "machine": machine, "load": load, "threads": torch.get_num_threads(), "model": {
            "n_layers": L, "n_heads": H, "dim": 64, "mlp": "gelu", "vocab": VOCAB, "context": N,
            "spans_per_sequence": SPANS, "span_length": list(SPAN)},
        "steps": args.steps, "seed": args.seed, "train_seconds": round(seconds, 1), "history": history,
        "corpus_loss_repeats": round(base_rep, 4), "corpus_loss_first": round(base_first, 4),
        "corpus_repeat_rise_per_head": rise.tolist(), "probes": probes}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
