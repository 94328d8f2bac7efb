// A small time-series chart on a canvas: lines (or stacked areas) over the last `window`
// seconds, a y axis from 0 with round ticks, a legend with the latest values. No library.

const PAD = { left: 44, right: 8, top: 8, bottom: 20 };
const GAP_S = 5; // samples further apart than this are not joined

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmt(v, digits = 3) {
  if (v == null || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en");
  return Number(v.toPrecision(digits)).toString();
}

export class TimeChart {
  // series: [{key, label, color}]; options: {title, unit, stacked, max}
  constructor(parent, series, options) {
    this.series = series;
    this.opt = options;
    this.points = [];
    this.box = document.createElement("figure");
    this.box.className = "chart";
    const cap = document.createElement("figcaption");
    cap.textContent = options.title + (options.unit ? ` (${options.unit})` : "");
    this.canvas = document.createElement("canvas");
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", options.title);
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    this.box.append(cap, this.canvas, this.legend);
    parent.append(this.box);
    new ResizeObserver(() => this.draw()).observe(this.canvas);
  }

  // points: [{t, v: {key: number | null}}] in time order; tEnd: the right edge (server time)
  update(points, tEnd, windowS) {
    this.points = points;
    this.tEnd = tEnd;
    this.windowS = windowS;
    this.draw();
  }

  latest() {
    const last = this.points[this.points.length - 1];
    return last ? last.v : {};
  }

  draw() {
    const c = this.canvas;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (!w || !h || this.tEnd === undefined) return;
    const dpr = window.devicePixelRatio || 1;
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const t0 = this.tEnd - this.windowS;
    const pts = this.points.filter((p) => p.t >= t0 - GAP_S);
    const stacks = pts.map((p) => this.stack(p.v));
    const top = Math.max(0, ...stacks.flatMap((s) => s.filter((v) => v != null)));
    const yMax = this.opt.max ?? niceMax(top * 1.1);
    const x = (t) => PAD.left + ((t - t0) / this.windowS) * (w - PAD.left - PAD.right);
    const y = (v) => h - PAD.bottom - (v / yMax) * (h - PAD.top - PAD.bottom);
    this.axes(g, w, h, yMax, y);
    this.series.forEach((s, i) => this.line(g, pts, stacks, i, s, x, y));
    if (!pts.length) {
      g.fillStyle = "#8b949e";
      g.font = "12px system-ui, sans-serif";
      g.fillText("no samples yet", PAD.left + 8, PAD.top + 16);
    }
    this.renderLegend();
    c.dataset.points = String(pts.length);
    c.dataset.latest = JSON.stringify(this.latest());
  }

  // cumulative values when stacked (series order, bottom first)
  stack(v) {
    let acc = 0;
    return this.series.map((s) => {
      const val = v[s.key];
      if (!this.opt.stacked) return val ?? null;
      acc += val ?? 0;
      return acc;
    });
  }

  axes(g, w, h, yMax, y) {
    g.strokeStyle = "#d0d7de";
    g.fillStyle = "#57606a";
    g.font = "11px system-ui, sans-serif";
    g.lineWidth = 1;
    g.textAlign = "right";
    for (let i = 0; i <= 4; i++) {
      const v = (yMax * i) / 4;
      const yy = Math.round(y(v)) + 0.5;
      g.beginPath();
      g.moveTo(PAD.left, yy);
      g.lineTo(w - PAD.right, yy);
      g.stroke();
      g.fillText(fmt(v), PAD.left - 4, yy + 4);
    }
    g.textAlign = "center";
    const ticks = [this.windowS, this.windowS / 2, 0];
    for (const s of ticks) {
      const xx = PAD.left + ((this.windowS - s) / this.windowS) * (w - PAD.left - PAD.right);
      g.fillText(s === 0 ? "now" : `-${s}s`, Math.min(Math.max(xx, PAD.left + 12), w - 16), h - 5);
    }
  }

  line(g, pts, stacks, i, s, x, y) {
    g.strokeStyle = s.color;
    g.fillStyle = s.color;
    g.lineWidth = 1.6;
    if (this.opt.stacked && pts.length > 1) this.area(g, pts, stacks, i, x, y);
    g.beginPath();
    let prevT = null;
    pts.forEach((p, j) => {
      const v = stacks[j][i];
      if (v == null) { prevT = null; return; }
      if (prevT === null || p.t - prevT > GAP_S) g.moveTo(x(p.t), y(v));
      else g.lineTo(x(p.t), y(v));
      prevT = p.t;
    });
    g.stroke();
    if (pts.length === 1 && stacks[0][i] != null) g.fillRect(x(pts[0].t) - 2, y(stacks[0][i]) - 2, 4, 4);
  }

  // the band between this series' cumulative values and the one below
  area(g, pts, stacks, i, x, y) {
    g.beginPath();
    pts.forEach((p, j) => (j ? g.lineTo(x(p.t), y(stacks[j][i])) : g.moveTo(x(p.t), y(stacks[j][i]))));
    for (let j = pts.length - 1; j >= 0; j--) g.lineTo(x(pts[j].t), y(i ? stacks[j][i - 1] : 0));
    g.closePath();
    g.globalAlpha = 0.35;
    g.fill();
    g.globalAlpha = 1;
  }

  renderLegend() {
    const v = this.latest();
    this.legend.replaceChildren(...this.series.map((s) => {
      const item = document.createElement("span");
      const dot = document.createElement("i");
      dot.style.background = s.color;
      item.append(dot, `${s.label} ${fmt(v[s.key])}`);
      return item;
    }));
  }
}
