// A run page's second half: Talk (the chat pane, streamed), Ship (export buttons), the hardware readings and
// sampled completions; and the compare page's one-click `mudpuppy eval`. Uses app.js's h() and api() at call
// time; everything shown is set as text.
"use strict";
window.mpTalk = (() => {
  const {fmt} = window.mpCharts;

  // Server-sent events from a POST: fetch's body read as it arrives, one `event:` / `data:` block at a time.
  async function postStream(path, body, on) {
    const res = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
    if (!res.ok) { const d = await res.json().catch(() => ({})); throw new Error(d.error || `${res.status} ${res.statusText}`); }
    const reader = res.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, at);
        buf = buf.slice(at + 2);
        let kind = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event: ")) kind = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) on(kind, JSON.parse(data));
      }
    }
  }

  // ---------------------------------------------------------------- Talk
  function talkPane(name, held) {
    const sides = {run: [], base: []};
    const logs = {run: h("div", {class: "chat-log", id: "chat-run"}), base: h("div", {class: "chat-log", id: "chat-base"})};
    const withBase = h("input", {type: "checkbox", id: "chat-base-on"});
    const temperature = h("input", {id: "chat-temperature", value: "0", inputmode: "decimal"});
    const maxNew = h("input", {id: "chat-max-new", value: "128", inputmode: "numeric"});
    const input = h("textarea", {id: "chat-input", rows: 2, placeholder: "a message (special tokens stay text)"});
    const send = h("button", {id: "chat-send"}, "Send");
    const clear = h("button", {class: "secondary", id: "chat-clear"}, "Clear");
    const note = h("div", {class: "muted", id: "chat-note"},
      held && held.run ? `holding ${held.run} (${held.sides.join(", ")}); a message to this run frees it first` : "the model loads with the first message");
    const baseCol = h("div", {class: "hidden", id: "chat-base-col"}, h("h3", {}, "base model (adapter off)"), logs.base);
    withBase.addEventListener("change", () => baseCol.classList.toggle("hidden", !withBase.checked));
    const bubble = (side, role, text) => {
      const b = h("div", {class: `msg ${role}`}, text);
      logs[side].append(b);
      logs[side].scrollTop = logs[side].scrollHeight;
      return b;
    };
    async function answer(side) {
      const out = bubble(side, "assistant", "");
      out.dataset.pieces = "0";
      let text = "";
      await postStream("/api/chat", {run: name, side, messages: sides[side], temperature: temperature.value,
                                     max_new_tokens: maxNew.value}, (kind, data) => {
        if (kind === "text") { text += data; out.textContent = text; out.dataset.pieces = String(+out.dataset.pieces + 1); }
        else if (kind === "note") note.textContent = data;
        else if (kind === "error") { out.textContent = data; out.classList.add("bad"); throw new Error(data); }
        else if (kind === "done") {
          out.dataset.done = "1";
          note.textContent = `${side}: ${data.prompt_tokens} prompt tokens, ${data.completion_tokens} generated in ` +
            `${fmt(data.seconds)} s (${data.finish_reason})`;
        }
      });
      sides[side].push({role: "assistant", content: text});
    }
    async function go() {
      const text = input.value.trim();
      if (!text) return;
      input.value = "";
      send.disabled = true;
      const which = withBase.checked ? ["run", "base"] : ["run"];
      for (const side of which) { sides[side].push({role: "user", content: text}); bubble(side, "user", text); }
      try { for (const side of which) await answer(side); }
      catch (e) { note.textContent = e.message; for (const side of which) if (sides[side].at(-1).role === "user") sides[side].pop(); }
      send.disabled = false;
    }
    send.addEventListener("click", go);
    input.addEventListener("keydown", ev => { if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); go(); } });
    clear.addEventListener("click", () => { sides.run = []; sides.base = []; logs.run.replaceChildren(); logs.base.replaceChildren(); });
    return h("section", {id: "talk"}, h("h2", {}, "Talk"),
      h("div", {class: "inline"}, h("label", {}, withBase, " base model beside (same prompt)"),
        h("label", {}, "temperature ", temperature), h("label", {}, "max new tokens ", maxNew)),
      h("div", {class: "cols"}, h("div", {}, h("h3", {}, name), logs.run), baseCol),
      h("div", {class: "chat-input"}, input, send, clear), note);
  }

  // ---------------------------------------------------------------- Ship
  async function follow(id, box, onDone) {
    for (;;) {
      let t;
      try { t = await api(`/api/task?id=${encodeURIComponent(id)}`); } catch (e) { box.textContent = e.message; return; }
      onDone(t);
      if (t.exit_code !== null && t.exit_code !== undefined) return t;
      await new Promise(r => setTimeout(r, 500));
    }
  }

  function taskView(t) {
    const state = h("span", {class: "task-state"});
    const path = h("div", {class: "task-path"});
    const out = h("pre", {class: "task-log"});
    const box = h("div", {class: "task", "data-task": t.id}, h("code", {}, `mudpuppy ${t.args.join(" ")}`), " ", state, path, out);
    const show = t => {
      const running = t.exit_code === null || t.exit_code === undefined;
      state.replaceChildren(badge(running ? "running" : (t.exit_code === 0 ? "finished" : "failed")));
      box.dataset.exit = running ? "" : String(t.exit_code);
      out.textContent = t.log.split("\n").filter(l => l.trim()).slice(-12).join("\n");
      if (t.path) { path.textContent = `${t.path}: ${t.files.join(", ")}`; path.dataset.path = t.path; }
      else if (t.error) { path.textContent = t.error; path.className = "task-path bad"; }
    };
    show(t);
    return {box, show};
  }

  function shipPane(name, earlier, choices) {
    const format = h("select", {id: "export-format"}, ...choices.formats.map(f => h("option", {value: f}, f)));
    const quant = h("select", {id: "export-quant"});
    const evaluate = h("input", {type: "checkbox", id: "export-eval", checked: true});
    const overwrite = h("input", {type: "checkbox", id: "export-overwrite"});
    const go = h("button", {id: "export-go"}, "Export");
    const list = h("div", {id: "exports"});
    const fill = () => {
      const qs = choices.quants[format.value] || [];
      const dflt = choices.defaults[format.value];
      quant.replaceChildren(...(format.value === "mlx" ? [h("option", {value: ""}, "none")] : []),
                            ...qs.map(q => h("option", {value: q, selected: q === dflt}, q)));
      quant.disabled = !qs.length;
    };
    format.addEventListener("change", fill);
    format.value = "gguf";
    fill();
    const note = h("span", {class: "muted", id: "export-note"});
    go.addEventListener("click", async () => {
      note.textContent = "";
      try {
        const {task} = await api("/api/export", {run: name, format: format.value, quant: quant.disabled ? "" : quant.value,
                                                 evaluate: evaluate.checked, overwrite: overwrite.checked});
        const view = taskView({...task, log: ""});
        list.prepend(view.box);
        follow(task.id, view.box, view.show);
      } catch (e) { note.textContent = e.message; }
    });
    for (const t of earlier || []) { const view = taskView(t); list.append(view.box); if (t.exit_code === null) follow(t.id, view.box, view.show); }
    return h("section", {id: "ship"}, h("h2", {}, "Ship"),
      h("div", {class: "inline"}, h("label", {}, "format ", format), h("label", {}, "quant ", quant),
        h("label", {}, evaluate, " measure the GGUF's held-out perplexity"), h("label", {}, overwrite, " overwrite an earlier export"), go, note),
      list);
  }

  // ---------------------------------------------------------------- hardware and samples
  function extrasPane() {
    const hw = h("table", {id: "hardware"});
    const peaks = h("div", {class: "muted", id: "memory-peaks"});
    const samples = h("table", {id: "samples"});
    const sampleBox = h("section", {class: "hidden"}, h("h2", {}, "Sampled completions"), samples);
    const gib = n => `${(n / 2 ** 30).toFixed(2)} GiB`;
    // worded as the dashboard's hardware panel words it (monitor/dashboard.py's describe_reading)
    const reading = r => r.percent !== null ? `${r.percent.toFixed(0)}%` : (r.used !== null && r.total ? `${(r.used / 2 ** 30).toFixed(2)}/${(r.total / 2 ** 30).toFixed(2)} GiB` : (r.used !== null ? gib(r.used) : "-"));
    const update = x => {
      hw.replaceChildren(...(x.hardware.live.length ? x.hardware.live.map(r => {
        const bar = h("span", {class: "bar"}, h("i", {}));
        if (r.fraction !== null) bar.firstChild.style.width = `${Math.round(r.fraction * 100)}%`;
        return h("tr", {"data-reading": r.name}, h("td", {}, r.name, " ", h("span", {class: "muted"}, r.source)), h("td", {}, bar), h("td", {class: "num"}, reading(r)));
      }) : [h("tr", {}, h("td", {}, "no readings: nothing is training here now"))]));
      peaks.textContent = x.hardware.peaks.length ? "device memory peaks: " + x.hardware.peaks.map(p =>
        `${p.phase} ${Object.entries(p).filter(([k]) => k !== "phase").map(([k, v]) => `${k} ${gib(v)}`).join(" / ")}`).join("; ") : "";
      sampleBox.classList.toggle("hidden", !x.samples.length);
      samples.replaceChildren(h("tr", {}, ...["step", "rewards", "prompt", "completion"].map(t => h("th", {}, t))),
        ...x.samples.map(s => h("tr", {}, h("td", {class: "num"}, s.step ?? "–"),
          h("td", {}, Object.entries(s.rewards).map(([k, v]) => `${k} ${fmt(v)}`).join(", ") || "–"),
          h("td", {class: "wrap"}, s.prompt), h("td", {class: "wrap"}, s.completion))));
    };
    return {box: h("section", {id: "extras"}, h("h2", {}, "Hardware"), hw, peaks, sampleBox), update};
  }

  // ---------------------------------------------------------------- compare: one click to `mudpuppy eval`
  function evalPane(picked, choices) {
    const data = h("select", {id: "eval-data"}, ...choices.data.map(f => h("option", {value: f}, f)));
    const samples = h("input", {id: "eval-samples", placeholder: "all", inputmode: "numeric"});
    const base = h("input", {type: "checkbox", id: "eval-base"});
    const go = h("button", {id: "eval-go"}, "Run mudpuppy eval on the ticked runs");
    const note = h("span", {class: "muted", id: "eval-note"});
    const result = h("div", {id: "eval-result"});
    go.addEventListener("click", async () => {
      note.textContent = "";
      try {
        const {task} = await api("/api/eval", {runs: picked(), data: data.value, max_samples: samples.value, base: base.checked});
        const view = taskView({...task, log: ""});
        result.replaceChildren(view.box);
        const t = await follow(task.id, view.box, view.show);
        if (t && t.table) {
          const table = h("table", {id: "eval-table"}, h("tr", {}, ...t.table.header.map(c => h("th", {}, c))),
            ...t.table.rows.map(r => h("tr", {"data-row": r[0]}, h("td", {}, r[0]), ...r.slice(1).map(c => h("td", {class: "num"}, c)))));
          result.append(table, h("div", {class: "muted"}, `eval.json, eval.md and charts in ${t.table.out}`));
        }
      } catch (e) { note.textContent = e.message; }
    });
    return h("section", {id: "eval"}, h("h2", {}, "Evaluate"),
      h("div", {class: "inline"}, h("label", {}, "data file ", data), h("label", {}, "max samples ", samples),
        h("label", {}, base, " with the base model"), go, note), result);
  }

  return {talkPane, shipPane, extrasPane, evalPane};
})();
