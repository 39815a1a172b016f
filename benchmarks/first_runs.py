"""`qkv generate` on a machine that has no saved step yet: the first runs, one after the other, as
a student tries prompts. Is any of them slower than qkv's eager default before issue 27?

Three sequences, one after the other (never two at once), each in a fresh qkv cache folder
(SmolLM2's converted weights copied in when this machine has them, so every sequence starts from
the same load time; no kernels, no saved steps):

- **before**: ``QKV_SAVED_STEP=off QKV_INT4_KERNEL=off``: eager on PyTorch's kernels, as before;
- **default**: nothing set: the first run compiles qkv's kernels (~5 s, once per machine) while
  the model loads and waits for what is left, decodes eagerly, and starts the saved step's build
  in the background for later runs; later runs pause that build while they decode and load the
  step once it exists;
- **prepared**: the same after ``qkv assets install smollm2``, which builds the kernels (timed
  on its own).

Each sequence: ``--runs`` runs of ``qkv generate smollm2`` (32-token prompt, 128 new tokens,
greedy) with ``--gap`` idle seconds between them. Reported per run: wall seconds of the whole
command, decoding tok/s and how it decoded (eager or the saved step), from its closing line.
After the runs of the default sequences the machine is left idle until the background build
has finished (at most ``--wait`` s), and one more run shows what later runs get. Background
builds left running are killed before the next sequence.

    python benchmarks/first_runs.py            # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
from serve_first_run import fresh_cache  # noqa: E402

from qkv.generation import aot  # noqa: E402

NAME = "first_runs"
PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
          "every morning walked down to the harbour and")
STATS = re.compile(r"\[(\d+) tokens in ([\d.]+) s after a (\d+)-token prompt, ([\d.]+) tok/s, (.*)\]$")


def kill_builds(cache: Path) -> int:
    """Kill the background builds recorded in ``cache`` (their process groups)."""
    live = aot._live_builds(cache / "steps")
    for pid, _ in live:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    return len(live)


def generate(env: dict[str, str]) -> dict:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qkv", "generate", "smollm2", "--prompt", PROMPT,
                        "--max-new-tokens", "128"], env=env, capture_output=True, text=True, timeout=600)
    wall = round(time.perf_counter() - t, 2)
    if r.returncode != 0:
        raise RuntimeError(f"qkv generate failed: {r.stderr.strip()[-500:]}")
    m = STATS.search(r.stderr.strip().splitlines()[-1])
    if m is None:
        raise RuntimeError(f"no closing stats line in: {r.stderr.strip()[-500:]}")
    how = m.group(5)
    return {"wall_s": wall, "tok_s": float(m.group(4)), "saved_step": how.startswith("KV cache, saved step"),
            "how": how[:160]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--gap", type=float, default=3.0, help="idle seconds between runs")
    ap.add_argument("--wait", type=float, default=300.0,
                    help="most idle seconds to wait for the background build after the runs")
    ap.add_argument("--quick", action="store_true", help="3 runs 2 s apart (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.runs, args.gap = 3, 2.0
        args.out = args.out or str(HERE.parent / "results" / f"{NAME}_quick.json")
    if not C.have_assets(NAME, ("smollm2",)):
        return 1
    machine = C.machine_info()
    print(C.machine_line(machine))
    result: dict = {"machine": machine, "runs": args.runs, "gap_s": args.gap, "new_tokens": 128}
    sequences = (("before", {"QKV_SAVED_STEP": "off", "QKV_INT4_KERNEL": "off"}, False),
                 ("default", {}, False), ("prepared", {}, True))
    with tempfile.TemporaryDirectory(prefix="qkv-first-runs-") as tmp:
        for name, extra, prepare in sequences:
            cache = fresh_cache(Path(tmp), name)
            env = {k: v for k, v in os.environ.items() if k not in ("QKV_SAVED_STEP", "QKV_INT4_KERNEL",
                                                                    "QKV_SAVED_STEP_BACKGROUND")}
            env.update(QKV_CACHE_DIR=str(cache), **extra)
            seq: dict = {"runs": []}
            try:
                if prepare:
                    t = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "qkv", "assets", "install", "smollm2"], env=env,
                                   check=True, capture_output=True, timeout=600)
                    seq["prepare_s"] = round(time.perf_counter() - t, 2)
                    print(f"{name}: qkv assets install smollm2 (builds the kernels): {seq['prepare_s']} s")
                for i in range(args.runs):
                    run = generate(env)
                    seq["runs"].append(run)
                    print(f"{name} run {i + 1}: {run['wall_s']:.2f} s, {run['tok_s']:.1f} tok/s, "
                          f"{run['how']}", flush=True)
                    time.sleep(args.gap)
                if name != "before":  # then idle until the build is done, and once more
                    t = time.monotonic()
                    while aot._live_builds(cache / "steps") and time.monotonic() - t < args.wait:
                        time.sleep(1)
                    seq["idle_wait_s"] = round(time.monotonic() - t, 1)
                    seq["after"] = generate(env)
                    print(f"{name}, after {seq['idle_wait_s']} s idle: {seq['after']['wall_s']:.2f} s, "
                          f"{seq['after']['tok_s']:.1f} tok/s, {seq['after']['how']}", flush=True)
            finally:
                seq["builds_killed"] = kill_builds(cache)
            result[name] = seq
    before = result["before"]["runs"]
    rows, summary = [], {}
    for name, *_ in sequences:
        runs = result[name]["runs"]
        ratio = C.median([r["tok_s"] / b["tok_s"] for r, b in zip(runs, before, strict=True)])
        worst = min(r["tok_s"] / b["tok_s"] for r, b in zip(runs, before, strict=True))
        summary[name] = {"first_wall_s": runs[0]["wall_s"],
                         "median_wall_s": C.median([r["wall_s"] for r in runs]),
                         "tok_s": [r["tok_s"] for r in runs], "over_before_median": round(ratio, 2),
                         "over_before_worst": round(worst, 2),
                         "saved_step_runs": sum(r["saved_step"] for r in runs)}
        after, idle = result[name].get("after"), result[name].get("idle_wait_s")
        once = "-" if after is None else (f"{after['tok_s']:.0f} after {idle:.0f} s "
                                          f"({'saved step' if after['saved_step'] else 'eager'})")
        rows.append([name, f"{runs[0]['wall_s']:.2f}", " ".join(f"{r['tok_s']:.0f}" for r in runs),
                     f"{ratio:.2f} ({worst:.2f})", str(summary[name]["saved_step_runs"]), once])
    result["summary"] = summary
    C.print_table(f"qkv generate smollm2, {args.runs} runs {args.gap:g} s apart from a fresh cache "
                  f"(128 new tokens)", ["sequence", "first run, s", "tok/s per run",
                                        "/ before, median (worst)", "runs on the saved step",
                                        "tok/s once idle"], rows)
    out = C.write_json(NAME, result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
