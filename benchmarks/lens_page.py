"""The page's lens views, timed in a real browser (Debian's Chromium, headless, driven by
Playwright), on SmolLM2 at 64 tokens, with the server on the same 2 cores:

- ``look_inside``: click "Look inside" -> bars, logit lens, rollout and every head drawn (one
  POST /api/lens: the forward pass, the logit lens of the last 16 positions, 270 thumbnails);
- ``temperature``: moving the slider -> bars redrawn (no request: softmax(z / T) in the page);
- ``ablate_click``: a click on a head with "knock it out" ticked -> the whole lens again with
  the head ablated;
- ``qk``: one head's q·k row (POST /api/qk);
- ``patch_head``: patching every head of the clean prompt into the corrupt one (270 cells);
- ``history_step``: the step slider over a run's recorded scores (no request), when ``--runs``
  holds a GPT run with a history.

Each is the median of ``--repeat`` clicks after one warm-up, wall time from the event to the
view drawn, measured by the test harness (not by the page). With ``--screens DIR`` it also
saves a picture of each view (the docs/ screenshots).

    python benchmarks/lens_page.py                                  # needs qkv[serve], playwright, chromium
    python benchmarks/lens_page.py --runs runs --screens docs       # + a run's history, + screenshots
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

TEXT = ("The quick brown fox jumps over the lazy dog. When Mary and John went to the store, John gave a "
        "drink to Mary because she was thirsty after the long walk home from the old market square and")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(page, expression: str, timeout: float = 300.0) -> None:
    """Poll ``expression`` in the page (the page's CSP forbids wait_for_function's eval)."""
    end = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > end:
            raise SystemExit(f"the page never reached: {expression}")
        time.sleep(0.005)


READY = "document.body.dataset.state === 'ready'"


def main() -> None:
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="timed clicks per view (median)")
    p.add_argument("--runs", default=None, help="a --runs folder for qkv serve whose GPT runs have a history")
    p.add_argument("--screens", default=None, help="save a PNG of each view in this folder")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/lens_page.json)")
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs Debian's Chromium: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    machine = C.machine_info()
    print(C.machine_line(machine))
    port = free_port()
    runs = Path(args.runs) if args.runs else Path(HERE.parent / "results" / "_no_runs")
    server = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--port", str(port), "--runs", str(runs),
                               "--max-tokens", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[float]] = {}
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/api/models", timeout=1).read()
                break
            except OSError:
                time.sleep(0.2)
        models = json.loads(urllib.request.urlopen(url + "/api/models").read())
        ids = [m["id"] for m in (models["models"] if isinstance(models, dict) else models)]
        run = next((i for i in ids if i.startswith("runs/")), None)
        meter = C.LoadMeter()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(url + "/")
            wait(page, READY)

            def timed(name: str, act, done: str, repeat: int = args.repeat) -> None:
                for i in range(repeat + 1):
                    page.evaluate("window.qkvQK = undefined; window.qkvPatch = undefined")
                    t0 = time.perf_counter()
                    act()
                    wait(page, done)
                    if i:  # the first is the warm-up
                        results.setdefault(name, []).append(time.perf_counter() - t0)
                print(f"{name}: {C.median(results[name]) * 1000:.0f} ms", flush=True)

            page.select_option("#model", "smollm2")
            page.fill("#text", TEXT)

            def look() -> None:
                page.evaluate("document.body.dataset.state = 'busy'")
                page.click("#lens-go")

            timed("look_inside", look, READY + " && document.querySelectorAll('#rollout rect').length > 0")

            def slide() -> None:
                page.evaluate("window.qkvBars = null")
                now = page.input_value("#lens-temperature")
                page.fill("#lens-temperature", "0.7" if now == "1.5" else "1.5")
                page.dispatch_event("#lens-temperature", "input")

            timed("temperature", slide, "window.qkvBars !== null")
            page.check("#click-ablates")
            box = page.locator("#grid").bounding_box()
            scale = box["width"] / page.evaluate("document.querySelector('#grid').width")

            def click_head() -> None:  # head 3 of layer 5 (cells of 34 + 3 px, margins 28 and 16)
                page.evaluate("document.body.dataset.state = 'busy'")
                page.mouse.click(box["x"] + (28 + 3 * 37 + 17) * scale, box["y"] + (16 + 5 * 37 + 17) * scale)

            timed("ablate_click", click_head, READY)
            if not page.inner_text("#ablated").startswith("knocked out"):  # an even number of clicks
                click_head()
                wait(page, READY)
            shots = Path(args.screens) if args.screens else None
            if shots:
                for fig, name in (("#probs-figure", "lens-ablated"), ("#rollout-figure", "lens-rollout")):
                    page.locator(fig).screenshot(path=str(shots / f"{name}.png"))
            page.evaluate("document.body.dataset.state = 'busy'")
            page.click("#clear-ablation")
            wait(page, READY)
            if shots:
                page.locator("#probs-figure").screenshot(path=str(shots / "lens-probs.png"))
            page.uncheck("#click-ablates")
            page.fill("#qk-layer", "5")
            page.fill("#qk-head", "3")
            page.fill("#qk-query", "-1")
            timed("qk", lambda: page.click("#qk-go"), "window.qkvQK !== undefined && " + READY)
            page.fill("#patch-corrupt", TEXT.replace("Mary", "Alice"))
            page.select_option("#patch-site", "head")
            timed("patch_head", lambda: page.click("#patch-go"), "window.qkvPatch !== undefined && " + READY,
                  repeat=1)
            if shots:
                for fig, name in (("#qk-figure", "lens-qk"), ("#patch-figure", "lens-patch"),
                                  ("#lens-figure", "lens-logit-lens"), ("#grid-figure", "lens-heads")):
                    if page.locator(fig).count():
                        page.locator(fig).screenshot(path=str(shots / f"{name}.png"))
            if run is not None:
                page.select_option("#model", run)
                page.fill("#text", "abcdefabcdef")
                page.click("#lens-go")
                wait(page, READY)
                if page.is_visible("#history-figure"):
                    n = int(page.get_attribute("#history-step", "max"))

                    def step() -> None:
                        page.evaluate("window.qkvHistoryShown = null")
                        page.fill("#history-step", str(int(time.perf_counter() * 1000) % (n + 1)))
                        page.dispatch_event("#history-step", "input")

                    timed("history_step", step, "window.qkvHistoryShown !== null")
                    page.select_option("#history-type", "induction")
                    page.fill("#history-step", str(n))
                    page.dispatch_event("#history-step", "input")
                    if shots:
                        page.locator("#history-figure").screenshot(path=str(shots / "lens-history.png"))
            browser.close()
        load = meter.stop()
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows = [[k, f"{C.median(v) * 1000:.0f}", " ".join(f"{x * 1000:.0f}" for x in v)]
            for k, v in results.items()]
    C.print_table(f"the page's lens views on SmolLM2, 64 tokens, Chromium headless ({C.load_line(load)})",
                  ["view", "ms (median)", "each"], rows)
    out = C.write_json("lens_page", {"machine": machine, "load": load, "repeat": args.repeat,
                                     "ms": {k: [round(x * 1000, 1) for x in v] for k, v in results.items()}},
                       args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
