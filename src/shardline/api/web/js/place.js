// Placing a model: a preview first (the stages, or the numbers why it does not fit), then Place.
import { bytes, h, layers, setOptions } from "./dom.js";
import { call, NeedsKey } from "./net.js";
import { stageColor } from "./cluster.js";

export class Placer {
  constructor({ onNeedsKey }) {
    this.onNeedsKey = onNeedsKey;
    this.model = document.getElementById("place-model");
    this.sequences = document.getElementById("place-seq");
    this.tokens = document.getElementById("place-tokens");
    this.go = document.getElementById("place-go");
    this.out = document.getElementById("place-result");
    this.previewed = null;
    this.names = new Map(); // node id -> name, from the newest state
    document.getElementById("place-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.preview();
    });
    for (const el of [this.model, this.sequences, this.tokens]) el.addEventListener("input", () => this.stale());
    this.go.addEventListener("click", () => this.place());
  }

  setModels(models) {
    setOptions(this.model, models);
  }

  request() {
    const q = { model: this.model.value, sequences: Math.max(1, Number(this.sequences.value) || 4) };
    if (this.tokens.value) q.reserve_tokens = Math.max(1, Number(this.tokens.value));
    return q;
  }

  stale() {
    this.previewed = null;
    this.go.disabled = true;
  }

  fail(err) {
    if (err instanceof NeedsKey) this.onNeedsKey();
    this.out.replaceChildren(h("p", { class: "why", role: "alert" }, err.message));
  }

  async preview() {
    const q = this.request();
    if (!q.model) return;
    this.stale();
    this.out.replaceChildren(h("p", { class: "small" }, "asking the master…"));
    const params = new URLSearchParams(Object.entries(q).map(([k, v]) => [k, String(v)]));
    try {
      const p = await call(`/instances/preview?${params}`);
      if (!p.fits) {
        this.out.replaceChildren(h("div", { class: "verdict bad", "data-fits": "false" }, h("strong", {}, "Does not fit"), h("p", {}, p.reason)));
        return;
      }
      const pl = p.placement;
      this.out.replaceChildren(
        h(
          "div",
          { class: "verdict ok", "data-fits": "true" },
          h("strong", {}, `Fits in ${pl.stages.length} stage${pl.stages.length === 1 ? "" : "s"}, ${bytes(pl.need_bytes)} in all`),
          h(
            "table",
            {},
            h("thead", {}, h("tr", {}, ["stage", "node", "layers", "weights", "KV", "needs", "free"].map((c) => h("th", { scope: "col" }, c)))),
            h(
              "tbody",
              {},
              pl.stages.map((s, k) =>
                h(
                  "tr",
                  {},
                  h("td", {}, h("span", { class: "dot", style: `--c:${stageColor(k)}` }), String(k)),
                  h("td", { title: s.node_id }, this.names.get(s.node_id) || s.node_id),
                  h("td", {}, layers(s.start, s.end)),
                  h("td", {}, bytes(s.weight_bytes)),
                  h("td", {}, bytes(s.kv_bytes)),
                  h("td", {}, bytes(s.need_bytes)),
                  h("td", {}, bytes(s.available_bytes)),
                ),
              ),
            ),
          ),
          h("p", { class: "small" }, `KV for ${pl.sequences} × ${pl.reserve_tokens} tokens${pl.unused_nodes.length ? ` · unused: ${pl.unused_nodes.join(", ")}` : ""}`),
          p.layout ? h("p", { class: "small layout", "data-role": "layout" }, p.layout) : null,
        ),
      );
      this.previewed = JSON.stringify(q);
      this.go.disabled = false;
    } catch (err) {
      this.fail(err);
    }
  }

  async place() {
    const q = this.request();
    if (this.previewed !== JSON.stringify(q)) return this.preview();
    this.go.disabled = true;
    try {
      const inst = await call("/instances", { method: "POST", body: q });
      this.out.replaceChildren(h("p", { class: "small", role: "status" }, `placed ${inst.instance}: it appears above as it loads`));
    } catch (err) {
      this.fail(err);
    } finally {
      this.previewed = null;
    }
  }
}
