// The judge playground. Every element that shows data is built with createElement and
// textContent, never innerHTML: a choice, a reason or an error detail that holds markup is
// shown as text. The API key lives in this tab's memory only (no storage), and is sent on
// every call as "Authorization: Bearer <key>".
"use strict";

const DIGITS = 4; // probabilities as printed; the bars' data-* attributes hold the same text
const SVG = "http://www.w3.org/2000/svg";
let apiKey = "";
let profileSummaries = [];

function $(id) {
  return document.getElementById(id);
}

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== null) node.textContent = text;
  return node;
}

function fmt(x, digits = DIGITS) {
  return x === null || x === undefined ? "none" : Number(x).toFixed(digits);
}

// --- talking to the API ------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const detail = body && typeof body === "object" && body.detail ? body.detail : String(body);
    super(detail);
    this.status = status;
    this.field = body && typeof body === "object" ? body.field || null : null;
    this.detail = detail;
  }
}

async function api(method, path, body) {
  const headers = {};
  if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const type = response.headers.get("content-type") || "";
  const data = type.includes("json") ? await response.json() : await response.text();
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

function showError(err) {
  const box = $("error");
  box.replaceChildren();
  if (err instanceof ApiError) {
    box.append(el("strong", {}, String(err.status)));
    if (err.field) box.append(" ", el("code", { id: "error-field" }, err.field));
    box.append(" ", el("span", { id: "error-detail" }, err.detail));
  } else {
    box.append(el("span", { id: "error-detail" }, String(err && err.message ? err.message : err)));
  }
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").replaceChildren();
}

// --- profiles for the pickers ------------------------------------------------------------

let profilesAsked = 0;

async function loadProfiles() {
  // Only the latest call applies: an answer to a call made before the key was typed may
  // arrive after the answer to the call made with it.
  const asked = ++profilesAsked;
  let summaries = [];
  let failure = null;
  try {
    summaries = await api("GET", "/profiles");
  } catch (err) {
    failure = err;
  }
  if (asked !== profilesAsked) return;
  profileSummaries = summaries;
  if (failure) showError(failure);
  const pickers = [["profile", "none"], ["profile-pick", "choose a profile"], ["label-profile", "choose a profile"]];
  for (const [id, first] of pickers) {
    const select = $(id);
    const keep = select.value;
    select.replaceChildren(el("option", { value: "" }, first));
    for (const p of profileSummaries) select.append(el("option", { value: p.name }, p.name));
    select.value = profileSummaries.some((p) => p.name === keep) ? keep : "";
  }
}

// A profile that carries the prompt it was fitted on takes the item alone: the form asks for
// the item, the choices are the profile's, and the answer shows the prompt it was placed in.
let itemMode = false;

function onProfileChosen() {
  const p = profileSummaries.find((s) => s.name === $("profile").value);
  itemMode = Boolean(p && p.takes_item);
  $("prompt-label").textContent = itemMode ? "Item" : "Prompt";
  $("item-note").hidden = !itemMode;
  $("choices").readOnly = itemMode;
  $("return-prompt").disabled = itemMode;
  if (itemMode) {
    $("choices").value = p.choices.join("\n");
    $("return-prompt").checked = true;
  } else if (p && !$("choices").value.trim()) {
    // The profile's choices are the only ones it applies to: offer them when none are typed.
    $("choices").value = p.choices.join("\n");
  }
}

// --- judging -----------------------------------------------------------------------------

function readRequest() {
  if (itemMode) {
    const item = { item: $("prompt").value, profile: $("profile").value, return_prompt: true };
    const t = $("threshold").value.trim();
    if (t !== "") item.threshold = Number(t);
    return item;
  }
  const body = {
    prompt: $("prompt").value,
    choices: $("choices").value.split("\n").map((c) => c.trim()).filter((c) => c !== ""),
    return_prompt: $("return-prompt").checked,
  };
  const system = $("system").value;
  if (system.trim()) body.system = system;
  if ($("profile").value) body.profile = $("profile").value;
  const threshold = $("threshold").value.trim();
  if (threshold !== "") body.threshold = Number(threshold);
  return body;
}

async function onSubmit(event) {
  event.preventDefault();
  const form = $("judge-form");
  form.dataset.state = "busy";
  $("submit").disabled = true;
  clearError();
  try {
    const result = await api("POST", "/judge", readRequest());
    showResult(result);
    form.dataset.state = "done";
  } catch (err) {
    $("result").hidden = true;
    showError(err);
    form.dataset.state = "error";
  } finally {
    $("submit").disabled = false;
  }
}

function track(kind, value, threshold) {
  const t = el("div", { class: "track " + kind });
  const fill = el("div", { class: "fill" });
  fill.style.width = (100 * value).toFixed(2) + "%"; // CSSOM, which the CSP allows
  t.append(fill);
  if (threshold !== null && threshold !== undefined) {
    const mark = el("div", { class: "mark", title: "threshold " + fmt(threshold) });
    mark.style.left = (100 * threshold).toFixed(2) + "%";
    t.append(mark);
  }
  return t;
}

function showResult(r) {
  const decision = $("decision");
  decision.textContent = r.decision;
  decision.className = r.decision;
  $("choice").textContent = r.choice;
  $("confidence").textContent = fmt(r.confidence);

  const reasons = $("reasons");
  reasons.replaceChildren(...r.reasons.map((text, i) =>
    el("li", { "data-code": r.reason_codes[i] || "" }, text)));
  reasons.hidden = r.reasons.length === 0;

  const inSet = new Set(r.prediction_set || []);
  const bars = $("bars");
  bars.replaceChildren();
  for (const [choice, p] of Object.entries(r.probabilities)) {
    const raw = r.raw_probabilities[choice];
    const calibrated = fmt(p);
    const rawText = fmt(raw);
    const row = el("div", { class: "bar", "data-choice": choice, "data-calibrated": calibrated, "data-raw": rawText });
    if (choice === r.choice) row.classList.add("top");
    if (inSet.has(choice)) row.classList.add("in-set");
    row.append(el("div", { class: "label", title: choice }, choice));
    const tracks = el("div", { class: "tracks" });
    const calRow = el("div", { class: "line" });
    calRow.append(track("calibrated", p, r.threshold), el("span", { class: "num calibrated" }, calibrated));
    const rawRow = el("div", { class: "line" });
    rawRow.append(track("raw", raw, null), el("span", { class: "num raw" }, rawText));
    tracks.append(calRow, rawRow);
    row.append(tracks);
    bars.append(row);
  }

  $("choice-mass").textContent = fmt(r.choice_mass);
  $("latency").textContent = fmt(r.latency_ms, 1) + " ms";
  $("threshold-used").textContent = r.threshold === null
    ? "none"
    : fmt(r.threshold, 3) + (r.certified ? " (certified)" : " (not certified)");
  $("profile-used").textContent = profileUsed(r);
  $("prediction-set").textContent = r.prediction_set === null ? "none" : r.prediction_set.join(", ");
  $("model").textContent = r.model;
  const shown = typeof r.prompt === "string";
  $("rendered-prompt-box").hidden = !shown;
  $("rendered-prompt").textContent = shown ? r.prompt : "";
  $("result").hidden = false;
}

function layersText(layers) {
  return "hidden layer" + (layers.length > 1 ? "s " : " ") + layers.join(", ");
}

// The profile a judgment used and how it calibrates: a temperature rescales the model's own
// probabilities; a probe has no temperature, it reads the hidden state of its layers.
function profileUsed(r) {
  if (r.profile === null) return "none (raw probabilities)";
  if (r.calibration_method === "probe") return r.profile + ", probe on " + layersText(r.feature_layers || []);
  const t = typeof r.temperature === "number" ? ", temperature " + fmt(r.temperature, 3) : "";
  const method = r.calibration_method && r.calibration_method !== "temperature" ? ", " + r.calibration_method : "";
  return r.profile + method + t;
}

// --- the profile view --------------------------------------------------------------------

// A profile's calibration map in words: its method, and a probe's layers or a scaling's T.
function mapText(map) {
  if (map.method === "probe") {
    return "probe on " + layersText(map.layers) + " of " + map.num_layers + " (" +
      map.feature_dim + " values each)";
  }
  return map.method + (typeof map.temperature === "number" ? ", T = " + fmt(map.temperature, 3) : "");
}

const METRICS = [
  ["accuracy", "accuracy"],
  ["nll", "negative log-likelihood"],
  ["brier", "Brier score"],
  ["ece", "ECE"],
  ["adaptive_ece", "adaptive ECE"],
  ["mce", "MCE"],
  ["classwise_ece", "class-wise ECE"],
];

function interval(i) {
  return i ? fmt(i.value) + " [" + fmt(i.low) + ", " + fmt(i.high) + "]" : "none";
}

async function onProfilePicked() {
  const name = $("profile-pick").value;
  const detail = $("profile-detail");
  detail.dataset.state = "busy";
  clearError();
  if (!name) {
    detail.hidden = true;
    return;
  }
  try {
    showProfile(await api("GET", "/profiles/" + encodeURIComponent(name)));
    detail.hidden = false;
    await showTraffic(name);
    detail.dataset.state = "done";
    await showPng(name);
  } catch (err) {
    detail.hidden = true;
    showError(err);
    detail.dataset.state = "error";
  }
}

// What to do when a profile certifies nothing (calibration.report.next_steps says the same
// on the command line): how close it came, and the labels its map says would certify.
function nextSteps(p) {
  const t = p.threshold;
  const n = p.labels_needed;
  let text = "Next: on its " + t.n + " certify labels the best lower bound on the precision is " +
    fmt(t.best_certified_precision, 3) +
    (t.best_threshold === null || t.best_threshold === undefined ? "" : " (at threshold " + t.best_threshold + ")") +
    ", short of " + t.target_precision + ". ";
  if (n && n.more !== null) {
    text += "About " + n.more + " more uniform labels (" + n.labels + " in all) would likely certify it, " +
      "at threshold " + n.threshold + " accepting about " + Math.round(100 * n.acceptance) +
      "% of items: label more (the Label tab, or judge label --queue), then fit again.";
  } else if (!n || n.given < 50) {
    text += "Too few uniform labels to tell whether more would certify: label more.";
  } else {
    text += n.reason;
  }
  return text;
}

function showProfile(p) {
  $("profile-name").textContent = p.name;
  const map = p.calibration_map;
  $("profile-meta").textContent =
    p.model + " · " + p.dtype + " · choices " + p.choices.join(", ") + " · " +
    p.n_examples + " examples (fit " + p.split.fit + ", conformal " + p.split.conformal +
    ", certify " + p.split.certify + ") · map " + mapText(map) +
    (p.baseline ? " · baseline " + mapText(p.baseline.calibration_map) : "") +
    " · created " + p.created_at;

  const t = p.threshold;
  const th = $("profile-threshold");
  th.replaceChildren();
  if (t.threshold !== null) {
    th.append(el("strong", { id: "profile-threshold-value" }, fmt(t.threshold, 3)), " certified: ",
      "precision ≥ " + t.target_precision + " with probability ≥ " + (1 - t.delta).toFixed(2) +
      " (lower bound " + fmt(t.precision_lower_bound, 3) + ", coverage " + fmt(t.coverage, 3) +
      " on " + t.n + " items)");
  } else {
    th.append(el("strong", { id: "profile-threshold-value" }, "none certified"), " — " + t.reason);
  }
  const next = $("profile-next");
  next.textContent = t.threshold === null && p.metrics_after ? nextSteps(p) : "";
  next.hidden = next.textContent === "";

  const table = $("profile-metrics");
  table.replaceChildren();
  const head = el("tr");
  for (const h of ["metric", "before", "after"]) head.append(el("th", {}, h));
  table.append(head);
  const before = p.metrics_before || {};
  const after = p.metrics_after || {};
  for (const [key, label] of METRICS) {
    const row = el("tr", { "data-metric": key });
    row.append(el("td", {}, label), el("td", {}, interval(before[key])), el("td", {}, interval(after[key])));
    table.append(row);
  }
  const floor = el("tr", { "data-metric": "ece_noise_floor" });
  floor.append(el("td", {}, "ECE of a perfectly calibrated judge"),
    el("td", {}, fmt(before.ece_noise_floor)), el("td", {}, fmt(after.ece_noise_floor)));
  const n = el("tr", { "data-metric": "n" });
  n.append(el("td", {}, "items"), el("td", {}, String(before.n)), el("td", {}, String(after.n)));
  table.append(floor, n);

  drawCalibration(before, after);
}

// The profile keeps summary metrics with bootstrap intervals, not per-bin counts, so the
// chart shows what it has: each binned calibration error before and after, with its interval,
// and the ECE a perfectly calibrated judge would show on this many items.
function drawCalibration(before, after) {
  const rows = METRICS.filter(([key]) => key.endsWith("ece") || key === "mce");
  const W = 640, left = 130, right = 20, top = 24, rowH = 34;
  const H = top + rows.length * rowH + 34;
  let max = 0;
  for (const [key] of rows) {
    for (const m of [before[key], after[key]]) if (m) max = Math.max(max, m.high, m.value);
  }
  // A round step that needs at most 6 ticks, and the axis ends on a tick.
  const step = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5].find((s) => max / s <= 6) || 1;
  const ticks = Math.max(1, Math.ceil(max / step - 1e-9));
  max = step * ticks;
  const x = (v) => left + (W - left - right) * Math.min(v, max) / max;
  const chart = svg("svg", { id: "reliability-svg", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  chart.append(svg("title", {}, "Calibration error before and after, with bootstrap intervals"));
  const axisY = top + rows.length * rowH;
  for (let i = 0; i <= ticks; i++) {
    const v = step * i;
    chart.append(svg("line", { x1: x(v), x2: x(v), y1: top - 6, y2: axisY, class: "grid" }));
    chart.append(svg("text", { x: x(v), y: axisY + 16, "text-anchor": "middle", class: "tick" }, fmt(v, 2)));
  }
  rows.forEach(([key, label], i) => {
    const y = top + i * rowH + rowH / 2;
    chart.append(svg("text", { x: left - 10, y: y + 4, "text-anchor": "end", class: "label" }, label));
    if (key === "ece" && after.ece_noise_floor !== undefined) {
      chart.append(svg("line", { x1: x(after.ece_noise_floor), x2: x(after.ece_noise_floor), y1: y - 12, y2: y + 12, class: "floor" }));
    }
    [[before[key], "before", -6], [after[key], "after", 6]].forEach(([m, cls, dy]) => {
      if (!m) return;
      const g = svg("g", { class: cls, "data-metric": key });
      g.append(svg("line", { x1: x(m.low), x2: x(m.high), y1: y + dy, y2: y + dy, class: "whisker" }));
      g.append(svg("circle", { cx: x(m.value), cy: y + dy, r: 4.5 }));
      g.append(svg("title", {}, label + " " + cls + ": " + interval(m)));
      chart.append(g);
    });
  });
  const legend = svg("g", { class: "legend" });
  legend.append(svg("circle", { cx: left, cy: 10, r: 4.5, class: "before" }),
    svg("text", { x: left + 10, y: 14 }, "before (raw)"),
    svg("circle", { cx: left + 110, cy: 10, r: 4.5, class: "after" }),
    svg("text", { x: left + 120, y: 14 }, "after (calibrated)"),
    svg("line", { x1: left + 250, x2: left + 250, y1: 3, y2: 17, class: "floor" }),
    svg("text", { x: left + 258, y: 14 }, "ECE of a perfectly calibrated judge"));
  chart.append(legend);
  $("reliability").replaceChildren(chart);
  $("reliability-note").textContent =
    "The profile stores these summaries, not per-bin counts; lower is better. " +
    "Where `judge calibrate` wrote a reliability diagram beside the profile, it is shown below.";
}

// --- traffic: each share with its interval over time, the live prior, the alarms ----------

// GET /profiles/{name}/health/history: 20 points of the version's decisions. Each choice's
// share is drawn as a band (its confidence sequence: it holds at every point at once) around
// its estimate, the live prior EM estimates without labels as a dashed line, and the mix the
// certificate was measured on as a dotted one; the alarms that had fired by each point are
// marked on the axis.
const TRAFFIC_COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

async function showTraffic(name) {
  const state = $("traffic-state");
  const box = $("traffic");
  box.replaceChildren();
  let history;
  try {
    history = await api("GET", "/profiles/" + encodeURIComponent(name) + "/health/history");
  } catch (err) {
    state.textContent = err.status === 404 ? "No decision log: the server keeps no traffic to show." : "Traffic: " + err.detail;
    return;
  }
  const points = history.points;
  if (!points.length) {
    state.textContent = "No decision of this version is logged yet.";
    return;
  }
  const last = points[points.length - 1];
  state.dataset.alarms = last.alarms.join(",");
  state.textContent = last.n_decisions + " decisions, " + last.n_labeled + " audited and labelled; alarms: " +
    (last.alarms.length ? last.alarms.join(", ") : "none");
  const W = 640, H = 240, left = 44, right = 16, top = 16, bottom = 40;
  const maxN = last.n_decisions;
  const x = (n) => left + (W - left - right) * n / maxN;
  const y = (v) => top + (H - top - bottom) * (1 - v);
  const chart = svg("svg", { id: "traffic-svg", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  chart.append(svg("title", {}, "Each choice's share over the version's decisions, with its confidence sequence"));
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    chart.append(svg("line", { x1: left, x2: W - right, y1: y(v), y2: y(v), class: "grid" }));
    chart.append(svg("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, fmt(v, 2)));
  }
  chart.append(svg("text", { x: W - right, y: H - 6, "text-anchor": "end", class: "tick" }, maxN + " decisions"));
  history.choices.forEach((choice, j) => {
    const color = TRAFFIC_COLORS[j % TRAFFIC_COLORS.length];
    const g = svg("g", { class: "share", "data-choice": choice });
    const withShares = points.filter((p) => p.shares);
    if (withShares.length) {
      const upper = withShares.map((p) => `${x(p.n_decisions)},${y(p.shares.upper[j])}`);
      const lower = withShares.map((p) => `${x(p.n_decisions)},${y(p.shares.lower[j])}`).reverse();
      g.append(svg("polygon", { points: upper.concat(lower).join(" "), fill: color, "fill-opacity": 0.15, class: "band" }));
      g.append(svg("polyline", { points: withShares.map((p) => `${x(p.n_decisions)},${y(p.shares.estimate[j])}`).join(" "), stroke: color, fill: "none", class: "estimate" }));
    }
    const withPrior = points.filter((p) => p.prior);
    if (withPrior.length) {
      g.append(svg("polyline", { points: withPrior.map((p) => `${x(p.n_decisions)},${y(p.prior[j])}`).join(" "), stroke: color, fill: "none", "stroke-dasharray": "5 3", class: "prior" }));
    }
    if (history.source_prior) {
      g.append(svg("line", { x1: left, x2: W - right, y1: y(history.source_prior[j]), y2: y(history.source_prior[j]), stroke: color, "stroke-dasharray": "1 3", class: "source" }));
    }
    g.append(svg("title", {}, choice));
    chart.append(g);
    chart.append(svg("text", { x: left + 8 + 90 * j, y: H - 6, fill: color, class: "tick" }, choice));
  });
  for (const p of points) {
    if (!p.alarms.length) continue;
    chart.append(svg("circle", { cx: x(p.n_decisions), cy: y(0) + 10, r: 4, class: "alarm", "data-alarms": p.alarms.join(",") }));
  }
  box.replaceChildren(chart);
  box.append(el("p", { class: "muted" },
    "Solid: each choice's share of the traffic (labels and the model together, PPI++), its band valid at every point at once; " +
    "dashed: the live class prior the model's probabilities imply (EM, no labels); dotted: the mix the certificate was measured on; " +
    "red dots: an alarm had fired."));
}

async function showPng(name) {
  const img = $("reliability-png");
  if (img.src.startsWith("blob:")) URL.revokeObjectURL(img.src);
  img.hidden = true;
  img.removeAttribute("src");
  const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
  const response = await fetch("/playground/profiles/" + encodeURIComponent(name) + "/reliability.png", { headers });
  if (!response.ok) return; // most profiles (all fitted over HTTP) have none
  img.src = URL.createObjectURL(await response.blob());
  img.hidden = false;
}

// --- the labelling queue -----------------------------------------------------------------

// GET /profiles/{name}/queue gives the next decisions of each stream; the page takes them in
// turn (audit, teach, ...), skips what the person skipped (in this tab only) and labels with
// POST /judgments/{id}/label. The audit stream certifies; the teach stream only fits.
const STREAMS = ["audit", "teach"];
let labelQueue = null;
let labelTurn = 0;
const skipped = new Set();

function labelName() {
  return $("label-profile").value;
}

async function loadQueue() {
  const name = labelName();
  const card = $("label-card");
  card.dataset.state = "busy";
  clearError();
  if (!name) {
    card.hidden = true;
    $("label-empty").hidden = true;
    return;
  }
  try {
    labelQueue = await api("GET", "/profiles/" + encodeURIComponent(name) + "/queue");
    showLabelState(labelQueue);
    showNextItem();
    await loadVersions();
  } catch (err) {
    card.hidden = true;
    card.dataset.state = "error";
    showError(err);
  }
}

function showLabelState(q) {
  const parts = ["audit " + q.n_audited_labeled + " of " + q.n_audited + " labelled"];
  parts.push(q.threshold === null
    ? "no certified threshold"
    : "threshold " + fmt(q.threshold, 3) + " certified, coverage " + fmt(q.coverage, 3));
  if (q.labels) {
    if (q.labels.more === null) parts.push(q.labels.reason);
    else if (q.labels.more === 0) parts.push("enough audit labels to refit and certify");
    else parts.push("about " + q.labels.more + " more audit labels would open the gate");
  }
  $("label-state").textContent = parts.join(" · ");
}

function nextEntry() {
  for (let step = 0; step < STREAMS.length; step++) {
    const stream = STREAMS[(labelTurn + step) % STREAMS.length];
    const entry = labelQueue[stream].find((e) => !skipped.has(e.judgment_id));
    if (entry) {
      labelTurn = (labelTurn + step) % STREAMS.length;
      return entry;
    }
  }
  return null;
}

function showNextItem() {
  const card = $("label-card");
  const entry = nextEntry();
  $("label-empty").hidden = entry !== null;
  card.hidden = entry === null;
  if (entry === null) {
    card.dataset.state = "empty";
    return;
  }
  const left = entry.stream === "audit" ? labelQueue.pending_audit : labelQueue.pending_teach;
  $("label-stream").textContent = entry.stream === "audit"
    ? "audit (a uniform sample: it certifies)"
    : "teach (the least certain: it fits)";
  $("label-left").textContent = left + " left in this stream";
  $("label-item").textContent = entry.item;
  const ranked = Object.entries(entry.probabilities).sort((a, b) => b[1] - a[1]);
  $("label-model").textContent = ranked.map(([c, p]) => c + " " + fmt(p, 2)).join(", ");
  const buttons = $("label-buttons");
  buttons.replaceChildren();
  for (const choice of entry.choices) {
    const b = el("button", { type: "button", class: "label-choice", "data-choice": choice }, choice);
    b.addEventListener("click", () => giveLabel(entry, choice));
    buttons.append(b);
  }
  const skip = el("button", { type: "button", id: "label-skip", class: "secondary" }, "skip");
  skip.addEventListener("click", () => {
    skipped.add(entry.judgment_id);
    labelTurn = (labelTurn + 1) % STREAMS.length;
    showNextItem();
  });
  buttons.append(skip);
  card.dataset.judgment = entry.judgment_id;
  card.dataset.state = "ready";
}

async function giveLabel(entry, choice) {
  const card = $("label-card");
  card.dataset.state = "busy";
  try {
    await api("POST", "/judgments/" + encodeURIComponent(entry.judgment_id) + "/label", { label: choice });
    labelTurn = (labelTurn + 1) % STREAMS.length;
    await loadQueue();
  } catch (err) {
    card.dataset.state = "error";
    showError(err);
  }
}

async function loadVersions() {
  const name = labelName();
  if (!name) return;
  const v = await api("GET", "/profiles/" + encodeURIComponent(name) + "/versions");
  const current = v.versions.find((x) => x.current);
  const shown = $("label-version");
  shown.textContent = current ? current.etag : "none";
  shown.dataset.etag = current ? current.etag : "";
  $("label-refits").replaceChildren(...v.refits.map((r) =>
    el("li", { "data-served": String(r.served) }, r.at + ": " + r.reason)));
}

// A background refit finishes on its own time: while the queue is on screen, look again.
function watchVersions() {
  setInterval(() => {
    if (!$("label-view").hidden && labelName()) loadVersions().catch(() => {});
  }, 2000);
}

// --- wiring ------------------------------------------------------------------------------

function showView(id) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const on = tab.dataset.view === id;
    tab.setAttribute("aria-selected", String(on));
    $(tab.dataset.view).hidden = !on;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("judge-form").addEventListener("submit", onSubmit);
  $("profile").addEventListener("change", onProfileChosen);
  $("profile-pick").addEventListener("change", onProfilePicked);
  $("label-profile").addEventListener("change", () => {
    skipped.clear();
    labelTurn = 0;
    loadQueue();
  });
  $("api-key").addEventListener("input", () => {
    apiKey = $("api-key").value;
  });
  $("api-key").addEventListener("change", () => {
    clearError();
    loadProfiles();
  });
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => {
      showView(tab.dataset.view);
      if (tab.dataset.view === "profiles-view" || tab.dataset.view === "label-view") loadProfiles();
    });
  }
  loadProfiles();
  watchVersions();
});
