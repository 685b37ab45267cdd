// Line charts drawn as SVG by hand: one metric, one or several series (the compare page overlays runs).
(function () {
"use strict";
const COLORS = ["#4fb3a9", "#e0a84f", "#8fa8ff", "#e06c6c", "#b48ee0", "#7cc27c", "#d4d46a", "#6ad4d4"];
const SVGNS = "http://www.w3.org/2000/svg";

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return (+v.toPrecision(4)).toString();
}

// An axis label that differs from its neighbours a `span` apart: 0.00495 rather than 0.005 twice; on a span
// too narrow for four digits, the lowest value in full and the others as what they add to it (+2.2e-8).
function fmtAxis(v, base, span) {
  if (!isFinite(v) || !(span > 0) || v === 0) return fmt(v);
  const digits = Math.ceil(Math.log10(Math.abs(v) / span)) + 2;
  if (digits <= 4) return fmt(v);
  if (digits <= 6) return (+v.toPrecision(digits)).toString();
  return v === base ? (+v.toPrecision(6)).toString() : `+${(v - base).toExponential(1)}`;
}

// series: [{label, points: [[x, y], ...]}]; returns the <svg> element.
function drawChart(svg, series) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 400, H = 170, L = 62, R = 8, T = 8, B = 20;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const all = series.flatMap(s => s.points).filter(p => isFinite(p[1]));
  svg.dataset.points = String(series.reduce((n, s) => n + s.points.length, 0));
  if (!all.length) return svg;
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.05 || 1; y1 += Math.abs(y1) * 0.05 || 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const el = (name, attrs, text) => {
    const e = document.createElementNS(SVGNS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e);
    return e;
  };
  el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"});
  el("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"});
  for (const y of [y0, (y0 + y1) / 2, y1]) el("text", {x: L - 4, y: sy(y) + 3, "text-anchor": "end"}, fmtAxis(y, y0, y1 - y0));
  el("text", {x: L, y: H - 5}, fmt(x0));
  el("text", {x: W - R, y: H - 5, "text-anchor": "end"}, fmt(x1));
  series.forEach((s, i) => {
    const pts = s.points.filter(p => isFinite(p[1]));
    const color = COLORS[i % COLORS.length];
    if (pts.length === 1) el("circle", {cx: sx(pts[0][0]), cy: sy(pts[0][1]), r: 2.5, fill: color});
    else el("polyline", {points: pts.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "), stroke: color});
  });
  return svg;
}

window.mpCharts = {drawChart, fmt, COLORS};
})();
