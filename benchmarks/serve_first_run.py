"""`qkv serve` on a machine that has no saved steps yet: is it ever slower than the eager server
while it builds them, and how fast once they are built?

Two servers on SmolLM2, one after the other (never both at once), each in a fresh qkv cache
folder (SmolLM2's converted weights are copied in when this machine has them, so both start from
the same load time; the saved steps are not):

- **eager**: ``QKV_SAVED_STEP=off QKV_INT4_KERNEL=off``, the server as it decoded before issue 27;
- **default**: saved steps on, background builds on: the server builds its steps while idle and
  stops the build when a request arrives (``qkv/serve/api.py``, ``aot.stop_background_builds``);
  qkv's own 4-bit kernels are compiled when the model loads (``qkv.kernels.prepare``), so its
  first request pays for that.

Each gets ``--requests`` requests (64 new tokens, greedy, one layer's attention rows, as the
page asks) spaced ``--gap`` seconds apart (idle gaps in which the default server builds); then
the default server is left idle until its steps exist (at most ``--wait`` s) and asked
``--requests`` more. Reported: seconds per request (the first includes loading the model, so
the medians leave it out), the default's while-building median over the eager median (the goal:
not slower, ≤ 1.1), and after-built over eager.

    python benchmarks/serve_first_run.py            # ~4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
from serve_batch import Server, free_port, post  # noqa: E402

from qkv.paths import cache_root  # noqa: E402

NAME = "serve_first_run"
BODY = {
    "model": "smollm2",
    "prompt": "Once upon a time, in a small village by the sea,",
    "max_new_tokens": 64,
    "layer": -1,
    "head": None,
}


class FirstRunServer(Server):
    """``qkv serve`` in its own cache folder, its stderr (what it says of its builds) in a log."""

    def __init__(self, cache: Path, runs: Path, saved_steps: bool) -> None:
        port = free_port()
        env = {
            **os.environ,
            "QKV_CACHE_DIR": str(cache),
            "QKV_SAVED_STEP": "on" if saved_steps else "off",
            "QKV_SAVED_STEP_BACKGROUND": "on",
            # the eager server as before issue 27: PyTorch's 4-bit kernels too (the default
            # compiles qkv's own, once per machine, when it loads the model)
            "QKV_INT4_KERNEL": "on" if saved_steps else "off",
        }
        self.log = cache / "serve.log"
        argv = [sys.executable, "-m", "qkv", "serve", "--port", str(port), "--runs", str(runs)]
        super().__init__("qkv serve", argv, "/api/models", port, env, stderr=self.log.open("w"))

    def ask(self) -> float:
        t = time.perf_counter()
        events = [
            json.loads(x) for x in post(f"http://127.0.0.1:{self.port}/api/generate", BODY).splitlines()
        ]
        if events[-1]["event"] != "done":
            raise RuntimeError(f"the server said {events[-1]}")
        return round(time.perf_counter() - t, 3)

def fresh_cache(root: Path, name: str) -> Path:
    cache = root / name
    cache.mkdir()
    mine = cache_root()  # this machine's qkv cache: its converted weights, if any
    if mine is not None and (mine / "converted").is_dir():
        shutil.copytree(mine / "converted", cache / "converted")
    return cache


def packages(cache: Path) -> int:
    steps = cache / "steps"
    return (
        sum(1 for p in steps.iterdir() if p.is_dir() and not p.name.startswith(".")) if steps.is_dir() else 0
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--gap", type=float, default=5.0, help="idle seconds between requests")
    ap.add_argument("--wait", type=float, default=400.0, help="most seconds to wait for the steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not C.have_assets(NAME, ("smollm2",)):  # qkv and llama.cpp only: no reference packages
        return 1
    machine = C.machine_info()
    print(C.machine_line(machine))
    result: dict = {"machine": machine, "requests": args.requests, "gap_s": args.gap, "new_tokens": 64}
    with tempfile.TemporaryDirectory(prefix="qkv-first-run-") as tmp:
        root = Path(tmp)
        runs = root / "runs"
        runs.mkdir()
        for name, saved in (("eager", False), ("default", True)):
            cache = fresh_cache(root, name)
            server = FirstRunServer(cache, runs, saved)
            try:
                during = []
                for _ in range(args.requests):
                    during.append(server.ask())
                    print(
                        f"{name}: {during[-1]:.2f} s (packages built so far: {packages(cache)})", flush=True
                    )
                    time.sleep(args.gap)
                result[name] = {"seconds": during, "packages_after": packages(cache)}
                if saved:
                    t0 = time.monotonic()
                    while packages(cache) < 2 and time.monotonic() - t0 < args.wait:
                        time.sleep(2)
                    waited = round(time.monotonic() - t0, 1)
                    time.sleep(1)
                    after = [server.ask() for _ in range(args.requests)]
                    print(f"{name}, after {waited} s idle ({packages(cache)} packages): {after}", flush=True)
                    result[name].update(
                        {
                            "idle_wait_s": waited,
                            "packages": packages(cache),
                            "after": after,
                            "log": server.log.read_text()[-2000:],
                        }
                    )
            finally:
                server.close()
    eager = C.median(result["eager"]["seconds"][1:])
    building = C.median(result["default"]["seconds"][1:])
    built = C.median(result["default"]["after"])
    result["summary"] = {
        "eager_median_s": eager,
        "default_while_building_median_s": building,
        "default_built_median_s": built,
        "while_building_over_eager": round(building / eager, 2),
        "built_over_eager": round(built / eager, 2),
    }
    C.print_table(
        f"qkv serve on a machine without saved steps: seconds per request (64 tokens), "
        f"median of requests 2..{args.requests}",
        ["server", "first request", "median", "/ eager"],
        [
            ["eager (saved steps off)", f"{result['eager']['seconds'][0]:.2f}", f"{eager:.2f}", "1.00"],
            [
                "default, while its steps are missing",
                f"{result['default']['seconds'][0]:.2f}",
                f"{building:.2f}",
                f"{building / eager:.2f}",
            ],
            ["default, once built", "-", f"{built:.2f}", f"{built / eager:.2f}"],
        ],
    )
    out = C.write_json(NAME, result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
