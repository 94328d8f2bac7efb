// The server as the page talks to it: the API key (kept in this browser, asked for when the
// server wants one and sent as a Bearer token), JSON fetches, and server-sent events.

const KEY_STORE = "backboard.apiKey";
let pendingAsk = null;

export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// Ask for the key when the server wants one and none is stored (no request fails for it).
export async function initAuth() {
  const r = await fetch("/api/auth");
  const { api_key_required: required } = await r.json();
  if (required && !apiKey()) await askKey("");
  return required;
}

// Show the key dialog; resolves once it is closed (a second caller waits for the same one).
export function askKey(message) {
  if (pendingAsk) return pendingAsk;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const err = document.getElementById("key-error");
  err.hidden = !message;
  err.textContent = message || "";
  input.value = apiKey();
  pendingAsk = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      if (dialog.returnValue === "save" && input.value.trim()) localStorage.setItem(KEY_STORE, input.value.trim());
      if (dialog.returnValue === "forget") localStorage.removeItem(KEY_STORE);
      pendingAsk = null;
      resolve();
    }, { once: true });
  });
  dialog.showModal();
  input.focus();
  return pendingAsk;
}

async function errorMessage(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `${r.status} ${r.statusText}`;
  }
}

// fetch with the key; a refused key asks for another and retries once; errors throw APIError.
export async function apiFetch(path, opts = {}) {
  for (let attempt = 0; ; attempt++) {
    const r = await fetch(path, { ...opts, headers: authHeaders(opts.headers) });
    if (r.status === 401 && attempt === 0) {
      await askKey(await errorMessage(r));
      continue;
    }
    if (!r.ok) throw new APIError(r.status, await errorMessage(r));
    return r;
  }
}

export async function getJSON(path) {
  return (await apiFetch(path)).json();
}

// The JSON payloads of a text/event-stream response, until [DONE] or the end of the body.
export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}
