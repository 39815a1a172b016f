"""qkv's 4-bit kernel (``qkv/kernels/qmatmul.cpp``) beside PyTorch's (``_weight_int4pack_mm_for_cpu``)
on SmolLM2-135M's matrices, and what each does to the model's predictions.

- ``speed``: every 4-bit product of a token (30 layers x qkv, out, gate|up, down; random codes of
  SmolLM2's shapes) for 1, 2, 4, 8 and 32 rows (a token, a running batch, a prompt), in
  alternated rounds; rows/s and the rate the weights are read at (0.625 bytes per weight, both
  kernels). ``--against REV``: also qkv's kernel as it was at git revision REV (its
  ``qmatmul.cpp`` compiled here beside today's), in the same rounds.
- ``quality``: SmolLM2's GGUF in q4 with each kernel against the same file in fp32 (its exact
  float weights) on 300 positions of held text: how often the top-1 token agrees, the mean
  KL(fp32 || q4) and the mean negative log-likelihood of the text (with qkv's kernels the
  output head is the file's Q8_0 blocks on ``qkv::q8_mm``; with PyTorch's, int8 rows); and the
  same text fed a token at a time through the native step (``qkv/generation/native_step.py``).

PyTorch's kernel takes bf16 activations; qkv's takes float32 ones and rounds each group of 32 to
int8 twice (a code and its residual: to 1/256 of the int8 step), then multiplies by integer dot
products (AVX512-VNNI, else AVX2).

    python benchmarks/int4_kernel.py              # ~1 minute on 2 cores
    python benchmarks/int4_kernel.py --against adb32d0 --positions 0   # speed only, vs a revision
    python benchmarks/int4_kernel.py --threads 1 2 --positions 0        # what a second thread adds
"""

from __future__ import annotations

import argparse
import time

import _common as C

NAME = "int4_kernel"
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, out, gate|up, down


def kernel_at(rev: str) -> object:
    """``int4_mm`` of qkv's kernel source at git revision ``rev``, compiled for this CPU under its
    own namespace (torch.ops.qkv_at_rev) beside today's."""
    import subprocess
    import tempfile
    from pathlib import Path

    import torch

    from qkv.kernels import compile_library

    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:qkv/kernels/qmatmul.cpp"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as d:
        cpp, lib = Path(d) / "qmatmul.cpp", Path(d) / "before.so"
        cpp.write_text(src)
        compile_library(lib, namespace="qkv_at_rev", source=cpp)
        torch.ops.load_library(str(lib))
    return torch.ops.qkv_at_rev.int4_mm


def speed(rounds: int, rows: tuple[int, ...], before: object | None = None) -> list[dict]:
    import torch

    from qkv.layers.quant import Int4Linear

    torch.manual_seed(0)
    layers = {k: [Int4Linear.from_float(torch.randn(N, K), kernel=k) for _ in range(30) for (N, K) in SHAPES]
              for k in ("aten", "qkv")}
    weights = sum(N * K for (N, K) in SHAPES) * 30
    out = []
    for M in rows:
        xs = {K: torch.randn(M, K) for K in (576, 1536)}
        inputs = {"aten": {K: x.bfloat16() for K, x in xs.items()}, "qkv": xs}
        reps = max(2, 64 // M)
        kinds = ["aten", "qkv", *(["before"] if before is not None else [])]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(rounds):
            for k in (kinds if r % 2 == 0 else kinds[::-1]):
                t = time.perf_counter()
                for _ in range(reps):
                    if k == "before":  # the same packed layers, through the revision's op
                        for layer in layers["qkv"]:
                            before(inputs["qkv"][layer.in_features], layer.w4, layer.dm)
                        continue
                    for layer in layers[k]:
                        layer.matmul(inputs[k][layer.in_features])
                times[k].append((time.perf_counter() - t) / reps)
        row = {"rows": M}
        for k, ts in times.items():
            s = C.median(ts)
            row[k] = {"ms_per_pass": round(s * 1e3, 3), "rows_per_s": round(M / s, 1),
                      "weights_gb_per_s": round(weights * 0.625 / s / 1e9, 1),
                      "samples_ms": [round(t * 1e3, 3) for t in ts]}
        row["qkv_vs_pytorch"] = round(row["aten"]["ms_per_pass"] / row["qkv"]["ms_per_pass"], 2)
        a, q = row["aten"]["ms_per_pass"], row["qkv"]["ms_per_pass"]
        extra = ""
        if before is not None:
            row["qkv_vs_before"] = round(row["before"]["ms_per_pass"] / q, 2)
            was = row["before"]["ms_per_pass"]
            extra = f"; at the revision {was:.2f} ms ({row['qkv_vs_before']:.2f}x now)"
        print(f"{M:>3} rows: PyTorch's {a:.2f} ms, qkv's {q:.2f} ms for every 4-bit product once "
              f"({row['qkv_vs_pytorch']:.2f}x){extra}", flush=True)
        out.append(row)
    return out


def speed_by_threads(rounds: int, threads: list[int]) -> dict[int, list[dict]]:
    """:func:`speed` of qkv's kernel and PyTorch's on each thread count (1, 2 and 4 rows). Where
    each thread's arithmetic bounds the products a second thread nearly doubles their speed; where
    the memory's bandwidth (or a core the two threads share) bounds them, it adds less."""
    import torch

    was = torch.get_num_threads()
    out = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            print(f"{n} thread(s):", flush=True)
            out[n] = speed(rounds, (1, 2, 4))
    finally:
        torch.set_num_threads(was)
    for M in (1, 2, 4):
        ms = {n: next(r for r in rows if r["rows"] == M)["qkv"]["ms_per_pass"] for n, rows in out.items()}
        print(f"{M} rows, qkv's kernel: " + ", ".join(f"{n} thread(s) {t:.2f} ms" for n, t in ms.items()),
              flush=True)
    return out


def quality(positions: int) -> dict:
    import os

    import torch

    import qkv
    import qkv.kernels as K
    from qkv.assets import asset_path

    folder = asset_path("shakespeare")
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else [folder]
    text = files[0].read_text(errors="ignore")[20000:60000]
    ref = qkv.load("smollm2", weights="fp32")
    ids = torch.tensor([ref.tokenizer.encode(text)[: positions + 1]])
    with torch.inference_mode():
        lr = ref.model(ids).logits[0].double().log_softmax(-1)
    nll = -lr[:-1].gather(1, ids[0, 1:, None]).mean().item()
    out = {"positions": int(ids.shape[1]), "fp32_nll": round(nll, 5)}
    for kern in ("aten", "qkv"):
        os.environ["QKV_INT4_KERNEL"] = "off" if kern == "aten" else "on"
        K._state.update(op=None, status=None)
        lm = qkv.load("smollm2", weights="q4")
        used = {m.kernel for m in lm.model.modules() if isinstance(getattr(m, "kernel", None), str)}
        assert used == {kern}, used
        with torch.inference_mode():
            lq = lm.model(ids).logits[0].double().log_softmax(-1)
        out[kern] = {"top1_agreement": round((lq.argmax(-1) == lr.argmax(-1)).float().mean().item(), 4),
                     "kl_fp32_q4": round((lr.exp() * (lr - lq)).sum(-1).mean().item(), 6),
                     "nll": round(-lq[:-1].gather(1, ids[0, 1:, None]).mean().item(), 5)}
        o = out[kern]
        print(f"q4 with {'PyTorch' if kern == 'aten' else 'qkv'}'s kernel: top-1 as fp32 at "
              f"{o['top1_agreement']:.1%}, KL {o['kl_fp32_q4']:.5f}, NLL {o['nll']:.4f} "
              f"(fp32 {out['fp32_nll']:.4f})", flush=True)
        from qkv.generation import native_step

        if kern == "qkv" and native_step.unsupported(lm.model) is None:
            # the same text fed a token at a time through the native step (the first eagerly)
            ns = native_step.NativeStep(lm.model, ids.shape[1])
            rows, picks = [], []
            with torch.inference_mode():
                cache, again = ns.make_cache(1), ns.make_cache(1)
                rows.append(lm.model(ids[:, :1], cache=cache).logits[0, -1])
                picks.append(int(lm.model(ids[:, :1], cache=again).logits[0, -1].argmax()))
                for t in range(1, ids.shape[1]):
                    rows.append(ns.step(ids[:, t : t + 1], cache)[0, -1])
                    ns.step(ids[:, t : t + 1], again, greedy=True)  # greedy decoding's step
                    picks.append(int(ns.greedy()))
            ln = torch.stack(rows).double().log_softmax(-1)
            greedy_picks = torch.tensor(picks)

            def share(same):
                return round(same.float().mean().item(), 4)

            def agree(a, b):
                return round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)

            out["native"] = {"top1_agreement": agree(ln, lr),
                             "kl_fp32_q4": round((lr.exp() * (lr - ln)).sum(-1).mean().item(), 6),
                             "nll": round(-ln[:-1].gather(1, ids[0, 1:, None]).mean().item(), 5),
                             "top1_as_the_forward": agree(ln, lq),
                             # greedy steps rank with the head's 4-bit copy where made (greedy_head)
                             "greedy_head": "8-bit" if native_step.greedy_head(lm.model) is None else "4-bit",
                             # (position 0 is the eager prompt's in both: left out)
                             "greedy_as_the_step": share(greedy_picks[1:] == ln[1:].argmax(-1)),
                             "greedy_top1_agreement": share(greedy_picks[1:] == lr[1:].argmax(-1)),
                             "greedy_positions": int(ids.shape[1]) - 1}
            o = out["native"]
            print(f"q4 through the native step, a token at a time: top-1 as fp32 at "
                  f"{o['top1_agreement']:.1%} (as the q4 forward at {o['top1_as_the_forward']:.1%}), "
                  f"KL {o['kl_fp32_q4']:.5f}, NLL {o['nll']:.4f}; greedy steps ({o['greedy_head']} head's "
                  f"ranking) choose the step's argmax at {o['greedy_as_the_step']:.1%}, fp32's at "
                  f"{o['greedy_top1_agreement']:.1%}", flush=True)
    os.environ.pop("QKV_INT4_KERNEL", None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--positions", type=int, default=300)
    p.add_argument("--against", default=None, metavar="REV",
                   help="also time qkv's kernel as it was at this git revision, in the same rounds")
    p.add_argument("--threads", type=int, nargs="+", default=None, metavar="N",
                   help="also time the products (1, 2, 4 rows) on each of these thread counts in turn: "
                        "what a second thread adds (near 2x where arithmetic bounds them)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads is not None and not all(n >= 1 for n in args.threads):
        raise SystemExit("--threads: each count at least 1")
    if not C.have_assets(NAME, ("smollm2", "shakespeare")):
        return
    import qkv.kernels as K

    machine = C.machine_info()
    print(C.machine_line(machine))
    print(f"qkv's kernel here: {K.int4_status()}", flush=True)
    meter = C.LoadMeter()
    before = kernel_at(args.against) if args.against else None
    result = {"machine": machine, "kernel": K.int4_status(), "against": args.against,
              "speed": speed(args.rounds, (1, 2, 4, 8, 32), before),
              "speed_by_threads": speed_by_threads(args.rounds, args.threads) if args.threads else None,
              "quality": quality(args.positions) if args.positions > 0 else None}
    result["load"] = meter.stop()
    print(C.load_line(result["load"]))
    C.write_json(NAME, result, args.out)


if __name__ == "__main__":
    main()
