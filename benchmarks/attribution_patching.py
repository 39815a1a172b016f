"""Attribution patching against the exact sweep it estimates: SmolLM2-135M (fp32, the lens's
weights), prompt pairs of different kinds (a capital city, an indirect object, a repeated name,
a date, a gendered pronoun), every head of every layer (30 x 9 = 270 cells) and every
(layer, position) of the residual stream.

- exact: ``lens.patch(lm, clean, corrupt, site)``: one forward pass from layer l on per cell
  (batched per layer);
- estimate: ``lens.attribution_patch(...)`` (plain AtP: a clean pass, a corrupt pass with
  gradients, one backward pass, a dot product per cell); for heads also with AtP*'s GradDrop
  (``grad_drop=True``: one more backward pass per layer; magnitudes, compared with |exact|);
- agreement per pair: Spearman's rank correlation of the two tables and the top-10 recall (of
  the exact sweep's 10 largest cells by |value|, the share among the estimate's 10 largest);
  the time of each, alternated over ``--rounds`` rounds (medians).

- planted: the hand-set two-layer induction circuit with distractor heads (``qkv.lens.planted``,
  seeds 0-4): the share of the two planted heads among each method's two largest cells.

The issue's goals (issue 54): Spearman ≥ 0.9 and top-10 recall ≥ 0.9 with AtP* (plain AtP
reported too), all 270 heads in ≤ 1 s on 2 cores.

    python benchmarks/attribution_patching.py             # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time

import _common as C

NAME = "attribution_patching"
# (kind, clean, corrupt, answer, wrong): same number of tokens in each pair (checked)
PAIRS = [
    ("capital city", "The capital of France is", "The capital of Italy is", " Paris", " Rome"),
    ("indirect object", "When Mary and John went to the store, John gave a drink to",
     "When Mary and John went to the store, Mary gave a drink to", " Mary", " John"),
    ("repeated name", "Anna met Bob at the station. Later Anna waved to", "Anna met Tom at the station. "
     "Later Anna waved to", " Bob", " Tom"),
    ("date", "The war lasted from the year 1732 to the year 17", "The war lasted from the year 1781 to "
     "the year 17", None, None),
    ("gendered pronoun", "John was late, so the teacher asked why", "Mary was late, so the teacher asked why",
     " he", " she"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per pair (alternated); medians")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    import qkv
    from qkv import lens

    machine = C.machine_info()
    print(C.machine_line(machine))
    lm = qkv.load("smollm2", weights="fp32")
    rows, results = [], []
    for kind, clean, corrupt, answer, wrong in PAIRS:
        n_c, n_k = len(lm.tokenizer.encode(clean)), len(lm.tokenizer.encode(corrupt))
        if n_c != n_k:
            raise SystemExit(f"{kind}: the prompts have {n_c} and {n_k} tokens; the pairs must match")
        times: dict[str, list[float]] = {"exact head": [], "estimate head": [], "exact resid": [],
                                         "estimate resid": [], "grad drop head": []}
        got = {}
        for r in range(args.rounds):
            for site in ("head", "resid"):
                order = ("exact", "estimate") if r % 2 == 0 else ("estimate", "exact")
                for what in order:
                    t = time.perf_counter()
                    if what == "exact":
                        got[f"exact {site}"] = lens.patch(lm, clean, corrupt, site=site, answer=answer,
                                                          wrong=wrong)
                    else:
                        got[f"estimate {site}"] = lens.attribution_patch(lm, clean, corrupt, site=site,
                                                                         answer=answer, wrong=wrong)
                    times[f"{what} {site}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            got["grad drop"] = lens.attribution_patch(lm, clean, corrupt, site="head", answer=answer,
                                                      wrong=wrong, grad_drop=True)
            times["grad drop head"].append(time.perf_counter() - t)
        res = {"kind": kind, "clean": clean, "corrupt": corrupt, "answer": got["exact head"].answer,
               "wrong": got["exact head"].wrong, "tokens": n_c,
               "clean_diff": round(got["exact head"].clean_diff, 4),
               "corrupt_diff": round(got["exact head"].corrupt_diff, 4),
               "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()}}
        for site in ("head", "resid"):
            agree = lens.agreement(got[f"estimate {site}"].values, got[f"exact {site}"].values, k=10)
            res[site] = {"spearman": round(agree.spearman, 4), "top10_recall": agree.recall,
                         "exact_values": got[f"exact {site}"].values.tolist(),
                         "estimate_values": got[f"estimate {site}"].values.tolist()}
            rows.append([kind, site, f"{agree.spearman:.3f}", f"{agree.recall:.1f}",
                         f"{C.median(times[f'estimate {site}']):.2f} s",
                         f"{C.median(times[f'exact {site}']):.2f} s"])
        gd = lens.agreement(got["grad drop"].grad_drop, got["exact head"].values.abs(), k=10)
        plain_abs = lens.agreement(got["estimate head"].values.abs(), got["exact head"].values.abs(), k=10)
        res["grad_drop"] = {"spearman_of_magnitudes": round(gd.spearman, 4), "top10_recall": gd.recall,
                            "plain_spearman_of_magnitudes": round(plain_abs.spearman, 4),
                            "values": got["grad drop"].grad_drop.tolist()}
        rows.append([kind, "head, GradDrop (|.|)", f"{gd.spearman:.3f} (plain {plain_abs.spearman:.3f})",
                     f"{gd.recall:.1f}", f"{C.median(times['grad drop head']):.2f} s",
                     f"{C.median(times['exact head']):.2f} s"])
        results.append(res)
        print(f"{kind}: heads Spearman {res['head']['spearman']:.3f}, top-10 recall "
              f"{res['head']['top10_recall']:.1f}; resid {res['resid']['spearman']:.3f} / "
              f"{res['resid']['top10_recall']:.1f}", flush=True)
    from qkv.lens.planted import induction, recall

    planted = []
    for seed in range(5):
        pl = induction(seed=seed)
        kw = dict(site="head", answer=pl.answer, wrong=pl.wrong)
        exact = lens.patch(pl, pl.clean, pl.corrupt, **kw)
        est = lens.attribution_patch(pl, pl.clean, pl.corrupt, grad_drop=True, **kw)
        planted.append({"seed": seed, "exact": recall(exact.values, pl.circuit),
                        "atp": recall(est.values, pl.circuit), "grad_drop": recall(est.grad_drop, pl.circuit),
                        "exact_values": exact.values.tolist(), "atp_values": est.values.tolist(),
                        "grad_drop_values": est.grad_drop.tolist()})
    for name in ("exact", "atp", "grad_drop"):
        print(f"planted induction circuit, recall of its 2 heads by {name}: "
              + " ".join(f"{r[name]:.1f}" for r in planted), flush=True)
    C.print_table(f"SmolLM2 fp32, attribution patching (AtP) vs the exact sweep, "
                  f"{torch.get_num_threads()} threads",
                  ["pair", "site", "Spearman", "top-10 recall", "AtP", "exact sweep"], rows)
    out = C.write_json(NAME, {"machine": machine, "threads": torch.get_num_threads(), "rounds": args.rounds,
                              "pairs": results, "planted": planted}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
