"""The explorer page's views as a student reads them (issue 41), in Debian's Chromium (headless,
Playwright, never a downloaded browser): the contrast of every text on every view, computed here
with WCAG 2.x's formula from the colours the browser rendered (the text's, and the nearest painted
background: the SVG shape under an SVG text, else the closest HTML background); the q·k view's
column headers; the all-heads grid at SmolLM2's 30 layers fitting the page without a scrollbar;
the history as one line per head type with the slider's step marked; an empty state on every
panel; a legend on every heatmap; the first view; and one threshold (0.5) for naming a head.

``QKV_PAGE_SHOTS=DIR`` also saves screenshots of the views as DIR/page-*.png (the docs' figures).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import page_wait
from serve_helpers import api, asset_installed, explorer_page

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

pytest.importorskip("fastapi", reason="qkv serve needs FastAPI: pip install 'qkv[serve]'")
pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need Playwright: "
                               "pip install playwright (it drives the system Chromium)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("browser tests need Debian's Chromium: apt-get install -y chromium", allow_module_level=True)

GPT = "runs/gpt-tiny"
TEXT = "ROMEO: But soft"
AA = 4.5  # WCAG 2.x level AA, normal text
NAMED = 0.5  # the one threshold for naming a head (the summary of `qkv train` / `qkv lens`)
TYPES = ("previous", "first", "duplicate", "induction")  # qkv.lens.heads.HEAD_TYPES, in its order
SHOTS = os.environ.get("QKV_PAGE_SHOTS")
needs_smollm2 = pytest.mark.skipif(not asset_installed("smollm2"),
                                   reason="asset smollm2 not installed: qkv assets install smollm2")


# ------------------------------------------------------------------ WCAG 2.x, written out here


def _channel(v: float) -> float:
    s = v / 255
    return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4


def relative_luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG 2.x relative luminance of an sRGB colour (0..255 channels)."""
    r, g, b = (_channel(v) for v in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """(L_lighter + 0.05) / (L_darker + 0.05)."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def parse_colour(css: str) -> tuple[float, float, float, float]:
    """'rgb(r, g, b)' / 'rgba(r, g, b, a)' (as getComputedStyle gives them) -> (r, g, b, a)."""
    m = re.fullmatch(r"rgba?\(([^)]*)\)", css.strip())
    assert m, f"not a computed colour: {css!r}"
    parts = [float(x) for x in re.split(r"[,\s/]+", m.group(1).strip()) if x]
    return (*parts[:3], parts[3] if len(parts) > 3 else 1.0)  # type: ignore[return-value]


def flatten(layers: list[str]) -> tuple[float, float, float]:
    """Colours from the top painted layer down to an opaque one -> the colour seen (alpha over)."""
    out = None
    for css in reversed([*layers, "rgb(255, 255, 255)"]):  # the canvas below everything is white
        r, g, b, a = parse_colour(css)
        top = (r, g, b)
        out = top if out is None else tuple(a * c + (1 - a) * o for c, o in zip(top, out, strict=True))
    return out  # type: ignore[return-value]


def test_the_formula_on_known_pairs() -> None:
    assert contrast((0, 0, 0), (255, 255, 255)) == pytest.approx(21.0)
    assert contrast((119, 119, 119), (255, 255, 255)) == pytest.approx(4.48, abs=0.01)  # #777: fails AA
    # the finding: the page's dark ink on a dark viridis cell
    assert contrast((0x1d, 0x23, 0x30), (59, 28, 113)) < 1.5
    assert flatten(["rgba(0, 0, 0, 0.5)"]) == pytest.approx((127.5, 127.5, 127.5))


# The rendered colours of every visible text under ROOT: for an HTML element with its own text,
# its color over the backgrounds of it and its ancestors (top first, down to an opaque one); for
# an SVG <text>, its fill over the shapes painted before it in the same SVG whose box holds the
# text's centre (top first), then the SVG's HTML backgrounds.
RENDERED = """(root) => {
  const visible = (el) => el.getClientRects().length > 0 && getComputedStyle(el).visibility === 'visible'
    && !el.closest('[hidden]') && Number(getComputedStyle(el).opacity) > 0;
  const htmlBackgrounds = (el) => {
    const out = [];
    for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
      const bg = getComputedStyle(e).backgroundColor;
      const a = bg.startsWith('rgba') ? Number(bg.split(',')[3].replace(')', '')) : 1;
      if (a > 0) out.push(bg);
      if (a >= 1) break;
    }
    return out;
  };
  const out = [];
  for (const el of document.querySelector(root).querySelectorAll('*')) {
    if (!visible(el)) continue;
    const tag = el.tagName.toLowerCase();
    if (el instanceof SVGElement) {
      if (tag !== 'text') continue;
      const r = el.getBoundingClientRect(), cx = r.x + r.width / 2, cy = r.y + r.height / 2;
      const svg = el.ownerSVGElement, shapes = [];
      for (const s of svg.querySelectorAll('rect, image')) {
        if (!(s.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING)) continue;  // painted after
        const b = s.getBoundingClientRect();
        if (cx < b.left || cx > b.right || cy < b.top || cy > b.bottom) continue;
        if (s.tagName.toLowerCase() === 'image') { shapes.push('image'); continue; }
        const f = getComputedStyle(s).fill;
        if (f === 'none') continue;
        shapes.push(f.startsWith('rgba') || Number(getComputedStyle(s).fillOpacity) === 1 ? f
          : f.replace('rgb(', 'rgba(').replace(')', `, ${getComputedStyle(s).fillOpacity})`));
      }
      out.push({ text: el.textContent, where: svg.id, ink: getComputedStyle(el).fill,
                 layers: [...shapes.reverse(), ...htmlBackgrounds(svg)] });
    } else if (!['option', 'script', 'style', 'title', 'select', 'textarea'].includes(tag)) {
      const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim() !== '');
      if (!own) continue;
      out.push({ text: el.textContent.trim().slice(0, 60), where: el.id || el.closest('[id]')?.id || tag,
                 ink: getComputedStyle(el).color, layers: htmlBackgrounds(el) });
    }
  }
  return out;
}"""


def low_contrast(page, root: str = "body") -> tuple[int, list[str]]:
    """(how many texts were measured, those under 4.5:1) for every visible text under ``root``."""
    texts = page.evaluate(RENDERED, root)
    bad = []
    for t in texts:
        assert "image" not in t["layers"][:1], f"text on a picture has no measurable ground: {t}"
        layers = [x for x in t["layers"] if x != "image"]
        r, g, b, a = parse_colour(t["ink"])
        ground = flatten(layers)
        ink = flatten([f"rgba({r}, {g}, {b}, {a})", *layers]) if a < 1 else (r, g, b)
        ratio = contrast(ink, ground)
        if ratio < AA:
            bad.append(f"{ratio:.2f}:1 {t['where']}: {t['text']!r} ({t['ink']} on {t['layers']})")
    return len(texts), bad


# ------------------------------------------------------------------ the page


@pytest.fixture
def page(browser, tiny_gpt_server):
    """A fresh page on the explorer (serve_helpers.explorer_page)."""
    yield from explorer_page(browser, tiny_gpt_server, ("data:",))


def ready(page, condition: str = "true") -> None:
    """Wait until the page is ready and ``condition`` holds, or it shows an error (which fails)."""
    page_wait(page, f"document.body.dataset.state === 'error' || (document.body.dataset.state === 'ready' "
              f"&& ({condition}))")
    assert page.is_hidden("#error"), page.inner_text("#error")


def patch(page, corrupt: str = "ROMEO: But sift") -> None:
    page.fill("#patch-corrupt", corrupt)
    page.fill("#patch-answer", "e")
    page.fill("#patch-wrong", "o")
    page.click("#patch-go")
    ready(page, "window.qkvPatch !== undefined")


def qk(page, layer: int, head: int, query: int) -> None:
    page.fill("#qk-layer", str(layer))
    page.fill("#qk-head", str(head))
    page.fill("#qk-query", str(query))
    page.click("#qk-go")
    ready(page, "window.qkvQK !== undefined")


def look_inside(page, model: str, text: str) -> None:
    page.select_option("#model", model)
    page.fill("#text", text)
    page.click("#lens-go")
    page_wait(page, "!document.querySelector('#lens').hidden && document.body.dataset.state !== 'loading'")
    ready(page)


def shot(page, name: str, selector: str | None = None) -> None:
    """With QKV_PAGE_SHOTS=DIR: the view (or the whole page) as DIR/page-NAME.png."""
    if SHOTS:
        path = Path(SHOTS) / f"page-{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        if selector:
            page.locator(selector).screenshot(path=path)
        else:
            page.screenshot(path=path, full_page=True)


def names_at_threshold(scores: dict[str, list[list[float]]]) -> list[list[str]]:
    """Each head's best type when its score reaches NAMED, "" otherwise (ties: the first type)."""
    L, H = len(scores[TYPES[0]]), len(scores[TYPES[0]][0])
    out = []
    for layer in range(L):
        row = []
        for head in range(H):
            best = max(TYPES, key=lambda t: (scores[t][layer][head], -TYPES.index(t)))
            row.append(best if scores[best][layer][head] >= NAMED else "")
        out.append(row)
    return out


HEATMAPS = ("heatmap", "lens-table", "rollout", "grid", "history", "qk", "patch")


def test_the_first_view_shows_an_example_and_where_to_start(page) -> None:
    assert page.is_visible("#start") and "Start here" in page.inner_text("#start")
    for button in ("Show attention", "Look inside"):
        assert button in page.inner_text("#start ol")
    # the first view names Quiz me exactly when the page shows it (the quiz is a decoder's)
    assert ("Quiz me" in page.inner_text("#start ol")) == page.is_visible("#quiz-controls")
    page.select_option("#model", GPT)
    page.wait_for_function("() => !document.getElementById('quiz-controls').hidden")
    assert "Quiz me" in page.inner_text("#start ol")
    assert page.locator("#start-example rect").count() > 25  # the sketch's 5 x 5 cells and its legend
    assert page.locator("#start-example g.legend text").count() >= 2
    n, bad = low_contrast(page)
    assert n > 30 and bad == []
    shot(page, "start")
    # an example button fills the text and runs it; the first result replaces the first view
    page.select_option("#model", GPT)  # it knows only its corpus's characters: the example's text is Romeo's
    page.eval_on_selector("#start button[data-example=attention]", f"b => {{ b.dataset.text = '{TEXT}'; }}")
    page.click("#start button[data-example=attention]")
    ready(page)
    assert page.is_hidden("#start") and page.is_visible("#views")
    example = page.get_attribute("#start button[data-example=attention]", "data-text")
    assert page.input_value("#text") == example


def test_every_text_of_every_view_reaches_aa_contrast(page, tiny_gpt_server) -> None:
    look_inside(page, GPT, TEXT)
    page.click("#show")  # the heatmap too (choosing a model again would clear the views)
    ready(page)
    qk(page, 1, 0, 9)
    patch(page)
    page.click("#patch-exact")  # the estimate and the exact sweep side by side: both measured
    ready(page, "window.qkvPatch.method === 'exact'")
    assert page.locator("#patch g.patch-panel").count() == 2
    shot(page, "patch-compare", "#patch-figure")
    measured = {}
    for view in (*HEATMAPS, "probs"):
        n, bad = low_contrast(page, f"#{view}")
        measured[view] = n
        assert bad == [], f"{view}: {bad[:5]}"
    assert all(n > 0 for n in measured.values()), measured
    n, bad = low_contrast(page)  # everything else on the page: captions, controls, empty states
    assert bad == [], bad[:5]
    shot(page, "attention", "#views")
    # the logit lens prints a token on each cell: every one of them measured, on its own colour
    cells = page.locator("#lens-table rect.lens-cell").count()
    assert page.locator("#lens-table text.lens-top").count() == cells > 0
    # the measurement catches the fault the issue found: the page's ink forced on every SVG text
    page.evaluate("() => document.querySelectorAll('#lens-table text')"
                  ".forEach(t => { t.style.fill = '#1d2330'; })")
    _, bad = low_contrast(page, "#lens-table")
    assert bad, "dark ink on the viridis cells should fail"
    shot(page, "lens")


def test_the_quiz_reveal_reaches_aa_contrast(page) -> None:
    page.select_option("#model", GPT)
    page.select_option("#quiz-kind", "induction")
    page.click("#quiz-go")
    ready(page, "window.qkvQuiz !== undefined")
    page.click("#quiz-choices .quiz-choice >> nth=0")
    ready(page, "window.qkvQuiz.reveal !== null")
    assert page.locator("#quiz-reveal g.legend").count() == 1
    n, bad = low_contrast(page, "#quiz")
    assert n > 8 and bad == [], bad[:5]


def test_generated_tokens_shaded_by_attention_reach_aa_contrast(page) -> None:
    page.select_option("#model", GPT)
    page.fill("#text", "ROMEO: ")
    page.fill("#n-new", "6")
    page.click("#generate")
    ready(page, "document.querySelectorAll('#generated span.new').length === 6")
    shaded = page.eval_on_selector_all("#generated span",
                                       "ss => ss.filter(s => s.style.backgroundColor).length")
    assert shaded >= 1
    n, bad = low_contrast(page, "#generated")
    assert n >= 6 and bad == [], bad[:5]  # every token but the blank ones


def test_qk_view_has_column_headers_over_its_columns(page, tiny_gpt_server) -> None:
    look_inside(page, GPT, TEXT)
    assert page.is_visible('#qk-figure p.empty') and page.is_hidden("#qk")
    qk(page, 1, 2, 9)
    assert page.is_hidden('#qk-figure p.empty') and page.is_visible("#qk")
    headers = page.eval_on_selector_all("#qk text.qk-header", "ts => ts.map(t => [t.textContent, "
                                        "t.getBoundingClientRect().right])")
    want = api(tiny_gpt_server, "/api/qk", {"model": GPT, "text": TEXT, "layer": 1, "head": 2, "query": 9})
    names = [h[0] for h in headers]
    assert names == ["key #", "q·k", f"÷ √{want['head_dim']}", "softmax (the weight)"]
    # the numbers of each column end where its header ends (right-aligned), and read as the API's
    cols = page.eval_on_selector_all("#qk text.qk-row", "ts => ts.map(t => [...t.querySelectorAll('tspan')]"
                                     ".map(s => [s.textContent, s.getBoundingClientRect().right]))")
    assert len(cols) == len(want["keys"]) == 10
    for row, dot, scaled in zip(cols, want["dots"], want["scaled"], strict=True):
        assert float(row[0][0]) == pytest.approx(dot, abs=0.006)
        assert float(row[1][0]) == pytest.approx(scaled, abs=6e-4)
        assert abs(row[0][1] - headers[1][1]) < 1.5 and abs(row[1][1] - headers[2][1]) < 1.5


def test_each_panel_says_what_it_does_until_used(page) -> None:
    look_inside(page, GPT, TEXT)
    empty = {v: page.inner_text(f'p.empty[data-for="{v}"]') for v in ("qk", "patch")}
    assert "q·k" in empty["qk"] and "press q·k" in empty["qk"]
    assert "Patch" in empty["patch"] and "corrupt" in empty["patch"]
    for v in ("qk", "patch"):
        assert page.is_visible(f'p.empty[data-for="{v}"]') and page.is_hidden(f"#{v}")
        assert page.is_hidden(f"#{v}-figure .downloads")
    for v in ("probs", "grid", "lens-table", "rollout", "history"):  # drawn at once: no empty state
        assert page.is_hidden(f'p.empty[data-for="{v}"]') and page.is_visible(f"#{v}"), v
    # every panel of the lens has one, each naming what to click
    for v in ("probs", "grid", "lens-table", "rollout", "history", "qk", "patch"):
        text = page.text_content(f'p.empty[data-for="{v}"]')
        assert re.search(r"press|click|choose", text, re.I), (v, text)
    patch(page)
    assert page.is_hidden('p.empty[data-for="patch"]') and page.locator("#patch rect.patch-cell").count() == 8
    shot(page, "patch", "#patch-figure")
    # another text: the q·k and patching results no longer answer it
    look_inside(page, GPT, "ROMEO: But hard")
    assert page.is_visible('p.empty[data-for="patch"]') and page.is_hidden("#patch")


def test_every_heatmap_has_a_colour_legend(page) -> None:
    look_inside(page, GPT, TEXT)
    page.click("#show")  # the heatmap too (choosing a model again would clear the views)
    ready(page)
    qk(page, 0, 0, -1)
    patch(page)
    for view in ("heatmap", "lens-table", "rollout", "grid", "history", "patch"):
        swatches = page.locator(f"#{view} g.legend rect").count()
        ticks = page.eval_on_selector_all(f"#{view} g.legend text", "ts => ts.map(t => t.textContent)")
        assert swatches > 10 and len(ticks) >= 3, (view, swatches, ticks)
    # the heatmap's legend spans 0 to the largest weight drawn
    data = page.evaluate("state.attention.weights")
    top = max(max(r) for r in data)
    ticks = page.eval_on_selector_all("#heatmap g.legend text", "ts => ts.map(t => t.textContent)")
    assert ticks[0] == "0" and float(ticks[2]) == pytest.approx(top, abs=0.006)


def test_the_history_draws_a_line_per_head_type_and_marks_the_step(page, tiny_gpt_server) -> None:
    look_inside(page, GPT, TEXT)
    h = api(tiny_gpt_server, "/api/history", {"model": GPT})
    n = len(h["steps"])
    assert n >= 2
    lines = page.eval_on_selector_all("#history path.history-line", "ps => ps.map(p => [p.dataset.type, "
                                      "p.getAttribute('d')])")
    assert sorted(t for t, _ in lines) == sorted(h["scores"])  # one line per head type
    shown = page.evaluate("window.qkvHistoryShown")
    pairs: list[tuple[float, float]] = []  # (best score, y drawn) of every point of every line
    for t, d in lines:
        points = [tuple(map(float, p.split())) for p in re.findall(r"[ML]([\d.\-]+ [\d.\-]+)", d)]
        assert len(points) == n
        best = [max(v for row in m for v in row) for m in h["scores"][t]]  # the best head at each step
        assert shown["lines"][t] == pytest.approx(best)
        pairs += [(b, p[1]) for b, p in zip(best, points, strict=True)]
        xs = [p[0] for p in points]
        assert xs == sorted(xs) and len(set(xs)) == n
    # one y axis for every line: y = a + k·score with k < 0 (higher is better), by least squares
    mb, my = sum(b for b, _ in pairs) / len(pairs), sum(y for _, y in pairs) / len(pairs)
    sbb = sum((b - mb) ** 2 for b, _ in pairs)
    assert sbb > 0, "the lines should not all be equal"
    k = sum((b - mb) * (y - my) for b, y in pairs) / sbb
    assert k < 0 and all(abs(y - (my + k * (b - mb))) < 0.2 for b, y in pairs)
    # the slider moves the marker onto each recorded step's x; the per-head cells follow
    first_xs = [float(x.split()[0]) for x in re.findall(r"[ML]([\d.\-]+ [\d.\-]+)", lines[0][1])]
    for i in (0, n - 1):
        page.fill("#history-step", str(i))
        page.dispatch_event("#history-step", "input")
        x = float(page.get_attribute("#history line.history-now", "x1"))
        assert x == pytest.approx(first_xs[i], abs=0.11)
        shown = page.evaluate("window.qkvHistoryShown")
        assert shown["step"] == h["steps"][i] and shown["scores"] == h["scores"]["induction"][i]
    assert page.locator("#history rect.history-cell").count() == 2 * 4
    shot(page, "history", "#history-figure")


def test_heads_are_named_at_one_threshold(page, tiny_gpt_server) -> None:
    look_inside(page, GPT, TEXT)
    data = api(tiny_gpt_server, "/api/lens", {"model": GPT, "text": TEXT, "thumbs": False})
    grid = page.evaluate("window.qkvGrid")
    assert grid["threshold"] == NAMED and page.inner_text("#grid-threshold") == "0.5"
    assert grid["names"] == names_at_threshold(data["scores"])
    marks = page.locator("#grid text.mark").count()
    assert marks == sum(bool(x) for row in grid["names"] for x in row)


@needs_smollm2
def test_smollm2_grid_fits_the_page_without_a_scrollbar(page, tiny_gpt_server) -> None:
    text = "The cat sat on the mat. The cat sat on the mat."
    look_inside(page, "smollm2", text)
    assert page.locator("#grid g.head").count() == 30 * 9
    geometry = page.evaluate("""() => {
        const wrap = document.querySelector('#grid-wrap'), fig = document.querySelector('#grid-figure');
        const g = document.querySelector('#grid').getBoundingClientRect();
        const scrolls = [];
        for (let e = document.querySelector('#grid'); e; e = e.parentElement) {
            const s = getComputedStyle(e);
            const name = e.id || e.tagName;
            if (e.scrollWidth > e.clientWidth + 1 && /auto|scroll/.test(s.overflowX)) scrolls.push(name);
            if (e.scrollHeight > e.clientHeight + 1 && /auto|scroll/.test(s.overflowY)) scrolls.push(name);
        }
        return { scrolls, grid: g.width, wrap: wrap.clientWidth, fig: fig.getBoundingClientRect().width,
                 page: document.documentElement.scrollWidth, viewport: window.innerWidth,
                 columns: document.querySelectorAll('#grid text.grid-col').length };
    }""")
    assert geometry["scrolls"] == [], geometry
    assert geometry["page"] <= geometry["viewport"], geometry  # no horizontal scroll of the page either
    assert geometry["grid"] <= geometry["wrap"] + 1 and geometry["grid"] >= 0.9 * geometry["wrap"], geometry
    assert geometry["fig"] >= 0.9 * (1400 - 40), geometry  # the figure takes the page's width
    assert geometry["columns"] == 30 and page.inner_text("#grid-axes") == "layers across, heads down"
    # one threshold here too, on a model with named heads
    data = api(tiny_gpt_server, "/api/lens", {"model": "smollm2", "text": text, "thumbs": False})
    names = names_at_threshold(data["scores"])
    assert page.evaluate("window.qkvGrid.names") == names and any(x for row in names for x in row)
    n, bad = low_contrast(page, "#lens")
    assert n > 100 and bad == [], bad[:5]
    assert page.is_visible('p.empty[data-for="history"]')  # a pretrained model has no training history
    shot(page, "lens-smollm2")
    shot(page, "grid", "#grid-figure")
    shot(page, "logit-lens", "#lens-figure")
    shot(page, "rollout", "#rollout-figure")
    qk(page, 3, 0, -1)
    shot(page, "qk", "#qk-figure")
    # a narrower window: the grid follows it, still without a scrollbar
    page.set_viewport_size({"width": 900, "height": 1000})
    page_wait(page, "document.querySelector('#grid').getBoundingClientRect().width <= "
              "document.querySelector('#grid-wrap').clientWidth + 1")
    assert page.evaluate("document.querySelector('#grid').getBoundingClientRect().right <= window.innerWidth")


def test_the_lectures_page_cites_each_lecture_and_reads_at_aa(page, tiny_gpt_server) -> None:
    from qkv.explain.lectures import LECTURES

    page.goto(tiny_gpt_server + "/lectures")
    body = page.inner_text("main.lectures")
    assert ".txt" not in body
    for lec in LECTURES:
        assert lec.notes in body and lec.sections[0].title in body
    n, bad = low_contrast(page)
    assert n > 50 and bad == [], bad[:5]


@pytest.mark.skipif(not asset_installed("minilm"),
                    reason="asset minilm not installed: qkv assets install minilm")
def test_an_encoder_draws_its_views_with_headers_and_contrast(page) -> None:
    look_inside(page, "minilm", "The cat sat on the mat because it was tired.")
    assert page.locator("#grid g.head").count() == 6 * 12
    assert page.inner_text("#grid-axes") == "layers down, heads across"  # 12 heads > 6 layers: heads across
    assert page.is_hidden("#probs-figure") and page.is_visible("#rollout")  # no next token in an encoder
    qk(page, 2, 3, 0)
    assert page.locator("#qk text.qk-header").count() == 4
    n, bad = low_contrast(page, "#lens")
    assert n > 40 and bad == [], bad[:5]
