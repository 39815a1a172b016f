// qkv explorer: what attention does (POST /api/lens). Next-token bars with a temperature slider
// (softmax(z / T) computed here from the logits the server sends), the logit lens, every head as a
// thumbnail (click to open it, or to knock it out), and SVG / PNG downloads of every view.
// Uses app.js's helpers ($, api, label, esc, colormap, VIRIDIS, rgb, state, ...).
"use strict";

const lensState = { data: null, ablated: [], history: null };

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
    const data = await post("/api/lens", { model: m.id, text: $("text").value, ablate: lensState.ablated });
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

function renderLens() {
  const d = lensState.data;
  showNotes(d.notes);
  $("lens").hidden = false;
  $("probs-figure").hidden = d.logits === null;
  $("patch-figure").hidden = d.logits === null;  // patching measures a next-token answer
  $("lens-figure").hidden = d.lens === null;
  if (d.logits !== null) renderBars();
  if (d.lens !== null) renderLensTable();
  $("rollout-figure").hidden = !d.rollout;
  if (d.rollout) renderRollout();
  renderGrid();
  $("history-figure").hidden = !lensState.history;
  if (lensState.history) {
    $("history-step").max = String(lensState.history.steps.length - 1);
    $("history-step").value = String(lensState.history.steps.length - 1);
    renderHistory();
  }
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
  const width = lw + (T - first) * cw + 4, height = top + L * ch + 4;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  for (let t = first; t < T; t++) {
    const x = lw + (t - first) * cw + cw / 2;
    parts.push(`<text x="${x}" y="${top - 6}" transform="rotate(-45 ${x} ${top - 6})">${esc(label(d.tokens[t]))}</text>`);
  }
  for (let r = 0; r < L; r++) {
    const y = top + r * ch;
    parts.push(`<text x="${lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle">${esc(d.lens.rows[r])}</text>`);
    for (let t = first; t < T; t++) {
      const p = d.lens.prob[r][t - first];
      const c = colormap(VIRIDIS, p);
      const x = lw + (t - first) * cw;
      parts.push(`<rect class="lens-cell" data-r="${r}" data-t="${t}" x="${x}" y="${y}" width="${cw - 1}" height="${ch - 1}" fill="${rgb(c)}"/>`);
      parts.push(`<text x="${x + cw / 2}" y="${y + ch / 2}" text-anchor="middle" dominant-baseline="middle" ` +
        `fill="${p > 0.5 ? "black" : "white"}" font-size="9">${esc(label(d.lens.top[r][t - first]).slice(0, 8))}</text>`);
    }
  }
  sizeSvg($("lens-table"), width, height, parts);
}

// ------------------------------------------------------------------ attention rollout

function renderRollout() {
  const d = lensState.data, R = d.rollout.positions.length, T = d.tokens.length;
  const cw = Math.max(6, Math.min(16, Math.floor(640 / T))), ch = 14, lw = 110, top = 70;
  const width = lw + T * cw + 8, height = top + R * ch + 6;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  if (cw >= 10) {
    d.tokens.forEach((tok, j) => {
      const x = lw + j * cw + cw / 2;
      parts.push(`<text x="${x}" y="${top - 6}" transform="rotate(-60 ${x} ${top - 6})" font-size="9">${esc(label(tok)).slice(0, 10)}</text>`);
    });
  }
  const sink = $("rollout-sink").checked;  // LLMs park most attention on the first token
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
  window.qkvRollout = d.rollout;
  sizeSvg($("rollout"), width, height, parts);
}

// ------------------------------------------------------------------ every head

const TYPE_MARK = { previous: "P", first: "F", duplicate: "D", induction: "I" };

function renderGrid() {
  const d = lensState.data;
  const L = d.n_layers, H = d.n_heads, cell = 34, gap = 3, left = 28, top = 16;
  const canvas = $("grid");
  canvas.width = left + H * (cell + gap);
  canvas.height = top + L * (cell + gap);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "white";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.font = "10px monospace";
  ctx.fillStyle = "#1d2330";
  for (let h = 0; h < H; h++) ctx.fillText(String(h), left + h * (cell + gap) + cell / 2 - 3, 11);
  const ablated = new Set(d.ablated.map(([l, h]) => `${l}.${h}`));
  for (let l = 0; l < L; l++) {
    ctx.fillStyle = "#1d2330";
    ctx.fillText(String(l), 4, top + l * (cell + gap) + cell / 2 + 3);
    for (let h = 0; h < H; h++) {
      const x0 = left + h * (cell + gap), y0 = top + l * (cell + gap);
      if (d.thumbs) {
        const m = d.thumbs[l * H + h], n = m.length;
        let max = 0;
        for (const r of m) for (const v of r) max = Math.max(max, v);
        for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
          ctx.fillStyle = rgb(colormap(VIRIDIS, m[i][j] / (max || 1)));
          ctx.fillRect(x0 + (j * cell) / n, y0 + (i * cell) / n, cell / n + 0.5, cell / n + 0.5);
        }
      }
      const type = d.labels[l][h];
      if (type) {
        ctx.fillStyle = "rgba(255,255,255,0.85)";
        ctx.fillRect(x0 + cell - 11, y0, 11, 11);
        ctx.fillStyle = "#c92a2a";
        ctx.fillText(TYPE_MARK[type], x0 + cell - 9, y0 + 9);
      }
      if (ablated.has(`${l}.${h}`)) {
        ctx.strokeStyle = "#ff2d55";
        ctx.lineWidth = 2;
        ctx.beginPath();
        ctx.moveTo(x0, y0); ctx.lineTo(x0 + cell, y0 + cell);
        ctx.moveTo(x0 + cell, y0); ctx.lineTo(x0, y0 + cell);
        ctx.stroke();
      }
    }
  }
  canvas.dataset.cell = String(cell + gap);
  canvas.dataset.left = String(left);
  canvas.dataset.top = String(top);
}

function headAt(event) {
  const c = $("grid"), d = lensState.data;
  const r = c.getBoundingClientRect();
  const x = (event.clientX - r.left) * (c.width / r.width) - Number(c.dataset.left);
  const y = (event.clientY - r.top) * (c.height / r.height) - Number(c.dataset.top);
  const step = Number(c.dataset.cell);
  const h = Math.floor(x / step), l = Math.floor(y / step);
  return l >= 0 && l < d.n_layers && h >= 0 && h < d.n_heads ? [l, h] : null;
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
  const rows = Object.entries(d.scores).map(([t, s]) => ({ token: t, index: `${l}.${h}`, weight: s[l][h] }));
  showPanel(event, `head ${l}.${h}${d.labels[l][h] ? " · " + d.labels[l][h] + " head" : ""}`, rows);
}

// ------------------------------------------------------------------ heads during training

function renderHistory() {
  const h = lensState.history, i = Number($("history-step").value), type = $("history-type").value;
  const m = h.scores[type][i], L = m.length, H = m[0].length, cell = 26, lw = 60, top = 24;
  const width = lw + H * cell + 8, height = top + L * cell + 30;
  const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
  for (let hh = 0; hh < H; hh++) parts.push(`<text x="${lw + hh * cell + cell / 2}" y="${top - 6}" text-anchor="middle">${hh}</text>`);
  for (let l = 0; l < L; l++) {
    parts.push(`<text x="${lw - 4}" y="${top + l * cell + cell / 2}" text-anchor="end" dominant-baseline="middle">layer ${l}</text>`);
    for (let hh = 0; hh < H; hh++) {
      const v = m[l][hh];
      parts.push(`<rect class="history-cell" data-l="${l}" data-h="${hh}" x="${lw + hh * cell}" y="${top + l * cell}" ` +
        `width="${cell - 1}" height="${cell - 1}" fill="${rgb(colormap(VIRIDIS, v))}"><title>${v.toFixed(3)}</title></rect>`);
    }
  }
  const step = h.steps[i];
  const copying = h.copying === null ? "not yet" : `from step ${h.copying}`;
  parts.push(`<text x="4" y="${height - 8}">${type} scores at step ${step} (colour 0 to 1) · loss ${h.loss_first[i].toFixed(2)} ` +
    `first copy, ${h.loss_second[i].toFixed(2)} repeat · copying ${copying}</text>`);
  $("history-label").textContent = `step ${step}`;
  window.qkvHistoryShown = { step, type, scores: m };
  sizeSvg($("history"), Math.max(width, 720), height, parts);
}

// ------------------------------------------------------------------ q·k and patching

async function post(path, body) {
  return (await api(path, { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) })).json();
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
    const d = await post("/api/qk", { model: m.id, text: $("text").value, layer: Number($("qk-layer").value),
      head: Number($("qk-head").value), query: Number($("qk-query").value) });
    window.qkvQK = d;
    const rowH = 18, lw = 110, nums = 190, barW = 160, width = lw + nums + barW + 60, top = 22;
    const height = top + d.keys.length * rowH + 6;
    const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`,
      `<text x="4" y="14">layer ${d.layer} head ${d.head}, query "${esc(label(d.query_token))}" #${d.query}: ` +
      `q·k, ÷ √${d.head_dim}, softmax</text>`];
    d.keys.forEach((k, j) => {
      const y = top + j * rowH;
      parts.push(`<text x="${lw - 6}" y="${y + rowH / 2}" text-anchor="end" dominant-baseline="middle">${esc(label(k))} #${j}</text>`);
      parts.push(`<text class="qk-row" data-j="${j}" x="${lw}" y="${y + rowH / 2}" dominant-baseline="middle">` +
        `${d.dots[j].toFixed(2).padStart(8)} ${d.scaled[j].toFixed(3).padStart(8)}</text>`);
      parts.push(`<rect x="${lw + nums}" y="${y + 4}" width="${(barW * d.weights[j]).toFixed(1)}" height="${rowH - 8}" fill="#3b5bdb"/>`);
      parts.push(`<text x="${lw + nums + barW * d.weights[j] + 4}" y="${y + rowH / 2}" dominant-baseline="middle">${d.weights[j].toFixed(3)}</text>`);
    });
    sizeSvg($("qk"), width, height, parts);
  });
}

function patchPrompts() {
  return runPanel(async () => {
    const m = currentModel();
    const opt = (id) => ($(id).value.trim() === "" ? null : $(id).value);
    const d = await post("/api/patch", { model: m.id, clean: $("text").value, corrupt: $("patch-corrupt").value,
      site: $("patch-site").value, answer: opt("patch-answer"), wrong: opt("patch-wrong") });
    window.qkvPatch = d;
    const R = d.rows.length, C = d.columns.length, cw = d.site === "head" ? 26 : 40, ch = 16, lw = 60, top = 70;
    const width = lw + C * cw + 8, height = top + R * ch + 24;
    const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
    d.columns.forEach((c, j) => {
      const x = lw + j * cw + cw / 2;
      parts.push(`<text x="${x}" y="${top - 6}" transform="rotate(-45 ${x} ${top - 6})">${esc(label(c))}</text>`);
    });
    d.rows.forEach((r, i) => {
      const y = top + i * ch;
      parts.push(`<text x="${lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle">${esc(r.replace("layer ", ""))}</text>`);
      d.columns.forEach((_, j) => {
        const v = d.values[i][j];
        const a = v === null ? 0 : Math.min(1, Math.abs(v));
        const fill = v === null ? "#eee" : v >= 0 ? `rgba(201,42,42,${a.toFixed(3)})` : `rgba(59,91,219,${a.toFixed(3)})`;
        parts.push(`<rect class="patch-cell" data-i="${i}" data-j="${j}" x="${lw + j * cw}" y="${y}" width="${cw - 1}" ` +
          `height="${ch - 1}" fill="${fill}"><title>${v === null ? "undefined" : v.toFixed(3)}</title></rect>`);
      });
    });
    parts.push(`<text x="4" y="${height - 6}">logit[${esc(label(d.answer))}] − logit[${esc(label(d.wrong))}]: ` +
      `${d.clean_diff.toFixed(2)} clean, ${d.corrupt_diff.toFixed(2)} corrupt · red: restores it</text>`);
    sizeSvg($("patch"), width, height, parts);
  });
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

function canvasSvg(canvas) {
  return '<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" ' +
    `xmlns:xlink="http://www.w3.org/1999/xlink" width="${canvas.width}" height="${canvas.height}">` +
    `<image width="${canvas.width}" height="${canvas.height}" href="${canvas.toDataURL("image/png")}"/></svg>`;
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
  if (el.tagName.toLowerCase() === "canvas") {
    if (format === "png") save(await new Promise((r) => el.toBlob(r, "image/png")), name);
    else save(new Blob([canvasSvg(el)], { type: "image/svg+xml" }), name);
    return;
  }
  const text = svgText(el);
  if (format === "svg") save(new Blob([text], { type: "image/svg+xml" }), name);
  else save(await svgToPng(text, Number(el.getAttribute("width")), Number(el.getAttribute("height"))), name);
}
window.qkvDownloadText = (id) => { const el = $(id); return el.tagName.toLowerCase() === "canvas" ? canvasSvg(el) : svgText(el); };

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
    const width = lw + H * cw + 4, height = top + L * ch + 4;
    const parts = [`<rect x="0" y="0" width="${width}" height="${height}" fill="white"/>`];
    for (let h = 0; h < H; h++) parts.push(`<text x="${lw + h * cw + cw / 2}" y="${top - 6}" text-anchor="middle">head ${h}</text>`);
    d.scores.forEach((row, l) => {
      const y = top + l * ch;
      parts.push(`<text x="${lw - 4}" y="${y + ch / 2}" text-anchor="end" dominant-baseline="middle">layer ${l}</text>`);
      row.forEach((v, h) => {
        const best = l === d.best[0] && h === d.best[1];
        parts.push(`<rect class="quiz-cell" data-l="${l}" data-h="${h}" x="${lw + h * cw}" y="${y}" width="${cw - 2}" height="${ch - 2}" ` +
          `fill="${rgb(colormap(VIRIDIS, v))}"${best ? ' stroke="#e8590c" stroke-width="3"' : ""}/>`);
        parts.push(`<text class="${v > 0.5 ? "on-light" : "on-dark"}" x="${lw + h * cw + cw / 2 - 1}" y="${y + ch / 2}" ` +
          `text-anchor="middle" dominant-baseline="middle" fill="${v > 0.5 ? "black" : "white"}">${v.toFixed(2)}</text>`);
      });
    });
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
  $("quiz-go").addEventListener("click", askQuestion);
  $("quiz-next").addEventListener("click", askQuestion);
  for (const b of document.querySelectorAll("button[data-download]")) {
    b.addEventListener("click", () => download(b.dataset.download, b.dataset.format));
  }
}

document.addEventListener("DOMContentLoaded", initLens);
