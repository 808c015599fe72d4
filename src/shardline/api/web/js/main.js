// The dashboard: one live feed (/events, starting with the whole /state), views drawn from the newest state.
import { Chat } from "./chat.js";
import { renderInstances, renderNodes, renderTimeline } from "./cluster.js";
import { call, apiKey, NeedsKey, setApiKey, streamEvents } from "./net.js";
import { Placer } from "./place.js";

const SILENCE_MS = 12000;
const $ = (id) => document.getElementById(id);
const conn = $("conn");
const keyDialog = $("key-dialog");

let state = null;
const events = new Map(); // cluster events by identity: snapshots and the live feed both bring them

function status(kind, text) {
  conn.dataset.conn = kind;
  conn.textContent = text;
}

function askKey() {
  if (!keyDialog.open) {
    $("key-input").value = apiKey();
    keyDialog.showModal();
  }
}

const chat = new Chat({ onNeedsKey: askKey });
const placer = new Placer({ onNeedsKey: askKey });

function eventKey(e) {
  return `${e.at}|${e.kind}|${e.node}|${e.instance}`;
}

function addEvent(e) {
  events.set(eventKey(e), e);
  if (events.size > 500) events.delete(events.keys().next().value);
}

function sortedEvents() {
  return [...events.values()].sort((a, b) => a.at - b.at);
}

async function remove(instance, wrap) {
  try {
    await call(`/instances/${encodeURIComponent(instance)}`, { method: "DELETE" });
    wrap.replaceChildren(document.createTextNode("removing…"));
  } catch (err) {
    if (err instanceof NeedsKey) askKey();
    wrap.replaceChildren(document.createTextNode(err.message));
  }
}

function draw() {
  if (!state) return;
  const name = (id) => state.nodes.find((n) => n.node_id === id)?.name || id;
  const master = state.master ? `master ${name(state.master)}` : "no master";
  $("where").textContent = `this is ${name(state.node)} · ${master} · term ${state.term}`;
  renderNodes($("nodes"), state);
  renderInstances($("instances"), state, { onRemove: remove });
  renderTimeline($("timeline"), sortedEvents());
  const placed = state.instances.filter((i) => i.phase !== "failed").map((i) => i.model);
  const held = state.nodes.filter((n) => n.alive).flatMap((n) => n.models);
  const models = [...new Set([...placed, ...held])].sort();
  chat.setModels(models);
  placer.setModels([...new Set(held)].sort());
  placer.names = new Map(state.nodes.map((n) => [n.node_id, n.name || n.node_id]));
}

function take(snapshot) {
  state = snapshot;
  for (const e of snapshot.events) addEvent(e);
  draw();
}

// The feed, for as long as the page is open: on any break, show it and connect again with a growing pause.
async function follow() {
  let pause = 500;
  for (;;) {
    // The node sends a state every few seconds: silence this long is a connection that died unseen.
    const abort = new AbortController();
    let watchdog = setTimeout(() => abort.abort(), SILENCE_MS);
    try {
      await streamEvents("/events", {
        signal: abort.signal,
        onEvent: (name, data) => {
          clearTimeout(watchdog);
          watchdog = setTimeout(() => abort.abort(), SILENCE_MS);
          if (name === "state") {
            take(JSON.parse(data));
            status("live", "live");
            pause = 500;
          } else if (name === "cluster") {
            addEvent(JSON.parse(data));
            draw();
          }
        },
      });
      status("retry", "reconnecting");
    } catch (err) {
      if (err instanceof NeedsKey) {
        status("key", "needs API key");
        askKey();
        await new Promise((resolve) => keyDialog.addEventListener("close", resolve, { once: true }));
        continue;
      }
      status("retry", "reconnecting");
    } finally {
      clearTimeout(watchdog);
    }
    await new Promise((resolve) => setTimeout(resolve, pause));
    pause = Math.min(pause * 2, 5000);
  }
}

$("key-open").addEventListener("click", askKey);
$("key-form").addEventListener("submit", (e) => {
  const action = e.submitter?.value;
  if (action === "clear") setApiKey("");
  else setApiKey($("key-input").value.trim());
});

follow();
