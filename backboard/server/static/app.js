// The page: tabs (the path picks one: /, /dashboard, /scorecards), the API key, start-up.

import { askKey, getJSON, initAuth } from "./api.js";
import { initChat } from "./chat.js";
import { startDashboard, stopDashboard } from "./dashboard.js";
import { showScorecards } from "./scorecards.js";
import * as render from "./render.js";

const TABS = { "/": "chat", "/dashboard": "dashboard", "/scorecards": "scorecards" };
const $ = (id) => document.getElementById(id);
let info = null;

function show(tab) {
  for (const name of Object.values(TABS)) $(`tab-${name}`).hidden = name !== tab;
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === tab);
  if (tab === "dashboard") startDashboard(info);
  else stopDashboard();
  if (tab === "scorecards") showScorecards().catch(showError);
  document.body.dataset.tab = tab;
}

function showError(e) {
  const p = $("chat-error");
  p.textContent = e.message;
  p.hidden = false;
}

async function main() {
  for (const a of document.querySelectorAll("#tabs a")) {
    a.addEventListener("click", (e) => {
      e.preventDefault();
      history.pushState(null, "", a.getAttribute("href"));
      show(a.dataset.tab);
    });
  }
  window.addEventListener("popstate", () => show(TABS[location.pathname] || "chat"));
  $("key-button").addEventListener("click", () => askKey("").then(() => location.reload()));
  const keyRequired = await initAuth();
  $("key-button").hidden = !keyRequired;
  info = await getJSON("/api/info");
  $("server-status").textContent = `${info.models[0]} · engine ${info.engine.state}`;
  initChat(info);
  show(TABS[location.pathname] || "chat");
  document.body.dataset.ready = "1";
}

window.backboard = { render }; // for tests and the curious: the pure rendering helpers
main().catch((e) => {
  $("tab-chat").hidden = false;
  showError(e);
  document.body.dataset.ready = "error";
});
