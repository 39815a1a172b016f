"""What a user waits, once, and what every decoding process then runs at, beside llama.cpp.

The documented set-up of the bundled decoder is ``qkv assets install smollm2``: it installs the
weights, compiles qkv's decoding kernels for this CPU and prepares the model (``qkv prepare
smollm2``: saved decoding steps where the native step does not decode it; for SmolLM2 q4, none:
one request and ``qkv serve``'s running batch decode through the native step). This script
measures, in a fresh qkv cache folder:

- **set-up**: the seconds ``qkv assets install smollm2`` takes there (the GGUF converted, the
  kernels compiled), once;
- **before set-up** (a second fresh cache, nothing prepared: the kernels compile on first use):
  one Python process and one ``qkv generate``, and llama.cpp's portable build beside them;
- then ``--rounds`` rounds, each of fresh processes one after the other, never two at once: the
  default Python API (``qkv.load("smollm2").stream(prompt, 128)``, nothing else asked), ``qkv
  generate smollm2`` (greedy, 128 new tokens), and llama.cpp's ``llama-bench -t 2`` on the same
  GGUF (the faster of its portable and native builds, ``--build-llama-cpp`` builds them once):
  the first round's processes are the first after set-up.

Reported per process: decoding tok/s after the first token (what llama-bench's tg reports;
the overall rate, prefill included, is kept too) and which decoder ran (the stream's typed
decision), and each qkv rate over llama.cpp's in the same round.

    python benchmarks/first_runs.py                    # ~5 minutes on 2 cores (set-up included)
    python benchmarks/first_runs.py --build-llama-cpp  # also builds llama.cpp (~20 minutes, once)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
import _llama_cpp as L  # noqa: E402

NAME = "first_runs"
PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
          "every morning walked down to the harbour and")
NEW = 128
STATS = re.compile(r"\[(\d+) tokens in ([\d.]+) s after a (\d+)-token prompt, ([\d.]+) tok/s, "
                   r"([\d.]+) after the first, (.*)\]$")
PYTHON = f"""
import json, time
t0 = time.perf_counter()
import qkv
lm = qkv.load("smollm2")
text = "".join(lm.stream({PROMPT!r}, {NEW}))
st = lm.last_stats
print(json.dumps({{"tok_s": round(st.decode_tokens_per_s, 1), "overall_tok_s": round(st.tokens_per_s, 1),
                  "first_token_s": round(st.first_token_s, 3), "tokens": st.new_tokens,
                  "kind": st.decision.kind,
                  "says": st.decision.says(), "wall_s": round(time.perf_counter() - t0, 2)}}))
"""


def python_api(env: dict[str, str]) -> dict:
    r = subprocess.run([sys.executable, "-c", PYTHON], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"the Python process failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def qkv_generate(env: dict[str, str]) -> dict:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qkv", "generate", "smollm2", "--prompt", PROMPT,
                        "--max-new-tokens", str(NEW), "--temperature", "0"], env=env, capture_output=True,
                       text=True, timeout=600)
    wall = round(time.perf_counter() - t, 2)
    if r.returncode != 0:
        raise RuntimeError(f"qkv generate failed: {r.stderr.strip()[-500:]}")
    m = STATS.search(r.stderr.strip().splitlines()[-1])
    if m is None:
        raise RuntimeError(f"no closing stats line in: {r.stderr.strip()[-500:]}")
    how = m.group(6)
    return {"wall_s": wall, "tok_s": float(m.group(5)), "overall_tok_s": float(m.group(4)),
            "kind": "native" if "native step" in how else "saved" if "saved step" in how else "eager",
            "says": how[:200]}


def fresh_cache(root: Path, name: str, converted: bool) -> Path:
    """``root/name`` as an empty qkv cache; ``converted``: with this machine's converted weights
    (so that load times are alike), else truly empty (the set-up converts too)."""
    from qkv.paths import cache_root

    cache = root / name
    cache.mkdir()
    mine = cache_root()
    if converted and mine is not None and (mine / "converted").is_dir():
        shutil.copytree(mine / "converted", cache / "converted")
    return cache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp if it is not built")
    ap.add_argument("--quick", action="store_true", help="one round (the set-up still takes minutes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
        args.out = args.out or str(HERE.parent / "results" / f"{NAME}_quick.json")
    if not C.have_assets(NAME, ("smollm2",)):
        return 1
    from qkv.assets import asset_path

    gguf = Path(asset_path("smollm2"))
    gguf = gguf if gguf.is_file() else next(gguf.rglob("*.gguf"))
    machine = C.machine_info()
    print(C.machine_line(machine))
    llamas, portable = [], None
    for native in (False, True):
        binary, how = L.llama_tool("llama-bench", build=args.build_llama_cpp, native=native)
        print(f"llama-bench ({'native' if native else 'portable'}): {how}")
        if binary is not None:
            llamas.append(binary)
            portable = binary if not native else portable
    result: dict = {"machine": machine, "new_tokens": NEW, "rounds": [],
                    "llama_bench": [str(b) for b in llamas]}
    base = {k: v for k, v in os.environ.items() if k not in ("QKV_SAVED_STEP", "QKV_INT4_KERNEL")}
    with tempfile.TemporaryDirectory(prefix="qkv-first-runs-") as tmp:
        env = {**base, "QKV_CACHE_DIR": str(fresh_cache(Path(tmp), "set-up", converted=False))}
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "qkv", "assets", "install", "smollm2"], env=env,
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"the set-up failed: {r.stdout[-500:]} {r.stderr[-500:]}")
        setup = round(time.perf_counter() - t, 1)
        result["setup_s"], result["setup_says"] = setup, r.stdout.strip().splitlines()[-8:]
        print(f"set-up: qkv assets install smollm2 in a fresh cache: {setup} s")
        for line in result["setup_says"]:
            print(f"  {line}")
        unprepared = {**base, "QKV_CACHE_DIR": str(fresh_cache(Path(tmp), "none", converted=True))}
        result["before_setup"] = {"python": python_api(unprepared), "generate": qkv_generate(unprepared)}
        b = result["before_setup"]
        if portable is not None:  # what a first process is held to
            b["llama_cpp_portable"] = L.run_llama_bench(portable, gguf, prompt=32, new=NEW,
                                                        reps=2)["decode"]["tokens_per_s"]
            for k in ("python", "generate"):
                b[f"{k}_over_portable"] = round(b[k]["tok_s"] / b["llama_cpp_portable"], 2)
        print(f"before set-up: Python {b['python']['tok_s']} tok/s, qkv generate "
              f"{b['generate']['tok_s']} tok/s ({b['generate']['says']}); llama.cpp portable "
              f"{b.get('llama_cpp_portable', '-')} tok/s")
        for i in range(args.rounds):
            rd: dict = {"python": python_api(env), "generate": qkv_generate(env)}
            if llamas:
                runs = [L.run_llama_bench(b, gguf, prompt=32, new=NEW, reps=2)["decode"]["tokens_per_s"]
                        for b in llamas]
                rd["llama_cpp"] = max(runs)
                rd["python_over_llama"] = round(rd["python"]["tok_s"] / rd["llama_cpp"], 2)
                rd["generate_over_llama"] = round(rd["generate"]["tok_s"] / rd["llama_cpp"], 2)
            result["rounds"].append(rd)
            print(f"round {i + 1}: Python {rd['python']['tok_s']} tok/s ({rd['python']['kind']}), "
                  f"qkv generate {rd['generate']['tok_s']} tok/s ({rd['generate']['kind']}), llama.cpp "
                  f"{rd.get('llama_cpp', '-')} tok/s", flush=True)
    rounds = result["rounds"]
    rows = [[str(i + 1), f"{rd['python']['tok_s']:.1f} ({rd['python']['kind']})",
             f"{rd['generate']['tok_s']:.1f} ({rd['generate']['kind']})", f"{rd.get('llama_cpp', '-')}",
             f"{rd.get('python_over_llama', '-')}x", f"{rd.get('generate_over_llama', '-')}x"]
            for i, rd in enumerate(rounds)]
    b = result["before_setup"]
    rows.insert(0, ["before set-up", f"{b['python']['tok_s']:.1f} ({b['python']['kind']})",
                    f"{b['generate']['tok_s']:.1f} ({b['generate']['kind']})",
                    f"{b.get('llama_cpp_portable', '-')} (portable)",
                    f"{b.get('python_over_portable', '-')}x", f"{b.get('generate_over_portable', '-')}x"])
    if llamas:
        result["summary"] = {
            "setup_s": setup,
            "first_python_over_llama": rounds[0]["python_over_llama"],
            "python_over_llama_median": C.median([rd["python_over_llama"] for rd in rounds]),
            "python_over_llama_min": min(rd["python_over_llama"] for rd in rounds),
            "generate_over_llama_median": C.median([rd["generate_over_llama"] for rd in rounds]),
            "generate_over_llama_min": min(rd["generate_over_llama"] for rd in rounds),
            "kinds": sorted({rd[k]["kind"] for rd in rounds for k in ("python", "generate")})}
    C.print_table(f"decoding SmolLM2 ({NEW} new tokens) in fresh processes after `qkv assets install "
                  f"smollm2` ({setup:.0f} s, once)",
                  ["round", "Python API tok/s", "qkv generate tok/s", "llama.cpp tok/s", "Python / llama.cpp",
                   "generate / llama.cpp"], rows)
    out = C.write_json(NAME, result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
