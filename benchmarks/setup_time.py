"""What set-up costs on this machine: `qkv prepare smollm2 --batch-rows 8 --max-tokens 256` (what
`qkv assets install smollm2` runs after the weights: SmolLM2's conversion, qkv's kernels and its
saved decoding steps where the native step does not decode it: since the native step takes a
running batch's rows too, none for SmolLM2 q4) in an empty qkv cache (`QKV_CACHE_DIR`: nothing
converted, compiled or cached by an earlier run), the wall time and each step's build as the
command reports it; with ``--against PATH``, another checkout of qkv the same way, one after the
other (each alone).

    python benchmarks/setup_time.py                          # ~1.5 minutes on 2 cores
    python benchmarks/setup_time.py --against /tmp/before    # and another revision's
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

NAME = "setup_time"
COMMAND = ["prepare", "smollm2", "--batch-rows", "8", "--max-tokens", "256"]


def prepare(checkout: Path) -> dict:
    """`qkv prepare` of ``checkout``'s code in an empty cache: wall seconds and the builds."""
    with tempfile.TemporaryDirectory(prefix="qkv-setup-") as tmp:
        env = {**os.environ, "QKV_CACHE_DIR": tmp, "PYTHONPATH": str(checkout)}
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "qkv", *COMMAND], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t
    built = re.finditer(r"saved step for (.+?): built in (\d+) s", r.stderr)
    builds = {m.group(1): float(m.group(2)) for m in built}
    loaded = re.search(r"loaded in ([\d.]+) s", r.stderr)
    return {"checkout": str(checkout), "exit": r.returncode, "wall_s": round(wall, 1),
            "load_s": float(loaded.group(1)) if loaded else None, "builds_s": builds,
            "nothing_to_build": "ready: nothing to build" in r.stderr, "printed": r.stderr[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default=None, metavar="PATH",
                    help="another checkout of qkv, timed the same way")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    runs = {"this checkout": prepare(C.REPO_DIR)}
    if args.against:
        runs[f"at {Path(args.against).name}"] = prepare(Path(args.against).resolve())
    rows = []
    for k, r in runs.items():
        if r["exit"]:
            raise SystemExit(f"{k}: qkv prepare failed:\n{r['printed']}")
        if not r["builds_s"] and not r["nothing_to_build"]:  # read from what the command prints
            raise SystemExit(f"{k}: expected 'saved step for ...: built in N s' or 'nothing to build' "
                             f"lines:\n{r['printed']}")
        rows.append([k, f"{r['wall_s']:.0f}", f"{r['load_s']:.0f}",
                     "; ".join(f"{name}: {v:.0f}" for name, v in r["builds_s"].items()) or "none to build"])
    C.print_table("qkv " + " ".join(COMMAND) + ", an empty qkv cache", ["code", "wall s", "load s",
                                                                       "saved steps built, s"], rows)
    payload = {"machine": machine, "command": "qkv " + " ".join(COMMAND), "runs": runs}
    out = C.write_json(NAME, payload, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
