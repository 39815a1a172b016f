"""How many blocks a saved step's package should hold: SmolLM2 q4's one-request step built with
groups of G blocks (``aot.GROUP_MAX = G``; 30 = the whole stack in one package, one call a token),
each build timed (export + AOTInductor + g++, Inductor's cache warm from the first build, as on a
machine that has built once), then decoding through each, rounds alternating the order: ms a
token and the ratio to the whole stack in one call, measured in the same rounds.

    python benchmarks/step_groups.py                 # ~6 minutes on 2 cores
    python benchmarks/step_groups.py --groups 1 5 30

Packages built for a G other than qkv's own are removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import time

import _common as C

NAME = "step_groups"
TEXT = ("The history of the city begins with a small settlement on an island in the river. Over the "
        "centuries it grew into a centre of trade and learning, with markets, bridges and churches. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 3, 5, 10, 30])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=100, help="tokens decoded a round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    import qkv
    from qkv.generation import aot

    machine = C.machine_info()
    print(C.machine_line(machine))
    lm = qkv.load("smollm2")
    m = lm.model
    own = aot.GROUP_MAX
    steps, build_s, keys = {}, {}, {}
    for G in args.groups:
        aot.GROUP_MAX = G
        key, _ = aot.step_key(m, aot.cache_len_for(m))
        keys[G] = key
        t = time.perf_counter()
        built = aot.load(m) is None
        if built:
            aot.build(m)
        build_s[G] = round(time.perf_counter() - t, 1) if built else None
        steps[G] = aot.load(m)
        assert steps[G] is not None and steps[G].group == aot.group_size(m.cfg.n_layers)
        print(f"groups of {steps[G].group}: " + (f"built in {build_s[G]:.0f} s" if built else "found built"),
              flush=True)
    aot.GROUP_MAX = own

    ids = lm.tokenizer.encode(TEXT * 4)
    whole = max(args.groups)

    def ms_a_token(G: int) -> float:
        step = steps[G]
        cache = step.make_cache(1)
        times = []
        with torch.inference_mode():
            m(torch.tensor([ids[:8]]), cache=cache)
            for t in ids[8 : 8 + args.tokens]:
                t0 = time.perf_counter()
                step.step(torch.tensor([[t]]), cache)
                times.append(time.perf_counter() - t0)
        step.release(cache)
        return C.median(times) * 1e3

    for G in args.groups:
        ms_a_token(G)  # warm
    ms: dict[int, list[float]] = {G: [] for G in args.groups}
    for r in range(args.rounds):
        for G in args.groups if r % 2 == 0 else args.groups[::-1]:
            ms[G].append(ms_a_token(G))
        print(f"round {r + 1}: " + ", ".join(f"G={G} {v[-1]:.2f} ms" for G, v in ms.items()), flush=True)
    ratios = {G: [a / b for a, b in zip(ms[G], ms[whole], strict=True)] for G in args.groups}
    rows = [[str(steps[G].group), "" if build_s[G] is None else f"{build_s[G]:.0f}", f"{C.median(ms[G]):.2f}",
             f"{C.median(ratios[G]):.3f}", f"{min(ratios[G]):.2f}-{max(ratios[G]):.2f}"] for G in args.groups]
    C.print_table(f"SmolLM2 q4, one-request step, {torch.get_num_threads()} threads",
                  ["blocks a package", "build s", "ms a token (median)", f"x G={whole}'s time", "rounds"],
                  rows)
    for G in args.groups:  # only qkv's own grouping stays in the cache
        if aot.group_size(m.cfg.n_layers) != steps[G].group:
            shutil.rmtree(aot.folder() / keys[G], ignore_errors=True)
            (aot.folder() / f"{keys[G]}.lock").unlink(missing_ok=True)
    out = C.write_json(NAME, {"machine": machine, "threads": torch.get_num_threads(), "build_s": build_s,
                              "ms_a_token": {G: [round(x, 3) for x in v] for G, v in ms.items()},
                              "ratio_to_whole": {G: round(C.median(v), 3) for G, v in ratios.items()},
                              "qkv_group_max": own}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
