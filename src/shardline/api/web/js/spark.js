// A sparkline: the last minutes of one figure as a small line, with its range in the tooltip.
import { svg } from "./dom.js";

export function sparkline(values, { width = 120, height = 28, label = "" } = {}) {
  const nums = values.map((v) => (v === null || v === undefined ? null : Number(v)));
  const known = nums.filter((v) => v !== null);
  const max = Math.max(1e-9, ...known);
  const step = nums.length > 1 ? width / (nums.length - 1) : width;
  let d = "";
  let pen = false;
  nums.forEach((v, i) => {
    if (v === null) {
      pen = false;
      return;
    }
    const x = (i * step).toFixed(1);
    const y = (height - 2 - (v / max) * (height - 4)).toFixed(1);
    d += `${pen ? "L" : "M"}${x} ${y}`;
    pen = true;
  });
  const title = svg("title");
  title.textContent = known.length
    ? `${label}: last ${nums.length} samples, min ${Math.min(...known)}, max ${Math.max(...known)}`
    : `${label}: no samples yet`;
  return svg(
    "svg",
    { class: "spark", viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", height, role: "img", "aria-label": title.textContent },
    title,
    svg("path", { d: d || `M0 ${height - 2}L${width} ${height - 2}`, class: d ? "line" : "line none" }),
  );
}
