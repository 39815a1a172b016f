// qkv explorer: what attention does (POST /api/lens). Next-token bars with a temperature slider
// (softmax(z / T) computed here from the logits the server sends), the logit lens, every head as a
// thumbnail (click to open it, or to knock it out), q·k term by term, activation patching, the
// rollout, the heads' training history, and SVG / PNG downloads of every view. Text on a coloured
// cell takes black or white by the cell's luminance (ink); every heatmap carries its legend.
// Uses app.js's helpers ($, api, label, esc, colormap, VIRIDIS, rgb, state, ...).
"use strict";

const lensState = { data: null, ablated: [], history: null, key: null };

// softmax(z / T) over the whole vocabulary, in float64 as the server computes it.
function softmaxT(logits, T) {
  let max = -Infinity;
  for (const z of logits) if (z / T > max) max = z / T;
  let sum = 0;
  for (const z of logits) sum += Math.exp(z / T - max);
  return (i) => Math.exp(logits[i] / T - max) / sum;
}

function temperature() { return Number($("lens-temperature").value); }

async function lookInside() {
  clearError();
  const m = currentModel();
  if (!m) { showError("Choose a model first."); return; }
  setBusy(true);
  const t0 = performance.now();
  try {
    const data = await postStream("/api/lens", { model: m.id, text: $("text").value, ablate: lensState.ablated });
    const key = `${m.id}\n${data.tokens.join("\u0000")}`;
    if (key !== lensState.key) {  // q·k and patching answered another text: back to their empty states
      for (const view of ["qk", "patch"]) { $(view).innerHTML = ""; showView(view, false); }
      lensState.key = key;
    }
    lensState.data = data;
    lensState.history = null;
    $("quiz").hidden = true;
    if (m.id.startsWith("runs/")) {
      try { lensState.history = await post("/api/history", { model: m.id }); } catch (e) { lensState.history = null; }
    }
    renderLens();
    await nextPaint();
    $("timing").textContent = `lens: ${data.tokens.length} tokens · server ${(data.seconds * 1000).toFixed(0)} ms · ` +
      `total ${(performance.now() - t0).toFixed(0)} ms`;
    setState("ready");
  } catch (e) {
    $("lens").hidden = true;
    showError(e.message);
  } finally {
    setBusy(false);
  }
}

// A panel shows its view, or (until it has one) what it does and what to click: its p.empty.
function showView(view, drawn) {
  const fig = $(view).closest("figure");
  $(view).toggleAttribute("hidden", !drawn);  // an SVG element has no .hidden property
  fig.querySelector(".downloads").hidden = !drawn;
  fig.querySelector("p.empty").hidden = drawn;
}

function renderLens() {
  const d = lensState.data;
  hideStart();
  showNotes(d.notes);
  $("lens").hidden = false;
  $("probs-figure").hidden = d.logits === null;
  $("patch-figure").hidden = d.logits === null;  // patching measures a next-token answer
  $("lens-figure").hidden = d.lens === null;
  showView("probs", d.logits !== null);
  if (d.logits !== null) renderBars();
  showView("lens-table", d.lens !== null);
  if (d.lens !== null) renderLensTable();
  showView("rollout", Boolean(d.rollout));
  if (d.rollout) renderRollout();
  showView("grid", true);
  renderGrid();
  for (const view of ["qk", "patch"]) if (!$(view).innerHTML) showView(view, false);
  $("history-figure").hidden = false;
  showView("history", Boolean(lensState.history));
  if (lensState.history) {
    $("history-step").max = String(lensState.history.steps.length - 1);
    $("history-step").value = String(lensState.history.steps.length - 1);
    renderHistory();
  }
  $("history-step").disabled = !lensState.history;
  $("history-type").disabled = !lensState.history;
  const abl = d.ablated.map(([l, h]) => `${l}.${h}`).join(", ");
  $("ablated").textContent = abl ? `knocked out: ${abl}` + (d.embedding_change !== null && d.embedding_change !== undefined
    ? ` · sentence embedding changed by 1 − cos = ${d.embedding_change.toFixed(4)}` : "") : "no heads knocked out";
}

// ------------------------------------------------------------------ next-token bars

function renderBars() {
  const d = lensState.data;
  const T = temperature();
  $("lens-t-value").textContent = T.toFixed(2);
  const p = softmaxT(d.logits, T);
  const base = d.base_logits ? softmaxT(d.base_logits, T) : null;
  const k = Math.min(10, d.candidates.length);
  const rows = d.candidates.slice(0, k).map((c) => ({ token: c.token, id: c.id, p: p(c.id), base: base ? base(c.id) : null }));
  let shown = 0;
  for (const r of rows) shown += r.p;
  rows.push({ token: "(all others)", id: -1, p: Math.max(0, 1 - shown), base: null });
  window.qkvBars = rows.map((r) => ({ id: r.id, token: r.token, prob: r.p }));
  drawBars($("probs"), rows.map((r) => ({ ...r, name: label(r.token),
    text: `${(100 * r.p).toFixed(2)}%` + (r.base !== null ? ` (was ${(100 * r.base).toFixed(2)}%)` : "") })));
}

// Horizontal bars, one per row {name, id, p (0..1: the bar's length), base (a grey bar behind, or
// null), text (beside the bar), mark (outlined: the quiz's truth)}: the next-token probabilities
// and the quiz's reveals.
function drawBars(svg, rows) {
  const rowH = 20, labelW = 120, barW = 300, width = labelW + barW + 150, height = rows.length * rowH + 8;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    parts.push(`<text x="${labelW - 6}" y="${y + rowH / 2}" text-anchor="end" dominant-baseline="middle"` +
      `${r.mark ? ' font-weight="bold"' : ""}>${esc(r.name)}</text>`);
    if (r.base !== null && r.base !== undefined) parts.push(`<rect x="${labelW}" y="${y + 2}" width="${(barW * r.base).toFixed(1)}" height="${rowH - 4}" fill="#ced4da"/>`);
    parts.push(`<rect class="bar" data-id="${r.id}" data-p="${r.p}" x="${labelW}" y="${y + 5}" width="${(barW * r.p).toFixed(1)}" ` +
      `height="${rowH - 10}" fill="${r.id < 0 ? "#adb5bd" : "#3b5bdb"}"${r.mark ? ' stroke="#e8590c" stroke-width="2"' : ""}/>`);
    parts.push(`<text x="${labelW + barW * r.p + 4}" y="${y + rowH / 2}" dominant-baseline="middle">${esc(r.text)}</text>`);
  });
  sizeSvg(svg, width, height, parts);
}

// ------------------------------------------------------------------ logit lens table

function renderLensTable() {
  const d = lensState.data;
  const L = d.lens.rows.length, T = d.tokens.length;
  const first = d.lens.positions[0];  // the server reads out the last positions only
  const cw = 64, ch = 18, lw = 44, top = 70;
  const legendY = top + L * ch + 10;
  const legendTitle = "probability of the layer's top token";
  const width = Math.max(lw + (T - first) * cw + 4, legendEnd(lw, legendTitle)), height = legendY + 28;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  for (let t = first; t < T; t++) {
    const x = lw + (t - first) * cw + cw / 2;
    parts.push(`<text class="col-head" x="${x}" y="${top - 6}" transform="rotate(-45 ${x} ${top - 6})">${esc(label(d.tokens[t]))}</text>`);
  }
  for (let r = 0; r < L; r++) {
    const y = top + r * ch;
    parts.push(`<text x="${lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle">${esc(d.lens.rows[r])}</text>`);
    for (let t = first; t < T; t++) {
      const p = d.lens.prob[r][t - first];
      const c = colormap(VIRIDIS, p);
      const x = lw + (t - first) * cw;
      parts.push(`<rect class="lens-cell" data-r="${r}" data-t="${t}" x="${x}" y="${y}" width="${cw - 1}" height="${ch - 1}" fill="${rgb(c)}"/>`);
      parts.push(`<text class="lens-top" x="${x + cw / 2}" y="${y + ch / 2}" text-anchor="middle" dominant-baseline="middle" ` +
        `fill="${ink(c)}" font-size="9">${esc(label(d.lens.top[r][t - first]).slice(0, 8))}</text>`);
    }
  }
  parts.push(viridisLegend(lw, legendY, 1, legendTitle));
  sizeSvg($("lens-table"), width, height, parts);
}

// ------------------------------------------------------------------ attention rollout

function renderRollout() {
  const d = lensState.data, R = d.rollout.positions.length, T = d.tokens.length;
  const cw = Math.max(6, Math.min(16, Math.floor(640 / T))), ch = 14, lw = 110, top = 70;
  const sink = $("rollout-sink").checked;  // LLMs park most attention on the first token
  const legendY = top + R * ch + 10;
  const legendTitle = sink ? "share of the row's largest (first token left out)" : "share of the row's largest";
  const width = Math.max(lw + T * cw + 8, legendEnd(lw, legendTitle)), height = legendY + 28;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  if (cw >= 10) {
    d.tokens.forEach((tok, j) => {
      const x = lw + j * cw + cw / 2;
      parts.push(`<text x="${x}" y="${top - 6}" transform="rotate(-60 ${x} ${top - 6})" font-size="9">${esc(label(tok)).slice(0, 10)}</text>`);
    });
  }
  d.rollout.positions.forEach((t, i) => {
    const row = d.rollout.values[i], y = top + i * ch;
    let max = 0;
    row.forEach((v, j) => { if (!(sink && j === 0 && t > 0)) max = Math.max(max, v); });
    parts.push(`<text x="${lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle" font-size="10">` +
      `${esc(label(d.tokens[t])).slice(0, 12)} #${t}</text>`);
    row.forEach((v, j) => {
      parts.push(`<rect class="rollout-cell" data-t="${t}" data-j="${j}" x="${lw + j * cw}" y="${y}" width="${cw - 1}" ` +
        `height="${ch - 1}" fill="${rgb(colormap(VIRIDIS, Math.min(1, v / (max || 1))))}"><title>${v.toFixed(4)}</title></rect>`);
    });
  });
  parts.push(legendParts(lw, legendY, 160, (x) => colormap(VIRIDIS, x), [[0, "0"], [0.5, "half"], [1, "largest"]],
    legendTitle));
  window.qkvRollout = d.rollout;
  sizeSvg($("rollout"), width, height, parts);
}

// ------------------------------------------------------------------ every head

const TYPE_MARK = { previous: "P", first: "F", duplicate: "D", induction: "I" };
// A head is named after its highest score when that reaches qkv's one threshold (qkv.lens.NAMED_AT:
// the summary `qkv train` and `qkv lens` print); the lens API names the heads (`labels`), and its
// `threshold`, when it sends one, is the number this page states.
const HEAD_NAMED = 0.5;
const HEAD_TYPES = ["previous", "first", "duplicate", "induction"];  // qkv.lens.HEAD_TYPES

function namedAt(d) { return typeof d.threshold === "number" ? d.threshold : HEAD_NAMED; }

// Each head's name (L x H, "" for none), as the lens API names them.
function headNames(d) { return d.labels; }

// One head's pattern as a PNG data URL (viridis, scaled to its own largest weight), k pixels a cell.
function thumbUrl(m, k) {
  const n = m.length, c = document.createElement("canvas");
  c.width = c.height = n * k;
  const ctx = c.getContext("2d");
  let max = 0;
  for (const r of m) for (const v of r) max = Math.max(max, v);
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
    ctx.fillStyle = rgb(colormap(VIRIDIS, m[i][j] / (max || 1)));
    ctx.fillRect(j * k, i * k, k, k);
  }
  return c.toDataURL("image/png");
}

// The grid fills the page's width: the longer of layers and heads runs across (SmolLM2's 30
// layers across, its 9 heads down), cells square, at most 96 px.
function renderGrid() {
  const d = lensState.data, L = d.n_layers, H = d.n_heads;
  const names = headNames(d);
  const layersAcross = L > H;
  const cols = layersAcross ? L : H, rows = layersAcross ? H : L;
  const avail = Math.max(240, Math.floor($("grid-wrap").getBoundingClientRect().width) || 900);
  const left = 64, top = 34, gap = 3;
  const cell = Math.max(12, Math.min(96, Math.floor((avail - left - 4) / cols) - gap));
  const step = cell + gap, legendY = top + rows * step + 8;
  const legendTitle = "attention weight, from 0 to each head's own largest";
  const width = Math.min(avail, Math.max(left + cols * step + 4, legendEnd(left, legendTitle))), height = legendY + 28;
  const font = Math.max(9, Math.min(12, Math.floor(cell * 0.45)));
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  parts.push(`<text x="${left}" y="12" font-size="11">${layersAcross ? "layer" : "head"} →</text>`);
  for (let c = 0; c < cols; c++) {
    parts.push(`<text class="grid-col" x="${left + c * step + cell / 2}" y="${top - 6}" text-anchor="middle" ` +
      `font-size="${Math.min(11, font)}">${c}</text>`);
  }
  for (let r = 0; r < rows; r++) {
    parts.push(`<text class="grid-row" x="${left - 6}" y="${top + r * step + cell / 2}" text-anchor="end" ` +
      `dominant-baseline="middle" font-size="11">${layersAcross ? "head" : "layer"} ${r}</text>`);
  }
  const ablated = new Set(d.ablated.map(([l, h]) => `${l}.${h}`));
  const k = d.thumbs ? Math.max(1, Math.min(8, Math.round(cell / d.thumbs[0].length))) : 1;
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < H; h++) {
      const x0 = left + (layersAcross ? l : h) * step, y0 = top + (layersAcross ? h : l) * step;
      const g = [`<g class="head" data-l="${l}" data-h="${h}"><title>head ${l}.${h}${names[l][h] ? ": " + names[l][h] : ""}</title>`,
        `<rect class="frame" x="${x0}" y="${y0}" width="${cell}" height="${cell}" fill="#e9ecef"/>`];
      if (d.thumbs) {
        g.push(`<image x="${x0}" y="${y0}" width="${cell}" height="${cell}" preserveAspectRatio="none" ` +
          `image-rendering="pixelated" href="${thumbUrl(d.thumbs[l * H + h], k)}"/>`);
      }
      if (names[l][h]) {
        const s = font + 3;
        g.push(`<rect class="mark-bg" x="${x0 + cell - s}" y="${y0}" width="${s}" height="${s}" fill="white"/>`,
          `<text class="mark" data-type="${names[l][h]}" x="${x0 + cell - s / 2}" y="${y0 + s / 2 + 0.5}" text-anchor="middle" ` +
          `dominant-baseline="middle" font-size="${font}" font-weight="bold" fill="#a61e1e">${TYPE_MARK[names[l][h]]}</text>`);
      }
      if (ablated.has(`${l}.${h}`)) {
        g.push(`<path d="M${x0} ${y0}L${x0 + cell} ${y0 + cell}M${x0 + cell} ${y0}L${x0} ${y0 + cell}" stroke="#ff2d55" stroke-width="3"/>`);
      }
      g.push("</g>");
      parts.push(g.join(""));
    }
  }
  parts.push(legendParts(left, legendY, 160, (x) => colormap(VIRIDIS, x), [[0, "0"], [0.5, "half"], [1, "largest"]],
    legendTitle));
  $("grid-axes").textContent = layersAcross ? "layers across, heads down" : "layers down, heads across";
  $("grid-threshold").textContent = String(namedAt(d));
  window.qkvGrid = { names, cell, layersAcross, threshold: namedAt(d) };
  sizeSvg($("grid"), width, height, parts);
}

function headAt(event) {
  const g = event.target.closest && event.target.closest("#grid g.head");
  return g ? [Number(g.dataset.l), Number(g.dataset.h)] : null;
}

async function onGridClick(event) {
  const head = headAt(event);
  if (!head || state.busy) return;
  const [l, h] = head;
  if ($("click-ablates").checked) {
    const key = `${l}.${h}`;
    const i = lensState.ablated.findIndex(([a, b]) => `${a}.${b}` === key);
    if (i >= 0) lensState.ablated.splice(i, 1); else lensState.ablated.push([l, h]);
    await lookInside();
  } else {
    fillSelect($("layer"), lensState.data.n_layers, "last");
    fillSelect($("head"), lensState.data.n_heads, "mean of heads");
    $("layer").value = String(l);
    $("head").value = String(h);
    $("qk-layer").value = String(l);
    $("qk-head").value = String(h);
    await showAttention();
    $("views").scrollIntoView({ block: "nearest" });
  }
}

function onGridHover(event) {
  const head = headAt(event), d = lensState.data;
  if (!head) { $("hover").hidden = true; return; }
  const [l, h] = head;
  const name = window.qkvGrid ? window.qkvGrid.names[l][h] : "";
  const rows = Object.entries(d.scores).map(([t, s]) => ({ token: t, index: `${l}.${h}`, weight: s[l][h] }));
  showPanel(event, `head ${l}.${h}${name ? " · " + name + " head" : ""}`, rows);
}

// ------------------------------------------------------------------ heads during training

// colours of the head types' lines (legend text stays in the page's ink)
const TYPE_COLOUR = { previous: "#1c7ed6", first: "#7048e8", duplicate: "#2f9e44", induction: "#e8590c" };

function renderHistory() {
  const h = lensState.history, i = Number($("history-step").value), type = $("history-type").value;
  const steps = h.steps, n = steps.length;
  // left: one line per head type, its best head's score at each step
  const pl = 44, pt = 30, pw = 420, ph = 200, x1 = Math.max(1, steps[n - 1] - steps[0]);
  const X = (s) => pl + ((s - steps[0]) / x1) * pw, Y = (v) => pt + (1 - v) * ph;
  const parts = [];
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    parts.push(`<line x1="${pl}" x2="${pl + pw}" y1="${Y(v)}" y2="${Y(v)}" stroke="#dee2e6"/>`,
      `<text x="${pl - 4}" y="${Y(v)}" text-anchor="end" dominant-baseline="middle" font-size="10">${v}</text>`);
  }
  const at = namedAt(lensState.data || {});
  parts.push(`<line class="history-named" x1="${pl}" x2="${pl + pw}" y1="${Y(at)}" y2="${Y(at)}" stroke="#495057" stroke-dasharray="4 3"/>`);
  const ticks = n <= 6 ? steps : [0, 1, 2, 3, 4].map((k) => steps[Math.round((k * (n - 1)) / 4)]);
  for (const s of ticks) parts.push(`<text x="${X(s)}" y="${pt + ph + 14}" text-anchor="middle" font-size="10">${s}</text>`);
  parts.push(`<text x="${pl + pw / 2}" y="${pt + ph + 28}" text-anchor="middle" font-size="10">training step</text>`);
  parts.push(`<text x="4" y="12" font-size="10">best head's score</text>`);
  const lines = {};
  HEAD_TYPES.forEach((t, k) => {
    if (!h.scores[t]) return;
    const best = h.scores[t].map((m) => Math.max(...m.flat()));
    lines[t] = best;
    const d = best.map((v, j) => `${j ? "L" : "M"}${X(steps[j]).toFixed(1)} ${Y(v).toFixed(1)}`).join("");
    parts.push(`<path class="history-line" data-type="${t}" d="${d}" fill="none" stroke="${TYPE_COLOUR[t]}" ` +
      `stroke-width="${t === type ? 3 : 2}"/>`);
    const ly = pt + 8 + k * 16;
    parts.push(`<line x1="${pl + pw + 14}" x2="${pl + pw + 34}" y1="${ly}" y2="${ly}" stroke="${TYPE_COLOUR[t]}" stroke-width="3"/>`,
      `<text x="${pl + pw + 38}" y="${ly}" dominant-baseline="middle" font-size="11">${t}${h.formed[t] !== null && h.formed[t] !== undefined ? ` (named from step ${h.formed[t]})` : ""}</text>`);
  });
  parts.push(`<text x="${pl + pw + 14}" y="${pt + 8 + 4 * 16}" dominant-baseline="middle" font-size="10">- - named at ${at}</text>`);
  const xs = X(steps[i]);
  parts.push(`<line class="history-now" x1="${xs}" x2="${xs}" y1="${pt}" y2="${pt + ph}" stroke="#c2255c" stroke-width="2"/>`,
    `<text x="${Math.min(xs + 4, pl + pw - 60)}" y="${pt + 10}" font-size="10" font-weight="bold">step ${steps[i]}</text>`);
  // right: the chosen type's score of every head at that step, as numbers on their colours
  const m = h.scores[type][i], L = m.length, H = m[0].length, cell = 30, gx = pl + pw + 240, gy = pt + 14;
  parts.push(`<text x="${gx}" y="12" font-size="10">${type} score of each head at step ${steps[i]}</text>`);
  for (let hh = 0; hh < H; hh++) parts.push(`<text x="${gx + 40 + hh * cell + cell / 2}" y="${gy + 4}" text-anchor="middle" font-size="10">${hh}</text>`);
  for (let l = 0; l < L; l++) {
    const y = gy + 10 + l * cell;
    parts.push(`<text x="${gx + 36}" y="${y + cell / 2}" text-anchor="end" dominant-baseline="middle" font-size="10">layer ${l}</text>`);
    for (let hh = 0; hh < H; hh++) {
      const v = m[l][hh], c = colormap(VIRIDIS, v), x = gx + 40 + hh * cell;
      parts.push(`<rect class="history-cell" data-l="${l}" data-h="${hh}" x="${x}" y="${y}" width="${cell - 1}" height="${cell - 1}" ` +
        `fill="${rgb(c)}"/>`, `<text x="${x + cell / 2}" y="${y + cell / 2}" text-anchor="middle" dominant-baseline="middle" ` +
        `font-size="9" fill="${ink(c)}">${v.toFixed(2)}</text>`);
    }
  }
  const gridBottom = gy + 10 + L * cell;
  parts.push(viridisLegend(gx + 40, gridBottom + 6, 1, "score"));
  const copying = h.copying === null ? "not yet" : `from step ${h.copying}`;
  const height = Math.max(pt + ph + 40, gridBottom + 40) + 18, width = Math.max(gx + 40 + H * cell + 120, 760);
  parts.push(`<text x="4" y="${height - 6}">loss on the probe at step ${steps[i]}: ${h.loss_first[i].toFixed(2)} first copy, ` +
    `${h.loss_second[i].toFixed(2)} repeat · copying ${copying}</text>`);
  parts.unshift(`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`);
  $("history-label").textContent = `step ${steps[i]}`;
  window.qkvHistoryShown = { step: steps[i], type, scores: m, lines, marked: xs };
  sizeSvg($("history"), width, height, parts);
}

// ------------------------------------------------------------------ q·k and patching

async function post(path, body) {
  return (await api(path, { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) })).json();
}

// The same POST with Accept: application/x-ndjson (lens, q·k, patching): while the request waits
// in the server's queue the page says its place ("queued: 3rd"), while a sweep runs how far it is,
// then the answer, which is what the plain request returns. Leaving the page closes the stream,
// and the server stops a computation no one waits for.
async function postStream(path, body) {
  const response = await api(path, { method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json", "Accept": "application/x-ndjson" } });
  try {
    for await (const ev of ndjsonEvents(response)) {
      if (ev.event === "result") return ev.result;
      if (ev.event === "error") throw new Error(`Error ${ev.status}: ${ev.detail}`);
      showWait(ev);
    }
  } finally {
    showWait(null);
  }
  throw new Error("the server closed the answer before it was complete; try again");
}

function ordinal(n) {
  const s = n % 100 >= 10 && n % 100 <= 20 ? "th" : ({ 1: "st", 2: "nd", 3: "rd" }[n % 10] || "th");
  return `${n}${s}`;
}

function showWait(ev) {
  const el = $("wait");
  el.hidden = !ev;
  el.textContent = !ev ? "" : ev.event === "queued" ? `queued: ${ordinal(ev.position)}`
    : ev.total ? `computing: ${ev.done} of ${ev.total}` : "computing…";
}

async function runPanel(work) {
  clearError();
  if (state.busy) return;
  setBusy(true);
  try {
    await work();
    setState("ready");
  } catch (e) {
    showError(e.message);
  } finally {
    setBusy(false);
  }
}

function computeQK() {
  return runPanel(async () => {
    const m = currentModel();
    const d = await postStream("/api/qk", { model: m.id, text: $("text").value, layer: Number($("qk-layer").value),
      head: Number($("qk-head").value), query: Number($("qk-query").value) });
    window.qkvQK = d;
    const rowH = 18, lw = 110, dotX = lw + 80, scaledX = lw + 170, barX = lw + 190, barW = 160, top = 42;
    const width = barX + barW + 60, height = top + d.keys.length * rowH + 6;
    const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`,
      `<text x="4" y="14">layer ${d.layer} head ${d.head}, query "${esc(label(d.query_token))}" #${d.query}: ` +
      `q·k, ÷ √${d.head_dim}, softmax</text>`];
    for (const [x, anchor, name] of [[lw - 6, "end", "key #"], [dotX, "end", "q·k"], [scaledX, "end", `÷ √${d.head_dim}`],
      [barX, "start", "softmax (the weight)"]]) {
      parts.push(`<text class="qk-header" x="${x}" y="${top - 8}" text-anchor="${anchor}" font-weight="bold">${esc(name)}</text>`);
    }
    parts.push(`<line x1="4" x2="${width - 4}" y1="${top - 3}" y2="${top - 3}" stroke="#adb5bd"/>`);
    d.keys.forEach((k, j) => {
      const y = top + j * rowH;
      parts.push(`<text x="${lw - 6}" y="${y + rowH / 2}" text-anchor="end" dominant-baseline="middle">${esc(label(k))} #${j}</text>`);
      parts.push(`<text class="qk-row" data-j="${j}" y="${y + rowH / 2}" dominant-baseline="middle">` +
        `<tspan x="${dotX}" text-anchor="end">${d.dots[j].toFixed(2)}</tspan>` +
        `<tspan x="${scaledX}" text-anchor="end">${d.scaled[j].toFixed(3)}</tspan></text>`);
      parts.push(`<rect x="${barX}" y="${y + 4}" width="${(barW * d.weights[j]).toFixed(1)}" height="${rowH - 8}" fill="#3b5bdb"/>`);
      parts.push(`<text x="${barX + barW * d.weights[j] + 4}" y="${y + rowH / 2}" dominant-baseline="middle">${d.weights[j].toFixed(3)}</text>`);
    });
    sizeSvg($("qk"), width, height, parts);
    showView("qk", true);
  });
}

// the patching scale: blue (−1: as corrupt, and further) through white (0) to red (1: restores
// the clean answer), painted translucent over white
const PATCH_RED = [201, 42, 42], PATCH_BLUE = [59, 91, 219];

function patchColour(v) {
  return over(v >= 0 ? PATCH_RED : PATCH_BLUE, Math.min(1, Math.abs(v)));
}

// Patching answers with the estimate first (attribution patching: two forward passes and one
// backward pass, a fraction of a second); "Exact sweep" asks for the sweep (a forward pass per
// cell, its progress streamed) and, when the page holds the estimate of the same request, both
// side by side with their agreement (Spearman, top-10 recall), computed by the server.
const patchState = { key: null, estimate: null };

function patchRequest() {
  const opt = (id) => ($(id).value.trim() === "" ? null : $(id).value);
  return { model: currentModel().id, clean: $("text").value, corrupt: $("patch-corrupt").value,
    site: $("patch-site").value, answer: opt("patch-answer"), wrong: opt("patch-wrong") };
}

// The estimate's known failure (Kramár et al. 2024): a saturated softmax has a ~0 gradient, so an
// effect that reaches the answer through such a head can be missed to first order.
function saturatedNote(d) {
  const n = d.saturated.length;
  if (n === 0) return "";
  const names = d.saturated.slice(0, 4).map(([l, h]) => `${l}.${h}`).join(", ");
  return ` · saturated attention in ${n} head${n === 1 ? "" : "s"} (${names}${n > 4 ? ", …" : ""}):` +
    " the estimate may miss effects through them";
}

function seconds(s) { return s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`; }

function patchPrompts() {
  return runPanel(async () => {
    const req = patchRequest();
    patchState.key = null;
    patchState.estimate = null;
    const d = await postStream("/api/patch", { ...req, method: "estimate" });
    patchState.key = JSON.stringify(req);
    patchState.estimate = d;
    window.qkvPatch = d;
    drawPatch(d, [["estimate", d.values]], `estimate (attribution patching) in ${seconds(d.estimate_seconds)}` +
      " · Exact sweep: one forward pass per cell" + saturatedNote(d));
  });
}

function patchExact() {
  return runPanel(async () => {
    const req = patchRequest();
    const compare = patchState.estimate !== null && patchState.key === JSON.stringify(req);
    const d = await postStream("/api/patch", { ...req, method: "exact", compare });
    window.qkvPatch = d;
    if (d.estimate === null) {
      drawPatch(d, [["exact", d.values]], `exact sweep in ${seconds(d.seconds)}`);
      return;
    }
    const a = d.agreement;
    const agree = a === null ? "agreement undefined"
      : `Spearman ${a.spearman === null ? "undefined" : a.spearman.toFixed(3)} · top-${a.k} recall ${a.recall.toFixed(2)}`;
    drawPatch(d, [["estimate", d.estimate], ["exact", d.values]],
      `estimate ${seconds(d.estimate_seconds)} · exact ${seconds(d.seconds - d.estimate_seconds)} · ${agree}` +
      saturatedNote(d));
  });
}

// One heatmap per [name, values] panel, side by side, on one scale (−1 blue, 0 white, 1 red).
function drawPatch(d, panels, title) {
  const R = d.rows.length, C = d.columns.length, cw = d.site === "head" ? 26 : 40, ch = 16, lw = 60;
  const longest = Math.max(1, ...d.columns.map((c) => label(c).length));
  const top = 46 + Math.min(70, Math.ceil(4.7 * longest));  // room for the column labels, turned 45°
  const panelW = lw + C * cw + 16;
  const legendY = top + R * ch + 8;
  const legendTitle = "0: as corrupt · 1: restores the clean answer";
  const footer = `logit[${esc(label(d.answer))}] − logit[${esc(label(d.wrong))}]: ` +
    `${d.clean_diff.toFixed(2)} clean, ${d.corrupt_diff.toFixed(2)} corrupt · red: restores it`;
  const width = Math.max(panels.length * panelW, legendEnd(lw, legendTitle), 8 + 6.6 * Math.max(title.length, footer.length));
  const height = legendY + 48;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`,
    `<text class="patch-title" x="4" y="14">${esc(title)}</text>`];
  panels.forEach(([name, values], p) => {
    const x0 = p * panelW;
    parts.push(`<g class="patch-panel" data-name="${name}">`);
    parts.push(`<text x="${x0 + lw}" y="32" font-weight="bold">${name}</text>`);
    d.columns.forEach((c, j) => {
      const x = x0 + lw + j * cw + cw / 2;
      parts.push(`<text x="${x}" y="${top - 6}" transform="rotate(-45 ${x} ${top - 6})">${esc(label(c))}</text>`);
    });
    d.rows.forEach((r, i) => {
      const y = top + i * ch;
      parts.push(`<text x="${x0 + lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle">${esc(r.replace("layer ", ""))}</text>`);
      d.columns.forEach((_, j) => {
        const v = values[i][j];
        const fill = v === null ? "#eee" : rgb(patchColour(v));
        parts.push(`<rect class="patch-cell" data-i="${i}" data-j="${j}" x="${x0 + lw + j * cw}" y="${y}" width="${cw - 1}" ` +
          `height="${ch - 1}" fill="${fill}"><title>${name}: ${v === null ? "undefined" : v.toFixed(3)}</title></rect>`);
      });
    });
    parts.push("</g>");
  });
  parts.push(legendParts(lw, legendY, 160, (x) => patchColour(2 * x - 1),
    [[0, "−1"], [0.5, "0"], [1, "1"]], legendTitle));
  parts.push(`<text x="4" y="${height - 6}">${footer}</text>`);
  sizeSvg($("patch"), width, height, parts);
  showView("patch", true);
  window.qkvPatchShown = { panels: panels.map(([name]) => name), title };
}

// ------------------------------------------------------------------ downloads

function sizeSvg(svg, width, height, parts) {
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.innerHTML = parts.join("");
}

// A standalone SVG: the namespace, its size, and the page's text style inlined (no stylesheet).
function svgText(svg) {
  const copy = svg.cloneNode(true);
  copy.setAttribute("xmlns", "http://www.w3.org/2000/svg");
  copy.setAttribute("font-family", "monospace");
  copy.setAttribute("font-size", "11");
  return '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(copy);
}

function save(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function svgToPng(text, width, height) {
  const img = new Image();
  img.src = URL.createObjectURL(new Blob([text], { type: "image/svg+xml" }));
  await img.decode();
  const c = document.createElement("canvas");
  c.width = width;
  c.height = height;
  c.getContext("2d").drawImage(img, 0, 0);
  URL.revokeObjectURL(img.src);
  return new Promise((resolve) => c.toBlob(resolve, "image/png"));
}

async function download(id, format) {
  const el = $(id);
  const name = `qkv-${id}.${format}`;
  const text = svgText(el);
  if (format === "svg") save(new Blob([text], { type: "image/svg+xml" }), name);
  else save(await svgToPng(text, Number(el.getAttribute("width")), Number(el.getAttribute("height"))), name);
}
window.qkvDownloadText = (id) => svgText($(id));

// ------------------------------------------------------------------ quiz: predict, then reveal

// POST /api/quiz/question asks (without the truth), POST /api/quiz/answer (the same model, kind and
// seed) reveals it with the lens's numbers, drawn with the views above (bars, a grid of heads). The
// score counts here.
const quizState = { question: null, reveal: null, right: 0, answered: 0 };

function publishQuiz() {
  window.qkvQuiz = { question: quizState.question, reveal: quizState.reveal, right: quizState.right,
    answered: quizState.answered };
  $("quiz-score").textContent = `score ${quizState.right}/${quizState.answered}`;
}

function askQuestion() {
  return runPanel(async () => {
    const m = currentModel();
    if (!m) throw new Error("Choose a model first.");
    const q = await post("/api/quiz/question", { model: m.id, kind: $("quiz-kind").value || null });
    clearResults();
    hideStart();
    quizState.question = q;
    quizState.reveal = null;
    $("quiz").hidden = false;
    $("quiz-title").textContent = `${q.model} · ${q.title}`;
    $("quiz-question").textContent = q.question;
    const box = $("quiz-choices");
    box.innerHTML = "";
    q.choices.forEach((c, i) => {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "quiz-choice";
      b.dataset.i = String(i);
      b.textContent = `${i + 1}) ${c}`;
      b.addEventListener("click", () => answerQuestion(i));
      box.appendChild(b);
    });
    $("quiz-verdict").hidden = true;
    $("quiz-figure").hidden = true;
    $("quiz-next").hidden = true;
    publishQuiz();
  });
}

function answerQuestion(i) {
  return runPanel(async () => {
    const q = quizState.question;
    if (!q || quizState.reveal) return;
    const r = await post("/api/quiz/answer", { model: q.model, kind: q.kind, seed: q.seed, choice: i });
    quizState.reveal = r;
    quizState.answered += 1;
    if (r.correct) quizState.right += 1;
    for (const b of document.querySelectorAll("#quiz-choices .quiz-choice")) {
      const j = Number(b.dataset.i);
      b.disabled = true;
      b.classList.toggle("truth", j === r.truth);
      b.classList.toggle("wrong", j === r.choice && !r.correct);
    }
    const v = $("quiz-verdict");
    v.textContent = (r.correct ? "Right: " : `Not quite: the answer is ${r.truth + 1}) ${q.choices[r.truth]}. `) + r.explain;
    v.className = r.correct ? "right" : "wrong";
    v.hidden = false;
    renderReveal(q, r);
    $("quiz-figure").hidden = false;
    $("quiz-next").hidden = false;
    publishQuiz();
  });
}

function renderReveal(q, r) {
  const d = r.reveal, svg = $("quiz-reveal");
  if (q.kind === "next") {
    const rows = d.bars.map((b, k) => ({ name: label(b.token), id: b.id, p: b.prob, text: `${(100 * b.prob).toFixed(2)}%`, mark: k === 0 }));
    for (const c of d.choices) {  // a distractor outside the top ten, with its own probability
      if (!d.bars.some((b) => b.id === c.id)) rows.push({ name: label(c.token), id: c.id, p: c.prob, text: `${(100 * c.prob).toFixed(4)}% (a choice)` });
    }
    $("quiz-caption").textContent = "next token: softmax(logits), the top ten (outlined: the likeliest)";
    drawBars(svg, rows);
  } else if (q.kind === "knockout") {
    const top = Math.max(d.loss, d.loss_without) * 1.15;
    drawBars(svg, [{ name: "every head", id: 0, p: d.loss / top, text: `${d.loss.toFixed(4)} nats` },
      { name: `without ${d.head[0]}.${d.head[1]}`, id: 1, p: d.loss_without / top, mark: true,
        text: `${d.loss_without.toFixed(4)} nats (${d.loss_without >= d.loss ? "+" : ""}${(d.loss_without - d.loss).toFixed(4)})` }]);
    $("quiz-caption").textContent = "mean next-token cross-entropy over the text, with and without the head (qkv.lens.ablate)";
  } else if (q.kind === "lens") {
    drawBars(svg, d.rows.map((name, k) => ({ name: name.replace("the embeddings (before block 0)", "embeddings").replace("after ", ""),
      id: k, p: d.prob[k], mark: k === d.first, text: `rank ${d.rank[k]} · p ${d.prob[k].toFixed(3)} · top ${label(d.top[k])}` })));
    $("quiz-caption").textContent = `logit lens: the probability and rank of ${label(d.answer)} after each block (outlined: first ranked top)`;
  } else {
    const L = d.scores.length, H = d.scores[0].length, cw = 52, ch = 22, lw = 64, top = 22;
    const legendY = top + L * ch + 8;
    const width = Math.max(lw + H * cw + 4, legendEnd(lw, "induction score")), height = legendY + 28;
    const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
    for (let h = 0; h < H; h++) parts.push(`<text x="${lw + h * cw + cw / 2}" y="${top - 6}" text-anchor="middle">head ${h}</text>`);
    d.scores.forEach((row, l) => {
      const y = top + l * ch;
      parts.push(`<text x="${lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle">layer ${l}</text>`);
      row.forEach((v, h) => {
        const best = l === d.best[0] && h === d.best[1];
        const c = colormap(VIRIDIS, v);
        parts.push(`<rect class="quiz-cell" data-l="${l}" data-h="${h}" x="${lw + h * cw}" y="${y}" width="${cw - 2}" height="${ch - 2}" ` +
          `fill="${rgb(c)}"${best ? ' stroke="#e8590c" stroke-width="3"' : ""}/>`);
        parts.push(`<text x="${lw + h * cw + cw / 2 - 1}" y="${y + ch / 2}" ` +
          `text-anchor="middle" dominant-baseline="middle" fill="${ink(c)}">${v.toFixed(2)}</text>`);
      });
    });
    parts.push(viridisLegend(lw, legendY, 1, "induction score"));
    sizeSvg(svg, width, height, parts);
    $("quiz-caption").textContent = "induction score of every head (Olsson et al. 2022; outlined: the highest)";
  }
}

function initLens() {
  $("lens-go").addEventListener("click", () => { lensState.ablated = []; lookInside(); });
  $("lens-temperature").addEventListener("input", () => lensState.data && lensState.data.logits && renderBars());
  $("grid").addEventListener("click", onGridClick);
  $("grid").addEventListener("mousemove", onGridHover);
  $("grid").addEventListener("mouseleave", () => { $("hover").hidden = true; });
  $("clear-ablation").addEventListener("click", () => { lensState.ablated = []; lookInside(); });
  $("qk-go").addEventListener("click", computeQK);
  $("history-step").addEventListener("input", () => lensState.history && renderHistory());
  $("history-type").addEventListener("change", () => lensState.history && renderHistory());
  $("rollout-sink").addEventListener("change", () => lensState.data && lensState.data.rollout && renderRollout());
  $("patch-go").addEventListener("click", patchPrompts);
  $("patch-exact").addEventListener("click", patchExact);
  let resize = null;  // the grid follows the page's width
  window.addEventListener("resize", () => {
    clearTimeout(resize);
    resize = setTimeout(() => { if (lensState.data && !$("lens").hidden) renderGrid(); }, 150);
  });
  $("quiz-go").addEventListener("click", askQuestion);
  $("quiz-next").addEventListener("click", askQuestion);
  for (const b of document.querySelectorAll("button[data-download]")) {
    b.addEventListener("click", () => download(b.dataset.download, b.dataset.format));
  }
}

document.addEventListener("DOMContentLoaded", initLens);
