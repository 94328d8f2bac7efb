// The scorecard viewer: the results folders the server lists (--scorecard-dir), each shown as
// its self-contained HTML report in a sandboxed frame (no scripts run in it).

import { apiFetch, getJSON } from "./api.js";

const $ = (id) => document.getElementById(id);
let loaded = false;
let blobUrl = null;

export async function showScorecards() {
  if (loaded) return;
  loaded = true;
  $("scorecard-back").addEventListener("click", () => { $("scorecard-view").hidden = true; $("scorecard-list").hidden = false; });
  $("scorecard-frame").addEventListener("load", fitFrame);
  const { root, scorecards } = await getJSON("/api/scorecards");
  $("scorecard-root").textContent = root
    ? `${scorecards.length} scorecard(s) under ${root} (backboard serve --scorecard-dir DIR to choose another folder)`
    : "No scorecard folder: start the server with --scorecard-dir DIR.";
  $("scorecard-list").replaceChildren(...scorecards.map(listItem));
  $("scorecard-list").dataset.loaded = "1";
}

function listItem(sc) {
  const li = document.createElement("li");
  const b = document.createElement("button");
  b.type = "button";
  b.className = "link";
  b.textContent = sc.title;
  b.addEventListener("click", () => open(sc.name));
  const meta = document.createElement("span");
  meta.className = "muted";
  const totals = sc.totals
    ? Object.entries(sc.totals.totals).map(([o, t]) => `${sc.totals.ours} vs ${o}: ${t.wins}/${t.total} wins`).join("; ")
    : "not scored yet";
  meta.textContent = ` ${sc.name} · ${totals}`;
  li.append(b, meta);
  return li;
}

async function open(name) {
  const frame = $("scorecard-frame");
  $("scorecard-list").hidden = true;
  $("scorecard-view").hidden = false;
  frame.srcdoc = "<p style='font-family:sans-serif'>Building the report…</p>";
  try {
    const html = await (await apiFetch(`/api/scorecards/${encodeURIComponent(name).replaceAll("%2F", "/")}`)).text();
    frame.srcdoc = html;
    if (blobUrl) URL.revokeObjectURL(blobUrl);
    blobUrl = URL.createObjectURL(new Blob([html], { type: "text/html" }));
    $("scorecard-download").href = blobUrl;
    $("scorecard-download").download = `scorecard-${name.replaceAll("/", "-")}.html`;
  } catch (e) {
    frame.srcdoc = "";
    $("scorecard-root").textContent = `Cannot show ${name}: ${e.message}`;
  }
}

function fitFrame() {
  const frame = $("scorecard-frame");
  const doc = frame.contentDocument;
  if (doc && doc.documentElement) frame.style.height = `${doc.documentElement.scrollHeight + 16}px`;
}
