// Talking to the node: JSON calls and server-sent events over fetch (EventSource cannot send a key).

const KEY_STORE = "shardline.api-key";

export class NeedsKey extends Error {}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function failure(res) {
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    message = body?.error?.message || body?.error || message;
  } catch {
    // not JSON: keep the status line
  }
  if (res.status === 401) return new NeedsKey(message);
  return new HttpError(res.status, message);
}

export async function call(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const res = await fetch(path, init);
  if (!res.ok) throw await failure(res);
  return res.json();
}

// POST (or GET) and hand each server-sent event to onEvent(name, data) until the stream ends.
export async function streamEvents(path, { method = "GET", body, signal, onEvent }) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const res = await fetch(path, init);
  if (!res.ok) throw await failure(res);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      let name = "message";
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}
