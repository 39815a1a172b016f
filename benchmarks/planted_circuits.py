"""Which heads matter, checked against ground truth: every head-ranking method of the lens scored
on models whose circuit is known because qkv planted it (``qkv.lens.planted``):

- planted induction: the hand-set two-layer induction circuit (heads 0.0 and 1.0) among
  distractor heads that write a little into the answer (float64, weights set by hand);
- planted copying: a 2-layer attention-only GPT trained on repeated spans with its induction
  circuit planted in heads 0.1 and 1.2 (the other heads resampled in training);
- planted previous token: the same shape trained to name π(the token before), one previous-token
  head planted as 1.1.

Each trained model's circuit is verified by exact patching first (``planted.check``). Then for
each method of :data:`METHODS` (a name -> a function (lm, clean, corrupt, answer, wrong) -> (L, H)
scores; add a row to add a method):

- recall: the share of the planted heads among the method's len(circuit) largest |scores|;
- the faithfulness curve (``qkv.lens.faithful``: the clean prompt with every head outside the top k
  patched to its corrupt output, k = 0..L·H; Mueller et al. 2025, MIB) and its CPR (area under f,
  higher is better) and CMD (area under |1 - f|, 0 is best);
- the method's time.

Two rows calibrate the others: "random" (a seeded random table) and "planted heads first" (the
ground truth as a table: the best curve any ranking can reach; where the circuit is an AND of
heads, f stays 0 until all of it is kept, so its CPR is below 1, e.g. 0.75 for 2 heads of 6).

Writes benchmarks/results/planted_circuits.json and the curves (seed 0 of each model) as
benchmarks/results/planted_circuits.png.

    python benchmarks/planted_circuits.py              # ~1 minute on 2 cores (trained models cached)
    python benchmarks/planted_circuits.py --seeds 3
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _common as C
import torch
from torch import Tensor

from qkv import lens
from qkv.lens import planted
from qkv.lens.faithful import faithfulness

NAME = "planted_circuits"
PLOT = C.RESULTS_DIR / f"{NAME}.png"

# A method: (a text model, clean ids, corrupt ids, answer id, wrong id) -> (L, H) head scores,
# ranked by magnitude.
Method = Callable[[planted.Planted, list[int], list[int], int, int], Tensor]


def _exact(lm, clean, corrupt, a, b) -> Tensor:
    return lens.patch(lm, clean, corrupt, site="head", answer=a, wrong=b).values


def _atp(lm, clean, corrupt, a, b) -> Tensor:
    return lens.attribution_patch(lm, clean, corrupt, site="head", answer=a, wrong=b).values


def _grad_drop(lm, clean, corrupt, a, b) -> Tensor:
    est = lens.attribution_patch(lm, clean, corrupt, site="head", answer=a, wrong=b, grad_drop=True)
    assert est.grad_drop is not None
    return est.grad_drop


def _atp_ig(lm, clean, corrupt, a, b) -> Tensor:
    return lens.attribution_patch(lm, clean, corrupt, site="head", answer=a, wrong=b, ig_steps=8).values


def _knockout(lm, clean, corrupt, a, b) -> Tensor:
    # zero-ablation on the clean prompt alone: the change of the logit difference
    return lens.head_effects(lm, clean, answer=a, wrong=b).effect


def _oracle(lm, clean, corrupt, a, b) -> Tensor:
    # the ground truth itself: the planted heads first (the best curve a ranking can give)
    L, H, _ = lens.hooks.shape(lm.model)
    scores = torch.zeros(L, H)
    for layer, h in lm.circuit:
        scores[layer, h] = 1.0
    return scores


def _random(lm, clean, corrupt, a, b) -> Tensor:
    L, H, _ = lens.hooks.shape(lm.model)
    return torch.rand(L, H, generator=torch.Generator().manual_seed(sum(clean)))


METHODS: dict[str, Method] = {
    "exact patching": _exact,
    "AtP": _atp,
    "AtP GradDrop": _grad_drop,
    "AtP IG (m=8)": _atp_ig,
    "zero knock-out (clean)": _knockout,
    "random": _random,
    "planted heads first (ceiling)": _oracle,
}
MODELS: dict[str, Callable[[int], planted.Planted]] = {
    "induction (hand-set)": lambda seed: planted.induction(seed=seed),
    "copying (trained)": lambda seed: planted.copying(seed=seed),
    "previous token (trained)": lambda seed: planted.previous_token(seed=seed),
}


def score(p: planted.Planted, method: Method) -> dict:
    """One method on one planted model: recall, the faithfulness curve and its areas, seconds."""
    t = time.perf_counter()
    values = method(p, p.clean, p.corrupt, p.answer, p.wrong)
    seconds = time.perf_counter() - t
    f = faithfulness(p, p.clean, p.corrupt, values, answer=p.answer, wrong=p.wrong)
    return {"recall": planted.recall(values, p.circuit), "cpr": round(f.cpr, 4), "cmd": round(f.cmd, 4),
            "f": [round(float(v), 4) for v in f.f], "fractions": [round(float(x), 4) for x in f.fractions],
            "order": [f"{layer}.{h}" for layer, h in f.order], "scores": values.tolist(),
            "seconds": round(seconds, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each planted model (0..N-1)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    meter = C.LoadMeter()
    models, rows = [], []
    for model_name, build in MODELS.items():
        for seed in range(args.seeds):
            p = build(seed)
            chk = planted.check(p)
            entry = {"model": model_name, "seed": seed, "circuit": [f"{a}.{b}" for a, b in p.circuit],
                     "heads": p.model.cfg.n_layers * p.model.cfg.n_heads,
                     "train_seconds": None if p.train_seconds is None else round(p.train_seconds, 2),
                     "recipe": None if p.recipe is None else p.recipe.__dict__ | {"key": p.recipe.key()},
                     "check": {"ok": chk.ok, "patch": chk.patch.tolist(), "kept": round(chk.kept, 4),
                               "strongest_other": round(chk.strongest_other, 4)},
                     "methods": {}}
            for method_name, method in METHODS.items():
                entry["methods"][method_name] = score(p, method)
            models.append(entry)
            print(f"{model_name} seed {seed}: circuit {entry['circuit']} check ok={chk.ok} "
                  f"(kept {chk.kept:.3f}, strongest other {chk.strongest_other:.3f})", flush=True)
    summary = {}
    for model_name in MODELS:
        for method_name in METHODS:
            runs = [m["methods"][method_name] for m in models if m["model"] == model_name]
            s = {k: round(sum(r[k] for r in runs) / len(runs), 4) for k in ("recall", "cpr", "cmd")}
            s["recall_per_seed"] = [r["recall"] for r in runs]
            summary.setdefault(model_name, {})[method_name] = s
            rows.append([model_name, method_name, " ".join(f"{r:.2f}" for r in s["recall_per_seed"]),
                         f"{s['cpr']:.3f}", f"{s['cmd']:.3f}",
                         C.fmt_time(C.median([r["seconds"] for r in runs]))])
    load = meter.stop()
    C.print_table(f"planted circuits: recall of the planted heads, faithfulness (CPR higher, CMD lower; "
                  f"mean over {args.seeds} seeds) ({C.load_line(load)})",
                  ["model", "method", "recall per seed", "CPR", "CMD", "time (median)"], rows)
    out = C.write_json(NAME, {"machine": machine, "load": load, "threads": torch.get_num_threads(),
                              "seeds": args.seeds, "methods": list(METHODS), "summary": summary,
                              "models": models}, args.out)
    print(f"wrote {out}")
    if not args.no_plot:
        plot(models)
        print(f"wrote {PLOT}")
    return 0 if all(m["check"]["ok"] for m in models) else 1


def plot(models: list[dict]) -> None:
    from qkv.fileio import save_figure
    from qkv.viz.plots import _pyplot

    plt = _pyplot()
    first = [m for m in models if m["seed"] == 0]
    fig, axes = plt.subplots(1, len(first), figsize=(4.2 * len(first), 3.6), dpi=120, sharey=True)
    for ax, m in zip(axes, first, strict=True):
        for name, r in m["methods"].items():
            ax.plot(r["fractions"], r["f"], marker="o", ms=3, label=f"{name} (CPR {r['cpr']:.2f})")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{m['model']}, circuit {', '.join(m['circuit'])}", fontsize=9)
        ax.set_xlabel("circuit size (share of the heads)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("faithfulness f")
    fig.suptitle("keep the top-k heads, patch the rest to the corrupt run (seed 0)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, PLOT)
    plt.close(fig)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
