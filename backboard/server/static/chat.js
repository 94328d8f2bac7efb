// The chat playground: settings, a conversation kept in this browser (localStorage), answers
// streamed from /v1/chat/completions, a stop button that closes the stream (the server aborts
// the request), per-answer TTFT / tokens per second / tokens.

import { APIError, apiFetch, sseEvents } from "./api.js";
import { answerElement, mergeToolCalls, renderAnswer, splitReasoning } from "./render.js";

const STORE = "backboard.chat";
const SETTINGS = "backboard.chatSettings";
const FIELDS = ["system", "temperature", "top-p", "max-tokens", "extra"];
const $ = (id) => document.getElementById(id);

let conversation = [];
let controller = null;
let supportsThinking = false;

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversation));
  const s = {};
  for (const id of FIELDS) s[id] = $(id).value;
  s.thinking = $("thinking").checked;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

export function initChat(info) {
  conversation = load(STORE, []);
  const select = $("model");
  select.replaceChildren(...info.models.map((m) => new Option(m, m)));
  supportsThinking = info.thinking;
  const s = load(SETTINGS, {});
  for (const id of FIELDS) if (s[id] !== undefined) $(id).value = s[id];
  $("thinking").checked = supportsThinking && !!s.thinking;
  $("thinking").disabled = !supportsThinking;
  $("thinking-note").textContent = supportsThinking ? "" : "(this model's chat template has no thinking switch)";
  if (window.innerWidth < 700) $("settings").open = false;
  $("max-tokens").max = info.max_model_len;
  renderConversation();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", () => { conversation = []; save(); renderConversation(); });
  for (const id of [...FIELDS, "thinking"]) $(id).addEventListener("change", save);
}

function thinkingOn() {
  return supportsThinking && $("thinking").checked;
}

function renderConversation() {
  $("messages").replaceChildren();
  for (const m of conversation) addMessage(m);
}

function addMessage(m) {
  const box = document.createElement("div");
  box.className = `msg ${m.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant";
  let body;
  if (m.role === "user") {
    body = document.createElement("div");
    body.className = "text";
    body.textContent = m.content;
  } else {
    body = answerElement();
    renderAnswer(body, m, m.thinking);
  }
  box.append(role, body);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return body;
}

// What the server gets: the system prompt, then the conversation without reasoning.
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation) {
    if (m.error) continue;
    const content = m.role === "assistant" ? splitReasoning(m.content, m.thinking).content.trim() : m.content;
    messages.push({ role: m.role, content });
  }
  const body = {
    model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if (supportsThinking) body.chat_template_kwargs = { enable_thinking: thinkingOn() };
  return { ...body, ...extraFields() };
}

// the "more request fields" box: a JSON object merged into the request (throws when it is not one)
function extraFields() {
  const text = $("extra").value.trim();
  if (!text) return {};
  let v;
  try {
    v = JSON.parse(text);
  } catch (e) {
    throw new Error(`More request fields: not JSON (${e.message})`);
  }
  if (typeof v !== "object" || v === null || Array.isArray(v)) throw new Error("More request fields: expected a JSON object");
  return v;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("chat-error").hidden = true;
  let body;
  try {
    conversation.push({ role: "user", content: text });
    body = requestBody();
  } catch (e) {
    conversation.pop();
    $("chat-error").textContent = e.message;
    $("chat-error").hidden = false;
    return;
  }
  $("prompt").value = "";
  addMessage(conversation[conversation.length - 1]);
  const answer = { role: "assistant", content: "", reasoning: "", toolCalls: [], thinking: thinkingOn(), meta: {} };
  const box = addMessage(answer);
  controller = new AbortController();
  setBusy(true);
  const t = { start: performance.now(), first: null, last: null, chunks: 0 };
  let usage = null;
  let finish = null;
  try {
    const r = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal,
    });
    for await (const ev of sseEvents(r)) {
      if (ev.error) throw new APIError(ev.error.code || 500, ev.error.message);
      if (ev.usage) usage = ev.usage;
      for (const ch of ev.choices || []) finish = applyDelta(answer, ch, t) || finish;
      renderAnswer(box, answer, answer.thinking);
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { finish = "error"; answer.error = e.message; }
  } finally {
    controller = null;
    setBusy(false);
  }
  answer.meta = answerStats(t, usage, finish);
  renderAnswer(box, answer, answer.thinking);
  conversation.push(answer);
  save();
  box.scrollIntoView({ block: "end" });
}

function applyDelta(answer, choice, t) {
  const d = choice.delta || {};
  const piece = d.content || "";
  const reasoning = d.reasoning_content || d.reasoning || "";
  if (piece || reasoning || d.tool_calls) {
    const now = performance.now();
    t.first ??= now;
    t.last = now;
    t.chunks += 1;
  }
  answer.content += piece;
  answer.reasoning += reasoning;
  mergeToolCalls(answer.toolCalls, d.tool_calls);
  return choice.finish_reason;
}

function answerStats(t, usage, finish) {
  const tokens = usage?.completion_tokens ?? t.chunks;
  const span = t.first !== null ? (t.last - t.first) / 1000 : 0;
  return {
    ttft_ms: t.first !== null ? t.first - t.start : null,
    tokens,
    tokens_per_s: tokens > 1 && span > 0 ? (tokens - 1) / span : null,
    finish: finish || "done",
  };
}
