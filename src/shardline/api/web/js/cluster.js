// The cluster as pictures: node cards, each instance's stages laid over its nodes, live figures, timeline.
import { bytes, clock, h, layers, percent, seconds, swap } from "./dom.js";
import { sparkline } from "./spark.js";

export function stageColor(k) {
  return `hsl(${(205 + k * 67) % 360} 62% 46%)`;
}

function nodeStatus(node) {
  if (!node.alive) return ["unreachable", "bad"];
  if (node.leaving) return ["leaving", "warn"];
  return ["up", "ok"];
}

export function renderNodes(container, state) {
  const nodes = state.nodes;
  const key = JSON.stringify(nodes.map((n) => [n.node_id, n.alive, n.leaving, n.master, n.resources, n.api, n.left_at, n.downloads]));
  swap(container, key, () => {
    if (!nodes.length) return h("p", { class: "empty" }, "No nodes yet.");
    return nodes.map((n) => {
      const [status, tone] = nodeStatus(n);
      const r = n.resources;
      const used = r ? r.memory_total - r.memory_available : 0;
      const pct = r && r.memory_total ? Math.round((100 * used) / r.memory_total) : 0;
      return h(
        "article",
        { class: `node ${tone}`, "data-node": n.node_id, "data-status": status, "aria-label": `node ${n.node_id}` },
        h(
          "header",
          {},
          h("strong", {}, n.name || n.node_id),
          n.master ? h("span", { class: "badge master", title: "the master places instances and heals them" }, "master") : null,
          h("span", { class: `badge ${tone}`, "data-role": "status" }, status),
        ),
        n.name && n.name !== n.node_id ? h("p", { class: "addr", title: "node id" }, n.node_id) : null,
        h("p", { class: "addr", title: "where peers connect" }, n.endpoint.replace(/^tcp\//, "")),
        n.api ? h("p", { class: "addr" }, h("a", { href: n.api + "/" }, n.api.replace(/^https?:\/\//, ""))) : null,
        r
          ? [
              h(
                "div",
                { class: "meter", role: "meter", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": pct, "aria-label": "memory used" },
                h("span", { style: `width:${pct}%` }),
              ),
              h("p", { class: "small" }, `${bytes(used)} used · ${bytes(r.memory_available)} free of ${bytes(r.memory_total)}`),
              h("p", { class: "small" }, `score ${r.compute_score.toFixed(1)} GFLOP/s · ${r.device} · ${r.cpus} CPUs`),
            ]
          : h("p", { class: "small" }, n.left_at ? `last seen ${clock(n.left_at)}` : "no report"),
        downloadRows(n.downloads || {}),
      );
    });
  });
}

// A model this node downloads for the cluster (the others copy their stages from it).
function downloadRows(downloads) {
  return Object.entries(downloads)
    .filter(([, d]) => d.phase !== "done")
    .map(([model, d]) => {
      const pct = d.total_bytes ? Math.floor((100 * d.done_bytes) / d.total_bytes) : 0;
      const what = d.phase === "failed" ? `failed: ${d.error}` : d.total_bytes ? `${d.phase} ${pct}% of ${bytes(d.total_bytes)}` : `${d.phase} ${bytes(d.done_bytes)}`;
      return h(
        "div",
        { class: "download", "data-download": model, title: `${model} from ${d.source}` },
        h("p", { class: "small" }, `⤓ ${d.source}: ${what}`),
        d.phase === "failed" ? null : h("div", { class: "meter", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": pct, "aria-label": `download of ${model}` }, h("span", { style: `width:${pct}%` })),
      );
    });
}

const PHASE_LABEL = { weights: "copying weights", warming: "warming up" };
const phaseLabel = (p) => PHASE_LABEL[p] || p;
// A generation id is (master term << 20) | count (controller/state.py): shown as "term.count".
const GENERATION_SPAN = 1 << 20;
const generationLabel = (g) => (g >= GENERATION_SPAN ? `${Math.floor(g / GENERATION_SPAN)}.${g % GENERATION_SPAN}` : `${g}`);
const PHASE_TONE = { ready: "ok", recovering: "warn", failed: "bad", weights: "busy", loading: "busy", warming: "busy", placed: "busy", starting: "busy" };

// A runner's stage: its own slot for a pipeline stage or a group's face, its face's for another member
// (a tensor-parallel group shares its stage's layers, 1/k of each).
function ringStage(st, k) {
  return st.ring === null || st.ring === undefined ? k : st.ring;
}

function stageBand(st, k, total) {
  const copying = st.phase === "weights" && st.weights_total > 0;
  const pct = copying ? Math.floor((100 * st.weights_done) / st.weights_total) : 0;
  const stage = ringStage(st, k);
  const name = st.member ? `stage ${stage} · member ${st.member}` : `stage ${stage}`;
  return h(
    "div",
    {
      class: "band",
      "data-stage": k,
      style: `--c:${stageColor(stage)};flex-grow:${st.end - st.start}`,
      title: `${name}: ${layers(st.start, st.end)} of ${total}, ${phaseLabel(st.phase)}`,
    },
    h("span", { class: "band-name" }, name),
    h("span", { class: "band-range", "data-role": "range" }, layers(st.start, st.end)),
    h("span", { class: `band-phase ${PHASE_TONE[st.phase] || ""}` }, copying ? `copying weights ${pct}%` : phaseLabel(st.phase)),
    copying ? h("span", { class: "progress", style: `width:${pct}%` }) : null,
  );
}

function picture(inst, nodesById) {
  const total = inst.stages.length ? inst.stages[inst.stages.length - 1].end : 0;
  // Nodes in pipeline order, each with the stages it holds.
  const order = [];
  inst.stages.forEach((st, k) => {
    let box = order.find((b) => b.node === st.node_id);
    if (!box) order.push((box = { node: st.node_id, stages: [] }));
    box.stages.push([st, k]);
  });
  const strip = h(
    "div",
    { class: "strip", "aria-hidden": "true" },
    inst.stages.filter((st) => !st.member).map((st, k) => h("span", { style: `--c:${stageColor(k)};flex-grow:${st.end - st.start}` })),
  );
  const boxes = order.map((b, i) => {
    const node = nodesById.get(b.node);
    const down = node && !node.alive;
    return [
      i ? h("span", { class: "hop", "aria-hidden": "true" }, "→") : null,
      h(
        "div",
        { class: `box${down ? " down" : ""}`, "data-node-box": b.node },
        h(
          "div",
          { class: "box-name", title: `node ${b.node}` },
          node?.name || b.node,
          down ? h("span", { class: "badge bad" }, "unreachable") : null,
        ),
        h("div", { class: "bands" }, b.stages.map(([st, k]) => stageBand(st, k, total))),
      ),
    ];
  });
  const stages = inst.stages.filter((st) => !st.member).length;
  const group = stages ? inst.stages.length / stages : 1;
  const shape = group > 1 ? `, each a tensor-parallel group of ${group}` : "";
  return h("div", { class: "picture" }, strip, h("div", { class: "boxes" }, boxes), h("p", { class: "small" }, `${total} layers in ${stages} stage${stages === 1 ? "" : "s"}${shape}`));
}

function figure(name, label, value, series, title = null) {
  return h(
    "div",
    { class: "figure", "data-figure": name, title },
    h("span", { class: "fig-label" }, label),
    h("span", { class: "fig-value", "data-role": "value" }, value),
    sparkline(series, { label }),
  );
}

function figures(inst) {
  const live = inst.live;
  if (!live) return h("p", { class: "small" }, "no live figures from this node yet");
  const hist = live.history || [];
  return h(
    "div",
    { class: "figures" },
    figure("tokens", "tokens/s", live.tokens_per_s.toFixed(1), hist.map((p) => p.tokens_per_s)),
    figure("running", "running", String(live.instance_running), hist.map((p) => p.running)),
    figure("queued", "queued", String(live.instance_queued), hist.map((p) => p.queued)),
    figure("ttft", "first token", seconds(live.ttft_s), hist.map((p) => p.ttft_s)),
    // The value is over every prompt since this node first heard the instance; the line, per sample period.
    figure(
      "prefix",
      "prefix cache hits",
      percent(live.prefix_hit_rate),
      hist.map((p) => p.prefix_hit_rate),
      `${live.prefix_hits} of ${live.prefix_queries} prompt tokens looked up were cached`,
    ),
    figure(
      "blocks",
      "cached blocks",
      String(live.prefix_blocks),
      hist.map((p) => p.prefix_blocks),
      live.prefix_block_tokens ? `${live.prefix_block_tokens} tokens each` : null,
    ),
  );
}

export function renderInstances(container, state, { onRemove }) {
  const nodesById = new Map(state.nodes.map((n) => [n.node_id, n]));
  const insts = state.instances;
  if (!insts.length) {
    swap(container, "empty", () => h("p", { class: "empty" }, "No model placed yet. Place one below, or send a chat: it places its model."));
    return;
  }
  // One card per instance, kept across updates: its parts are rebuilt only when what they show changes,
  // so the figures move every few seconds without disturbing a half-confirmed Remove.
  const cards = insts.map((inst) => {
    let card = container.querySelector(`:scope > article[data-instance="${CSS.escape(inst.instance)}"]`);
    if (!card) {
      card = h("article", { class: "instance", "data-instance": inst.instance }, h("div", { class: "head" }), h("div", { class: "pic" }), h("div", { class: "live" }));
    }
    card.dataset.phase = inst.phase;
    const [head, pic, live] = card.children;
    swap(head, JSON.stringify([inst.model, inst.phase, inst.generation, inst.recoveries, inst.why, inst.weight_format, inst.layout]), () => [
      h(
        "header",
        {},
        h("strong", {}, inst.model),
        h("span", { class: `badge ${PHASE_TONE[inst.phase] || ""}`, "data-role": "phase" }, phaseLabel(inst.phase)),
        inst.weight_format ? h("span", { class: "badge format", "data-role": "weights", title: "how its weights are stored" }, inst.weight_format) : null,
        h("span", { class: "small" }, `${inst.instance} · generation ${generationLabel(inst.generation)} · ${inst.recoveries} recover${inst.recoveries === 1 ? "y" : "ies"}`),
        removeButton(inst.instance, onRemove),
      ),
      inst.why && inst.phase !== "ready" ? h("p", { class: "why" }, inst.why) : null,
      // Pipeline or groups, and why: the reason in a line, every candidate's figures on hover.
      inst.layout ? h("p", { class: "small layout", "data-role": "layout", title: inst.layout }, inst.layout.split(". Candidates:")[0]) : null,
    ].filter(Boolean));
    const alive = inst.stages.map((st) => nodesById.get(st.node_id)?.alive);
    swap(pic, JSON.stringify([inst.stages, alive]), () => picture(inst, nodesById));
    swap(live, JSON.stringify(inst.live), () => figures(inst));
    return card;
  });
  delete container.dataset.key;
  const current = [...container.children];
  if (current.length !== cards.length || current.some((c, i) => c !== cards[i])) container.replaceChildren(...cards);
}

// Two steps, both reachable from the keyboard: Remove, then Confirm (or Escape / Cancel).
function removeButton(instance, onRemove) {
  const wrap = h("span", { class: "remove" });
  const ask = h("button", { type: "button", class: "ghost small-btn", "aria-label": `remove ${instance}` }, "Remove");
  const confirm = h("button", { type: "button", class: "danger small-btn" }, "Confirm remove");
  const cancel = h("button", { type: "button", class: "ghost small-btn" }, "Cancel");
  const reset = () => wrap.replaceChildren(ask);
  ask.addEventListener("click", () => {
    wrap.replaceChildren(confirm, cancel);
    confirm.focus();
  });
  cancel.addEventListener("click", reset);
  wrap.addEventListener("keydown", (e) => e.key === "Escape" && reset());
  confirm.addEventListener("click", () => onRemove(instance, wrap));
  wrap.append(ask);
  return wrap;
}

const SHOWN = new Set([
  "failure", "recovered", "failed", "leave", "join", "placed", "ready", "removed", "master", "weights",
]);

export function renderTimeline(container, events) {
  const shown = events.filter((e) => SHOWN.has(e.kind));
  const key = JSON.stringify(shown.map((e) => [e.at, e.kind, e.node, e.instance]));
  swap(container, key, () => {
    if (!shown.length) return h("li", { class: "empty" }, "Nothing has happened yet.");
    return shown
      .slice()
      .reverse()
      .slice(0, 60)
      .map((e, i, rows) => {
        // A failure's pause is told by the recovery that followed it (a newer row, earlier in this list).
        let pause = null;
        if (e.kind === "failure") {
          const after = rows.slice(0, i).reverse().find((r) => r.kind === "recovered" && r.instance === e.instance);
          if (after && after.pause_s !== null && after.pause_s !== undefined) pause = after.pause_s;
        }
        const tone = { failure: "bad", failed: "bad", weights: "bad", leave: "warn", recovered: "ok", ready: "ok" }[e.kind] || "";
        return h(
          "li",
          { class: `event ${tone}`, "data-kind": e.kind },
          h("time", { datetime: new Date(e.at * 1000).toISOString() }, clock(e.at)),
          h("span", { class: `badge ${tone}` }, e.kind),
          h("span", { class: "what" }, [e.node && `node ${e.node}`, e.instance].filter(Boolean).join(" · ")),
          e.message ? h("span", { class: "message" }, e.message) : null,
          pause !== null && pause !== undefined ? h("span", { class: "pause" }, `paused ${seconds(pause)}`) : null,
        );
      });
  });
}
