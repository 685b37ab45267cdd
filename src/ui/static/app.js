// The page: hash routes #/ (runs), #/run/NAME (one run, live), #/new (the form), #/compare.
// Everything shown is text set with textContent: nothing from a run's files becomes markup.
"use strict";
const {drawChart, fmt, COLORS} = window.mpCharts;
const view = document.getElementById("view");
const SKIP_KEYS = new Set(["step", "epoch", "skipped", "elapsed"]);
let cleanup = [];

function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else if (k === "dataset") Object.assign(e.dataset, v);
    else if (k === "color") e.style.background = v;          // through the CSSOM: the page's CSP forbids style=""
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) if (kid !== null && kid !== undefined) e.append(kid instanceof Node ? kid : String(kid));
  return e;
}

async function api(path, body) {
  const opts = body === undefined ? {} : {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const res = await fetch(path, opts);
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(data.error || `${res.status} ${res.statusText}`);
  return data;
}

const badge = s => h("span", {class: `badge ${s}`, "data-status": s}, s);
const heldout = m => Object.entries(m || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(", ") || "–";
const runLink = name => h("a", {href: `#/run/${encodeURIComponent(name)}`}, name);

// ------------------------------------------------------------------ runs list
async function showRuns() {
  const table = h("table", {id: "runs-table"});
  view.replaceChildren(h("h1", {}, "Runs"), table);
  const draw = async () => {
    let data;
    try { data = await api("/api/runs"); } catch (e) { table.replaceChildren(h("tr", {}, h("td", {}, e.message))); return; }
    document.getElementById("root").textContent = data.root;
    const head = h("tr", {}, ...["run", "status", "method", "model", "adapter", "backend / device", "steps",
                                 "final loss", "held-out"].map(t => h("th", {}, t)));
    const rows = data.runs.map(r => h("tr", {"data-run": r.name},
      h("td", {}, runLink(r.name)), h("td", {}, badge(r.status)), h("td", {}, r.method || "–"),
      h("td", {}, r.model || "–"), h("td", {}, r.adapter || "–"),
      h("td", {}, [r.backend, r.device].filter(Boolean).join(" / ") || "–"),
      h("td", {class: "num"}, r.steps === null ? "–" : (r.max_steps ? `${r.steps} / ${r.max_steps}` : r.steps)),
      h("td", {class: "num"}, fmt(r.final_loss)), h("td", {}, heldout(r.heldout))));
    table.replaceChildren(head, ...(rows.length ? rows : [h("tr", {}, h("td", {colspan: 9}, "No runs in this folder yet: start one from New run."))]));
  };
  await draw();
  const timer = setInterval(draw, 2000);
  cleanup.push(() => clearInterval(timer));
}

// ------------------------------------------------------------------ one run, live
function metricSeries(rows) {
  const series = {};
  for (const r of rows) for (const [k, v] of Object.entries(r)) {
    if (SKIP_KEYS.has(k) || typeof v !== "number" || typeof r.step !== "number") continue;
    (series[k] = series[k] || []).push([r.step, v]);
  }
  return series;
}

async function showRun(name) {
  const data = await api(`/api/run?name=${encodeURIComponent(name)}`);
  const status = h("span", {id: "run-status"});
  const stop = h("button", {id: "stop", on: {click: () => act("stop")}}, "Stop (Ctrl-C)");
  const resume = h("button", {id: "resume", class: "secondary", on: {click: () => act("resume")}}, "Resume");
  const note = h("span", {id: "action-note", class: "muted"});
  const summary = h("div", {class: "muted", id: "run-summary"});
  const charts = h("div", {class: "charts", id: "charts"});
  const config = h("pre", {id: "config", dataset: data.config ? {read: "1"} : {}}, data.config || "–");
  const log = h("pre", {id: "log"}, data.log || "(no log: the page keeps the log of runs it started)");
  const extras = window.mpTalk.extrasPane();
  const shipping = h("div", {id: "finished-panes"});
  view.replaceChildren(h("h1", {}, name, " ", status), summary, h("div", {class: "actions"}, stop, resume, note),
                       charts, extras.box, shipping, h("div", {class: "cols"}, h("div", {}, h("h2", {}, "Log"), log),
                       h("div", {}, h("h2", {}, "config.yaml"), config)));
  extras.update({hardware: data.hardware, samples: data.samples});
  const finishedPanes = async () => {          // a finished run can be talked to and shipped
    if (shipping.dataset.shown) return;
    shipping.dataset.shown = "1";
    const choices = await api("/api/choices");
    shipping.replaceChildren(window.mpTalk.talkPane(name, data.talk), window.mpTalk.shipPane(name, data.exports, choices));
  };
  let rows = [];
  const boxes = {};
  const redraw = () => {
    for (const [key, pts] of Object.entries(metricSeries(rows))) {
      if (!boxes[key]) {
        const last = h("span", {class: "last"});
        const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
        svg.id = `chart-${key}`;
        const box = h("div", {class: "chart", "data-metric": key}, h("h3", {}, key, last), svg);
        charts.append(box);
        boxes[key] = {svg, last};
      }
      drawChart(boxes[key].svg, [{label: name, points: pts}]);
      boxes[key].last.textContent = `step ${pts[pts.length - 1][0]}: ${fmt(pts[pts.length - 1][1])}`;
    }
  };
  const setStatus = r => {
    status.replaceChildren(badge(r.status));
    if (r.status === "finished") finishedPanes();
    if (!config.dataset.read && !config.dataset.asking && r.status !== "starting") {
      config.dataset.asking = "1";                        // a run writes config.yaml once its model has loaded
      api(`/api/run?name=${encodeURIComponent(name)}`).then(d => {
        if (d.config) { config.textContent = d.config; config.dataset.read = "1"; }
      }, () => {}).finally(() => { delete config.dataset.asking; });
    }
    stop.disabled = r.status !== "running";
    resume.disabled = r.status === "running" || !r.resumable;
    summary.textContent = [r.method, r.model, r.adapter, [r.backend, r.device].filter(Boolean).join(" on "),
      r.steps !== null ? `step ${r.steps}${r.max_steps ? " of " + r.max_steps : ""}` : null,
      `held-out: ${heldout(r.heldout)}`].filter(Boolean).join(" · ");
  };
  async function act(what) {
    note.textContent = "";
    try {
      await api(`/api/${what}`, {run: name});
      note.textContent = what === "stop" ? "SIGINT sent: the step in progress ends and its checkpoint is written"
                                         : "resuming from the newest checkpoint";
      if (what === "resume") { stop.disabled = false; resume.disabled = true; }
      else stop.disabled = true;
    } catch (e) { note.textContent = e.message; }
  }
  setStatus(data.run);
  const source = new EventSource(`/api/events?name=${encodeURIComponent(name)}&from=0&log_from=${data.log_size}`);
  source.addEventListener("metrics", e => { rows = rows.concat(JSON.parse(e.data)); redraw(); });
  source.addEventListener("reset", () => { rows = []; redraw(); });
  source.addEventListener("status", e => setStatus(JSON.parse(e.data)));
  source.addEventListener("extras", e => extras.update(JSON.parse(e.data)));
  source.addEventListener("log", e => {
    if (log.textContent.startsWith("(no log")) log.textContent = "";
    log.textContent += JSON.parse(e.data);
    log.scrollTop = log.scrollHeight;
  });
  cleanup.push(() => source.close());
}

// ------------------------------------------------------------------ new run
const METHODS = ["lora", "dora", "qlora", "full", "dpo", "ipo", "simpo", "orpo", "kto", "grpo", "rm", "prm", "gptq", "qat"];
const NUMBERS = [["max_steps", "max steps"], ["learning_rate", "learning rate"], ["batch_size", "micro batch size"],
                 ["sequence_len", "sequence length"], ["save_steps", "save every N steps"], ["eval_steps", "evaluate every N steps"], ["seed", "seed"]];

async function showNew() {
  const {configs} = await api("/api/configs");
  const field = (label, input) => [h("label", {for: input.id}, label), input];
  const select = (id, options, value) => h("select", {id, name: id}, ...options.map(o => h("option", {value: o, selected: o === value}, o)));
  const source = select("source", ["new", "config"], "new");
  const check = h("div", {class: "check", id: "validation"}, "fill in the form");
  const start = h("button", {id: "start", type: "submit", disabled: true}, "Start run");
  const form = h("form", {class: "run-form", id: "run-form"},
    field("start from", source),
    h("div", {class: "fieldset-config hidden", id: "from-config"},
      field("config file", select("config", configs, configs[0]))),
    h("div", {class: "fieldset-new", id: "from-new"},
      field("base model", h("input", {id: "model", name: "model", placeholder: "smollm2-135m-instruct, owner/name or a folder"})),
      field("method / adapter", select("method", METHODS, "lora")),
      field("training data", h("input", {id: "data", name: "data", placeholder: "a .jsonl file (path as in a terminal here)"})),
      field("held-out data", h("input", {id: "val_data", name: "val_data", placeholder: "optional"}))),
    field("backend", select("backend", ["auto", "cpu", "cuda", "rocm", "mlx"], "auto")),
    ...NUMBERS.flatMap(([id, label]) => field(label, h("input", {id, name: id, inputmode: "decimal", placeholder: "the config's"}))),
    field("run folder", h("input", {id: "output", name: "output", placeholder: "a name inside the runs folder"})),
    check, h("div", {}, start));
  view.replaceChildren(h("h1", {}, "New run"), h("p", {class: "muted"},
    "Checked as you type by what `mudpuppy validate` and `mudpuppy train` run; Start runs the same command in the background."), form);
  const values = () => {
    const out = {};
    for (const e of form.querySelectorAll("input, select")) if (e.value !== "") out[e.name] = e.value;
    return out;
  };
  let pending = 0;
  const validate = async () => {
    const mine = ++pending;
    document.getElementById("from-config").classList.toggle("hidden", source.value !== "config");
    document.getElementById("from-new").classList.toggle("hidden", source.value !== "new");
    let res;
    try { res = await api("/api/validate", values()); } catch (e) { res = {ok: false, message: e.message}; }
    if (mine !== pending) return;
    check.textContent = res.message;
    check.className = `check ${res.ok ? "ok" : "bad"}`;
    check.dataset.ok = res.ok ? "1" : "0";
    start.disabled = !res.ok;
  };
  let timer;
  form.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(validate, 250); });
  form.addEventListener("change", () => { clearTimeout(timer); timer = setTimeout(validate, 50); });
  form.addEventListener("submit", async ev => {
    ev.preventDefault();
    start.disabled = true;
    try {
      const {job} = await api("/api/start", values());
      location.hash = `#/run/${encodeURIComponent(job.run)}`;
    } catch (e) { check.textContent = e.message; check.className = "check bad"; start.disabled = false; }
  });
  validate();
}

// ------------------------------------------------------------------ compare
async function showCompare() {
  const {runs} = await api("/api/runs");
  const picks = h("div", {id: "compare-picks"}, ...runs.map(r => h("label", {class: "pick"},
    h("input", {type: "checkbox", value: r.name, on: {change: draw}}), r.name, " ", badge(r.status))));
  const table = h("table", {id: "compare-table"});
  const charts = h("div", {class: "charts", id: "compare-charts"});
  const choices = await api("/api/choices");
  const picked = () => [...picks.querySelectorAll("input:checked")].map(e => e.value);
  view.replaceChildren(h("h1", {}, "Compare"), picks, h("h2", {}, "Held-out results"), table,
                       window.mpTalk.evalPane(picked, choices), h("h2", {}, "Curves"), charts);
  async function draw() {
    const names = picked();
    const loaded = await Promise.all(names.map(n => api(`/api/run?name=${encodeURIComponent(n)}`)));
    const keys = [...new Set(loaded.flatMap(d => Object.keys(d.run.heldout || {})))];
    table.replaceChildren(h("tr", {}, h("th", {}, "run"), h("th", {}, "steps"), h("th", {}, "final loss"), ...keys.map(k => h("th", {}, k))),
      ...loaded.map(d => h("tr", {"data-run": d.run.name}, h("td", {}, runLink(d.run.name)), h("td", {class: "num"}, d.run.steps ?? "–"),
        h("td", {class: "num"}, fmt(d.run.final_loss)), ...keys.map(k => h("td", {class: "num"}, fmt((d.run.heldout || {})[k]))))));
    const per = loaded.map(d => metricSeries(d.metrics));
    const metrics = [...new Set(per.flatMap(s => Object.keys(s)))];
    charts.replaceChildren(...metrics.map(key => {
      const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
      svg.id = `compare-${key}`;
      const series = per.map((s, i) => ({label: names[i], points: s[key] || []}));
      drawChart(svg, series);
      const legend = h("div", {class: "legend"}, ...names.map((n, i) => h("span", {}, h("i", {color: COLORS[i % COLORS.length]}), n)));
      return h("div", {class: "chart", "data-metric": key}, h("h3", {}, key), svg, legend);
    }));
  }
}

// ------------------------------------------------------------------ routing
async function route() {
  cleanup.forEach(fn => fn());
  cleanup = [];
  const hash = location.hash || "#/";
  try {
    if (hash.startsWith("#/run/")) await showRun(decodeURIComponent(hash.slice(6)));
    else if (hash === "#/new") await showNew();
    else if (hash === "#/compare") await showCompare();
    else await showRuns();
  } catch (e) {
    view.replaceChildren(h("h1", {}, "Error"), h("pre", {id: "error"}, e.message));
  }
}
window.addEventListener("hashchange", route);
route();
