// The two API calls the page makes, with the key the user typed: GET v1/models and a streaming
// POST v1/chat/completions, read as server-sent events. Paths are relative, so the page also
// works behind a proxy that serves the gateway under a prefix.

export class ApiError extends Error {
  constructor(message, status = 0) {
    super(message);
    this.status = status;
  }
}

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

// The server's own message when the body is an OpenAI error object, else the status line.
async function errorOf(resp) {
  const text = await resp.text().catch(() => "");
  try {
    const msg = JSON.parse(text)?.error?.message;
    if (msg) return new ApiError(msg, resp.status);
  } catch {
    // not JSON: fall through
  }
  return new ApiError(
    `HTTP ${resp.status} ${resp.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`,
    resp.status,
  );
}

async function call(path, init) {
  try {
    return await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`cannot reach the server (${e.message})`);
  }
}

export async function listModels(apiKey) {
  const resp = await call("v1/models", { headers: headers(apiKey), cache: "no-store" });
  if (!resp.ok) throw await errorOf(resp);
  return (await resp.json()).data ?? [];
}

// Streams one chat completion; onChunk gets every parsed chunk. Resolves when the server sends
// [DONE]; rejects with ApiError on an HTTP or in-band error, with AbortError when stopped.
export async function streamChat(body, apiKey, signal, onChunk) {
  const resp = await call("v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    let value, done;
    try {
      ({ value, done } = await reader.read());
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(`the connection to the server was lost (${e.message})`);
    }
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.message ?? JSON.stringify(chunk.error), 200);
      onChunk(chunk);
    }
  }
  throw new ApiError("the stream ended before the server finished it");
}
