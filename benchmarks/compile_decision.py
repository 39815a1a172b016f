"""Does `--compile auto` hold up where batches change shape? The case a new user met (issue 25):
`qkv train seq2seq --preset copy-cpu --task copy --arch rnn`, whose batches are trimmed to their
longest row, so every new target length recompiles the unrolled RNN decoder.

Each mode trains the same run in a fresh process with a fresh cache folder (no probe answers,
no compiled kernels from earlier runs): ``off`` (``--compile false``), ``auto`` (the default:
the probe decides, and the compile meter stops compiling once recompiles cost more than
compiling can still save) and, with ``--with-on``, ``on`` (``--compile true``, paid whatever it
costs). Reported: wall time of the whole command, the steps trained, and what the run printed
about compiling; the runs' own config.json "chosen" records are kept in the JSON.

    python benchmarks/compile_decision.py                  # off, auto: ~25 minutes on 2 cores
    python benchmarks/compile_decision.py --max-iters 300 --with-on
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))


def run_mode(mode: str, max_iters: int | None, root: Path) -> dict:
    """One fresh `qkv train seq2seq` process; its wall time, its speed lines and its record."""
    out_dir = root / f"run-{mode}"
    argv = [sys.executable, "-m", "qkv", "train", "seq2seq", "--preset", "copy-cpu", "--task", "copy",
            "--arch", "rnn", "--out_dir", str(out_dir), "--no-progress"]
    if mode != "auto":
        argv += ["--compile", "true" if mode == "on" else "false"]
    if max_iters:
        argv += ["--max_iters", str(max_iters)]
    env = {**os.environ, "QKV_CACHE_DIR": str(root / f"cache-{mode}"),
           "TORCHINDUCTOR_CACHE_DIR": str(root / f"inductor-{mode}")}  # cold compiles, as a new user
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines()
            if "compil" in ln.lower() or ln.startswith(("speed:", "using:"))]
    cfg = json.loads((out_dir / "config.json").read_text())
    ev = json.loads((out_dir / "eval.json").read_text())
    return {"mode": mode, "seconds": seconds, "steps": ev["steps"], "train_seconds": ev["train_seconds"],
            "test_exact": ev["test"]["exact"], "said": said, "chosen": cfg.get("chosen")}


def main() -> None:
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--max-iters", type=int, default=None, help="steps (default: the preset's 1,200)")
    p.add_argument("--with-on", action="store_true", help="also --compile true (long: every length compiles)")
    p.add_argument("--json", default=None, help="results file (default benchmarks/results/)")
    args = p.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("off", "auto", *(["on"] if args.with_on else [])):
            r = run_mode(mode, args.max_iters, Path(tmp))
            results.append(r)
            print(f"{mode}: {r['seconds']:.0f} s for {r['steps']} steps (training "
                  f"{r['train_seconds']:.0f} s), test exact {r['test_exact']:.1%}", flush=True)
            for line in r["said"]:
                print(f"    {line}", flush=True)
    load = meter.stop()
    off = results[0]["seconds"]
    C.print_table("qkv train seq2seq --preset copy-cpu --task copy --arch rnn, fresh caches",
                  ["mode", "wall s", "steps", "vs --compile false"],
                  [[r["mode"], f"{r['seconds']:.0f}", str(r["steps"]), f"{r['seconds'] / off:.2f}x"]
                   for r in results])
    print(C.load_line(load))
    C.write_json("compile_decision", {"machine": machine, "load": load, "max_iters": args.max_iters,
                                      "results": results}, args.json)


if __name__ == "__main__":
    main()
