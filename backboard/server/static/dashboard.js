// The live dashboard: polls /api/dashboard every second (only the samples it has not seen),
// keeps the last few minutes in the page and redraws the charts, the current values and the
// engine's configuration.

import { getJSON } from "./api.js";
import { TimeChart } from "./plot.js";

const POLL_MS = 1000;
const HOLD_AFTER_S = 1.0; // idle engine: repeat its last state so the charts keep moving
const C = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df"];
const $ = (id) => document.getElementById(id);

// [name, title, unit, [[key, label], ...], options]
const CHARTS = [
  ["requests", "Requests", "", [["running", "running"], ["waiting", "waiting"]]],
  ["cache", "Cache in use", "%", [["kv", "KV blocks"], ["slots", "state slots"], ["prefix", "prefix-cache hits"]], { max: 100 }],
  ["throughput", "Throughput", "tokens/s", [["generation", "generation"], ["prompt", "prompt"]]],
  ["phases", "Step time split", "ms per step", [["schedule", "schedule"], ["forward", "forward"], ["sample", "sample"],
    ["draft", "draft"], ["detokenize", "detokenize"]], { stacked: true }],
  ["ttft", "TTFT, last minute", "ms", [["p50", "p50"], ["p90", "p90"], ["p99", "p99"]]],
  ["tpot", "TPOT, last minute", "ms", [["p50", "p50"], ["p90", "p90"], ["p99", "p99"]]],
  ["accept", "Speculative acceptance length", "tokens per round", [["accept", "mean"]]],
];

let samples = [];
let lastSampleT = null;
let charts = null;
let timer = null;
let running = false;
let historyS = 300;
let config = {};

const pct = (v) => (v == null ? null : 100 * v);

// one server sample -> {chart name: {series key: value}}
function chartValues(s) {
  return {
    requests: { running: s.running, waiting: s.waiting },
    cache: { kv: pct(s.kv_cache_usage), slots: pct(s.state_slot_usage), prefix: pct(s.prefix_cache_hit_rate) },
    throughput: { generation: s.generation_tps, prompt: s.prompt_tps },
    phases: s.step_phase_ms || {},
    ttft: s.ttft_ms || {},
    tpot: s.tpot_ms || {},
    accept: { accept: s.spec_acceptance_length },
  };
}

function buildCharts() {
  const root = $("charts");
  root.replaceChildren();
  charts = {};
  for (const [name, title, unit, series, opt] of CHARTS) {
    const s = series.map(([key, label], i) => ({ key, label, color: C[i % C.length] }));
    charts[name] = new TimeChart(root, s, { title, unit, ...(opt || {}) });
    charts[name].box.dataset.chart = name;
  }
}

// an idle engine sends nothing: hold its last gauges (rates zero) at the server's time
function holdSample(snap) {
  const last = samples[samples.length - 1];
  if (!last || snap.engine.num_unfinished > 0 || snap.time - last.t < HOLD_AFTER_S) return null;
  return { ...last, t: snap.time, generation_tps: 0, prompt_tps: 0, steps_per_s: 0, step_ms: null,
           step_phase_ms: {}, spec_acceptance_length: null, ttft_ms: snap.latency.ttft_ms,
           tpot_ms: snap.latency.tpot_ms, hold: true };
}

function ingest(snap) {
  historyS = snap.history_s;
  for (const s of snap.samples) {
    samples.push(s);
    lastSampleT = s.t;
  }
  const hold = holdSample(snap);
  if (hold) samples.push(hold);
  samples = samples.filter((s) => s.t >= snap.time - historyS);
}

function draw(snap) {
  const windowS = Number($("dash-window").value);
  const points = samples.map((s) => ({ t: s.t, v: chartValues(s) }));
  for (const [name, chart] of Object.entries(charts)) {
    chart.update(points.map((p) => ({ t: p.t, v: p.v[name] })), snap.time, windowS);
  }
  charts.accept.box.hidden = !config.speculative;
  renderCards(snap);
}

function card(label, value, id) {
  const d = document.createElement("div");
  d.className = "card";
  d.dataset.card = id;
  const v = document.createElement("b");
  v.textContent = value;
  const l = document.createElement("span");
  l.textContent = label;
  d.append(v, l);
  return d;
}

const num = (v, d = 1) => (v == null ? "–" : Number(v).toFixed(d));

function renderCards(snap) {
  const s = snap.latest || {};
  const lat = snap.latency;
  const busy = snap.engine.num_unfinished > 0;
  const prefix = s.prefix_cache_hit_rate != null ? `${num(100 * s.prefix_cache_hit_rate)} %` : "off";
  const accept = config.speculative ? num(s.spec_acceptance_length, 2) : "off";
  $("cards").replaceChildren(
    card("running", s.running ?? 0, "running"),
    card("waiting", s.waiting ?? 0, "waiting"),
    card("KV blocks used", `${num(pct(s.kv_cache_usage))} %`, "kv"),
    card("state slots used", `${num(pct(s.state_slot_usage))} %`, "slots"),
    card("prefix-cache hit rate", prefix, "prefix"),
    card("generation tok/s", busy ? num(s.generation_tps) : "0.0", "generation"),
    card("prompt tok/s", busy ? num(s.prompt_tps) : "0.0", "prompt"),
    card("ms per step", busy ? num(s.step_ms, 2) : "–", "step"),
    card("acceptance length", accept, "accept"),
    card(`TTFT p50 / p99 (ms, ${lat.num_requests} req)`, `${num(lat.ttft_ms.p50, 0)} / ${num(lat.ttft_ms.p99, 0)}`, "ttft"),
    card("TPOT p50 / p99 (ms)", `${num(lat.tpot_ms.p50, 1)} / ${num(lat.tpot_ms.p99, 1)}`, "tpot"),
    card("aborted requests", snap.num_aborted, "aborted"),
  );
  $("dash-state").textContent = `engine ${snap.engine.state}` + (snap.engine.error ? `: ${snap.engine.error}` : "");
}

function renderConfig(engine, info) {
  const rows = { "served models": info.models.join(", "), backboard: info.version, ...engine.config };
  if (engine.description) rows.summary = engine.description;
  $("engine-config").replaceChildren(...Object.entries(rows).map(([k, v]) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = k.replaceAll("_", " ");
    const td = document.createElement("td");
    td.textContent = v === null ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v);
    tr.append(th, td);
    return tr;
  }));
}

async function poll(info) {
  try {
    const since = lastSampleT === null ? "" : `?since=${lastSampleT}`;
    const snap = await getJSON(`/api/dashboard${since}`);
    if (!Object.keys(config).length && snap.engine.config) {
      config = snap.engine.config;
      renderConfig(snap.engine, info);
    }
    ingest(snap);
    draw(snap);
  } catch (e) {
    $("dash-state").textContent = `cannot reach the server: ${e.message}`;
  }
  if (running) timer = setTimeout(() => poll(info), POLL_MS);
}

export function startDashboard(info) {
  if (!charts) buildCharts();
  if (running) return;
  running = true;
  poll(info);
}

export function stopDashboard() {
  running = false;
  clearTimeout(timer);
}
