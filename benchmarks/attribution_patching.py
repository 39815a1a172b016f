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

- refinements per pair: integrated gradients for heads (``ig_steps=4``); a head's queries and
  keys alone (sites "query", "key": the exact sweep, plain AtP and AtP*'s QK fix); edge attribution
  (EAP, EAP-IG with 4 steps: its time and strongest edges; no exact reference at this size);
- planted: the hand-set two-layer induction circuit with distractor heads (``qkv.lens.planted``,
  seeds 0-4): the share of the two planted heads among each method's two largest cells; and the
  pair on which its induction head is saturated in both runs (the earlier X moved): plain AtP,
  the QK fix and IG against the exact patch on the heads that make the answer.

The issue's goals (issue 54): Spearman ≥ 0.9 and top-10 recall ≥ 0.9 with AtP* (plain AtP
reported too), all 270 heads in ≤ 1 s on 2 cores.

    python benchmarks/attribution_patching.py             # ~8 minutes on 2 cores
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
# the refinements, timed once a round: (name, lens function, its arguments beyond the pair)
MORE = [("ig4 head", "attribution_patch", {"site": "head", "ig_steps": 4}),
        ("exact query", "patch", {"site": "query"}),
        ("estimate query", "attribution_patch", {"site": "query"}),
        ("qk fix query", "attribution_patch", {"site": "query", "qk_fix": True}),
        ("exact key", "patch", {"site": "key"}),
        ("estimate key", "attribution_patch", {"site": "key"}),
        ("qk fix key", "attribution_patch", {"site": "key", "qk_fix": True}),
        ("eap", "edge_attribution", {}),
        ("eap-ig4", "edge_attribution", {"ig_steps": 4})]


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
                                         "estimate resid": [], "grad drop head": [], "ig4 head": [],
                                         "exact query": [], "estimate query": [], "qk fix query": [],
                                         "exact key": [], "estimate key": [], "qk fix key": [],
                                         "eap": [], "eap-ig4": []}
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
            for name, fn, extra in MORE:
                t = time.perf_counter()
                got[name] = getattr(lens, fn)(lm, clean, corrupt, answer=answer, wrong=wrong, **extra)
                times[name].append(time.perf_counter() - t)
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
        ig = lens.agreement(got["ig4 head"].values, got["exact head"].values, k=10)
        res["ig4_head"] = {"spearman": round(ig.spearman, 4), "top10_recall": ig.recall,
                           "values": got["ig4 head"].values.tolist()}
        rows.append([kind, "head, IG (4 steps)", f"{ig.spearman:.3f}", f"{ig.recall:.1f}",
                     f"{C.median(times['ig4 head']):.2f} s", f"{C.median(times['exact head']):.2f} s"])
        for part in ("query", "key"):
            ex = got[f"exact {part}"].values
            res[part] = {"exact_values": ex.tolist()}
            for how in ("estimate", "qk fix"):
                a = lens.agreement(got[f"{how} {part}"].values, ex, k=10)
                res[part][how.replace(" ", "_")] = {"spearman": round(a.spearman, 4),
                                                    "top10_recall": a.recall,
                                                    "values": got[f"{how} {part}"].values.tolist()}
                rows.append([kind, f"{part}, {'AtP' if how == 'estimate' else 'QK fix'}", f"{a.spearman:.3f}",
                             f"{a.recall:.1f}", f"{C.median(times[f'{how} {part}']):.2f} s",
                             f"{C.median(times[f'exact {part}']):.2f} s"])
        for name in ("eap", "eap-ig4"):
            e = got[name]
            res[name] = {"edges": int((~e.values.isnan()).sum()),
                         "top": [[t.sender, t.receiver, round(t.value, 4)] for t in e.top(10)]}
            rows.append([kind, f"edges, {name.upper()} ({res[name]['edges']})",
                         ", ".join(f"{t.sender}>{t.receiver}" for t in e.top(3)), "-",
                         f"{C.median(times[name]):.2f} s", "-"])
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
    # saturated in both runs: clean [f X Y f ... X] -> Y, corrupt: the earlier X moved to position 4,
    # followed by Z; the induction head attends (weight ~1) to Z's position instead
    pl = induction(vocab=8, n_ctx=12, heads=3, distractor=0.0, seed=0)
    clean_s, corrupt_s = [3, 0, 1, 4, 5, 6, 7, 3, 4, 5, 6, 0], [3, 4, 1, 5, 0, 2, 7, 3, 4, 5, 6, 0]
    kw = dict(answer=1, wrong=2)
    saturated = {
        "keys of the induction head 1.0": {
            "exact": float(lens.patch(pl, clean_s, corrupt_s, site="key", **kw).values[1, 0]),
            "atp": float(lens.attribution_patch(pl, clean_s, corrupt_s, site="key", **kw).values[1, 0]),
            "qk_fix": float(lens.attribution_patch(pl, clean_s, corrupt_s, site="key", qk_fix=True,
                                                   **kw).values[1, 0])},
        "previous-token head 0.0 (output)": {
            "exact": float(lens.patch(pl, clean_s, corrupt_s, site="head", **kw).values[0, 0]),
            "atp": float(lens.attribution_patch(pl, clean_s, corrupt_s, site="head", **kw).values[0, 0]),
            "grad_drop": float(lens.attribution_patch(pl, clean_s, corrupt_s, site="head", grad_drop=True,
                                                      **kw).grad_drop[0, 0]),
            **{f"ig{m}": float(lens.attribution_patch(pl, clean_s, corrupt_s, site="head", ig_steps=m,
                                                      **kw).values[0, 0]) for m in (4, 16, 64)}}}
    for what, vals in saturated.items():
        print(f"planted, saturated pair, {what}: " + ", ".join(f"{k} {v:.3f}" for k, v in vals.items()),
              flush=True)
    C.print_table(f"SmolLM2 fp32, attribution patching (AtP) vs the exact sweep, "
                  f"{torch.get_num_threads()} threads",
                  ["pair", "site", "Spearman", "top-10 recall", "AtP", "exact sweep"], rows)
    out = C.write_json(NAME, {"machine": machine, "threads": torch.get_num_threads(), "rounds": args.rounds,
                              "pairs": results, "planted": planted, "planted_saturated": saturated}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
