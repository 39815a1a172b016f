// qkv attention explorer: talks to the JSON API of qkv/serve/app.py, draws with SVG and canvas.
// No framework and no build step; nothing is fetched from outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { models: [], model: null, attention: null, steps: [], busy: false };

// ------------------------------------------------------------------ small helpers

const VIRIDIS = [[68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [110, 206, 88], [181, 222, 43], [253, 231, 37]];
const INFERNO = [[0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99], [212, 72, 66],
  [245, 125, 21], [250, 193, 39], [252, 255, 164]];

function colormap(table, x) {
  const t = Math.min(1, Math.max(0, x)) * (table.length - 1);
  const i = Math.min(table.length - 2, Math.floor(t));
  const f = t - i;
  return table[i].map((c, k) => Math.round(c + f * (table[i + 1][k] - c)));
}

function rgb(c) { return `rgb(${c[0]},${c[1]},${c[2]})`; }

// WCAG 2.x relative luminance of an sRGB colour [r, g, b] (0..255).
function luminance(c) {
  const lin = (v) => { const s = v / 255; return s <= 0.04045 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * lin(c[0]) + 0.7152 * lin(c[1]) + 0.0722 * lin(c[2]);
}

// The ink for text on a cell of colour c: black or white, whichever contrasts more (WCAG's ratio
// (L1 + 0.05) / (L2 + 0.05)). One of the two always reaches 4.58:1, above AA's 4.5:1; the choice
// follows the colour as rendered, not the value it encodes.
function ink(c) {
  const L = luminance(c);
  return (L + 0.05) / 0.05 >= 1.05 / (L + 0.05) ? "black" : "white";
}

// A translucent colour [r, g, b] at alpha a painted over an opaque background (white by default).
function over(c, a, bg = [255, 255, 255]) {
  return c.map((v, k) => Math.round(a * v + (1 - a) * bg[k]));
}

// A colour legend as SVG: `n` swatches of colourAt(0..1) across `w` px at (x, y), tick labels
// below ([fraction, text] pairs), the title to the right. Drawn inside each heatmap's SVG so
// that a download keeps it.
function legendParts(x, y, w, colourAt, ticks, title) {
  const n = 40, parts = ['<g class="legend">'];
  for (let i = 0; i < n; i++) {
    parts.push(`<rect x="${(x + (i * w) / n).toFixed(2)}" y="${y}" width="${(w / n + 0.5).toFixed(2)}" ` +
      `height="10" fill="${rgb(colourAt((i + 0.5) / n))}"/>`);
  }
  parts.push(`<rect x="${x}" y="${y}" width="${w}" height="10" fill="none" stroke="#596070" stroke-width="0.5"/>`);
  for (const [f, t] of ticks) {
    parts.push(`<text x="${(x + f * w).toFixed(1)}" y="${y + 22}" text-anchor="middle" font-size="10">${esc(t)}</text>`);
  }
  if (title) parts.push(`<text x="${x + w + 10}" y="${y + 9}" font-size="10">${esc(title)}</text>`);
  parts.push("</g>");
  return parts.join("");
}

// Where a legend drawn at x with this title ends (10 px monospace: about 6.1 px a character).
function legendEnd(x, title) { return x + 180 + Math.ceil(6.2 * (title || "").length); }

// viridis from 0 to max: the legend of the attention heatmaps
function viridisLegend(x, y, max, title) {
  const f = (v) => (max >= 0.1 ? v.toFixed(2) : v.toPrecision(2));
  return legendParts(x, y, 160, (t) => colormap(VIRIDIS, t), [[0, "0"], [0.5, f(max / 2)], [1, f(max)]], title);
}

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

// A token as a label: whitespace made visible, long tokens shortened.
function label(tok) {
  let s = tok.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "");
  if (s.trim() === "") return s.length ? "␣".repeat(Math.min(s.length, 4)) : "∅";
  s = s.trim();
  return s.length > 14 ? s.slice(0, 13) + "…" : s;
}

function nextPaint() {
  return new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
}

function setState(s) { document.body.dataset.state = s; }

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
  setState("error");
}

function clearError() { $("error").hidden = true; $("error").textContent = ""; }

// The first view (where to start) gives way to the first result.
function hideStart() { $("start").hidden = true; }

// Results of an earlier request must not pass for the answer to a new one.
function clearResults() {
  for (const id of ["views", "generation", "image-view", "notes", "hover", "lens", "quiz"]) $(id).hidden = true;
  $("timing").textContent = "";
  state.attention = null;
}

function showNotes(notes) {
  const box = $("notes");
  box.hidden = !notes || notes.length === 0;
  box.textContent = (notes || []).map((n) => "Note: " + n).join("  ·  ");
}

// This browser's id for the server's fair queue (one turn per student, not per request).
const CLIENT_ID = (() => {
  try {
    let id = localStorage.getItem("qkv-client");
    if (!id) {
      id = Array.from(crypto.getRandomValues(new Uint8Array(12)), (b) => b.toString(16).padStart(2, "0")).join("");
      localStorage.setItem("qkv-client", id);
    }
    return id;
  } catch (e) {
    return "";  // no storage: the server goes by the address
  }
})();

// fetch + JSON; an error response becomes an Error carrying the API's message.
async function api(path, options) {
  let response;
  options = options || {};
  if (CLIENT_ID) options = { ...options, headers: { ...(options.headers || {}), "X-QKV-Client": CLIENT_ID } };
  try {
    response = await fetch(path, options);
  } catch (e) {
    throw new Error(`cannot reach the server (${e.message}); is qkv serve still running?`);
  }
  if (!response.ok) throw new Error(await errorText(response));
  return response;
}

// The events of an application/x-ndjson response (generation, the lens's waits), one parsed line
// at a time, as they arrive.
async function* ndjsonEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (line) yield JSON.parse(line);
    }
  }
}

async function errorText(response) {
  let detail = "";
  try {
    const body = await response.json();
    detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch (e) { detail = response.statusText; }
  return `Error ${response.status}: ${detail || "request failed"}`;
}

function setBusy(busy) {
  state.busy = busy;
  for (const id of ["show", "generate", "upload", "lens-go", "qk-go", "patch-go"]) $(id).disabled = busy;
  if (busy) setState("loading");
}

// ------------------------------------------------------------------ models

async function loadModels() {
  try {
    const data = await (await api("/api/models")).json();
    state.models = data.models;
    state.limits = data.limits;
    const select = $("model");
    select.innerHTML = "";
    for (const m of data.models) {
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = `${m.id} (${m.kind})`;
      select.appendChild(opt);
    }
    $("n-new").max = data.limits.max_new_tokens;
    $("status").textContent = `${data.models.length} models · runs from ${data.runs_dir}`;
    if (data.models.length === 0) showError("No models: install one (qkv assets install minilm) or train a run.");
    onModelChange();
    setState("ready");
  } catch (e) {
    showError(e.message);
  }
}

function currentModel() { return state.models.find((m) => m.id === $("model").value) || null; }

function onModelChange() {
  const m = currentModel();
  state.model = m;
  if (!m) return;
  $("model-kind").textContent = m.description;
  $("text-input").hidden = m.input !== "text";
  $("image-input").hidden = m.input !== "image";
  $("generate-controls").hidden = !m.can_generate;
  $("lens-go").hidden = m.kind !== "decoder" && m.kind !== "encoder";
  $("quiz-controls").hidden = m.kind !== "decoder";  // the quiz asks about next tokens and heads of a decoder
  $("start-quiz").hidden = m.kind !== "decoder";  // the first view names only buttons the page shows
  $("view-controls").hidden = m.kind === "seq2seq" || m.family === "captioner";
  $("head").parentElement.hidden = m.kind === "image";
  $("show-lines").parentElement.hidden = m.kind === "image";
  fillSelect($("layer"), null, "last");
  fillSelect($("head"), null, "mean of heads");
}

function fillSelect(select, n, first) {
  const keep = select.value;
  select.innerHTML = `<option value="">${first}</option>`;
  for (let i = 0; i < (n || 0); i++) select.insertAdjacentHTML("beforeend", `<option value="${i}">${i}</option>`);
  if (keep !== "" && Number(keep) < (n || 0)) select.value = keep;
}

function chosen(select) { return select.value === "" ? null : Number(select.value); }

// ------------------------------------------------------------------ text attention

async function showAttention() {
  clearError();
  const m = currentModel();
  if (!m) { showError("Choose a model first."); return; }
  setBusy(true);
  const t0 = performance.now();
  try {
    const body = { model: m.id, text: $("text").value, layer: chosen($("layer")), head: chosen($("head")) };
    const response = await api("/api/attention", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const data = await response.json();
    const t1 = performance.now();
    state.attention = data;
    $("generation").hidden = true;
    $("image-view").hidden = true;
    renderAttention(data);
    await nextPaint();
    const t2 = performance.now();
    window.qkvTiming = { request_ms: t1 - t0, render_ms: t2 - t1, total_ms: t2 - t0,
      tokens: data.key_tokens.length, server_ms: data.seconds * 1000 };
    $("timing").textContent = `${data.query_tokens.length}×${data.key_tokens.length} weights · request ` +
      `${(t1 - t0).toFixed(0)} ms (model ${(data.seconds * 1000).toFixed(0)} ms) · render ${(t2 - t1).toFixed(0)} ms`;
    setState("ready");
  } catch (e) {
    clearResults();
    showError(e.message);
  } finally {
    setBusy(false);
  }
}

function renderAttention(data) {
  hideStart();
  showNotes(data.notes);
  if (data.layer !== null) {
    fillSelect($("layer"), data.n_layers, "last");
    fillSelect($("head"), data.n_heads, "mean of heads");
  }
  const what = data.kind === "seq2seq"
    ? `alignment: output "${data.output}" (rows) × input (columns)`
    : `layer ${data.layer}, ${data.head === null ? "mean of " + data.n_heads + " heads" : "head " + data.head}` +
      ` · rows attend to columns${data.causal ? " (causal: no looking ahead)" : ""}`;
  let max = 0;
  for (const r of data.weights) for (const v of r) if (v > max) max = v;
  $("heatmap-caption").textContent = `${what} · colour: 0 (dark) to ${max.toFixed(3)} (yellow)`;
  $("views").hidden = false;
  renderHeatmap(data);
  $("lines-figure").hidden = !$("show-lines").checked;
  if ($("show-lines").checked) renderLines(data); else $("lines").innerHTML = "";
}

function renderHeatmap(data) {
  const svg = $("heatmap");
  const T = data.query_tokens.length, S = data.key_tokens.length;
  const n = Math.max(T, S);
  const cell = Math.max(3, Math.min(28, Math.floor(640 / n)));
  const showLabels = cell >= 8;
  const font = Math.min(11, cell);
  const rows = data.query_tokens.map(label), cols = data.key_tokens.map(label);
  const longest = Math.max(1, ...rows.map((s) => s.length), ...cols.map((s) => s.length));
  const margin = showLabels ? Math.min(110, 8 + longest * font * 0.62) : 8;
  let max = 0;
  for (const r of data.weights) for (const v of r) if (v > max) max = v;
  max = max || 1;
  const parts = [];
  for (let i = 0; i < T; i++) {
    const y = margin + i * cell;
    const r = data.weights[i];
    for (let j = 0; j < S; j++) {
      parts.push(`<rect class="cell" data-q="${i}" data-k="${j}" x="${margin + j * cell}" y="${y}" ` +
        `width="${cell}" height="${cell}" fill="${rgb(colormap(VIRIDIS, r[j] / max))}"/>`);
    }
  }
  if (showLabels) {
    rows.forEach((s, i) => parts.push(`<text class="token query" data-i="${i}" x="${margin - 4}" ` +
      `y="${margin + i * cell + cell / 2}" text-anchor="end" dominant-baseline="middle" font-size="${font}">${esc(s)}</text>`));
    cols.forEach((s, j) => {
      const x = margin + j * cell + cell / 2;
      parts.push(`<text class="token key" data-j="${j}" x="${x}" y="${margin - 4}" text-anchor="start" ` +
        `dominant-baseline="middle" font-size="${font}" transform="rotate(-90 ${x} ${margin - 4})">${esc(s)}</text>`);
    });
  }
  const legendY = margin + T * cell + 10;
  parts.push(viridisLegend(margin, legendY, max, "attention weight"));
  const width = Math.max(margin + S * cell + 4, legendEnd(margin, "attention weight")), height = legendY + 28;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("shape-rendering", "crispEdges");
  svg.innerHTML = parts.join("");
}

// bertviz-style: queries on the left, keys on the right, a line per weight above 1%.
function renderLines(data) {
  const svg = $("lines");
  const T = data.query_tokens.length, S = data.key_tokens.length;
  const rowH = Math.max(9, Math.min(18, Math.floor(900 / Math.max(T, S))));
  const font = Math.min(12, rowH - 1);
  const colW = 110, gap = 160;
  const parts = [];
  for (let i = 0; i < T; i++) {
    const r = data.weights[i];
    for (let j = 0; j < S; j++) {
      if (r[j] < 0.01) continue;
      parts.push(`<line data-q="${i}" data-k="${j}" x1="${colW}" y1="${(i + 0.5) * rowH}" x2="${colW + gap}" ` +
        `y2="${(j + 0.5) * rowH}" stroke-opacity="${Math.min(1, r[j]).toFixed(3)}" stroke-width="2"/>`);
    }
  }
  data.query_tokens.forEach((t, i) => parts.push(`<text class="token query" data-i="${i}" x="${colW - 6}" ` +
    `y="${(i + 0.5) * rowH}" text-anchor="end" dominant-baseline="middle" font-size="${font}">${esc(label(t))}</text>`));
  data.key_tokens.forEach((t, j) => parts.push(`<text class="token key" data-j="${j}" x="${colW + gap + 6}" ` +
    `y="${(j + 0.5) * rowH}" dominant-baseline="middle" font-size="${font}">${esc(label(t))}</text>`));
  const width = 2 * colW + gap, height = Math.max(T, S) * rowH + 4;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.innerHTML = parts.join("");
}

// ------------------------------------------------------------------ hover panel

function topOf(values, labels, k) {
  return values.map((v, i) => [v, i]).sort((a, b) => b[0] - a[0]).slice(0, k)
    .map(([v, i]) => ({ token: labels[i], index: i, weight: v }));
}

function showPanel(event, title, top) {
  const panel = $("hover");
  const rows = top.map((t) => `<tr><td>${esc(label(t.token))}</td><td>#${t.index}</td>` +
    `<td><span class="bar" data-w="${t.weight}"></span></td><td class="weight">${t.weight.toFixed(3)}</td></tr>`);
  panel.innerHTML = `<div><b>${esc(title)}</b></div><table>${rows.join("")}</table>`;
  for (const bar of panel.querySelectorAll(".bar")) bar.style.width = `${Math.round(80 * Number(bar.dataset.w))}px`;
  panel.hidden = false;
  movePanel(event);
}

function movePanel(event) {
  const panel = $("hover");
  const x = Math.min(event.clientX + 16, window.innerWidth - panel.offsetWidth - 8);
  const y = Math.min(event.clientY + 16, window.innerHeight - panel.offsetHeight - 8);
  panel.style.left = `${Math.max(4, x)}px`;
  panel.style.top = `${Math.max(4, y)}px`;
}

function hidePanel() {
  $("hover").hidden = true;
  const lines = $("lines");
  lines.classList.remove("focus");
  for (const el of document.querySelectorAll(".on, .active")) el.classList.remove("on", "active");
}

function onHover(event) {
  const data = state.attention;
  const el = event.target;
  if (!data || !el.classList) return;
  if (el.classList.contains("cell")) {
    const i = Number(el.dataset.q), j = Number(el.dataset.k);
    const w = data.weights[i][j];
    showPanel(event, `${label(data.query_tokens[i])} → ${label(data.key_tokens[j])}: ${w.toFixed(3)}`,
      topOf(data.weights[i], data.key_tokens, 5));
  } else if (el.classList.contains("query")) {
    const i = Number(el.dataset.i);
    highlight(el, `line[data-q="${i}"]`);
    showPanel(event, `"${label(data.query_tokens[i])}" attends to`, topOf(data.weights[i], data.key_tokens, 5));
  } else if (el.classList.contains("key")) {
    const j = Number(el.dataset.j);
    highlight(el, `line[data-k="${j}"]`);
    showPanel(event, `attending to "${label(data.key_tokens[j])}"`,
      topOf(data.weights.map((r) => r[j]), data.query_tokens, 5));
  }
}

function highlight(el, selector) {
  el.classList.add("active");
  const lines = $("lines");
  lines.classList.add("focus");
  for (const line of lines.querySelectorAll(selector)) line.classList.add("on");
}

// ------------------------------------------------------------------ generation

async function generate() {
  clearError();
  const m = currentModel();
  setBusy(true);
  clearResults();
  const out = $("generated");
  out.innerHTML = "";
  state.steps = [];
  $("generation").hidden = false;
  $("generation-status").textContent = "generating…";
  try {
    const number = (id) => ($(id).value === "" ? null : Number($(id).value));
    const body = { model: m.id, prompt: $("text").value, max_new_tokens: Number($("n-new").value) || 20,
      layer: chosen($("layer")), head: chosen($("head")), temperature: number("gen-temperature") || 0,
      top_k: number("gen-top-k"), seed: number("gen-seed") };
    const response = await api("/api/generate", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    for await (const ev of ndjsonEvents(response)) onEvent(ev);
  } catch (e) {
    if (state.steps.length === 0) clearResults();
    showError(e.message);
  } finally {
    setBusy(false);
    if ($("error").hidden) setState("ready");
  }
}

function onEvent(ev) {
  if (ev.event === "start") {
    showNotes(ev.notes);
    fillSelect($("layer"), ev.n_layers, "last");
    fillSelect($("head"), ev.n_heads, "mean of heads");
    $("generation-status").textContent = `layer ${ev.layer}, ${ev.head === undefined ? "mean of heads" : "head " + ev.head}`;
    ev.tokens.forEach((t) => addToken(t, null));
  } else if (ev.event === "token") {
    const span = addToken(ev.token, ev.weights);
    shade(span, ev.weights);
  } else if (ev.event === "done") {
    hideStart();
    const n = state.steps.filter((s) => s.weights).length;
    $("generation-status").textContent += ` · ${n} new tokens in ${ev.seconds.toFixed(2)} s`;
  } else if (ev.event === "error") {
    showError(`Generation stopped: ${ev.detail}`);
  }
}

function addToken(text, weights) {
  const span = document.createElement("span");
  span.textContent = text.replace(/\n/g, "↵\n");  // a newline token stays visible (and hoverable)
  span.dataset.index = String(state.steps.length);
  if (weights) {
    span.className = "new";
    span.addEventListener("mouseenter", () => shade(span, weights));
  } else {
    span.className = "prompt";
  }
  state.steps.push({ text, weights });
  $("generated").appendChild(span);
  return span;
}

// Shade every earlier token by the attention the chosen token's position paid to it.
function shade(span, weights) {
  const spans = $("generated").children;
  const max = Math.max(...weights) || 1;
  for (let i = 0; i < spans.length; i++) {
    const w = i < weights.length ? weights[i] / max : 0;
    const bg = over([59, 91, 219], Number((0.75 * w).toFixed(3)));  // the shading, as painted on white
    spans[i].style.backgroundColor = w > 0.02 ? rgb(bg) : "";
    spans[i].style.color = w > 0.02 ? ink(bg) : "";  // black or white by the shading's luminance
    spans[i].classList.remove("current");
  }
  span.classList.add("current");
}

// ------------------------------------------------------------------ images

async function uploadImage() {
  clearError();
  const m = currentModel();
  const file = $("image").files[0];
  if (!file) { showError("Choose an image file first."); return; }
  setBusy(true);
  const t0 = performance.now();
  try {
    const form = new FormData();
    form.append("model", m.id);
    form.append("image", file);
    const layer = chosen($("layer"));
    if (layer !== null && m.family === "vit") form.append("layer", String(layer));
    const data = await (await api("/api/image-attention", { method: "POST", body: form })).json();
    $("views").hidden = true;
    $("generation").hidden = true;
    renderImage(data);
    await nextPaint();
    $("timing").textContent = `image attention in ${(performance.now() - t0).toFixed(0)} ms`;
    setState("ready");
  } catch (e) {
    clearResults();
    showError(e.message);
  } finally {
    setBusy(false);
  }
}

function renderImage(data) {
  hideStart();
  showNotes(data.notes);
  if (data.family === "vit") fillSelect($("layer"), data.details.n_layers, "last");
  $("image-title").textContent = data.family === "vit" ? `prediction: ${data.title}` : `caption: ${data.title}`;
  const box = $("image-maps");
  box.innerHTML = "";
  box.appendChild(imageFigure(data, null, "image"));
  for (const map of data.maps) box.appendChild(imageFigure(data, map.weights, map.label));
  $("image-view").hidden = false;
}

function imageFigure(data, weights, caption) {
  const { width, height, channels, pixels } = data.image;
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(width, height);
  for (let p = 0; p < width * height; p++) {
    for (let c = 0; c < 3; c++) img.data[4 * p + c] = pixels[p * channels + (channels === 1 ? 0 : c)];
    img.data[4 * p + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
  if (weights) {
    const g = weights.length;
    let max = 0;
    for (const r of weights) for (const v of r) max = Math.max(max, v);
    ctx.globalAlpha = 0.6;
    for (let i = 0; i < g; i++) {
      for (let j = 0; j < g; j++) {
        ctx.fillStyle = rgb(colormap(INFERNO, weights[i][j] / (max || 1)));
        ctx.fillRect((j * width) / g, (i * height) / g, width / g, height / g);
      }
    }
  }
  const fig = document.createElement("figure");
  fig.appendChild(canvas);
  const cap = document.createElement("figcaption");
  cap.textContent = caption;
  fig.appendChild(cap);
  return fig;
}

// ------------------------------------------------------------------ the first view

// A sketch of what a heatmap shows: five tokens, a head that looks one token back (the first
// token looks at itself). Drawn with the same colours, ink and legend as the real views.
function renderStartExample() {
  const toks = ["The", "cat", "sat", "on", "the"], n = toks.length, cell = 34, lw = 40, top = 40;
  const width = lw + n * cell + 80, height = top + n * cell + 40;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  toks.forEach((t, j) => parts.push(`<text x="${lw + j * cell + cell / 2}" y="${top - 8}" text-anchor="middle">${t}</text>`));
  for (let i = 0; i < n; i++) {
    parts.push(`<text x="${lw - 4}" y="${top + i * cell + cell / 2}" text-anchor="end" dominant-baseline="middle">${toks[i]}</text>`);
    for (let j = 0; j < n; j++) {
      const w = j > i ? 0 : i === 0 ? 1 : j === i - 1 ? 0.8 : 0.2 / i;
      const c = colormap(VIRIDIS, w);
      parts.push(`<rect x="${lw + j * cell}" y="${top + i * cell}" width="${cell - 1}" height="${cell - 1}" fill="${rgb(c)}"/>`);
      if (j <= i) parts.push(`<text x="${lw + j * cell + cell / 2}" y="${top + i * cell + cell / 2}" text-anchor="middle" ` +
        `dominant-baseline="middle" font-size="10" fill="${ink(c)}">${w.toFixed(2)}</text>`);
    }
  }
  parts.push(`<text x="${lw + n * cell + 6}" y="${top + cell / 2}" dominant-baseline="middle" font-size="10">← a row:</text>`);
  parts.push(`<text x="${lw + n * cell + 6}" y="${top + cell / 2 + 12}" dominant-baseline="middle" font-size="10">sums to 1</text>`);
  parts.push(`<text x="4" y="14" font-size="10">rows: queries · columns: the keys they look at</text>`);
  parts.push(viridisLegend(lw, top + n * cell + 8, 1, "weight"));
  const svg = $("start-example");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.innerHTML = parts.join("");
}

function runExample(button) {
  $("text").value = button.dataset.text;
  if (button.dataset.example === "lens" && !$("lens-go").hidden) $("lens-go").click();
  else $("show").click();
}

// ------------------------------------------------------------------ wiring

function init() {
  $("model").addEventListener("change", () => { onModelChange(); clearError(); clearResults(); });
  $("show").addEventListener("click", showAttention);
  $("generate").addEventListener("click", generate);
  $("upload").addEventListener("click", uploadImage);
  const refresh = () => {
    const m = currentModel();
    if (!m || state.busy) return;
    if (m.input === "image") { if ($("image").files[0]) uploadImage(); } else if (state.attention) showAttention();
  };
  $("layer").addEventListener("change", refresh);
  $("head").addEventListener("change", refresh);
  $("show-lines").addEventListener("change", () => state.attention && renderAttention(state.attention));
  for (const id of ["heatmap", "lines"]) {
    $(id).addEventListener("mouseover", onHover);
    $(id).addEventListener("mousemove", (e) => { if (!$("hover").hidden) movePanel(e); });
    $(id).addEventListener("mouseleave", hidePanel);
    $(id).addEventListener("mouseout", (e) => { if (e.target.classList && !e.target.classList.contains("cell")) hidePanel(); });
  }
  renderStartExample();
  for (const b of document.querySelectorAll("#start button[data-example]")) b.addEventListener("click", () => runExample(b));
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) showAttention();
  });
  loadModels();
}

document.addEventListener("DOMContentLoaded", init);
