// The chat page: conversations, the composer, streaming answers, settings and the API key.
import { ApiError, listModels, streamChat } from "./api.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const el = {
  log: $("log"),
  empty: $("empty"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  model: $("model"),
  status: $("status"),
  chatList: $("chat-list"),
  sidebar: $("sidebar"),
  scrim: $("scrim"),
  menu: $("menu"),
  theme: $("theme"),
  settings: $("settings"),
  settingsForm: $("settings-form"),
  settingsError: $("settings-error"),
  keyDialog: $("key-dialog"),
  keyInput: $("api-key"),
  keyError: $("key-error"),
};

const state = {
  chats: store.loadChats(),
  chatId: null,
  settings: store.loadSettings(),
  apiKey: store.loadKey(),
  streaming: null, // {controller} while an answer streams
};

// ---- small helpers ------------------------------------------------------------------------

const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
const currentChat = () => state.chats.find((c) => c.id === state.chatId) ?? null;

function showStatus(text) {
  el.status.textContent = text;
  el.status.hidden = !text;
}

function persist() {
  if (!store.saveChats(state.chats)) {
    showStatus("This browser refused to store the conversations (storage full or disabled).");
  }
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API off https and localhost: copy through a selected text area.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = label), 1500);
}

function button(label, action, extra = "") {
  const b = document.createElement("button");
  b.type = "button";
  b.className = `btn small ${extra}`.trim();
  b.textContent = label;
  b.dataset.action = action;
  return b;
}

// ---- one message on screen ----------------------------------------------------------------

function statsText(m) {
  const s = m.stats;
  if (!s) return "";
  const parts = [];
  if (s.completion_tokens != null) parts.push(`${s.completion_tokens} tokens`);
  if (s.tok_per_s != null) parts.push(`${s.tok_per_s.toFixed(1)} tok/s`);
  if (s.prompt_tokens != null) parts.push(`prompt ${s.prompt_tokens} tokens`);
  if (s.ttft_s != null) parts.push(`first token ${s.ttft_s.toFixed(2)} s`);
  if (m.finish === "length") parts.push("stopped at the token limit");
  if (m.stopped) parts.push(`stopped after ${s.elapsed_s.toFixed(1)} s`);
  return parts.join(" · ");
}

function toolCallsHtml(calls) {
  return calls
    .map((c) => {
      let args = c.function.arguments;
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch {
        // partial while streaming, or not JSON: shown as sent
      }
      const name = escapeHtml(c.function.name);
      return (
        `<div class="tool-call"><div class="tool-head">Tool call <code>${name}</code></div>` +
        `<pre><code>${escapeHtml(args)}</code></pre></div>`
      );
    })
    .join("");
}

class MessageView {
  constructor(message, index) {
    this.message = message;
    this.root = document.createElement("article");
    this.root.className = `msg ${message.role}`;
    this.root.dataset.index = index;
    const who = document.createElement("h2");
    who.className = "who";
    who.textContent = message.role === "user" ? "You" : message.model || "Assistant";
    this.root.append(who);
    if (message.role === "user") {
      this.body = document.createElement("div");
      this.body.className = "body plain";
      this.body.textContent = message.content;
      this.root.append(this.body);
    } else {
      this.reasoning = document.createElement("details");
      this.reasoning.className = "reasoning";
      this.reasoning.innerHTML = '<summary>Reasoning</summary><div class="md"></div>';
      this.body = document.createElement("div");
      this.body.className = "body md";
      this.tools = document.createElement("div");
      this.tools.className = "tools";
      this.error = document.createElement("p");
      this.error.className = "error";
      this.error.setAttribute("role", "alert");
      this.root.append(this.reasoning, this.body, this.tools, this.error);
    }
    this.meta = document.createElement("footer");
    this.meta.className = "meta";
    this.stats = document.createElement("span");
    this.stats.className = "stats";
    this.meta.append(this.stats, button("Copy", "copy"));
    this.root.append(this.meta);
    this.frame = 0;
    this.render();
  }

  // Coalesces the updates of one frame: a fast stream re-renders once per frame, not per chunk.
  update() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.render();
    });
  }

  render() {
    // A render now supersedes one still waiting for its frame: the answer's last render (when
    // the stream ends) stays the last, so nothing rebuilt afterwards drops a selection or the
    // state of a code block's Copy button.
    if (this.frame) {
      cancelAnimationFrame(this.frame);
      this.frame = 0;
    }
    const m = this.message;
    if (m.role === "user") return;
    const streaming = Boolean(m.streaming);
    this.root.setAttribute("aria-busy", String(streaming));
    this.root.classList.toggle("streaming", streaming);
    this.reasoning.hidden = !m.reasoning;
    if (m.reasoning) this.reasoning.lastElementChild.innerHTML = renderMarkdown(m.reasoning);
    this.body.hidden =
      !m.content && (Boolean(m.error) || Boolean(m.tool_calls?.length) || !streaming);
    this.body.innerHTML = renderMarkdown(m.content);
    this.tools.hidden = !m.tool_calls?.length;
    this.tools.innerHTML = m.tool_calls?.length ? toolCallsHtml(m.tool_calls) : "";
    this.error.hidden = !m.error;
    this.error.textContent = m.error ?? "";
    this.stats.textContent = statsText(m);
    this.meta.hidden = streaming;
  }

  setLast(isLast) {
    const old = this.meta.querySelector('[data-action="regenerate"]');
    if (isLast && this.message.role === "assistant" && !old) {
      this.meta.append(button(this.message.error ? "Retry" : "Regenerate", "regenerate"));
    } else if (!isLast && old) old.remove();
  }
}

// ---- the conversation on screen -----------------------------------------------------------

let views = [];

function nearBottom() {
  return el.log.scrollHeight - el.log.scrollTop - el.log.clientHeight < 80;
}

function scrollDown() {
  el.log.scrollTop = el.log.scrollHeight;
}

function renderChat() {
  const chat = currentChat();
  views.forEach((v) => v.root.remove());
  views = (chat?.messages ?? []).map((m, i) => new MessageView(m, i));
  el.log.append(...views.map((v) => v.root));
  views.forEach((v, i) => v.setLast(i === views.length - 1 && !state.streaming));
  el.empty.hidden = views.length > 0;
  scrollDown();
  renderChatList();
}

function renderChatList() {
  el.chatList.replaceChildren(
    ...[...state.chats]
      .sort((a, b) => b.updated - a.updated)
      .map((c) => {
        const li = document.createElement("li");
        const open = document.createElement("button");
        open.type = "button";
        open.className = "chat-open";
        open.dataset.id = c.id;
        open.textContent = c.title || "New chat";
        if (c.id === state.chatId) open.setAttribute("aria-current", "true");
        const del = document.createElement("button");
        del.type = "button";
        del.className = "chat-delete";
        del.dataset.delete = c.id;
        del.setAttribute("aria-label", `Delete "${c.title || "New chat"}"`);
        del.textContent = "×";
        li.append(open, del);
        return li;
      }),
  );
}

function openChat(id) {
  if (state.streaming) return;
  state.chatId = id;
  renderChat();
  closeSidebar();
}

function newChat() {
  if (state.streaming) return;
  state.chatId = null;
  renderChat();
  closeSidebar();
  el.prompt.focus();
}

// ---- asking the server --------------------------------------------------------------------

function requestBody(chat) {
  const s = state.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of chat.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.content || m.tool_calls?.length) {
      const out = { role: "assistant", content: m.content };
      if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    }
  }
  const body = { ...(s.extra.trim() ? JSON.parse(s.extra) : {}), messages, stream: true };
  body.stream_options = { ...(body.stream_options ?? {}), include_usage: true };
  if (el.model.value) body.model = el.model.value;
  for (const k of ["temperature", "top_p", "max_tokens"]) if (s[k] !== "") body[k] = Number(s[k]);
  return body;
}

function addDelta(m, delta) {
  if (delta.content) m.content += delta.content;
  if (delta.reasoning_content) m.reasoning = (m.reasoning ?? "") + delta.reasoning_content;
  for (const tc of delta.tool_calls ?? []) {
    m.tool_calls ??= [];
    const call = (m.tool_calls[tc.index] ??= {
      id: "",
      type: "function",
      function: { name: "", arguments: "" },
    });
    if (tc.id) call.id = tc.id;
    if (tc.function?.name) call.function.name += tc.function.name;
    if (tc.function?.arguments) call.function.arguments += tc.function.arguments;
  }
}

async function answer(chat) {
  const message = { role: "assistant", content: "", model: el.model.value, streaming: true };
  let body;
  try {
    body = requestBody(chat);
  } catch (e) {
    message.error = `The "other request fields" setting is not valid JSON: ${e.message}`;
  }
  chat.messages.push(message);
  chat.updated = Date.now();
  const view = new MessageView(message, chat.messages.length - 1);
  views.forEach((v) => v.setLast(false));
  views.push(view);
  el.log.append(view.root);
  el.empty.hidden = true;
  scrollDown();
  const controller = new AbortController();
  setStreaming({ controller });
  const t0 = performance.now();
  let first = null;
  let usage = null;
  try {
    if (body) {
      await streamChat(body, state.apiKey, controller.signal, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        // The server sends its first chunk once the first token is out (even a token that
        // shows nothing yet, such as the start of a tool call).
        if (first === null && chunk.choices?.length) first = performance.now();
        // One answer per request: a second choice (an `n` in the other fields) is not shown.
        for (const c of (chunk.choices ?? []).filter((x) => (x.index ?? 0) === 0)) {
          const d = c.delta ?? {};
          addDelta(message, d);
          if (c.finish_reason) message.finish = c.finish_reason;
        }
        const follow = nearBottom();
        view.update();
        if (follow) requestAnimationFrame(scrollDown);
      });
    }
  } catch (e) {
    if (e.name === "AbortError") message.stopped = true;
    else message.error = e.message;
    if (e instanceof ApiError && e.status === 401) askForKey(e.message);
  } finally {
    const end = performance.now();
    const n = usage?.completion_tokens;
    message.stats = {
      completion_tokens: n ?? null,
      prompt_tokens: usage?.prompt_tokens ?? null,
      // Decode speed: the tokens after the first over the time after the first.
      tok_per_s: n > 1 && first !== null && end > first ? ((n - 1) * 1000) / (end - first) : null,
      ttft_s: first !== null ? (first - t0) / 1000 : null,
      elapsed_s: (end - t0) / 1000,
    };
    delete message.streaming;
    setStreaming(null);
    view.render();
    view.setLast(true);
    persist();
    renderChatList();
  }
}

function setStreaming(s) {
  state.streaming = s;
  el.send.hidden = Boolean(s);
  el.stop.hidden = !s;
  el.log.setAttribute("aria-busy", String(Boolean(s)));
}

function send() {
  const text = el.prompt.value;
  if (!text.trim() || state.streaming) return;
  let chat = currentChat();
  if (!chat) {
    chat = { id: newId(), title: "", updated: Date.now(), messages: [] };
    state.chats.push(chat);
    state.chatId = chat.id;
  }
  if (!chat.title) chat.title = text.trim().replace(/\s+/g, " ").slice(0, 60);
  chat.messages.push({ role: "user", content: text });
  el.prompt.value = "";
  growPrompt();
  renderChat();
  persist();
  answer(chat);
}

function regenerate() {
  const chat = currentChat();
  if (!chat || state.streaming || chat.messages.at(-1)?.role !== "assistant") return;
  chat.messages.pop();
  views.pop().root.remove();
  answer(chat);
}

// ---- models and the API key ---------------------------------------------------------------

let modelsTimer = null;

async function loadModels() {
  clearTimeout(modelsTimer);
  try {
    const models = await listModels(state.apiKey);
    if (!models.length) {
      showStatus("The server is starting; waiting for a model…");
      modelsTimer = setTimeout(loadModels, 2000);
      return false;
    }
    el.model.replaceChildren(
      ...models.map((m) => {
        const o = document.createElement("option");
        o.value = o.textContent = m.id;
        return o;
      }),
    );
    if (models.some((m) => m.id === state.settings.model)) el.model.value = state.settings.model;
    showStatus("");
    return true;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      askForKey(state.apiKey ? "The server refused this key." : "");
      return false;
    }
    showStatus(`Cannot list the models: ${e.message}. Trying again…`);
    modelsTimer = setTimeout(loadModels, 3000);
    return false;
  }
}

function askForKey(message) {
  el.keyError.textContent = message;
  el.keyError.hidden = !message;
  if (!el.keyDialog.open) el.keyDialog.showModal();
  el.keyInput.focus();
}

el.keyDialog.addEventListener("cancel", (e) => e.preventDefault()); // the page needs a key
el.keyDialog.addEventListener("submit", async (e) => {
  e.preventDefault();
  state.apiKey = el.keyInput.value.trim();
  store.saveKey(state.apiKey);
  el.keyError.hidden = true;
  if (await loadModels()) {
    el.keyDialog.close();
    el.keyInput.value = "";
    el.prompt.focus();
  }
});

// ---- settings -----------------------------------------------------------------------------

function openSettings() {
  const f = el.settingsForm.elements;
  for (const k of ["system", "temperature", "top_p", "max_tokens", "extra"])
    f[k].value = state.settings[k];
  el.settingsError.hidden = true;
  el.settings.showModal();
}

el.settingsForm.addEventListener("submit", (e) => {
  if (e.submitter?.value !== "save") return;
  const f = el.settingsForm.elements;
  const extra = f.extra.value.trim();
  let problem = "";
  if (extra) {
    try {
      const v = JSON.parse(extra);
      if (typeof v !== "object" || v === null || Array.isArray(v))
        problem = "Other request fields must be a JSON object.";
    } catch (err) {
      problem = `Other request fields are not valid JSON: ${err.message}`;
    }
  }
  if (problem) {
    e.preventDefault();
    el.settingsError.textContent = problem;
    el.settingsError.hidden = false;
    return;
  }
  for (const k of ["system", "temperature", "top_p", "max_tokens"]) state.settings[k] = f[k].value;
  state.settings.extra = extra;
  store.saveSettings(state.settings);
});

$("forget-key").addEventListener("click", () => {
  state.apiKey = "";
  store.saveKey("");
  el.settings.close();
  loadModels();
});

// ---- theme and the phone-width drawer -----------------------------------------------------

const THEMES = ["", "light", "dark"];

function applyTheme(t) {
  if (t) document.documentElement.dataset.theme = t;
  else delete document.documentElement.dataset.theme;
  el.theme.setAttribute("aria-label", `Theme: ${t || "system"}`);
}

el.theme.addEventListener("click", () => {
  const t = THEMES[(THEMES.indexOf(store.loadTheme()) + 1) % THEMES.length];
  store.saveTheme(t);
  applyTheme(t);
});

function closeSidebar() {
  el.sidebar.classList.remove("open");
  el.scrim.hidden = true;
  el.menu.setAttribute("aria-expanded", "false");
}

el.menu.addEventListener("click", () => {
  const open = !el.sidebar.classList.contains("open");
  el.sidebar.classList.toggle("open", open);
  el.scrim.hidden = !open;
  el.menu.setAttribute("aria-expanded", String(open));
  if (open) $("new-chat").focus();
});
el.scrim.addEventListener("click", closeSidebar);

// ---- events -------------------------------------------------------------------------------

const PROMPT_MAX_PX = 240;

function growPrompt() {
  el.prompt.style.height = "auto";
  const h = el.prompt.scrollHeight + 2; // + the borders (border-box)
  el.prompt.style.height = `${Math.min(h, PROMPT_MAX_PX)}px`;
  el.prompt.style.overflowY = h > PROMPT_MAX_PX ? "auto" : "hidden";
}

const touch = matchMedia("(pointer: coarse)");

el.prompt.addEventListener("input", growPrompt);
el.prompt.addEventListener("keydown", (e) => {
  // On a phone's keyboard Enter is a new line; the Send button sends.
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !touch.matches) {
    e.preventDefault();
    send();
  }
});
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
el.stop.addEventListener("click", () => state.streaming?.controller.abort());
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape" || document.querySelector("dialog[open]")) return;
  if (el.sidebar.classList.contains("open")) {
    closeSidebar();
    el.menu.focus();
  } else state.streaming?.controller.abort();
});
el.model.addEventListener("change", () => {
  state.settings.model = el.model.value;
  store.saveSettings(state.settings);
});
$("open-settings").addEventListener("click", openSettings);
$("new-chat").addEventListener("click", newChat);

el.chatList.addEventListener("click", (e) => {
  const t = e.target.closest("button");
  if (!t || state.streaming) return;
  if (t.dataset.id) openChat(t.dataset.id);
  if (t.dataset.delete) {
    state.chats = state.chats.filter((c) => c.id !== t.dataset.delete);
    if (state.chatId === t.dataset.delete) state.chatId = null;
    persist();
    renderChat();
  }
});

el.log.addEventListener("click", (e) => {
  const t = e.target.closest("button");
  if (!t) return;
  if (t.classList.contains("copy-code")) {
    copyText(t.closest(".code").querySelector("code").textContent, t);
    return;
  }
  const index = Number(t.closest("article")?.dataset.index);
  const m = currentChat()?.messages[index];
  if (t.dataset.action === "copy" && m) copyText(m.content || m.error || "", t);
  if (t.dataset.action === "regenerate") regenerate();
});

// ---- start --------------------------------------------------------------------------------

applyTheme(store.loadTheme());
growPrompt();
state.chatId = [...state.chats].sort((a, b) => b.updated - a.updated)[0]?.id ?? null;
renderChat();
loadModels();
el.prompt.focus();
