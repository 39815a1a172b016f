"""qkv's one-token decoding steps on SmolLM2-135M beside llama.cpp on the same GGUF file: the
native step (``qkv/generation/native_step.py``, the default where it runs the model: no set-up),
the saved step (``qkv/generation/aot.py``: what building it costs once, what every later process
pays to load it) and eager decoding; how fast each decodes and whether it predicts what eager
decoding predicts.

- ``build_s``: export + AOTInductor compile of the 1-token step, once per model shape x weight
  format x machine (skipped when the package is already in qkv's cache: ``--rebuild`` forces);
- ``fresh process``: ``--processes`` new Python processes each import qkv, load SmolLM2 and
  its saved step and decode 8 tokens; reported: the saved step's load (p50), the wall time
  from the start to the first new token, and whether dynamo or inductor was imported at all;
- decoding, 32-token prompt + ``--new-tokens`` greedy, tokens/s after the first: eager, the
  saved step (``QKV_NATIVE_STEP=off``) and the native step, ``--rounds`` rounds with the order
  alternated, and llama.cpp's ``llama-bench
  -t <threads> -p 32 -n 128`` in the middle of every round, both its portable build and its
  ``GGML_NATIVE=ON`` build where the CPU allows (``--build-llama-cpp`` builds what is missing:
  ~10 minutes each, once); qkv is compared with the faster of the two; ratios per round,
  medians reported;
- agreement: the saved and the native step's top-1 next token against eager's over
  ``--positions`` positions of a text fed token by token (teacher forcing);
- ``--against PATH``: another checkout of qkv (``git worktree add /tmp/before <commit>``) decodes
  through its default decoder (its native step where it has one, else its saved step; the saved
  step is built first if missing, its build timed) in a child process that runs that checkout's
  code, timed in the same rounds, so the two revisions are compared on one machine at one time
  (results before 2026-12-06 10:55 UTC call it "qkv saved step at NAME" whatever it ran).

    python benchmarks/saved_step.py                        # q4, the default weights
    python benchmarks/saved_step.py --weights fp32 --rounds 3
    python benchmarks/saved_step.py --against /tmp/before   # this revision against another
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _common import DECODE_TEXT as TEXT  # noqa: E402

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch, qkv
from qkv.generation import aot, generate
lm = qkv.load("smollm2", weights=sys.argv[1])
t1 = time.perf_counter()
step = aot.load(lm.model)
t2 = time.perf_counter()
x = torch.tensor([lm.tokenizer.encode("Once upon a time")])
out = []
for t in generate(lm.model, x, 8, temperature=0.0):
    out.append(int(t[0]))
    if len(out) == 1:
        t3 = time.perf_counter()
print(json.dumps({"import_and_load_model_s": t1 - t0, "step_load_s": t2 - t1, "first_token_s": t3 - t0,
                  "found": step is not None, "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor" in sys.modules, "tokens": out}))
"""

# The other revision's decoder (--against): loads SmolLM2 (and builds its saved step if missing)
# once, then decodes through its default decoder; for each
# line "N" on stdin decodes 1 and N tokens greedily and prints the times and the tokens.
AGAINST = """
import json, sys, time
import torch, qkv
from qkv.generation import aot, generate
lm = qkv.load("smollm2", weights=sys.argv[1])
t = time.perf_counter()
built = aot.load(lm.model) is None
if built:
    aot.build(lm.model)
build_s = time.perf_counter() - t if built else None
assert aot.load(lm.model) is not None
x = torch.tensor([lm.tokenizer.encode(sys.argv[2])[:32]])
print(json.dumps({"ready": True, "build_s": build_s}), flush=True)
for line in sys.stdin:
    n = int(line)
    t = time.perf_counter()
    list(generate(lm.model, x, 1, temperature=0.0))
    first = time.perf_counter() - t
    t = time.perf_counter()
    toks = [int(t[0]) for t in generate(lm.model, x, n, temperature=0.0)]
    print(json.dumps({"first_s": first, "total_s": time.perf_counter() - t, "tokens": toks}), flush=True)
"""


class Against:
    """The other revision's saved step in a child process (see ``AGAINST``), a contender whose
    rate is measured as this process measures its own: (n - 1) tokens / (time of n - time of 1)."""

    def __init__(self, path: str, weights: str) -> None:
        import os

        env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
        self.proc = subprocess.Popen([sys.executable, "-c", AGAINST, weights, TEXT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=path)
        self.build_s = json.loads(self._line())["build_s"]
        self.tokens: list[int] = []

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the --against process ended (exit {self.proc.wait()})")
        return line

    def rate(self, n: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        r = json.loads(self._line())
        self.tokens = r["tokens"]
        return (n - 1) / max(r["total_s"] - r["first_s"], 1e-9)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="q4", choices=("q4", "int8", "bf16", "fp32"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--processes", type=int, default=5, help="fresh processes timed loading the step")
    p.add_argument("--positions", type=int, default=300, help="positions of the top-1 agreement check")
    p.add_argument("--rebuild", action="store_true", help="build the step even if it is saved")
    p.add_argument("--build-llama-cpp", action="store_true", help="build llama-bench if it is not built")
    p.add_argument("--against", default=None, metavar="PATH",
                   help="another checkout of qkv, its default decoder timed in the same rounds")
    p.add_argument("--out", default=None,
                   help="results JSON (default benchmarks/results/saved_step_<weights>.json)")
    args = p.parse_args()

    import torch

    import qkv
    from qkv.generation import aot, generate

    machine = C.machine_info()
    print(C.machine_line(machine))
    lm = qkv.load("smollm2", weights=args.weights)
    m = lm.model
    build_s = None
    if args.rebuild or aot.load(m) is None:
        if args.rebuild:
            key, _ = aot.step_key(m, aot.cache_len_for(m))
            import shutil

            shutil.rmtree(aot.folder() / key, ignore_errors=True)
        t = time.perf_counter()
        aot.build(m)
        build_s = time.perf_counter() - t
        print(f"built the saved step in {build_s:.0f} s", flush=True)
    step = aot.load(m)
    assert step is not None

    fresh = []
    for _ in range(args.processes):
        r = subprocess.run([sys.executable, "-c", CHILD, args.weights], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        fresh.append(json.loads(r.stdout.splitlines()[-1]))
    print(f"fresh process: saved step loaded in {C.median([f['step_load_s'] for f in fresh]) * 1000:.0f} ms "
          f"(p50), first token {C.median([f['first_token_s'] for f in fresh]):.2f} s after start; dynamo "
          f"imported: {any(f['dynamo'] for f in fresh)}, inductor: {any(f['inductor'] for f in fresh)}",
          flush=True)

    # top-1 agreement, teacher-forced on the eager model's own continuation of a text
    ids = lm.tokenizer.encode(TEXT * 8)[: args.positions + 2]
    agree = 0
    with torch.inference_mode():
        c_e, c_s = m.make_cache(1, step.cache_len), step.make_cache(1)
        m(torch.tensor([ids[:2]]), cache=c_e)
        m(torch.tensor([ids[:2]]), cache=c_s)
        for t in ids[2:]:
            tok = torch.tensor([[t]])
            a = m(tok, cache=c_e, last_only=True).logits[0, -1]
            b = step.step(tok, c_s)[0, -1]
            agree += int(a.argmax() == b.argmax())
    n_pos = len(ids) - 2
    print(f"top-1 agreement with eager: {agree}/{n_pos}", flush=True)

    x = torch.tensor([lm.tokenizer.encode(TEXT)[:32]])
    n_new = args.new_tokens

    import os

    from qkv.generation import native_step

    def run(mode, native=True):
        def go(n: int) -> list[int]:
            os.environ["QKV_NATIVE_STEP"] = "on" if native else "off"
            try:
                said: list = []
                out = [int(t[0]) for t in generate(m, x, n, temperature=0.0, mode=mode,
                                                   on_decision=said.append)]
            finally:
                os.environ.pop("QKV_NATIVE_STEP", None)
            assert said[0].kind == {"eager": "eager", "auto": "native" if native else "saved"}[mode], said[0]
            return out
        return go

    contenders = {"qkv eager": run("eager"), "qkv saved step": run("auto", native=False)}
    why_not = native_step.unsupported(m)
    if why_not is None:
        contenders["qkv native step"] = run("auto")
        # its top-1 agreement with eager, teacher-forced as above
        ns = native_step.NativeStep(m, len(ids) + 1)
        agree_native = 0
        with torch.inference_mode():
            c_e, c_n = m.make_cache(1, len(ids) + 1), ns.make_cache(1)
            m(torch.tensor([ids[:2]]), cache=c_e)
            m(torch.tensor([ids[:2]]), cache=c_n)
            for t in ids[2:]:
                tok = torch.tensor([[t]])
                a = m(tok, cache=c_e, last_only=True).logits[0, -1]
                agree_native += int(a.argmax() == ns.step(tok, c_n)[0, -1].argmax())
        print(f"native step top-1 agreement with eager: {agree_native}/{n_pos}", flush=True)
    else:
        agree_native = None
        print(f"no native step for this model: {why_not}", flush=True)
    from _llama_cpp import llama_bench, run_llama_bench

    from qkv.assets import asset_path

    args.threads = torch.get_num_threads()
    peers = {}  # llama.cpp's portable build and, where the CPU allows, its native build
    for name, native in (("llama.cpp portable", False), ("llama.cpp native", True)):
        binary, how = llama_bench(build=args.build_llama_cpp, native=native)
        print(f"{name}: {how}", flush=True)
        if binary is not None:
            peers[name] = (lambda b=binary: run_llama_bench(b, asset_path("smollm2"), threads=args.threads,
                                                            prompt=32, new=n_new, reps=1))
    tokens = {k: f(n_new) for k, f in contenders.items()}
    against = Against(args.against, args.weights) if args.against else None
    other = f"qkv at {Path(args.against).name}" if args.against else ""
    if against is not None:
        built = f" (built in {against.build_s:.0f} s)" if against.build_s else ""
        print(f"{other}: loaded{built}", flush=True)
    rates: dict[str, list[float]] = {k: [] for k in [*contenders, *peers, *([other] if other else [])]}
    meter = C.LoadMeter()
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for i, k in enumerate(order):
            if i == 1:  # mid-round: the peers and the other revision under the same conditions
                for name, peer in peers.items():
                    rates[name].append(peer()["decode"]["tokens_per_s"])
                if against is not None:
                    rates[other].append(against.rate(n_new))
            t = time.perf_counter()
            contenders[k](1)
            first = time.perf_counter() - t
            t = time.perf_counter()
            contenders[k](n_new)
            rates[k].append((n_new - 1) / max(time.perf_counter() - t - first, 1e-9))
        line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
        print(f"round {r + 1}: {line} tok/s", flush=True)
    load = meter.stop()
    if against is not None:
        against.close()
    rows = [[k, f"{C.median(v):.1f}", " ".join(f"{x:.1f}" for x in v)] for k, v in rates.items()]
    summary = {k: round(C.median(v), 1) for k, v in rates.items()}
    vs = {"saved_vs_eager": [s / e for s, e in zip(rates["qkv saved step"], rates["qkv eager"], strict=True)]}
    llama_rates: list[float] = []
    best = None
    if peers:  # against the faster of llama.cpp's builds (by median)
        best = max(peers, key=lambda n: C.median(rates[n]))
        llama_rates = rates[best]
        print(f"the faster llama.cpp: {best}")
        short = {"qkv eager": "eager", "qkv saved step": "saved", "qkv native step": "native"}
        for k in contenders:
            vs[f"{short[k]}_vs_llama_cpp"] = [s / q for s, q in zip(rates[k], llama_rates, strict=True)]
        if "llama.cpp portable" in peers:
            for k in contenders:
                vs[f"{short[k]}_vs_llama_cpp_portable"] = [
                    s / q for s, q in zip(rates[k], rates["llama.cpp portable"], strict=True)]
    if "qkv native step" in rates:
        vs["native_vs_saved"] = [s / q for s, q in zip(rates["qkv native step"], rates["qkv saved step"],
                                                       strict=True)]
    if other:
        best_ours = "qkv native step" if "qkv native step" in rates else "qkv saved step"
        vs["default_vs_against"] = [s / q for s, q in zip(rates[best_ours], rates[other], strict=True)]
    C.print_table(f"SmolLM2 {args.weights}, decoding tok/s ({C.load_line(load)})",
                  ["contender", "median", "rounds"], rows)
    for k, v in vs.items():
        print(f"{k}: median {C.median(v):.2f} (rounds {min(v):.2f}-{max(v):.2f})")
    out = C.write_json(f"saved_step_{args.weights}", {
        "machine": machine, "load": load, "weights": args.weights, "threads": args.threads,
        "build_s": round(build_s, 1) if build_s is not None else None, "package": str(step.path),
        "fresh_processes": fresh, "top1_agreement": [agree, n_pos],
        "native_top1_agreement": None if agree_native is None else [agree_native, n_pos],
        "same_greedy_tokens": tokens["qkv saved step"] == tokens["qkv eager"],
        "native_same_greedy_tokens": tokens.get("qkv native step") == tokens["qkv eager"],
        "against": None if against is None else {
            "path": args.against, "build_s": against.build_s,
            "same_greedy_tokens": against.tokens == tokens["qkv saved step"]},
        "decode_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "llama_cpp": {"builds": list(peers), "faster": best,
                      "decode_tokens_per_s": [round(x, 1) for x in llama_rates]},
        "summary": summary, "ratios": {k: {"median": round(C.median(v), 3), "min": round(min(v), 3),
                                           "max": round(max(v), 3)} for k, v in vs.items()}}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
