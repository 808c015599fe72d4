// A few lines of DOM building and formatting shared by the views.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") el.style.cssText = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  for (const c of children) el.append(c);
  return el;
}

const UNITS = ["B", "KB", "MB", "GB", "TB"];

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  let i = 0;
  while (Math.abs(n) >= 1024 && i < UNITS.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${UNITS[i]}`;
}

export function clock(wall) {
  return new Date(wall * 1000).toLocaleTimeString([], { hour12: false });
}

export function seconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

// A share in [0, 1] as a percentage; "–" when there is none yet (e.g. no prompt looked up).
export function percent(x) {
  if (x === null || x === undefined) return "–";
  return `${(x * 100).toFixed(1)}%`;
}

// Half-open [start, end) as people count layers: "layers 0–14".
export function layers(start, end) {
  return end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`;
}

// Replace a container's children only when what they show changed: keeps focus and scroll still.
export function swap(container, key, build) {
  if (container.dataset.key === key) return;
  container.dataset.key = key;
  container.replaceChildren(...[build()].flat());
}

// A select's options, replaced only when the list changed; the chosen one stays chosen while it is listed.
export function setOptions(select, values) {
  const have = [...select.options].map((o) => o.value);
  if (JSON.stringify(have) === JSON.stringify(values)) return;
  const chosen = select.value;
  select.replaceChildren(...values.map((v) => h("option", { value: v }, v)));
  if (values.includes(chosen)) select.value = chosen;
}
