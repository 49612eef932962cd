// The dashboard of phalanx server: four pages (jobs, a job, jobs compared, the fleet) drawn from
// /api/v1/dashboard/* and kept up to date by one WebSocket per page (/api/v1/dashboard/live), which sends the
// page's data again whenever it changes (the comparison polls). The token stays in this tab (sessionStorage)
// and goes with every request.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
const main = $("#main");
const STATES = ["PENDING", "ADMITTED", "RUNNING", "PREEMPTED", "SUCCEEDED", "FAILED", "CANCELLED"];
const GOODPUT = {
  productive: "#2b8a3e", lost: "#c92a2a", checkpoint: "#4c6ef5", data: "#15aabf",
  detection: "#e67700", recovery: "#f08c00", idle: "#adb5bd",
};
let token = sessionStorage.getItem("phalanx-token");
let unit = "GPUs"; // what the cluster counts: GPUs, or CPU slots ("slots") on a machine without GPUs
let channel = null; // the live channel of the page shown
let follow = null; // the log poller of the job page

const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const pct = (v) => (v == null ? "" : `${(100 * v).toFixed(1)}%`);
const num = (v, digits = 0) => (v == null ? "" : Number(v).toLocaleString(undefined, { maximumFractionDigits: digits }));
const when = (ts) => new Date(ts * 1000).toLocaleString();
function duration(s) {
  if (s == null) return "";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}

async function api(path, options = {}) {
  const response = await fetch("/api/v1" + path, {
    ...options,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
  });
  if (response.status === 401) {
    logout();
    throw new Error("logged out");
  }
  const body = await response.json();
  if (!response.ok) {
    const detail = body.detail;
    throw new Error(typeof detail === "string" ? detail : detail.map((d) => `${d.loc.join(".")}: ${d.msg}`).join("; "));
  }
  return body;
}

function live(view, id, render) {
  if (channel) channel.close();
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/api/v1/dashboard/live`);
  ws.onopen = () => ws.send(JSON.stringify({ token, view, id }));
  ws.onmessage = (message) => render(JSON.parse(message.data));
  ws.onclose = (event) => {
    if (channel !== ws) return; // replaced by another page's
    if (event.code === 4401) logout();
    else if (event.code === 4404) main.innerHTML = `<p class="error">${esc(event.reason)}</p>`;
    else setTimeout(() => channel === ws && live(view, id, render), 2000); // the server restarted: again
  };
  channel = ws;
}

function stopPage() {
  if (channel) channel.close();
  channel = null;
  if (follow) clearInterval(follow);
  follow = null;
}

// --- logging in
function loginPage() {
  stopPage();
  main.replaceChildren($("#login-page").content.cloneNode(true));
  const submit = async () => {
    token = $("#token").value.trim();
    try {
      await whoami();
      sessionStorage.setItem("phalanx-token", token);
      if (location.hash === "#/jobs") route();
      else location.hash = "#/jobs"; // routed by its hashchange
    } catch (e) {
      $("#login-error").textContent = e.message;
    }
  };
  $("#login").onclick = submit;
  $("#token").onkeydown = (e) => e.key === "Enter" && submit();
}

async function whoami() {
  const response = await fetch("/api/v1/whoami", { headers: { Authorization: `Bearer ${token}` } });
  if (!response.ok) throw new Error("that token is not valid (missing, expired or revoked)");
  const who = await response.json();
  unit = (await api("/cluster")).unit;
  $("#who").textContent = `${who.user} (${who.role}${who.tenant ? `, ${who.tenant}` : ""})`;
  $("#logout").hidden = false;
  return who;
}

function logout() {
  sessionStorage.removeItem("phalanx-token");
  token = null;
  $("#who").textContent = "";
  $("#logout").hidden = true;
  loginPage();
}

// --- the jobs table
const COLUMNS = [
  ["id", "job"], ["tenant", "tenant"], ["state", "state"], ["gpus", null], ["progress", "progress"],
  ["eta_s", "ETA"], ["tokens_per_s", "tokens/s"], ["mfu", "MFU"], ["goodput", "goodput"], ["restarts", "restarts"],
  ["submitted_at", "submitted"],
];
const table = { sort: "submitted_at", descending: true, filter: "", state: "" };

function jobsPage() {
  main.innerHTML = `
    <h1>Jobs</h1>
    <div class="toolbar">
      <input id="filter" placeholder="filter: id, name, tenant, owner" size="40" value="${esc(table.filter)}">
      <select id="state-filter"><option value="">any state</option>
        ${STATES.map((s) => `<option ${s === table.state ? "selected" : ""}>${s}</option>`).join("")}</select>
      <span id="count"></span><button id="compare">Compare the loss of the jobs picked</button>
    </div>
    <table id="jobs-table"><thead><tr><th></th>${COLUMNS.map(([k, label]) => `<th data-sort="${k}">${label ?? unit}</th>`).join("")}</tr></thead>
      <tbody></tbody></table>
    <h2>Submit a job</h2>
    <textarea id="submit-spec" rows="8" placeholder="name: my-job&#10;resources: {procs_per_node: 2, device: cpu}&#10;train: {model: {preset: llama-tiny}, steps: 100}"></textarea>
    <div class="toolbar"><label>priority <input id="submit-priority" type="number" value="0" style="width:5em"></label>
      <button id="submit">Submit</button><span id="submit-result"></span></div>`;
  let rows = [];
  const draw = () => {
    const text = table.filter.toLowerCase();
    const shown = rows
      .filter((j) => (!table.state || j.state === table.state) &&
        (!text || [j.id, j.name, j.tenant, j.owner].some((v) => v.toLowerCase().includes(text))))
      .sort((a, b) => {
        const [x, y] = [a[table.sort], b[table.sort]];
        const order = x == null ? 1 : y == null ? -1 : x < y ? -1 : x > y ? 1 : 0;
        return table.descending ? -order : order;
      });
    $("#count").textContent = `${shown.length} of ${rows.length}`;
    $("#jobs-table tbody").innerHTML = shown.map((j) => `
      <tr data-job="${esc(j.id)}">
        <td data-label="pick"><input type="checkbox" class="pick" value="${esc(j.id)}" ${picked.has(j.id) ? "checked" : ""}></td>
        <td data-label="job"><a href="#/jobs/${esc(j.id)}">${esc(j.id)}</a></td><td data-label="tenant">${esc(j.tenant)}</td>
        <td data-label="state" class="state state-${esc(j.state)}" title="${esc(j.reason)}">${esc(j.state)}</td>
        <td data-label="${unit}">${j.gpus}</td>
        <td data-label="progress" class="progress"><div class="bar"><span style="width:${100 * (j.progress || 0)}%"></span></div>
          ${j.steps_done == null ? "" : `${j.steps_done}${j.total_steps ? ` / ${j.total_steps}` : ""}`}</td>
        <td data-label="ETA">${duration(j.eta_s)}</td><td data-label="tokens/s">${num(j.tokens_per_s)}</td>
        <td data-label="MFU">${pct(j.mfu)}</td><td data-label="goodput">${pct(j.goodput)}</td>
        <td data-label="restarts" class="restarts">${j.restarts}</td><td data-label="submitted">${when(j.submitted_at)}</td>
      </tr>`).join("");
  };
  const picked = new Set();
  $("#jobs-table").addEventListener("change", (e) => {
    if (e.target.classList.contains("pick")) e.target.checked ? picked.add(e.target.value) : picked.delete(e.target.value);
  });
  $("#compare").onclick = () => { if (picked.size) location.hash = `#/compare/${[...picked].map(encodeURIComponent).join(",")}`; };
  $("#filter").oninput = (e) => { table.filter = e.target.value; draw(); };
  $("#state-filter").onchange = (e) => { table.state = e.target.value; draw(); };
  for (const th of main.querySelectorAll("th[data-sort]")) {
    th.onclick = () => {
      table.descending = table.sort === th.dataset.sort ? !table.descending : false;
      table.sort = th.dataset.sort;
      draw();
    };
  }
  $("#submit").onclick = async () => {
    try {
      const spec = $("#submit-spec").value;
      const made = await api("/jobs", { method: "POST", body: JSON.stringify({ spec, priority: Number($("#submit-priority").value) }) });
      $("#submit-result").innerHTML = `submitted <a href="#/jobs/${esc(made.id)}">${esc(made.id)}</a>`;
    } catch (e) {
      $("#submit-result").innerHTML = `<span class="error">${esc(e.message)}</span>`;
    }
  };
  live("jobs", null, (data) => { rows = data.jobs; draw(); });
}

// --- one job
const MARKS = [ // what a vertical line on a job's charts means, and how it is drawn
  ["failure", "a failure was detected", "#c92a2a", []],
  ["restart", "an attempt began (a restart from a checkpoint)", "#e67700", []],
  ["recovery", "a recovery in process (a warm spare)", "#7048e8", []],
  ["bad", "a bad step (NaN, spike)", "#862e9c", [4, 4]],
];

// A chart that follows its box's width, says why when it has nothing to draw, and draws MARKS at marks[kind]
// (x values). ``steps``: its x axis is the step (else the time).
function chart(element, title, label, format = (v) => v, empty = `no ${label} reported yet`, steps = true) {
  const marks = Object.fromEntries(MARKS.map(([kind]) => [kind, []]));
  element.classList.add("chart");
  element.dataset.empty = `${title}: ${empty}`;
  element.replaceChildren();
  const x = steps ? { label: "step", value: (u, v) => (v == null ? "" : `step ${Math.round(v)}`) } : {};
  const plot = new uPlot({
    title, width: element.clientWidth || 380, height: 220,
    scales: { x: { time: !steps } },
    series: [x, { label, stroke: "#4c6ef5", width: 1.5, value: (u, v) => (v == null ? "" : format(v)) }],
    axes: [steps ? { label: "step", values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? num(t) : "")) } : {},
      { values: (u, ticks) => ticks.map(format), size: 80 }],
    hooks: { draw: [(u) => {
      const { ctx, bbox } = u;
      ctx.save();
      for (const [kind, , color, dash] of MARKS) {
        ctx.strokeStyle = color; ctx.setLineDash(dash); ctx.lineWidth = 1.5;
        for (const at of marks[kind]) {
          const px = u.valToPos(at, "x", true);
          if (px < bbox.left || px > bbox.left + bbox.width) continue;
          ctx.beginPath(); ctx.moveTo(px, bbox.top); ctx.lineTo(px, bbox.top + bbox.height); ctx.stroke();
        }
      }
      ctx.restore();
    }] },
  }, [[], []], element);
  element.plot = plot;
  if (!element.observed) { // one observer per box, whichever plot it holds now
    new ResizeObserver(() => element.clientWidth && element.plot.setSize({ width: element.clientWidth, height: 220 })).observe(element);
    element.observed = true;
  }
  const show = (xs, ys) => { element.classList.toggle("empty", ys.every((v) => v == null)); plot.setData([xs, ys]); };
  return { plot, marks, show };
}

// Each step's records as chart points: by time, or by step (counted from 1). A new segment (the next attempt or
// execution, or a recovery: at ``breaks``, their times) starts after a break, wherever it resumes, even past
// the last step shown; by step, the last record of a step (a step run again after a restart) is the one shown.
function chartPoints(steps, byStep, breaks = []) {
  let segment = 0;
  const tagged = steps.map((s, i) => {
    const before = steps[i - 1];
    if (before && (s.execution !== before.execution || s.step <= before.step ||
        breaks.some((t) => before.ts < t && t <= s.ts))) segment += 1;
    return { ...s, x: byStep ? s.step + 1 : s.ts, segment };
  });
  const shown = byStep ? [...new Map(tagged.map((p) => [p.x, p])).values()].sort((a, b) => a.x - b.x) : tagged;
  const points = [];
  shown.forEach((p, i) => {
    const before = shown[i - 1];
    if (before && before.segment !== p.segment) points.push({ x: (before.x + p.x) / 2 }); // the break
    points.push(p);
  });
  return points;
}

// When training resumed: a restart's new attempt, or a recovery in process.
const resumptions = (marks) => marks.filter((m) => m.kind === "restart" || m.kind === "recovery").map((m) => m.ts);

// Where each mark falls on a chart: its time, or the step of the first record at or after it.
function markPositions(marks, steps, byStep) {
  const at = (ts) => {
    if (!byStep) return ts;
    const next = steps.find((s) => s.ts >= ts);
    return next ? next.step + 1 : null;
  };
  return Object.fromEntries(MARKS.map(([kind]) => [kind, marks.filter((m) => m.kind === kind).map((m) => at(m.ts)).filter((v) => v != null)]));
}

function jobPage(id) {
  main.innerHTML = `
    <h1>Job <span id="job-id">${esc(id)}</span> <span id="job-state"></span></h1>
    <p id="job-reason" class="why"></p>
    <div id="summary" class="card"></div>
    <div class="toolbar"><div class="bar" style="width:20em"><span id="job-bar"></span></div><span id="job-progress"></span>
      <span id="job-speed"></span><button id="cancel">Cancel</button></div>
    <div class="toolbar"><label><input id="time-axis" type="checkbox"> against time (else the step)</label></div>
    <div class="charts"><div id="chart-loss"></div><div id="chart-tokens"></div><div id="chart-mfu"></div>
      <div id="chart-step"></div><div id="chart-memory"></div></div>
    <p class="legend">${MARKS.map(([kind, text, color]) => `<span data-mark="${kind}"><i style="background:${color}"></i>${text}</span>`).join("")}</p>
    <h2>Ranks</h2><table id="per-rank"><thead><tr><th>rank</th><th>node</th><th>steps done</th><th>peak memory</th><th></th>
      <th>GPU busy</th></tr></thead><tbody><tr><td colspan="6" class="why">no heartbeat yet</td></tr></tbody></table>
    <h2>Goodput</h2><div id="goodput"></div>
    <h2>Restarts</h2><ol id="restarts"></ol>
    <h2>Timeline</h2><table id="timeline"><tbody></tbody></table>
    <h2>Checkpoints</h2><table id="checkpoints"><tbody><tr><td class="why">reading...</td></tr></tbody></table>
    <h2>Logs</h2>
    <div class="toolbar"><label>rank <select id="rank"></select></label><label><input id="follow" type="checkbox" checked> follow</label>
      <input id="log-search" placeholder="show lines with..." size="24"><button id="log-download">Download</button></div>
    <pre id="log"></pre>
    <details><summary>The resolved spec</summary><pre id="spec"></pre></details>
    <h2>Stack dumps</h2><div id="stacks"><p class="why">none: dumped when a rank is found hung</p></div>`;
  const short = (v) => Number(v.toPrecision(3)).toString(); // a y label with no more digits than it needs
  const bytes = (v) => (v >= 2 ** 30 ? `${short(v / 2 ** 30)} GiB` : `${short(v / 2 ** 20)} MiB`);
  let charts = null, shown = null;
  const makeCharts = (byStep) => {
    charts = {
      loss: chart($("#chart-loss"), "loss", "loss", short, undefined, byStep),
      tokens_per_s: chart($("#chart-tokens"), "tokens/s", "tokens/s", (v) => num(v), undefined, byStep),
      mfu: chart($("#chart-mfu"), "MFU", "MFU", (v) => pct(v), "none reported: the device's peak FLOPs are not known (a CPU)", byStep),
      step_time_s: chart($("#chart-step"), "step time", "s", (v) => `${short(v)} s`, undefined, byStep),
      peak_memory_bytes: chart($("#chart-memory"), "peak memory", "memory", bytes, undefined, byStep),
    };
    if (shown) drawCharts(shown);
  };
  const drawCharts = (d) => {
    shown = d;
    const byStep = !$("#time-axis").checked;
    const points = chartPoints(d.steps, byStep, resumptions(d.marks));
    const marks = markPositions(d.marks, d.steps, byStep);
    for (const [key, c] of Object.entries(charts)) {
      Object.assign(c.marks, marks);
      c.show(points.map((p) => p.x), points.map((p) => p[key] ?? null));
    }
  };
  makeCharts(true);
  $("#time-axis").onchange = (e) => makeCharts(!e.target.checked);
  $("#cancel").onclick = () => api(`/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" }).catch((e) => alert(e.message));
  const log = { rank: null, offset: 0, execution: null, text: "" };
  const showLog = () => { // the lines that have the searched text, or all of it
    const pre = $("#log"), wanted = $("#log-search").value;
    pre.textContent = wanted ? log.text.split("\n").filter((line) => line.includes(wanted)).join("\n") : log.text;
    pre.scrollTop = pre.scrollHeight;
  };
  const readLog = async () => {
    if (log.rank == null || !$("#follow").checked) return;
    const chunk = await api(`/jobs/${encodeURIComponent(id)}/logs?rank=${log.rank}&offset=${log.offset}`);
    if (chunk.execution !== log.execution) { log.text = ""; log.execution = chunk.execution; }
    log.offset = chunk.next_offset;
    if (chunk.text) { log.text += chunk.text; showLog(); }
  };
  $("#rank").onchange = (e) => { log.rank = Number(e.target.value); log.offset = 0; log.text = ""; showLog(); readLog(); };
  $("#log-search").oninput = showLog;
  $("#log-download").onclick = async () => { // the whole log of the rank, not only what was shown
    let text = "", offset = 0, chunk;
    do {
      chunk = await api(`/jobs/${encodeURIComponent(id)}/logs?rank=${log.rank ?? 0}&offset=${offset}`);
      text += chunk.text; offset = chunk.next_offset;
    } while (chunk.text && offset < chunk.size);
    const a = Object.assign(document.createElement("a"), {
      href: URL.createObjectURL(new Blob([text], { type: "text/plain" })), download: `${id}-rank-${log.rank ?? 0}.log`,
    });
    a.click(); URL.revokeObjectURL(a.href);
  };
  const readCheckpoints = async () => { // each with its verification: read on opening and once the job ended
    const found = await api(`/jobs/${encodeURIComponent(id)}/checkpoints`);
    $("#checkpoints tbody").innerHTML = found.map((c) => `<tr data-step="${c.step}"><td data-label="step">${c.step}</td>
      <td data-label="size">${(c.bytes / 2 ** 20).toFixed(1)} MiB</td><td data-label="verified">${c.problem ? `<span class="error">${esc(c.problem)}</span>` : "ok"}</td>
      <td data-label="where" class="why">${esc(c.location)}</td></tr>`).join("") || "<tr><td class=\"why\">none yet</td></tr>";
  };
  readCheckpoints().catch(() => {});
  let ended = false;
  follow = setInterval(() => readLog().catch(() => {}), 1000);

  live("job", id, (d) => {
    const j = d.job;
    $("#job-state").textContent = j.state;
    $("#job-state").className = `state state-${j.state}`;
    $("#job-reason").textContent = j.reason;
    $("#job-bar").style.width = `${100 * (j.progress || 0)}%`;
    $("#job-progress").textContent = j.steps_done == null ? "no step yet" :
      `step ${j.steps_done}${j.total_steps ? ` of ${j.total_steps} (${pct(j.progress)})` : ""}${j.eta_s ? `, ETA ${duration(j.eta_s)}` : ""}`;
    $("#job-speed").textContent = [j.tokens_per_s && `${num(j.tokens_per_s)} tokens/s`, j.mfu && `MFU ${pct(j.mfu)}`,
      j.goodput != null && `goodput ${pct(j.goodput)}`].filter(Boolean).join(" · ");
    $("#cancel").hidden = d.final;
    if (d.final && !ended) { ended = true; readCheckpoints().catch(() => {}); }
    if (!$("#spec").textContent) $("#spec").textContent = d.spec;
    const s = d.summary;
    $("#summary").innerHTML = [
      ["outcome", esc(s.outcome)], ["steps", j.steps_done == null ? "none yet" : `${j.steps_done}${j.total_steps ? ` of ${j.total_steps}` : ""}`],
      ["last loss", s.last_loss == null ? "-" : s.last_loss.toFixed(4)], ["runtime", duration(s.runtime_s) || "-"],
      ["tokens", num(s.tokens) || "-"], ["goodput", pct(d.goodput.goodput) || "-"], ["restarts", String(j.restarts)],
      ...(s.data ? [["data fetched", `${bytes(s.data.fetched_bytes)}, waited ${duration(s.data.wait_s)}`],
        ["cache hits", pct(s.data.hit_rate)]] : []),
    ].map(([k, v]) => `<div data-field="${k}"><span>${k}</span><b>${v}</b></div>`).join("");
    drawCharts(d);
    const most = Math.max(1, ...d.per_rank.map((r) => r.peak_memory_bytes ?? 0)); // the bars: against the largest
    if (d.per_rank.length) $("#per-rank tbody").innerHTML = d.per_rank.map((r) => `<tr data-rank="${r.rank}">
      <td data-label="rank">${r.rank}</td><td data-label="node">${r.node}</td><td data-label="steps done">${r.step == null ? "-" : r.step + 1}</td>
      <td data-label="peak memory">${r.peak_memory_bytes == null ? "-" : bytes(r.peak_memory_bytes)}</td>
      <td data-label="against the largest"><div class="bar" style="width:10em"><span style="width:${(100 * (r.peak_memory_bytes ?? 0)) / most}%"></span></div></td>
      <td data-label="GPU busy">${r.gpu_util == null ? "no GPU" : `${num(r.gpu_util)}%`}</td></tr>`).join("");
    const g = d.goodput;
    $("#goodput").innerHTML = `<div class="goodput">${Object.entries(g.seconds).map(([k, s]) =>
      `<span data-category="${k}" style="width:${g.wall_s ? (100 * s) / g.wall_s : 0}%;background:${GOODPUT[k]}" title="${k} ${s.toFixed(1)} s"></span>`).join("")}</div>
      <p class="legend">${Object.entries(g.seconds).map(([k, s]) => `<span><i style="background:${GOODPUT[k]}"></i>${k} ${duration(s)}</span>`).join("")}
      of ${duration(g.wall_s)}: goodput ${pct(g.goodput)}</p>`;
    $("#restarts").innerHTML = d.restarts.length ? d.restarts.map((r) =>
      `<li data-cause="${esc(r.cause)}"><b>${esc(r.cause)}</b> (execution ${r.execution}, ${when(r.ts)}): ${esc(r.reason)}</li>`).join("")
      : "<li class=\"why\">none</li>";
    $("#timeline tbody").innerHTML = d.timeline.map((e) =>
      `<tr><td>${when(e.ts)}</td><td>${esc(e.kind)}</td><td class="why">${esc(e.text)}</td></tr>`).join("");
    const ranks = d.ranks.map(String);
    const shown = [...$("#rank").options].map((o) => o.value);
    if (ranks.join() !== shown.join()) {
      $("#rank").innerHTML = ranks.map((r) => `<option>${r}</option>`).join("");
      if (log.rank == null && ranks.length) { log.rank = Number(ranks[0]); readLog(); }
    }
    const stacks = Object.entries(d.stacks);
    if (stacks.length) $("#stacks").innerHTML = stacks.map(([r, text]) => `<h3>rank ${esc(r)}</h3><pre>${esc(text)}</pre>`).join("");
  });
}

// --- runs side by side: the loss of several jobs against the step, one line each
const COLOURS = ["#4c6ef5", "#e8590c", "#2b8a3e", "#ae3ec9", "#1098ad", "#f59f00", "#c92a2a", "#495057"];

function comparePage(ids) {
  main.innerHTML = `<h1>Loss, side by side</h1><p class="why">${ids.map((id, i) =>
    `<span class="legend"><i style="background:${COLOURS[i % COLOURS.length]}"></i><a href="#/jobs/${esc(id)}">${esc(id)}</a></span>`).join(" ")}</p>
    <div id="chart-compare" class="chart"></div><p id="compare-error" class="error"></p>`;
  const element = $("#chart-compare");
  const plot = new uPlot({
    title: "loss", width: element.clientWidth || 380, height: 320, scales: { x: { time: false } },
    series: [{ label: "step", value: (u, v) => (v == null ? "" : `step ${v}`) },
      ...ids.map((id, i) => ({ label: id, stroke: COLOURS[i % COLOURS.length], width: 1.5, spanGaps: false }))],
    axes: [{ label: "step" }, { values: (u, ticks) => ticks.map((v) => Number(v.toPrecision(3)).toString()), size: 70 }],
  }, [[], ...ids.map(() => [])], element);
  element.plot = plot;
  new ResizeObserver(() => element.clientWidth && plot.setSize({ width: element.clientWidth, height: 320 })).observe(element);
  const refresh = async () => {
    const views = await Promise.all(ids.map((id) => api(`/dashboard/jobs/${encodeURIComponent(id)}`)));
    const lines = views.map((v) => {
      const points = chartPoints(v.steps, true, resumptions(v.marks));
      return [points.map((p) => p.x), points.map((p) => p.loss ?? null)];
    });
    plot.setData(uPlot.join(lines));
  };
  const again = () => refresh().catch((e) => { $("#compare-error").textContent = e.message; });
  again();
  follow = setInterval(again, 5000);
}

// --- the fleet
function fleetPage() {
  main.innerHTML = `
    <h1>Fleet</h1><p id="capacity"></p>
    <h2>${unit} by tenant</h2>
    <table id="tenants"><thead><tr><th>tenant</th><th>in use / quota</th><th></th><th>borrowing limit</th><th>preemptions</th></tr></thead><tbody></tbody></table>
    <h2>Queue</h2>
    <table id="queue"><thead><tr><th>job</th><th>tenant</th><th>${unit}</th><th>priority</th><th>waiting</th><th>why</th></tr></thead><tbody></tbody></table>
    <h2>Utilisation, last 24 hours</h2><div id="chart-utilisation"></div>
    <h2>Spend this month</h2><p id="spend-total"></p>
    <table id="spend"><thead><tr><th>tenant</th><th>spent</th><th>monthly budget</th><th></th><th>now</th></tr></thead><tbody></tbody></table>
    <h2>Speed per GPU type</h2><p class="why">tokens/s per GPU of each kind of job: measured (*) on its runs, estimated elsewhere; a kind not yet measured, as a share of its fastest type; each job goes where it runs fastest</p>
    <table id="speeds"><thead></thead><tbody></tbody></table>`;
  const used = chart($("#chart-utilisation"), `${unit} allocated, the most in each 12 minutes`, unit, (v) => num(v, 1),
    "no execution in the last 24 hours", false);
  live("fleet", null, (d) => {
    const inUse = d.tenants.reduce((sum, t) => sum + t.gpus_in_use, 0);
    $("#capacity").textContent = `${inUse} of ${d.capacity} ${unit} in use; ${d.queue.length} job(s) waiting`;
    $("#tenants tbody").innerHTML = d.tenants.map((t) => {
      const scale = Math.max(d.capacity, t.gpus_in_use, 1); // against the whole cluster
      return `<tr data-tenant="${esc(t.name)}"><td data-label="tenant">${esc(t.name)}</td><td data-label="in use / quota">${t.gpus_in_use} / ${t.nominal_gpus}</td>
        <td data-label="share of the cluster"><div class="bar" style="width:16em"><span style="width:${(100 * t.gpus_in_use) / scale}%"></span>
          <span class="quota" style="width:${(100 * t.nominal_gpus) / scale}%"></span>
          ${t.borrowing_limit != null ? `<span class="borrow" style="width:${(100 * (t.nominal_gpus + t.borrowing_limit)) / scale}%"></span>` : ""}</div></td>
        <td data-label="borrowing limit">${t.cohort == null ? "none (no cohort)" : t.borrowing_limit ?? `any idle in ${esc(t.cohort)}`}</td>
        <td data-label="preemptions">${t.preemptions}</td></tr>`;
    }).join("");
    $("#queue tbody").innerHTML = d.queue.map((q) => `<tr data-job="${esc(q.id)}"><td data-label="job"><a href="#/jobs/${esc(q.id)}">${esc(q.id)}</a></td>
      <td data-label="tenant">${esc(q.tenant)}</td><td data-label="${unit}">${q.gpus}</td><td data-label="priority">${q.priority}</td>
      <td data-label="waiting">${duration(q.waiting_s)}</td><td data-label="why" class="why">${esc(q.why)}</td></tr>`).join("")
      || "<tr><td colspan=\"6\" class=\"why\">nothing waits</td></tr>";
    used.show(d.utilisation.ts, d.utilisation.max);
    const money = (v) => `$${num(v, 2)}`;
    const spend = d.spend;
    $("#spend-total").textContent = `${money(spend.dollars)} spent of ${money(spend.budgets)} budgeted; ${money(spend.dollars_per_h)} an hour now`;
    $("#spend tbody").innerHTML = spend.tenants.map((t) => `<tr data-tenant="${esc(t.tenant)}"><td data-label="tenant">${esc(t.tenant)}</td>
      <td data-label="spent">${money(t.dollars)}</td><td data-label="monthly budget">${t.monthly_budget == null ? "none" : money(t.monthly_budget)}</td>
      <td data-label="share of the budget">${t.monthly_budget ? `<div class="bar" style="width:12em"><span style="width:${Math.min(100, (100 * t.dollars) / t.monthly_budget)}%"></span></div>` : ""}
        ${t.over_budget ? "<span class=\"why\">over budget: new jobs wait</span>" : ""}</td>
      <td data-label="now">${money(t.dollars_per_h)}/h</td></tr>`).join("");
    const speeds = d.speeds;
    $("#speeds thead").innerHTML = `<tr><th>kind</th>${speeds.types.map((t) => `<th>${esc(t)}</th>`).join("")}</tr>`;
    $("#speeds tbody").innerHTML = speeds.kinds.map((k) => `<tr data-kind="${esc(k.kind)}"><td data-label="kind">${esc(k.kind)}</td>
      ${speeds.types.map((t) => `<td data-label="${esc(t)}"${t === k.fastest ? " class=\"fastest\"" : ""}>${k.measured.length ? num(k.tokens_per_gpu_s[t], 1) : `${num(k.relative[t], 2)}x`}${k.measured.includes(t) ? "*" : ""}</td>`).join("")}</tr>`).join("")
      || `<tr><td colspan="${speeds.types.length + 1}" class="why">no jobs yet</td></tr>`;
  });
}

// --- routing: #/jobs, #/jobs/ID, #/compare/ID,ID,..., #/fleet
let routing = 0; // the latest route's number: one overtaken while it waited for the server draws nothing
async function route() {
  const mine = ++routing;
  stopPage();
  if (!token) return loginPage();
  try {
    await whoami();
  } catch {
    return mine === routing && logout();
  }
  if (mine !== routing) return; // a newer route draws the page: drawing it twice would wipe what was typed
  const [, page, id] = location.hash.split("/");
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.id === `nav-${page}`);
  if (page === "fleet") fleetPage();
  else if (page === "compare" && id) comparePage(id.split(",").map(decodeURIComponent));
  else if (page === "jobs" && id) jobPage(decodeURIComponent(id));
  else jobsPage();
}

$("#logout").onclick = logout;
window.addEventListener("hashchange", route);
route();
