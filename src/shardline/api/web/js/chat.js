// The chat panel: streams an answer from the chosen model; Stop closes the stream, which cancels the request.
import { h, seconds, setOptions } from "./dom.js";
import { NeedsKey, streamEvents } from "./net.js";

export class Chat {
  constructor({ onNeedsKey }) {
    this.onNeedsKey = onNeedsKey;
    this.history = [];
    this.abort = null;
    this.model = document.getElementById("chat-model");
    this.log = document.getElementById("chat-log");
    this.input = document.getElementById("chat-input");
    this.send = document.getElementById("chat-send");
    this.stopButton = document.getElementById("chat-stop");
    this.maxTokens = document.getElementById("chat-max");
    this.temperature = document.getElementById("chat-temp");
    this.extra = document.getElementById("chat-extra");
    document.getElementById("chat-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.ask();
    });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.ask();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
    document.getElementById("chat-new").addEventListener("click", () => {
      this.stop();
      this.history = [];
      this.log.replaceChildren();
      this.input.focus();
    });
    document.addEventListener("keydown", (e) => e.key === "Escape" && this.abort && this.stop());
  }

  setModels(models) {
    setOptions(this.model, models);
    this.send.disabled = !models.length || this.abort !== null;
  }

  stop() {
    if (this.abort) this.abort.abort();
  }

  busy(on) {
    this.send.disabled = on;
    this.stopButton.disabled = !on;
  }

  message(role, text) {
    const body = h("div", { class: "text" }, text);
    const el = h("div", { class: `msg ${role}`, "data-role": role }, h("span", { class: "who" }, role === "user" ? "you" : this.model.value), body);
    this.log.append(el);
    this.log.scrollTop = this.log.scrollHeight;
    return el;
  }

  // The request options box: a JSON object added to the request (tools, tool_choice...); throws if it is not.
  extraOf() {
    const raw = this.extra.value.trim();
    if (!raw) return {};
    const extra = JSON.parse(raw);
    if (typeof extra !== "object" || extra === null || Array.isArray(extra)) throw new Error("not a JSON object");
    return extra;
  }

  async ask() {
    const question = this.input.value.trim();
    if (!question || this.abort || !this.model.value) return;
    let extra;
    try {
      extra = this.extraOf();
      this.extra.removeAttribute("aria-invalid");
    } catch (err) {
      this.extra.setAttribute("aria-invalid", "true");
      this.extra.closest("details").open = true;
      this.extra.title = `request options not sent: ${err.message}`;
      return;
    }
    this.input.value = "";
    this.message("user", question);
    this.history.push({ role: "user", content: question });
    const answer = this.message("assistant", "");
    answer.dataset.state = "streaming";
    const text = answer.querySelector(".text");
    const meta = h("p", { class: "meta" });
    answer.append(meta);
    const body = {
      ...extra,
      model: this.model.value,
      messages: this.history,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: Math.max(1, Number(this.maxTokens.value) || 256),
      temperature: Math.max(0, Number(this.temperature.value) || 0),
    };
    this.abort = new AbortController();
    this.busy(true);
    let content = "";
    const calls = []; // tool calls as they stream: {id, type, function: {name, arguments}} by index
    let end = "done";
    try {
      await streamEvents("/v1/chat/completions", {
        method: "POST",
        body,
        signal: this.abort.signal,
        onEvent: (_name, data) => {
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
          const delta = chunk.choices?.[0]?.delta?.content;
          if (delta) {
            content += delta;
            text.textContent = content;
            this.log.scrollTop = this.log.scrollHeight;
          }
          for (const part of chunk.choices?.[0]?.delta?.tool_calls || []) {
            if (!calls[part.index]) {
              calls[part.index] = { id: part.id, type: "function", function: { name: part.function.name, arguments: "" } };
              calls[part.index].el = h("pre", { class: "call" });
              meta.before(calls[part.index].el);
            }
            const call = calls[part.index];
            call.function.arguments += part.function?.arguments || "";
            call.el.textContent = `${call.function.name}(${call.function.arguments})`;
            this.log.scrollTop = this.log.scrollHeight;
          }
          if (chunk.usage) {
            const t = chunk.timings || {};
            meta.textContent = [
              `${chunk.usage.completion_tokens} tokens`,
              t.decode_tokens_per_s ? `${t.decode_tokens_per_s.toFixed(1)} tokens/s` : null,
              t.ttft_s !== undefined && t.ttft_s !== null ? `first token ${seconds(t.ttft_s)}` : null,
            ].filter(Boolean).join(" · ");
          }
        },
      });
    } catch (err) {
      if (err.name === "AbortError") {
        end = "stopped";
        meta.textContent = "stopped";
      } else {
        end = "error";
        meta.textContent = err.message;
        if (err instanceof NeedsKey) this.onNeedsKey();
      }
    } finally {
      answer.dataset.state = end;
      this.abort = null;
      this.busy(false);
      const made = calls.filter(Boolean).map(({ el, ...call }) => call);
      this.history.push(made.length ? { role: "assistant", content, tool_calls: made } : { role: "assistant", content });
      if (end === "error" && !content) this.history.splice(-2, 2);
    }
  }
}
