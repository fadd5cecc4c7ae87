// quickdraft's chat page: talks to this server's own /v1/chat/completions over SSE. Every value from the model or
// the user reaches the page as text (textContent) or through escapeHtml before the small Markdown renderer below.
"use strict";

const STORE = "quickdraft.conversations";
const $ = (id) => document.getElementById(id);
let conversations = loadConversations();
let current = conversations.length ? conversations[0].id : null;
let running = null; // {controller} while a request streams

function loadConversations() {
  try {
    const value = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(value) ? value : [];
  } catch (e) {
    return [];
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function conversation() {
  let c = conversations.find((x) => x.id === current);
  if (!c) {
    c = { id: String(Date.now()) + Math.random().toString(16).slice(2), title: "New conversation", messages: [] };
    conversations.unshift(c);
    current = c.id;
  }
  return c;
}

// ---- text to HTML, safely --------------------------------------------------------------------------------------
function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[ch]));
}

function inline(escaped) {
  return escaped
    .replace(/`([^`\n]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)"]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
}

// Markdown: fenced code blocks, headings, lists, paragraphs, inline code, bold, italics, http(s) links. The text is
// escaped before any of it, so nothing the model writes becomes markup of its own.
function markdown(source) {
  const parts = source.split("```");
  let html = "";
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const newline = part.indexOf("\n");
      const code = newline >= 0 ? part.slice(newline + 1) : part;
      html += "<pre><code>" + escapeHtml(code.replace(/\n$/, "")) + "</code></pre>";
      return;
    }
    for (const block of part.split(/\n{2,}/)) {
      const lines = block.split("\n").filter((l) => l.trim() !== "");
      if (!lines.length) continue;
      const heading = /^(#{1,6})\s+(.*)$/.exec(lines[0]);
      if (heading && lines.length === 1) {
        const level = heading[1].length;
        html += `<h${level}>${inline(escapeHtml(heading[2]))}</h${level}>`;
      } else if (lines.every((l) => /^\s*([-*]|\d+\.)\s+/.test(l))) {
        html += "<ul>" + lines.map((l) => "<li>" + inline(escapeHtml(l.replace(/^\s*([-*]|\d+\.)\s+/, ""))) + "</li>").join("") + "</ul>";
      } else {
        html += "<p>" + lines.map((l) => inline(escapeHtml(l))).join("<br>") + "</p>";
      }
    }
  });
  return html;
}

// ---- rendering ---------------------------------------------------------------------------------------------------
function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.textContent = c.title;
    li.className = c.id === current ? "current" : "";
    li.addEventListener("click", () => { if (!running) { current = c.id; render(); } });
    list.appendChild(li);
  }
}

function tokenSpans(container, spans) {
  for (const span of spans) {
    const el = document.createElement("span");
    el.className = "tok " + (span.draft ? "draft" : "target");
    el.textContent = span.text;
    container.appendChild(el);
  }
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [`${stats.tok_s.toFixed(1)} tok/s`, `first token ${(stats.ttft_s * 1000).toFixed(0)} ms`,
    `${stats.completion_tokens} tokens`];
  const spec = stats.speculative;
  if (spec) {
    parts.push(`drafted ${spec.drafted_tokens}`, `accepted ${spec.accepted_tokens}`,
      `acceptance ${(spec.acceptance_rate * 100).toFixed(0)}%`,
      `${(stats.completion_tokens / Math.max(1, spec.target_passes)).toFixed(2)} tokens a target pass`);
  }
  return parts.join(" · ");
}

function messageElement(message, index) {
  const el = document.createElement("div");
  el.className = "message " + message.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  el.appendChild(role);
  if (message.role === "user") {
    const body = document.createElement("div");
    body.className = "tokens";
    body.textContent = message.content;
    el.appendChild(body);
    return el;
  }
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thought = document.createElement("div");
  thought.className = "thought";
  thought.textContent = message.reasoning || "";
  thinking.append(summary, thought);
  thinking.hidden = !message.reasoning;
  const tokens = document.createElement("div");
  tokens.className = "tokens";
  tokenSpans(tokens, message.spans || [{ text: message.content, draft: false }]);
  const rendered = document.createElement("div");
  rendered.className = "markdown";
  rendered.innerHTML = markdown(message.content); // escaped inside markdown()
  rendered.hidden = true;
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = statsText(message.stats);
  const actions = document.createElement("div");
  actions.className = "actions";
  const toggle = button("Markdown", () => {
    const showMarkdown = rendered.hidden;
    rendered.hidden = !showMarkdown;
    tokens.hidden = showMarkdown;
    toggle.textContent = showMarkdown ? "Draft tokens" : "Markdown";
  });
  actions.append(toggle, button("Copy", () => navigator.clipboard && navigator.clipboard.writeText(message.content)));
  el.append(thinking, tokens, rendered, stats, actions);
  el.dataset.index = String(index);
  return el;
}

function button(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function render() {
  renderSidebar();
  const box = $("messages");
  box.replaceChildren();
  const c = conversations.find((x) => x.id === current);
  if (c) c.messages.forEach((m, i) => box.appendChild(messageElement(m, i)));
  box.scrollTop = box.scrollHeight;
}

function showError(text) {
  const el = $("error");
  el.textContent = text;
  el.hidden = !text;
}

// ---- the API -----------------------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("quickdraft.key");
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(response) {
  let detail = "";
  try { detail = (await response.json()).error.message; } catch (e) { /* not JSON */ }
  if (response.status === 401) {
    $("key-form").hidden = false;
    return "401: this server needs an API key (or the key given is wrong). Enter it below; it is kept for this tab only.";
  }
  if (response.status === 413) return "413: the conversation is larger than this server accepts: start a new one.";
  if (response.status === 429) return "429: the server is busy: try again in a moment.";
  if (response.status >= 500) return `${response.status}: the server failed: ${detail}`;
  return `${response.status}: ${detail}`;
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) { showError(await errorText(response)); return; }
  const select = $("model");
  select.replaceChildren();
  for (const m of (await response.json()).data) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.id;
    select.appendChild(option);
  }
}

function requestBody(messages) {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const system = $("system").value.trim();
  const maxDraft = number("max_draft");
  const body = {
    model: $("model").value || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(
      messages.map((m) => ({ role: m.role, content: m.content }))),
    stream: true,
    stream_options: { include_usage: true, include_draft_info: true },
    temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"), seed: number("seed"),
    speculative: $("speculative").checked ? (maxDraft === undefined ? true : { max_draft_tokens: maxDraft }) : false,
  };
  if ($("json_mode").checked) body.response_format = { type: "json_object" };
  return body;
}

// Sends the conversation and streams the answer into a new assistant message.
async function complete(c) {
  const answer = { role: "assistant", content: "", reasoning: "", spans: [], stats: null };
  c.messages.push(answer);
  render();
  const el = $("messages").lastElementChild;
  const tokens = el.querySelector(".tokens");
  const thinking = el.querySelector(".thinking");
  tokens.replaceChildren();
  const controller = new AbortController();
  running = { controller };
  setRunning(true);
  const started = performance.now();
  let firstAt = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(c.messages.slice(0, -1))),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const data = JSON.parse(event.slice(6));
        if (data.error) throw new Error(`the server failed: ${data.error.message}`);
        if (data.usage) usage = data.usage;
        const choice = data.choices && data.choices[0];
        if (!choice) continue;
        const thought = choice.delta && choice.delta.reasoning_content;
        if (thought) { // a reasoning model's thinking, apart from its answer (textContent: never markup)
          if (firstAt === null) firstAt = performance.now();
          answer.reasoning += thought;
          thinking.hidden = false;
          thinking.querySelector(".thought").textContent = answer.reasoning;
        }
        const spans = choice.draft_info ? choice.draft_info.spans
          : (choice.delta && choice.delta.content ? [{ text: choice.delta.content, draft: false }] : []);
        if (spans.length && firstAt === null) firstAt = performance.now();
        for (const s of spans) { answer.content += s.text; answer.spans.push(s); }
        tokenSpans(tokens, spans);
      }
    }
    if (usage) {
      const end = performance.now();
      const decodeS = firstAt === null ? 0 : (end - firstAt) / 1000;
      answer.stats = { completion_tokens: usage.completion_tokens, speculative: usage.speculative,
        ttft_s: ((firstAt || end) - started) / 1000,
        tok_s: decodeS > 0 ? (usage.completion_tokens - 1) / decodeS : 0 };
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      showError(e instanceof TypeError ? "The connection to the server was lost." : e.message);
    }
  } finally {
    running = null;
    setRunning(false);
    if (!answer.content && !answer.reasoning && !answer.stats) c.messages.pop();
    save();
    render();
  }
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("regenerate").disabled = on;
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || running) return;
  showError("");
  const c = conversation();
  if (!c.messages.length) c.title = text.slice(0, 60);
  c.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  save();
  complete(c);
}

function regenerate() {
  const c = conversations.find((x) => x.id === current);
  if (!c || running) return;
  while (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  if (c.messages.length) complete(c);
}

function init() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", () => running && running.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => { if (!running) { current = null; conversation(); save(); render(); } });
  $("clear-all").addEventListener("click", () => {
    if (running) return;
    conversations = [];
    current = null;
    localStorage.removeItem(STORE);
    render();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("quickdraft.key", $("api-key").value);
    $("key-form").hidden = true;
    showError("");
    loadModels();
  });
  render();
  loadModels();
}

document.addEventListener("DOMContentLoaded", init);
