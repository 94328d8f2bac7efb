// An answer as the page shows it: reasoning folded, tool calls and JSON formatted, code blocks,
// plain text. Model text only ever goes into textContent (never parsed as HTML).

const OPEN = "<think>";
const CLOSE = "</think>";

// {reasoning, content, thinking}: the <think> part of a text and the rest. With `startsInside`
// (the chat template opened <think> in the prompt) text before any </think> is reasoning.
export function splitReasoning(text, startsInside = false) {
  const open = text.indexOf(OPEN);
  const close = text.indexOf(CLOSE);
  if (open >= 0 && (close < 0 || open < close)) {
    const before = text.slice(0, open);
    if (close < 0) return { reasoning: text.slice(open + OPEN.length), content: before, thinking: true };
    return { reasoning: text.slice(open + OPEN.length, close),
             content: before + text.slice(close + CLOSE.length), thinking: false };
  }
  if (close >= 0) return { reasoning: text.slice(0, close), content: text.slice(close + CLOSE.length), thinking: false };
  if (startsInside) return { reasoning: text, content: "", thinking: true };
  return { reasoning: "", content: text, thinking: false };
}

function prettyJSON(text) {
  const s = text.trim();
  if (!/^[[{]/.test(s)) return null;
  try {
    return JSON.stringify(JSON.parse(s), null, 2);
  } catch {
    return null;
  }
}

function pushText(out, text) {
  const json = prettyJSON(text);
  if (json !== null) out.push({ kind: "json", text: json });
  else if (text.trim()) out.push({ kind: "text", text });
}

// The content as segments: {kind: "text" | "json" | "code" | "tool_call", text, lang?}.
export function segments(content) {
  const out = [];
  const re = /<tool_call>([\s\S]*?)(?:<\/tool_call>|$)|```([\w+.-]*)\n([\s\S]*?)(?:```|$)/g;
  let last = 0;
  for (const m of content.matchAll(re)) {
    if (m.index > last) pushText(out, content.slice(last, m.index));
    if (m[1] !== undefined) out.push({ kind: "tool_call", text: prettyJSON(m[1]) ?? m[1].trim() });
    else out.push({ kind: "code", lang: m[2], text: m[3] });
    last = m.index + m[0].length;
  }
  if (last < content.length) pushText(out, content.slice(last));
  return out;
}

// OpenAI streaming tool-call deltas, merged by index into [{id, name, arguments}].
export function mergeToolCalls(calls, deltas) {
  for (const d of deltas || []) {
    const c = (calls[d.index ?? calls.length] ??= { id: "", name: "", arguments: "" });
    if (d.id) c.id = d.id;
    if (d.function?.name) c.name += d.function.name;
    if (d.function?.arguments) c.arguments += d.function.arguments;
  }
  return calls;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function segmentElement(seg) {
  if (seg.kind === "text") return el("div", "text", seg.text);
  const box = el("div", `block ${seg.kind}`);
  const label = { json: "JSON", code: seg.lang || "code", tool_call: "tool call" }[seg.kind];
  box.append(el("div", "block-label", label), el("pre", null, seg.text));
  return box;
}

// The skeleton of an assistant message: folded reasoning, content, stats line.
export function answerElement() {
  const box = el("div", "answer");
  const details = el("details", "reasoning");
  details.hidden = true;
  details.append(el("summary", null, "Reasoning"), el("pre"));
  box.append(details, el("div", "content"), el("div", "error"), el("div", "stats"));
  return box;
}

// Fill an answerElement from {content, reasoning, toolCalls, error, meta}; keeps whether the
// reader opened the reasoning.
export function renderAnswer(box, answer, startsInside = false) {
  const split = splitReasoning(answer.content, startsInside);
  const reasoning = (answer.reasoning || "") + split.reasoning;
  const details = box.querySelector(".reasoning");
  details.hidden = !reasoning.trim();
  details.querySelector("pre").textContent = reasoning.trim();
  details.querySelector("summary").textContent = split.thinking ? "Reasoning…" : `Reasoning (${reasoning.trim().length} characters)`;
  const segs = segments(split.content);
  for (const c of answer.toolCalls || []) {
    let args = c.arguments;
    try { args = JSON.parse(c.arguments); } catch { /* still streaming */ }
    segs.push({ kind: "tool_call", text: JSON.stringify({ name: c.name, arguments: args }, null, 2) });
  }
  box.querySelector(".content").replaceChildren(...segs.map(segmentElement));
  const err = box.querySelector(".error");
  err.textContent = answer.error || "";
  err.hidden = !answer.error;
  renderStats(box.querySelector(".stats"), answer.meta);
}

function renderStats(node, meta) {
  if (!meta || meta.finish === undefined) {
    node.textContent = "";
    return;
  }
  const parts = [];
  if (meta.ttft_ms != null) parts.push(`TTFT ${Math.round(meta.ttft_ms)} ms`);
  if (meta.tokens_per_s != null) parts.push(`${meta.tokens_per_s.toFixed(1)} tok/s`);
  parts.push(`${meta.tokens} tokens`);
  parts.push(meta.finish);
  node.textContent = parts.join(" · ");
  node.dataset.ttftMs = meta.ttft_ms ?? "";
  node.dataset.tokens = meta.tokens;
  node.dataset.finish = meta.finish;
}
